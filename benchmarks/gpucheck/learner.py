"""The learner stage: one optimiser step of the project's learner, with and without checkpointing."""

from __future__ import annotations

import time

from gpucheck.common import (
    allocated_gib,
    Clock,
    free_memory,
    is_oom,
    learner_batch,
    learner_step,
    peak_gib,
    reset_peak,
    score_nograd,
    set_checkpointing,
    sync,
)


def run_learner(model, shape, device, steps: int, clock: Clock) -> list:
    """One optimiser step per configuration (two response lengths, checkpointing on and
    off), after the optimiser state exists; the no-grad scoring pass on the same batch."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    warm_optimizer(model, optimizer, shape, device, clock)
    rows, prompt = shape["rows"], shape["prompt"]
    out = []
    for response, ckpt in [(r, ckpt) for r in shape["responses"] for ckpt in (True, False)]:
        name = f"learner {rows}x({prompt}+{response}) {'ckpt' if ckpt else 'no-ckpt'}"
        entry = {
            "name": name,
            "rows": rows,
            "prompt": prompt,
            "response": response,
            "tokens_per_step": rows * (prompt + response),
            "gradient_checkpointing": ckpt,
        }
        out.append(entry)
        clock.results["learner"] = out
        t = time.perf_counter()
        set_checkpointing(model, ckpt)
        model.config.use_cache = False
        model.train()
        try:
            learner_config(model, optimizer, shape, device, steps, clock, entry)
        except Exception as e:  # OOM is a result here, not a crash
            if not is_oom(e):
                raise
            entry.update(status="oom", error=str(e).splitlines()[0][:300], peak_gib=peak_gib(device))
        optimizer.zero_grad(set_to_none=True)
        free_memory(device)
        note = (
            f"{entry['step_s_mean']:.2f} s/step, {entry['tokens_per_s']:,.0f} tok/s, peak {entry['peak_gib']:.2f} GiB"
            if entry["status"] == "ok"
            else entry["status"]
        )
        clock.stage(name, time.perf_counter() - t, note)
        if clock.left() <= 0:
            break
    set_checkpointing(model, False)
    del optimizer
    model.zero_grad(set_to_none=True)
    free_memory(device)
    return out


def warm_optimizer(model, optimizer, shape, device, clock: Clock) -> None:
    """AdamW's moments exist from the first step on: allocate them now, so every config's
    peak includes them the same way; and say whether an lr 1e-6 step changes the weights
    at this dtype (bf16 weights have an ulp of ~1e-4 at |w| ~ 0.02, so most 1e-6 updates
    round away; fp32 weights all move)."""
    t = time.perf_counter()
    warm = learner_batch(2, 8, 8, shape["config"]["vocab_size"], device, seed=0)
    warm["old_logp"] = score_nograd(model, warm, 8)[0]
    model.train()
    learner_step(model, optimizer, warm, 8, 8)
    before = [p.detach().clone() for p in model.parameters()]
    learner_step(model, optimizer, warm, 8, 8)
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(model.parameters(), before))
    fraction = changed / sum(b.numel() for b in before)
    clock.results["param_update_fraction"] = fraction
    del warm, before
    free_memory(device)
    sync(device)
    base = allocated_gib(device)
    clock.results["learner_static_gib"] = round(base, 3)
    clock.stage(
        "learner: optimiser state",
        time.perf_counter() - t,
        f"weights + AdamW state {base:.2f} GiB; one lr 1e-6 step changes {fraction:.1%} of the weights",
    )


def timed(device, fn):
    """``(seconds, result)`` of ``fn()``, the device synchronised on both ends."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def learner_config(model, optimizer, shape, device, steps: int, clock: Clock, entry: dict) -> None:
    """One configuration: the no-grad scoring pass twice (behaviour log-probs / replay choice
    on an env runner), a warm-up step, then as many timed steps as the budget allows."""
    response = entry["response"]
    batch = learner_batch(entry["rows"], entry["prompt"], response, shape["config"]["vocab_size"], device, seed=response)
    entry["valid_tokens_per_step"] = int(batch["attention_mask"].sum())
    reset_peak(device)
    first_score, logp = timed(device, lambda: score_nograd(model, batch, response)[0])
    batch["old_logp"] = logp
    entry["score_nograd_s"] = timed(device, lambda: score_nograd(model, batch, response))[0]
    entry["score_nograd_tokens_per_s"] = entry["tokens_per_step"] / entry["score_nograd_s"]
    entry["score_nograd_peak_gib"] = peak_gib(device)
    reset_peak(device)

    def step():
        return learner_step(model, optimizer, batch, response, max_len=8192)

    warm_s = timed(device, step)[0]
    n = steps
    if warm_s * n > clock.left():
        n = max(1, int(clock.left() // max(warm_s, 1e-9)))
        entry["steps_cut_by_budget"] = True
    times = [timed(device, step)[0] for _ in range(n)]
    mean = sum(times) / len(times)
    entry.update(
        status="ok",
        steps=len(times),
        warmup_step_s=warm_s,
        first_score_s=first_score,
        step_s_mean=mean,
        step_s_min=min(times),
        tokens_per_s=entry["tokens_per_step"] / mean,
        valid_tokens_per_s=entry["valid_tokens_per_step"] / mean,
        peak_gib=peak_gib(device),
    )
