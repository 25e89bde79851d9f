"""Shapes, the clock, device memory helpers and the learner's step, shared by the stages."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # rllib_exgrpo importable without installing

DEFAULT_OUT = ROOT / "benchmarks" / "out" / "gpu_check.json"
RECIPE_7B = ROOT / "tuned_examples" / "exgrpo_qwen.yaml"
RECIPE_1_5B = ROOT / "tuned_examples" / "exgrpo_qwen1.5b.yaml"
HEAVY = ("ray", "vllm", "deepspeed")

#: Model shapes (Qwen2Config fields) and workloads.
SHAPES = {
    # Qwen/Qwen2.5-Math-1.5B's config.json (max_position_embeddings raised: the recipe's
    # 1024 + 8192 tokens need more than its 4096; it changes no compute).
    "qwen2.5-1.5b": {
        "config": dict(
            hidden_size=1536,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            intermediate_size=8960,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=16384,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
        ),
        "rows": 8,
        "prompt": 1024,
        "responses": (1024, 3072),
        "gen_batches": (64, 256),
        "gen_prompt": 256,
        "gen_new_tokens": 512,
    },
    "tiny": {
        "config": dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=512,
            tie_word_embeddings=True,
            max_position_embeddings=256,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
        ),
        "rows": 4,
        "prompt": 16,
        "responses": (16, 48),
        "gen_batches": (4,),
        "gen_prompt": 8,
        "gen_new_tokens": 16,
    },
}
# Qwen/Qwen2.5-Math-7B's config.json (7,615,616,512 parameters; max_position_embeddings
# raised as above). The slice stage builds only ``layers`` of its 28 decoder layers.
QWEN25_MATH_7B = dict(
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
    tie_word_embeddings=False,
    max_position_embeddings=16384,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)
# The 7B recipe (tuned_examples/exgrpo_qwen.yaml): one learner pass holds at most
# learner_micro_batch_tokens 32768, i.e. 4 rows at full width (max_prompt_tokens 1024 +
# max_response_tokens 8192).
SHAPES["qwen2.5-1.5b"].update(
    drift={"rows": 4, "prompt": 1024, "response": 8192},
    slice={"name": "qwen2.5-math-7b", "config": QWEN25_MATH_7B, "layers": (2, 4), "rows": 4, "prompt": 1024, "response": 8192, "steps": 3},
    transfer_gb=15.2,  # Qwen2.5-Math-7B's bf16 weights: 7.6 G parameters x 2 bytes
    transfer_chunk_mb=512,
    # The 1.5B recipe's packed pass: learner_micro_batch_tokens (read from the recipe;
    # 32768 when it was written) as rows of 1024 prompt + 3072 completion tokens (the
    # backbone's 4096 positions), on 2 of the 28 decoder layers.
    packed={
        "name": "qwen2.5-math-1.5b",
        "config": SHAPES["qwen2.5-1.5b"]["config"],
        "layers": 2,
        "prompt": 1024,
        "response": 3072,
        "tokens": 32768,
        "recipe": RECIPE_1_5B,
        "max_len": 8192,
    },
    # The colocated cycle on the full 1.5B model: fp32 weights + AdamW (~25 GB of state) under
    # bf16 autocast, the learner stage's shorter rows, a generation turn of 64 x (256 + 128).
    colocate={"rows": 8, "prompt": 1024, "response": 1024, "gen_batch": 64, "gen_prompt": 256, "gen_new_tokens": 128},
)
SHAPES["tiny"].update(
    drift={"rows": 4, "prompt": 16, "response": 48},
    slice={
        "name": "tiny-untied",
        "layers": (1, 2),
        "rows": 2,
        "prompt": 8,
        "response": 24,
        "steps": 1,
        "config": dict(
            hidden_size=64,
            num_hidden_layers=28,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=160,
            vocab_size=512,
            tie_word_embeddings=False,
            max_position_embeddings=256,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
        ),
    },
    transfer_gb=0.016,
    transfer_chunk_mb=4,
    packed={
        "name": "tiny",
        "config": SHAPES["tiny"]["config"],
        "layers": 2,
        "prompt": 32,
        "response": 96,
        "tokens": 768,
        "recipe": None,
        "max_len": 8192,
    },
    colocate={"rows": 4, "prompt": 16, "response": 16, "gen_batch": 4, "gen_prompt": 8, "gen_new_tokens": 8},
)
LEGACY_STAGES = ("learner", "packed", "drift", "slice", "transfer", "generation", "colocate")
GIB = float(1 << 30)

# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


class Clock:
    """Stage times, the budget, and the JSON rewritten after every stage."""

    def __init__(self, budget_s: float, out: Path, results: dict):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.out = out
        self.results = results

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def stage(self, name: str, seconds: float, note: str = "") -> None:
        self.results["stage_times_s"][name] = round(seconds, 3)
        self.results["total_s"] = round(self.elapsed(), 3)
        print(f"[{self.elapsed():7.1f} s] {name}: {seconds:.2f} s{('  ' + note) if note else ''}", flush=True)
        self.save()

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(self.out.suffix + ".tmp")
        tmp.write_text(json.dumps(self.results, indent=2) + "\n")
        os.replace(tmp, self.out)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float:
    """Peak allocated GiB since the last reset (CUDA), or the process's peak RSS (CPU)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / GIB


