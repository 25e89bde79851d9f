"""The stages after the measuring ones: each returns ``(status, note)`` for the table of
stages and keeps its figures in the results (``zero3_colocate_offload``, ``nccl_broadcast``,
``packed_flash``, ``vllm_reload``, ``vllm_sleep_wake``)."""

from __future__ import annotations

from gpucheck.deps import have

NEW_STAGES = ("zero3-colocate-offload", "nccl-broadcast", "packed-flash", "vllm-reload", "vllm-sleep-wake")

#: Seconds each new stage is expected to take where it runs (GPU, CPU), kept back from the
#: measuring stages' budget; a stage whose dependency is absent costs nothing.
EXPECTED_S = {
    "zero3-colocate-offload": (60, 60),
    "nccl-broadcast": (40, 30),
    "packed-flash": (30, 0),
    "vllm-reload": (90, 60),
    "vllm-sleep-wake": (90, 0),
}
NEEDS = {
    "zero3-colocate-offload": "deepspeed",
    "nccl-broadcast": "ray",
    "packed-flash": "flash_attn",
    "vllm-reload": "vllm",
    "vllm-sleep-wake": "vllm",
}


def reserve_s(stages, device) -> float:
    """The time the selected new stages are expected to take here."""
    gpu = device.type == "cuda"
    return float(sum(EXPECTED_S[s][0 if gpu else 1] for s in stages if s in EXPECTED_S and have(NEEDS[s])))


def _keep(ctx, key: str, entry: dict) -> tuple:
    ctx.results[key] = entry
    ctx.clock.save()
    status = entry.get("status", "failed")
    note = entry.get("why") if status == "skipped" else entry.get("error") if status == "failed" else entry.get("note")
    return status, note or ""


def zero3_colocate_offload(ctx) -> tuple:
    from gpucheck.zero_offload import run_zero_offload

    return _keep(ctx, "zero3_colocate_offload", run_zero_offload(ctx.device, ctx.args.zero_stage_list))


def nccl_broadcast(ctx) -> tuple:
    from gpucheck.broadcast import run_broadcast

    return _keep(ctx, "nccl_broadcast", run_broadcast(ctx.device))


def packed_flash(ctx) -> tuple:
    """The packed stage's pass under ``flash_attention_2`` (no fallback), on a GPU where
    ``flash_attn`` imports."""
    from gpucheck.packed import flash_attn_status, run_packed

    if ctx.device.type != "cuda":
        return _keep(ctx, "packed_flash", {"status": "skipped", "why": "flash-attention needs a CUDA device"})
    fa = flash_attn_status()
    if not fa["importable"]:
        return _keep(ctx, "packed_flash", {"status": "skipped", "why": f"flash_attn not importable ({fa['error']})"})
    entry = run_packed(ctx.shape["packed"], ctx.device, ctx.clock, kernel="flash_attention_2", key="packed_flash")
    status = {"ok": "ran", "oom": "ran", "skipped": "skipped"}.get(entry["status"], "failed")
    note = (
        f"{entry['pass_s']:.2f} s/pass, peak {entry['measured_gib']:.3f} GiB, measured_over_planned="
        f"{entry.get('measured_over_planned', float('nan')):.3f}"
        if entry["status"] == "ok"
        else entry.get("why", entry.get("error", entry["status"]))
    )
    entry["table_status"] = status
    return status, note


def vllm_reload(ctx) -> tuple:
    from gpucheck.vllm_check import run_vllm_reload

    return _keep(ctx, "vllm_reload", run_vllm_reload(ctx.device))


def vllm_sleep_wake(ctx) -> tuple:
    from gpucheck.vllm_check import run_vllm_sleep_wake

    return _keep(ctx, "vllm_sleep_wake", run_vllm_sleep_wake(ctx.device))


NEW_RUNNERS = {
    "zero3-colocate-offload": zero3_colocate_offload,
    "nccl-broadcast": nccl_broadcast,
    "packed-flash": packed_flash,
    "vllm-reload": vllm_reload,
    "vllm-sleep-wake": vllm_sleep_wake,
}
