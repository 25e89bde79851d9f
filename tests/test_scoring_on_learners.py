"""``scoring_on: learners``: behaviour log-probs and replay entropies computed by the
learners, where the training weights are (verl's actor computes ``old_log_prob`` so).

* the config field is checked, and refused next to ``async_rollouts``;
* on the learners, a set of stored rows gets the numbers the runner's own module gives them
  (same weights after a sync, the same scoring function): one local learner, two DDP
  learners, and two DeepSpeed ZeRO-3 learners (each scores its share; a forward is a
  collective there, so they agree on the number of passes);
* a training iteration with it: every sampled completion is scored by the learners, and the
  first optimiser step's fresh-token ratio is 1 (the recorded log-probs are the weights'
  own), as with runner scoring.

The runner that then holds no torch module at all (vLLM) is tested in the vLLM venv
(``tests/test_vllm_backend.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from test_ddp import two_learner_config  # noqa: E402  (tests/ is on sys.path)

RATIO_TOL = 1e-4


def test_scoring_on_is_checked():
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    assert ExGRPOConfig().scoring_on == "runners"
    with pytest.raises(ValueError, match=r"scoring_on must be one of \['runners', 'learners'\]"):
        ExGRPOConfig().training(scoring_on="gpu").validate()
    with pytest.raises(ValueError, match="scoring_on: 'learners' does not go with async_rollouts"):
        (ExGRPOConfig().training(scoring_on="learners", async_rollouts=True).env_runners(num_env_runners=1).validate())


def _rows(algo, n=12):
    """Stored-trajectory-like rows: real prompts, sampled completions cut to different lengths."""
    runner = algo.env_runner_group.local_env_runner
    episodes = runner.sample(question_ids=[p.id for p in runner.env.problems[:n]], num_samples=1)
    return (
        [np.asarray(e.get_observations(0)) for e in episodes],
        [np.asarray(e.get_actions(0))[: 3 + i % 9] for i, e in enumerate(episodes)],
    )


def _assert_same_numbers(algo):
    runner = algo.env_runner_group.local_env_runner
    prompts, completions = _rows(algo)
    assert len({len(c) for c in completions}) > 1, "want completions of different lengths"
    want_lp, want_en = runner.score_trajectories(prompts, completions)
    got_lp, got_en = algo._score_trajectories(prompts, completions)  # replay choice's call
    for i, (a, b, c, d) in enumerate(zip(want_lp, got_lp, want_en, got_en)):
        assert a.shape == b.shape == c.shape == d.shape == (len(completions[i]),)
        np.testing.assert_allclose(b, a, atol=2e-5, err_msg=f"log-probs of row {i}")
        np.testing.assert_allclose(d, c, atol=2e-5, err_msg=f"entropies of row {i}")


def _train_scored_on_learners(algo, config) -> dict:
    """One iteration: every completion scored by the learners, first-step ratio 1."""
    result = algo.train()
    learner = result["learners"]["default_policy"]
    assert result["learner_scored_completions"] == config.completions_per_step
    assert abs(learner["ratio_max"] - 1.0) < RATIO_TOL and abs(learner["ratio_min"] - 1.0) < RATIO_TOL, learner
    return result


@pytest.mark.usefixtures("ray_local")
def test_learner_scores_equal_the_runner_module_and_an_iteration_trains(quick_tiny_model):
    """One local learner; the local runner samples (no remote runners)."""
    config = two_learner_config(quick_tiny_model, num_learners=0, scoring_on="learners", learner_micro_batch_tokens=256)
    algo = config.env_runners(num_env_runners=0).build_algo()
    try:
        _assert_same_numbers(algo)
        result = _train_scored_on_learners(algo, config)
        assert result["step_time_s"]["learner_scoring"] > 0
        assert algo.env_runner_group.local_env_runner.module is not None  # the HF backend generates with it
    finally:
        algo.stop()


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("backend", ["ddp", "deepspeed3"])
def test_two_learners_score_their_shares(quick_tiny_model, backend):
    from rllib_exgrpo.rllib.deepspeed_learner import deepspeed_importable

    extra = {}
    if backend == "deepspeed3":
        if not deepspeed_importable():
            pytest.skip("deepspeed is not importable (pip install 'rllib-exgrpo[deepspeed]')")
        extra = dict(
            learner_backend="deepspeed", deepspeed_zero_stage=3, deepspeed={"zero_optimization": {"stage3_param_persistence_threshold": 0}}
        )
    # A token budget that gives the two learners different numbers of passes.
    config = two_learner_config(quick_tiny_model, scoring_on="learners", learner_micro_batch_tokens=64, **extra)
    algo = config.env_runners(num_env_runners=0).build_algo()
    try:
        _assert_same_numbers(algo)
        _train_scored_on_learners(algo, config)
    finally:
        algo.stop()
