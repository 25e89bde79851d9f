"""The zero3-colocate-offload stage: a DeepSpeed ZeRO engine's colocated offload round trip.

A one-rank DeepSpeed engine (gloo on CPU, NCCL on a GPU; no Ray: the group is made here as
the project's DeepSpeed learner makes one for a local learner) over a small Qwen2 with the
learner's optimizer, ``torch.optim.AdamW``: one step, then the colocated turn's offload
with the product's ``rllib_exgrpo.rllib.optimizer_offload.OptimizerOffload`` (bytes moved
per state kind), a check that the compute-dtype weights the next push reads
(``lp_params``) neither moved nor changed, the reload, a second step; then the optimizer
state (AdamW's moments and steps), the fp32 master partitions and the weights compared bit
for bit with a reference run of the same two steps without the offload. ZeRO stages 1, 2
and 3 each (``--zero-stages``).
"""

from __future__ import annotations

import os
import socket
import time

from gpucheck.common import GIB, free_memory
from gpucheck.deps import have

#: The model: small enough for seconds per stage on 2 CPU cores; every tensor partitioned.
ZERO_MODEL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)


def run_zero_offload(device, stages=(1, 2, 3)) -> dict:
    """Each ZeRO stage's round trip (module doc); ``status`` ran / skipped / failed."""
    entry = {
        "name": "zero3-colocate-offload",
        "zero_stages": list(stages),
        "model_config": ZERO_MODEL,
        "offload": "rllib_exgrpo.rllib.optimizer_offload.OptimizerOffload",
        "per_stage": {},
    }
    if not have("deepspeed"):
        return {**entry, "status": "skipped", "why": "deepspeed is not installed (--wheels DIR installs it)"}
    from rllib_exgrpo.rllib.optimizer_offload import OptimizerOffload  # noqa: F401  (fails the stage if absent)

    import deepspeed

    entry["deepspeed"] = deepspeed.__version__
    one_rank_group(device)
    for stage in stages:
        entry["per_stage"][stage] = zero_round_trip(stage, device)
        free_memory(device)
    bad = [s for s, r in entry["per_stage"].items() if not r["ok"]]
    entry["status"] = "failed" if bad else "ran"
    if bad:
        entry["error"] = "; ".join(f"ZeRO-{s}: {entry['per_stage'][s]['failed_checks']}" for s in bad)
    entry["note"] = ", ".join(
        f"ZeRO-{s} moved {r['bytes_offloaded'] / 2**20:.2f} MiB ({', '.join(sorted(r['moved_by_kind']))}), "
        f"bitwise={r['bitwise_equal_to_reference']}"
        for s, r in entry["per_stage"].items()
    )
    return entry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_group(device) -> None:
    """The one-rank process group DeepSpeed needs, as the project's DeepSpeed learner makes it
    for a local learner (gloo; NCCL on a GPU), its shared-memory op marked incompatible (it
    would be compiled)."""
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            rank=0,
            world_size=1,
        )
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=str(device.index or 0) if device.type == "cuda" else "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def ds_config(stage: int, device) -> dict:
    """The learner's DeepSpeed config at this size (rllib/deepspeed_learner.py's
    ``build_deepspeed_config``: bf16 on a GPU, fp32 on CPU, clip 1.0, torch AdamW allowed),
    every tensor partitioned under ZeRO-3."""
    zero = {"stage": stage, "reduce_bucket_size": 1_000_000, "allgather_bucket_size": 1_000_000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "bf16": {"enabled": device.type == "cuda"},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class _LossOf:
    """The model's mean token loss on a fixed batch (what the engine steps on)."""

    def __init__(self, device):
        import torch

        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(1, ZERO_MODEL["vocab_size"], (2, 24), generator=g).to(device)

    def __call__(self, engine):
        return engine(input_ids=self.ids, labels=self.ids).loss


def build_engine(stage: int, device):
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**ZERO_MODEL), attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(stage, device), dist_init_required=False)
    return engine


def engine_step(engine, loss_of) -> float:
    loss = loss_of(engine)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def lp_tensors(engine) -> list:
    """The compute-dtype weights the next push reads: ZeRO-3's partitions, else the module's."""
    return [p.ds_tensor if hasattr(p, "ds_tensor") else p.data for p in engine.module.parameters()]


def hp_tensors(engine) -> list:
    """The fp32 master partitions the ZeRO optimizer keeps."""
    zopt = engine.optimizer
    flat = getattr(zopt, "fp32_partitioned_groups_flat", None)
    return list(flat if flat is not None else getattr(zopt, "single_partition_of_fp32_groups", []))


