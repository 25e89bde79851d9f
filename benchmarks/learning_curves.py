"""Held-out accuracy against training steps for GRPO, ExGRPO, XRPO and ExGRPO+XRPO.

    python benchmarks/learning_curves.py [--algos grpo exgrpo xrpo exgrpo_xrpo]
        [--seeds 0 1 2] [--iterations 40] [--eval-interval 10] [--out benchmarks/out]

Each (algorithm, seed) run trains the embedded default (tiny model, arithmetic family;
settings from tuned_examples/*_tiny.yaml) for the same number of steps and evaluates the
held-out set (greedy, 200 questions) every ``--eval-interval`` steps and at the end.
Writes ``learning_curves.png``, ``learning_curves.csv`` and prints a table of mean and
spread per step, the wall time per step of each algorithm and its ratio to GRPO's.
"""
from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import numpy as np

from _common import ROOT, recipe_config, start_ray


def run(name: str, seed: int, iterations: int, eval_interval: int, overrides: dict) -> dict:
    config = recipe_config(name, seed=seed, heldout_interval=eval_interval, **overrides)
    algo = config.build_algo()
    curve, tokens, step_walls = {}, 0, []
    try:
        for _ in range(iterations):
            t0 = time.perf_counter()
            result = algo.train()
            step_walls.append(time.perf_counter() - t0)
            runners = result["env_runners"]
            tokens += float(runners["response_length_mean"]) * float(runners["num_episodes"])
            held = result.get("heldout", {})
            if held and np.isfinite(held.get("accuracy", np.nan)) and np.isfinite(held.get("after_iteration", np.nan)):
                curve[int(held["after_iteration"])] = float(held["accuracy"])
            if held and np.isfinite(held.get("initial_accuracy", np.nan)):
                curve.setdefault(0, float(held["initial_accuracy"]))
        if iterations not in curve:
            curve[iterations] = algo.evaluate_heldout()["accuracy"]
        experience = result.get("experience", {})
    finally:
        algo.stop()
    return {
        "algo": name, "seed": seed, "curve": curve, "sampled_tokens": tokens,
        # The median leaves out the steps that also ran a held-out evaluation.
        "step_wall_s": float(np.median(step_walls)),
        "total_wall_s": float(sum(step_walls)),
        "switch_iteration": experience.get("switch_iteration"),
    }


def plot(runs, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["algo"] for r in runs):
        mine = [r for r in runs if r["algo"] == name]
        steps = sorted(mine[0]["curve"])
        acc = np.array([[r["curve"][s] for s in steps] for r in mine])
        mean, lo, hi = acc.mean(0), acc.min(0), acc.max(0)
        ax.plot(steps, mean, marker="o", label=f"{name} (n={len(mine)})")
        ax.fill_between(steps, lo, hi, alpha=0.15)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title("Embedded default: tiny Qwen2 on arithmetic, CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=["grpo", "exgrpo", "xrpo", "exgrpo_xrpo"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    parser.add_argument("--config", default="{}", help="JSON config overrides for every run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start_ray()
    runs = []
    for seed in args.seeds:
        for name in args.algos:
            r = run(name, seed, args.iterations, args.eval_interval, json.loads(args.config))
            runs.append(r)
            print(f"{name} seed {seed}: {r['curve']}  ({r['step_wall_s']:.2f} s/step)", flush=True)
    with open(out / "learning_curves.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["algo", "seed", "step", "heldout_accuracy", "sampled_tokens", "step_wall_s"])
        for r in runs:
            for step, acc in sorted(r["curve"].items()):
                w.writerow([r["algo"], r["seed"], step, f"{acc:.4f}", int(r["sampled_tokens"]), f"{r['step_wall_s']:.3f}"])
    plot(runs, out / "learning_curves.png")
    steps = sorted(runs[0]["curve"])
    print("\nheld-out accuracy, mean ± std over seeds")
    print("algo          " + "".join(f"{s:>14}" for s in steps) + "   s/step  vs GRPO")
    base = np.mean([r["step_wall_s"] for r in runs if r["algo"] == "grpo"]) if any(r["algo"] == "grpo" for r in runs) else None
    for name in dict.fromkeys(r["algo"] for r in runs):
        mine = [r for r in runs if r["algo"] == name]
        acc = np.array([[r["curve"][s] for s in steps] for r in mine])
        wall = np.mean([r["step_wall_s"] for r in mine])
        ratio = f"{wall / base:6.3f}x" if base else ""
        cells = "".join(f"{m:>8.3f}±{s:<5.3f}" for m, s in zip(acc.mean(0), acc.std(0)))
        print(f"{name:<14}{cells}  {wall:6.2f}  {ratio}")
    print(f"\nwrote {out / 'learning_curves.png'} and {out / 'learning_curves.csv'}")


if __name__ == "__main__":
    main()
