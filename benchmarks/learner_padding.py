"""Token positions and time of a learner update: rows cut into passes vs token-budget passes.

    python benchmarks/learner_padding.py [--seeds 5] [--scale 32] [--repeats 3] [--timing-rows 128]
    python benchmarks/learner_padding.py --seeds 1 --scale 256 --repeats 1 --timing-rows 16   # seconds

The length mix (declared, long-tailed as RLVR completions are): per learner 128 rows, the
7B recipe's ``minibatch_size`` (tuned_examples/exgrpo_qwen.yaml); prompts log-normal with
median 150 tokens and sigma 0.35, clipped to [30, 1024] (``max_prompt_tokens``); completions
log-normal with median 700 and sigma 0.8, clipped to [16, 8192] (``max_response_tokens``),
and 3% of them run to the 8192 cap (unfinished answers). Seeded draws, one per seed.

Counted at full size (no model needed: the planner of ``core/minibatches.py`` and the
layouts of ``core/columns.py`` / ``core/packing.py``), token positions a learner computes
over the real tokens of its rows:

* ``rows``: passes of ``learner_micro_batch_rows`` = 4 rows (the recipe's setting), every
  row as wide as the minibatch's longest prompt + longest completion (the learner shard is
  not trimmed per pass);
* ``sorted``: ``learner_micro_batch_tokens`` = 36864 (4 x (1024 + 8192), the same activation
  memory as the rows setting at full width) with ``learner_sequence_packing: false``: rows
  sorted by length, each pass trimmed to its own longest row;
* ``packed``: the same budget, packed end to end without padding (the default).

Timed on CPU: one learner update (``LearnerGroup.update``, forward + backward of every pass
and the AdamW step) of the same rows with lengths divided by ``--scale`` (32: completions up
to 256 tokens), on ``rehearsal:qwen2`` (a random Qwen2 of hidden size 128 and 2 layers, no
download), for each layout; median of ``--repeats`` updates after one warm-up
(``--timing-rows``: the first that many rows of the mix, 128 by default). The last
line is ``padded_over_real=X``: the packed layout's positions over real tokens, the worst
seed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = 128
MICRO_ROWS = 4
BUDGET = 4 * (1024 + 8192)


def length_mix(seed: int, rows: int = ROWS):
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(150), 0.35, rows), 30, 1024).astype(np.int64)
    completion = np.clip(rng.lognormal(np.log(700), 0.8, rows), 16, 8192).astype(np.int64)
    completion[rng.random(rows) < 0.03] = 8192
    return prompt, completion


def positions(prompt, completion, budget=BUDGET):
    """Token positions of each layout (see the module doc) and the real tokens."""
    from rllib_exgrpo.core.minibatches import padded_positions, plan_micro_batches

    real = int(prompt.sum() + completion.sum())
    rows = len(prompt) * int(prompt.max() + completion.max())
    sorted_passes = plan_micro_batches(prompt, completion, max_tokens=budget)
    packed_passes = plan_micro_batches(prompt, completion, max_tokens=budget, packed=True)
    return {
        "real": real,
        "rows": rows,
        "sorted": padded_positions(prompt, completion, sorted_passes),
        "packed": padded_positions(prompt, completion, packed_passes, packed=True),
        "passes": {"rows": -(-len(prompt) // MICRO_ROWS), "sorted": len(sorted_passes), "packed": len(packed_passes)},
    }


def _batch(prompt, completion, vocab: int, seed: int):
    from rllib_exgrpo.core.groups import Trajectory, learner_batch

    rng = np.random.default_rng(seed)
    trajs = [
        Trajectory(
            f"q{i // 8}",
            rng.integers(5, vocab, size=int(p)),
            rng.integers(5, vocab, size=int(c)),
            np.full(int(c), -2.0, np.float32),
            float(i % 2),
            off_policy=(i % 4 == 3),
        )
        for i, (p, c) in enumerate(zip(prompt, completion))
    ]
    adv = rng.normal(size=len(trajs)).astype(np.float32)
    return learner_batch(trajs, adv, pad_id=0)


def time_update(prompt, completion, scale: int, repeats: int, seed: int, rows: int = ROWS):
    """Median seconds of one learner update per layout, lengths divided by ``scale``."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rllib_exgrpo.core.groups import to_multi_agent_batch
    from rllib_exgrpo.models.loading import load_tokenizer
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
    from rllib_exgrpo.rllib.env_runner import token_spaces

    p = np.maximum(1, prompt[:rows] // scale)
    c = np.maximum(1, completion[:rows] // scale)
    max_p, max_c = 1024 // scale, 8192 // scale
    layouts = {
        "rows": {"learner_micro_batch_rows": MICRO_ROWS},
        "sorted": {"learner_micro_batch_tokens": BUDGET // scale, "learner_sequence_packing": False},
        "packed": {"learner_micro_batch_tokens": BUDGET // scale},
    }
    seconds = {}
    for name, fields in layouts.items():
        cfg = ExGRPOConfig().training(
            model_name_or_path="rehearsal:qwen2",
            max_prompt_tokens=max_p,
            max_response_tokens=max_c,
            lr=1e-6,
            minibatch_size=len(p),
            loss_agg_mode="seq-mean-token-sum-norm-official",
            entropy_coeff=0.001,
            **fields,
        )
        vocab = len(load_tokenizer("rehearsal:qwen2"))
        group = cfg.build_learner_group(spaces={DEFAULT_MODULE_ID: token_spaces(vocab, max_p, max_c)})
        batch = to_multi_agent_batch(_batch(p, c, vocab, seed))
        group.update(batch=batch)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            group.update(batch=batch)
            times.append(time.perf_counter() - t0)
        seconds[name] = statistics.median(times)
        group.shutdown()
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--scale", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timing-rows", type=int, default=ROWS, help="rows of the timed update (the first of the mix)")
    ap.add_argument("--no-timing", action="store_true", help="count positions only")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    worst = {"rows": 0.0, "sorted": 0.0, "packed": 0.0}
    print(f"{ROWS} rows per learner; budget {BUDGET} tokens; positions computed / real tokens (passes)")
    for seed in range(args.seeds):
        prompt, completion = length_mix(seed)
        pos = positions(prompt, completion)
        ratios = {k: pos[k] / pos["real"] for k in worst}
        worst = {k: max(worst[k], ratios[k]) for k in worst}
        print(
            f"  seed {seed}: real {pos['real']} tokens (longest row {int((prompt + completion).max())}); "
            + ", ".join(f"{k} {ratios[k]:.3f} ({pos['passes'][k]})" for k in worst)
        )
    if not args.no_timing:
        prompt, completion = length_mix(0)
        secs = time_update(prompt, completion, args.scale, args.repeats, seed=0, rows=args.timing_rows)
        print(
            f"learner update of {min(args.timing_rows, ROWS)} rows on rehearsal:qwen2, lengths / {args.scale}, "
            f"1 thread, median of {args.repeats}: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in secs.items())
            + f"; packed / rows = {secs['packed'] / secs['rows']:.2f}"
        )
    print(f"padded_over_real_rows={worst['rows']:.3f}")
    print(f"padded_over_real_sorted={worst['sorted']:.3f}")
    print(f"padded_over_real={worst['packed']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
