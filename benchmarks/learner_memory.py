"""Peak memory of one learner forward + backward (log-probs + token entropies of the
completion tokens, as the ExGRPO learner computes them), plain vs streamed entropy.

    python benchmarks/learner_memory.py [--model smollm2] [--rows 16] [--prompt 150] [--response 256]

Each variant runs in its own subprocess and reports its peak resident memory (ru_maxrss),
so the two do not share an allocator. ``plain`` is losses.entropy_from_logits (autograd
keeps the softmax and its products, several [rows, response, vocab] tensors); ``streamed``
is losses.streamed_entropy (what the module uses: keeps nothing vocabulary-sized beyond
the logits, recomputes the softmax chunk by chunk in backward).
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
from rllib_exgrpo.rllib import module
from rllib_exgrpo.models import resolve_model_path
variant, model_name, rows, prompt, response, checkpointing = {args!r}
if variant == "plain":
    module.streamed_entropy = losses.entropy_from_logits
model = module.load_causal_lm({{"model": resolve_model_path(model_name), "gradient_checkpointing": checkpointing}})
model.train()
vocab = model.config.vocab_size
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, vocab, (rows, prompt + response), generator=g)
mask = torch.ones_like(ids)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
logp, ent, _ = module.score_completions(model, ids, mask, response)
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
    args = parser.parse_args()
    results = {}
    for variant, ckpt in (("streamed", False), ("plain", False), ("streamed", True), ("plain", True)):
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


if __name__ == "__main__":
    main()
