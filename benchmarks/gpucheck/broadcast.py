"""The nccl-broadcast stage: the project's collective weight broadcast between two processes.

``rllib/weight_broadcast.py`` driven as the driver drives it, without Ray's actors: this
process is the root (a stand-in learner holding a small Qwen2: ``learner_open`` plans the
buckets and serves the group's store, ``learner_join``, ``learner_send``); a second process
(``torch.multiprocessing``, spawned) is an env runner (``RunnerEnd.join``,
``RunnerEnd.receive`` straight into its model's tensors, as the HF backend's runner takes
them). The runner's model then holds the root's weights bit for bit. The backend is the
product's choice: NCCL when the root and the runner each have a GPU of their own (NCCL
takes one GPU per rank), gloo otherwise.

What needs Ray: ``learner_open`` and ``RunnerEnd.join`` ask Ray for the node's address
(``ray.util.get_node_ip_address``) and the root reads its tensors through RLlib's
``InferenceOnlyAPI``; without Ray the stage is skipped, saying so.
"""

from __future__ import annotations

import io
import os
import time

from gpucheck.deps import have
from gpucheck.zero_offload import ZERO_MODEL

#: Small buckets, so that a sync takes several rounds (the product's default is 512 MiB).
BUCKET_BYTES = 256 << 10
TIMEOUT_S = "120"  # each member's wait for the others (the product's default: 10 minutes)


def _model(seed: int, device):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(**{**ZERO_MODEL, "tie_word_embeddings": True})
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device)


def _receiver(address, device: str, queue) -> None:
    """The env runner's side, in its own process: join, receive into the model, report."""
    import torch

    from rllib_exgrpo.rllib import weight_broadcast as wb

    try:
        model = _model(1, device)  # other weights than the root's, until the broadcast
        targets = dict(model.state_dict())
        end = wb.RunnerEnd.join(address, 1, torch.device(device))
        missing = end.missing(list(targets))
        t = time.perf_counter()
        seq_no, collected = end.receive(1, targets)
        seconds = time.perf_counter() - t
        end.close()
        buf = io.BytesIO()  # bytes, not tensors: torch would share their memory with a process about to end
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buf)
        queue.put(
            {
                "ok": True,
                "seq_no": seq_no,
                "missing": missing,
                "collected": collected is not None,
                "seconds": seconds,
                "state": buf.getvalue(),
            }
        )
    except Exception as e:  # the root reports it
        queue.put({"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"})


def pick_backend(device) -> tuple:
    """``(backend, root device, runner device, why)`` as the product picks the backend."""
    import torch

    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        return "nccl", "cuda:0", "cuda:1", "root and runner on a GPU each"
    if device.type == "cuda":
        return "gloo", str(device), "cpu", "one GPU: NCCL takes one GPU per rank, so the runner is on the CPU (gloo)"
    return "gloo", "cpu", "cpu", "CPU"


def run_broadcast(device) -> dict:
    entry = {"name": "nccl-broadcast", "bucket_bytes": BUCKET_BYTES, "model_config": {**ZERO_MODEL, "tie_word_embeddings": True}}
    if not have("ray"):
        return {
            **entry,
            "status": "skipped",
            "why": "Ray is absent: weight_broadcast.learner_open / RunnerEnd.join ask Ray for the node's "
            "address and read the learner's tensors through RLlib's InferenceOnlyAPI",
        }
    os.environ.setdefault("RLLIB_EXGRPO_WEIGHT_SYNC_TIMEOUT_S", TIMEOUT_S)
    backend, root_dev, runner_dev, why = pick_backend(device)
    entry.update(backend=backend, root_device=root_dev, runner_device=runner_dev, backend_why=why)
    got, sent, model = _broadcast_once(entry, backend, root_dev, runner_dev)
    if not got.get("ok"):
        return {**entry, "status": "failed", "error": f"runner: {got.get('error')}", "sent": sent}
    import torch

    theirs = torch.load(io.BytesIO(got["state"]))
    mine = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    same = [k for k in mine if k in theirs and torch.equal(mine[k].to(theirs[k].dtype), theirs[k])]
    entry.update(
        sent=sent, runner_seconds=got["seconds"], seq_no=got["seq_no"], missing=got["missing"], tensors=len(mine), tensors_equal=len(same)
    )
    ok = "error" not in sent and len(same) == len(mine) and not got["missing"] and got["seq_no"] == 3
    entry["status"] = "ran" if ok else "failed"
    if not ok:
        entry["error"] = (
            f"{len(mine) - len(same)} of {len(mine)} tensors differ after the broadcast"
            + (f"; root: {sent['error']}" if "error" in sent else "")
            + f"; seq no {got['seq_no']}"
        )
    entry["note"] = (
        f"{backend} ({why}): {sent.get('bytes', 0) / 2**20:.2f} MiB in {sent.get('buckets', 0)} buckets, "
        f"{sent.get('seconds', 0):.3f} s; {len(same)}/{len(mine)} tensors bitwise equal on the runner"
    )
    return entry


def _broadcast_once(entry: dict, backend: str, root_dev: str, runner_dev: str) -> tuple:
    """One generation, one sync: the root here, the runner spawned; ``(runner's report, root's
    send report, root model)``."""
    import queue as queue_mod
    from types import SimpleNamespace

    import torch
    import torch.multiprocessing as mp

    from rllib_exgrpo.rllib import weight_broadcast as wb

    model = _model(0, root_dev)
    learner = SimpleNamespace(module={wb.MODULE_ID: model}, _device=torch.device(root_dev), _weights_seq_no=3)
    opened = wb.learner_open(learner, generation=1, bucket_bytes=BUCKET_BYTES)
    address = wb.GroupAddress(opened["host"], opened["port"], 2, 1, backend, opened["layout"])
    entry["layout_buckets"] = len(opened["layout"].buckets)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_receiver, args=(address, runner_dev, q), daemon=True)
    child.start()
    sent = {}
    try:
        wb.learner_join(learner, generation=1, world_size=2, backend=backend)
        sent = wb.learner_send(learner, generation=1, sync=1)
        got = q.get(timeout=float(TIMEOUT_S))
    except queue_mod.Empty:
        got = {"ok": False, "error": f"no report in {TIMEOUT_S} s"}
    except Exception as e:  # the root's side failed: the runner's report may say why
        got = {"ok": False, "error": f"root: {type(e).__name__}: {e}"}
    finally:
        wb.learner_close(learner)
        child.join(timeout=30)
        if child.is_alive():
            child.terminate()
    return got, sent, model
