"""Verifications per second of the reward, single-call and batched.

Workloads:
  * math500 answers: each row's own ground truth (correct) and the next row's different
    answer (incorrect), boxed; the fast path is off so every pair goes through math-verify.
  * arithmetic answers: 256-completion "training steps" (half right, half wrong), as the
    trainer sees them (fast path on) and all through math-verify.

The last line: ``arithmetic_batched_per_s=A arithmetic_verify_per_s=B arithmetic_single_per_s=C``
(verifications per second: batched with the fast path, batched all through math-verify,
single calls), after ``math500_correct_batched_per_s=D math500_incorrect_batched_per_s=E``
when the math500 file is there.

Usage: python benchmarks/reward_throughput.py [--data ../shared/data] [--workers N] [--limit 500] [--steps 10]
       python benchmarks/reward_throughput.py --limit 16 --steps 1 --workers 1     # seconds
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rllib_exgrpo.envs import arithmetic  # noqa: E402
from rllib_exgrpo.envs import rewards  # noqa: E402
from rllib_exgrpo.envs.datasets import load_problems  # noqa: E402


def _rate(n: int, seconds: float) -> str:
    return f"{n / seconds:8.1f} /s  ({n} in {seconds:.2f} s, {1000 * seconds / n:.2f} ms each)"


def _single(completions, truths, fast_path: bool) -> float:
    start = time.perf_counter()
    for c, t in zip(completions, truths):
        rewards.math_reward(c, t, fast_path=fast_path)
    return time.perf_counter() - start


def _batched(completions, truths, fast_path: bool, workers) -> float:
    start = time.perf_counter()
    rewards.score_batch(completions, truths, fast_path=fast_path, num_workers=workers)
    return time.perf_counter() - start


def _math500_pairs(path: Path, limit: int):
    truths = [p.ground_truth for p in load_problems(path, strict=True)][:limit]
    wrong = []
    for i, t in enumerate(truths):
        wrong.append(
            next(truths[(i + j) % len(truths)] for j in range(1, len(truths)) if truths[(i + j) % len(truths)].strip() != t.strip())
        )
    return truths, wrong


def _step_data(step, k):
    """One training step's completions and ground truths: half right, half wrong, all
    distinct answers (the expensive case)."""
    comps = [
        p.solution if (i + k) % 2 == 0 else p.solution.replace(f"\\boxed{{{p.ground_truth}}}", f"\\boxed{{{int(p.ground_truth) + 1}}}")
        for i, p in enumerate(step)
    ]
    return comps, [p.ground_truth for p in step]


def _parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    ap.add_argument("--workers", type=int, default=None, help="verifier processes (default: pool default)")
    ap.add_argument("--limit", type=int, default=500, help="math500 rows to use")
    ap.add_argument("--steps", type=int, default=10, help="arithmetic training steps of 256 completions")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = _parse_args(argv)

    t0 = time.perf_counter()
    rewards.warm_up(args.workers)
    print(f"pool: {args.workers or rewards.default_num_workers()} worker process(es), started in {time.perf_counter() - t0:.2f} s")

    figures = {}
    math500 = args.data / "simplerl_eval" / "math500_test.jsonl"
    if math500.exists():
        truths, wrong = _math500_pairs(math500, args.limit)
        for label, answers in (("correct", truths), ("incorrect", wrong)):
            completions = [f"The answer is \\boxed{{{a}}}." for a in answers]
            # Fresh answer strings per run would defeat math-verify's own parse caches in
            # the workers; the first (cold) run is the honest one, so batched goes first
            # on a restarted pool, then single on another restarted pool.
            rewards.shutdown_workers()
            rewards.warm_up(args.workers)
            seconds = _batched(completions, truths, False, args.workers)
            print(f"math500 {label:9s} batched: {_rate(len(answers), seconds)}")
            figures[f"math500_{label}_batched_per_s"] = len(answers) / seconds
            rewards.shutdown_workers()
            rewards.warm_up(args.workers)
            print(f"math500 {label:9s} single : {_rate(len(answers), _single(completions, truths, False))}")
    else:
        print(f"math500 skipped: {math500} absent")

    problems = arithmetic.generate(256 * args.steps, seed=0, levels=(1, 2, 3, 4))
    steps = [problems[i : i + 256] for i in range(0, len(problems), 256)]

    for fast_path in (True, False):
        rewards.shutdown_workers()
        rewards.warm_up(args.workers)
        times = [_batched(*_step_data(step, k), fast_path, args.workers) for k, step in enumerate(steps)]
        n = sum(len(s) for s in steps)
        print(
            f"arithmetic 256/step batched fast_path={fast_path!s:5}: {_rate(n, sum(times))}; "
            f"per step mean {1000 * sum(times) / len(times):.0f} ms, max {1000 * max(times):.0f} ms"
        )
        figures["arithmetic_batched_per_s" if fast_path else "arithmetic_verify_per_s"] = n / sum(times)
    rewards.shutdown_workers()
    rewards.warm_up(args.workers)
    comps, truths = _step_data(steps[0], 0)
    seconds = _single(comps, truths, False)
    print(f"arithmetic single (math_reward loop), fast_path=False: {_rate(len(comps), seconds)}")
    figures["arithmetic_single_per_s"] = len(comps) / seconds
    print(f"stats: {rewards.reward_stats()}")
    rewards.shutdown_workers()
    math500_figures = {k: v for k, v in figures.items() if k.startswith("math500")}
    if math500_figures:
        print(" ".join(f"{k}={v:.1f}" for k, v in math500_figures.items()))
    print(" ".join(f"{k}={figures[k]:.1f}" for k in ("arithmetic_batched_per_s", "arithmetic_verify_per_s", "arithmetic_single_per_s")))


if __name__ == "__main__":
    main()
