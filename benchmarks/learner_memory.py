"""Peak memory of one learner forward + backward (log-probs + token entropies of the
completion tokens, as the ExGRPO learner computes them), against the whole-logits pass.

    python benchmarks/learner_memory.py [--model smollm2] [--rows 16] [--prompt 150] [--response 256]
    python benchmarks/learner_memory.py --model tiny --rows 2 --prompt 16 --response 16 --no-checkpointing  # seconds

Each variant runs in its own subprocess and reports its peak resident memory (ru_maxrss),
so they do not share an allocator. ``streamed`` is the learner's scoring pass
(``core.scoring.completion_logprobs_and_entropy``: the decoder's hidden states, then LM head,
log-softmax, picked log-prob and entropy in chunks of positions, nothing vocabulary-sized
kept for backward beyond a chunk); ``plain`` is the pass before it: the model's logits of
every completion position at once, ``losses.token_logprobs_from_logits`` and
``losses.entropy_from_logits`` (autograd keeps the softmax and its products, several
[rows, response, vocab] tensors). Each runs without and with gradient checkpointing
(``--no-checkpointing``: without only).

The last line is ``streamed_peak_mb=A plain_peak_mb=B streamed_over_plain_growth=R``
(without checkpointing; R: the streamed pass's growth of the peak above the loaded model
over the plain one's), then ``streamed_checkpointed_peak_mb=C`` when measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from _common import ROOT

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {root!r})
import torch
from rllib_exgrpo.core import losses
from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy
from rllib_exgrpo.models import resolve_model_path
from rllib_exgrpo.models.loading import load_causal_lm
variant, model_name, rows, prompt, response, checkpointing = {args!r}
model = load_causal_lm({{"model": resolve_model_path(model_name), "gradient_checkpointing": checkpointing}})
model.train()
vocab = model.config.vocab_size
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, vocab, (rows, prompt + response), generator=g)
mask = torch.ones_like(ids)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if variant == "plain":
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=response + 1, use_cache=False).logits[:, :-1]
    logp = losses.token_logprobs_from_logits(logits, ids[:, -response:])
    ent = losses.entropy_from_logits(logits)
else:
    logp, ent = completion_logprobs_and_entropy(model, ids, mask, response)
loss = -(logp.mean()) - 0.001 * ent.mean()
loss.backward()
print(json.dumps({{"variant": variant, "vocab": vocab, "seconds": time.perf_counter() - t0,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "before_mb": base / 1024}}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=150)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument(
        "--no-checkpointing", dest="checkpointing", action="store_false", help="skip the variants with gradient checkpointing"
    )
    args = parser.parse_args()
    results = {}
    variants = [("streamed", False), ("plain", False)] + ([("streamed", True), ("plain", True)] if args.checkpointing else [])
    for variant, ckpt in variants:
        code = CHILD.format(root=str(ROOT), args=(variant, args.model, args.rows, args.prompt, args.response, ckpt))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{variant}: failed (exit {proc.returncode}; killed for memory?)\n{proc.stderr[-2000:]}")
            continue
        results[variant + (" + grad. checkpointing" if ckpt else "")] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"model {args.model}, {args.rows} rows x ({args.prompt} prompt + {args.response} completion) tokens")
    print(f"{'variant':<34}{'peak RSS (MB)':>15}{'after model load':>18}{'fwd+bwd (s)':>13}")
    for v, r in results.items():
        print(f"{v:<34}{r['peak_mb']:>15.0f}{r['before_mb']:>18.0f}{r['seconds']:>13.1f}")
    nan = {"peak_mb": float("nan"), "before_mb": float("nan")}
    streamed, plain = results.get("streamed", nan), results.get("plain", nan)
    grown = {k: r["peak_mb"] - r["before_mb"] for k, r in (("streamed", streamed), ("plain", plain))}
    ratio = grown["streamed"] / grown["plain"] if grown["plain"] > 0 else float("nan")
    print(f"streamed_peak_mb={streamed['peak_mb']:.0f} plain_peak_mb={plain['peak_mb']:.0f} streamed_over_plain_growth={ratio:.3f}")
    if "streamed + grad. checkpointing" in results:
        print(f"streamed_checkpointed_peak_mb={results['streamed + grad. checkpointing']['peak_mb']:.0f}")


if __name__ == "__main__":
    main()
