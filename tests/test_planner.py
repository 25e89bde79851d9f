"""Tests of XRPO's rollout planner (rllib_exgrpo/xrpo/planner.py): pure numpy/scipy, fast."""

import math
import random
import warnings

import numpy as np
import pytest
from scipy import stats

from rllib_exgrpo.xrpo.planner import (
    ALLOCATIONS,
    UNKNOWN_STD,
    RolloutPlanner,
    allocate_proportional,
    priority,
    reward_stats,
    student_t_halfwidth,
)


# --------------------------------------------------------------------------------------
# Half-width
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16, 64])
@pytest.mark.parametrize("s", [0.0, 0.1, 0.5, 0.7071])
@pytest.mark.parametrize("alpha", [0.05, 0.1])
def test_halfwidth_matches_scipy_t_quantile(n, s, alpha):
    expected = stats.t.ppf(1 - alpha / 2, n - 1) * s / math.sqrt(n)
    assert student_t_halfwidth(s, n, alpha) == pytest.approx(expected, rel=1e-12, abs=0)


def test_halfwidth_known_values():
    # t_{0.975, 1} = 12.7062..., t_{0.975, 3} = 3.1824...
    assert student_t_halfwidth(1.0, 2) == pytest.approx(12.706204736 / math.sqrt(2), rel=1e-9)
    assert student_t_halfwidth(1.0, 4) == pytest.approx(3.182446305 / 2, rel=1e-9)


def test_halfwidth_from_rewards():
    r = [0, 1, 1, 0, 1]
    s = np.std(r, ddof=1)
    assert student_t_halfwidth(r) == pytest.approx(stats.t.ppf(0.975, 4) * s / math.sqrt(5))
    # unscored entries (None / NaN) are skipped
    assert student_t_halfwidth(r + [None, float("nan")]) == pytest.approx(student_t_halfwidth(r))
    assert student_t_halfwidth([1, 1, 1]) == 0.0


def test_halfwidth_vectorised_and_small_n():
    s = np.array([0.5, 0.5, 0.5, 0.0])
    n = np.array([0, 1, 5, 1])
    h = student_t_halfwidth(s, n)
    assert h.shape == (4,)
    assert np.isinf(h[0]) and np.isinf(h[1]) and np.isinf(h[3])  # n < 2: no t quantile
    assert h[2] == pytest.approx(stats.t.ppf(0.975, 4) * 0.5 / math.sqrt(5))
    assert math.isinf(student_t_halfwidth([1.0]))
    assert math.isinf(student_t_halfwidth([]))
    # s is undefined for n < 2: NaN accepted there, rejected where n >= 2
    assert math.isinf(student_t_halfwidth(float("nan"), 1))
    with pytest.raises(ValueError):
        student_t_halfwidth(float("nan"), 3)
    with pytest.raises(ValueError):
        student_t_halfwidth(-0.1, 3)
    with pytest.raises(ValueError):
        student_t_halfwidth(0.5, 3, alpha=1.5)


def test_halfwidth_decreases_with_n():
    h = student_t_halfwidth(0.5, np.arange(2, 40))
    assert np.all(np.diff(h) < 0)


# --------------------------------------------------------------------------------------
# Priority
# --------------------------------------------------------------------------------------


def test_priority_formula():
    s, n, T, lam = 0.4, 6, 48, 0.7
    red = student_t_halfwidth(s, n) - student_t_halfwidth(s, n + 1)
    assert priority(s, n, T, lam) == pytest.approx(red + lam * math.sqrt(math.log(1 + T) / n))


def test_priority_zero_std_only_bonus():
    for n in (2, 4, 9):
        assert priority(0.0, n, 100, 1.0) == pytest.approx(math.sqrt(math.log(101) / n))
    assert priority(0.0, 4, 100, lam=0.0) == 0.0
    assert priority(0.0, 4, 0, lam=1.0) == 0.0  # log(1 + 0) = 0


