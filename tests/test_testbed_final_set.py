"""The experience testbed's large final set (experiments/experience_testbed.py): which
questions it holds, its level-mean score and the two-way bootstrap of a paired
difference, on the real dataset and on hand-made outcomes."""

import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
# the studies, and the helpers (_common, _runs) they share with the benchmarks
sys.path[:0] = [str(REPO / "experiments"), str(REPO / "benchmarks")]

import experience_testbed as tb  # noqa: E402
from rllib_exgrpo.envs.datasets import load_problems  # noqa: E402
from rllib_exgrpo.envs.problem import Problem  # noqa: E402


def test_final_set_is_the_test_split_outside_validation():
    problems = list(load_problems(tb.FINAL_SET_DATASET, split="test"))
    chosen = tb.final_set_questions(problems)
    assert len(chosen) == tb.FINAL_SET_SIZE - (tb.VAL_SLICE[1] - tb.VAL_SLICE[0]) == 2200
    # the figure's first 200 questions are its head; validation is never in it
    default = list(load_problems("arithmetic", split="test"))
    assert [p.id for p in chosen[:200]] == [p.id for p in default[:200]]
    val_ids = {p.id for p in default[tb.VAL_SLICE[0] : tb.VAL_SLICE[1]]}
    assert not val_ids & {p.id for p in chosen}
    # never a training question of the testbed's finite set
    train = {p.question for p in load_problems("arithmetic:levels=1-4,n=600", split="train")}
    assert not train & {p.question for p in chosen}
    # the level counts docs/experience/testbed.md declares (all level-1/3 questions there are)
    counts = {k: int(n) for k, n in zip(*np.unique(tb.final_set_levels(), return_counts=True))}
    assert counts == {1: 29, 2: 699, 3: 59, 4: 1413}
    with pytest.raises(ValueError, match="needs 2400"):
        tb.final_set_questions(default)


def _problem(i: int, level: int) -> Problem:
    return Problem(id=f"q{i}", question=f"q{i}?", ground_truth="1", data_source="arithmetic", difficulty=level)


def test_final_set_scores_weigh_levels_equally():
    problems = [_problem(0, 1), _problem(1, 2), _problem(2, 2), _problem(3, 2), _problem(4, 2)]
    correct = {"q0": 1.0, "q1": 1.0, "q2": 0.0, "q3": 0.0, "q4": 0.0}
    s = tb.final_set_scores(problems, correct)
    assert s["final_L1"] == 1.0 and s["final_L2"] == 0.25
    assert s["final"] == pytest.approx((1.0 + 0.25) / 2)  # level mean, not the pooled 0.4
    assert s["final_pooled"] == pytest.approx(0.4)
    assert s["final_bits"] == "11000"


def _run(seed: int, bits: str) -> dict:
    return {
        "algo": "x",
        "seed": seed,
        "evals": [{"step": 0, "tokens": 0.0, "final_bits": "0" * len(bits)}, {"step": 10, "tokens": 100.0, "final_bits": bits}],
    }


def test_paired_bootstrap_point_and_interval():
    levels = np.array([1, 1, 2, 2])
    budgets = {0: 100.0, 1: 100.0}
    runs = {"a": [_run(0, "1111"), _run(1, "1110")], "b": [_run(0, "0101"), _run(1, "0100")]}
    line = tb.paired_bootstrap(runs, budgets, "a", "b", levels, draws=500)
    # per seed a - b: seed 0 level means (1-0)+(0.5-0)... level 1: (1,1)-(0,1) = 0.5; level 2: (1,1)-(0,1) = 0.5
    # seed 1: level 1 0.5, level 2 (1,0)-(0,0) = 0.5 -> +0.500
    assert "+0.500" in line and "seeds [0, 1]" in line
    lo, hi = (float(x) for x in line.split("[")[-1].split("]")[0].split(","))
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0 and lo < hi  # level 1's tie question can be drawn alone
    sure = tb.paired_bootstrap(
        {"a": [_run(0, "1111"), _run(1, "1111")], "b": [_run(0, "0000"), _run(1, "0000")]}, budgets, "a", "b", levels, draws=200
    )
    assert "+1.000, 95% bootstrap over seeds and questions [+1.000, +1.000]; 100% of draws above 0" in sure
    same = tb.paired_bootstrap({"a": runs["a"], "b": runs["a"]}, budgets, "a", "b", levels, draws=200)
    assert "+0.000, 95% bootstrap over seeds and questions [+0.000, +0.000]" in same
    short = tb.paired_bootstrap(runs, {0: 1e9, 1: 100.0}, "a", "b", levels, draws=10)
    assert "seeds [1]" in short and "seeds [0] left out: short of the budget" in short
    with pytest.raises(ValueError, match="4 final-set outcomes per run but 3 question levels"):
        tb.paired_bootstrap(runs, budgets, "a", "b", levels[:3], draws=10)
