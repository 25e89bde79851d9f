"""Peak memory of the learner's log-prob + entropy pass at a real vocabulary, on CPU.

    python benchmarks/logprob_memory.py [--tokens 8192] [--vocab 152064] [--chunk N] [--whole-tokens 1024]

One packed learner pass (``core/packing.py``'s ``score_packed``, what the learner runs
under ``learner_micro_batch_tokens``): 16 rows of 64 prompt + 512 completion tokens
(8,192 completion tokens), at Qwen2.5's vocabulary of 152,064 with tied embeddings, on a
randomly initialised Qwen2 that is narrow and shallow everywhere else (hidden 64, one
layer): the vocabulary-sized buffers have their real width, the rest costs little. The
pass computes the picked log-probs and entropies, a loss of both (as the GRPO loss with an
entropy bonus), and its backward, with the model's gradients already allocated (a learner
in its steady state).

Measured: the peak of live torch tensor bytes during the pass, relative to its start (the
CPU allocator's records through ``torch.profiler``, as ``benchmarks/memory_plan.py``),
over the size of one float32 ``[completion tokens x vocabulary]`` tensor (4.98 GB here):
what a pass that upcast its logits whole would need once, before any temporary.

``--whole-tokens`` also measures the earlier whole-logits path on that many completion
tokens (the model's ``logits`` for every scored position, upcast to float32 per pass and
reduced by ``losses.token_logprobs_from_logits`` and ``losses.streamed_entropy``); at 8,192
tokens it would need ~30 GB, more than this machine has. 0 skips it.

The last line is ``peak_over_logits_fp32=X`` (the chunked pass).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

GIB = float(1 << 30)
ROWS, PROMPT = 16, 64


def build_model(vocab: int, kernel: str):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rllib_exgrpo.core.attention import register_kernels

    register_kernels()
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    model = Qwen2ForCausalLM(config)
    model.set_attn_implementation(kernel)
    for p in model.parameters():  # a learner in its steady state: gradients exist
        p.grad = torch.zeros_like(p)
    return model


def packed_batch(completion_tokens: int, vocab: int):
    import torch

    from rllib_exgrpo.core import columns as C
    from rllib_exgrpo.core.packing import pack_rows

    response = completion_tokens // ROWS
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (ROWS, PROMPT + response), generator=g)
    mask = torch.ones_like(ids)
    cols = {C.INPUT_IDS: ids, C.ATTENTION_MASK: mask, C.RESPONSE_MASK: mask[:, PROMPT:].float()}
    return {**cols, **pack_rows(cols)}


def chunked_pass(model, batch, chunk):
    from rllib_exgrpo.core.packing import score_packed

    logp, entropy = score_packed(model, batch, chunk_tokens=chunk)
    (-(logp.sum()) - 0.001 * entropy.sum()).backward()


def whole_logits_pass(model, batch):
    """The earlier path: every scored position's logits at once, upcast per pass."""
    from rllib_exgrpo.core import columns as C
    from rllib_exgrpo.core.losses import streamed_entropy, token_logprobs_from_logits

    index = batch[C.PACKED_LOGIT_INDEX]
    logits = model(
        input_ids=batch[C.PACKED_INPUT_IDS], position_ids=batch[C.PACKED_POSITION_IDS], logits_to_keep=index, use_cache=False
    ).logits[0]
    targets = batch[C.PACKED_INPUT_IDS][0, index + 1]
    logp = token_logprobs_from_logits(logits.unsqueeze(0), targets.unsqueeze(0))[0]
    entropy = streamed_entropy(logits.unsqueeze(0))[0]
    (-(logp.sum()) - 0.001 * entropy.sum()).backward()


def measure(fn) -> tuple:
    from memory_plan import _peak_of

    t = time.perf_counter()
    peak = _peak_of(fn)
    return peak, time.perf_counter() - t


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="completion tokens of the packed pass")
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--chunk", type=int, default=None, help="logit_chunk_tokens (default: the field's)")
    parser.add_argument("--whole-tokens", type=int, default=1024, help="completion tokens for the whole-logits comparison (0: skip)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "logprob_memory.json")
    return parser.parse_args(argv)


def _compare_whole_logits(model, chunk: int, whole_tokens: int, vocab: int) -> dict:
    """The whole-logits pass against the chunked one on a packed pass of ``whole_tokens``
    completion tokens: prints both peaks, returns the result's fields for them."""
    small = packed_batch(whole_tokens, vocab)
    small_logits = 4.0 * whole_tokens * vocab
    peak_c, _ = measure(lambda: chunked_pass(model, small, chunk))
    peak_w, seconds_w = measure(lambda: whole_logits_pass(model, small))
    fields = dict(
        whole_tokens=whole_tokens,
        whole_peak_bytes=peak_w,
        whole_peak_over_logits_fp32=peak_w / small_logits,
        chunked_peak_over_logits_fp32_at_whole_tokens=peak_c / small_logits,
    )
    print(
        f"  at {whole_tokens} completion tokens: whole logits peak {peak_w / GIB:.2f} GiB = "
        f"{peak_w / small_logits:.2f} x float32 [{whole_tokens} x {vocab}]; chunked "
        f"{peak_c / small_logits:.3f} x"
    )
    return fields


def main(argv=None) -> int:
    args = _parse_args(argv)

    import torch
    import transformers

    from rllib_exgrpo.core.attention import SDPA_VARLEN
    from rllib_exgrpo.core.chunked_logprobs import DEFAULT_CHUNK_TOKENS

    torch.set_num_threads(2)
    chunk = args.chunk or DEFAULT_CHUNK_TOKENS
    model = build_model(args.vocab, SDPA_VARLEN)
    logits_fp32 = 4.0 * args.tokens * args.vocab
    batch = packed_batch(args.tokens, args.vocab)
    peak, seconds = measure(lambda: chunked_pass(model, batch, chunk))
    result = {
        "tokens": args.tokens,
        "vocab": args.vocab,
        "chunk_tokens": chunk,
        "rows": ROWS,
        "prompt": PROMPT,
        "peak_bytes": peak,
        "logits_fp32_bytes": logits_fp32,
        "peak_over_logits_fp32": peak / logits_fp32,
        "seconds": round(seconds, 1),
    }
    print(f"packed pass: {ROWS} rows x ({PROMPT} + {args.tokens // ROWS}) tokens, vocabulary {args.vocab}, chunks of {chunk}")
    print(
        f"  chunked (learner):  peak {peak / GIB:6.2f} GiB  = {peak / logits_fp32:.3f} x float32 "
        f"[{args.tokens} x {args.vocab}] ({logits_fp32 / GIB:.2f} GiB)  in {seconds:.1f} s"
    )
    if args.whole_tokens:
        result.update(_compare_whole_logits(model, chunk, args.whole_tokens, args.vocab))
    result.update(
        torch=torch.__version__,
        transformers=transformers.__version__,
        machine=platform.processor() or platform.machine(),
        date=time.strftime("%Y-%m-%d"),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"peak_over_logits_fp32={peak / logits_fp32:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
