"""How ExperienceBuffer scales with the pool size (rllib_exgrpo/exgrpo/buffer.py).

For pool sizes 10^3 .. 10^6 questions (1-2 stored trajectories each), time

* add: ``update_group`` of a new question (microseconds per call),
* sample: ``sample_questions(64)`` (microseconds per *sampled question*), Gaussian and
  uniform weighting,
* retire: ``update_group`` with ``num_correct == G`` of a pooled question (us per call),

and report the bytes per stored response token (int32 ids + float16 log-probs) and the
process memory growth per question (Python object overhead included). Each size runs in
its own subprocess so that the memory numbers do not mix.

Trajectory lengths are uniform in 64..200 tokens up to 10^5 questions; the 10^6 case uses
16..48 tokens to stay within a couple of GB (the per-question costs do not depend on the
length, apart from copying the arrays on add).

The last line gives the figures of the largest size: ``pool=N add_us=.. sample_us_per_q=..
retire_us=.. bytes_per_token=.. overhead_bytes_per_q=..``.

Usage: ``python benchmarks/buffer_scaling.py [--sizes 1000 10000 100000 1000000]``
(``--sizes 1000``: a few seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rllib_exgrpo.exgrpo.buffer import ExperienceBuffer  # noqa: E402

G = 8
PROMPT_LEN = 32


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _time_sampling(b: ExperienceBuffer, calls: int = 600, repeats: int = 5) -> float:
    """Best of ``repeats`` runs of ``calls`` x sample_questions(64), per sampled question."""
    b.sample_questions(64)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            b.sample_questions(64)
        best = min(best, time.perf_counter() - t)
    return best / (calls * 64)


def run_one(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lo, hi = (64, 200) if n <= 100_000 else (16, 48)
    n_traj = rng.integers(1, 3, size=n)  # 1 or 2 trajectories per question
    lengths = rng.integers(lo, hi + 1, size=int(n_traj.sum()))
    total = int(lengths.sum())
    # One flat source array; the buffer copies each slice into its own compact arrays.
    ids_src = rng.integers(0, 150_000, size=total, dtype=np.int32)
    logp_src = -rng.exponential(1.0, size=total).astype(np.float32)
    prompt_src = rng.integers(0, 150_000, size=PROMPT_LEN, dtype=np.int32)
    buckets = rng.integers(1, G, size=n)
    qids = [f"q{i}" for i in range(n)]

    buf = ExperienceBuffer(G, capacity=2 * n + 10, seed=seed)
    rss0 = _rss_bytes()
    off = 0
    t_idx = 0
    t0 = time.perf_counter()
    for i in range(n):
        trajs = []
        for _ in range(int(n_traj[i])):
            L = int(lengths[t_idx])
            trajs.append((ids_src[off : off + L], logp_src[off : off + L]))
            off += L
            t_idx += 1
        buf.update_group(qids[i], prompt_src, int(buckets[i]), G, trajs, 0)
    t_add = time.perf_counter() - t0
    rss1 = _rss_bytes()
    assert len(buf) == n

    t_sample = _time_sampling(buf)
    # The same pool in uniform mode (switching the private mode fields avoids a rebuild).
    buf.bucket_weighting, buf._logw, saved = "uniform", None, buf._logw
    t_sample_uniform = _time_sampling(buf)
    buf.bucket_weighting, buf._logw = "gaussian", saved

    stats = buf.stats()
    n_retire = min(10_000, n // 2)
    victims = rng.choice(n, size=n_retire, replace=False)
    t0 = time.perf_counter()
    for i in victims:
        buf.update_group(qids[i], prompt_src, G, G, [], 1)
    t_retire = time.perf_counter() - t0
    assert buf.num_retired == n_retire and len(buf) == n - n_retire

    return {
        "pool": n,
        "tokens_per_traj": f"{lo}-{hi}",
        "trajectories": stats["num_trajectories"],
        "tokens": stats["num_tokens"],
        "add_us": 1e6 * t_add / n,
        "sample_us_per_q": 1e6 * t_sample,
        "sample_uniform_us_per_q": 1e6 * t_sample_uniform,
        "retire_us": 1e6 * t_retire / n_retire,
        "bytes_per_token": stats["bytes_per_token"],
        "nbytes_mb": stats["nbytes"] / 2**20,
        "rss_mb": (rss1 - rss0) / 2**20,
        "rss_overhead_per_q": (rss1 - rss0 - stats["nbytes"]) / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[1_000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.one)))
        return
    rows = []
    for n in args.sizes:
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--one", str(n)],
            check=True,
            capture_output=True,
            text=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    header = (
        f"{'pool':>9} {'tok/traj':>8} {'trajs':>9} {'add us':>7} {'sample us/q':>11} "
        f"{'uniform us/q':>12} {'retire us':>9} {'B/token':>7} {'arrays MB':>9} "
        f"{'RSS MB':>8} {'overhead B/q':>12}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['pool']:>9} {r['tokens_per_traj']:>8} {r['trajectories']:>9} {r['add_us']:>7.1f} "
            f"{r['sample_us_per_q']:>11.2f} {r['sample_uniform_us_per_q']:>12.2f} "
            f"{r['retire_us']:>9.1f} {r['bytes_per_token']:>7.2f} {r['nbytes_mb']:>9.1f} "
            f"{r['rss_mb']:>8.1f} {r['rss_overhead_per_q']:>12.0f}"
        )
    print(
        "\nsample us/q = wall time of sample_questions(64) / 64 (best of 5 x 600 calls); B/token = bytes of "
        "stored ids + log-probs per response token;\narrays MB = nbytes() (ids + log-probs + "
        "prompts); overhead B/q = (RSS growth - nbytes) / pooled question (Python objects)."
    )
    r = rows[-1]  # the figures of the largest pool
    print(
        f"pool={r['pool']} add_us={r['add_us']:.2f} sample_us_per_q={r['sample_us_per_q']:.3f} "
        f"retire_us={r['retire_us']:.2f} bytes_per_token={r['bytes_per_token']:.2f} "
        f"overhead_bytes_per_q={r['rss_overhead_per_q']:.0f}"
    )


if __name__ == "__main__":
    main()
