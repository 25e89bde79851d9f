"""Where the main job and its twin differ: held-out accuracy per difficulty level.

    python experiments/main_job_levels.py [--storage-path benchmarks/out/main_job] [--seeds 0 1 2 3 4]

Reads the runs ``experiments/main_job_seeds.py`` left under ``--storage-path`` (one folder
per file and seed), loads each run's last checkpoint and scores it greedily, with the
project's evaluator (``rllib_exgrpo.evaluation.evaluate``, the one ``rllib evaluate``
uses), on the large final set of the experience testbed: the first 2400 arithmetic test
questions without the validation slice 200-400 (2200 questions; levels 1-4: 29 / 699 / 59
/ 1413). Prints, per seed and as the mean over seeds, the accuracy on the first 200 test
questions (the runs' own held-out figure, as a check that this evaluator agrees with the
training-time one), on each level of the final set, and the final set's score (the mean
of the four level accuracies), for the main job, its twin and their difference.

The level split answers one question the 200-question figure cannot: whether the main
job's gap to its twin sits on the levels its retirement takes out of training (questions
solved 8/8, mostly levels 1-2) or on the hard levels its replay draws from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The final set and its score have one definition, the testbed's.
from experience_testbed import FINAL_SET_DATASET, VAL_SLICE, final_set_scores  # noqa: E402

FIRST = 200


def last_checkpoint(folder: Path) -> Path:
    """The newest ``checkpoint_*`` of the one trial under a run folder."""
    found = sorted(folder.glob("*/*/checkpoint_*"))
    if not found:
        raise SystemExit(f"{folder}: no checkpoint (run experiments/main_job_seeds.py first)")
    return found[-1]


def level_scores(questions) -> dict:
    """``first200``, ``L1``..``L4`` and ``final`` from the evaluator's questions (in set order)."""
    correct = {q.id: float(q.correct[0]) for q in questions}
    first = float(np.mean([correct[q.id] for q in questions[:FIRST]]))
    kept = [q for i, q in enumerate(questions) if not VAL_SLICE[0] <= i < VAL_SLICE[1]]
    scores = final_set_scores(kept, correct)
    by_level = {k[len("final_") :]: v for k, v in scores.items() if k.startswith("final_L")}
    return {"first200": first, **by_level, "final": scores["final"]}


def score_run(folder: Path) -> dict:
    from rllib_exgrpo.evaluation.evaluate import evaluate

    report = evaluate(str(last_checkpoint(folder)), [FINAL_SET_DATASET], temperature=0.0)
    return level_scores(report.questions)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--storage-path", default=str(ROOT / "benchmarks" / "out" / "main_job"))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--files", nargs=2, default=["exgrpo_tiny", "grpo_tiny"], metavar=("MAIN", "TWIN"))
    args = ap.parse_args()
    storage = Path(args.storage_path)
    keys = ["first200", "L1", "L2", "L3", "L4", "final"]
    rows = {name: [] for name in args.files}
    print(f"{'seed':>4} {'run':>12} " + " ".join(f"{k:>8}" for k in keys), flush=True)
    for seed in args.seeds:
        for name in args.files:
            s = score_run(storage / f"{name}-seed{seed}")
            rows[name].append(s)
            print(f"{seed:>4} {name:>12} " + " ".join(f"{s[k]:8.3f}" for k in keys), flush=True)
    main_rows, twin_rows = rows[args.files[0]], rows[args.files[1]]
    n = len(args.seeds)
    print(f"\nmean over {n} seeds (difference: mean ± 95% t of the paired differences, points)")
    for name in args.files:
        print(f"{'':>4} {name:>12} " + " ".join(f"{np.mean([r[k] for r in rows[name]]):8.3f}" for k in keys))
    diffs = {k: 100 * np.array([a[k] - b[k] for a, b in zip(main_rows, twin_rows)]) for k in keys}
    if n > 1:
        from scipy import stats

        t = stats.t.ppf(0.975, n - 1)
        half = {k: t * diffs[k].std(ddof=1) / np.sqrt(n) for k in keys}
        print(f"{'':>4} {'main - twin':>12} " + " ".join(f"{diffs[k].mean():+4.1f}±{half[k]:<3.1f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
