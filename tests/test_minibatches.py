"""Exact minibatching: every row once per epoch, groups shuffled, steps as documented."""
import numpy as np
import pytest

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.groups import Trajectory, learner_batch
from rllib_exgrpo.core.minibatches import num_minibatches, plan_minibatches, row_order, take_rows


def _groups(num_groups, size=8):
    return np.repeat(np.arange(num_groups), size)


@pytest.mark.parametrize("rows_per_group", [8, 7])
@pytest.mark.parametrize("num_learners", [1, 2, 4])
@pytest.mark.parametrize("shuffle", ["groups", "rows", "none"])
def test_every_row_in_exactly_one_minibatch_per_epoch(rows_per_group, num_learners, shuffle):
    # 32 groups of 8 (256 rows) and of 7 (224: unscored completions dropped); plus 4 extra
    # rows (in-context seeding): 260 rows, the case RLlib's cyclic iterator trained twice.
    gidx = np.concatenate([_groups(32, rows_per_group), [32, 32, 33, 33]])
    plan = plan_minibatches(
        gidx, minibatch_size=128 // num_learners, num_learners=num_learners, num_epochs=2,
        shuffle=shuffle, rng=np.random.default_rng(0),
    )
    assert len(plan) == 2
    for epoch in plan:
        rows = np.concatenate([part for step in epoch for part in step])
        assert sorted(rows.tolist()) == list(range(len(gidx)))
        for step in epoch:
            assert len(step) == num_learners
            sizes = [len(p) for p in step]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    # 260 or 228 rows, 128 per optimiser step (all learners together): 2 steps, not 3.
    assert len(plan[0]) == 2


def test_optimizer_steps_follow_rows_over_minibatch_times_learners():
    assert num_minibatches(256, 128, 1) == 2
    assert num_minibatches(256, 64, 2) == 2  # 2 learners x 64 rows per step
    assert num_minibatches(1024, 128, 4) == 2  # the official recipe on 4 learners
    assert num_minibatches(1024, 512, 1) == 2  # ... and on one
    assert num_minibatches(260, 128, 1) == 2
    assert num_minibatches(100, 128, 1) == 1
    assert num_minibatches(3, 1, 4) == 0 or plan_minibatches(
        np.arange(3), minibatch_size=1, num_learners=4, rng=np.random.default_rng(0)
    ) == []


def test_groups_shuffle_keeps_groups_whole_and_mixes_replayed_groups():
    # Fresh groups first, replayed last: the batch order the algorithm builds.
    gidx = _groups(32)
    replayed = gidx >= 16
    plan = plan_minibatches(gidx, minibatch_size=128, shuffle="groups", rng=np.random.default_rng(3))
    for (rows,) in plan[0]:
        # whole groups only
        groups, counts = np.unique(gidx[rows], return_counts=True)
        assert (counts == 8).all()
        # both fresh and replayed groups in every minibatch
        assert 0 < replayed[rows].sum() < len(rows)
    # in batch order every replayed row would sit in the second minibatch
    (first,), (second,) = plan_minibatches(gidx, minibatch_size=128, shuffle="none", rng=np.random.default_rng(3))[0]
    assert not replayed[first].any() and replayed[second].all()


def test_row_order_is_seeded():
    gidx = _groups(10)
    a = row_order(gidx, "groups", np.random.default_rng([0, 5, 11]))
    b = row_order(gidx, "groups", np.random.default_rng([0, 5, 11]))
    c = row_order(gidx, "groups", np.random.default_rng([0, 6, 11]))
    assert (a == b).all() and not (a == c).all()
    with pytest.raises(ValueError, match="minibatch_shuffle"):
        row_order(gidx, "sideways", np.random.default_rng(0))


def test_take_rows_drops_columns_that_are_padding_for_every_row():
    def traj(p, c):
        return Trajectory("q", np.arange(1, p + 1), np.arange(1, c + 1), np.full(c, -0.5, np.float32), 1.0)

    trajs = [traj(2, 3), traj(5, 1), traj(3, 6)]
    batch = learner_batch(trajs, np.zeros(3, np.float32), pad_id=0)
    assert batch[C.INPUT_IDS].shape == (3, 5 + 6)
    sub = take_rows(batch, np.array([0]))
    # row 0 alone: prompt 2 tokens, completion 3
    assert sub[C.INPUT_IDS].shape == (1, 5) and sub[C.RESPONSE_MASK].shape == (1, 3)
    assert sub[C.INPUT_IDS][0].tolist() == [1, 2, 1, 2, 3]
    assert sub[C.OLD_LOGP].shape == (1, 3) and sub[C.ADVANTAGES].shape == (1,)
    both = take_rows(batch, np.array([0, 1]))
    assert both[C.INPUT_IDS].shape == (2, 5 + 3)
    assert both[C.ATTENTION_MASK].sum() == 2 + 3 + 5 + 1