def allocated_gib(device) -> float:
    import torch

    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else 0.0


def free_memory(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", RuntimeError)
    return isinstance(e, oom) or "out of memory" in str(e).lower()


def build_model(shape: dict, device, dtype, attn: str):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**shape["config"])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters created in bf16 directly, on the device
    try:
        try:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        except Exception as e:  # some transformers versions dislike a default device: CPU, then move
            if device.type == "cpu":
                raise
            print(f"gpu_check: building on {device} failed ({type(e).__name__}: {e}); building on CPU", flush=True)
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(device)
    finally:
        torch.set_default_dtype(previous)
    model.config.use_cache = False
    return model


def set_checkpointing(model, on: bool) -> None:
    """Gradient (activation) checkpointing on or off, as ``models.loading`` turns it on
    (transformers 5 renamed the methods; the old names warn)."""
    name = "enable" if on else "disable"
    method = getattr(model, f"activation_checkpointing_{name}", None) or getattr(model, f"gradient_checkpointing_{name}")
    method()


def learner_batch(rows: int, prompt: int, response: int, vocab: int, device, seed: int):
    """Padded learner batch in the project's layout (core/tokens.py): prompts left-padded
    to ``prompt``, responses right-padded to ``response``; one row of each at full length."""
    import torch

    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(prompt // 2, prompt + 1, (rows,), generator=g)
    r_len = torch.randint(response // 2, response + 1, (rows,), generator=g)
    p_len[0], r_len[0] = prompt, response
    cols = torch.arange(prompt + response)
    attn = ((cols >= prompt - p_len[:, None]) & (cols < prompt + r_len[:, None])).long()
    ids = torch.randint(1, vocab, (rows, prompt + response), generator=g) * attn  # pad id 0
    return {
        "input_ids": ids.to(device),
        "attention_mask": attn.to(device),
        "response_mask": attn[:, prompt:].to(device),
        "advantages": torch.randn(rows, generator=g).to(device),
        "off_policy": (torch.arange(rows) % 2 == 1).to(device),  # half replayed (rho = 0.5)
    }


def learner_forward_backward(model, batch, response: int, max_len: int) -> float:
    """The learner's pass over one micro-batch, mixed mode (official settings): scoring,
    ``mixed_policy_loss``, backward (gradients accumulate in the parameters' ``.grad``)."""
    from rllib_exgrpo.core.chunked_logprobs import DEFAULT_CHUNK_TOKENS
    from rllib_exgrpo.core.losses import mixed_policy_loss
    from rllib_exgrpo.core.scoring import score_learner_batch

    assert batch["response_mask"].shape[1] == response
    # what the learner's module calls (rllib/module.py), logit_chunk_tokens at its default
    logp, entropy = score_learner_batch(model, batch, temperature=1.0, chunk_tokens=DEFAULT_CHUNK_TOKENS)
    loss, _ = mixed_policy_loss(
        logp,
        batch["old_logp"],
        batch["advantages"],
        batch["response_mask"],
        batch["off_policy"],
        eps_low=0.2,
        eps_high=0.2,
        clip_fresh=False,
        beta=0.1,
        agg_mode="seq-mean-token-sum-norm-official",
        max_len=max_len,
        micro_batch_rows=64,
        entropy=entropy,
        entropy_coeff=0.001,
    )
    loss.backward()
    return float(loss.detach())


def learner_step(model, optimizer, batch, response: int, max_len: int) -> float:
    """One ExGRPOTorchLearner optimiser step, mixed mode (official settings)."""
    import torch

    loss = learner_forward_backward(model, batch, response, max_len)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


class MasterWeightAdamW:
    """bf16 module weights, an fp32 master copy kept by the optimiser: what DeepSpeed's bf16
    mode does on one rank with nothing to shard (ZeRO over N learners keeps 1/N of the fp32
    parts per GPU). ``step``: the bf16 gradients become fp32 gradients of the master copy
    (one parameter at a time, the bf16 one freed), global-norm clip on the fp32 gradients,
    ``torch.optim.AdamW`` (its default implementation) on the master copy, the master copy
    rounded back into the bf16 weights."""

    def __init__(self, params, lr: float, weight_decay: float, max_norm: float):
        import torch

        self.params = [p for p in params if p.requires_grad]
        with torch.no_grad():
            self.masters = [torch.empty_like(p, dtype=torch.float32).copy_(p) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)
        self.max_norm = max_norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> float:
        import torch

        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.masters, self.max_norm)
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
                m.grad = None
        return float(norm)

    def state_bytes(self) -> dict:
        """Bytes of what persists between steps, counted from the tensors themselves."""
        weights = sum(p.numel() * p.element_size() for p in self.params)
        master = sum(m.numel() * m.element_size() for m in self.masters)
        moments = sum(
            t.numel() * t.element_size()
            for st in self.optimizer.state.values()
            for k, t in st.items()
            if k != "step" and hasattr(t, "numel")
        )
        return {"weights": weights, "fp32_master": master, "adamw_moments": moments, "total": weights + master + moments}


def score_nograd(model, batch, response: int):
    import torch

    from rllib_exgrpo.core.chunked_logprobs import DEFAULT_CHUNK_TOKENS
    from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy

    with torch.no_grad():
        return completion_logprobs_and_entropy(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            response,
            temperature=1.0,
            chunk_tokens=DEFAULT_CHUNK_TOKENS,
        )


def peak_bytes(device) -> int:
    """:func:`peak_gib` in bytes."""
    return int(peak_gib(device) * GIB)


def allocated_bytes(device) -> int:
    import torch

    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def count_params(config: dict) -> int:
    """Parameters of a Qwen2 with this config, built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**config))
    return sum(p.numel() for p in model.parameters())


def linear_fit(xs, ys) -> tuple:
    """Least-squares line ``y = fixed + per_layer * x`` (two points: the line through them)."""
    n = len(xs)
    if n != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"need values at two or more distinct depths, got x={list(xs)}")
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def depth_fit(xs, ys, at: int) -> dict:
    """A quantity measured at slice depths ``xs`` split into a fixed part (embeddings, final
    norm, LM head, logits, loss) and a per-layer part, then evaluated at depth ``at``."""
    fixed, per_layer = linear_fit(xs, ys)
    return {"fixed": fixed, "per_layer": per_layer, "at_layers": at, "value": fixed + per_layer * at}


def step_flops(cfg: dict, layers: int, rows: int, seq: int, response: int, checkpointing: bool) -> float:
    """Rough FLOPs of one learner step (matmuls, causal attention, LM head on the completion
    positions); x3 for forward + backward, x4 with checkpointing. Used only to predict a
    stage's time from a throughput measured earlier in the run."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    per_layer = 2 * h * heads * hd + 2 * h * kv * hd + 3 * h * cfg["intermediate_size"]
    fwd = layers * (2 * per_layer * rows * seq + 2 * rows * seq * seq * heads * hd)
    fwd += 2 * h * cfg["vocab_size"] * rows * (response + 1)
    return fwd * (4 if checkpointing else 3)


def learner_flops_rate(results: dict, cfg: dict):
    """Achieved FLOP/s of the learner stage's checkpointed steps (the slowest), or None."""
    rates = [
        step_flops(cfg, cfg["num_hidden_layers"], e["rows"], e["prompt"] + e["response"], e["response"], True) / e["step_s_mean"]
        for e in results.get("learner", [])
        if e.get("status") == "ok" and e.get("gradient_checkpointing")
    ]
    return min(rates) if rates else None


def nograd_token_rate(results: dict):
    """Slowest no-grad scoring tokens/s of the learner stage, or None."""
    rates = [e["score_nograd_tokens_per_s"] for e in results.get("learner", []) if e.get("status") == "ok"]
    return min(rates) if rates else None


def read_recipe(path: Path) -> dict:
    """The 7B recipe's learner settings (tuned_examples/exgrpo_qwen.yaml) for the plan's
    per-GPU estimate; the defaults of ``config_fields`` where the file says nothing."""
    recipe = {
        "file": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
        "learner_backend": "ddp",
        "deepspeed_zero_stage": 2,
        "num_learners": 4,
        "model_dtype": "bfloat16",
        "learner_micro_batch_rows": 4,
        "max_prompt_tokens": 1024,
        "max_response_tokens": 8192,
        "gradient_checkpointing": True,
    }
    try:
        import yaml

        doc = yaml.safe_load(path.read_text())
        cfg = next(iter(doc.values()))["config"]
        recipe.update({k: cfg[k] for k in list(recipe) if k in cfg})
        if cfg.get("learner_micro_batch_tokens") and "learner_micro_batch_rows" not in cfg:
            # A token budget: the pass's rows at full width (what the memory plan counts).
            width = recipe["max_prompt_tokens"] + recipe["max_response_tokens"]
            recipe["learner_micro_batch_tokens"] = int(cfg["learner_micro_batch_tokens"])
            recipe["learner_micro_batch_rows"] = max(1, -(-int(cfg["learner_micro_batch_tokens"]) // width))
    except Exception as e:  # the defaults above are the file's values when this was written
        recipe["read_error"] = f"{type(e).__name__}: {e}"
    return recipe


def host_available_bytes():
    """MemAvailable of /proc/meminfo (free + reclaimable), else free pages; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None
