"""One GPU check: the learner step and HF generation of a Qwen2.5-1.5B-shaped model, in bf16.

    python benchmarks/gpu_check.py [--shape qwen2.5-1.5b|tiny] [--device auto|cuda|cpu]
                                   [--steps 5] [--out benchmarks/out/gpu_check.json]

Needs only torch and transformers (no Ray, vLLM, DeepSpeed, nothing downloaded): the model
is built from a ``Qwen2Config`` with Qwen2.5(-Math)-1.5B's shape and random weights, and
the project's own functions are imported from the repository this file lives in (no
install needed). It measures, on one device:

1. **Learner step** (``learner``): one optimiser step of this project's learner on one
   GPU's share of the official recipe: 8 rows x (1024 prompt + 1024 or 3072 response)
   tokens, i.e. 16k / 32k tokens, the official run's ``ppo_max_token_len_per_gpu`` of
   32768 (ExGRPO/exp_scripts/run_exgrpo.sh). A step is what ``ExGRPOTorchLearner`` does:
   ``core.scoring.completion_logprobs_and_entropy`` (log-probs + streamed entropy of the
   completion tokens), ``core.losses.mixed_policy_loss`` as in mixed mode (half the rows
   replayed and shaped, fresh rows unclipped, the official aggregation, entropy 0.001),
   backward, grad-norm clip 1.0, AdamW (lr 1e-6, weight decay 0.01). Prompts are
   left-padded and responses right-padded to random lengths (one row full), as the
   learner batch is. With and without gradient checkpointing; tokens/s (all positions
   computed, and real tokens only) and peak memory (``torch.cuda.max_memory_allocated``).
   ``param_update_fraction``: the share of weight elements one lr-1e-6 AdamW step changes
   at this dtype (bf16 weights round most such updates away: the learner needs fp32
   master weights). The no-grad scoring pass (what an env runner does to recompute behaviour log-probs or
   to pick the lowest-entropy replay trajectory) is timed on the same batch.
2. **Generation** (``generation``): ``model.generate`` under the HF backend's neutral
   sampling config (temperature 1, top-p 1, no top-k) and the backend's own
   ``pruned_decode`` loop, batch 64 and 256 x (256 prompt + 512 new tokens), no stop token
   (every row runs to 512). New tokens/s and peak memory.

Every stage is timed and printed; a stage whose predicted time would exceed the budget
(``--budget-s``, 420 s: the whole check stays under 8 minutes on one H200) is skipped and
marked so. The JSON (``--out``) is rewritten after every stage, so a killed run still
leaves what it measured. ``--shape tiny`` is a 2-layer model for CPU (tests).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # rllib_exgrpo importable without installing

DEFAULT_OUT = ROOT / "benchmarks" / "out" / "gpu_check.json"
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
GIB = float(1 << 30)


# --------------------------------------------------------------------------------------
# Imports: the project's functions must not pull in Ray (the GPU machine has none)
# --------------------------------------------------------------------------------------


def import_project() -> dict:
    """Import the learner's and the HF backend's functions; say what each pulled in."""
    report = {}
    before = set(sys.modules)
    from rllib_exgrpo.core.losses import mixed_policy_loss  # noqa: F401
    from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy  # noqa: F401

    new = set(sys.modules) - before
    report["rllib_exgrpo.core.scoring+losses"] = sorted({m.split(".")[0] for m in new if m.split(".")[0] in HEAVY})
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


def learner_step(model, optimizer, batch, response: int, max_len: int) -> float:
    """One ExGRPOTorchLearner optimiser step, mixed mode (official settings)."""
    import torch

    from rllib_exgrpo.core.losses import mixed_policy_loss
    from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy

    logp, entropy = completion_logprobs_and_entropy(
        model, batch["input_ids"], batch["attention_mask"], response, temperature=1.0
    )
    loss, _ = mixed_policy_loss(
        logp, batch["old_logp"], batch["advantages"], batch["response_mask"], batch["off_policy"],
        eps_low=0.2, eps_high=0.2, clip_fresh=False, beta=0.1,
        agg_mode="seq-mean-token-sum-norm-official", max_len=max_len, micro_batch_rows=64,
        entropy=entropy, entropy_coeff=0.001,
    )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def score_nograd(model, batch, response: int):
    import torch

    from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy

    with torch.no_grad():
        return completion_logprobs_and_entropy(
            model, batch["input_ids"], batch["attention_mask"], response, temperature=1.0
        )


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


def run_generation(model, shape, device, clock: Clock) -> list:
    import torch

    try:
        from rllib_exgrpo.generation.base import SamplingParams
        from rllib_exgrpo.generation.hf import HFGenerationBackend, pruned_decode
    except Exception:  # reported under "imports"; plain generate still measured
        SamplingParams = HFGenerationBackend = pruned_decode = None

    model.eval()
    model.config.use_cache = True
    vocab, prompt, new = shape["config"]["vocab_size"], shape["gen_prompt"], shape["gen_new_tokens"]

    def run(decoder: str, batch: int, max_new: int, ids, attn):
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


def print_table(results: dict) -> None:
    print()
    print(f"{results['shape']} ({results['params'] / 1e6:,.1f} M params) on {results['device_name']}, "
          f"{results['dtype']}, attention {results['attn_implementation']}; "
          f"torch {results['torch']}, transformers {results['transformers']}")
    print(f"weights + AdamW state: {results.get('learner_static_gib', 0):.2f} GiB; one AdamW step at lr 1e-6 changes "
          f"{results.get('param_update_fraction', float('nan')):.1%} of the {results['param_dtype']} weights")
    head = f"{'learner step (fwd+loss+bwd+clip+AdamW)':<40}{'s/step':>8}{'tok/s':>11}{'real tok/s':>12}{'peak GiB':>10}" \
           f"{'no-grad score s':>17}"
    print(head)
    print("-" * len(head))
    for e in results.get("learner", []):
        if e.get("status") == "ok":
            print(f"{e['name']:<40}{e['step_s_mean']:>8.2f}{e['tokens_per_s']:>11,.0f}{e['valid_tokens_per_s']:>12,.0f}"
                  f"{e['peak_gib']:>10.2f}{e['score_nograd_s']:>17.2f}")
        else:
            print(f"{e['name']:<40}{e.get('status', 'not run'):>8}  {e.get('error', '')[:80]}")
    head = f"{'generation (sampling, T=1)':<40}{'s':>8}{'new tok/s':>11}{'':>12}{'peak GiB':>10}"
    print()
    print(head)
    print("-" * len(head))
    for e in results.get("generation", []):
        if e.get("status") == "ok":
            print(f"{e['name']:<40}{e['seconds']:>8.2f}{e['tokens_per_s']:>11,.0f}{'':>12}{e['peak_gib']:>10.2f}")
        else:
            print(f"{e['name']:<40}{e.get('status', 'not run'):>8}  {e.get('why', e.get('error', ''))[:80]}")
    print()
    print("stage times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in results["stage_times_s"].items()))
    print(f"total {results['total_s']:.1f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    parser.add_argument("--steps", type=int, default=5, help="timed learner steps per configuration (after 1 warm-up)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa: what load_causal_lm gets by default)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stages predicted to end past this are skipped")
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")

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
        "peak_memory": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "process peak RSS (ru_maxrss)",
        "model_config": shape["config"],
        "stage_times_s": {},
    }
    clock = Clock(args.budget_s, args.out, results)
    clock.t0 = t_start
    print(f"gpu_check: {args.shape} on {results['device_name']} ({device}), {args.dtype}; out {args.out}", flush=True)
    for module, pulled in imports.items():
        print(f"  import {module}: " + (("pulls in " + ", ".join(pulled)) if isinstance(pulled, list) and pulled
                                        else pulled if isinstance(pulled, str) else "no ray/vllm/deepspeed"))
    clock.stage("startup (torch, CUDA, imports)", time.perf_counter() - t_start)

    t = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(shape, device, dtype, args.attn)
    sync(device)
    results["params"] = sum(p.numel() for p in model.parameters())
    results["param_dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    results["attn_implementation"] = getattr(model.config, "_attn_implementation", args.attn)
    clock.stage("model build (random weights)", time.perf_counter() - t, f"{results['params'] / 1e6:,.1f} M parameters")

    run_learner(model, shape, device, args.steps, clock)
    if not args.skip_generation and clock.left() > 0:
        run_generation(model, shape, device, clock)
    results["total_s"] = round(time.perf_counter() - t_start, 3)
    clock.save()
    print_table(results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