def test_priority_small_n_is_finite_fallback():
    fallback = student_t_halfwidth(UNKNOWN_STD, 2) - student_t_halfwidth(UNKNOWN_STD, 3)
    for s in (float("nan"), 0.0, 0.3):
        p = priority(s, 1, 10, lam=0.0)
        assert math.isfinite(p) and p == pytest.approx(fallback)
    # it equals the most uncertain two-sample {0,1} question's reduction
    assert priority(np.std([0, 1], ddof=1), 2, 10, lam=0.0) == pytest.approx(fallback)
    assert fallback == pytest.approx(4.5962, abs=1e-3)
    # n_bonus: the count used in the bonus only
    assert priority(0.0, 0, 15, n_bonus=3) == pytest.approx(fallback + math.sqrt(math.log(16) / 3))
    with pytest.raises(ValueError):
        priority(0.0, 0, 15)  # bonus with n = 0 is undefined
    with pytest.raises(ValueError):
        priority(0.0, 3, 15, lam=-1)


def test_priority_vectorised():
    s = np.array([0.0, 0.5, 0.5])
    n = np.array([4, 4, 8])
    p = priority(s, n, 32)
    assert p.shape == (3,)
    assert p[1] > p[0] and p[1] > p[2]
    for i in range(3):
        assert p[i] == pytest.approx(priority(float(s[i]), int(n[i]), 32))


def test_reward_stats():
    assert reward_stats([1, 0, None, float("nan")]) == (2, pytest.approx(math.sqrt(0.5)))
    n, s = reward_stats([1])
    assert n == 1 and math.isnan(s)
    with pytest.raises(ValueError):
        reward_stats([float("inf")])


# --------------------------------------------------------------------------------------
# Largest remainder
# --------------------------------------------------------------------------------------


def test_allocate_proportional_largest_remainder():
    assert allocate_proportional(10, [1, 1, 1]).tolist() == [4, 3, 3]
    # quotas 5.0, 3.333.., 1.666.. -> floors 5, 3, 1 (9), leftover to the largest remainder
    assert allocate_proportional(10, [3, 2, 1]).tolist() == [5, 3, 2]
    # tie on the remainder: larger weight first... here equal weights -> lower index
    assert allocate_proportional(1, [1, 1]).tolist() == [1, 0]
    assert allocate_proportional(7, [0, 0, 0]).tolist() == [3, 2, 2]  # uniform fallback
    assert allocate_proportional(0, [1, 2]).tolist() == [0, 0]
    assert allocate_proportional(5, []).tolist() == []


def test_allocate_proportional_exact_random():
    rng = np.random.default_rng(0)
    for _ in range(300):
        q = int(rng.integers(1, 12))
        total = int(rng.integers(0, 60))
        w = rng.random(q) * (rng.random(q) > 0.2)
        caps = rng.integers(0, 10, size=q) if rng.random() < 0.5 else None
        out = allocate_proportional(total, w, caps)
        limit = total if caps is None else min(total, int(caps.sum()))
        assert out.sum() == limit
        assert np.all(out >= 0)
        if caps is not None:
            assert np.all(out <= caps)
        else:
            # without caps each count is floor or ceil of its quota (when weights > 0)
            if w.sum() > 0:
                quota = total * w / w.sum()
                assert np.all(out >= np.floor(quota) - 1e-9)
                assert np.all(out <= np.ceil(quota) + 1e-9)


def test_allocate_proportional_caps_water_fill():
    # the heavy question is capped at 2; the rest is re-split 1:1
    assert allocate_proportional(10, [100, 1, 1], caps=[2, 10, 10]).tolist() == [2, 4, 4]
    assert allocate_proportional(10, [1, 1], caps=[3, 3]).tolist() == [3, 3]


# --------------------------------------------------------------------------------------
# Planner
# --------------------------------------------------------------------------------------


def simulate(planner, true_p, seed=0, unscored=0.0):
    """Drive the planner like the algorithm does; rewards ~ Bernoulli(true_p[q])."""
    rng = random.Random(seed)

    def gen(counts):
        out = []
        for q, c in enumerate(counts):
            rows = []
            for _ in range(c):
                if rng.random() < unscored:
                    rows.append(None)
                else:
                    rows.append(1.0 if rng.random() < true_p[q] else 0.0)
            out.append(rows)
        return out

    counts = planner.initial(len(true_p))
    rewards = gen(counts)
    per_round = [sum(counts)]
    for r in range(planner.rounds):
        extra = planner.next_round(rewards, r)
        assert all(e >= 0 for e in extra)
        per_round.append(sum(extra))
        new = gen(extra)
        rewards = [a + b for a, b in zip(rewards, new)]
        assert sum(len(x) for x in rewards) <= planner.total_budget(len(true_p))
    return rewards, per_round


