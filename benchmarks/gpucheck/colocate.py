"""The colocate stage: learner and HF generation taking turns on one device, the optimizer state round trip."""

from __future__ import annotations

import math
import time

from gpucheck.generation import generate_tokens
from gpucheck.common import (
    allocated_bytes,
    build_model,
    Clock,
    count_params,
    free_memory,
    GIB,
    is_oom,
    learner_batch,
    learner_flops_rate,
    learner_forward_backward,
    reset_peak,
    score_nograd,
    set_checkpointing,
    step_flops,
    sync,
)


# --------------------------------------------------------------------------------------
# The colocated cycle (stage 7)
# --------------------------------------------------------------------------------------

#: The plan's items the allocator sees nothing of (``torch.cuda.max_memory_allocated``
#: counts only the caching allocator's tensors).
PLAN_OUTSIDE_ALLOCATOR = ("CUDA context, workspaces",)
COLOCATE_PHASES = ("learner", "release", "generation", "restore")


def colocate_plan(cfg: dict, spec: dict, model_dtype: str, attn: str, gpu_memory=None) -> dict:
    """The memory plan (``rllib_exgrpo.planning.memory.plan_memory``) of a one-GPU DDP learner
    with ``colocate: true`` and the HF backend at the stage's shapes: its learner entry
    for the learner's pass (``rows`` x (``prompt`` + ``response``), padded, checkpointing) and
    its ``learner, generation turn (colocate)`` entry for the turn (``generation_batch_size``
    ``gen_batch``, ``gen_prompt`` + ``gen_new_tokens`` tokens, ``behaviour_logprobs: engine``:
    no scoring pass, as the stage generates only). The per-phase figures are the plan's bytes
    the allocator can see (its items less the CUDA context): ``learner`` and ``restore`` the
    learner entry; ``release`` the turn's resident learner weights; ``generation`` the turn
    with its optimizer state offloaded (what this stage does; the plan keeps it on the GPU for
    the HF backend, as the product's HF turn does: ``generation_as_planned``). Or
    ``status: unavailable (...)``."""
    try:
        from rllib_exgrpo.planning.memory import plan_memory  # noqa: F401
        from rllib_exgrpo.rllib.config_fields import field_defaults  # noqa: F401
    except ImportError as e:
        return {"status": f"unavailable ({type(e).__name__}: {e})"}
    try:
        learner, turn = _colocate_plan_entries(cfg, spec, model_dtype, attn, gpu_memory)

        def items(actor):
            return {it.what: int(it.bytes) for it in actor.items}

        def seen(actor):  # what the allocator can see of the entry
            return sum(b for what, b in items(actor).items() if what not in PLAN_OUTSIDE_ALLOCATOR)

        turn_items = items(turn)
        resident = turn_items.get("learner weights", 0) + turn_items.get("DDP gradient buckets", 0)
        phases = {
            "learner": seen(learner),
            "release": resident,
            "generation": seen(turn) - turn_items.get("optimizer state", 0),
            "restore": seen(learner),
        }
        return {
            "status": "ok",
            "source": "rllib_exgrpo.planning.memory.plan_memory",
            "args": f"ddp, 1 learner, model_dtype {model_dtype}, gradient_checkpointing, learner "
            f"{spec['rows']} x ({spec['prompt']} + {spec['response']}) padded; generation hf, "
            f"generation_batch_size {spec['gen_batch']}, {spec['gen_prompt']} + "
            f"{spec['gen_new_tokens']} tokens, behaviour_logprobs engine",
            "learner_items": items(learner),
            "turn_items": turn_items,
            "learner_total_bytes": learner.total,
            "turn_total_bytes": turn.total,
            "learner_fits": learner.fits,
            "turn_fits": turn.fits,
            "phase_bytes": phases,
            "generation_as_planned_bytes": seen(turn),
            # bf16 weight copies autocast keeps through a pass (the learner entry has them;
            # a turn under the learner's autocast makes them too)
            "autocast_copies_bytes": items(learner).get("autocast weight copies", 0),
            "excluded": list(PLAN_OUTSIDE_ALLOCATOR),
        }
    except Exception as e:  # the plan's API moved: say so, keep the run
        return {"status": f"unavailable ({type(e).__name__}: {str(e)[:200]})"}


