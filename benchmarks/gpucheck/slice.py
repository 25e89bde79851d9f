"""The slice stage: a bf16 learner step of a 7B-shaped slice, fitted over depth, against the plan."""

from __future__ import annotations

import time

from gpucheck.common import (
    allocated_bytes,
    build_model,
    Clock,
    count_params,
    depth_fit,
    free_memory,
    GIB,
    is_oom,
    learner_batch,
    learner_forward_backward,
    MasterWeightAdamW,
    peak_bytes,
    reset_peak,
    score_nograd,
    set_checkpointing,
    step_flops,
    sync,
)


def run_slice(spec: dict, device, attn: str, steps: int, clock: Clock, flops_rate=None, after_last=None) -> dict:
    """A bf16 learner step of the first few decoder layers of a full-size model, at the
    recipe's micro-batch, with gradient checkpointing; fitted over depth and extrapolated."""
    cfg = dict(spec["config"])
    full = cfg["num_hidden_layers"]
    rows, prompt, response = spec["rows"], spec["prompt"], spec["response"]
    res = slice_header(spec, device, attn)
    clock.results["slice"] = res
    for layers in spec["layers"]:
        name = f"slice {spec['name']} {layers}/{full} layers {rows}x({prompt}+{response}) ckpt"
        entry = {"name": name, "layers": layers}
        res["depths"].append(entry)
        t = time.perf_counter()
        # build + warm-up + scoring + steps, from the learner stage's FLOP rate
        predicted = (
            (steps + 2) * step_flops(cfg, layers, rows, prompt + response, response, True) / flops_rate * 1.5 if flops_rate else None
        )
        if predicted is not None and predicted > clock.left():
            entry.update(status="skipped", why=f"predicted {predicted:.0f} s > {clock.left():.0f} s left")
            clock.stage(name, time.perf_counter() - t, f"skipped ({entry['why']})")
            continue
        free_memory(device)
        sync(device)
        base = allocated_bytes(device)
        depth = SliceDepth(spec, layers, device, attn, entry, base)
        try:
            depth.build(t)
            depth.measure(steps, clock)
        except Exception as e:  # OOM is a result here, not a crash
            if not is_oom(e):
                raise
            entry.update(status="oom", error=str(e).splitlines()[0][:300], peak_bytes=peak_bytes(device) - base)
        depth.opt = depth.batch = None
        free_memory(device)
        note = (
            f"{entry['step_s']:.2f} s/step ({entry['fb_s']:.2f} fwd+bwd, {entry['opt_s']:.2f} optimiser), "
            f"{entry['tokens_per_s']:,.0f} tok/s, state {entry['state_bytes'] / GIB:.2f} GiB, "
            f"peak {entry['peak_gib']:.2f} GiB"
            if entry["status"] == "ok"
            else entry["status"]
        )
        clock.stage(name, time.perf_counter() - t, note)
        if after_last is not None and layers == spec["layers"][-1] and entry["status"] == "ok":
            after_last(depth.model, entry)  # e.g. the drift stage on this slice's weights
        depth = None
        free_memory(device)
    res["full_depth"] = extrapolate_slice(res)
    clock.save()
    return res


def slice_header(spec: dict, device, attn: str) -> dict:
    """The slice stage's result before any depth runs: what is measured, and how."""
    cfg = dict(spec["config"])
    rows, prompt, response = spec["rows"], spec["prompt"], spec["response"]
    return {
        "model": spec["name"],
        "full_layers": cfg["num_hidden_layers"],
        "slice_layers": list(spec["layers"]),
        "rows": rows,
        "prompt": prompt,
        "response": response,
        "tokens_per_step": rows * (prompt + response),
        "gradient_checkpointing": True,
        "attn_implementation": attn,
        "weights": "bfloat16 module (forward and backward in bf16, bf16 gradients)",
        "optimizer": "torch.optim.AdamW (lr 1e-6, wd 0.01, default implementation) on an fp32 master copy; "
        "global-norm clip 1.0 on the fp32 gradients; master copy rounded into the bf16 weights",
        "counted": "everything on this one device, unsharded: bf16 weights 2 B/param, fp32 master 4, AdamW moments "
        "8 (state_bytes: 14 B/param); bf16 gradients 2 B/param during backward; fp32 master gradients "
        "4 B/param made during the optimiser step; activations of one micro-batch with checkpointing. "
        "ZeRO over N learners keeps 1/N of the fp32 parts (and, stage 2, of the gradients) per GPU",
        "memory_source": (
            "torch.cuda.max_memory_allocated minus what was allocated before the slice was built"
            if device.type == "cuda"
            else "process peak RSS (CPU): monotone over the run, not per depth; state_bytes is counted from the tensors"
        ),
        "model_config": cfg,
        "params_full_depth": count_params(cfg),
        "depths": [],
    }


