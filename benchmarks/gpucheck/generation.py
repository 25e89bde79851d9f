"""The generation stage: HF ``generate`` and the backend's ``pruned_decode``."""

from __future__ import annotations

import time

from gpucheck.common import (
    Clock,
    free_memory,
    is_oom,
    peak_gib,
    reset_peak,
    sync,
)


def generation_api():
    """``(SamplingParams, HFGenerationBackend, pruned_decode)`` of the HF backend, or Nones
    where it does not import (reported under "imports"; plain generate is still measured)."""
    try:
        from rllib_exgrpo.generation.base import SamplingParams
        from rllib_exgrpo.generation.hf import HFGenerationBackend, pruned_decode
    except Exception:
        return None, None, None
    return SamplingParams, HFGenerationBackend, pruned_decode


def generate_tokens(model, decoder: str, batch: int, max_new: int, ids, attn) -> int:
    """Sample ``max_new`` tokens per row (no stop token) under the HF backend's neutral
    sampling config (``"generate"``: ``HFGenerationBackend.generate_raw``; ``"pruned"``: its
    ``pruned_decode``); returns the new tokens generated."""
    SamplingParams, HFGenerationBackend, pruned_decode = generation_api()
    if decoder == "pruned":
        params = SamplingParams(max_new_tokens=max_new, temperature=1.0, top_p=1.0, stop_token_ids=())
        rows, _, _ = pruned_decode(model, ids, attn, params, pad_token_id=0)
        return sum(len(r) for r in rows)
    if HFGenerationBackend is not None:
        params = SamplingParams(max_new_tokens=max_new, temperature=1.0, top_p=1.0, stop_token_ids=())
        seqs = HFGenerationBackend(model, pad_token_id=0, batch_size=batch, decoder="generate").generate_raw(ids, attn, params)
    else:
        from transformers import GenerationConfig

        gc_ = GenerationConfig(
            max_new_tokens=max_new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=None, use_cache=True
        )
        seqs = model.generate(input_ids=ids, attention_mask=attn, generation_config=gc_)
    return int(seqs.shape[0] * (seqs.shape[1] - ids.shape[1]))


def _timed_decode(model, decoder: str, entry: dict, ids, attn, device, clock: Clock) -> None:
    """A short warm-up decode of ``ids``; then, when the whole decode of ``entry["new_tokens"]``
    tokens is predicted to fit in the time left, the timed one. ``entry`` gets its status and
    figures (or why it was skipped)."""
    import torch

    batch, new = entry["batch"], entry["new_tokens"]
    with torch.no_grad():
        warm_new = max(2, new // 32)
        reset_peak(device)
        sync(device)
        t1 = time.perf_counter()
        generate_tokens(model, decoder, batch, warm_new, ids, attn)
        sync(device)
        warm_s = time.perf_counter() - t1
        predicted = warm_s * new / warm_new
        if predicted > clock.left():
            entry.update(status="skipped", why=f"predicted {predicted:.0f} s > {clock.left():.0f} s left")
        else:
            reset_peak(device)
            t1 = time.perf_counter()
            n_tokens = generate_tokens(model, decoder, batch, new, ids, attn)
            sync(device)
            seconds = time.perf_counter() - t1
            entry.update(
                status="ok",
                seconds=seconds,
                generated_tokens=n_tokens,
                tokens_per_s=n_tokens / seconds,
                warmup_s=warm_s,
                peak_gib=peak_gib(device),
            )


def run_generation(model, shape, device, clock: Clock) -> list:
    import torch

    pruned_decode = generation_api()[2]
    model.eval()
    model.config.use_cache = True
    vocab, prompt, new = shape["config"]["vocab_size"], shape["gen_prompt"], shape["gen_new_tokens"]

    decoders = ["generate"] + (["pruned"] if pruned_decode is not None else [])
    out = []
    for batch in shape["gen_batches"]:
        for decoder in decoders:
            name = f"generation {decoder} {batch}x({prompt}+{new})"
            entry = {"name": name, "decoder": decoder, "batch": batch, "prompt": prompt, "new_tokens": new}
            out.append(entry)
            clock.results["generation"] = out
            t = time.perf_counter()
            try:
                g = torch.Generator().manual_seed(batch)
                ids = torch.randint(1, vocab, (batch, prompt), generator=g).to(device)
                attn = torch.ones_like(ids)
                _timed_decode(model, decoder, entry, ids, attn, device, clock)
            except Exception as e:
                if not is_oom(e):
                    raise
                entry.update(status="oom", error=str(e).splitlines()[0][:300], peak_gib=peak_gib(device))
            ids = attn = None
            free_memory(device)
            note = (
                f"{entry['tokens_per_s']:,.0f} new tok/s, peak {entry['peak_gib']:.2f} GiB"
                if entry["status"] == "ok"
                else entry["status"] + (f" ({entry['why']})" if "why" in entry else "")
            )
            clock.stage(name, time.perf_counter() - t, note)
    return out