def _colocate_plan_entries(cfg: dict, spec: dict, model_dtype: str, attn: str, gpu_memory):
    """``(learner entry, generation turn entry)`` of ``plan_memory`` for the stage's shapes."""
    from types import SimpleNamespace

    from transformers import Qwen2Config

    from rllib_exgrpo.core.attention import ATTN_IMPLEMENTATIONS
    from rllib_exgrpo.planning.memory import plan_memory
    from rllib_exgrpo.planning.shapes import ModelShape
    from rllib_exgrpo.rllib.config_fields import field_defaults

    shape = ModelShape.from_hf_config(Qwen2Config(**cfg))
    base = field_defaults()
    base.update(
        model_name_or_path="gpu_check (random weights)",
        colocate=True,
        num_learners=0,
        num_gpus_per_learner=1,
        num_env_runners=0,
        num_gpus_per_env_runner=0,
        learner_backend="ddp",
        model_dtype=model_dtype,
        gradient_checkpointing=True,
        attn_implementation=attn if attn in ATTN_IMPLEMENTATIONS else "sdpa",
        learner_micro_batch_rows=spec["rows"],
        minibatch_size=spec["rows"],
        learner_micro_batch_tokens=None,
        generation_backend="hf",
        hf_decoder="generate",
        behaviour_logprobs="engine",
        scoring_on="runners",
        kl_coeff=0.0,
        lora_rank=0,
        torch_ddp_kwargs={},
        generation_batch_size=spec["gen_batch"],
    )
    kw = (
        {"gpu_memory": gpu_memory, "gpu_memory_source": "torch.cuda.get_device_properties", "shape": shape}
        if gpu_memory
        else {"shape": shape}
    )
    learner_cfg = SimpleNamespace(**{**base, "max_prompt_tokens": spec["prompt"], "max_response_tokens": spec["response"]})
    turn_cfg = SimpleNamespace(**{**base, "max_prompt_tokens": spec["gen_prompt"], "max_response_tokens": spec["gen_new_tokens"]})
    # the learner entry ("learner", or "learner, training turn (colocate)") and the turn's
    learner = next(a for a in plan_memory(learner_cfg, **kw).actors if a.kind.startswith("learner") and "generation turn" not in a.kind)
    turn = next(a for a in plan_memory(turn_cfg, **kw).actors if "generation turn" in a.kind)
    return learner, turn


def colocate_predicted_s(results: dict, shape: dict):
    """Seconds the colocate stage should take, from what earlier stages measured (the learner's
    FLOP rate, the generation rate, the transfer rates; assumed rates where they did not run),
    or None when nothing measured it."""
    spec, cfg = shape["colocate"], shape["config"]
    rate = learner_flops_rate(results, cfg)
    gen = [
        e["tokens_per_s"]
        for e in results.get("generation", [])
        if e.get("status") == "ok" and e.get("decoder") == "generate" and e.get("batch") == spec["gen_batch"]
    ]
    if rate is None and not gen:
        return None
    params = results.get("params") or count_params(cfg)
    seconds = 10.0  # model build, first-call warm-ups
    if rate:  # two fp32-weight steps under autocast (x1.5 for the casts) and one scoring pass
        flops = step_flops(cfg, cfg["num_hidden_layers"], spec["rows"], spec["prompt"] + spec["response"], spec["response"], True)
        seconds += 2.5 * 1.5 * flops / rate
    if gen:
        seconds += 2.0 * spec["gen_batch"] * spec["gen_new_tokens"] / min(gen)
    tr = results.get("transfer", {}) if isinstance(results.get("transfer"), dict) else {}
    pinned = tr.get("pinned", {}).get("h2d_gb_per_s") or 10.0
    pageable = tr.get("pageable", {}).get("h2d_gb_per_s") or 4.0
    # offload + reload of the fp32 moments (8 B/param), pinning them (~4 GB/s); the reference
    # copies (moments, weights, gradients out; and back in) at the pageable rate
    seconds += 2 * 8 * params / (pinned * 1e9) + 8 * params / 4e9 + 2 * 16 * params / (pageable * 1e9)
    return seconds


