"""One GPU check: the learner step and HF generation of a Qwen2.5-1.5B-shaped model, the
colocated cycle (learner and generation taking turns on one GPU), and what one GPU can
settle for the 7B recipe, in bf16.

    python benchmarks/gpu_check.py [--shape qwen2.5-1.5b|tiny] [--device auto|cuda|cpu]
                                   [--stages learner,packed,drift,slice,transfer,generation,colocate]
                                   [--steps 5] [--slice-layers 2,4] [--transfer-gb 15.2]
                                   [--transfer-chunk-mb 512] [--budget-s 420]
                                   [--out benchmarks/out/gpu_check.json]

Needs only torch and transformers (no Ray, vLLM, DeepSpeed, nothing downloaded): the models
are built from a ``Qwen2Config`` with Qwen2.5(-Math)-1.5B's / -7B's shape and random
weights, and the project's own functions are imported from the repository this file lives
in (no install needed). The stages, run in this order on one device (``--stages`` picks a
subset):

1. ``learner``: one optimiser step of this project's learner on one GPU's share of the
   official 1.5B recipe: 8 rows x (1024 prompt + 1024 or 3072 response) tokens, i.e.
   16k / 32k tokens, the official run's ``ppo_max_token_len_per_gpu`` of 32768
   (ExGRPO/exp_scripts/run_exgrpo.sh). A step is what ``ExGRPOTorchLearner`` does:
   ``core.scoring.score_learner_batch`` (log-probs + entropy of the completion tokens,
   through the LM head in chunks of ``logit_chunk_tokens``' default, 512 positions),
   ``core.losses.mixed_policy_loss`` as in mixed mode (half the rows
   replayed and shaped, fresh rows unclipped, the official aggregation, entropy 0.001),
   backward, grad-norm clip 1.0, AdamW (lr 1e-6, weight decay 0.01). Prompts are
   left-padded and responses right-padded to random lengths (one row full), as the
   learner batch is. With and without gradient checkpointing; tokens/s (all positions
   computed, and real tokens only) and peak memory (``torch.cuda.max_memory_allocated``).
   ``param_update_fraction``: the share of weight elements one lr-1e-6 AdamW step changes
   at this dtype (bf16 weights round most such updates away: the learner needs fp32
   master weights). The no-grad scoring pass (what an env runner does to recompute
   behaviour log-probs or to pick the lowest-entropy replay trajectory) is timed on the
   same batch. These passes are padded (``--attn``, sdpa by default); the packed pass
   the learner runs under ``learner_micro_batch_tokens`` is the next stage.
2. ``packed``: one packed learner pass at the real vocabulary on a Qwen2.5-Math-1.5B-shaped
   slice (hidden 1536, 12 heads, 2 kv heads, intermediate 8960, vocab 151936, tied
   embeddings) with 2 of its 28 decoder layers, bf16 weights, gradient checkpointing as
   tuned_examples/exgrpo_qwen1.5b.yaml has it: its ``learner_micro_batch_tokens`` (32768)
   as 8 rows x (1024 + 3072) tokens laid end to end (``core.packing.pack_rows``), positions
   restarting per row, under the kernel the learner resolves
   (``core.attention.resolve_attn_implementation("auto", device)`` after
   ``register_kernels()``: flash_attention_2 where ``flash_attn`` imports, else the
   project's ``sdpa_varlen``; whether ``flash_attn`` imported is reported), scored by
   ``core.packing.score_packed`` (log-probs + entropy in chunks of the default 512
   positions, recomputed in backward), ``mixed_policy_loss`` as the learner stage,
   backward (gradients already allocated, as under gradient accumulation). The peak beyond
   what was allocated before the pass (``torch.cuda.max_memory_allocated`` after
   ``reset_peak_memory_stats`` minus ``memory_allocated`` before; on CPU the peak of live
   tensor bytes from ``torch.profiler``'s memory events, as benchmarks/memory_plan.py) is
   set against the memory plan's ``learner_activation_breakdown(...)["peak"]`` for the
   same pass (rows 1, its tokens, its scored positions, ``dense_mask=False``, bf16,
   checkpointing, default chunk): ``measured_over_planned``; pass time (the second, warm
   pass; the first is reported too) and tokens/s.
3. ``drift``: bf16 log-prob drift. The same rows (4 x (1024 + 8192), the 7B recipe's
   micro-batch) scored in other batch compositions than the learner's padded batch: the
   same batch again, each row alone without padding, rows reversed with wider padding.
   Max and mean |delta log p| over the real completion tokens, and max |exp(delta) - 1|:
   the error it puts into ExGRPO's unclipped importance ratio of fresh rows in mixed mode.
   Run on the full-depth 1.5B model and on the deepest 7B slice below.
4. ``slice``: a bf16 learner step of a Qwen2.5-Math-7B-shaped slice (hidden 3584, 28
   heads, 4 kv heads, intermediate 18944, vocab 152064, untied embeddings) with only 2 and
   4 of its 28 decoder layers, at the 7B recipe's micro-batch (``learner_micro_batch_rows``
   4 x (1024 + 8192) tokens, tuned_examples/exgrpo_qwen.yaml), gradient checkpointing on.
   Weights as DeepSpeed's bf16 mode keeps them: a bf16 module (bf16 forward, backward and
   gradients) and an fp32 master copy with AdamW's moments in the optimiser, here for the
   slice's own parameters, on one device, unsharded: ``state_bytes`` is 14 B/param (2
   weights + 4 master + 8 moments); bf16 gradients (2 B/param) live during backward, fp32
   master gradients (4 B/param) during the optimiser step. Forward + backward and the
   optimiser step are timed and their peaks (minus what was allocated before the slice)
   taken separately. Every per-depth figure is fitted as fixed part (embeddings, LM head,
   logits, loss) + per-layer part and evaluated at 28 layers: peak memory, state, step
   time, tokens/s, no-grad scoring time; the parameter count, exactly linear in depth,
   checks the fit against the full model's (7,615,616,512). The memory plan
   (``rllib_exgrpo.planning``: ``model_state_bytes``, ``learner_activation_bytes``) is
   set next to the measurement at each depth, at 28 layers, and per GPU as the recipe
   runs (its learner backend, ZeRO stage and learner count); ``plan: unavailable (...)``
   where that module cannot be imported.
5. ``transfer``: host <-> GPU copies of 7B-sized bf16 state (15.2 GB: 7.6 G parameters
   x 2 bytes) in 512 MB chunks, from pinned and from pageable host memory, both
   directions: seconds, GB/s, bytes moved, a round-trip check of the data, and seconds
   per 15.2 GB. Sized down to 40% of the free host RAM and 80% of the free GPU memory,
   to what the budget allows (predicted from one probed chunk), and on a CPU run (host to
   host, pageable only) to 0.25 GB.
6. ``generation``: ``model.generate`` under the HF backend's neutral sampling config
   (temperature 1, top-p 1, no top-k) and the backend's own ``pruned_decode`` loop,
   batch 64 and 256 x (256 prompt + 512 new tokens), no stop token (every row runs to
   512). New tokens/s and peak memory.
7. ``colocate``: the colocated cycle (``colocate: true``, rllib/colocation.py) on one device,
   with the full 1.5B model as the DDP learner holds it: fp32 weights and AdamW (lr 1e-6,
   weight decay 0.01, clip 1.0) computing under bf16 autocast (``--dtype float32``: no
   autocast), gradient checkpointing; the learner stage's helpers at 8 x (1024 + 1024).
   Phases, each with its peak (``torch.cuda.max_memory_allocated`` after
   ``reset_peak_memory_stats``) and what stays allocated after it, both above the stage's
   start: (1) ``learner``: one step (its gradients kept, as the learner leaves them);
   (2) ``release``: gradients set to None, the optimizer state to pinned host memory with
   the product's ``OptimizerOffload``, ``empty_cache``; (3) ``generation``: ``generate``
   (sampling, 64 prompts x (256 + 128 new tokens)) from the same model object, eval mode,
   no grad, under the learner's autocast; (4) ``restore``: the state reloaded, a second
   step. Next to each, the memory plan's figure for the same shapes
   (``planning.memory.plan_memory`` of a one-GPU DDP learner with ``colocate: true`` and the
   HF backend, less the CUDA context the allocator does not see): the ``learner`` entry for
   (1) and (4), the ``generation turn (colocate)`` entry's learner weights for (2)'s
   resident bytes, and that entry less its optimizer state (offloaded here; the plan keeps
   it for the HF turn, printed too) for (3); ``within_plan``. The round trip is checked:
   every state tensor on the host (pinned) during the turn and back on its device after,
   bitwise equal to a copy taken before the offload; the weights bitwise unchanged by the
   turn; and the second step equal, bitwise, to the same step replayed from that copy (the
   same gradients, the same optimizer): ``round_trip_ok``. About a minute on an H100
   (~25 GB of state; ~37 GB of host memory for the pinned state and the reference copies).
   On CPU (``--shape tiny``) the cycle runs at a tiny shape; memory figures are
   ``unavailable`` and nothing moves (the state is already on the host).

Every stage is timed and printed; a stage whose predicted time (from what the earlier
stages measured: the learner's FLOP rate and scoring rate, the packed stage's no-grad
pass, a probe chunk, a short generation) would exceed the budget (``--budget-s``, 420 s:
the whole check stays under 8 minutes on one H200) is skipped with the reason, or cut to
fewer steps / fewer passes / fewer bytes.
The JSON (``--out``) is rewritten after every stage, so a killed run still leaves what it
measured. ``--shape tiny`` runs every stage at a tiny shape on CPU (tests): a 2-layer
model (vocabulary 512), a packed pass of 6 x (32 + 96) tokens at that shape, a 1- and
2-layer slice of a 28-layer untied toy, 16 MB transferred; its numbers are CPU numbers
(memory there is the process's peak RSS, not per stage, except the packed stage's
profiler figure), not GPU figures.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
        "config": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=16384, rope_theta=10000.0, rms_norm_eps=1e-6),
        "rows": 8, "prompt": 1024, "responses": (1024, 3072),
        "gen_batches": (64, 256), "gen_prompt": 256, "gen_new_tokens": 512,
    },
    "tiny": {
        "config": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
                       max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6),
        "rows": 4, "prompt": 16, "responses": (16, 48),
        "gen_batches": (4,), "gen_prompt": 8, "gen_new_tokens": 16,
    },
}
# Qwen/Qwen2.5-Math-7B's config.json (7,615,616,512 parameters; max_position_embeddings
# raised as above). The slice stage builds only ``layers`` of its 28 decoder layers.
QWEN25_MATH_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                      intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
                      max_position_embeddings=16384, rope_theta=10000.0, rms_norm_eps=1e-6)
# The 7B recipe (tuned_examples/exgrpo_qwen.yaml): one learner pass holds at most
# learner_micro_batch_tokens 32768, i.e. 4 rows at full width (max_prompt_tokens 1024 +
# max_response_tokens 8192).
SHAPES["qwen2.5-1.5b"].update(
    drift={"rows": 4, "prompt": 1024, "response": 8192},
    slice={"name": "qwen2.5-math-7b", "config": QWEN25_MATH_7B, "layers": (2, 4), "rows": 4, "prompt": 1024,
           "response": 8192, "steps": 3},
    transfer_gb=15.2,  # Qwen2.5-Math-7B's bf16 weights: 7.6 G parameters x 2 bytes
    transfer_chunk_mb=512,
    # The 1.5B recipe's packed pass: learner_micro_batch_tokens (read from the recipe;
    # 32768 when it was written) as rows of 1024 prompt + 3072 completion tokens (the
    # backbone's 4096 positions), on 2 of the 28 decoder layers.
    packed={"name": "qwen2.5-math-1.5b", "config": SHAPES["qwen2.5-1.5b"]["config"], "layers": 2,
            "prompt": 1024, "response": 3072, "tokens": 32768, "recipe": RECIPE_1_5B, "max_len": 8192},
    # The colocated cycle on the full 1.5B model: fp32 weights + AdamW (~25 GB of state) under
    # bf16 autocast, the learner stage's shorter rows, a generation turn of 64 x (256 + 128).
    colocate={"rows": 8, "prompt": 1024, "response": 1024, "gen_batch": 64, "gen_prompt": 256,
              "gen_new_tokens": 128},
)
SHAPES["tiny"].update(
    drift={"rows": 4, "prompt": 16, "response": 48},
    slice={"name": "tiny-untied", "layers": (1, 2), "rows": 2, "prompt": 8, "response": 24, "steps": 1,
           "config": dict(hidden_size=64, num_hidden_layers=28, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=160, vocab_size=512, tie_word_embeddings=False,
                          max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6)},
    transfer_gb=0.016,
    transfer_chunk_mb=4,
    packed={"name": "tiny", "config": SHAPES["tiny"]["config"], "layers": 2, "prompt": 32, "response": 96,
            "tokens": 768, "recipe": None, "max_len": 8192},
    colocate={"rows": 4, "prompt": 16, "response": 16, "gen_batch": 4, "gen_prompt": 8, "gen_new_tokens": 8},
)
STAGES = ("learner", "packed", "drift", "slice", "transfer", "generation", "colocate")  # run in this order
CPU_TRANSFER_CAP_GB = 0.25  # host-to-host "transfers" on a CPU run are sized down to this
GIB = float(1 << 30)


# --------------------------------------------------------------------------------------
# Imports: the project's functions must not pull in Ray (the GPU machine has none)
# --------------------------------------------------------------------------------------


def import_project() -> dict:
    """Import the learner's and the HF backend's functions; say what each pulled in."""
    report = {}
    before = set(sys.modules)
    from rllib_exgrpo.core.losses import mixed_policy_loss  # noqa: F401
    from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy, score_learner_batch  # noqa: F401

    new = set(sys.modules) - before
    report["rllib_exgrpo.core.scoring+losses"] = sorted({m.split(".")[0] for m in new if m.split(".")[0] in HEAVY})
    before = set(sys.modules)
    from rllib_exgrpo.core.attention import register_kernels, resolve_attn_implementation  # noqa: F401
    from rllib_exgrpo.core.packing import pack_rows, score_packed  # noqa: F401

    new = set(sys.modules) - before
    report["rllib_exgrpo.core.packing+attention"] = sorted(
        {m.split(".")[0] for m in new if m.split(".")[0] in HEAVY})
    before = set(sys.modules)
    try:
        from rllib_exgrpo.rllib.colocation import OptimizerOffload  # noqa: F401
    except Exception as e:  # the colocate stage needs it; the others do not
        report["rllib_exgrpo.rllib.colocation"] = f"import failed: {type(e).__name__}: {e}"
    else:
        new = set(sys.modules) - before
        report["rllib_exgrpo.rllib.colocation"] = sorted({m.split(".")[0] for m in new if m.split(".")[0] in HEAVY})
    before = set(sys.modules)
    try:
        from rllib_exgrpo.generation.hf import HFGenerationBackend, pruned_decode  # noqa: F401
    except Exception as e:  # generation is optional here: generate still runs without it
        report["rllib_exgrpo.generation.hf"] = f"import failed: {type(e).__name__}: {e}"
    else:
        new = set(sys.modules) - before
        report["rllib_exgrpo.generation.hf"] = sorted({m.split(".")[0] for m in new if m.split(".")[0] in HEAVY})
    return report


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
        logp, batch["old_logp"], batch["advantages"], batch["response_mask"], batch["off_policy"],
        eps_low=0.2, eps_high=0.2, clip_fresh=False, beta=0.1,
        agg_mode="seq-mean-token-sum-norm-official", max_len=max_len, micro_batch_rows=64,
        entropy=entropy, entropy_coeff=0.001,
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
        moments = sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                      for k, t in st.items() if k != "step" and hasattr(t, "numel"))
        return {"weights": weights, "fp32_master": master, "adamw_moments": moments,
                "total": weights + master + moments}


def score_nograd(model, batch, response: int):
    import torch

    from rllib_exgrpo.core.chunked_logprobs import DEFAULT_CHUNK_TOKENS
    from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy

    with torch.no_grad():
        return completion_logprobs_and_entropy(
            model, batch["input_ids"], batch["attention_mask"], response, temperature=1.0,
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
    rates = [step_flops(cfg, cfg["num_hidden_layers"], e["rows"], e["prompt"] + e["response"], e["response"], True)
             / e["step_s_mean"] for e in results.get("learner", [])
             if e.get("status") == "ok" and e.get("gradient_checkpointing")]
    return min(rates) if rates else None


def nograd_token_rate(results: dict):
    """Slowest no-grad scoring tokens/s of the learner stage, or None."""
    rates = [e["score_nograd_tokens_per_s"] for e in results.get("learner", []) if e.get("status") == "ok"]
    return min(rates) if rates else None


def read_recipe(path: Path) -> dict:
    """The 7B recipe's learner settings (tuned_examples/exgrpo_qwen.yaml) for the plan's
    per-GPU estimate; the defaults of ``config_fields`` where the file says nothing."""
    recipe = {"file": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
              "learner_backend": "ddp", "deepspeed_zero_stage": 2, "num_learners": 4, "model_dtype": "bfloat16",
              "learner_micro_batch_rows": 4, "max_prompt_tokens": 1024, "max_response_tokens": 8192,
              "gradient_checkpointing": True}
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


# --------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------


def run_learner(model, shape, device, steps: int, clock: Clock) -> list:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    # AdamW's moments exist from the first step on; allocate them now so every config's
    # peak includes them the same way.
    t = time.perf_counter()
    warm = learner_batch(2, 8, 8, shape["config"]["vocab_size"], device, seed=0)
    warm["old_logp"] = score_nograd(model, warm, 8)[0]
    model.train()
    learner_step(model, optimizer, warm, 8, 8)
    # Does an lr 1e-6 AdamW step change the weights at this dtype? (bf16 weights have an ulp
    # of ~1e-4 at |w| ~ 0.02, so most 1e-6 updates round away; fp32 weights all move.)
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
    clock.stage("learner: optimiser state", time.perf_counter() - t,
                f"weights + AdamW state {base:.2f} GiB; one lr 1e-6 step changes {fraction:.1%} of the weights")

    rows, prompt = shape["rows"], shape["prompt"]
    configs = [(r, ckpt) for r in shape["responses"] for ckpt in (True, False)]
    out = []
    for response, ckpt in configs:
        name = f"learner {rows}x({prompt}+{response}) {'ckpt' if ckpt else 'no-ckpt'}"
        entry = {"name": name, "rows": rows, "prompt": prompt, "response": response,
                 "tokens_per_step": rows * (prompt + response), "gradient_checkpointing": ckpt}
        out.append(entry)
        clock.results["learner"] = out
        t = time.perf_counter()
        set_checkpointing(model, ckpt)
        model.config.use_cache = False
        model.train()
        try:
            batch = learner_batch(rows, prompt, response, shape["config"]["vocab_size"], device, seed=response)
            entry["valid_tokens_per_step"] = int(batch["attention_mask"].sum())
            # no-grad scoring pass (behaviour log-probs / replay choice on an env runner)
            reset_peak(device)
            sync(device)
            t1 = time.perf_counter()
            batch["old_logp"] = score_nograd(model, batch, response)[0]
            sync(device)
            first_score = time.perf_counter() - t1
            t1 = time.perf_counter()
            score_nograd(model, batch, response)
            sync(device)
            entry["score_nograd_s"] = time.perf_counter() - t1
            entry["score_nograd_tokens_per_s"] = entry["tokens_per_step"] / entry["score_nograd_s"]
            entry["score_nograd_peak_gib"] = peak_gib(device)
            # warm-up step, then predict whether the timed steps fit the budget
            reset_peak(device)
            t1 = time.perf_counter()
            learner_step(model, optimizer, batch, response, max_len=8192)
            sync(device)
            warm_s = time.perf_counter() - t1
            n = steps
            if warm_s * n > clock.left():
                n = max(1, int(clock.left() // max(warm_s, 1e-9)))
                entry["steps_cut_by_budget"] = True
            times = []
            for _ in range(n):
                t1 = time.perf_counter()
                learner_step(model, optimizer, batch, response, max_len=8192)
                sync(device)
                times.append(time.perf_counter() - t1)
            mean = sum(times) / len(times)
            entry.update(status="ok", steps=len(times), warmup_step_s=warm_s, first_score_s=first_score,
                         step_s_mean=mean, step_s_min=min(times),
                         tokens_per_s=entry["tokens_per_step"] / mean,
                         valid_tokens_per_s=entry["valid_tokens_per_step"] / mean,
                         peak_gib=peak_gib(device))
        except Exception as e:  # OOM is a result here, not a crash
            if not is_oom(e):
                raise
            entry.update(status="oom", error=str(e).splitlines()[0][:300], peak_gib=peak_gib(device))
        optimizer.zero_grad(set_to_none=True)
        batch = None
        free_memory(device)
        note = (f"{entry['step_s_mean']:.2f} s/step, {entry['tokens_per_s']:,.0f} tok/s, peak {entry['peak_gib']:.2f} GiB"
                if entry["status"] == "ok" else entry["status"])
        clock.stage(name, time.perf_counter() - t, note)
        if clock.left() <= 0:
            break
    set_checkpointing(model, False)
    del optimizer
    model.zero_grad(set_to_none=True)
    free_memory(device)
    return out


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
    here = str(Path(__file__).resolve().parent)
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
        out["recipe"] = {k: recipe[k] for k in ("file", "learner_micro_batch_tokens", "gradient_checkpointing",
                                                "max_response_tokens", "read_error") if k in recipe}
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
    args = dict(gradient_checkpointing=checkpointing, dtype_bytes=2, autocast=False, dense_mask=False,
                chunk_tokens=None)
    parts = learner_activation_breakdown(shape, 1, tokens, response_tokens=scored, **args)
    # The planner's own pass under a token budget scores every position (its worst case).
    every = learner_activation_breakdown(shape, 1, tokens, response_tokens=tokens, **args)
    return {"status": "ok", "source": "rllib_exgrpo.planning.memory.learner_activation_breakdown",
            "args": f"rows 1, tokens {tokens}, response_tokens {scored}, gradient_checkpointing {checkpointing}, "
                    "dtype_bytes 2, dense_mask False, chunk_tokens default",
            "planned_bytes": int(parts["peak"]), "peak_phase": parts["peak_phase"], "breakdown": parts,
            "planned_every_position_scored_bytes": int(every["peak"])}


def run_packed(spec: dict, device, clock: Clock, flops_rate=None) -> dict:
    """One packed learner pass at the real vocabulary on a few decoder layers of the model
    (module doc, stage 2): its peak beyond what was allocated before it, against the plan."""
    import torch

    from rllib_exgrpo.core import columns as C
    from rllib_exgrpo.core.attention import SDPA_VARLEN, register_kernels, resolve_attn_implementation
    from rllib_exgrpo.core.chunked_logprobs import DEFAULT_CHUNK_TOKENS
    from rllib_exgrpo.core.losses import mixed_policy_loss
    from rllib_exgrpo.core.packing import pack_rows, score_packed

    cuda = device.type == "cuda"
    cfg = {**spec["config"], "num_hidden_layers": spec["layers"]}
    pp = packed_pass_spec(spec)
    rows, prompt, response, tokens = pp["rows"], spec["prompt"], spec["response"], pp["tokens"]
    ckpt = pp["gradient_checkpointing"]
    fa = flash_attn_status()
    register_kernels()
    kernel = resolve_attn_implementation("auto", device.type)
    name = (f"packed {spec['name']} {spec['layers']}/{spec['config']['num_hidden_layers']} layers "
            f"{rows}x({prompt}+{response})={tokens} tok {'ckpt' if ckpt else 'no-ckpt'}")
    entry = {"name": name, "model": spec["name"], "layers": spec["layers"],
             "full_layers": spec["config"]["num_hidden_layers"], "model_config": cfg, "rows": rows,
             "prompt": prompt, "response": response, "tokens": tokens, "scored_tokens": pp["scored_tokens"],
             "tokens_budget": pp["tokens_budget"], "gradient_checkpointing": ckpt, "dtype": "bfloat16",
             "chunk_tokens": int(DEFAULT_CHUNK_TOKENS), "kernel_requested": kernel, "kernel": kernel,
             "flash_attn_importable": fa["importable"], "flash_attn": fa, "loss_max_len": pp["max_len"],
             "memory_source": ("torch.cuda.max_memory_allocated after reset_peak_memory_stats minus "
                               "memory_allocated before the pass" if cuda else
                               "torch.profiler memory events: peak live CPU tensor bytes during the pass"),
             "before_pass": "weights and their (zeroed) gradients allocated, as under gradient accumulation"}
    if "recipe" in pp:
        entry["recipe"] = pp["recipe"]
    clock.results["packed"] = entry
    t = time.perf_counter()

    def done(note: str) -> dict:
        clock.stage(name, time.perf_counter() - t, note)
        return entry

    # build + warm-up + no-grad pass + two passes, from the learner stage's FLOP rate
    predicted = (4 * step_flops(cfg, spec["layers"], rows, prompt + response, response, ckpt) / flops_rate * 1.5
                 if flops_rate else None)
    if predicted is not None:
        entry["predicted_s"] = predicted
    if predicted is not None and predicted > clock.left():
        entry.update(status="skipped", why=f"predicted {predicted:.0f} s > {clock.left():.0f} s left")
        return done(f"skipped ({entry['why']})")

    model = batch = None
    free_memory(device)
    try:
        torch.manual_seed(spec["layers"])
        try:
            model = build_model({"config": cfg}, device, torch.bfloat16, kernel)
        except Exception as e:  # e.g. a flash_attn wheel transformers refuses: the learner's fallback kernel
            if is_oom(e) or kernel == SDPA_VARLEN:
                raise
            entry["kernel_fallback"] = f"{kernel} failed at build ({type(e).__name__}: {str(e)[:200]}); {SDPA_VARLEN}"
            kernel = SDPA_VARLEN
            model = build_model({"config": cfg}, device, torch.bfloat16, kernel)
        entry["kernel"] = getattr(model.config, "_attn_implementation", kernel)
        entry["params"] = sum(p.numel() for p in model.parameters())
        set_checkpointing(model, ckpt)
        model.config.use_cache = False
        model.train()
        vocab = cfg["vocab_size"]

        def packed_batch(n, p, r, seed):
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(1, vocab, (n, p + r), generator=g).to(device)
            mask = torch.ones_like(ids)
            cols = {C.INPUT_IDS: ids, C.ATTENTION_MASK: mask, C.RESPONSE_MASK: mask[:, p:].float()}
            cols.update(pack_rows(cols))
            cols["advantages"] = torch.randn(n, generator=g).to(device)
            cols["off_policy"] = (torch.arange(n) % 2 == 1).to(device)  # half replayed (rho = 0.5)
            return cols

        def learner_pass(b):
            logp, entropy = score_packed(model, b, temperature=1.0, chunk_tokens=DEFAULT_CHUNK_TOKENS)
            loss, _ = mixed_policy_loss(
                logp, b["old_logp"], b["advantages"], b[C.RESPONSE_MASK], b["off_policy"],
                eps_low=0.2, eps_high=0.2, clip_fresh=False, beta=0.1,
                agg_mode="seq-mean-token-sum-norm-official", max_len=pp["max_len"], micro_batch_rows=64,
                entropy=entropy, entropy_coeff=0.001,
            )
            loss.backward()
            return float(loss.detach())

        # warm-up on a small packed batch: every parameter's gradient exists from here on
        warm = packed_batch(2, 8, 8, seed=0)
        with torch.no_grad():
            warm["old_logp"] = score_packed(model, warm, chunk_tokens=DEFAULT_CHUNK_TOKENS)[0]
        learner_pass(warm)
        for p_ in model.parameters():
            if p_.grad is not None:
                p_.grad.zero_()
        warm = None
        entry["build_s"] = time.perf_counter() - t

        batch = packed_batch(rows, prompt, response, seed=1)
        assert int(batch[C.PACKED_INPUT_IDS].shape[1]) == tokens
        sync(device)
        t1 = time.perf_counter()
        with torch.no_grad():  # the behaviour log-probs (and the forward kernels warmed at full size)
            batch["old_logp"] = score_packed(model, batch, chunk_tokens=DEFAULT_CHUNK_TOKENS)[0]
        sync(device)
        entry["score_nograd_s"] = time.perf_counter() - t1
        # a checkpointed pass: forward, the layers' and the chunks' recomputation, backward
        predicted_pass = entry["score_nograd_s"] * (4 if ckpt else 3) * 1.5
        if predicted_pass > clock.left():
            entry.update(status="skipped", why=f"predicted {predicted_pass:.0f} s > {clock.left():.0f} s left")
            return done(f"skipped ({entry['why']})")

        def one_pass(measure: bool):
            free_memory(device)
            sync(device)
            before = allocated_bytes(device)
            reset_peak(device)
            t2 = time.perf_counter()
            if measure and not cuda:
                box = {}
                peak = cpu_peak_bytes(lambda: box.setdefault("loss", learner_pass(batch)))
                loss = box["loss"]
            else:
                loss = learner_pass(batch)
            sync(device)
            seconds = time.perf_counter() - t2
            if cuda:
                peak = int(torch.cuda.max_memory_allocated(device)) - before
            return seconds, (peak if measure else None), loss, before

        passes = [one_pass(True)]
        # a second pass, warm (on CPU not under the profiler: its time is the figure)
        if passes[0][0] * 1.5 < clock.left():
            passes.append(one_pass(cuda))
        else:
            entry["passes_cut_by_budget"] = True
        peaks = [p_[1] for p_ in passes if p_[1] is not None]
        seconds = passes[-1][0]
        entry.update(status="ok", passes=len(passes), first_pass_s=passes[0][0], pass_s=seconds,
                     tokens_per_s=tokens / seconds, loss=passes[-1][2], allocated_before_bytes=passes[0][3],
                     measured_bytes=max(peaks), measured_gib=max(peaks) / GIB, measured_per_pass_bytes=peaks)
        plan = packed_plan(cfg, tokens, pp["scored_tokens"], ckpt)
        entry["plan"] = plan
        if plan["status"] == "ok":
            entry["planned_bytes"] = plan["planned_bytes"]
            entry["planned_gib"] = plan["planned_bytes"] / GIB
            entry["measured_over_planned"] = entry["measured_bytes"] / max(plan["planned_bytes"], 1)
    except Exception as e:  # OOM is a result; any other failure is reported and the check goes on
        import traceback

        entry.update(status="oom" if is_oom(e) else "error",
                     error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        if entry["status"] == "error":
            entry["traceback"] = traceback.format_exc()[-3000:]
            print(entry["traceback"], file=sys.stderr, flush=True)
    model = batch = None
    free_memory(device)
    fa_note = f"flash_attn {'importable' if fa['importable'] else 'not importable'}"
    if entry["status"] == "ok":
        ratio = entry.get("measured_over_planned")
        note = (f"kernel {entry['kernel']} ({fa_note}), {entry['pass_s']:.2f} s/pass, {entry['tokens_per_s']:,.0f} "
                f"tok/s, peak {entry['measured_gib']:.3f} GiB, plan "
                + (f"{entry['planned_gib']:.3f} GiB, measured_over_planned={ratio:.3f}" if ratio is not None
                   else entry["plan"]["status"]))
    else:
        note = f"{entry['status']} ({entry.get('why', entry.get('error', ''))}); kernel {entry['kernel']}, {fa_note}"
    return done(note)


def generation_api():
    """``(SamplingParams, HFGenerationBackend, pruned_decode)`` of the HF backend, or Nones
    where it does not import (reported under "imports"; plain generate is still measured)."""
    try:
        from rllib_exgrpo.generation.base import SamplingParams
        from rllib_exgrpo.generation.hf import HFGenerationBackend, pruned_decode
    except Exception:
        return None, None, None
    return SamplingParams, HFGenerationBackend, pruned_decode


def generate_tokens(model, decoder: str, batch: int, max_new: int, ids, attn) -> int:
    """Sample ``max_new`` tokens per row (no stop token) under the HF backend's neutral
    sampling config (``"generate"``: ``HFGenerationBackend.generate_raw``; ``"pruned"``: its
    ``pruned_decode``); returns the new tokens generated."""
    SamplingParams, HFGenerationBackend, pruned_decode = generation_api()
    if decoder == "pruned":
        params = SamplingParams(max_new_tokens=max_new, temperature=1.0, top_p=1.0, stop_token_ids=())
        rows, _, _ = pruned_decode(model, ids, attn, params, pad_token_id=0)
        return sum(len(r) for r in rows)
    if HFGenerationBackend is not None:
        params = SamplingParams(max_new_tokens=max_new, temperature=1.0, top_p=1.0, stop_token_ids=())
        seqs = HFGenerationBackend(model, pad_token_id=0, batch_size=batch, decoder="generate").generate_raw(
            ids, attn, params)
    else:
        from transformers import GenerationConfig

        gc_ = GenerationConfig(max_new_tokens=max_new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                               pad_token_id=0, eos_token_id=None, use_cache=True)
        seqs = model.generate(input_ids=ids, attention_mask=attn, generation_config=gc_)
    return int(seqs.shape[0] * (seqs.shape[1] - ids.shape[1]))


def run_generation(model, shape, device, clock: Clock) -> list:
    import torch

    pruned_decode = generation_api()[2]
    model.eval()
    model.config.use_cache = True
    vocab, prompt, new = shape["config"]["vocab_size"], shape["gen_prompt"], shape["gen_new_tokens"]

    def run(decoder: str, batch: int, max_new: int, ids, attn):
        return generate_tokens(model, decoder, batch, max_new, ids, attn)

    decoders = ["generate"] + (["pruned"] if pruned_decode is not None else [])
    out = []
    for batch in shape["gen_batches"]:
        for decoder in decoders:
            name = f"generation {decoder} {batch}x({prompt}+{new})"
            entry = {"name": name, "decoder": decoder, "batch": batch, "prompt": prompt, "new_tokens": new}
            out.append(entry)
            clock.results["generation"] = out
            t = time.perf_counter()
            try:
                g = torch.Generator().manual_seed(batch)
                ids = torch.randint(1, vocab, (batch, prompt), generator=g).to(device)
                attn = torch.ones_like(ids)
                with torch.no_grad():
                    warm_new = max(2, new // 32)
                    reset_peak(device)
                    sync(device)
                    t1 = time.perf_counter()
                    run(decoder, batch, warm_new, ids, attn)
                    sync(device)
                    warm_s = time.perf_counter() - t1
                    predicted = warm_s * new / warm_new
                    if predicted > clock.left():
                        entry.update(status="skipped", why=f"predicted {predicted:.0f} s > {clock.left():.0f} s left")
                    else:
                        reset_peak(device)
                        t1 = time.perf_counter()
                        n_tokens = run(decoder, batch, new, ids, attn)
                        sync(device)
                        seconds = time.perf_counter() - t1
                        entry.update(status="ok", seconds=seconds, generated_tokens=n_tokens,
                                     tokens_per_s=n_tokens / seconds, warmup_s=warm_s, peak_gib=peak_gib(device))
            except Exception as e:
                if not is_oom(e):
                    raise
                entry.update(status="oom", error=str(e).splitlines()[0][:300], peak_gib=peak_gib(device))
            ids = attn = None
            free_memory(device)
            note = (f"{entry['tokens_per_s']:,.0f} new tok/s, peak {entry['peak_gib']:.2f} GiB"
                    if entry["status"] == "ok" else entry["status"] + (f" ({entry['why']})" if "why" in entry else ""))
            clock.stage(name, time.perf_counter() - t, note)
    return out


def logp_drift(model, rows: int, prompt: int, response: int, vocab: int, device, seed: int) -> dict:
    """Score the same rows in several batch compositions with the model as it is (bf16 on the
    GPU run); |delta log p| over the real completion tokens against the learner's layout
    (all rows in one batch, prompts left-padded, responses right-padded)."""
    import torch

    model.eval()
    b = learner_batch(rows, prompt, response, vocab, device, seed)
    ids, attn, real = b["input_ids"], b["attention_mask"], b["response_mask"].bool()

    def score(i, a, r):
        return score_nograd(model, {"input_ids": i, "attention_mask": a}, r)[0].float()

    ref = score(ids, attn, response)
    variants = {"repeat": score(ids, attn, response)}  # same batch again: 0 unless kernels are nondeterministic
    alone = torch.zeros_like(ref)
    for i in range(rows):  # each row by itself, no padding at all (an env runner scoring one row)
        x = ids[i][attn[i].bool()][None]
        r_i = int(real[i].sum())
        alone[i, :r_i] = score(x, torch.ones_like(x), r_i)[0]
    variants["row_alone_unpadded"] = alone
    # rows in reverse order, padded wider on both sides (another micro-batch's padding)
    pad = max(4, (prompt + response) // 64)
    order = torch.arange(rows - 1, -1, -1, device=ids.device)
    ids2 = torch.zeros(rows, pad + prompt + response + pad, dtype=ids.dtype, device=ids.device)
    attn2 = torch.zeros_like(ids2)
    ids2[:, pad:pad + prompt + response] = ids[order]
    attn2[:, pad:pad + prompt + response] = attn[order]
    wide = score(ids2, attn2, response + pad)[:, :response]
    back = torch.empty_like(wide)
    back[order] = wide
    variants["reversed_wider_padding"] = back

    out = {"rows": rows, "prompt": prompt, "response": response,
           "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
           "reference": "all rows in one padded batch (learner layout)",
           "tokens_compared": int(real.sum()), "comparisons": {}}
    for name, x in variants.items():
        d = (x - ref)[real]
        out["comparisons"][name] = {
            "max_abs_delta_logp": float(d.abs().max()), "mean_abs_delta_logp": float(d.abs().mean()),
            # what it does to an unclipped importance ratio exp(logp - old_logp) = 1 + ...
            "max_abs_ratio_minus_1": float(d.exp().sub(1).abs().max()),
        }
    return out


def run_drift(model, label: str, spec: dict, vocab: int, device, clock: Clock, tokens_per_s=None) -> dict:
    rows, prompt, response = spec["rows"], spec["prompt"], spec["response"]
    name = f"drift {label} {rows}x({prompt}+{response})"
    entry = {"name": name, "model": label}
    clock.results.setdefault("drift", []).append(entry)
    t = time.perf_counter()
    # 3 padded passes of the batch + the rows one by one
    predicted = 4 * rows * (prompt + response) / tokens_per_s * 1.5 if tokens_per_s else None
    if predicted is not None and predicted > clock.left():
        entry.update(status="skipped", why=f"predicted {predicted:.0f} s > {clock.left():.0f} s left")
    else:
        try:
            entry.update(logp_drift(model, rows, prompt, response, vocab, device, seed=7))
            entry["status"] = "ok"
        except Exception as e:
            if not is_oom(e):
                raise
            entry.update(status="oom", error=str(e).splitlines()[0][:300])
    free_memory(device)
    c = entry.get("comparisons", {})
    note = (", ".join(f"{k} max {v['max_abs_delta_logp']:.3g} mean {v['mean_abs_delta_logp']:.3g}" for k, v in c.items())
            if entry["status"] == "ok" else entry["status"] + (f" ({entry['why']})" if "why" in entry else ""))
    clock.stage(name, time.perf_counter() - t, note)
    return entry


def run_slice(spec: dict, device, attn: str, steps: int, clock: Clock, flops_rate=None, after_last=None) -> dict:
    """A bf16 learner step of the first few decoder layers of a full-size model, at the
    recipe's micro-batch, with gradient checkpointing; fitted over depth and extrapolated."""
    import torch

    cfg = dict(spec["config"])
    full = cfg["num_hidden_layers"]
    rows, prompt, response = spec["rows"], spec["prompt"], spec["response"]
    tokens = rows * (prompt + response)
    cuda = device.type == "cuda"
    res = {
        "model": spec["name"], "full_layers": full, "slice_layers": list(spec["layers"]),
        "rows": rows, "prompt": prompt, "response": response, "tokens_per_step": tokens,
        "gradient_checkpointing": True, "attn_implementation": attn,
        "weights": "bfloat16 module (forward and backward in bf16, bf16 gradients)",
        "optimizer": "torch.optim.AdamW (lr 1e-6, wd 0.01, default implementation) on an fp32 master copy; "
                     "global-norm clip 1.0 on the fp32 gradients; master copy rounded into the bf16 weights",
        "counted": "everything on this one device, unsharded: bf16 weights 2 B/param, fp32 master 4, AdamW moments "
                   "8 (state_bytes: 14 B/param); bf16 gradients 2 B/param during backward; fp32 master gradients "
                   "4 B/param made during the optimiser step; activations of one micro-batch with checkpointing. "
                   "ZeRO over N learners keeps 1/N of the fp32 parts (and, stage 2, of the gradients) per GPU",
        "memory_source": ("torch.cuda.max_memory_allocated minus what was allocated before the slice was built"
                          if cuda else "process peak RSS (CPU): monotone over the run, not per depth; "
                                       "state_bytes is counted from the tensors"),
        "model_config": cfg,
        "params_full_depth": count_params(cfg),
        "depths": [],
    }
    clock.results["slice"] = res
    vocab = cfg["vocab_size"]
    for layers in spec["layers"]:
        name = f"slice {spec['name']} {layers}/{full} layers {rows}x({prompt}+{response}) ckpt"
        entry = {"name": name, "layers": layers}
        res["depths"].append(entry)
        t = time.perf_counter()
        # build + warm-up + scoring + steps, from the learner stage's FLOP rate
        predicted = ((steps + 2) * step_flops(cfg, layers, rows, prompt + response, response, True) / flops_rate * 1.5
                     if flops_rate else None)
        if predicted is not None and predicted > clock.left():
            entry.update(status="skipped", why=f"predicted {predicted:.0f} s > {clock.left():.0f} s left")
            clock.stage(name, time.perf_counter() - t, f"skipped ({entry['why']})")
            continue
        model = opt = batch = None
        free_memory(device)
        sync(device)
        base = allocated_bytes(device)
        try:
            torch.manual_seed(layers)
            model = build_model({"config": {**cfg, "num_hidden_layers": layers}}, device, torch.bfloat16, attn)
            entry["params"] = sum(p.numel() for p in model.parameters())
            set_checkpointing(model, True)
            model.config.use_cache = False
            model.train()
            opt = MasterWeightAdamW(model.parameters(), lr=1e-6, weight_decay=0.01, max_norm=1.0)
            # warm-up step on a small batch: AdamW's moments exist from here on. Does the
            # master copy move at lr 1e-6, and how much of it reaches the bf16 weights?
            warm = learner_batch(2, 8, 8, vocab, device, seed=0)
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
            entry["master_update_fraction"] = sum(
                int((m.detach().reshape(-1)[::97] != b).sum()) for (_, m), b in zip(pairs, m_before)) / n
            entry["weight_update_fraction"] = sum(
                int((p.detach().reshape(-1)[::97] != b).sum()) for (p, _), b in zip(pairs, w_before)) / n
            warm = m_before = w_before = pairs = emb = None
            free_memory(device)
            sync(device)
            entry["state_bytes_counted"] = opt.state_bytes()
            entry["state_bytes"] = allocated_bytes(device) - base if cuda else entry["state_bytes_counted"]["total"]
            entry["build_s"] = time.perf_counter() - t

            batch = learner_batch(rows, prompt, response, vocab, device, seed=layers)
            entry["valid_tokens_per_step"] = int(batch["attention_mask"].sum())
            reset_peak(device)
            sync(device)
            t1 = time.perf_counter()
            batch["old_logp"] = score_nograd(model, batch, response)[0]
            sync(device)
            entry["score_nograd_s"] = time.perf_counter() - t1
            entry["score_nograd_peak_bytes"] = peak_bytes(device) - base
            model.train()

            def one_step():
                reset_peak(device)
                sync(device)
                t1 = time.perf_counter()
                learner_forward_backward(model, batch, response, max_len=8192)
                sync(device)
                fb_s, fb_peak = time.perf_counter() - t1, peak_bytes(device) - base
                reset_peak(device)
                t1 = time.perf_counter()
                opt.step()
                opt.zero_grad()
                sync(device)
                return fb_s, time.perf_counter() - t1, fb_peak, peak_bytes(device) - base

            first = one_step()
            n = steps
            if (first[0] + first[1]) * n > clock.left():
                n = max(1, int(clock.left() // max(first[0] + first[1], 1e-9)))
                entry["steps_cut_by_budget"] = True
            runs = [one_step() for _ in range(n)]
            fb_s = sum(r[0] for r in runs) / n
            opt_s = sum(r[1] for r in runs) / n
            entry.update(status="ok", steps=n, warmup_step_s=first[0] + first[1], fb_s=fb_s, opt_s=opt_s,
                         step_s=fb_s + opt_s, step_s_min=min(r[0] + r[1] for r in runs),
                         tokens_per_s=tokens / (fb_s + opt_s),
                         # what a micro-batch costs under gradient accumulation (one optimiser
                         # step per minibatch of many micro-batches)
                         fb_tokens_per_s=tokens / fb_s,
                         valid_tokens_per_s=entry["valid_tokens_per_step"] / (fb_s + opt_s),
                         fb_peak_bytes=max(r[2] for r in runs), opt_peak_bytes=max(r[3] for r in runs))
            entry["peak_bytes"] = max(entry["fb_peak_bytes"], entry["opt_peak_bytes"])
            entry["peak_above_state_bytes"] = entry["peak_bytes"] - entry["state_bytes"]
            entry["peak_gib"] = entry["peak_bytes"] / GIB
        except Exception as e:  # OOM is a result here, not a crash
            if not is_oom(e):
                raise
            entry.update(status="oom", error=str(e).splitlines()[0][:300], peak_bytes=peak_bytes(device) - base)
        batch = opt = None
        free_memory(device)
        note = (f"{entry['step_s']:.2f} s/step ({entry['fb_s']:.2f} fwd+bwd, {entry['opt_s']:.2f} optimiser), "
                f"{entry['tokens_per_s']:,.0f} tok/s, state {entry['state_bytes'] / GIB:.2f} GiB, "
                f"peak {entry['peak_gib']:.2f} GiB" if entry["status"] == "ok" else entry["status"])
        clock.stage(name, time.perf_counter() - t, note)
        if after_last is not None and layers == spec["layers"][-1] and entry["status"] == "ok":
            after_last(model, entry)  # e.g. the drift stage on this slice's weights
        model = None
        free_memory(device)
    res["full_depth"] = extrapolate_slice(res)
    clock.save()
    return res


#: Per-depth quantities fitted as fixed + per-layer.
SLICE_FIT_KEYS = ("params", "state_bytes", "fb_peak_bytes", "opt_peak_bytes", "peak_bytes", "peak_above_state_bytes",
                  "score_nograd_s", "fb_s", "opt_s", "step_s")


def extrapolate_slice(res: dict) -> dict:
    """Fit every per-depth quantity over the depths that ran and evaluate it at full depth."""
    ok = [e for e in res["depths"] if e.get("status") == "ok"]
    full = res["full_layers"]
    if len({e["layers"] for e in ok}) < 2:
        return {"status": "not extrapolated: needs two slice depths that ran",
                "depths_ok": [e["layers"] for e in ok]}
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
        from rllib_exgrpo.planning.memory import learner_activation_bytes, model_state_bytes
        from rllib_exgrpo.planning.shapes import ModelShape
    except ImportError as e:
        return {"status": f"unavailable ({type(e).__name__}: {e})"}
    try:
        from transformers import Qwen2Config

        cfg = res["model_config"]
        rows, seq = res["rows"], res["prompt"] + res["response"]

        def shape_at(layers):
            return ModelShape.from_hf_config(Qwen2Config(**{**cfg, "num_hidden_layers": layers}))

        def total(state):
            if isinstance(state, dict):
                return int(state["total"]) if "total" in state else int(sum(
                    v for v in state.values() if isinstance(v, (int, float)) and not isinstance(v, bool)))
            return int(state)

        def plan_at(layers, backend="deepspeed", zero_stage=2, num_learners=1, model_dtype="bfloat16"):
            shape = shape_at(layers)
            state = model_state_bytes(shape, backend=backend, zero_stage=zero_stage, num_learners=num_learners,
                                      model_dtype=model_dtype)
            act = int(learner_activation_bytes(shape, rows, seq, gradient_checkpointing=True, dtype_bytes=2,
                                               response_tokens=res["response"]))
            return {"plan_state": state, "plan_state_bytes": total(state), "plan_activation_bytes": act,
                    "plan_total_bytes": total(state) + act}

        rows_out = []
        points = [(e["layers"], e) for e in res["depths"] if e.get("status") == "ok"]
        fd = res.get("full_depth", {})
        if fd.get("status") == "ok":
            points.append((res["full_layers"], fd))
        for layers, m in points:
            row = {"layers": layers, "extrapolated": layers == res["full_layers"] and m is fd}
            row.update(plan_at(layers))
            row.update(measured_state_bytes=m["state_bytes"], measured_peak_bytes=m["peak_bytes"],
                       measured_peak_above_state_bytes=m["peak_above_state_bytes"])
            row["measured_over_plan_state"] = m["state_bytes"] / max(row["plan_state_bytes"], 1)
            row["measured_over_plan_total"] = m["peak_bytes"] / max(row["plan_total_bytes"], 1)
            rows_out.append(row)
        out = {"status": "ok", "source": "rllib_exgrpo.planning.memory",
               "plan_state_args": "backend deepspeed, zero_stage 2, num_learners 1, model_dtype bfloat16 "
                                  "(one unsharded device, as measured)",
               "plan_activation_args": f"rows {rows}, tokens {seq}, gradient_checkpointing, dtype_bytes 2",
               "measured_peak_above_state": "peak minus weights + fp32 master + moments: activations and the "
                                            "gradients live at the peak",
               "per_depth": rows_out}
        if res.get("memory_source", "").startswith("process peak RSS"):
            out["note"] = "measured memory is process RSS on CPU: the ratios mean nothing here"
        backend = recipe.get("learner_backend", "ddp")
        zero = int(recipe.get("deepspeed_zero_stage", 2)) if backend == "deepspeed" else 0
        settings = {"learner_backend": backend, "zero_stage": zero, "num_learners": int(recipe.get("num_learners", 1)),
                    "model_dtype": recipe.get("model_dtype", "bfloat16"), "file": recipe.get("file")}
        try:
            per_gpu = plan_at(res["full_layers"], backend=backend, zero_stage=zero,
                              num_learners=settings["num_learners"], model_dtype=settings["model_dtype"])
        except Exception as e:
            per_gpu = {"status": f"error ({type(e).__name__}: {e})"}
        else:
            per_gpu["status"] = "ok"
            if fd.get("status") == "ok":
                # the plan's per-GPU state with the activations this run measured (extrapolated)
                per_gpu["plan_state_plus_measured_above_state_bytes"] = (per_gpu["plan_state_bytes"]
                                                                         + fd["peak_above_state_bytes"])
        per_gpu["recipe"] = settings
        out["recipe_per_gpu"] = per_gpu
        return out
    except Exception as e:  # the plan's API moved: say so, keep the run
        return {"status": f"error ({type(e).__name__}: {e})"}


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


def run_transfer(device, nbytes: int, chunk_bytes: int, clock: Clock) -> dict:
    """Move ``nbytes`` of bf16 between host and device memory in ``chunk_bytes`` chunks, from
    pinned and from pageable host buffers, both directions (host-to-host on a CPU run)."""
    import torch

    cuda = device.type == "cuda"
    esize = 2  # bfloat16
    entry = {"name": "transfer", "dtype": "bfloat16", "device": str(device), "bytes_requested": int(nbytes),
             "chunk_bytes": int(chunk_bytes)}
    clock.results["transfer"] = entry
    t = time.perf_counter()
    caps = []
    avail = host_available_bytes()
    if avail:  # one full-size host buffer at a time; leave most of the RAM alone
        caps.append(("host RAM", int(avail * 0.4)))
    if cuda:
        caps.append(("free GPU memory", int(torch.cuda.mem_get_info(device)[0] * 0.8)))
    else:
        caps.append(("CPU run", int(CPU_TRANSFER_CAP_GB * 1e9)))
    size = int(nbytes)
    for why, cap in caps:
        if size > cap:
            size, entry["sized_down"] = cap, f"to {cap / 1e9:.3f} GB ({why})"
    chunk_elems = max(1, min(int(chunk_bytes), size) // esize)
    kinds = ["pinned", "pageable"] if cuda else ["pageable"]
    if not cuda:
        entry["pinned"] = {"status": "skipped", "why": "pinned host memory needs CUDA"}

    # probe one chunk per kind and direction; predict the stage; shrink it to fit the budget
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
        per_byte += (alloc + time.perf_counter() - t1) / (chunk_elems * esize)
    probe_dev = host = None
    predicted = per_byte * size * 1.5 + 1.0
    if predicted > clock.left():
        fit = int(max(0.0, clock.left() - 1.0) / (per_byte * 1.5))
        if fit < chunk_elems * esize:
            entry.update(status="skipped", why=f"predicted {predicted:.0f} s > {clock.left():.0f} s left")
            clock.stage("transfer", time.perf_counter() - t, f"skipped ({entry['why']})")
            return entry
        size, entry["sized_down"] = fit, f"to {fit / 1e9:.3f} GB (budget: {predicted:.0f} s predicted for the full size)"
    n_elems = size // esize
    entry["bytes"] = n_elems * esize
    entry["predicted_s"] = per_byte * entry["bytes"]

    dev = torch.empty(n_elems, dtype=torch.bfloat16, device=device).zero_()
    k = max(1, min(n_elems // 2, 1 << 20))  # head and tail marked, checked after the round trip
    head = torch.randn(k).to(torch.bfloat16)
    tail = torch.randn(k).to(torch.bfloat16)
    for kind in kinds:
        pinned = kind == "pinned"
        r = {}
        t1 = time.perf_counter()
        host = torch.empty(n_elems, dtype=torch.bfloat16, pin_memory=pinned).zero_()  # pages touched
        r["alloc_s"] = time.perf_counter() - t1
        host[:k] = head
        host[n_elems - k:] = tail
        moved = 0
        sync(device)
        t1 = time.perf_counter()
        for s in range(0, n_elems, chunk_elems):
            part = dev[s:s + chunk_elems]
            part.copy_(host[s:s + chunk_elems], non_blocking=pinned)
            moved += part.numel() * esize
        sync(device)
        r["h2d_s"], r["bytes_h2d"] = time.perf_counter() - t1, moved
        host[:k].zero_()
        host[n_elems - k:].zero_()
        moved = 0
        t1 = time.perf_counter()
        for s in range(0, n_elems, chunk_elems):
            part = host[s:s + chunk_elems]
            part.copy_(dev[s:s + chunk_elems], non_blocking=pinned)
            moved += part.numel() * esize
        sync(device)
        r["d2h_s"], r["bytes_d2h"] = time.perf_counter() - t1, moved
        r["round_trip_ok"] = bool(torch.equal(host[:k], head) and torch.equal(host[n_elems - k:], tail))
        for d in ("h2d", "d2h"):
            r[f"{d}_gb_per_s"] = r[f"bytes_{d}"] / 1e9 / max(r[f"{d}_s"], 1e-12)
            # the full 7B bf16 state (15.2 GB) at this rate
            r[f"{d}_s_per_15_2_gb"] = 15.2 / r[f"{d}_gb_per_s"]
        r["status"] = "ok"
        entry[kind] = r
        host = None
        gc.collect()
        if pinned:  # torch caches freed pinned blocks: give them back before the pageable buffer
            empty = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
                     or getattr(torch._C, "_host_emptyCache", None))
            try:
                if empty is not None:
                    empty()
            except Exception:  # only host memory headroom depends on it
                pass
    dev = None
    free_memory(device)
    entry["status"] = "ok"
    note = ", ".join(f"{kind} h2d {entry[kind]['h2d_gb_per_s']:.1f} GB/s d2h {entry[kind]['d2h_gb_per_s']:.1f} GB/s"
                     for kind in kinds) + f" ({entry['bytes'] / 1e9:.3f} GB each way)"
    clock.stage("transfer", time.perf_counter() - t, note)
    return entry


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
        from types import SimpleNamespace

        from transformers import Qwen2Config

        from rllib_exgrpo.planning.memory import plan_memory
        from rllib_exgrpo.planning.shapes import ModelShape
        from rllib_exgrpo.rllib.config_fields import field_defaults
    except ImportError as e:
        return {"status": f"unavailable ({type(e).__name__}: {e})"}
    try:
        from rllib_exgrpo.core.attention import ATTN_IMPLEMENTATIONS

        shape = ModelShape.from_hf_config(Qwen2Config(**cfg))
        base = field_defaults()
        base.update(model_name_or_path="gpu_check (random weights)", colocate=True, num_learners=0,
                    num_gpus_per_learner=1, num_env_runners=0, num_gpus_per_env_runner=0, learner_backend="ddp",
                    model_dtype=model_dtype, gradient_checkpointing=True,
                    attn_implementation=attn if attn in ATTN_IMPLEMENTATIONS else "sdpa",
                    learner_micro_batch_rows=spec["rows"], minibatch_size=spec["rows"],
                    learner_micro_batch_tokens=None, generation_backend="hf", hf_decoder="generate",
                    behaviour_logprobs="engine", scoring_on="runners", kl_coeff=0.0, lora_rank=0,
                    torch_ddp_kwargs={}, generation_batch_size=spec["gen_batch"])
        kw = {"gpu_memory": gpu_memory, "gpu_memory_source": "torch.cuda.get_device_properties", "shape": shape} \
            if gpu_memory else {"shape": shape}
        learner_cfg = SimpleNamespace(**{**base, "max_prompt_tokens": spec["prompt"],
                                         "max_response_tokens": spec["response"]})
        turn_cfg = SimpleNamespace(**{**base, "max_prompt_tokens": spec["gen_prompt"],
                                      "max_response_tokens": spec["gen_new_tokens"]})
        # the learner entry ("learner", or "learner, training turn (colocate)") and the turn's
        learner = next(a for a in plan_memory(learner_cfg, **kw).actors
                       if a.kind.startswith("learner") and "generation turn" not in a.kind)
        turn = next(a for a in plan_memory(turn_cfg, **kw).actors if "generation turn" in a.kind)

        def items(actor):
            return {it.what: int(it.bytes) for it in actor.items}

        def seen(actor):  # what the allocator can see of the entry
            return sum(b for what, b in items(actor).items() if what not in PLAN_OUTSIDE_ALLOCATOR)

        turn_items = items(turn)
        resident = turn_items.get("learner weights", 0) + turn_items.get("DDP gradient buckets", 0)
        phases = {"learner": seen(learner), "release": resident,
                  "generation": seen(turn) - turn_items.get("optimizer state", 0), "restore": seen(learner)}
        return {"status": "ok", "source": "rllib_exgrpo.planning.memory.plan_memory",
                "args": f"ddp, 1 learner, model_dtype {model_dtype}, gradient_checkpointing, learner "
                        f"{spec['rows']} x ({spec['prompt']} + {spec['response']}) padded; generation hf, "
                        f"generation_batch_size {spec['gen_batch']}, {spec['gen_prompt']} + "
                        f"{spec['gen_new_tokens']} tokens, behaviour_logprobs engine",
                "learner_items": items(learner), "turn_items": turn_items,
                "learner_total_bytes": learner.total, "turn_total_bytes": turn.total,
                "learner_fits": learner.fits, "turn_fits": turn.fits,
                "phase_bytes": phases, "generation_as_planned_bytes": seen(turn),
                # bf16 weight copies autocast keeps through a pass (the learner entry has them;
                # a turn under the learner's autocast makes them too)
                "autocast_copies_bytes": items(learner).get("autocast weight copies", 0),
                "excluded": list(PLAN_OUTSIDE_ALLOCATOR)}
    except Exception as e:  # the plan's API moved: say so, keep the run
        return {"status": f"unavailable ({type(e).__name__}: {str(e)[:200]})"}


def colocate_predicted_s(results: dict, shape: dict):
    """Seconds the colocate stage should take, from what earlier stages measured (the learner's
    FLOP rate, the generation rate, the transfer rates; assumed rates where they did not run),
    or None when nothing measured it."""
    spec, cfg = shape["colocate"], shape["config"]
    rate = learner_flops_rate(results, cfg)
    gen = [e["tokens_per_s"] for e in results.get("generation", [])
           if e.get("status") == "ok" and e.get("decoder") == "generate" and e.get("batch") == spec["gen_batch"]]
    if rate is None and not gen:
        return None
    params = results.get("params") or count_params(cfg)
    seconds = 10.0  # model build, first-call warm-ups
    if rate:  # two fp32-weight steps under autocast (x1.5 for the casts) and one scoring pass
        flops = step_flops(cfg, cfg["num_hidden_layers"], spec["rows"], spec["prompt"] + spec["response"],
                           spec["response"], True)
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
    return {"peak_bytes": int(torch.cuda.max_memory_allocated(device)) - base,
            "resident_bytes": int(torch.cuda.memory_allocated(device)) - base}


def run_colocate(shape: dict, device, dtype, attn: str, clock: Clock, predicted_s=None) -> dict:
    """The colocated cycle on one device (module doc, stage 7): learner step, release
    (gradients dropped, optimizer state to the host with the product's ``OptimizerOffload``),
    a generation turn from the same model, restore (state reloaded, a second step), each
    phase's peak and resident memory against the plan; then the optimizer round trip
    checked: the state bitwise equal after it, the weights untouched by the turn, and the
    step after the reload equal to the same step from the state as it was before the
    offload (a reference replay: the same gradients, the same optimizer)."""
    import contextlib

    import torch

    from rllib_exgrpo.rllib.colocation import OptimizerOffload, optimizer_state_tensors

    spec, cfg = shape["colocate"], shape["config"]
    cuda = device.type == "cuda"
    rows, prompt, response = spec["rows"], spec["prompt"], spec["response"]
    gb, gp, gn = spec["gen_batch"], spec["gen_prompt"], spec["gen_new_tokens"]
    compute = None if dtype == torch.float32 else dtype  # the DDP learner: fp32 weights, autocast compute
    model_dtype = str(dtype).replace("torch.", "")
    name = "colocate"
    res = {"name": name, "model_config": cfg, "weights_dtype": "float32",
           "compute_dtype": model_dtype if compute is not None else "float32",
           "rows": rows, "prompt": prompt, "response": response, "gradient_checkpointing": True,
           "gen_batch": gb, "gen_prompt": gp, "gen_new_tokens": gn, "decoder": "generate",
           "optimizer": "torch.optim.AdamW(lr=1e-6, weight_decay=0.01), grad-norm clip 1.0",
           "offload": "rllib_exgrpo.rllib.colocation.OptimizerOffload",
           "memory_source": ("torch.cuda.max_memory_allocated / memory_allocated, above the stage's start"
                             if cuda else "unavailable (no CUDA: torch's allocator figures are per GPU)"),
           "phases": {}}
    clock.results["colocate"] = res
    t_stage = time.perf_counter()
    if predicted_s is not None:
        res["predicted_s"] = round(predicted_s, 1)
        if predicted_s > clock.left():
            res.update(status="skipped", why=f"predicted {predicted_s:.0f} s > {clock.left():.0f} s left")
            clock.save()
            return res
    gpu_memory = torch.cuda.get_device_properties(device).total_memory if cuda else None
    res["plan"] = plan = colocate_plan(cfg, spec, model_dtype, attn, gpu_memory)
    autocast = (lambda: torch.autocast(device.type, dtype=compute)) if compute is not None \
        else contextlib.nullcontext
    phases = res["phases"]
    model = optimizer = batch = ids = amask = None
    ref_state = ref_params = ref_grads = after = None
    phase = "build"
    try:
        free_memory(device)
        sync(device)
        base = allocated_bytes(device)
        res["stage_start_allocated_bytes"] = base
        torch.manual_seed(0)
        model = build_model(shape, device, torch.float32, attn)
        set_checkpointing(model, True)
        model.config.use_cache = False
        params = [p for p in model.parameters() if p.requires_grad]
        res["params"] = sum(p.numel() for p in params)
        optimizer = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.01)
        batch = learner_batch(rows, prompt, response, cfg["vocab_size"], device, seed=11)
        with autocast():
            batch["old_logp"] = score_nograd(model, batch, response)[0]  # behaviour log-probs
        free_memory(device)
        sync(device)

        # 1. learner awake: one step; its gradients stay until the release (as the learner's)
        phase = "learner"
        reset_peak(device)
        t = time.perf_counter()
        model.train()
        with autocast():
            loss1 = learner_forward_backward(model, batch, response, max_len=8192)
        norm1 = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        optimizer.step()
        sync(device)
        phases["learner"] = {"seconds": time.perf_counter() - t, "loss": loss1, "grad_norm": norm1,
                             **_phase_memory(device, base)}
        clock.stage(f"{name}: learner step", phases["learner"]["seconds"])

        # the reference for the round-trip checks: the state and weights as they are, on the host
        state = list(optimizer_state_tensors([optimizer]))
        ref_state = [(v.device, v.detach().to("cpu", copy=True)) for _, _, v in state]
        ref_params = [p.detach().to("cpu", copy=True) for p in params]
        state_bytes = sum(v.numel() * v.element_size() for _, _, v in state)
        device_state_bytes = sum(v.numel() * v.element_size() for _, _, v in state if v.device.type != "cpu")
        del state

        # 2. release: gradients dropped, optimizer state to (pinned) host memory, cache emptied
        phase = "release"
        reset_peak(device)
        t = time.perf_counter()
        for p in model.parameters():
            p.grad = None
        offload = OptimizerOffload(lambda: [optimizer])
        t1 = time.perf_counter()
        moved = offload.offload()
        offload_s = time.perf_counter() - t1
        free_memory(device)
        sync(device)
        held = [v for _, _, v in optimizer_state_tensors([optimizer])]
        phases["release"] = {"seconds": time.perf_counter() - t, "offload_s": offload_s, "bytes_offloaded": moved,
                             **_phase_memory(device, base)}
        on_host = all(v.device.type == "cpu" for v in held)
        pinned = all(v.is_pinned() for v, (home, _) in zip(held, ref_state) if home.type != "cpu") if cuda else None
        del held
        clock.stage(f"{name}: release", phases["release"]["seconds"],
                    f"{moved / 1e9:.3f} GB of optimizer state to the host in {offload_s:.2f} s")

        # 3. generation turn: the same model object, eval mode, no grad, the learner's autocast
        phase = "generation"
        reset_peak(device)
        t = time.perf_counter()
        model.eval()
        model.config.use_cache = True
        g = torch.Generator().manual_seed(gb)
        ids = torch.randint(1, cfg["vocab_size"], (gb, gp), generator=g).to(device)
        amask = torch.ones_like(ids)
        with torch.no_grad(), autocast():
            n_tokens = generate_tokens(model, "generate", gb, gn, ids, amask)
        sync(device)
        gen_s = time.perf_counter() - t
        peak = _phase_memory(device, base)["peak_bytes"]
        ids = amask = None
        free_memory(device)
        model.config.use_cache = False
        model.train()
        phases["generation"] = {"seconds": gen_s, "generated_tokens": n_tokens, "tokens_per_s": n_tokens / gen_s,
                                **_phase_memory(device, base), "peak_bytes": peak}
        with torch.no_grad():
            unchanged = all(torch.equal(p.detach(), r.to(device)) for p, r in zip(params, ref_params))
        clock.stage(f"{name}: generation", gen_s, f"{n_tokens / gen_s:,.0f} new tok/s (first call)")

        # 4. restore: optimizer state reloaded, then a second step
        phase = "restore"
        reset_peak(device)
        t = time.perf_counter()
        reloaded = offload.reload()
        sync(device)
        reload_s = time.perf_counter() - t
        reload_peak = _phase_memory(device, base)["peak_bytes"]
        state = list(optimizer_state_tensors([optimizer]))
        back_home = len(state) == len(ref_state) and all(v.device == home for (_, _, v), (home, _) in
                                                         zip(state, ref_state))
        with torch.no_grad():
            bitwise = back_home and all(v.dtype == r.dtype and torch.equal(v, r.to(v.device))
                                        for (_, _, v), (_, r) in zip(state, ref_state))
        del state
        reset_peak(device)  # the comparison's copies are not the cycle's
        t1 = time.perf_counter()
        with autocast():
            loss2 = learner_forward_backward(model, batch, response, max_len=8192)
        norm2 = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        sync(device)
        t2 = time.perf_counter()
        ref_grads = [p.grad.detach().to("cpu", copy=True) for p in params]  # for the reference (untimed)
        copy_s = time.perf_counter() - t2
        optimizer.step()
        sync(device)
        mem = _phase_memory(device, base)
        if cuda:
            mem["peak_bytes"] = max(mem["peak_bytes"], reload_peak)
        phases["restore"] = {"seconds": reload_s + time.perf_counter() - t1 - copy_s, "reload_s": reload_s,
                             "bytes_reloaded": reloaded, "loss": loss2, "grad_norm": norm2, **mem}
        clock.stage(f"{name}: restore", phases["restore"]["seconds"],
                    f"{reloaded / 1e9:.3f} GB back in {reload_s:.2f} s, second step loss {loss2:.4f}")

        # the reference: the same second step from the state as it was before the offload
        after = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, r, gr in zip(params, ref_params, ref_grads):
                p.copy_(r.to(device))
                p.grad = gr.to(device)
            for (st, key, _), (home, r) in zip(list(optimizer_state_tensors([optimizer])), ref_state):
                st[key] = r.to(home)
        optimizer.step()
        sync(device)
        with torch.no_grad():
            matches = all(torch.equal(p.detach(), a) for p, a in zip(params, after))
            moved_by_step = sum(int((a != r.to(device)).sum()) for a, r in zip(after, ref_params))
        rt = {"state_tensors": len(ref_state), "state_bytes": state_bytes, "device_state_bytes": device_state_bytes,
              "bytes_offloaded": moved, "bytes_reloaded": reloaded, "offload_s": offload_s, "reload_s": reload_s,
              "on_host_during_turn": on_host, "pinned_during_turn": pinned, "back_on_device": back_home,
              "state_bitwise_equal": bitwise, "weights_unchanged_by_generation": unchanged,
              "step_after_reload_matches_reference": matches,
              "second_step_update_fraction": moved_by_step / max(1, res["params"])}
        if not cuda:
            rt["note"] = "CPU run: the optimizer state is already on the host, nothing moves"
        rt["ok"] = bool(on_host and back_home and bitwise and unchanged and matches and moved == device_state_bytes
                        and reloaded == moved and pinned is not False and math.isfinite(loss1)
                        and math.isfinite(loss2) and moved_by_step > 0)
        res["round_trip"] = rt
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
        if plan.get("status") == "ok" and cuda:
            phases["generation"]["within_plan_as_planned"] = (phases["generation"]["peak_bytes"]
                                                              <= plan["generation_as_planned_bytes"])
        res["status"] = "ok"
    except Exception as e:
        if not is_oom(e):
            raise
        res.update(status="oom", phase=phase, error=str(e).splitlines()[0][:300],
                   peak_bytes=_phase_memory(device, res.get("stage_start_allocated_bytes", 0))["peak_bytes"])
    model = optimizer = batch = ids = amask = ref_state = ref_params = ref_grads = after = None
    free_memory(device)
    rt = res.get("round_trip", {})
    clock.stage(f"{name} (whole stage)", time.perf_counter() - t_stage,
                f"round trip ok={rt['ok']}" if rt else res["status"])
    return res


def _fmt_gib(x) -> str:
    return "unavailable" if x is None else f"{x:.2f}"


def print_table(results: dict) -> None:
    print()
    params = f"{results['params'] / 1e6:,.1f} M params" if "params" in results else "no main model"
    print(f"{results['shape']} ({params}) on {results['device_name']}, "
          f"{results['dtype']}, attention {results['attn_implementation']}; "
          f"torch {results['torch']}, transformers {results['transformers']}")
    if "learner" in results:
        print(f"weights + AdamW state: {results.get('learner_static_gib', 0):.2f} GiB; one AdamW step at lr 1e-6 "
              f"changes {results.get('param_update_fraction', float('nan')):.1%} of the {results['param_dtype']} weights")
        head = f"{'learner step (fwd+loss+bwd+clip+AdamW)':<40}{'s/step':>8}{'tok/s':>11}{'real tok/s':>12}" \
               f"{'peak GiB':>10}{'no-grad score s':>17}"
        print(head)
        print("-" * len(head))
        for e in results["learner"]:
            if e.get("status") == "ok":
                print(f"{e['name']:<40}{e['step_s_mean']:>8.2f}{e['tokens_per_s']:>11,.0f}"
                      f"{e['valid_tokens_per_s']:>12,.0f}{e['peak_gib']:>10.2f}{e['score_nograd_s']:>17.2f}")
            else:
                print(f"{e['name']:<40}{e.get('status', 'not run'):>8}  {e.get('error', '')[:80]}")
    pk = results.get("packed")
    if isinstance(pk, dict):
        print()
        if pk.get("status") == "ok":
            fa = "importable" if pk["flash_attn_importable"] else "not importable"
            print(f"packed learner pass: {pk['model']}, {pk['layers']} of {pk['full_layers']} layers "
                  f"({pk['params'] / 1e6:,.1f} M params), bf16, {pk['rows']} rows x ({pk['prompt']} + "
                  f"{pk['response']}) = {pk['tokens']} tokens packed, "
                  f"{'checkpointing' if pk['gradient_checkpointing'] else 'no checkpointing'}, log-prob chunks of "
                  f"{pk['chunk_tokens']}; kernel {pk['kernel']} (flash_attn {fa})")
            print(f"  {pk['pass_s']:.3f} s/pass (first {pk['first_pass_s']:.3f}), {pk['tokens_per_s']:,.0f} tok/s; "
                  f"no-grad scoring {pk['score_nograd_s']:.3f} s")
            plan = pk.get("plan", {})
            if "measured_over_planned" in pk:
                print(f"  peak beyond the pass's start: measured {pk['measured_gib']:.3f} GiB, planned "
                      f"{pk['planned_gib']:.3f} GiB ({plan['peak_phase'].replace('_', ' ')}): "
                      f"measured_over_planned={pk['measured_over_planned']:.3f}")
            else:
                print(f"  peak beyond the pass's start: measured {pk['measured_gib']:.3f} GiB; "
                      f"plan: {plan.get('status')}")
            if not str(pk.get("memory_source", "")).startswith("torch.cuda"):
                print(f"  memory: {pk['memory_source']}")
        else:
            print(f"packed learner pass: {pk.get('status')} ({pk.get('why', pk.get('error', ''))})")
    sl = results.get("slice")
    if isinstance(sl, dict) and "depths" in sl:
        print()
        print(f"slice of {sl['model']} (bf16 weights, fp32 master + AdamW in the optimiser, checkpointing), "
              f"{sl['rows']}x({sl['prompt']}+{sl['response']}) tokens")
        head = f"{'layers':<10}{'params M':>10}{'fwd+bwd s':>11}{'optim s':>9}{'tok/s':>11}{'fb tok/s':>11}" \
               f"{'state GiB':>11}{'peak GiB':>10}{'score s':>9}"
        print(head)
        print("-" * len(head))
        rows = [(str(e["layers"]), e) for e in sl["depths"]]
        fd = sl.get("full_depth", {})
        if fd.get("status") == "ok":
            rows.append((f"{fd['layers']} (fit)", fd))
        for label, e in rows:
            if e.get("status") == "ok":
                print(f"{label:<10}{e['params'] / 1e6:>10,.1f}{e['fb_s']:>11.2f}{e['opt_s']:>9.2f}"
                      f"{e['tokens_per_s']:>11,.0f}{e['fb_tokens_per_s']:>11,.0f}{e['state_bytes'] / GIB:>11.2f}"
                      f"{e['peak_bytes'] / GIB:>10.2f}"
                      f"{e['score_nograd_s']:>9.2f}")
            else:
                print(f"{label:<10}{e.get('status', 'not run')}  {e.get('why', e.get('error', ''))[:80]}")
        if fd.get("status") == "ok":
            print(f"fit check: {fd['params']:,} parameters extrapolated, {fd['params_actual']:,} in the full model")
        print(f"memory: {sl['memory_source']}")
        plan = sl.get("plan", {})
        if plan.get("status") == "ok":
            for r in plan["per_depth"]:
                print(f"plan at {r['layers']} layers: state {r['plan_state_bytes'] / GIB:.2f} GiB (measured "
                      f"{r['measured_state_bytes'] / GIB:.2f}), state + activations {r['plan_total_bytes'] / GIB:.2f} "
                      f"GiB (measured peak {r['measured_peak_bytes'] / GIB:.2f})")
            g = plan["recipe_per_gpu"]
            r = g["recipe"]
            where = f"{r['learner_backend']}, ZeRO {r['zero_stage']}, {r['num_learners']} learners"
            print(f"plan per GPU as the recipe runs ({where}): " + (
                f"{g['plan_total_bytes'] / GIB:.2f} GiB" if g["status"] == "ok" else g["status"]))
        elif plan:
            print(f"plan: {plan.get('status')}")
    for e in results.get("drift", []):
        if e.get("status") == "ok":
            print(f"\nlog-prob drift, {e['model']} {e['rows']}x({e['prompt']}+{e['response']}), {e['dtype']}, "
                  f"{e['tokens_compared']} completion tokens vs {e['reference']}:")
            for k, v in e["comparisons"].items():
                print(f"  {k:<26} max |d logp| {v['max_abs_delta_logp']:.3g}, mean {v['mean_abs_delta_logp']:.3g}, "
                      f"max |ratio - 1| {v['max_abs_ratio_minus_1']:.3g}")
        else:
            print(f"\n{e['name']}: {e.get('status')} {e.get('why', e.get('error', ''))}")
    tr = results.get("transfer")
    if isinstance(tr, dict):
        print()
        if tr.get("status") == "ok":
            print(f"host<->device transfer, {tr['bytes'] / 1e9:.3f} GB of bf16 each way in "
                  f"{tr['chunk_bytes'] / 1e6:.0f} MB chunks" + (f" (sized down {tr['sized_down']})"
                                                                 if "sized_down" in tr else ""))
            for kind in ("pinned", "pageable"):
                r = tr.get(kind, {})
                if r.get("status") == "ok":
                    print(f"  {kind:<9} h2d {r['h2d_gb_per_s']:7.2f} GB/s ({r['h2d_s_per_15_2_gb']:.2f} s per 15.2 GB), "
                          f"d2h {r['d2h_gb_per_s']:7.2f} GB/s ({r['d2h_s_per_15_2_gb']:.2f} s per 15.2 GB)")
                elif r:
                    print(f"  {kind:<9} {r.get('status')} ({r.get('why', '')})")
        else:
            print(f"transfer: {tr.get('status')} ({tr.get('why', '')})")
    if "generation" in results:
        head = f"{'generation (sampling, T=1)':<40}{'s':>8}{'new tok/s':>11}{'':>12}{'peak GiB':>10}"
        print()
        print(head)
        print("-" * len(head))
        for e in results["generation"]:
            if e.get("status") == "ok":
                print(f"{e['name']:<40}{e['seconds']:>8.2f}{e['tokens_per_s']:>11,.0f}{'':>12}{e['peak_gib']:>10.2f}")
            else:
                print(f"{e['name']:<40}{e.get('status', 'not run'):>8}  {e.get('why', e.get('error', ''))[:80]}")
    co = results.get("colocate")
    if isinstance(co, dict):
        print()
        if co.get("status") == "ok":
            print(f"colocated cycle: fp32 weights + AdamW, compute {co['compute_dtype']}, {co['params'] / 1e6:,.1f} M "
                  f"params; learner {co['rows']}x({co['prompt']}+{co['response']}) ckpt; generate "
                  f"{co['gen_batch']}x({co['gen_prompt']}+{co['gen_new_tokens']}) from the same model")
            plan = co.get("plan", {})
            for ph in COLOCATE_PHASES:
                e = co["phases"][ph]
                line = (f"  phase={ph} seconds={e['seconds']:.2f} peak_gib={_fmt_gib(e['peak_gib'])} "
                        f"resident_gib={_fmt_gib(e['resident_gib'])}")
                if "plan_gib" in e:
                    within = "unavailable" if e["within_plan"] is None else e["within_plan"]
                    line += f" plan_gib={e['plan_gib']:.2f} within_plan={within} (plan vs {e['compares']})"
                    if "over_plan_bytes" in e:
                        line += f" over_plan_gib={e['over_plan_bytes'] / GIB:.2f}"
                else:
                    line += f" plan={plan.get('status', 'unavailable')}"
                print(line)
            if plan.get("status") == "ok":
                g = co["phases"]["generation"]
                print(f"  plan: {plan['args']}; allocator's share (less CUDA context); generation with the optimizer "
                      f"state offloaded (as planned for the HF turn, state kept: "
                      f"{plan['generation_as_planned_bytes'] / GIB:.2f} GiB"
                      + (f", within={g['within_plan_as_planned']})" if "within_plan_as_planned" in g else ")")
                      + f"; the learner entry's autocast weight copies {plan['autocast_copies_bytes'] / GIB:.2f} GiB")
            rt = co["round_trip"]
            print(f"  optimizer round trip: state_bytes={rt['state_bytes']} bytes_offloaded={rt['bytes_offloaded']} "
                  f"offload_s={rt['offload_s']:.3f} reload_s={rt['reload_s']:.3f} "
                  f"pinned={'n/a' if rt['pinned_during_turn'] is None else rt['pinned_during_turn']} "
                  f"state_bitwise_equal={rt['state_bitwise_equal']} "
                  f"weights_unchanged_by_generation={rt['weights_unchanged_by_generation']} "
                  f"step_after_reload_matches_reference={rt['step_after_reload_matches_reference']}")
            if "note" in rt:
                print(f"  note: {rt['note']}")
            print(f"  memory: {co['memory_source']}")
            print(f"  round_trip_ok={rt['ok']}")
        else:
            print(f"colocated cycle: {co.get('status')} ({co.get('why', co.get('error', ''))}"
                  + (f", in phase {co['phase']})" if "phase" in co else ")"))
    print()
    print("stage times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in results["stage_times_s"].items()))
    print(f"total {results['total_s']:.1f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b",
                        help="qwen2.5-1.5b (GPU; its slice stage is Qwen2.5-Math-7B-shaped) or tiny (CPU, tests)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated subset of {','.join(STAGES)} (always run in that order; default all)")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed learner steps per configuration (after 1 warm-up); the slice stage times "
                             "at most its shape's count (3)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="weights of the learner / drift / generation model (the slice is always bf16 + fp32 master)")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa: what load_causal_lm gets by default)")
    parser.add_argument("--slice-layers", default=None,
                        help="decoder-layer counts of the slice stage, comma-separated, >= 2 distinct "
                             "(default: 2,4 for the 7B shape)")
    parser.add_argument("--transfer-gb", type=float, default=None,
                        help="bytes (1e9) moved each way by the transfer stage (default: 15.2, the 7B bf16 weights; "
                             f"tiny: 0.016; a CPU run is capped at {CPU_TRANSFER_CAP_GB})")
    parser.add_argument("--transfer-chunk-mb", type=float, default=None,
                        help="chunk size (1e6 bytes) of the transfer stage (default 512; tiny 4)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="stages predicted to end past this are skipped (colocate included)")
    parser.add_argument("--skip-generation", action="store_true", help="same as leaving generation out of --stages")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results, rewritten after every stage")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    stages = [x.strip() for x in args.stages.split(",") if x.strip()]
    unknown = [x for x in stages if x not in STAGES]
    if unknown:
        parser.error(f"--stages: unknown {', '.join(unknown)} (choose from {', '.join(STAGES)})")
    if args.skip_generation and "generation" in stages:
        stages.remove("generation")
    slice_spec = dict(SHAPES[args.shape]["slice"])
    if args.slice_layers:
        try:
            slice_spec["layers"] = tuple(int(x) for x in args.slice_layers.split(","))
        except ValueError:
            parser.error("--slice-layers: comma-separated integers")
    full_layers = slice_spec["config"]["num_hidden_layers"]
    if len(set(slice_spec["layers"])) < 2 or not all(1 <= n <= full_layers for n in slice_spec["layers"]):
        parser.error(f"--slice-layers: two or more distinct depths in 1..{full_layers}")
    transfer_gb = SHAPES[args.shape]["transfer_gb"] if args.transfer_gb is None else args.transfer_gb
    chunk_mb = SHAPES[args.shape]["transfer_chunk_mb"] if args.transfer_chunk_mb is None else args.transfer_chunk_mb
    if transfer_gb <= 0 or chunk_mb <= 0:
        parser.error("--transfer-gb and --transfer-chunk-mb must be > 0")

    t_start = time.perf_counter()
    import torch

    cuda = torch.cuda.is_available()
    device_arg = ("cuda" if cuda else "cpu") if args.device == "auto" else args.device
    if device_arg.startswith("cuda") and not cuda:
        print(f"gpu_check: --device {device_arg} but torch sees no CUDA device "
              f"(torch {torch.__version__}); use --shape tiny --device cpu for the CPU check.", file=sys.stderr)
        return 2
    if args.shape != "tiny" and not device_arg.startswith("cuda"):
        print(f"gpu_check: --shape {args.shape} needs a CUDA GPU (torch {torch.__version__} sees "
              f"{'none' if not cuda else 'one, but --device ' + device_arg}); use --shape tiny --device cpu on CPU.",
              file=sys.stderr)
        return 2
    device = torch.device(device_arg)
    dtype = getattr(torch, args.dtype)
    shape = SHAPES[args.shape]

    imports = import_project()
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        print(f"gpu_check: note: transformers {transformers.__version__}; the project pins >=5,<6 "
              "(scoring needs logits_to_keep): measuring anyway", flush=True)

    results = {
        "shape": args.shape,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": args.dtype,
        "attn_implementation": args.attn,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "imports": imports,
        "imports_pull_in_ray": any(isinstance(v, list) and "ray" in v for v in imports.values()),
        "flash_attn": flash_attn_status(),
        "peak_memory": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "process peak RSS (ru_maxrss)",
        "model_config": shape["config"],
        "stages": stages,
        "budget_s": args.budget_s,
        "stage_times_s": {},
    }
    clock = Clock(args.budget_s, args.out, results)
    clock.t0 = t_start
    print(f"gpu_check: {args.shape} on {results['device_name']} ({device}), {args.dtype}; stages {','.join(stages)}; "
          f"budget {args.budget_s:.0f} s; out {args.out}", flush=True)
    for module, pulled in imports.items():
        print(f"  import {module}: " + (("pulls in " + ", ".join(pulled)) if isinstance(pulled, list) and pulled
                                        else pulled if isinstance(pulled, str) else "no ray/vllm/deepspeed"))
    fa = results["flash_attn"]
    print("  flash_attn: " + (f"importable ({fa['version']})" if fa["importable"]
                              else f"not importable ({fa['error']})"), flush=True)
    clock.stage("startup (torch, CUDA, imports)", time.perf_counter() - t_start)

    model = None
    if any(x in stages for x in ("learner", "drift", "generation")):  # the slice builds its own
        t = time.perf_counter()
        torch.manual_seed(0)
        model = build_model(shape, device, dtype, args.attn)
        sync(device)
        results["params"] = sum(p.numel() for p in model.parameters())
        results["param_dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
        results["attn_implementation"] = getattr(model.config, "_attn_implementation", args.attn)
        clock.stage("model build (random weights)", time.perf_counter() - t,
                    f"{results['params'] / 1e6:,.1f} M parameters")

    if "learner" in stages:
        run_learner(model, shape, device, args.steps, clock)
    if "packed" in stages:
        if clock.left() > 0:
            run_packed(shape["packed"], device, clock, flops_rate=learner_flops_rate(results, shape["config"]))
        else:
            results["packed"] = {"status": "skipped", "why": "no budget left"}
            clock.save()
    vocab = shape["config"]["vocab_size"]
    if "drift" in stages:
        run_drift(model, args.shape, shape["drift"], vocab, device, clock, tokens_per_s=nograd_token_rate(results))
    if "slice" in stages:
        def slice_drift(slice_model, entry):
            if "drift" in stages:
                label = f"{slice_spec['name']}-{entry['layers']}-layers"
                run_drift(slice_model, label, slice_spec, slice_spec["config"]["vocab_size"], device, clock,
                          tokens_per_s=slice_spec["rows"] * (slice_spec["prompt"] + slice_spec["response"])
                          / entry["score_nograd_s"])

        if clock.left() > 0:
            res = run_slice(slice_spec, device, args.attn, min(args.steps, slice_spec["steps"]), clock,
                            flops_rate=learner_flops_rate(results, shape["config"]), after_last=slice_drift)
            res["plan"] = plan_comparison(res, read_recipe(RECIPE_7B))
            clock.save()
        else:
            results["slice"] = {"status": "skipped", "why": "no budget left"}
    if "transfer" in stages:
        nbytes = int(transfer_gb * 1e9)
        if clock.left() > 0:
            run_transfer(device, nbytes, int(chunk_mb * 1e6), clock)
        else:
            results["transfer"] = {"status": "skipped", "why": "no budget left", "bytes_requested": nbytes}
    if "generation" in stages and clock.left() > 0:
        run_generation(model, shape, device, clock)
    if "colocate" in stages:
        model = None  # the stage builds its own learner model (fp32 weights); nothing after it needs this one
        free_memory(device)
        if clock.left() > 0:
            run_colocate(shape, device, dtype, args.attn, clock, predicted_s=colocate_predicted_s(results, shape))
        else:
            results["colocate"] = {"status": "skipped", "why": "no budget left"}
            clock.save()
    results["total_s"] = round(time.perf_counter() - t_start, 3)
    clock.save()
    print_table(results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
