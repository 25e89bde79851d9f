"""The vLLM stages: ``vllm-reload`` (an engine takes the learner's weights through the
colocated push; its prompt log-probs match HF's; the push raises no vLLM warning) and
``vllm-sleep-wake`` (the same across ``sleep(level=2)`` and the two-step wake, with the GPU
memory in use awake and asleep against the plan).

The model is made here, never downloaded: the project's rehearsal model of the Qwen2 family
at Qwen2.5's vocabulary (``rehearsal:qwen2:vocab=151936,tied``: two small layers, random
weights saved with ``save_pretrained``, the tiny model's byte-level BPE filled up to the
vocabulary; ``models/rehearsal.py``). The learner's copy is perturbed before the push, so
an engine still holding the checkpoint's weights fails the comparison (its mismatch before
the push is reported too: the check must tell the two apart).
"""

from __future__ import annotations

import logging
import time
import warnings
from types import SimpleNamespace

from gpucheck.common import GIB
from gpucheck.deps import have

MODEL_SPEC = "rehearsal:qwen2:vocab=151936,tied"
#: Largest |vLLM - HF| prompt log-prob allowed after the push, by the engine's dtype.
TOLERANCE = {"float32": 2e-3, "bfloat16": 0.1}
PROMPTS = ["12 + 7 =", "What is 3 times 14? Think step by step.", "Compute 81 - 19, then add 5."]


def _skip_without_vllm():
    if not have("vllm"):
        return {"status": "skipped", "why": "vllm is not installed"}
    return None


def run_vllm_reload(device) -> dict:
    """Build the engine, push the learner's weights, compare prompt log-probs with HF's."""
    skipped = _skip_without_vllm()
    if skipped:
        return {"name": "vllm-reload", **skipped}
    rig = Rig(device, sleep_mode=False)
    try:
        entry = {"name": "vllm-reload", "model": MODEL_SPEC, "dtype": rig.dtype, **rig.build()}
        entry["before_push"] = rig.compare()
        entry["push"] = rig.push()
        entry["after_push"] = rig.compare()
        return finish(entry, rig)
    finally:
        rig.close()


def run_vllm_sleep_wake(device) -> dict:
    """Generate, ``sleep(level=2)``, wake the weights, push, wake the KV cache, generate again,
    compare with HF; GPU memory in use at each point against the plan's terms."""
    skipped = _skip_without_vllm()
    if skipped:
        return {"name": "vllm-sleep-wake", **skipped}
    if device.type != "cuda":
        return {"name": "vllm-sleep-wake", "status": "skipped", "why": "vLLM's CPU build has no sleep mode (enable_sleep_mode needs CUDA)"}
    rig = Rig(device, sleep_mode=True)
    try:
        entry = {"name": "vllm-sleep-wake", "model": MODEL_SPEC, "dtype": rig.dtype, **rig.build()}
        entry["push_on_build"] = rig.push()
        mem = {"awake": rig.gpu_used()}
        entry["first_generate"] = rig.generate()
        rig.backend.llm.sleep(level=2)
        mem["asleep"] = rig.gpu_used()
        rig.backend.llm.wake_up(tags=["weights"])
        mem["weights_awake"] = rig.gpu_used()
        entry["push"] = rig.push()
        rig.backend.llm.wake_up(tags=["kv_cache"])
        mem["awake_again"] = rig.gpu_used()
        entry["second_generate"] = rig.generate()
        entry["after_push"] = rig.compare()
        entry["memory"] = sleep_memory(rig, mem)
        return finish(entry, rig)
    finally:
        rig.close()


