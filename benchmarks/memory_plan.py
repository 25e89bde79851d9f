"""The memory plan's activation estimates against measured peaks, on CPU.

    python benchmarks/memory_plan.py [--quick] [--out benchmarks/out/memory_plan.json]

Builds small random-init Qwen2 models from a ``Qwen2Config`` (nothing downloaded) and runs
this project's learner pass on them: ``core.scoring.completion_logprobs_and_entropy`` (log-probs
and streamed entropy of the completion tokens) and ``core.losses.mixed_policy_loss`` (mixed
mode, half the rows replayed, entropy 0.001), then ``backward``; and the runner's scoring pass
(the same scoring under ``torch.no_grad``). Rows are left-padded prompts and right-padded
completions of random lengths, as the learner batch is, so the attention gets a padding mask.

Measured: the peak of live torch tensor bytes during one pass, relative to its start, from
the CPU allocator's own records of every allocation and free (``torch.profiler`` with
``profile_memory=True``: the ``[memory]`` events); model, gradients and AdamW state are
allocated before (a warm-up step on a small batch, gradients kept), so the peak is the
pass's activations and temporaries: what ``learner_activation_bytes`` /
``scoring_activation_bytes`` estimate. The CPU analogue of
``torch.cuda.max_memory_allocated() - memory_allocated()`` at the start.

Shapes: ``qwen2-11m`` and ``qwen2-39m`` in float32 (the DDP learner's fp32 path); the bf16
paths (DeepSpeed: bf16 weights; DDP with ``model_dtype: bfloat16``: fp32 weights under
autocast) on ``qwen2-probe``, a narrow model, because bf16 matrix products on a CPU without
AVX-512 BF16 run ~80x slower than fp32. Each shape runs in its own subprocess.

Prints estimate vs measured per configuration and ``activation_error_max=X`` (the worst
|estimate / measured - 1|).

Then the learner step at the real vocabulary (``--packed``, on by default): ``qwen2-vocab``,
a Qwen2 that is narrow and shallow (hidden 64, 2 layers) with Qwen2.5's vocabulary of
152,064 and tied embeddings, in float32 (the DDP learner's CPU path), takes one packed pass
of 16 rows x (64 + 448) tokens (``learner_micro_batch_tokens: 8192``, ``sdpa_varlen``, log-probs
in chunks of ``logit_chunk_tokens``), its GRPO loss, backward and AdamW step, after a warm-up
step (gradients and AdamW state exist, as in a learner's steady state). Measured: the peak
of live tensor bytes over the step, beyond the weights (gradients, AdamW state, the pass's
activations and the step's temporaries); planned: the learner's plan for the same config
(``planning.memory``'s learner items) less its weights and the assumed CUDA context. The
last line is ``measured_over_planned=X``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "benchmarks" / "out" / "memory_plan.json"
MIB = float(1 << 20)

#: Qwen2Config fields of the measured shapes.
SHAPES = {
    "qwen2-11m": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688,
        vocab_size=32000,
        tie_word_embeddings=True,
    ),
    "qwen2-39m": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1376,
        vocab_size=32000,
        tie_word_embeddings=True,
    ),
    "qwen2-probe": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=4000,
        tie_word_embeddings=True,
    ),
}

#: (shape, mode, pass, rows, prompt, response, gradient checkpointing)
#: mode: fp32 | bf16 (bf16 weights, DeepSpeed) | autocast (fp32 weights, bf16 compute: DDP)
CONFIGS = [
    ("qwen2-11m", "fp32", "learner", 2, 64, 448, False),
    ("qwen2-11m", "fp32", "learner", 2, 64, 448, True),
    ("qwen2-11m", "fp32", "learner", 4, 192, 64, False),
    ("qwen2-11m", "fp32", "learner", 4, 192, 64, True),
    ("qwen2-11m", "fp32", "scoring", 2, 64, 448, False),
    ("qwen2-39m", "fp32", "learner", 1, 64, 320, False),
    ("qwen2-39m", "fp32", "learner", 1, 64, 320, True),
    ("qwen2-39m", "fp32", "learner", 2, 160, 32, False),
    ("qwen2-39m", "fp32", "learner", 2, 160, 32, True),
    ("qwen2-probe", "bf16", "learner", 2, 64, 320, False),
    ("qwen2-probe", "bf16", "learner", 2, 64, 320, True),
    ("qwen2-probe", "autocast", "learner", 2, 64, 320, False),
    ("qwen2-probe", "autocast", "learner", 2, 64, 320, True),
    ("qwen2-probe", "bf16", "scoring", 2, 64, 320, False),
]
QUICK = [c for c in CONFIGS if c[0] != "qwen2-39m" and c[3] * (c[4] + c[5]) <= 1024][:5]


def model_shape_of(name: str):
    from rllib_exgrpo.planning.shapes import ModelShape

    c = SHAPES[name]
    return ModelShape(
        hidden_size=c["hidden_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["hidden_size"] // c["num_attention_heads"],
        intermediate_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        tie_word_embeddings=c["tie_word_embeddings"],
        max_position_embeddings=4096,
        model_type="qwen2",
        source=f"benchmarks/memory_plan.py {name}",
    )


def estimate(shape_name: str, mode: str, kind: str, rows: int, prompt: int, response: int, ckpt: bool) -> dict:
    from rllib_exgrpo.planning.memory import learner_activation_breakdown, scoring_activation_bytes

    shape = model_shape_of(shape_name)
    dtype_bytes = 4 if mode == "fp32" else 2
    tokens = prompt + response
    if kind == "scoring":
        return {
            "bytes": scoring_activation_bytes(shape, rows, tokens, response_tokens=response, dtype_bytes=4 if mode == "fp32" else 2),
            "phase": "no grad",
        }
    parts = learner_activation_breakdown(
        shape, rows, tokens, gradient_checkpointing=ckpt, dtype_bytes=dtype_bytes, response_tokens=response, autocast=mode == "autocast"
    )
    total = parts["peak"]
    if mode == "autocast":
        # autocast's bf16 copies of the linear weights live through the pass (a model state
        # in the plan: model_state_bytes(...)["autocast_copies"])
        from rllib_exgrpo.planning.memory import model_state_bytes

        total += model_state_bytes(shape, backend="ddp", model_dtype="bfloat16")["autocast_copies"]
    return {"bytes": total, "phase": parts["peak_phase"]}


# ------------------------------------------------------------------ measuring (child process)


def _batch(rows: int, prompt: int, response: int, vocab: int, seed: int):
    """Left-padded prompts, right-padded completions; every row padded somewhere."""
    import torch

    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(prompt // 2, prompt + 1, (rows,), generator=g)
    r_len = torch.randint(response // 2, response + 1, (rows,), generator=g)
    p_len[0], r_len[0] = prompt, response
    if rows == 1:
        p_len[0] = prompt - 8  # a padding mask, as a slice of a padded learner batch has
    cols = torch.arange(prompt + response)
    attn = ((cols >= prompt - p_len[:, None]) & (cols < prompt + r_len[:, None])).long()
    ids = torch.randint(1, vocab, (rows, prompt + response), generator=g) * attn
    return ids, attn, attn[:, prompt:].float(), torch.randn(rows, generator=g), torch.arange(rows) % 2 == 1


def _peak_of(fn) -> int:
    """Peak live torch CPU bytes while ``fn`` runs, relative to its start (profiler's
    allocator records)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _shape_model(shape_name: str, mode: str):
    """A random-init Qwen2 of ``SHAPES[shape_name]`` (bf16 weights for ``bf16``, fp32 otherwise)
    and its AdamW optimiser."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(
        Qwen2Config(**SHAPES[shape_name], max_position_embeddings=4096), dtype=dtype, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    return model, optimizer


def _passes(model, autocast):
    """``(learner_pass, scoring_pass)`` of ``model``, each ``fn(batch, response_tokens)``: the
    learner's log-probs, entropy, mixed loss and backward; the runner's scoring under no_grad."""
    import torch

    from rllib_exgrpo.core.losses import mixed_policy_loss
    from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy

    def learner_pass(batch, resp):
        ids, attn, rmask, adv, off = batch
        with autocast():
            logp, ent = completion_logprobs_and_entropy(model, ids, attn, resp)
        loss, _ = mixed_policy_loss(
            logp,
            logp.detach(),
            adv,
            rmask,
            off,
            clip_fresh=False,
            beta=0.1,
            agg_mode="seq-mean-token-sum-norm-official",
            max_len=resp,
            micro_batch_rows=64,
            entropy=ent,
            entropy_coeff=0.001,
        )
        loss.backward()

    def scoring_pass(batch, resp):
        ids, attn = batch[0], batch[1]
        with torch.no_grad(), autocast():
            completion_logprobs_and_entropy(model, ids, attn, resp)

    return learner_pass, scoring_pass


def measure_shape(shape_name: str, configs: list) -> list:
    import torch

    out = []
    models = {}
    for _, mode, kind, rows, prompt, response, ckpt in configs:
        if mode not in models:
            models[mode] = _shape_model(shape_name, mode)
        model, optimizer = models[mode]
        on = "enable" if ckpt else "disable"
        (getattr(model, f"activation_checkpointing_{on}", None) or getattr(model, f"gradient_checkpointing_{on}"))()
        model.train()
        autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "autocast" else contextlib.nullcontext
        vocab = SHAPES[shape_name]["vocab_size"]
        learner_pass, scoring_pass = _passes(model, autocast)

        # warm-up: gradients and AdamW state exist before the measured pass
        learner_pass(_batch(2, 8, 8, vocab, 0), 8)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        batch = _batch(rows, prompt, response, vocab, seed=rows * 7919 + response)
        t = time.perf_counter()
        fn = learner_pass if kind == "learner" else scoring_pass
        peak = _peak_of(lambda: fn(batch, response))
        out.append(
            {
                "shape": shape_name,
                "mode": mode,
                "pass": kind,
                "rows": rows,
                "prompt": prompt,
                "response": response,
                "gradient_checkpointing": ckpt,
                "measured_bytes": peak,
                "seconds": round(time.perf_counter() - t, 2),
                "parameters": sum(p.numel() for p in model.parameters()),
            }
        )
        optimizer.zero_grad(set_to_none=False)
    return out


#: The real-vocabulary check: shape and pass.
VOCAB_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    vocab_size=152064,
    tie_word_embeddings=True,
)
PACKED_ROWS, PACKED_PROMPT, PACKED_RESPONSE = 16, 64, 448


def _vocab_config():
    """What the plan reads of the learner: a DDP learner in float32, packed passes."""
    import types

    from rllib_exgrpo.rllib.config_fields import field_defaults

    fields = field_defaults()
    fields.update(
        model_name_or_path="qwen2-vocab",
        model_dtype="float32",
        learner_backend="ddp",
        num_learners=0,
        num_gpus_per_learner=1,
        gradient_checkpointing=False,
        minibatch_size=PACKED_ROWS,
        learner_micro_batch_tokens=PACKED_ROWS * (PACKED_PROMPT + PACKED_RESPONSE),
        attn_implementation="sdpa_varlen",
        max_prompt_tokens=PACKED_PROMPT,
        max_response_tokens=PACKED_RESPONSE,
        generation_backend="hf",
        scoring_on="runners",
        kl_coeff=0.0,
    )
    return types.SimpleNamespace(**fields)


def planned_packed_step() -> dict:
    from rllib_exgrpo.planning.memory import PROCESS_OVERHEAD_BYTES, _learner_plan
    from rllib_exgrpo.planning.shapes import ModelShape

    c = VOCAB_SHAPE
    shape = ModelShape(
        hidden_size=c["hidden_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["hidden_size"] // c["num_attention_heads"],
        intermediate_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        model_type="qwen2",
        source="benchmarks/memory_plan.py qwen2-vocab",
    )
    plan = _learner_plan(_vocab_config(), shape, None, PACKED_PROMPT, PACKED_RESPONSE)
    items = {it.what: it.bytes for it in plan.items}
    beyond = plan.total - items["weights"] - PROCESS_OVERHEAD_BYTES
    return {"planned_bytes": int(beyond), "items": items, "parameters": shape.num_parameters}


def _vocab_model():
    """The random-init ``qwen2-vocab`` model in float32 with packed (``sdpa_varlen``) attention,
    in training mode."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rllib_exgrpo.core.attention import register_kernels

    register_kernels()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        Qwen2Config(**VOCAB_SHAPE, max_position_embeddings=4096), dtype=torch.float32, attn_implementation="sdpa_varlen"
    )
    model.train()
    return model


