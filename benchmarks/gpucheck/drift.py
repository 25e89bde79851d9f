"""The drift stage: bf16 log-prob drift of the same rows in other batch compositions."""

from __future__ import annotations

import time

from gpucheck.common import (
    Clock,
    free_memory,
    is_oom,
    learner_batch,
    score_nograd,
)


def logp_drift(model, rows: int, prompt: int, response: int, vocab: int, device, seed: int) -> dict:
    """Score the same rows in several batch compositions with the model as it is (bf16 on the
    GPU run); |delta log p| over the real completion tokens against the learner's layout
    (all rows in one batch, prompts left-padded, responses right-padded)."""
    import torch

    model.eval()
    b = learner_batch(rows, prompt, response, vocab, device, seed)
    ids, attn, real = b["input_ids"], b["attention_mask"], b["response_mask"].bool()

    def score(i, a, r):
        return score_nograd(model, {"input_ids": i, "attention_mask": a}, r)[0].float()

    ref = score(ids, attn, response)
    variants = {"repeat": score(ids, attn, response)}  # same batch again: 0 unless kernels are nondeterministic
    alone = torch.zeros_like(ref)
    for i in range(rows):  # each row by itself, no padding at all (an env runner scoring one row)
        x = ids[i][attn[i].bool()][None]
        r_i = int(real[i].sum())
        alone[i, :r_i] = score(x, torch.ones_like(x), r_i)[0]
    variants["row_alone_unpadded"] = alone
    # rows in reverse order, padded wider on both sides (another micro-batch's padding)
    pad = max(4, (prompt + response) // 64)
    order = torch.arange(rows - 1, -1, -1, device=ids.device)
    ids2 = torch.zeros(rows, pad + prompt + response + pad, dtype=ids.dtype, device=ids.device)
    attn2 = torch.zeros_like(ids2)
    ids2[:, pad : pad + prompt + response] = ids[order]
    attn2[:, pad : pad + prompt + response] = attn[order]
    wide = score(ids2, attn2, response + pad)[:, :response]
    back = torch.empty_like(wide)
    back[order] = wide
    variants["reversed_wider_padding"] = back

    out = {
        "rows": rows,
        "prompt": prompt,
        "response": response,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "reference": "all rows in one padded batch (learner layout)",
        "tokens_compared": int(real.sum()),
        "comparisons": {},
    }
    for name, x in variants.items():
        d = (x - ref)[real]
        out["comparisons"][name] = {
            "max_abs_delta_logp": float(d.abs().max()),
            "mean_abs_delta_logp": float(d.abs().mean()),
            # what it does to an unclipped importance ratio exp(logp - old_logp) = 1 + ...
            "max_abs_ratio_minus_1": float(d.exp().sub(1).abs().max()),
        }
    return out


def run_drift(model, label: str, spec: dict, vocab: int, device, clock: Clock, tokens_per_s=None) -> dict:
    rows, prompt, response = spec["rows"], spec["prompt"], spec["response"]
    name = f"drift {label} {rows}x({prompt}+{response})"
    entry = {"name": name, "model": label}
    clock.results.setdefault("drift", []).append(entry)
    t = time.perf_counter()
    # 3 padded passes of the batch + the rows one by one
    predicted = 4 * rows * (prompt + response) / tokens_per_s * 1.5 if tokens_per_s else None
    if predicted is not None and predicted > clock.left():
        entry.update(status="skipped", why=f"predicted {predicted:.0f} s > {clock.left():.0f} s left")
    else:
        try:
            entry.update(logp_drift(model, rows, prompt, response, vocab, device, seed=7))
            entry["status"] = "ok"
        except Exception as e:
            if not is_oom(e):
                raise
            entry.update(status="oom", error=str(e).splitlines()[0][:300])
    free_memory(device)
    c = entry.get("comparisons", {})
    note = (
        ", ".join(f"{k} max {v['max_abs_delta_logp']:.3g} mean {v['mean_abs_delta_logp']:.3g}" for k, v in c.items())
        if entry["status"] == "ok"
        else entry["status"] + (f" ({entry['why']})" if "why" in entry else "")
    )
    clock.stage(name, time.perf_counter() - t, note)
    return entry
