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
        gidx,
        minibatch_size=128 // num_learners,
        num_learners=num_learners,
        num_epochs=2,
        shuffle=shuffle,
        rng=np.random.default_rng(0),
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
    assert (
        num_minibatches(3, 1, 4) == 0
        or plan_minibatches(np.arange(3), minibatch_size=1, num_learners=4, rng=np.random.default_rng(0)) == []
    )


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


def test_micro_batch_plan_packs_sorted_rows_under_the_token_budget():
    from rllib_exgrpo.core.minibatches import padded_positions, plan_micro_batches

    prompt = np.array([3, 3, 4, 3, 5, 3])
    completion = np.array([2, 10, 3, 2, 1, 30])
    passes = plan_micro_batches(prompt, completion, max_tokens=28)
    assert sorted(np.concatenate(passes).tolist()) == list(range(6))  # every row once
    # Longest first; [5] (33 positions) is over the budget alone; [1] alone (2 x 13 = 26 fits, 3 x 13 = 39 not).
    assert [p.tolist() for p in passes] == [[5], [1, 2], [0, 3, 4]]
    for rows in passes:
        assert len(rows) == 1 or len(rows) * (prompt[rows].max() + completion[rows].max()) <= 28
    assert padded_positions(prompt, completion, passes) == 33 + 2 * 14 + 3 * 7
    # A row cap holds too; without a budget the plan is today's consecutive row slices.
    assert max(len(p) for p in plan_micro_batches(prompt, completion, max_tokens=1000, max_rows=2)) == 2
    assert [p.tolist() for p in plan_micro_batches(prompt, completion, max_rows=4)] == [[0, 1, 2, 3], [4, 5]]
    assert [p.tolist() for p in plan_micro_batches(prompt, completion)] == [list(range(6))]


def test_trim_padding_keeps_one_contiguous_slice_for_numpy_and_torch():
    import torch

    from rllib_exgrpo.core import columns as C
    from rllib_exgrpo.core.minibatches import trim_padding

    # P = 3 (left-padded), R = 4 (right-padded); the real span is prompt columns 1-2 and completion 0-1.
    mask = np.array([[0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 0]])
    resp = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=np.float32)
    cols = {C.ATTENTION_MASK: mask, C.INPUT_IDS: mask * 7, C.RESPONSE_MASK: resp, C.ADVANTAGES: np.ones(2)}
    for wrap in (np.asarray, torch.as_tensor):
        out = trim_padding({k: wrap(v) for k, v in cols.items()})
        assert np.asarray(out[C.ATTENTION_MASK]).tolist() == [[1, 1, 1, 1], [0, 1, 1, 0]]
        assert np.asarray(out[C.RESPONSE_MASK]).tolist() == [[1, 1], [1, 0]]
        assert np.asarray(out[C.ADVANTAGES]).tolist() == [1, 1]


def test_packed_plan_fills_passes_first_fit_decreasing():
    from rllib_exgrpo.core.minibatches import padded_positions, plan_micro_batches

    prompt = np.array([3, 3, 4, 3, 5, 3])
    completion = np.array([2, 10, 3, 2, 1, 30])  # row lengths 5, 13, 7, 5, 6, 33
    passes = plan_micro_batches(prompt, completion, max_tokens=20, packed=True)
    assert [p.tolist() for p in passes] == [[5], [1, 2], [0, 3, 4]]  # 33 alone; 13 + 7; 6 + 5 + 5
    assert all((prompt[p] + completion[p]).sum() <= 20 or len(p) == 1 for p in passes)
    assert padded_positions(prompt, completion, passes, packed=True) == int(prompt.sum() + completion.sum())
    assert max(len(p) for p in plan_micro_batches(prompt, completion, max_tokens=100, max_rows=2, packed=True)) == 2