def snapshot(engine) -> dict:
    """Host copies of the optimizer state, the fp32 partitions and the weights."""
    from rllib_exgrpo.rllib.optimizer_offload import optimizer_state_tensors

    def host(ts):
        return [t.detach().to("cpu", copy=True) for t in ts]

    return {
        "optim_states": host(v for _, _, v in optimizer_state_tensors([engine.optimizer.optimizer])),
        "hp_params": host(hp_tensors(engine)),
        "lp_params": host(lp_tensors(engine)),
    }


def _equal(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _allocated(device) -> int:
    import torch

    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def zero_round_trip(stage: int, device) -> dict:
    """Reference run (two steps), then the offload run: step, offload, checks, reload, step."""
    from rllib_exgrpo.rllib.optimizer_offload import OptimizerOffload, optimizer_state_tensors

    loss_of = _LossOf(device)
    ref = build_engine(stage, device)
    ref_losses = [engine_step(ref, loss_of) for _ in range(2)]
    ref_snap = snapshot(ref)
    del ref
    free_memory(device)
    engine = build_engine(stage, device)
    out = {"zero_stage": stage, "loss_1": engine_step(engine, loss_of)}
    lp_before = [(t, t.device, t.data_ptr(), t.detach().to("cpu", copy=True)) for t in lp_tensors(engine)]
    offload = OptimizerOffload(lambda: [engine.optimizer.optimizer], lambda: [engine])
    before = _allocated(device)
    t = time.perf_counter()
    moved = offload.offload()
    out.update(
        offload_s=time.perf_counter() - t,
        bytes_offloaded=moved,
        moved_by_kind=dict(offload.moved),
        device_bytes_freed=before - _allocated(device) if device.type == "cuda" else None,
        on_device_flag_after_offload=offload.on_device,
    )
    held = [v for _, _, v in optimizer_state_tensors([engine.optimizer.optimizer])] + hp_tensors(engine)
    out["state_on_host_during_turn"] = all(v.device.type == "cpu" for v in held)
    out["lp_params_kept"] = all(x.device == d and x.data_ptr() == ptr and _equal([x.detach().cpu()], [c]) for x, d, ptr, c in lp_before)
    t = time.perf_counter()
    out["bytes_reloaded"] = offload.reload()
    out.update(reload_s=time.perf_counter() - t, on_device_flag_after_reload=offload.on_device)
    out["state_back_on_device"] = all(v.device.type == device.type for v in hp_tensors(engine))
    out["loss_2"] = engine_step(engine, loss_of)
    snap = snapshot(engine)
    out["bitwise"] = {k: _equal(snap[k], ref_snap[k]) for k in snap}
    out["bitwise_equal_to_reference"] = all(out["bitwise"].values()) and out["loss_2"] == ref_losses[1]
    out["plan"] = zero_plan(stage, out)
    engine = offload = None  # freed before the next stage
    checks = {
        "bytes moved": moved > 0,
        "on_device False after offload": not out["on_device_flag_after_offload"],
        "state on host during the turn": out["state_on_host_during_turn"] or device.type == "cpu",
        "lp_params kept": out["lp_params_kept"],
        "on_device True after reload": out["on_device_flag_after_reload"],
        "bitwise equal to the reference": out["bitwise_equal_to_reference"],
    }
    out["failed_checks"] = [k for k, ok in checks.items() if not ok]
    out["ok"] = not out["failed_checks"]
    return out


def zero_plan(stage: int, out: dict) -> dict:
    """The plan's ``optimizer`` term (fp32 master + AdamW moments, ``model_state_bytes``) next
    to what the offload moved of them (``hp_params`` + ``optim_states``)."""
    try:
        from transformers import Qwen2Config

        from rllib_exgrpo.planning.memory import model_state_bytes
        from rllib_exgrpo.planning.shapes import ModelShape

        states = model_state_bytes(
            ModelShape.from_hf_config(Qwen2Config(**ZERO_MODEL)), backend="deepspeed", zero_stage=stage, num_learners=1
        )
    except Exception as e:  # the plan's API moved, or it is absent: say so
        return {"status": f"unavailable ({type(e).__name__}: {e})"}
    moved = out["moved_by_kind"].get("hp_params", 0) + out["moved_by_kind"].get("optim_states", 0)
    return {
        "status": "ok",
        "plan_optimizer_bytes": states["optimizer"],
        "moved_optimizer_bytes": moved,
        "moved_over_plan": moved / max(1, states["optimizer"]),
        "plan_optimizer_gib": states["optimizer"] / GIB,
    }