class SliceDepth:
    """One slice depth: the model with its master-weight optimiser (``build``), then its
    scoring pass and timed steps (``measure``)."""

    def __init__(self, spec: dict, layers: int, device, attn: str, entry: dict, base: int):
        self.spec, self.layers, self.device, self.attn, self.entry, self.base = spec, layers, device, attn, entry, base
        self.vocab = spec["config"]["vocab_size"]
        self.model = self.opt = self.batch = None

    def build(self, t: float) -> None:
        """The bf16 model and its optimiser, after a warm-up step on a small batch (AdamW's
        moments exist from here on): does the master copy move at lr 1e-6, and how much of
        it reaches the bf16 weights?"""
        import torch

        entry, device = self.entry, self.device
        torch.manual_seed(self.layers)
        self.model = model = build_model(
            {"config": {**self.spec["config"], "num_hidden_layers": self.layers}}, device, torch.bfloat16, self.attn
        )
        entry["params"] = sum(p.numel() for p in model.parameters())
        set_checkpointing(model, True)
        model.config.use_cache = False
        model.train()
        self.opt = opt = MasterWeightAdamW(model.parameters(), lr=1e-6, weight_decay=0.01, max_norm=1.0)
        warm = learner_batch(2, 8, 8, self.vocab, device, seed=0)
        warm["old_logp"] = score_nograd(model, warm, 8)[0]
        model.train()
        # (every 97th element of every tensor but the input embedding, whose unused rows
        # get no gradient)
        emb = model.get_input_embeddings().weight
        pairs = [(p, m) for p, m in zip(opt.params, opt.masters) if p is not emb]
        m_before = [m.detach().reshape(-1)[::97].clone() for _, m in pairs]
        w_before = [p.detach().reshape(-1)[::97].clone() for p, _ in pairs]
        learner_forward_backward(model, warm, 8, 8)
        opt.step()
        opt.zero_grad()
        n = sum(x.numel() for x in m_before)
        entry["master_update_fraction"] = sum(int((m.detach().reshape(-1)[::97] != b).sum()) for (_, m), b in zip(pairs, m_before)) / n
        entry["weight_update_fraction"] = sum(int((p.detach().reshape(-1)[::97] != b).sum()) for (p, _), b in zip(pairs, w_before)) / n
        warm = m_before = w_before = pairs = emb = None
        free_memory(device)
        sync(device)
        entry["state_bytes_counted"] = opt.state_bytes()
        entry["state_bytes"] = allocated_bytes(device) - self.base if device.type == "cuda" else entry["state_bytes_counted"]["total"]
        entry["build_s"] = time.perf_counter() - t

    def one_step(self):
        """``(fwd+bwd s, optimiser s, fwd+bwd peak, optimiser peak)``, peaks above the base."""
        device, response = self.device, self.spec["response"]
        reset_peak(device)
        sync(device)
        t1 = time.perf_counter()
        learner_forward_backward(self.model, self.batch, response, max_len=8192)
        sync(device)
        fb_s, fb_peak = time.perf_counter() - t1, peak_bytes(device) - self.base
        reset_peak(device)
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        sync(device)
        return fb_s, time.perf_counter() - t1, fb_peak, peak_bytes(device) - self.base

    def measure(self, steps: int, clock: Clock) -> None:
        entry, device, spec = self.entry, self.device, self.spec
        response, tokens = spec["response"], spec["rows"] * (spec["prompt"] + spec["response"])
        self.batch = learner_batch(spec["rows"], spec["prompt"], response, self.vocab, device, seed=self.layers)
        entry["valid_tokens_per_step"] = int(self.batch["attention_mask"].sum())
        reset_peak(device)
        sync(device)
        t1 = time.perf_counter()
        self.batch["old_logp"] = score_nograd(self.model, self.batch, response)[0]
        sync(device)
        entry["score_nograd_s"] = time.perf_counter() - t1
        entry["score_nograd_peak_bytes"] = peak_bytes(device) - self.base
        self.model.train()
        first = self.one_step()
        n = steps
        if (first[0] + first[1]) * n > clock.left():
            n = max(1, int(clock.left() // max(first[0] + first[1], 1e-9)))
            entry["steps_cut_by_budget"] = True
        runs = [self.one_step() for _ in range(n)]
        fb_s = sum(r[0] for r in runs) / n
        opt_s = sum(r[1] for r in runs) / n
        entry.update(
            status="ok",
            steps=n,
            warmup_step_s=first[0] + first[1],
            fb_s=fb_s,
            opt_s=opt_s,
            step_s=fb_s + opt_s,
            step_s_min=min(r[0] + r[1] for r in runs),
            tokens_per_s=tokens / (fb_s + opt_s),
            # what a micro-batch costs under gradient accumulation (one optimiser
            # step per minibatch of many micro-batches)
            fb_tokens_per_s=tokens / fb_s,
            valid_tokens_per_s=entry["valid_tokens_per_step"] / (fb_s + opt_s),
            fb_peak_bytes=max(r[2] for r in runs),
            opt_peak_bytes=max(r[3] for r in runs),
        )
        entry["peak_bytes"] = max(entry["fb_peak_bytes"], entry["opt_peak_bytes"])
        entry["peak_above_state_bytes"] = entry["peak_bytes"] - entry["state_bytes"]
        entry["peak_gib"] = entry["peak_bytes"] / GIB


#: Per-depth quantities fitted as fixed + per-layer.
SLICE_FIT_KEYS = (
    "params",
    "state_bytes",
    "fb_peak_bytes",
    "opt_peak_bytes",
    "peak_bytes",
    "peak_above_state_bytes",
    "score_nograd_s",
    "fb_s",
    "opt_s",
    "step_s",
)


def extrapolate_slice(res: dict) -> dict:
    """Fit every per-depth quantity over the depths that ran and evaluate it at full depth."""
    ok = [e for e in res["depths"] if e.get("status") == "ok"]
    full = res["full_layers"]
    if len({e["layers"] for e in ok}) < 2:
        return {"status": "not extrapolated: needs two slice depths that ran", "depths_ok": [e["layers"] for e in ok]}
    xs = [e["layers"] for e in ok]
    fits = {k: depth_fit(xs, [e[k] for e in ok], full) for k in SLICE_FIT_KEYS}
    out = {"status": "ok", "layers": full, "fits": fits, "depths_used": xs}
    out.update({k: f["value"] for k, f in fits.items()})
    out["params"] = round(out["params"])
    # A check of the fit itself: the parameter count is exactly linear in depth.
    out["params_actual"] = res["params_full_depth"]
    out["tokens_per_s"] = res["tokens_per_step"] / out["step_s"]
    out["fb_tokens_per_s"] = res["tokens_per_step"] / out["fb_s"]
    out["score_nograd_tokens_per_s"] = res["tokens_per_step"] / out["score_nograd_s"]
    out["peak_gib"] = out["peak_bytes"] / GIB
    out["state_gib"] = out["state_bytes"] / GIB
    return out


def plan_comparison(res: dict, recipe: dict) -> dict:
    """The memory plan's estimate (``rllib_exgrpo.planning``) next to what the slice measured:
    at each slice depth and at full depth on one unsharded device (what was measured), and
    per GPU as the recipe runs (its backend, ZeRO stage, learners)."""
    try:
        from rllib_exgrpo.planning.memory import learner_activation_bytes, model_state_bytes  # noqa: F401
        from rllib_exgrpo.planning.shapes import ModelShape  # noqa: F401
    except ImportError as e:
        return {"status": f"unavailable ({type(e).__name__}: {e})"}
    try:
        plan_at = _slice_planner(res)
        rows, seq = res["rows"], res["prompt"] + res["response"]
        out = {
            "status": "ok",
            "source": "rllib_exgrpo.planning.memory",
            "plan_state_args": "backend deepspeed, zero_stage 2, num_learners 1, model_dtype bfloat16 (one unsharded device, as measured)",
            "plan_activation_args": f"rows {rows}, tokens {seq}, gradient_checkpointing, dtype_bytes 2",
            "measured_peak_above_state": "peak minus weights + fp32 master + moments: activations and the gradients live at the peak",
            "per_depth": _plan_per_depth(res, plan_at),
        }
        if res.get("memory_source", "").startswith("process peak RSS"):
            out["note"] = "measured memory is process RSS on CPU: the ratios mean nothing here"
        out["recipe_per_gpu"] = _plan_per_gpu(res, recipe, plan_at)
        return out
    except Exception as e:  # the plan's API moved: say so, keep the run
        return {"status": f"error ({type(e).__name__}: {e})"}


def _slice_planner(res: dict):
    """``plan_at(layers, backend=, zero_stage=, num_learners=, model_dtype=)``: the plan's
    state and activation bytes of the slice's model at that depth."""
    from transformers import Qwen2Config

    from rllib_exgrpo.planning.memory import learner_activation_bytes, model_state_bytes
    from rllib_exgrpo.planning.shapes import ModelShape

    cfg = res["model_config"]
    rows, seq = res["rows"], res["prompt"] + res["response"]

    def total(state):
        if isinstance(state, dict):
            return (
                int(state["total"])
                if "total" in state
                else int(sum(v for v in state.values() if isinstance(v, (int, float)) and not isinstance(v, bool)))
            )
        return int(state)

    def plan_at(layers, backend="deepspeed", zero_stage=2, num_learners=1, model_dtype="bfloat16"):
        shape = ModelShape.from_hf_config(Qwen2Config(**{**cfg, "num_hidden_layers": layers}))
        state = model_state_bytes(shape, backend=backend, zero_stage=zero_stage, num_learners=num_learners, model_dtype=model_dtype)
        act = int(learner_activation_bytes(shape, rows, seq, gradient_checkpointing=True, dtype_bytes=2, response_tokens=res["response"]))
        return {"plan_state": state, "plan_state_bytes": total(state), "plan_activation_bytes": act, "plan_total_bytes": total(state) + act}

    return plan_at


def _plan_per_depth(res: dict, plan_at) -> list:
    """The plan beside the measurement at each depth that ran and at the fitted full depth."""
    rows_out = []
    points = [(e["layers"], e) for e in res["depths"] if e.get("status") == "ok"]
    fd = res.get("full_depth", {})
    if fd.get("status") == "ok":
        points.append((res["full_layers"], fd))
    for layers, m in points:
        row = {"layers": layers, "extrapolated": layers == res["full_layers"] and m is fd}
        row.update(plan_at(layers))
        row.update(
            measured_state_bytes=m["state_bytes"],
            measured_peak_bytes=m["peak_bytes"],
            measured_peak_above_state_bytes=m["peak_above_state_bytes"],
        )
        row["measured_over_plan_state"] = m["state_bytes"] / max(row["plan_state_bytes"], 1)
        row["measured_over_plan_total"] = m["peak_bytes"] / max(row["plan_total_bytes"], 1)
        rows_out.append(row)
    return rows_out


def _plan_per_gpu(res: dict, recipe: dict, plan_at) -> dict:
    """The plan per GPU as the recipe runs (its backend, ZeRO stage and learner count)."""
    fd = res.get("full_depth", {})
    backend = recipe.get("learner_backend", "ddp")
    zero = int(recipe.get("deepspeed_zero_stage", 2)) if backend == "deepspeed" else 0
    settings = {
        "learner_backend": backend,
        "zero_stage": zero,
        "num_learners": int(recipe.get("num_learners", 1)),
        "model_dtype": recipe.get("model_dtype", "bfloat16"),
        "file": recipe.get("file"),
    }
    try:
        per_gpu = plan_at(
            res["full_layers"], backend=backend, zero_stage=zero, num_learners=settings["num_learners"], model_dtype=settings["model_dtype"]
        )
    except Exception as e:
        per_gpu = {"status": f"error ({type(e).__name__}: {e})"}
    else:
        per_gpu["status"] = "ok"
        if fd.get("status") == "ok":
            # the plan's per-GPU state with the activations this run measured (extrapolated)
            per_gpu["plan_state_plus_measured_above_state_bytes"] = per_gpu["plan_state_bytes"] + fd["peak_above_state_bytes"]
    per_gpu["recipe"] = settings
    return per_gpu
