"""The packed stage: one packed learner pass at the real vocabulary, its peak against the plan."""

from __future__ import annotations

import sys
from pathlib import Path
import time

from gpucheck.common import (
    allocated_bytes,
    build_model,
    Clock,
    free_memory,
    GIB,
    is_oom,
    read_recipe,
    reset_peak,
    set_checkpointing,
    step_flops,
    sync,
)


def flash_attn_status() -> dict:
    """Whether the ``flash_attn`` package imports here (what ``resolve_attn_implementation``
    asks on CUDA), with its version or the import error."""
    try:
        import flash_attn
    except Exception as e:  # ImportError, or a wheel built against another torch
        return {"importable": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    return {"importable": True, "version": str(getattr(flash_attn, "__version__", "unknown"))}


def cpu_peak_bytes(fn) -> int:
    """Peak live torch CPU tensor bytes while ``fn`` runs, relative to its start, from the
    allocator's records (``torch.profiler`` memory events): benchmarks/memory_plan.py's
    ``_peak_of`` (standard library imports only, as this script needs)."""
    here = str(Path(__file__).resolve().parents[1])  # benchmarks/
    if here not in sys.path:
        sys.path.insert(0, here)
    from memory_plan import _peak_of

    return _peak_of(fn)


def packed_pass_spec(spec: dict) -> dict:
    """The packed stage's pass: the recipe's ``learner_micro_batch_tokens`` and
    ``gradient_checkpointing`` where the shape names a recipe (else the shape's own), as
    whole rows of ``prompt + response`` tokens."""
    out = {"tokens_budget": int(spec["tokens"]), "gradient_checkpointing": True, "max_len": int(spec["max_len"])}
    if spec.get("recipe") is not None:
        recipe = read_recipe(Path(spec["recipe"]))
        out["recipe"] = {
            k: recipe[k]
            for k in ("file", "learner_micro_batch_tokens", "gradient_checkpointing", "max_response_tokens", "read_error")
            if k in recipe
        }
        if recipe.get("learner_micro_batch_tokens"):
            out["tokens_budget"] = int(recipe["learner_micro_batch_tokens"])
        out["gradient_checkpointing"] = bool(recipe.get("gradient_checkpointing", True))
        out["max_len"] = int(recipe.get("max_response_tokens", out["max_len"]))
    width = spec["prompt"] + spec["response"]
    out["rows"] = max(1, out["tokens_budget"] // width)
    out["tokens"] = out["rows"] * width
    out["scored_tokens"] = out["rows"] * spec["response"]
    return out


def packed_plan(cfg: dict, tokens: int, scored: int, checkpointing: bool) -> dict:
    """The memory plan's activation peak of one packed pass (``rows=1``, no dense mask, bf16,
    the default log-prob chunk), or ``status: unavailable (...)``."""
    try:
        from transformers import Qwen2Config

        from rllib_exgrpo.planning.memory import learner_activation_breakdown
        from rllib_exgrpo.planning.shapes import ModelShape
    except ImportError as e:
        return {"status": f"unavailable ({type(e).__name__}: {e})"}
    shape = ModelShape.from_hf_config(Qwen2Config(**cfg))
    args = dict(gradient_checkpointing=checkpointing, dtype_bytes=2, autocast=False, dense_mask=False, chunk_tokens=None)
    parts = learner_activation_breakdown(shape, 1, tokens, response_tokens=scored, **args)
    # The planner's own pass under a token budget scores every position (its worst case).
    every = learner_activation_breakdown(shape, 1, tokens, response_tokens=tokens, **args)
    return {
        "status": "ok",
        "source": "rllib_exgrpo.planning.memory.learner_activation_breakdown",
        "args": f"rows 1, tokens {tokens}, response_tokens {scored}, gradient_checkpointing {checkpointing}, "
        "dtype_bytes 2, dense_mask False, chunk_tokens default",
        "planned_bytes": int(parts["peak"]),
        "peak_phase": parts["peak_phase"],
        "breakdown": parts,
        "planned_every_position_scored_bytes": int(every["peak"]),
    }


def run_packed(spec: dict, device, clock: Clock, flops_rate=None, kernel=None, key: str = "packed") -> dict:
    """One packed learner pass at the real vocabulary on a few decoder layers of the model
    (module doc, stage 2): its peak beyond what was allocated before it, against the plan.
    ``kernel``: the attention kernel to use (default: what the learner resolves, falling
    back to ``sdpa_varlen`` when it fails to build); ``key``: where the entry goes in the
    results."""
    from rllib_exgrpo.core.attention import register_kernels, resolve_attn_implementation

    fa = flash_attn_status()
    register_kernels()
    forced = kernel is not None
    kernel = kernel or resolve_attn_implementation("auto", device.type)
    entry = packed_entry(spec, device, kernel, fa)
    entry["kernel_forced"] = forced
    clock.results[key] = entry
    t = time.perf_counter()
    pp = packed_pass_spec(spec)
    cfg = entry["model_config"]
    # build + warm-up + no-grad pass + two passes, from the learner stage's FLOP rate
    predicted = (
        4
        * step_flops(
            cfg, spec["layers"], entry["rows"], entry["prompt"] + entry["response"], entry["response"], entry["gradient_checkpointing"]
        )
        / flops_rate
        * 1.5
        if flops_rate
        else None
    )
    if predicted is not None:
        entry["predicted_s"] = predicted
    if predicted is not None and predicted > clock.left():
        entry.update(status="skipped", why=f"predicted {predicted:.0f} s > {clock.left():.0f} s left")
    else:
        free_memory(device)
        try:
            PackedPass(spec, pp, device, entry, forced).run(clock, t)
        except Exception as e:  # OOM is a result; any other failure is reported and the check goes on
            import traceback

            entry.update(
                status="oom" if is_oom(e) else "error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            )
            if entry["status"] == "error":
                entry["traceback"] = traceback.format_exc()[-3000:]
                print(entry["traceback"], file=sys.stderr, flush=True)
        free_memory(device)
    clock.stage(entry["name"], time.perf_counter() - t, packed_note(entry, fa))
    return entry


def packed_entry(spec: dict, device, kernel: str, fa: dict) -> dict:
    """The packed stage's entry before it runs: the pass's shape, kernel and settings."""
    from rllib_exgrpo.core.chunked_logprobs import DEFAULT_CHUNK_TOKENS

    cfg = {**spec["config"], "num_hidden_layers": spec["layers"]}
    pp = packed_pass_spec(spec)
    rows, prompt, response, tokens = pp["rows"], spec["prompt"], spec["response"], pp["tokens"]
    ckpt = pp["gradient_checkpointing"]
    name = (
        f"packed {spec['name']} {spec['layers']}/{spec['config']['num_hidden_layers']} layers "
        f"{rows}x({prompt}+{response})={tokens} tok {'ckpt' if ckpt else 'no-ckpt'}"
    )
    entry = {
        "name": name,
        "model": spec["name"],
        "layers": spec["layers"],
        "full_layers": spec["config"]["num_hidden_layers"],
        "model_config": cfg,
        "rows": rows,
        "prompt": prompt,
        "response": response,
        "tokens": tokens,
        "scored_tokens": pp["scored_tokens"],
        "tokens_budget": pp["tokens_budget"],
        "gradient_checkpointing": ckpt,
        "dtype": "bfloat16",
        "chunk_tokens": int(DEFAULT_CHUNK_TOKENS),
        "kernel_requested": kernel,
        "kernel": kernel,
        "flash_attn_importable": fa["importable"],
        "flash_attn": fa,
        "loss_max_len": pp["max_len"],
        "memory_source": (
            "torch.cuda.max_memory_allocated after reset_peak_memory_stats minus memory_allocated before the pass"
            if device.type == "cuda"
            else "torch.profiler memory events: peak live CPU tensor bytes during the pass"
        ),
        "before_pass": "weights and their (zeroed) gradients allocated, as under gradient accumulation",
    }
    if "recipe" in pp:
        entry["recipe"] = pp["recipe"]
    return entry


def packed_note(entry: dict, fa: dict) -> str:
    fa_note = f"flash_attn {'importable' if fa['importable'] else 'not importable'}"
    if entry["status"] != "ok":
        return f"{entry['status']} ({entry.get('why', entry.get('error', ''))}); kernel {entry['kernel']}, {fa_note}"
    ratio = entry.get("measured_over_planned")
    return (
        f"kernel {entry['kernel']} ({fa_note}), {entry['pass_s']:.2f} s/pass, {entry['tokens_per_s']:,.0f} "
        f"tok/s, peak {entry['measured_gib']:.3f} GiB, plan "
        + (f"{entry['planned_gib']:.3f} GiB, measured_over_planned={ratio:.3f}" if ratio is not None else entry["plan"]["status"])
    )


class PackedPass:
    """The packed stage's model, batch and pass (``run``: build, warm up, measure)."""

    def __init__(self, spec: dict, pp: dict, device, entry: dict, forced: bool):
        self.spec, self.pp, self.device, self.entry, self.forced = spec, pp, device, entry, forced
        self.cuda = device.type == "cuda"
        self.model = self.batch = None

    def build(self) -> None:
        """The slice in bf16 under the entry's kernel (the learner's fallback kernel where
        that fails to build, unless the kernel was asked for)."""
        import torch

        from rllib_exgrpo.core.attention import SDPA_VARLEN

        entry, cfg = self.entry, self.entry["model_config"]
        kernel = entry["kernel"]
        torch.manual_seed(self.spec["layers"])
        try:
            self.model = build_model({"config": cfg}, self.device, torch.bfloat16, kernel)
        except Exception as e:  # e.g. a flash_attn wheel transformers refuses: the learner's fallback kernel
            if is_oom(e) or kernel == SDPA_VARLEN or self.forced:
                raise
            entry["kernel_fallback"] = f"{kernel} failed at build ({type(e).__name__}: {str(e)[:200]}); {SDPA_VARLEN}"
            self.model = build_model({"config": cfg}, self.device, torch.bfloat16, SDPA_VARLEN)
        entry["kernel"] = getattr(self.model.config, "_attn_implementation", kernel)
        entry["params"] = sum(p.numel() for p in self.model.parameters())
        set_checkpointing(self.model, entry["gradient_checkpointing"])
        self.model.config.use_cache = False
        self.model.train()

    def packed_batch(self, n, p, r, seed):
        import torch

        from rllib_exgrpo.core import columns as C
        from rllib_exgrpo.core.packing import pack_rows

        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, self.entry["model_config"]["vocab_size"], (n, p + r), generator=g).to(self.device)
        mask = torch.ones_like(ids)
        cols = {C.INPUT_IDS: ids, C.ATTENTION_MASK: mask, C.RESPONSE_MASK: mask[:, p:].float()}
        cols.update(pack_rows(cols))
        cols["advantages"] = torch.randn(n, generator=g).to(self.device)
        cols["off_policy"] = (torch.arange(n) % 2 == 1).to(self.device)  # half replayed (rho = 0.5)
        return cols

    def score_nograd(self, b):
        import torch

        from rllib_exgrpo.core.chunked_logprobs import DEFAULT_CHUNK_TOKENS
        from rllib_exgrpo.core.packing import score_packed

        with torch.no_grad():
            return score_packed(self.model, b, chunk_tokens=DEFAULT_CHUNK_TOKENS)[0]

    def learner_pass(self, b) -> float:
        from rllib_exgrpo.core import columns as C
        from rllib_exgrpo.core.chunked_logprobs import DEFAULT_CHUNK_TOKENS
        from rllib_exgrpo.core.losses import mixed_policy_loss
        from rllib_exgrpo.core.packing import score_packed

        logp, entropy = score_packed(self.model, b, temperature=1.0, chunk_tokens=DEFAULT_CHUNK_TOKENS)
        loss, _ = mixed_policy_loss(
            logp,
            b["old_logp"],
            b["advantages"],
            b[C.RESPONSE_MASK],
            b["off_policy"],
            eps_low=0.2,
            eps_high=0.2,
            clip_fresh=False,
            beta=0.1,
            agg_mode="seq-mean-token-sum-norm-official",
            max_len=self.pp["max_len"],
            micro_batch_rows=64,
            entropy=entropy,
            entropy_coeff=0.001,
        )
        loss.backward()
        return float(loss.detach())

    def run(self, clock: Clock, t: float) -> None:
        from rllib_exgrpo.core import columns as C

        entry = self.entry
        self.build()
        # warm-up on a small packed batch: every parameter's gradient exists from here on
        warm = self.packed_batch(2, 8, 8, seed=0)
        warm["old_logp"] = self.score_nograd(warm)
        self.learner_pass(warm)
        for p_ in self.model.parameters():
            if p_.grad is not None:
                p_.grad.zero_()
        warm = None
        entry["build_s"] = time.perf_counter() - t
        self.batch = self.packed_batch(entry["rows"], entry["prompt"], entry["response"], seed=1)
        assert int(self.batch[C.PACKED_INPUT_IDS].shape[1]) == entry["tokens"]
        sync(self.device)
        t1 = time.perf_counter()
        self.batch["old_logp"] = self.score_nograd(self.batch)  # and the forward kernels warmed at full size
        sync(self.device)
        entry["score_nograd_s"] = time.perf_counter() - t1
        # a checkpointed pass: forward, the layers' and the chunks' recomputation, backward
        predicted_pass = entry["score_nograd_s"] * (4 if entry["gradient_checkpointing"] else 3) * 1.5
        if predicted_pass > clock.left():
            entry.update(status="skipped", why=f"predicted {predicted_pass:.0f} s > {clock.left():.0f} s left")
            return
        self.measure(clock)

    def one_pass(self, measure: bool):
        """``(seconds, peak beyond the start or None, loss, allocated before)``."""
        import torch

        free_memory(self.device)
        sync(self.device)
        before = allocated_bytes(self.device)
        reset_peak(self.device)
        t2 = time.perf_counter()
        peak = None
        if measure and not self.cuda:
            box = {}
            peak = cpu_peak_bytes(lambda: box.setdefault("loss", self.learner_pass(self.batch)))
            loss = box["loss"]
        else:
            loss = self.learner_pass(self.batch)
        sync(self.device)
        seconds = time.perf_counter() - t2
        if self.cuda:
            peak = int(torch.cuda.max_memory_allocated(self.device)) - before
        return seconds, (peak if measure else None), loss, before

    def measure(self, clock: Clock) -> None:
        entry = self.entry
        passes = [self.one_pass(True)]
        # a second pass, warm (on CPU not under the profiler: its time is the figure)
        if passes[0][0] * 1.5 < clock.left():
            passes.append(self.one_pass(self.cuda))
        else:
            entry["passes_cut_by_budget"] = True
        peaks = [p_[1] for p_ in passes if p_[1] is not None]
        seconds = passes[-1][0]
        entry.update(
            status="ok",
            passes=len(passes),
            first_pass_s=passes[0][0],
            pass_s=seconds,
            tokens_per_s=entry["tokens"] / seconds,
            loss=passes[-1][2],
            allocated_before_bytes=passes[0][3],
            measured_bytes=max(peaks),
            measured_gib=max(peaks) / GIB,
            measured_per_pass_bytes=peaks,
        )
        plan = packed_plan(entry["model_config"], entry["tokens"], entry["scored_tokens"], entry["gradient_checkpointing"])
        entry["plan"] = plan
        if plan["status"] == "ok":
            entry["planned_bytes"] = plan["planned_bytes"]
            entry["planned_gib"] = plan["planned_bytes"] / GIB
            entry["measured_over_planned"] = entry["measured_bytes"] / max(plan["planned_bytes"], 1)