def finish(entry: dict, rig) -> dict:
    """Status and note from the checks: log-probs within the tolerance after the push (and
    not before it, where that was measured), no vLLM warning during a push, memory within
    the plan where it was measured."""
    tol = TOLERANCE[rig.dtype]
    after = entry["after_push"]["max_abs_diff"]
    checks = {"log-probs match HF after the push": after <= tol, "no vLLM warning during the push": entry["push"]["vllm_warnings"] == 0}
    if "before_push" in entry:
        checks["the check tells the checkpoint's weights apart"] = entry["before_push"]["max_abs_diff"] > 10 * tol
    mem = entry.get("memory", {})
    for key in ("awake_within_plan", "asleep_within_plan"):
        if mem.get(key) is not None:
            checks[key.replace("_", " ")] = mem[key]
    failed = [k for k, ok in checks.items() if not ok]
    entry.update(tolerance=tol, checks=checks, status="failed" if failed else "ran")
    if failed:
        entry["error"] = "; ".join(failed) + f" (max |d logp| {after:.3g}, warnings {entry['push']['vllm_warnings']})"
    entry["note"] = (
        f"max |vLLM - HF| prompt log-prob {after:.2e} (tolerance {tol:g})"
        + (f", before the push {entry['before_push']['max_abs_diff']:.2f}" if "before_push" in entry else "")
        + f"; {entry['push']['tensors']} tensors pushed, {entry['push']['vllm_warnings']} vLLM warnings"
        + (
            f"; asleep {mem['asleep_bytes'] / GIB:.2f} GiB (plan {mem['plan_asleep_bytes'] / GIB:.2f})"
            if mem.get("plan_asleep_bytes")
            else ""
        )
    )
    return entry


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage()[:200])


