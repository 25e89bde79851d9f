"""Positive control of replay: does ExGRPO get better than GRPO at what it replays?

    python experiments/replay_positive_control.py [--seeds 0 1 2] [--train-dataset SPEC] [--exgrpo JSON]

On the arithmetic testbed (``grpo_finite_tiny.yaml`` / ``exgrpo_finite_tiny.yaml`` on
``arithmetic:levels=1-4,n=1280``, the testbed's selected settings: GRPO lr 1e-4, ExGRPO
lr 5e-5 with experience ratio 0.25), each seed runs GRPO to its 80 steps and ExGRPO to the
same sampled tokens; at the end both answer every training question greedily. The control
set of a seed is the *pooled hard* questions of its ExGRPO run: those in the pool at the
end (partly solved) whose last group solved at most 3 of 8. GRPO trained on the same
questions as fresh ones, so if replaying their successes does anything, ExGRPO's greedy
accuracy on that set is above GRPO's. Declared before its runs (docs/experience/positive_control.md); if it
is not above, a bug is looked for before anything else is read.

That set is chosen by the ExGRPO run's own last samples, so it leans towards the questions
ExGRPO itself failed at the end (a selection bias against ExGRPO; GRPO's accuracy on it is
not selected that way). The script therefore also reads a set chosen by neither run: the
*warm-start hard* questions, those the warm start solves 1 to 3 times in 8 samples at
temperature 1 (counted once per seed before training, cached). Those are the questions
ExGRPO pools as hard when it meets them, and GRPO trains on them as fresh ones. That set is
also split by ExGRPO's pool at the end: the part still pooled (what replay acts on) and the
rest (mostly questions retired as solved G in G, which leave the fresh data).

The last line is ``warm_start_hard_gain=<mean paired ExGRPO - GRPO accuracy on that set>``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict

import _paths  # noqa: F401  (benchmarks/ on sys.path: _common, _runs)
from _common import ROOT, start_ray
import _runs
import _replay_control as rc
import experience_testbed as tb

DEFAULT_TRAIN_DATASET = "arithmetic:levels=1-4,n=1280"
PICKS = {"grpo_finite": {"lr": 1e-4}, "exgrpo_finite": {"lr": 5e-5, "experience_ratio": 0.25}}


def warm_start_solve_counts(seed: int, out: Path, dataset: str) -> Dict[str, int]:
    """The warm start's correct answers in 8 samples of each training question, per seed
    (the default training set keeps its cache name without a dataset tag)."""
    tag = "" if dataset == DEFAULT_TRAIN_DATASET else "-" + dataset.replace(":", "_").replace(",", "_")
    path = out / f"warm_start_counts-seed{seed}-{_runs.model_build('grpo_finite')}{tag}.json"
    overrides = {**PICKS["grpo_finite"], "env_config": {"dataset": dataset}}
    return rc.warm_start_solve_counts(path, lambda: _runs.build("grpo_finite", seed, overrides)[1])


def run(name: str, seed: int, budget, out: Path, dataset: str) -> dict:
    overrides = {**PICKS[name], "env_config": {"dataset": dataset}}
    return _runs.train_run(
        name,
        seed,
        iterations=80,
        token_budget=budget,
        eval_interval=20,
        overrides=overrides,
        out=out,
        key_extra=rc.CONTROL_KEY,
        end_eval=rc.end_eval,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "positive_control")
    ap.add_argument(
        "--exgrpo",
        default=None,
        help='JSON overrides of the ExGRPO arm instead of its selected setting, e.g. \'{"lr": 1e-4, '
        '"experience_ratio": 0.25}\' (the same learning rate as GRPO)',
    )
    ap.add_argument(
        "--train-dataset",
        default=DEFAULT_TRAIN_DATASET,
        help="the training set of both arms; a smaller one replays each pooled question more often",
    )
    args = ap.parse_args()
    if args.exgrpo:
        PICKS["exgrpo_finite"] = json.loads(args.exgrpo)
    start_ray()
    names = ("warm_start_hard", "warm_start_hard_pooled", "warm_start_hard_unpooled", "pool_hard", "pooled", "all")
    diffs: Dict[str, list] = {k: [] for k in names}
    for seed in args.seeds:
        g = run("grpo_finite", seed, None, args.out, args.train_dataset)
        budget = g["steps"][79]["tokens"]  # GRPO's tokens after its 80 steps
        e = run("exgrpo_finite", seed, budget, args.out, args.train_dataset)
        sets = rc.control_sets(e["end"], warm_start_solve_counts(seed, args.out, args.train_dataset))
        cells = rc.compare_at_end(g["end"], e["end"], sets, names, diffs)
        test = (tb.at_budget(g, None, "accuracy"), tb.at_budget(e, budget, "accuracy"))
        print(f"seed {seed}, greedy accuracy GRPO / ExGRPO: {cells} | held-out test {test[0]:.3f} / {test[1]:.3f}", flush=True)
    print("\n".join(rc.difference_lines(diffs)))
    print(f"warm_start_hard_gain={tb.ci95(diffs['warm_start_hard'])[0]:.4f}")


if __name__ == "__main__":
    main()
