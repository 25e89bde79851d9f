"""The supported combinations of docs/support_matrix.md run as a whole: each trains one
iteration as the table lays it out (2 learners, 1 env runner or none when colocated) on the
tiny model, with HF or vLLM's CPU build (those marked ``vllm``, run in its virtualenv by
tests/run.sh). Which combinations: ``support_matrix.pairwise_combinations()``, every pair of
switch values the table accepts together at least once (12 of the 60: each costs 15-45 s of a
2-core machine, an actor start per learner and runner, all 60 about 15 minutes of CI).

One iteration at the smallest batch that still gives each learner a minibatch: 4 questions
x G=4 = 16 completions, one optimiser step of 8 rows on each learner. What is checked is
what the switches decide, read from the result: the rows were sampled, both learners took
their step (a finite loss, the optimiser step counted), scoring happened where
``scoring_on`` puts it, LoRA trained only its adapters, async sampling ran ahead.
"""

from __future__ import annotations

import math

import pytest

from rllib_exgrpo.cli.rehearsal import VLLM_CPU_KWARGS
from rllib_exgrpo.rllib import support_matrix
from rllib_exgrpo.rllib.algorithm import ExGRPOConfig


def _by_value():
    """The probe below runs on remote learners, where this test module is not importable."""
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


_by_value()

RUN_WHOLE = support_matrix.pairwise_combinations()


def _cell_id(combo) -> str:
    return "-".join(
        [
            combo["generation_backend"],
            "colocated" if combo["colocate"] else "runner",
            combo["learner"],
            f"lora{combo['lora_rank']}",
            f"scoring-{combo['scoring_on']}",
            "async" if combo["async_rollouts"] else "sync",
        ]
    )


def _params():
    out = []
    for combo in RUN_WHOLE:
        marks = [pytest.mark.slow] + ([pytest.mark.vllm] if combo["generation_backend"] == "vllm" else [])
        out.append(pytest.param(combo, marks=marks, id=_cell_id(combo)))
    return out


def cell_config(combo, model: str) -> ExGRPOConfig:
    """The combination at the table's layout with CPU shares and a one-step batch."""
    training = dict(
        support_matrix.training_kwargs(combo),
        model_name_or_path=model,
        questions_per_step=4,
        group_size=4,
        max_prompt_tokens=96,
        max_response_tokens=6,
        minibatch_size=8,
        delayed_start_solve_rate=0.0,
        lr=1e-3,
    )
    if combo["generation_backend"] == "vllm":
        training.update(generation_batch_size=16, vllm_kwargs=dict(VLLM_CPU_KWARGS))
    return (
        ExGRPOConfig()
        .environment(env_config={"dataset": "arithmetic"})
        .training(**training)
        .env_runners(num_env_runners=0 if combo["colocate"] else 1)
        .learners(num_learners=2, num_cpus_per_learner=0.5)
        .debugging(seed=0)
    )


def _trainable_fraction(learner) -> float:
    """The share of the learner's parameters the optimiser trains (ZeRO-3 counts a
    partitioned parameter by its full size)."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    params = list(learner.module[DEFAULT_MODULE_ID].unwrapped().model.parameters())
    size = [getattr(p, "ds_numel", p.numel()) for p in params]
    return sum(n for n, p in zip(size, params) if p.requires_grad) / sum(size)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("combo", _params())
def test_the_pairwise_combinations_train_one_iteration(combo, quick_tiny_model):
    if combo["learner"] != "ddp":
        pytest.importorskip("deepspeed")
    if combo["generation_backend"] == "vllm":
        pytest.importorskip("vllm", reason="vllm not installed (bash tests/run.sh vllm)")
    algo = cell_config(combo, quick_tiny_model).build_algo()
    try:
        result = algo.train()
        trainable = [r.get() for r in algo.learner_group.foreach_learner(_trainable_fraction)]
    finally:
        algo.stop()
    # 16 completions sampled and trained on (async: and the next step's 16 sampled ahead).
    assert result["training_iteration"] == 1 and result["num_completions"] == (32 if combo["async_rollouts"] else 16), result
    learner = result["learners"]["default_policy"]
    assert math.isfinite(learner["policy_loss"]), learner
    assert result["optimizer_steps"] == 1, result["optimizer_steps"]
    assert len(trainable) == 2
    if combo["lora_rank"]:
        assert all(0 < f < 0.5 for f in trainable), trainable  # the adapters only
    else:
        assert all(f == 1.0 for f in trainable), trainable
    scored_on_learners = result.get("learner_scored_completions", 0)
    assert scored_on_learners == (16 if combo["scoring_on"] == "learners" else 0), scored_on_learners
    if combo["async_rollouts"]:
        assert "async_batch_staleness" in result, sorted(result)
