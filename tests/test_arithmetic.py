"""The embedded arithmetic family: deterministic, split-disjoint, level-true, verifiable."""

from __future__ import annotations

import pytest

from rllib_exgrpo.envs import arithmetic
from rllib_exgrpo.envs.rewards import last_boxed, math_reward, score_batch


def test_deterministic_from_seed():
    a = arithmetic.generate(300, seed=7, levels=(1, 2, 3, 4, 5, 6))
    b = arithmetic.generate(300, seed=7, levels=(1, 2, 3, 4, 5, 6))
    c = arithmetic.generate(300, seed=8, levels=(1, 2, 3, 4, 5, 6))
    assert a == b
    assert [p.id for p in a] != [p.id for p in c]


def test_train_and_test_never_overlap():
    train = arithmetic.generate(5000, split="train", seed=0)
    test = arithmetic.generate(500, split="test", seed=0)
    assert not {p.question for p in train} & {p.question for p in test}
    assert len({p.id for p in train}) == 5000 and len({p.question for p in train}) == 5000
    assert all(arithmetic.split_of(p.question) == "test" for p in test)


@pytest.mark.parametrize("levels", [(1,), (2, 3), (5,), (4, 6)])
def test_levels_respected(levels):
    problems = arithmetic.generate(60, seed=1, levels=levels)
    assert {p.difficulty for p in problems} <= set(levels)
    assert all(p.id.startswith(f"arith-train-L{p.difficulty}-") for p in problems)


def test_weights_and_curriculum():
    problems = arithmetic.generate(200, seed=2, levels=(1, 4), level_weights=(0.0, 1.0))
    assert {p.difficulty for p in problems} == {4}
    ordered = arithmetic.generate(100, seed=2, levels=(1, 2, 3), order="curriculum")
    assert [p.difficulty for p in ordered] == sorted(p.difficulty for p in ordered)


def test_parse_spec():
    assert arithmetic.parse_spec("arithmetic:levels=1-4,n=5000,n_test=500,seed=0") == {
        "levels": (1, 2, 3, 4),
        "n": 5000,
        "n_test": 500,
        "seed": 0,
    }
    assert arithmetic.parse_spec("arithmetic:levels=1+3")["levels"] == (1, 3)
    with pytest.raises(ValueError):
        arithmetic.parse_spec("arithmetic:depth=3")


def test_each_solution_scores_one():
    problems = arithmetic.generate(300, seed=3, levels=arithmetic.LEVELS)
    assert all(last_boxed(p.solution) == p.ground_truth for p in problems)
    # Through math-verify itself (fast path off), for every level.
    results = score_batch([p.solution for p in problems], [p.ground_truth for p in problems], fast_path=False)
    assert [r.score for r in results] == [1.0] * len(problems)
    for p in problems[:12]:
        assert math_reward(p.solution, p.ground_truth).score == 1.0
        wrong = p.solution.replace(f"\\boxed{{{p.ground_truth}}}", f"\\boxed{{{int(p.ground_truth) + 1}}}")
        assert math_reward(wrong, p.ground_truth).score == 0.0