def _phase_memory(device, base: int) -> dict:
    """The phase's peak and what is allocated now, above the stage's start (CUDA only)."""
    import torch

    if device.type != "cuda":
        return {"peak_bytes": None, "resident_bytes": None}
    return {
        "peak_bytes": int(torch.cuda.max_memory_allocated(device)) - base,
        "resident_bytes": int(torch.cuda.memory_allocated(device)) - base,
    }


def _colocate_record(spec: dict, cfg: dict, model_dtype: str, compute, cuda: bool) -> dict:
    """The colocate stage's result before it runs: its settings (shape, batches, optimizer,
    offload, where the memory figures come from) and no phases yet."""
    return {
        "name": "colocate",
        "model_config": cfg,
        "weights_dtype": "float32",
        "compute_dtype": model_dtype if compute is not None else "float32",
        "rows": spec["rows"],
        "prompt": spec["prompt"],
        "response": spec["response"],
        "gradient_checkpointing": True,
        "gen_batch": spec["gen_batch"],
        "gen_prompt": spec["gen_prompt"],
        "gen_new_tokens": spec["gen_new_tokens"],
        "decoder": "generate",
        "optimizer": "torch.optim.AdamW(lr=1e-6, weight_decay=0.01), grad-norm clip 1.0",
        "offload": "rllib_exgrpo.rllib.colocation.OptimizerOffload",
        "memory_source": (
            "torch.cuda.max_memory_allocated / memory_allocated, above the stage's start"
            if cuda
            else "unavailable (no CUDA: torch's allocator figures are per GPU)"
        ),
        "phases": {},
    }


def run_colocate(shape: dict, device, dtype, attn: str, clock: Clock, predicted_s=None) -> dict:
    """The colocated cycle on one device (module doc, stage 7): learner step, release
    (gradients dropped, optimizer state to the host with the product's ``OptimizerOffload``),
    a generation turn from the same model, restore (state reloaded, a second step), each
    phase's peak and resident memory against the plan; then the optimizer round trip
    checked: the state bitwise equal after it, the weights untouched by the turn, and the
    step after the reload equal to the same step from the state as it was before the
    offload (a reference replay: the same gradients, the same optimizer)."""
    import torch

    spec, cfg = shape["colocate"], shape["config"]
    cuda = device.type == "cuda"
    compute = None if dtype == torch.float32 else dtype  # the DDP learner: fp32 weights, autocast compute
    model_dtype = str(dtype).replace("torch.", "")
    res = _colocate_record(spec, cfg, model_dtype, compute, cuda)
    clock.results["colocate"] = res
    t_stage = time.perf_counter()
    if predicted_s is not None:
        res["predicted_s"] = round(predicted_s, 1)
        if predicted_s > clock.left():
            res.update(status="skipped", why=f"predicted {predicted_s:.0f} s > {clock.left():.0f} s left")
            clock.save()
            return res
    gpu_memory = torch.cuda.get_device_properties(device).total_memory if cuda else None
    res["plan"] = colocate_plan(cfg, spec, model_dtype, attn, gpu_memory)
    cycle = ColocateCycle(shape, device, compute, attn, clock, res)
    try:
        cycle.run()
    except Exception as e:
        if not is_oom(e):
            raise
        res.update(
            status="oom",
            phase=cycle.phase,
            error=str(e).splitlines()[0][:300],
            peak_bytes=_phase_memory(device, res.get("stage_start_allocated_bytes", 0))["peak_bytes"],
        )
    cycle = None
    free_memory(device)
    rt = res.get("round_trip", {})
    clock.stage("colocate (whole stage)", time.perf_counter() - t_stage, f"round trip ok={rt['ok']}" if rt else res["status"])
    return res


