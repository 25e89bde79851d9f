"""The rollout coordinator (``rllib/rollouts.py``) without an Algorithm: a fleet of runners
that can die mid-call stands in for RLlib's ``EnvRunnerGroup`` of Ray actors; the metrics
logger is RLlib's own."""

import numpy as np
import pytest
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from rllib_exgrpo.rllib.rollouts import RolloutCoordinator, score_on_learners, split_evenly


def _episode(question_id: str) -> SingleAgentEpisode:
    episode = SingleAgentEpisode()
    episode.add_env_reset(observation=0, infos={"question_id": question_id})
    episode.add_env_step(observation=1, action=0, reward=1.0, terminated=True)
    return episode


class Runner:
    def __init__(self, worker_index: int, dies: int = 0):
        self.worker_index = worker_index
        self.dies = dies  # calls left that die
        self.sampled = []

    def sample(self, question_ids, num_samples, prompt_prefixes, **kwargs):
        self.sampled += list(question_ids)
        return [_episode(q) for q, n in zip(question_ids, num_samples) for _ in range(n)]

    def get_metrics(self):
        return {"runner": self.worker_index}

    def score_trajectories(self, prompts, completions):
        return [np.full(len(c), -float(self.worker_index)) for c in completions], [0.5] * len(completions)


class Fleet:
    """``EnvRunnerGroup``'s calls the coordinator makes; a runner with ``dies > 0`` returns
    nothing for that call (as RLlib's group does for a dead actor) until restored."""

    def __init__(self, runners, local=None):
        self.runners = {r.worker_index: r for r in runners}
        self.local_env_runner = local or Runner(0)
        self.dead = set()

    def num_remote_workers(self):
        return len(self.runners)

    def healthy_worker_ids(self):
        return [w for w in self.runners if w not in self.dead]

    def foreach_env_runner(self, funcs, remote_worker_ids, local_env_runner=False):
        out = []
        for wid, func in zip(remote_worker_ids, funcs):
            runner = self.runners[wid]
            if runner.dies > 0:
                runner.dies -= 1
                self.dead.add(wid)
                continue
            out.append(func(runner))
        return out

    def restore(self):
        self.dead.clear()


def test_split_evenly_keeps_order_and_every_item():
    assert split_evenly(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert split_evenly([1], 3) == [[1], [], []]
    assert split_evenly([], 0) == []


def test_sampling_spreads_questions_and_keeps_groups_whole():
    fleet = Fleet([Runner(1), Runner(2)])
    coordinator = RolloutCoordinator(fleet, MetricsLogger(), fleet.restore)
    episodes, metrics = coordinator.sample(["a", "b", "c"], [2, 2, 3])
    assert len(episodes) == 7 and sorted(m["runner"] for m in metrics) == [1, 2]
    assert fleet.runners[1].sampled == ["a", "b"] and fleet.runners[2].sampled == ["c"]


def test_a_dead_runner_is_restored_and_its_questions_sampled_once_more():
    fleet = Fleet([Runner(1, dies=1), Runner(2)])
    logger = MetricsLogger()
    coordinator = RolloutCoordinator(fleet, logger, fleet.restore)
    episodes, _ = coordinator.sample(["a", "b", "c", "d"], [1, 1, 1, 1])
    got = sorted(e.get_infos()[0]["question_id"] for e in episodes)
    assert got == ["a", "b", "c", "d"]  # nothing lost, nothing twice
    assert logger.peek("env_runner_failures") == 1 and logger.peek("resampled_questions") == 2


def test_runners_that_keep_dying_end_the_step_with_a_clear_error():
    fleet = Fleet([Runner(1, dies=10)])
    coordinator = RolloutCoordinator(fleet, MetricsLogger(), fleet.restore, attempts=2)
    with pytest.raises(RuntimeError, match="1 question\\(s\\) still unsampled after 2 attempts"):
        coordinator.sample(["a"], [2])


def test_without_remote_runners_the_local_one_samples_and_scores():
    local = Runner(0)
    fleet = Fleet([], local=local)
    logger = MetricsLogger()
    coordinator = RolloutCoordinator(fleet, logger, fleet.restore)
    episodes, metrics = coordinator.sample(["a"], [3])
    assert len(episodes) == 3 and metrics == [{"runner": 0}] and local.sampled == ["a"]
    coordinator.score_on_runners([[1, 2]], [[3]])
    assert logger.peek(("experience", "replay_scoring_runners")) == 0


def test_replay_scoring_shards_over_runners_and_a_dead_runners_shard_is_scored_locally():
    fleet = Fleet([Runner(1), Runner(2, dies=1)], local=Runner(9))
    logger = MetricsLogger()
    coordinator = RolloutCoordinator(fleet, logger, fleet.restore)
    prompts = [[1] * 5, [1] * 50, [1] * 6, [1] * 52]
    completions = [[2] * 3, [2] * 4, [2] * 5, [2] * 6]
    logps, entropies = coordinator.score_on_runners(prompts, completions)
    assert [len(lp) for lp in logps] == [3, 4, 5, 6]  # row order kept
    assert {float(lp[0]) for lp in logps} == {-1.0, -9.0}  # runner 2's shard went to the local runner
    assert entropies == [0.5] * 4
    assert logger.peek(("experience", "replay_scoring_runners")) == 1


class _Result:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class Learners:
    """Two learners, each scoring every other row (``ExGRPOTorchLearner.score_rows``'s reply)."""

    def foreach_learner(self, func):
        out = []
        for rank in range(2):
            learner = type(
                "L",
                (),
                {
                    "score_rows": lambda self, p, c, pad, rank=rank: (
                        list(range(rank, len(p), 2)),
                        [np.asarray(c[i], dtype=np.float32) * 0 - i for i in range(rank, len(p), 2)],
                        [float(i) for i in range(rank, len(p), 2)],
                    )
                },
            )()
            out.append(_Result(func(learner)))
        return out


def test_scoring_on_learners_puts_rows_back_in_order():
    logps, entropies = score_on_learners(Learners(), [[1], [1], [1]], [[2, 2], [2], [2, 2, 2]], pad_id=0)
    assert [lp.tolist() for lp in logps] == [[0, 0], [-1], [-2, -2, -2]] and entropies == [0.0, 1.0, 2.0]
    assert score_on_learners(Learners(), [], [], pad_id=0) == ([], [])
