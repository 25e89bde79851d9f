"""Held-out evaluation (``rllib/heldout.py``) without an Algorithm: the real held-out
questions of the arithmetic set and RLlib's metrics logger; the sampling call (the env
runner fleet in a run) answers with episodes whose reward says whether the question's id
is in a "solved" set."""

import pytest
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from rllib_exgrpo import ExGRPOConfig
from rllib_exgrpo.rllib.heldout import HeldoutEvaluator, heldout_env_config, heldout_question_ids


def _config(**training):
    return ExGRPOConfig().training(heldout_dataset="arithmetic", heldout_num_questions=6, **training)


def _episode(reward: float) -> SingleAgentEpisode:
    episode = SingleAgentEpisode()
    episode.add_env_reset(observation=0)
    episode.add_env_step(observation=1, action=0, reward=reward, terminated=True)
    return episode


class Sampler:
    def __init__(self, solved):
        self.solved = set(solved)
        self.calls = []

    def __call__(self, question_ids, num_samples, **kwargs):
        self.calls.append((list(question_ids), list(num_samples), kwargs))
        return [_episode(1.0 if q in self.solved else 0.0) for q, n in zip(question_ids, num_samples) for _ in range(n)], []


def test_heldout_questions_come_from_the_heldout_split():
    cfg = _config()
    assert heldout_env_config(cfg)["split"] == "test" and heldout_env_config(cfg)["dataset"] == "arithmetic"
    ids = heldout_question_ids(cfg)
    assert len(ids) == 6 and len(set(ids)) == 6
    assert heldout_question_ids(ExGRPOConfig()) is None


def test_accuracy_is_avg_at_k_with_the_heldout_settings_and_is_logged():
    cfg = _config(heldout_samples=2, heldout_temperature=0.0, heldout_max_response_tokens=7)
    ids = heldout_question_ids(cfg)
    sampler = Sampler(ids[:3])
    evaluator = HeldoutEvaluator(cfg, sampler, question_ids=ids)
    result = evaluator.evaluate()
    assert result == {"accuracy": 0.5, "num_questions": 6, "samples_per_question": 2}
    ((qs, ns, kwargs),) = sampler.calls
    assert qs == ids and ns == [2] * 6
    assert kwargs == {"heldout": True, "temperature": 0.0, "max_new_tokens": 7, "return_logprobs": False}
    logger = MetricsLogger()
    evaluator.record(logger, result, after_iteration=0)
    evaluator.record(logger, {**result, "accuracy": 0.75}, after_iteration=10)
    assert logger.peek(("heldout", "accuracy")) == 0.75 and logger.peek(("heldout", "after_iteration")) == 10
    assert evaluator.initial_accuracy == 0.5 and logger.peek(("heldout", "initial_accuracy")) == 0.5


def test_evaluations_are_due_at_the_start_and_every_interval():
    evaluator = HeldoutEvaluator(_config(heldout_interval=3), Sampler([]), question_ids=["q1"])
    assert [n for n in range(8) if evaluator.due(n)] == [0, 3, 6]
    never = HeldoutEvaluator(_config(heldout_interval=0), Sampler([]), question_ids=["q1"])
    assert [n for n in range(5) if never.due(n)] == [0]
    without = HeldoutEvaluator(ExGRPOConfig(), Sampler([]))
    assert not without.enabled and not without.due(0)
    with pytest.raises(ValueError, match="no held-out set"):
        without.evaluate()
