"""Rollouts that overlap training against strict alternation, on the GRPO recipe.

    python benchmarks/async_rollouts.py [--seeds 0 1 2] [--iterations 80] [--out FILE] [--overrides JSON]
    python benchmarks/async_rollouts.py --seeds 0 --iterations 2 --overrides \
        '{"questions_per_step": 2, "minibatch_size": 16, "heldout_num_questions": 4, "heldout_interval": 2}'  # seconds

Declared before the runs: ``tuned_examples/grpo_tiny.yaml`` as written (32 questions x 8
completions per iteration, 200 held-out questions every 10 iterations, greedy), with one
remote env runner holding one CPU (``num_env_runners: 1``, ``num_cpus_per_env_runner: 1``)
and the learner in the main process (one CPU): each actor owns its CPU, as on GPUs each
owns its device. Two arms per seed, run one after the other in the same process:
``async_rollouts: false`` (strict alternation) and ``true`` (the runner collects step t+1
with step t's weights while the learner trains on step t). Both arms sample the same number
of completions per iteration, so equal iterations are equal sampled completions; the
sampled tokens of each arm are reported too.

Figures: the median wall time of an iteration (``Algorithm.train()``, held-out evaluations
excluded: iterations whose result carries a held-out evaluation are left out of the
median), and held-out accuracy at the last iteration, per seed and as the mean paired
difference (async - sync) over seeds. The last lines are
``async_over_sync_iteration_time=X`` (the median over seeds of each seed's ratio of
medians) and ``heldout_async_minus_sync=Y`` (mean over seeds, accuracy points). ``--overrides`` (JSON)
changes both arms' config (smaller iterations for a quick check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(seed: int, async_rollouts: bool, iterations: int, extra: dict | None = None):
    from rllib_exgrpo.cli.experiment import build_experiments

    overrides = {**(extra or {}), "seed": seed, "async_rollouts": async_rollouts, "num_env_runners": 1, "num_cpus_per_env_runner": 1}
    exp = build_experiments(
        str(ROOT / "tuned_examples" / "grpo_tiny.yaml"), config_overrides=overrides, stop={"training_iteration": iterations}
    )[0]
    return exp.config.build_algo()


def run_arm(seed: int, async_rollouts: bool, iterations: int, extra: dict | None = None) -> dict:
    algo = build(seed, async_rollouts, iterations, extra)
    times, evaluated, curve = [], [], []
    try:
        for _ in range(iterations):
            t0 = time.perf_counter()
            result = algo.train()
            times.append(time.perf_counter() - t0)
            evaluated.append("heldout" in result)
            if "heldout" in result:
                curve.append((result["training_iteration"], result["heldout"]["accuracy"]))
        tokens = result["env_runners"].get("num_response_tokens_lifetime")
    finally:
        algo.stop()
    plain = [t for t, e in zip(times, evaluated) if not e] or times
    return {
        "seed": seed,
        "async": async_rollouts,
        "median_iteration_s": statistics.median(plain),
        "heldout_final": curve[-1][1] if curve else float("nan"),
        "curve": curve,
        "sampled_tokens": tokens,
        "iterations": iterations,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=80)
    ap.add_argument("--out", type=Path, default=None, help="write every arm's figures as JSON")
    ap.add_argument("--overrides", type=json.loads, default={}, help="JSON config overrides of both arms")
    args = ap.parse_args(argv)
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tempfile.mkdtemp(prefix="ray-async-"))
    arms = []
    try:
        for seed in args.seeds:
            for mode in (False, True):
                arm = run_arm(seed, mode, args.iterations, args.overrides)
                arms.append(arm)
                print(
                    f"seed {seed} {'async' if mode else 'sync '}: median iteration {arm['median_iteration_s']:.2f} s, "
                    f"held-out {arm['heldout_final']:.3f} at iteration {args.iterations}, "
                    f"{arm['sampled_tokens']} sampled tokens",
                    flush=True,
                )
    finally:
        ray.shutdown()
    ratios, diffs = [], []
    for seed in args.seeds:
        sync, asyn = (next(a for a in arms if a["seed"] == seed and a["async"] is m) for m in (False, True))
        ratios.append(asyn["median_iteration_s"] / sync["median_iteration_s"])
        diffs.append(100 * (asyn["heldout_final"] - sync["heldout_final"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(arms, indent=1))
    spread = f" (per seed: {', '.join(f'{d:+.1f}' for d in diffs)})"
    print(f"iteration time async / sync per seed: {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"held-out accuracy async - sync, points{spread}")
    print(f"async_over_sync_iteration_time={statistics.median(ratios):.3f}")
    print(f"heldout_async_minus_sync={statistics.mean(diffs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
