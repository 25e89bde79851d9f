"""LoRA GRPO against full fine-tuning GRPO on the tiny model, and colocated placement
against the default one (docs/results.md, "LoRA against full fine-tuning").

    python experiments/lora_compare.py --workers 2               # the grid, the colocated arm, the report
    python experiments/lora_compare.py --report                  # the report from cached runs only

Recipe: tuned_examples/grpo_tiny.yaml (1280 training questions, 80 iterations). Each arm
gets its own learning-rate grid, three seeds at every grid point, equal iterations:

* ``full``: full fine-tuning, lr 3e-5 / 1e-4 / 3e-4;
* ``lora``: LoRA rank 16, alpha 32, all linear layers, dropout 0, lr 3e-4 / 1e-3 / 3e-3
  (about 10x full fine-tuning's: "LoRA Without Regret", Thinking Machines Lab, 2025);
* ``colocated``: full fine-tuning at ``full``'s picked lr with ``colocate: true``
  (generation in the learner process from the learner's own weights), against the runs of
  ``full`` at that lr (default placement: the env runner holds its own copy, synced each
  iteration).

Runs and evaluators are the experience testbed's (``experience_testbed.train_run``, cached
under ``--out``): greedy held-out accuracy on the first 200 arithmetic test questions
(``accuracy``, the final figure) and on test questions 200-400 (``val``, the only figure
the lr pick reads), every 10 iterations. Selection: the highest mean over seeds of
``val_tail`` (the validation evaluations from 70% of the run on). Final figure: held-out
gain, end minus start, at each arm's picked lr. Criterion: LoRA's mean gain >= half of full
fine-tuning's.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

import _paths  # noqa: F401  (benchmarks/ on sys.path: _common, _runs)
import _common
from _common import ROOT
import _parallel_runs
import _runs
import experience_testbed as tb

RECIPE = "grpo_tiny"
_common.RECIPES.setdefault(RECIPE, ("grpo_tiny.yaml", {}))
FULL_LRS = (3e-5, 1e-4, 3e-4)
LORA_LRS = (3e-4, 1e-3, 3e-3)
LORA = {"lora_rank": 16, "lora_alpha": 32.0, "lora_dropout": 0.0, "lora_target_modules": "all-linear"}
COLOCATE = {"colocate": True, "num_env_runners": 0, "num_learners": 0}
SEEDS = (0, 1, 2)


def arm_overrides(arm: str, lr: float) -> dict:
    return {"full": {"lr": lr}, "lora": {**LORA, "lr": lr}, "colocated": {**COLOCATE, "lr": lr}}[arm]


def pick_lr(val_by_lr: Dict[float, Sequence[float]]) -> float:
    """The lr with the highest mean validation figure over its seeds (NaN runs left out;
    ties: the first in the grid's order)."""
    means = {lr: float(np.nanmean(v)) if len(v) else math.nan for lr, v in val_by_lr.items()}
    return max((lr for lr in means if not math.isnan(means[lr])), key=lambda lr: means[lr])


def meets_criterion(lora_gain: float, full_gain: float, ratio: float = 0.5) -> bool:
    """LoRA's held-out gain is at least ``ratio`` of full fine-tuning's (a full gain <= 0
    leaves nothing to match: met when LoRA's gain is not below it)."""
    return lora_gain >= (ratio * full_gain if full_gain > 0 else full_gain)


def within_noise(mean: float, half: float) -> str:
    """Whether a paired difference's 95% interval holds 0."""
    if math.isnan(half):
        return "no interval (one seed)"
    return "within noise" if mean - half <= 0 <= mean + half else "outside noise"


def run(arm: str, lr: float, seed: int, args) -> dict:
    return tb.train_run(
        RECIPE,
        seed,
        iterations=args.iterations,
        token_budget=None,
        eval_interval=args.eval_interval,
        overrides=arm_overrides(arm, lr),
        out=args.out,
    )


def cached(arm: str, lr: float, seed: int, args) -> dict:
    """The cached run, or None (never trains)."""
    key = {
        "algo": RECIPE,
        "seed": seed,
        "iterations": args.iterations,
        "token_budget": None,
        "eval_interval": args.eval_interval,
        "overrides": arm_overrides(arm, lr),
        "model": None,
        "format": _runs.RUN_FORMAT,
        "testbed": tb.TESTBED_FORMAT,
        "model_build": _runs.model_build(RECIPE),
    }
    path = _runs._cache_path(args.out, key)
    return json.loads(path.read_text()) if path.exists() else None


def jobs(todo: List[tuple], args) -> List[_parallel_runs.Job]:
    logs = args.out / "_logs"
    logs.mkdir(parents=True, exist_ok=True)
    common = ["--iterations", str(args.iterations), "--eval-interval", str(args.eval_interval), "--out", str(args.out)]
    return [
        _parallel_runs.Job(
            f"{arm}:{lr:g}:{seed}",
            _parallel_runs.python_argv(Path(__file__).resolve(), ["--one", arm, repr(lr), str(seed), *common]),
            log=logs / f"{arm}-lr{lr:g}-seed{seed}.log",
        )
        for arm, lr, seed in todo
    ]


def ensure(todo: List[tuple], args) -> None:
    todo = [t for t in todo if cached(*t, args) is None]
    if not todo or args.report:
        return
    if args.workers == 1:
        for t in todo:
            run(*t, args)
    else:
        _parallel_runs.run_jobs(jobs(todo, args), args.workers)


def summary(runs: List[dict]) -> dict:
    start = [r["evals"][0]["accuracy"] for r in runs]
    end = [r["evals"][-1]["accuracy"] for r in runs]
    return {
        "val": float(np.mean([tb.tail(r, None, "val") for r in runs])),
        "start": float(np.mean(start)),
        "end": tb.ci95(end),
        "gain": tb.ci95([e - s for s, e in zip(start, end)]),
        "gains": [e - s for s, e in zip(start, end)],
        "s_iter": float(np.mean([_runs.median_step_s(r) for r in runs])),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument("--lora-lrs", nargs="+", type=float, default=list(LORA_LRS))
    p.add_argument("--full-lrs", nargs="+", type=float, default=list(FULL_LRS))
    p.add_argument("--iterations", type=int, default=80)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--workers", type=int, default=2, help="runs at once, one process pinned to each core")
    p.add_argument("--report", action="store_true", help="read cached runs only")
    p.add_argument("--one", nargs=3, metavar=("ARM", "LR", "SEED"), help="(internal) one run")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "lora_compare")
    args = p.parse_args()
    if args.one:
        arm, lr, seed = args.one
        run(arm, float(lr), int(seed), args)
        return

    grid = {"full": args.full_lrs, "lora": args.lora_lrs}
    ensure([(arm, lr, s) for arm, lrs in grid.items() for lr in lrs for s in args.seeds], args)
    res = {arm: {lr: [r for r in (cached(arm, lr, s, args) for s in args.seeds) if r] for lr in lrs} for arm, lrs in grid.items()}
    best = {arm: pick_lr({lr: [tb.tail(r, None, "val") for r in rs] for lr, rs in res[arm].items() if rs}) for arm in grid}
    ensure([("colocated", best["full"], s) for s in args.seeds], args)
    coloc = [r for r in (cached("colocated", best["full"], s, args) for s in args.seeds) if r]

    lines = [
        f"{args.iterations} iterations, seeds {args.seeds}; val = mean over seeds of the validation tail; "
        "held-out = first 200 test questions (mean ± 95% t over seeds)"
    ]
    for arm, lrs in res.items():
        lines.append(
            f"{arm}: val by lr "
            + ", ".join(f"{lr:g}: {summary(rs)['val']:.3f}" for lr, rs in lrs.items() if rs)
            + f"; picked {best[arm]:g}"
        )
    rows = {"full": res["full"][best["full"]], "lora": res["lora"][best["lora"]], "colocated": coloc}
    for name, rs in rows.items():
        if not rs:
            continue
        s = summary(rs)
        lines.append(
            f"  {name:<10} n={len(rs)} start {s['start']:.3f} end {s['end'][0]:.3f} ± {s['end'][1]:.3f} "
            f"gain {s['gain'][0]:+.3f} ± {s['gain'][1]:.3f} (per seed "
            f"{', '.join(f'{g:+.3f}' for g in s['gains'])}), {s['s_iter']:.2f} s/iter"
        )
    g_full, g_lora = summary(rows["full"])["gain"][0], summary(rows["lora"])["gain"][0]
    lines.append(
        f"criterion LoRA gain >= half of full's: {g_lora:+.3f} vs {0.5 * g_full:+.3f}: "
        f"{'met' if meets_criterion(g_lora, g_full) else 'NOT met'}"
    )
    if coloc:
        by_seed = {r["seed"]: r["evals"][-1]["accuracy"] for r in rows["full"]}
        d = tb.ci95([r["evals"][-1]["accuracy"] - by_seed[r["seed"]] for r in coloc if r["seed"] in by_seed])
        lines.append(
            f"colocated - default, held-out at iteration {args.iterations}, paired: {d[0]:+.3f} ± {d[1]:.3f} "
            f"(95% t, n={d[2]}): {within_noise(*d[:2])}"
        )
    text = "\n".join(lines)
    print(text)
    (args.out / "report.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