class Rig:
    """The model folder, the learner's copy (perturbed), the project's vLLM backend over it and
    a colocated sampler whose ``push_weights`` moves the weights."""

    def __init__(self, device, sleep_mode: bool):
        self.device, self.sleep_mode = device, sleep_mode
        self.dtype = "bfloat16" if device.type == "cuda" else "float32"
        self.backend = self.sampler = self.model = self.tok = None

    def build(self) -> dict:
        import torch

        from rllib_exgrpo.models import resolve_model_path
        from rllib_exgrpo.models.loading import load_tokenizer

        t = time.perf_counter()
        self.folder = resolve_model_path(MODEL_SPEC)
        self.tok = load_tokenizer(self.folder)
        self.model = self._learner_model()
        self.prompts = [self.tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
        self.backend, self.sampler = self._backend_and_sampler()
        made = time.perf_counter() - t
        t = time.perf_counter()
        self.backend.build_engine()
        out = {
            "model_s": made,
            "engine_build_s": time.perf_counter() - t,
            "folder": self.folder,
            "vocab_size": int(self.model.config.vocab_size),
            "params": sum(p.numel() for p in self.model.parameters()),
            "engine_kwargs": {k: v for k, v in self.backend.engine_kwargs().items() if k != "model"},
            "sleep_mode": self.sleep_mode,
        }
        out["engine_kwargs"]["dtype"] = str(out["engine_kwargs"].get("dtype"))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return out

    def _learner_model(self):
        """The learner's weights: the checkpoint's, perturbed (a push that did not happen shows)."""
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.folder, dtype=getattr(torch, self.dtype)).to(self.device)
        model.eval()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
                p.add_(noise * (float(p.float().std()) + 0.02) * 4)
        return model

    def _backend_and_sampler(self):
        import contextlib

        import torch

        from rllib_exgrpo.generation.vllm import VLLMGenerationBackend
        from rllib_exgrpo.rllib.colocation import ColocatedSampler

        cuda = self.device.type == "cuda"
        vk = {"gpu_memory_utilization": 0.25, "enforce_eager": True} if cuda else {"kv_cache_memory_bytes": 64 << 20, "block_size": 32}
        cfg = SimpleNamespace(
            model_name_or_path=self.folder,
            model_dtype=self.dtype,
            seed=0,
            max_prompt_tokens=128,
            max_response_tokens=32,
            generation_batch_size=8,
            colocate=self.sleep_mode,
            vllm_kwargs=vk,
            behaviour_logprobs="recompute",
            _worker_index=0,
        )
        module = torch.nn.Module()
        module.model = self.model
        module.autocast = contextlib.nullcontext
        backend = VLLMGenerationBackend(cfg, module, self.tok)
        runner = SimpleNamespace(backend=backend, settings=SimpleNamespace(generation_backend="vllm"), module=None)
        return backend, ColocatedSampler(cfg, module, runner=runner)

    def push(self) -> dict:
        """The colocated sampler's push, vLLM's warnings (log records and Python warnings) counted."""
        count = _Count()
        vlog = logging.getLogger("vllm")
        vlog.addHandler(count)
        t = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pushed = self.sampler.push_weights()
        finally:
            vlog.removeHandler(count)
        from_vllm = [str(w.message)[:200] for w in caught if "vllm" in (w.filename or "")]
        return {
            "tensors": int(pushed),
            "seconds": time.perf_counter() - t,
            "vllm_warnings": len(count.messages) + len(from_vllm),
            "messages": (count.messages + from_vllm)[:5],
        }

    def engine_prompt_logprobs(self) -> list:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outs = self.backend.llm.generate([{"prompt_token_ids": p} for p in self.prompts], params, use_tqdm=False)
        rows = []
        for prompt, out in zip(self.prompts, outs):
            rows.append([float(getattr(pos[tok], "logprob", pos[tok])) for pos, tok in zip(out.prompt_logprobs[1:], prompt[1:])])
        return rows

    def hf_prompt_logprobs(self) -> list:
        import torch

        rows = []
        with torch.no_grad():
            for prompt in self.prompts:
                ids = torch.tensor([prompt], device=self.device)
                logp = torch.log_softmax(self.model(input_ids=ids).logits.float(), dim=-1)[0, :-1]
                rows.append(logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
        return rows

    def compare(self) -> dict:
        engine, hf = self.engine_prompt_logprobs(), self.hf_prompt_logprobs()
        diffs = [abs(a - b) for e, h in zip(engine, hf) for a, b in zip(e, h)]
        return {"positions": len(diffs), "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs)}

    def generate(self) -> dict:
        from rllib_exgrpo.generation.base import SamplingParams

        t = time.perf_counter()
        groups = self.backend.generate(
            self.prompts, [2] * len(self.prompts), SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=())
        )
        tokens = sum(len(c.token_ids) for g in groups for c in g)
        return {"seconds": time.perf_counter() - t, "new_tokens": tokens}

    def gpu_used(self) -> int:
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        return int(total - free)

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
        self.backend = self.sampler = self.model = None
        import gc

        gc.collect()
        if self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()


def sleep_memory(rig, mem: dict) -> dict:
    """GPU memory in use (``mem_get_info``, the whole device) at each point of the sleep cycle,
    against the plan: the engine's share (``gpu_memory_utilization`` x the GPU) while awake,
    the sleeping engine's residue (``SLEEPING_ENGINE_SHARE`` of the share, at least
    ``SLEEPING_ENGINE_MIN_BYTES``) asleep; the learner's copy and the CUDA context counted
    in both, as they are on the learner's GPU."""
    import torch

    out = {f"{k}_bytes": v for k, v in mem.items()}
    total = torch.cuda.get_device_properties(rig.device).total_memory
    util = float(rig.backend.engine_kwargs().get("gpu_memory_utilization", 0.9))
    learner = sum(p.numel() * p.element_size() for p in rig.model.parameters())
    try:
        from rllib_exgrpo.planning.memory import PROCESS_OVERHEAD_BYTES, SLEEPING_ENGINE_MIN_BYTES, SLEEPING_ENGINE_SHARE
    except ImportError as e:
        out["plan"] = f"unavailable ({e})"
        return out
    share = int(util * total)
    out["plan_awake_bytes"] = share + learner + PROCESS_OVERHEAD_BYTES
    out["plan_asleep_bytes"] = max(SLEEPING_ENGINE_MIN_BYTES, int(SLEEPING_ENGINE_SHARE * share)) + learner + PROCESS_OVERHEAD_BYTES
    out["awake_within_plan"] = mem["awake"] <= out["plan_awake_bytes"]
    out["asleep_within_plan"] = mem["asleep"] <= out["plan_asleep_bytes"]
    out["released_by_sleep_bytes"] = mem["awake"] - mem["asleep"]
    return out
