"""The transfer stage: host <-> device copies of 7B-sized bf16 state."""

from __future__ import annotations

import gc
import time

from gpucheck.common import Clock, free_memory, host_available_bytes, sync

CPU_TRANSFER_CAP_GB = 0.25  # host-to-host "transfers" on a CPU run are sized down to this
ESIZE = 2  # bfloat16


def run_transfer(device, nbytes: int, chunk_bytes: int, clock: Clock) -> dict:
    """Move ``nbytes`` of bf16 between host and device memory in ``chunk_bytes`` chunks, from
    pinned and from pageable host buffers, both directions (host-to-host on a CPU run)."""
    import torch

    cuda = device.type == "cuda"
    entry = {
        "name": "transfer",
        "dtype": "bfloat16",
        "device": str(device),
        "bytes_requested": int(nbytes),
        "chunk_bytes": int(chunk_bytes),
    }
    clock.results["transfer"] = entry
    t = time.perf_counter()
    size = _capped_size(device, int(nbytes), entry)
    chunk_elems = max(1, min(int(chunk_bytes), size) // ESIZE)
    kinds = ["pinned", "pageable"] if cuda else ["pageable"]
    if not cuda:
        entry["pinned"] = {"status": "skipped", "why": "pinned host memory needs CUDA"}
    # probe one chunk per kind and direction; predict the stage; shrink it to fit the budget
    per_byte = _probe_per_byte(device, kinds, chunk_elems)
    predicted = per_byte * size * 1.5 + 1.0
    if predicted > clock.left():
        fit = int(max(0.0, clock.left() - 1.0) / (per_byte * 1.5))
        if fit < chunk_elems * ESIZE:
            entry.update(status="skipped", why=f"predicted {predicted:.0f} s > {clock.left():.0f} s left")
            clock.stage("transfer", time.perf_counter() - t, f"skipped ({entry['why']})")
            return entry
        size, entry["sized_down"] = fit, f"to {fit / 1e9:.3f} GB (budget: {predicted:.0f} s predicted for the full size)"
    n_elems = size // ESIZE
    entry["bytes"] = n_elems * ESIZE
    entry["predicted_s"] = per_byte * entry["bytes"]
    dev = torch.empty(n_elems, dtype=torch.bfloat16, device=device).zero_()
    for kind in kinds:
        entry[kind] = _round_trip(device, dev, kind == "pinned", chunk_elems)
    dev = None
    free_memory(device)
    entry["status"] = "ok"
    note = (
        ", ".join(f"{kind} h2d {entry[kind]['h2d_gb_per_s']:.1f} GB/s d2h {entry[kind]['d2h_gb_per_s']:.1f} GB/s" for kind in kinds)
        + f" ({entry['bytes'] / 1e9:.3f} GB each way)"
    )
    clock.stage("transfer", time.perf_counter() - t, note)
    return entry


def _capped_size(device, size: int, entry: dict) -> int:
    """``size`` capped by the host RAM (one full-size host buffer at a time; most of the RAM
    left alone), the free GPU memory, or a CPU run's cap; the reason kept in ``entry``."""
    import torch

    caps = []
    avail = host_available_bytes()
    if avail:
        caps.append(("host RAM", int(avail * 0.4)))
    if device.type == "cuda":
        caps.append(("free GPU memory", int(torch.cuda.mem_get_info(device)[0] * 0.8)))
    else:
        caps.append(("CPU run", int(CPU_TRANSFER_CAP_GB * 1e9)))
    for why, cap in caps:
        if size > cap:
            size, entry["sized_down"] = cap, f"to {cap / 1e9:.3f} GB ({why})"
    return size


def _probe_per_byte(device, kinds, chunk_elems: int) -> float:
    """Seconds per byte of one chunk's allocation and round trip, summed over ``kinds``."""
    import torch

    probe_dev = torch.empty(chunk_elems, dtype=torch.bfloat16, device=device).zero_()
    per_byte = 0.0
    for kind in kinds:
        t1 = time.perf_counter()
        host = torch.empty(chunk_elems, dtype=torch.bfloat16, pin_memory=kind == "pinned").zero_()
        alloc = time.perf_counter() - t1
        sync(device)
        t1 = time.perf_counter()
        probe_dev.copy_(host, non_blocking=kind == "pinned")
        sync(device)
        host.copy_(probe_dev, non_blocking=kind == "pinned")
        sync(device)
        per_byte += (alloc + time.perf_counter() - t1) / (chunk_elems * ESIZE)
    return per_byte


def _copy_chunks(dst, src, chunk_elems: int, pinned: bool, device) -> tuple:
    """``dst`` <- ``src`` in chunks: ``(seconds, bytes moved)``."""
    moved = 0
    sync(device)
    t1 = time.perf_counter()
    for s in range(0, src.numel(), chunk_elems):
        part = dst[s : s + chunk_elems]
        part.copy_(src[s : s + chunk_elems], non_blocking=pinned)
        moved += part.numel() * ESIZE
    sync(device)
    return time.perf_counter() - t1, moved


def _round_trip(device, dev, pinned: bool, chunk_elems: int) -> dict:
    """One host buffer's trip to ``dev`` and back: times, rates, the data checked."""
    import torch

    n_elems = dev.numel()
    k = max(1, min(n_elems // 2, 1 << 20))  # head and tail marked, checked after the round trip
    head = torch.randn(k).to(torch.bfloat16)
    tail = torch.randn(k).to(torch.bfloat16)
    r = {}
    t1 = time.perf_counter()
    host = torch.empty(n_elems, dtype=torch.bfloat16, pin_memory=pinned).zero_()  # pages touched
    r["alloc_s"] = time.perf_counter() - t1
    host[:k] = head
    host[n_elems - k :] = tail
    r["h2d_s"], r["bytes_h2d"] = _copy_chunks(dev, host, chunk_elems, pinned, device)
    host[:k].zero_()
    host[n_elems - k :].zero_()
    r["d2h_s"], r["bytes_d2h"] = _copy_chunks(host, dev, chunk_elems, pinned, device)
    r["round_trip_ok"] = bool(torch.equal(host[:k], head) and torch.equal(host[n_elems - k :], tail))
    for d in ("h2d", "d2h"):
        r[f"{d}_gb_per_s"] = r[f"bytes_{d}"] / 1e9 / max(r[f"{d}_s"], 1e-12)
        # the full 7B bf16 state (15.2 GB) at this rate
        r[f"{d}_s_per_15_2_gb"] = 15.2 / r[f"{d}_gb_per_s"]
    r["status"] = "ok"
    host = None
    gc.collect()
    if pinned:
        _empty_host_cache()
    return r


def _empty_host_cache() -> None:
    """torch caches freed pinned blocks: give them back before the pageable buffer."""
    import torch

    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    try:
        if empty is not None:
            empty()
    except Exception:  # only host memory headroom depends on it
        pass
