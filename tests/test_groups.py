"""Grouping, advantages and the learner batch layout, on hand-made trajectories."""

import numpy as np

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.groups import Trajectory, learner_batch, score_groups


def traj(qid, reward, prompt=(5, 6), completion=(7, 8, 9), replayed=False, seeded=False):
    return Trajectory(
        question_id=qid,
        prompt_ids=np.asarray(prompt),
        completion_ids=np.asarray(completion),
        logp=np.full(len(completion), -0.5, dtype=np.float32),
        reward=float(reward),
        off_policy=replayed,
        seeded=seeded,
    )


def test_replayed_group_advantage_uses_all_rewards():
    # One replayed (correct) trajectory plus G - 1 = 3 fresh ones of question a.
    ts = [traj("a", 0), traj("b", 1), traj("a", 1, replayed=True), traj("a", 0), traj("a", 1), traj("b", 0)]
    g = score_groups(ts, estimator="mean_centered")
    assert g.question_ids == ["a", "b"]
    a_rows = [i for i, t in enumerate(g.trajectories) if t.question_id == "a"]
    assert len(a_rows) == 4
    # mean of a's rewards over all four (replayed included) = 0.5
    np.testing.assert_allclose(g.advantages[a_rows], [t.reward - 0.5 for t in (g.trajectories[i] for i in a_rows)])
    assert list(g.group_correct) == [2, 1]
    assert list(g.group_size) == [4, 2]
    assert not g.zero_variance.any()


def test_std_normalized_and_zero_variance():
    ts = [traj("a", 1), traj("a", 1), traj("b", 0), traj("b", 1), traj("b", 1), traj("b", 0)]
    g = score_groups(ts, estimator="std_normalized", eps=1e-6)
    assert list(g.zero_variance) == [True, False]
    np.testing.assert_allclose(g.advantages[:2], 0.0)
    std = np.std([0, 1, 1, 0], ddof=1)
    np.testing.assert_allclose(g.advantages[2:], (np.array([0, 1, 1, 0]) - 0.5) / (std + 1e-6), rtol=1e-5)


def test_learner_batch_layout():
    ts = [traj("a", 1, prompt=(1, 2, 3), completion=(4,)), traj("a", 0, prompt=(5,), completion=(6, 7, 8))]
    b = learner_batch(ts, np.array([0.5, -0.5]), pad_id=0)
    # prompts left-padded to 3, completions right-padded to 3
    assert b[C.INPUT_IDS].tolist() == [[1, 2, 3, 4, 0, 0], [0, 0, 5, 6, 7, 8]]
    assert b[C.ATTENTION_MASK].tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert b[C.RESPONSE_MASK].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert b[C.OLD_LOGP][0].tolist() == [-0.5, 0.0, 0.0]
    assert b[C.ADVANTAGES].tolist() == [0.5, -0.5]
    assert b[C.OFF_POLICY].tolist() == [0.0, 0.0]