class ColocateCycle:
    """The colocate stage's four phases on one model and optimizer, and their checks."""

    def __init__(self, shape: dict, device, compute, attn: str, clock: Clock, res: dict):
        self.shape, self.spec, self.cfg = shape, shape["colocate"], shape["config"]
        self.device, self.compute, self.attn, self.clock, self.res = device, compute, attn, clock, res
        self.cuda = device.type == "cuda"
        self.phases = res["phases"]
        self.phase = "build"
        self.model = self.optimizer = self.batch = self.params = None
        self.ref_state = self.ref_params = self.ref_grads = None
        self.checks = {}

    def autocast(self):
        import contextlib

        import torch

        return torch.autocast(self.device.type, dtype=self.compute) if self.compute is not None else contextlib.nullcontext()

    def run(self) -> None:
        self.build()
        self.learner_phase()
        self.release_phase()
        self.generation_phase()
        self.restore_phase()
        self.reference_check()
        self.set_plan_figures()
        self.res["status"] = "ok"

    def build(self) -> None:
        import torch

        spec, device = self.spec, self.device
        free_memory(device)
        sync(device)
        self.base = allocated_bytes(device)
        self.res["stage_start_allocated_bytes"] = self.base
        torch.manual_seed(0)
        self.model = build_model(self.shape, device, torch.float32, self.attn)
        set_checkpointing(self.model, True)
        self.model.config.use_cache = False
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.res["params"] = sum(p.numel() for p in self.params)
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-6, weight_decay=0.01)
        self.batch = learner_batch(spec["rows"], spec["prompt"], spec["response"], self.cfg["vocab_size"], device, seed=11)
        with self.autocast():
            self.batch["old_logp"] = score_nograd(self.model, self.batch, spec["response"])[0]  # behaviour log-probs
        free_memory(device)
        sync(device)

    def step_grads(self) -> tuple:
        """Forward, loss, backward under the learner's autocast, clip: ``(loss, grad norm)``."""
        import torch

        with self.autocast():
            loss = learner_forward_backward(self.model, self.batch, self.spec["response"], max_len=8192)
        return loss, float(torch.nn.utils.clip_grad_norm_(self.params, 1.0))

    def learner_phase(self) -> None:
        """1. learner awake: one step; its gradients stay until the release (as the learner's);
        then the reference for the round-trip checks: the state and weights, on the host."""
        from rllib_exgrpo.rllib.colocation import optimizer_state_tensors

        self.phase = "learner"
        reset_peak(self.device)
        t = time.perf_counter()
        self.model.train()
        loss, norm = self.step_grads()
        self.optimizer.step()
        sync(self.device)
        self.phases["learner"] = {
            "seconds": time.perf_counter() - t,
            "loss": loss,
            "grad_norm": norm,
            **_phase_memory(self.device, self.base),
        }
        self.clock.stage("colocate: learner step", self.phases["learner"]["seconds"])
        state = list(optimizer_state_tensors([self.optimizer]))
        self.ref_state = [(v.device, v.detach().to("cpu", copy=True)) for _, _, v in state]
        self.ref_params = [p.detach().to("cpu", copy=True) for p in self.params]
        self.checks["state_bytes"] = sum(v.numel() * v.element_size() for _, _, v in state)
        self.checks["device_state_bytes"] = sum(v.numel() * v.element_size() for _, _, v in state if v.device.type != "cpu")

    def release_phase(self) -> None:
        """2. release: gradients dropped, optimizer state to (pinned) host memory, cache emptied."""
        from rllib_exgrpo.rllib.colocation import OptimizerOffload, optimizer_state_tensors

        self.phase = "release"
        reset_peak(self.device)
        t = time.perf_counter()
        for p in self.model.parameters():
            p.grad = None
        self.offload = OptimizerOffload(lambda: [self.optimizer])
        t1 = time.perf_counter()
        moved = self.offload.offload()
        offload_s = time.perf_counter() - t1
        free_memory(self.device)
        sync(self.device)
        held = [v for _, _, v in optimizer_state_tensors([self.optimizer])]
        self.phases["release"] = {
            "seconds": time.perf_counter() - t,
            "offload_s": offload_s,
            "bytes_offloaded": moved,
            **_phase_memory(self.device, self.base),
        }
        self.checks.update(
            moved=moved,
            offload_s=offload_s,
            moved_by_kind=dict(getattr(self.offload, "moved", {})),
            on_host=all(v.device.type == "cpu" for v in held),
            pinned=(all(v.is_pinned() for v, (home, _) in zip(held, self.ref_state) if home.type != "cpu") if self.cuda else None),
        )
        self.clock.stage(
            "colocate: release",
            self.phases["release"]["seconds"],
            f"{moved / 1e9:.3f} GB of optimizer state to the host in {offload_s:.2f} s",
        )

    def generation_phase(self) -> None:
        """3. generation turn: the same model object, eval mode, no grad, the learner's autocast."""
        import torch

        spec, device = self.spec, self.device
        gb, gn = spec["gen_batch"], spec["gen_new_tokens"]
        self.phase = "generation"
        reset_peak(device)
        t = time.perf_counter()
        self.model.eval()
        self.model.config.use_cache = True
        g = torch.Generator().manual_seed(gb)
        ids = torch.randint(1, self.cfg["vocab_size"], (gb, spec["gen_prompt"]), generator=g).to(device)
        with torch.no_grad(), self.autocast():
            n_tokens = generate_tokens(self.model, "generate", gb, gn, ids, torch.ones_like(ids))
        sync(device)
        gen_s = time.perf_counter() - t
        peak = _phase_memory(device, self.base)["peak_bytes"]
        ids = None
        free_memory(device)
        self.model.config.use_cache = False
        self.model.train()
        self.phases["generation"] = {
            "seconds": gen_s,
            "generated_tokens": n_tokens,
            "tokens_per_s": n_tokens / gen_s,
            **_phase_memory(device, self.base),
            "peak_bytes": peak,
        }
        with torch.no_grad():
            self.checks["unchanged"] = all(torch.equal(p.detach(), r.to(device)) for p, r in zip(self.params, self.ref_params))
        self.clock.stage("colocate: generation", gen_s, f"{n_tokens / gen_s:,.0f} new tok/s (first call)")

    def restore_phase(self) -> None:
        """4. restore: optimizer state reloaded (checked against the reference), a second step."""
        import torch

        from rllib_exgrpo.rllib.colocation import optimizer_state_tensors

        self.phase = "restore"
        reset_peak(self.device)
        t = time.perf_counter()
        reloaded = self.offload.reload()
        sync(self.device)
        reload_s = time.perf_counter() - t
        reload_peak = _phase_memory(self.device, self.base)["peak_bytes"]
        state = list(optimizer_state_tensors([self.optimizer]))
        back_home = len(state) == len(self.ref_state) and all(v.device == home for (_, _, v), (home, _) in zip(state, self.ref_state))
        with torch.no_grad():
            bitwise = back_home and all(
                v.dtype == r.dtype and torch.equal(v, r.to(v.device)) for (_, _, v), (_, r) in zip(state, self.ref_state)
            )
        del state
        reset_peak(self.device)  # the comparison's copies are not the cycle's
        t1 = time.perf_counter()
        loss, norm = self.step_grads()
        sync(self.device)
        t2 = time.perf_counter()
        self.ref_grads = [p.grad.detach().to("cpu", copy=True) for p in self.params]  # for the reference (untimed)
        copy_s = time.perf_counter() - t2
        self.optimizer.step()
        sync(self.device)
        mem = _phase_memory(self.device, self.base)
        if self.cuda:
            mem["peak_bytes"] = max(mem["peak_bytes"], reload_peak)
        self.phases["restore"] = {
            "seconds": reload_s + time.perf_counter() - t1 - copy_s,
            "reload_s": reload_s,
            "bytes_reloaded": reloaded,
            "loss": loss,
            "grad_norm": norm,
            **mem,
        }
        self.checks.update(reloaded=reloaded, reload_s=reload_s, back_home=back_home, bitwise=bitwise)
        self.clock.stage(
            "colocate: restore",
            self.phases["restore"]["seconds"],
            f"{reloaded / 1e9:.3f} GB back in {reload_s:.2f} s, second step loss {loss:.4f}",
        )

    def reference_check(self) -> None:
        """The same second step from the state as it was before the offload: equal, bitwise."""
        import torch

        from rllib_exgrpo.rllib.colocation import optimizer_state_tensors

        device, c = self.device, self.checks
        after = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, r, gr in zip(self.params, self.ref_params, self.ref_grads):
                p.copy_(r.to(device))
                p.grad = gr.to(device)
            for (st, key, _), (home, r) in zip(list(optimizer_state_tensors([self.optimizer])), self.ref_state):
                st[key] = r.to(home)
        self.optimizer.step()
        sync(device)
        with torch.no_grad():
            matches = all(torch.equal(p.detach(), a) for p, a in zip(self.params, after))
            moved_by_step = sum(int((a != r.to(device)).sum()) for a, r in zip(after, self.ref_params))
        rt = {
            "state_tensors": len(self.ref_state),
            "state_bytes": c["state_bytes"],
            "device_state_bytes": c["device_state_bytes"],
            "bytes_offloaded": c["moved"],
            "bytes_reloaded": c["reloaded"],
            "moved_by_kind": c["moved_by_kind"],
            "offload_s": c["offload_s"],
            "reload_s": c["reload_s"],
            "on_host_during_turn": c["on_host"],
            "pinned_during_turn": c["pinned"],
            "back_on_device": c["back_home"],
            "state_bitwise_equal": c["bitwise"],
            "weights_unchanged_by_generation": c["unchanged"],
            "step_after_reload_matches_reference": matches,
            "second_step_update_fraction": moved_by_step / max(1, self.res["params"]),
        }
        if not self.cuda:
            rt["note"] = "CPU run: the state is copied into new host tensors and back (no device to leave)"
        losses = (self.phases["learner"]["loss"], self.phases["restore"]["loss"])
        # every state tensor goes to the host (the step counts too), and all of it comes back
        rt["ok"] = bool(
            c["on_host"]
            and c["back_home"]
            and c["bitwise"]
            and c["unchanged"]
            and matches
            and c["moved"] == c["state_bytes"]
            and c["reloaded"] == c["moved"]
            and c["pinned"] is not False
            and all(math.isfinite(x) for x in losses)
            and moved_by_step > 0
        )
        self.res["round_trip"] = rt

    def set_plan_figures(self) -> None:
        """Each phase's measurement beside the plan's figure for it."""
        plan, phases = self.res["plan"], self.phases
        for ph in COLOCATE_PHASES:
            e = phases[ph]
            for k in ("peak", "resident"):
                e[f"{k}_gib"] = None if e[f"{k}_bytes"] is None else e[f"{k}_bytes"] / GIB
            if plan.get("status") == "ok":
                e["plan_bytes"] = plan["phase_bytes"][ph]
                e["plan_gib"] = e["plan_bytes"] / GIB
                e["compares"] = "resident" if ph == "release" else "peak"
                measured = e[f"{e['compares']}_bytes"]
                e["within_plan"] = None if measured is None else measured <= e["plan_bytes"]
                if e["within_plan"] is False:
                    e["over_plan_bytes"] = measured - e["plan_bytes"]
        if plan.get("status") == "ok" and self.cuda:
            phases["generation"]["within_plan_as_planned"] = phases["generation"]["peak_bytes"] <= plan["generation_as_planned_bytes"]
