"""Colocated vLLM engines on data-parallel learners (marked ``vllm``, ``slow``).

With DDP (or DeepSpeed) learners torch.distributed is initialised in every learner process,
and vLLM 0.32 then builds each engine's groups over the learners' world: a collective
(``rllib/colocation.py``: ``engine_build_is_collective``). With one question per step one
of the two learners has none to sample, and still builds its engine in the same step as
the other (``ColocatedSampler.take_part``): the run trains 3 iterations instead of hanging
in the other learner's engine build.
"""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("ray_local")
def test_two_ddp_learners_with_one_question_per_step_train_three_iterations(quick_tiny_model):
    pytest.importorskip("vllm", reason="vllm not installed (bash tests/run.sh vllm)")
    from rllib_exgrpo.cli.rehearsal import VLLM_CPU_KWARGS
    from rllib_exgrpo.rllib.algorithm import GRPOConfig

    cfg = (
        GRPOConfig()
        .environment(env_config={"dataset": "arithmetic"})
        .training(
            model_name_or_path=quick_tiny_model,
            questions_per_step=1,
            group_size=4,
            max_prompt_tokens=96,
            max_response_tokens=8,
            minibatch_size=4,
            loss_agg_mode="token-mean",
            lr=1e-3,
            colocate=True,
            generation_backend="vllm",
            behaviour_logprobs="engine",
            generation_batch_size=8,
            vllm_kwargs=dict(VLLM_CPU_KWARGS),
        )
        .env_runners(num_env_runners=0)
        .learners(num_learners=2, num_cpus_per_learner=0.5)
    )
    algo = cfg.build_algo()
    try:
        for i in range(3):
            result = algo.train()
            assert result["training_iteration"] == i + 1
            assert result["env_runners"]["num_episodes"] == 4  # one question, sampled by one learner
            assert np.isfinite(result["learners"]["default_policy"]["total_loss"])
        built = [r.get() for r in algo.learner_group.foreach_learner(lambda learner: learner.colocated_sampler().backend.llm is not None)]
        assert built == [True, True]  # the learner without questions built its engine too
    finally:
        algo.stop()