@pytest.mark.parametrize("allocation", ALLOCATIONS)
@pytest.mark.parametrize("rounds", [1, 2, 3, 5])
def test_budget_never_exceeded_and_spent_by_last_round(allocation, rounds):
    for seed in range(4):
        true_p = [0.0, 1.0, 0.5, 0.2, 0.9, 0.5, 0.0]
        pl = RolloutPlanner(n0=3, budget_per_question=8, rounds=rounds, allocation=allocation)
        rewards, per_round = simulate(pl, true_p, seed=seed, unscored=0.1 * (seed % 2))
        assert sum(len(r) for r in rewards) == 7 * 8
        assert pl.remaining(rewards) == 0
        assert sum(per_round) == 56
        # budget spread evenly over the rounds: ceil(R / rounds_left)
        left = 56 - 21
        for r in range(rounds):
            share = -(-left // (rounds - r))
            assert per_round[1 + r] == share
            left -= share
        # once spent: zeros
        assert pl.next_round(rewards, rounds - 1) == [0] * 7


def test_initial_and_remaining():
    pl = RolloutPlanner(n0=4, budget_per_question=8, rounds=2)
    assert pl.initial(3) == [4, 4, 4]
    assert pl.total_budget(3) == 24
    assert pl.remaining([[0] * 4] * 3) == 12
    assert pl.remaining([[0] * 9] * 3) == 0  # over-drawn by the caller: never negative
    assert pl.initial(0) == []
    assert pl.next_round([], 0) == []


def test_high_variance_gets_more_than_zero_variance():
    # two all-0, two all-1, two mixed questions after n0 = 4
    rewards = [[0] * 4, [0] * 4, [1] * 4, [1] * 4, [0, 1, 0, 1], [1, 1, 0, 1]]
    for allocation in ALLOCATIONS:
        for lam, bpq in [(0.3, 8), (0.3, 16), (0.1, 8), (0.1, 16)]:
            pl = RolloutPlanner(n0=4, budget_per_question=bpq, rounds=1, lam=lam, allocation=allocation)
            extra = pl.next_round(rewards, 0)
            assert sum(extra) == 6 * (bpq - 4)
            assert min(extra[4], extra[5]) >= max(extra[:4]), (allocation, lam, extra)
            assert extra[4] + extra[5] > extra[0] + extra[2], (allocation, lam, extra)
            # zero-variance questions with equal n have equal priority: counts within 1
            assert max(extra[:4]) - min(extra[:4]) <= 1
            assert extra[4] >= extra[5]  # s = 0.577 > 0.5


def test_lam_one_small_n0_is_nearly_uniform():
    # documented behaviour of the formula: with lam = 1 the bonus dominates the
    # reduction term once n >= 4, so G = 8, n0 = 4 spreads the budget (almost) evenly
    rewards = [[0] * 4, [1] * 4, [0, 1, 0, 1]]
    pl = RolloutPlanner(n0=4, budget_per_question=8, rounds=1, lam=1.0)
    assert pl.next_round(rewards, 0) == [4, 4, 4]


def test_zero_variance_only_bonus_smaller_n_gets_more():
    # two zero-variance questions with different n: the under-sampled one gets more
    rewards = [[0] * 2, [0] * 6]
    for allocation in ALLOCATIONS:
        pl = RolloutPlanner(n0=2, budget_per_question=8, rounds=1, allocation=allocation)
        pi = pl.priorities(rewards)
        T = 8
        assert pi[0] == pytest.approx(math.sqrt(math.log(1 + T) / 2))
        assert pi[1] == pytest.approx(math.sqrt(math.log(1 + T) / 6))
        extra = pl.next_round(rewards, 0)
        assert sum(extra) == 8
        assert extra[0] > extra[1], (allocation, extra)


def test_proportional_split_matches_priorities():
    rewards = [[0] * 4, [0, 1, 0, 1], [0, 0, 0, 1]]
    pl = RolloutPlanner(n0=4, budget_per_question=12, rounds=2)
    pi = pl.priorities(rewards)
    extra = pl.next_round(rewards, 0)
    share = -(-(36 - 12) // 2)
    assert extra == allocate_proportional(share, pi).tolist()
    assert sum(extra) == share


def test_max_per_question_respected():
    for allocation in ALLOCATIONS:
        rewards = [[0, 1, 0, 1], [0] * 4, [1] * 4, [0] * 4]
        pl = RolloutPlanner(
            n0=4,
            budget_per_question=8,
            rounds=2,
            lam=0.05,
            max_per_question=9,
            allocation=allocation,
        )
        totals = [4, 4, 4, 4]
        for r in range(2):
            extra = pl.next_round(rewards, r)
            rewards = [a + [0.5] * e for a, e in zip(rewards, extra)]  # values don't matter
            totals = [t + e for t, e in zip(totals, extra)]
            assert all(t <= 9 for t in totals), (allocation, totals)
        assert totals[0] == 9  # the only uncertain question fills up to the cap
        assert sum(totals) == 32
        assert pl.remaining(rewards) == 0


def test_unscored_count_toward_budget():
    rewards = [[0, 1, None, None], [None] * 4]
    pl = RolloutPlanner(n0=4, budget_per_question=6, rounds=1)
    assert pl.remaining(rewards) == 4
    extra = pl.next_round(rewards, 0)
    assert sum(extra) == 4
    pi = pl.priorities(rewards)
    assert np.all(np.isfinite(pi))
    # question 1 has no scored reward: fallback reduction, bonus from 4 drawn
    fb = student_t_halfwidth(UNKNOWN_STD, 2) - student_t_halfwidth(UNKNOWN_STD, 3)
    assert pi[1] == pytest.approx(fb + math.sqrt(math.log(9) / 4))


def test_deterministic():
    rewards = [[0, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 1], [0, 1, 0]]
    for allocation in ALLOCATIONS:
        a = RolloutPlanner(3, 7, 3, allocation=allocation).next_round(rewards, 1)
        b = RolloutPlanner(3, 7, 3, allocation=allocation).next_round(rewards, 1)
        assert a == b


def test_n0_equals_budget_degenerates_to_grpo():
    pl = RolloutPlanner(n0=8, budget_per_question=8, rounds=2)
    rewards = [[0, 1] * 4, [0] * 8]
    assert pl.next_round(rewards, 0) == [0, 0]
    assert pl.next_round(rewards, 1) == [0, 0]


def test_validation_messages():
    with pytest.raises(ValueError, match="n0"):
        RolloutPlanner(n0=0, budget_per_question=8, rounds=1)
    with pytest.raises(ValueError, match="budget_per_question"):
        RolloutPlanner(n0=9, budget_per_question=8, rounds=1)
    with pytest.raises(ValueError, match="rounds"):
        RolloutPlanner(n0=4, budget_per_question=8, rounds=0)
    with pytest.raises(ValueError, match="max_per_question"):
        RolloutPlanner(n0=4, budget_per_question=8, rounds=1, max_per_question=7)
    with pytest.raises(ValueError, match="allocation"):
        RolloutPlanner(n0=4, budget_per_question=8, rounds=1, allocation="bogus")
    with pytest.raises(ValueError, match="alpha"):
        RolloutPlanner(n0=4, budget_per_question=8, rounds=1, alpha=0)
    with pytest.raises(ValueError, match="lam"):
        RolloutPlanner(n0=4, budget_per_question=8, rounds=1, lam=float("nan"))
    with pytest.raises(TypeError):
        RolloutPlanner(n0=4.5, budget_per_question=8, rounds=1)
    with pytest.warns(UserWarning, match="n0 = 1"):
        RolloutPlanner(n0=1, budget_per_question=8, rounds=1)
    pl = RolloutPlanner(n0=2, budget_per_question=4, rounds=2)
    with pytest.raises(ValueError, match="round_index"):
        pl.next_round([[0, 1]], 2)
    with pytest.raises(ValueError, match="no completion"):
        pl.next_round([[0, 1], []], 0)
    with pytest.raises(ValueError, match=r"rewards_so_far\[0\]"):
        pl.next_round([[float("inf"), 1]], 0)


def test_n0_one_is_finite_and_spends_budget():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for allocation in ALLOCATIONS:
            pl = RolloutPlanner(n0=1, budget_per_question=5, rounds=2, allocation=allocation)
            rewards, _ = simulate(pl, [0.5, 0.0, 1.0, 0.3], seed=3)
            assert sum(len(r) for r in rewards) == 20
