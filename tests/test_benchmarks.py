"""The comparison benchmark's machinery (benchmarks/_runs.py, compare.py, learning_curves.py)
on a two-step budget: every method is evaluated the same way, runs stop at GRPO's token
budget, and finished runs are cached and reused."""
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

pytestmark = pytest.mark.slow


def test_compare_runs_share_budget_and_cache(ray_local, quick_tiny_model, tmp_path):
    import _runs
    import compare
    import learning_curves

    runs = _runs.collect(["ppo", "grpo", "exgrpo"], [0], iterations=2, eval_interval=1, overrides={},
                         out=tmp_path, model=quick_tiny_model, log=lambda *_: None)
    by_algo = {r["algo"]: r for r in runs}
    budget = _runs.budget_of(runs, 0, 2)
    assert budget == by_algo["grpo"]["steps"][1]["tokens"] > 0
    for name, run in by_algo.items():
        tokens = [s["tokens"] for s in run["steps"]]
        assert tokens == sorted(tokens) and tokens[0] > 0, name
        assert len(run["steps"]) >= 2 and tokens[-1] >= budget, name  # ran to both stops
        assert [e["step"] for e in run["evals"]][:3] == [0, 1, 2], name
        # accuracies of the same fixed question set: multiples of 1 / questions
        assert all(abs(e["accuracy"] * _runs.HELDOUT_QUESTIONS - round(e["accuracy"] * _runs.HELDOUT_QUESTIONS)) < 1e-6
                   for e in run["evals"]), name
        assert not math.isnan(_runs.accuracy_at_tokens(run, budget)), name
    # The same model and evaluation for everyone: identical starting accuracy.
    assert len({r["evals"][0]["accuracy"] for r in runs}) == 1
    assert len(list((tmp_path / "runs").glob("*.json"))) == 3

    again = _runs.collect(["ppo", "grpo", "exgrpo"], [0], iterations=2, eval_interval=1, overrides={},
                          out=tmp_path, model=quick_tiny_model, log=lambda *_: None)
    assert json.dumps(again) == json.dumps(runs)  # read back from the cache, nothing retrained

    budgets, table = compare.budget_table(runs, [0], 2)
    assert budgets == {0: budget} and any(line.startswith("PPO (RLlib)") for line in table)
    lines = learning_curves.summary_lines(runs, 2)
    assert any(line.startswith("ExGRPO") and "x" in line for line in lines)
