"""PPO (RLlib's own) vs GRPO vs ExGRPO vs XRPO (vs ExGRPO+XRPO) on the embedded default,
at the same budget of sampled completion tokens, 3 seeds each. One command:

    python experiments/compare.py [--algos ppo grpo exgrpo xrpo exgrpo_xrpo] [--seeds 0 1 2]
        [--iterations 40] [--eval-interval 10] [--out benchmarks/out]

Same model (the embedded tiny Qwen2), same task (arithmetic family), same questions x
samples per step (32 x 8), token limits, learning rate and optimiser steps per iteration
(tuned_examples/*_tiny.yaml). The budget of each seed is what GRPO samples in
``--iterations`` steps; every method trains until it has spent that budget (and done
``--iterations`` steps, so the same runs also serve learning_curves.py). Held-out accuracy is
measured identically for all (first 200 arithmetic test questions, greedy, outside training).

Writes ``compare.png`` (accuracy against steps and against sampled tokens, mean and
min-max band over seeds), ``compare.csv`` (every evaluation) and prints a table: accuracy at
the budget (mean ± std), steps used to spend it, training wall time to the budget and per step.
A killed run resumes: finished runs are cached under ``<out>/runs``.
"""

from __future__ import annotations

import numpy as np

import _paths  # noqa: F401  (benchmarks/ on sys.path: _common, _runs)
from _runs import (
    accuracy_at_step,
    accuracy_at_tokens,
    budget_of,
    collect_from_command_line,
    mean_std,
    median_step_s,
    steps_to_budget,
    wall_to,
)
from learning_curves import LABELS, plot_curves, summary_lines, write_csv


def budget_table(runs, seeds, iterations):
    budgets = {s: budget_of(runs, s, iterations) for s in seeds}
    lines = [
        f"sampled-token budget per seed (GRPO's tokens after {iterations} steps): "
        + ", ".join(f"seed {s}: {int(b):,}" for s, b in budgets.items()),
        "",
        f"{'method':<13}{'acc @ budget':>15}{'acc @ ' + str(iterations) + ' steps':>17}{'steps to budget':>17}"
        f"{'train wall to budget':>22}{'s/step':>9}",
    ]
    for name in dict.fromkeys(r["algo"] for r in runs):
        mine = [r for r in runs if r["algo"] == name]
        at_budget = mean_std(accuracy_at_tokens(r, budgets[r["seed"]]) for r in mine)
        at_steps = mean_std(accuracy_at_step(r, iterations) for r in mine)
        steps = [steps_to_budget(r, budgets[r["seed"]]) for r in mine]
        wall = [wall_to(r, n) for r, n in zip(mine, steps)]
        lines.append(
            f"{LABELS.get(name, name):<13}{at_budget['mean']:>9.3f}±{at_budget['std']:<5.3f}"
            f"{at_steps['mean']:>11.3f}±{at_steps['std']:<5.3f}"
            f"{np.mean(steps):>17.1f}{np.mean(wall) / 60:>18.1f} min{np.mean([median_step_s(r) for r in mine]):>9.2f}"
        )
    return budgets, lines


def main():
    args, out, runs = collect_from_command_line(__doc__, ["ppo", "grpo", "exgrpo", "xrpo", "exgrpo_xrpo"])
    write_csv(runs, out / "compare.csv")
    budgets, table = budget_table(runs, args.seeds, args.iterations)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    plot_curves(runs, left, x="step", iterations=args.iterations)
    plot_curves(runs, right, x="tokens", iterations=args.iterations, budget_by_seed=budgets)
    fig.suptitle(f"Embedded default (tiny Qwen2, arithmetic, CPU): same sampled-token budget, {len(args.seeds)} seeds")
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=120)
    print("\n" + "\n".join(table))
    print("\n" + "\n".join(summary_lines(runs, args.iterations)))
    print(f"\nwrote {out / 'compare.png'} and {out / 'compare.csv'}")


if __name__ == "__main__":
    main()