def measure_packed_step() -> dict:
    """The steady-state learner step's peak beyond the weights (see the module doc)."""
    import torch

    from rllib_exgrpo.core import columns as C
    from rllib_exgrpo.core.losses import mixed_policy_loss
    from rllib_exgrpo.core.packing import pack_rows, score_packed

    model = _vocab_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    chunk = _vocab_config().logit_chunk_tokens

    def batch(rows, prompt, response, seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, VOCAB_SHAPE["vocab_size"], (rows, prompt + response), generator=g)
        mask = torch.ones_like(ids)
        cols = {C.INPUT_IDS: ids, C.ATTENTION_MASK: mask, C.RESPONSE_MASK: mask[:, prompt:].float()}
        return {**cols, **pack_rows(cols)}, torch.randn(rows, generator=g), torch.arange(rows) % 2 == 1

    def step(cols, adv, off):
        logp, ent = score_packed(model, cols, chunk_tokens=chunk)
        loss, _ = mixed_policy_loss(
            logp,
            logp.detach(),
            adv,
            cols[C.RESPONSE_MASK],
            off,
            clip_fresh=False,
            beta=0.1,
            agg_mode="seq-mean-token-sum-norm-official",
            max_len=cols[C.RESPONSE_MASK].shape[1],
            micro_batch_rows=64,
            entropy=ent,
            entropy_coeff=0.001,
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    step(*batch(2, 8, 8, 0))  # warm-up: gradients and AdamW state exist
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    held = 3 * weights  # gradients + AdamW's two moments, resident at the start of a step
    cols, adv, off = batch(PACKED_ROWS, PACKED_PROMPT, PACKED_RESPONSE, 1)
    t = time.perf_counter()
    peak = _peak_of(lambda: step(cols, adv, off))
    return {
        "measured_bytes": int(held + peak),
        "pass_peak_bytes": int(peak),
        "held_bytes": int(held),
        "weights_bytes": int(weights),
        "seconds": round(time.perf_counter() - t, 1),
        "tokens": int(cols[C.PACKED_INPUT_IDS].shape[1]),
        "chunk_tokens": int(chunk),
    }


def _child(args) -> int:
    import torch

    torch.set_num_threads(max(1, args.threads))
    if args.child == "packed":
        print(json.dumps(measure_packed_step()), flush=True)
        return 0
    configs = [tuple(c) for c in json.loads(args.child_configs)]
    print(json.dumps(measure_shape(args.child, configs)), flush=True)
    return 0


# ------------------------------------------------------------------ driver


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few small configurations only (tests)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--no-packed", dest="packed", action="store_false", help="skip the learner step at the real vocabulary")
    parser.add_argument("--packed-only", action="store_true", help="only the learner step at the real vocabulary")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-configs", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _run_child(child_args: list, threads: int) -> subprocess.CompletedProcess:
    """This script in a subprocess with ``child_args`` and ``--threads threads``, output captured."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run(
        [sys.executable, __file__, *child_args, "--threads", str(threads)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _print_table(rows: list) -> None:
    """Estimate against measured peak, one line per configuration."""
    head = (
        f"{'shape':<12}{'params':>8} {'mode':<9}{'pass':<8}{'rows x (prompt+resp)':<22}{'ckpt':<6}"
        f"{'estimate MiB':>13}{'measured MiB':>14}{'error':>8}  peak phase"
    )
    print()
    print(head)
    print("-" * len(head))
    for m in rows:
        print(
            f"{m['shape']:<12}{m['parameters'] / 1e6:>7.1f}M {m['mode']:<9}{m['pass']:<8}"
            f"{str(m['rows']) + ' x (' + str(m['prompt']) + '+' + str(m['response']) + ')':<22}"
            f"{'on' if m['gradient_checkpointing'] else 'off':<6}{m['estimated_bytes'] / MIB:>13.1f}"
            f"{m['measured_bytes'] / MIB:>14.1f}{m['error']:>+8.1%}  {m['phase']}"
        )


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.child:
        return _child(args)

    t0 = time.perf_counter()
    configs = [] if args.packed_only else (QUICK if args.quick else CONFIGS)
    rows = []
    for shape_name in dict.fromkeys(c[0] for c in configs):
        mine = [c for c in configs if c[0] == shape_name]
        proc = _run_child(["--child", shape_name, "--child-configs", json.dumps(mine)], args.threads)
        if proc.returncode != 0:
            print(proc.stdout + proc.stderr, file=sys.stderr)
            return proc.returncode
        measured = json.loads(proc.stdout.strip().splitlines()[-1])
        for m in measured:
            est = estimate(m["shape"], m["mode"], m["pass"], m["rows"], m["prompt"], m["response"], m["gradient_checkpointing"])
            m.update(estimated_bytes=est["bytes"], phase=est["phase"], error=est["bytes"] / m["measured_bytes"] - 1.0)
            rows.append(m)
            print(f"  measured {m['shape']} {m['mode']} {m['pass']} in {m['seconds']:.1f} s", flush=True)

    packed = None
    if args.packed:
        proc = _run_child(["--child", "packed"], args.threads)
        if proc.returncode != 0:
            print(proc.stdout + proc.stderr, file=sys.stderr)
            return proc.returncode
        packed = json.loads(proc.stdout.strip().splitlines()[-1])
        packed.update(planned_packed_step())
        packed["measured_over_planned"] = packed["measured_bytes"] / packed["planned_bytes"]
    if not rows:
        return _report_packed(packed, args, t0)

    _print_table(rows)
    worst = max(abs(m["error"]) for m in rows)
    print(f"activation_error_max={worst:.3f}")
    return _report_packed(packed, args, t0, configs=rows, activation_error_max=worst)


def _report_packed(packed, args, t0, **extra) -> int:
    import torch
    import transformers

    result = {
        **extra,
        "packed_step": packed,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "total_s": round(time.perf_counter() - t0, 1),
        "date": time.strftime("%Y-%m-%d"),
        "method": "torch.profiler memory events: peak live CPU tensor bytes during the pass",
    }
    if packed:
        print(
            f"\nlearner step at the real vocabulary: qwen2-vocab ({packed['parameters'] / 1e6:.1f} M parameters, "
            f"vocab {VOCAB_SHAPE['vocab_size']}, tied), one packed pass of {packed['tokens']} tokens, chunks of "
            f"{packed['chunk_tokens']}, float32, {packed['seconds']:.0f} s"
        )
        print(
            f"  measured beyond the weights: {packed['measured_bytes'] / MIB:9.1f} MiB (gradients + AdamW state "
            f"{packed['held_bytes'] / MIB:.1f}, step peak {packed['pass_peak_bytes'] / MIB:.1f})"
        )
        print(
            f"  planned beyond the weights:  {packed['planned_bytes'] / MIB:9.1f} MiB  "
            + ", ".join(f"{k} {v / MIB:.1f}" for k, v in packed["items"].items() if k not in ("weights", "CUDA context, workspaces"))
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ntotal {result['total_s']:.1f} s; wrote {args.out}")
    if packed:
        print(f"measured_over_planned={packed['measured_over_planned']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
