"""Our GRPO side by side with TRL's ``GRPOTrainer``: same model, prompts, settings, evaluator.

    .venv/bin/python benchmarks/peer_trl.py                 # 3 seeds x 40 iterations, both
    .venv/bin/python benchmarks/peer_trl.py --seeds 0 --iterations 5
    .venv/bin/python benchmarks/peer_trl.py --seeds 0 --iterations 1 --heldout 8 --out /tmp/peer_trl   # small

* **Model**: the embedded tiny model (``model_name_or_path: tiny``), the same folder for both.
* **Prompts**: iteration i of seed s trains on the 32 questions our ``QuestionSampler``
  draws at step i with seed s, rendered by ``ReasoningEnv``; TRL gets exactly those prompts
  in that order (``benchmarks/_trl_venv.py`` builds them, ``_trl_grpo_runner.py`` keeps the
  order and checks it).
* **Settings** (``tuned_examples/grpo_stream_tiny.yaml`` and the runner's ``DEFAULT_SETTINGS``):
  B = 32 x G = 8, 48 new tokens, temperature 1, top-p 1, no top-k, lr 3e-4 constant,
  AdamW (weight decay 0.01 on every parameter), 2 optimiser steps of 128 completions per
  iteration, Dr.GRPO advantages (r - mean), token-mean loss (TRL: ``dapo``), no KL, clip
  0.2, grad clip 1.0. TRL 1.16 runs in its own venv (``benchmarks/out/trl-venv``, created on
  first use; TRL is not a project dependency).
* **Score**: both final models by our own ``rllib evaluate --data arithmetic --temperature 0
  --limit 200 --max-new-tokens 48`` (the 200 held-out questions a run monitors, the
  training completion budget), and the starting model too.
* **Time**: median seconds per iteration: ours from Tune's ``time_this_iter_s`` (sample +
  score + learn + weight sync; no held-out evaluation during these runs), TRL's from the
  start of an iteration's first optimiser step to the end of its second (generation,
  reward, old log-probs, both steps).

The runs are made one after another (never two at once: they share the cores). Finished
runs are cached under ``--out`` (default ``benchmarks/out/peer_trl/``; delete a folder to
redo it; a small check belongs in a folder of its own, as the cache is keyed by seed).
Prints the table and writes ``peer_trl.json``, ``peer_trl.csv`` and ``peer_trl.png`` there.
``--heldout`` scores on fewer held-out questions (200 by default). The last line is
``ours_over_trl_time=R gain_ours_minus_trl=P`` (the mean ratio of median seconds per
iteration; held-out gain difference in points).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _trl_venv import ensure_trl_venv, run_trl, trl_inputs  # noqa: E402

OUT = ROOT / "benchmarks" / "out" / "peer_trl"
RLLIB = str(Path(sys.executable).with_name("rllib"))
RECIPE = ROOT / "tuned_examples" / "grpo_stream_tiny.yaml"
HELDOUT = 200
#: The recipe's max_response_tokens: the same completion budget for every model evaluated.
MAX_NEW_TOKENS = 48


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def evaluate(model: str, dest: Path, heldout: int = HELDOUT) -> float:
    """Greedy accuracy of ``model`` (name, folder or checkpoint) on the held-out questions."""
    if not dest.exists():
        subprocess.run(
            [
                RLLIB,
                "evaluate",
                "--model",
                model,
                "--data",
                "arithmetic",
                "--temperature",
                "0",
                "--limit",
                str(heldout),
                "--max-new-tokens",
                str(MAX_NEW_TOKENS),
                "--output",
                str(dest),
            ],
            check=True,
            env=_env(),
            stdout=subprocess.DEVNULL,
        )
    return _accuracy(json.loads(dest.read_text()))


def _accuracy(report: dict) -> float:
    return float(report["overall"]["avg_at_k"])


def run_ours(seed: int, iterations: int, overrides: dict, tag: str, out: Path = OUT) -> dict:
    """``rllib train file tuned_examples/grpo_stream_tiny.yaml`` for one seed; per-iteration times."""
    where = out / tag / f"seed{seed}"
    summary = where / "summary.json"
    if summary.exists():
        return json.loads(summary.read_text())
    where.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    subprocess.run(
        [
            RLLIB,
            "train",
            "file",
            str(RECIPE),
            "--storage-path",
            str(where / "runs"),
            "--stop",
            json.dumps({"training_iteration": iterations}),
            "--config",
            json.dumps({**overrides, "seed": seed, "heldout_dataset": None}),
        ],
        check=True,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=(where / "train.log").open("w"),
    )
    wall = time.perf_counter() - start
    (result_file,) = (where / "runs").glob("*/*/result.json")
    rows = [json.loads(line) for line in result_file.read_text().splitlines() if line.strip()]
    checkpoints = sorted(result_file.parent.glob("checkpoint_*"))
    out = {
        "seed": seed,
        "iterations": len(rows),
        "s_per_iteration": [r["time_this_iter_s"] for r in rows],
        "sample_s": [r["step_time_s"]["sample"] for r in rows],
        "learner_s": [r["step_time_s"]["learner_update_timer"] for r in rows],
        "reward_mean": [r["reward_mean"] for r in rows],
        "checkpoint": str(checkpoints[-1]),
        "total_s": wall,
    }
    summary.write_text(json.dumps(out, indent=1))
    return out


def run_theirs(seed: int, iterations: int, out: Path = OUT) -> dict:
    where = out / "trl" / f"seed{seed}"
    result = where / "trl_result.json"
    if result.exists():
        return json.loads(result.read_text())
    return run_trl(trl_inputs(seed, iterations, output_dir=str(where)))


def _mean_sd(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument(
        "--config", type=json.loads, default={}, help="JSON overrides of our recipe (an ablation; its runs are cached under --tag)"
    )
    ap.add_argument("--tag", default="ours", help="cache folder of our runs (default: ours)")
    ap.add_argument("--heldout", type=int, default=HELDOUT, help="held-out questions scored")
    ap.add_argument("--out", type=Path, default=OUT, help="runs, evaluations and the report")
    return ap.parse_args(argv)


def _compare_seed(seed: int, args, out: Path) -> dict:
    """Both trainings of one seed (cached), each trained model's held-out accuracy, and
    their timings and training curves."""
    ours = run_ours(seed, args.iterations, args.config, args.tag, out)
    theirs = run_theirs(seed, args.iterations, out)
    return {
        "seed": seed,
        "ours_acc": evaluate(ours["checkpoint"], out / f"eval_{args.tag}_seed{seed}.json", args.heldout),
        "trl_acc": evaluate(theirs["model_dir"], out / f"eval_trl_seed{seed}.json", args.heldout),
        "ours_s_it": statistics.median(ours["s_per_iteration"]),
        "trl_s_it": float(theirs["median_s_per_iteration"]),
        "ours_sample_s": statistics.median(ours["sample_s"]),
        "ours_learner_s": statistics.median(ours["learner_s"]),
        "trl_generate_s": float(theirs["median_generate_s"]),
        "ours_curve": ours["s_per_iteration"],
        "trl_curve": [it["wall_s"] for it in theirs["iterations"]],
        "ours_reward": ours["reward_mean"],
        "trl_reward": [it["reward_mean"] for it in theirs["iterations"]],
    }


def _print_report(args, rows, start_acc: float, ours_gain, trl_gain, ratio) -> None:
    """The per-seed table (accuracy, gain, seconds per iteration) and the ours-over-TRL figures."""
    print(f"\nheld-out greedy accuracy on {args.heldout} arithmetic test questions; start {start_acc:.3f}")
    print(
        "| | held-out after {} it. ({}) | gain (mean +- sd) | median s / iteration |".format(
            args.iterations, " / ".join(f"seed {r['seed']}" for r in rows)
        )
    )
    print("|---|---|---|---|")
    for name, acc, gain, t in (
        ("TRL GRPOTrainer", "trl_acc", trl_gain, "trl_s_it"),
        ("rllib-exgrpo GRPO", "ours_acc", ours_gain, "ours_s_it"),
    ):
        m, sd = _mean_sd(gain)
        print(
            f"| {name} | {' / '.join(f'{r[acc]:.3f}' for r in rows)} | {100 * m:+.1f} +- {100 * sd:.1f} points | "
            f"{' / '.join(f'{r[t]:.2f}' for r in rows)} |"
        )
    print(
        f"\ntime ratio ours / TRL (per seed): {' / '.join(f'{x:.2f}' for x in ratio)}; mean {statistics.mean(ratio):.2f}x (target <= 0.90x)"
    )
    print(f"gain ours - TRL: {100 * (statistics.mean(ours_gain) - statistics.mean(trl_gain)):+.1f} points (target >= 0)")
    print(
        f"ours: median sample {statistics.median(r['ours_sample_s'] for r in rows):.2f} s, learner "
        f"{statistics.median(r['ours_learner_s'] for r in rows):.2f} s; TRL generate "
        f"{statistics.median(r['trl_generate_s'] for r in rows):.2f} s"
    )


def main(argv=None) -> int:
    args = _parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    from rllib_exgrpo.models import resolve_model_path

    resolve_model_path("tiny")  # build the shared starting model once, before timing anything
    ensure_trl_venv(verbose=True)
    start_acc = evaluate("tiny", out / "eval_start.json", args.heldout)

    rows = []
    for seed in args.seeds:
        rows.append(_compare_seed(seed, args, out))
        print(
            f"seed {seed}: ours {rows[-1]['ours_acc']:.3f} ({rows[-1]['ours_s_it']:.2f} s/it), "
            f"TRL {rows[-1]['trl_acc']:.3f} ({rows[-1]['trl_s_it']:.2f} s/it)",
            flush=True,
        )

    ours_gain = [r["ours_acc"] - start_acc for r in rows]
    trl_gain = [r["trl_acc"] - start_acc for r in rows]
    ratio = [r["ours_s_it"] / r["trl_s_it"] for r in rows]
    _print_report(args, rows, start_acc, ours_gain, trl_gain, ratio)

    summary = {
        "start_accuracy": start_acc,
        "iterations": args.iterations,
        "rows": rows,
        "ours_gain": ours_gain,
        "trl_gain": trl_gain,
        "time_ratio": ratio,
    }
    name = "peer_trl" if args.tag == "ours" else f"peer_trl_{args.tag}"
    summary["ours_config"] = args.config
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1))
    with (out / f"{name}.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["seed", "ours_acc", "trl_acc", "ours_s_per_it", "trl_s_per_it"])
        for r in rows:
            w.writerow([r["seed"], r["ours_acc"], r["trl_acc"], r["ours_s_it"], r["trl_s_it"]])
    _plot(rows, start_acc, out / f"{name}.png", args.heldout)
    print(f"wrote {out / name}.json, .csv, .png")
    print(
        f"ours_over_trl_time={statistics.mean(ratio):.3f} "
        f"gain_ours_minus_trl={100 * (statistics.mean(ours_gain) - statistics.mean(trl_gain)):.1f}"
    )
    return 0


def _plot(rows, start_acc, dest: Path, heldout: int = HELDOUT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    seeds = [r["seed"] for r in rows]
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r["trl_acc"] for r in rows], 0.4, label="TRL GRPOTrainer")
    a.bar([i + 0.2 for i in x], [r["ours_acc"] for r in rows], 0.4, label="rllib-exgrpo GRPO")
    a.axhline(start_acc, color="k", ls="--", lw=1, label="start")
    a.set_xticks(list(x), [f"seed {s}" for s in seeds])
    a.set_ylabel(f"held-out greedy accuracy ({heldout} q.)")
    a.legend()
    for r in rows:
        b.plot(r["trl_reward"], color="tab:blue", alpha=0.6)
        b.plot(r["ours_reward"], color="tab:orange", alpha=0.6)
        c.plot(r["trl_curve"], color="tab:blue", alpha=0.6)
        c.plot(r["ours_curve"], color="tab:orange", alpha=0.6)
    b.set_xlabel("iteration"), b.set_ylabel("training reward mean")
    c.set_xlabel("iteration"), c.set_ylabel("s / iteration"), c.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
