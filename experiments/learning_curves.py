"""Held-out accuracy against training steps for GRPO, ExGRPO, XRPO and ExGRPO+XRPO.

    python experiments/learning_curves.py [--algos grpo exgrpo xrpo exgrpo_xrpo]
        [--seeds 0 1 2] [--iterations 40] [--eval-interval 10] [--out benchmarks/out]

Each (method, seed) run trains the embedded default (tiny model, arithmetic family;
settings from tuned_examples/*_tiny.yaml) for the same number of steps; the held-out set
(first 200 arithmetic test questions, greedy) is evaluated every ``--eval-interval`` steps.
Runs are cached under ``<out>/runs`` and shared with compare.py (see _runs.py).

Writes ``learning_curves.png`` and ``learning_curves.csv`` and prints: held-out accuracy
(mean ± std over seeds) per step; the median wall time of a step and its ratio to GRPO's
(the per-step overhead; the machine should be otherwise idle); ExGRPO's switch step to
mixed mode; XRPO's in-context seeding rescue rate (all-failing questions that got at least
one correct completion once seeded).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

import _paths  # noqa: F401  (benchmarks/ on sys.path: _common, _runs)
from _runs import accuracy_at_step, collect_from_command_line, mean_std, median_step_s

LABELS = {"ppo": "PPO (RLlib)", "grpo": "GRPO", "exgrpo": "ExGRPO", "xrpo": "XRPO", "exgrpo_xrpo": "ExGRPO+XRPO"}


def eval_steps(runs, iterations, interval=None):
    """Steps evaluated in every run up to ``iterations`` (with ``interval``: only step 0, its
    multiples and ``iterations``, leaving out the budget-crossing evaluations)."""
    common = set.intersection(*({e["step"] for e in r["evals"] if e["step"] <= iterations} for r in runs))
    if interval:
        common = {s for s in common if s % interval == 0 or s == iterations}
    return sorted(common)


def plot_curves(runs, ax, *, x: str, iterations: int, budget_by_seed=None):
    """Mean over seeds with min-max band. x='step' (evaluations up to ``iterations``) or
    x='tokens' (evaluations up to each seed's budget, interpolated on a common grid)."""
    for name in dict.fromkeys(r["algo"] for r in runs):
        mine = [r for r in runs if r["algo"] == name]
        if x == "step":
            xs = eval_steps(mine, iterations, interval=mine[0]["eval_interval"])
            acc = np.array([[accuracy_at_step(r, s) for s in xs] for r in mine])
        else:
            top = min(budget_by_seed[r["seed"]] for r in mine)
            xs = np.linspace(0, top, 9)
            acc = np.array([np.interp(xs, [e["tokens"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]]) for r in mine])
            xs = xs / 1e3
        ax.plot(xs, acc.mean(0), marker="o", ms=3, label=f"{LABELS.get(name, name)} (n={len(mine)})")
        ax.fill_between(xs, acc.min(0), acc.max(0), alpha=0.15)
    ax.set_xlabel("training step" if x == "step" else "sampled completion tokens (thousands)")
    ax.set_ylabel("held-out accuracy (greedy, 200 q)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def rescue_rate(run) -> float:
    """Over the run: rescued / seeded all-failing questions (XRPO's in-context seeding)."""
    seeded = sum(s["xrpo"].get("seeded_questions", 0.0) for s in run["steps"])
    rescued = sum(s["xrpo"].get("rescued_questions", 0.0) for s in run["steps"])
    return rescued / seeded if seeded else math.nan


def summary_lines(runs, iterations):
    steps = eval_steps(runs, iterations, interval=runs[0]["eval_interval"])
    base = (
        np.mean([median_step_s(r, iterations + 1) for r in runs if r["algo"] == "grpo"]) if any(r["algo"] == "grpo" for r in runs) else None
    )
    lines = [
        "held-out accuracy (greedy, 200 questions), mean ± std over seeds, by training step",
        f"{'method':<13}" + "".join(f"{s:>13}" for s in steps) + "    s/step  vs GRPO",
    ]
    for name in dict.fromkeys(r["algo"] for r in runs):
        mine = [r for r in runs if r["algo"] == name]
        cells = ""
        for s in steps:
            m = mean_std(accuracy_at_step(r, s) for r in mine)
            cells += f"{m['mean']:>7.3f}±{m['std']:<5.3f}"
        wall = np.mean([median_step_s(r, iterations + 1) for r in mine])
        ratio = f"{wall / base:6.3f}x" if base else ""
        lines.append(f"{LABELS.get(name, name):<13}{cells}  {wall:7.2f}  {ratio}")
    stages = ("sample", "learner_update_timer", "replay_choice", "buffer_update")
    extra = [
        "",
        "median seconds per stage of a step (this project's algorithms; PPO has no stage timers):",
        f"{'method':<13}" + "".join(f"{st:>22}" for st in stages),
    ]
    for name in dict.fromkeys(r["algo"] for r in runs):
        mine = [s["stage_s"] for r in runs if r["algo"] == name for s in r["steps"][1:iterations]]
        if mine and any(mine):
            extra.append(f"{LABELS.get(name, name):<13}" + "".join(f"{np.median([m.get(st, 0.0) for m in mine]):>22.3f}" for st in stages))
    extra.append("")
    for name in dict.fromkeys(r["algo"] for r in runs):
        mine = [r for r in runs if r["algo"] == name]
        if any(s["experience"].get("replayed_questions", 0) > 0 for r in mine for s in r["steps"]):
            switch = [int(r["steps"][-1]["experience"].get("switch_iteration", -1)) for r in mine]
            extra.append(f"{LABELS.get(name, name)}: switch to mixed mode at step {switch} (per seed; -1 = never)")
        rates = [rescue_rate(r) for r in mine]
        if any(not math.isnan(x) for x in rates):
            seeded = [sum(s["xrpo"].get("seeded_questions", 0.0) for s in r["steps"]) for r in mine]
            extra.append(
                f"{LABELS.get(name, name)}: in-context seeding rescued "
                + ", ".join(f"{x:.1%}" for x in rates)
                + " of the seeded all-failing questions "
                f"(per seed; {', '.join(str(int(n)) for n in seeded)} seeded)"
            )
    return lines + extra


def write_csv(runs, path: Path):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "seed", "step", "sampled_tokens", "heldout_accuracy", "median_step_s"])
        for r in runs:
            for e in r["evals"]:
                w.writerow([r["algo"], r["seed"], e["step"], int(e["tokens"]), f"{e['accuracy']:.4f}", f"{median_step_s(r):.3f}"])


def main():
    args, out, runs = collect_from_command_line(__doc__, ["grpo", "exgrpo", "xrpo", "exgrpo_xrpo"])
    write_csv(runs, out / "learning_curves.csv")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    plot_curves(runs, ax, x="step", iterations=args.iterations)
    ax.set_title("Embedded default: tiny Qwen2 on arithmetic, CPU")
    fig.tight_layout()
    fig.savefig(out / "learning_curves.png", dpi=120)
    print("\n" + "\n".join(summary_lines(runs, args.iterations)))
    print(f"\nwrote {out / 'learning_curves.png'} and {out / 'learning_curves.csv'}")


if __name__ == "__main__":
    main()
