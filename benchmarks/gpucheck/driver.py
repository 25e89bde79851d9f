"""The command line: options, the device, the stages in order, the table of stages."""

from __future__ import annotations

import argparse
import platform
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

from gpucheck import __doc__ as PACKAGE_DOC
from gpucheck.common import DEFAULT_OUT, LEGACY_STAGES, SHAPES, Clock, build_model, sync
from gpucheck.deps import install_wheels, present
from gpucheck.imports import import_project
from gpucheck.legacy import LEGACY_RUNNERS, legacy_outcome
from gpucheck.newstages import NEW_RUNNERS, NEW_STAGES, reserve_s
from gpucheck.packed import flash_attn_status
from gpucheck.report import print_stage_table, print_table
from gpucheck.transfer import CPU_TRANSFER_CAP_GB

#: Every stage, in the order a run takes them.
STAGES = LEGACY_STAGES + NEW_STAGES
EXIT_FAILED = 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=PACKAGE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="qwen2.5-1.5b",
        help="qwen2.5-1.5b (GPU; its slice stage is Qwen2.5-Math-7B-shaped) or tiny (CPU, tests)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    p.add_argument("--cpu", action="store_true", help="every stage a CPU allows, at the tiny shape (--shape tiny --device cpu)")
    p.add_argument(
        "--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)} (always run in that order; default all)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=5,
        help="timed learner steps per configuration (after 1 warm-up); the slice stage times at most its shape's count (3)",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="weights of the learner / drift / generation model (the slice is always bf16 + fp32 master)",
    )
    p.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa: what load_causal_lm gets by default)")
    p.add_argument(
        "--slice-layers",
        default=None,
        help="decoder-layer counts of the slice stage, comma-separated, >= 2 distinct (default: 2,4 for the 7B shape)",
    )
    p.add_argument(
        "--transfer-gb",
        type=float,
        default=None,
        help="bytes (1e9) moved each way by the transfer stage (default: 15.2, the 7B bf16 weights; "
        f"tiny: 0.016; a CPU run is capped at {CPU_TRANSFER_CAP_GB})",
    )
    p.add_argument(
        "--transfer-chunk-mb", type=float, default=None, help="chunk size (1e6 bytes) of the transfer stage (default 512; tiny 4)"
    )
    p.add_argument("--zero-stages", default="1,2,3", help="ZeRO stages of zero3-colocate-offload (default 1,2,3)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="stages predicted to end past this are skipped or cut (the new stages' time is kept back from the measuring stages)",
    )
    p.add_argument(
        "--wheels",
        type=Path,
        default=None,
        help="a folder of wheels (benchmarks/prepare_gpu_wheels.sh) pip-installed --no-deps "
        "--no-index before anything runs: DeepSpeed on a machine without it",
    )
    p.add_argument("--skip-generation", action="store_true", help="same as leaving generation out of --stages")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results, rewritten after every stage")
    return p


def parse_args(argv):
    """The options, checked; ``args.stage_list``, ``args.slice_spec``, ``args.transfer_gb`` and
    ``args.chunk_mb`` resolved."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cpu:
        args.shape, args.device = "tiny", "cpu"
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    stages = [x.strip() for x in args.stages.split(",") if x.strip()]
    unknown = [x for x in stages if x not in STAGES]
    if unknown:
        parser.error(f"--stages: unknown {', '.join(unknown)} (choose from {', '.join(STAGES)})")
    if args.skip_generation and "generation" in stages:
        stages.remove("generation")
    args.stage_list = [s for s in STAGES if s in stages]
    try:
        args.zero_stage_list = tuple(int(x) for x in args.zero_stages.split(",") if x.strip())
    except ValueError:
        parser.error("--zero-stages: comma-separated integers")
    if not args.zero_stage_list or not set(args.zero_stage_list) <= {1, 2, 3}:
        parser.error("--zero-stages: one or more of 1, 2, 3")
    args.slice_spec = dict(SHAPES[args.shape]["slice"])
    if args.slice_layers:
        try:
            args.slice_spec["layers"] = tuple(int(x) for x in args.slice_layers.split(","))
        except ValueError:
            parser.error("--slice-layers: comma-separated integers")
    full_layers = args.slice_spec["config"]["num_hidden_layers"]
    if len(set(args.slice_spec["layers"])) < 2 or not all(1 <= n <= full_layers for n in args.slice_spec["layers"]):
        parser.error(f"--slice-layers: two or more distinct depths in 1..{full_layers}")
    args.transfer_gb = SHAPES[args.shape]["transfer_gb"] if args.transfer_gb is None else args.transfer_gb
    args.chunk_mb = SHAPES[args.shape]["transfer_chunk_mb"] if args.transfer_chunk_mb is None else args.transfer_chunk_mb
    if args.transfer_gb <= 0 or args.chunk_mb <= 0:
        parser.error("--transfer-gb and --transfer-chunk-mb must be > 0")
    return args


def pick_device(args):
    """The torch device, or None after saying in one line why there is none."""
    import torch

    cuda = torch.cuda.is_available()
    device_arg = ("cuda" if cuda else "cpu") if args.device == "auto" else args.device
    if device_arg.startswith("cuda") and not cuda:
        print(
            f"gpu_check: --device {device_arg} but torch sees no CUDA device "
            f"(torch {torch.__version__}); use --cpu (--shape tiny --device cpu) for the CPU check.",
            file=sys.stderr,
        )
        return None
    if args.shape != "tiny" and not device_arg.startswith("cuda"):
        print(
            f"gpu_check: --shape {args.shape} needs a CUDA GPU (torch {torch.__version__} sees "
            f"{'none' if not cuda else 'one, but --device ' + device_arg}); use --cpu "
            "(--shape tiny --device cpu) on CPU.",
            file=sys.stderr,
        )
        return None
    return torch.device(device_arg)


def start_results(args, device, wheels) -> dict:
    import torch
    import transformers

    imports = import_project()
    if int(transformers.__version__.split(".")[0]) < 5:
        print(
            f"gpu_check: note: transformers {transformers.__version__}; the project pins >=5,<6 "
            "(scoring needs logits_to_keep): measuring anyway",
            flush=True,
        )
    return {
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
        "optional_dependencies": present(),
        "wheels": wheels,
        "peak_memory": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "process peak RSS (ru_maxrss)",
        "model_config": SHAPES[args.shape]["config"],
        "stages": list(args.stage_list),
        "budget_s": args.budget_s,
        "stage_times_s": {},
        "summary": [],
    }


def print_header(ctx) -> None:
    args, results = ctx.args, ctx.results
    print(
        f"gpu_check: {args.shape} on {results['device_name']} ({ctx.device}), {args.dtype}; stages "
        f"{','.join(args.stage_list)}; budget {args.budget_s:.0f} s; out {args.out}",
        flush=True,
    )
    for module, pulled in results["imports"].items():
        print(
            f"  import {module}: "
            + (
                ("pulls in " + ", ".join(pulled))
                if isinstance(pulled, list) and pulled
                else pulled
                if isinstance(pulled, str)
                else "no ray/vllm/deepspeed"
            )
        )
    fa = results["flash_attn"]
    print("  flash_attn: " + (f"importable ({fa['version']})" if fa["importable"] else f"not importable ({fa['error']})"), flush=True)
    print("  optional: " + ", ".join(f"{k} {'here' if v else 'absent'}" for k, v in results["optional_dependencies"].items()), flush=True)


def record(ctx, stage: str, status: str, seconds: float, note: str) -> None:
    """One row of the table of stages (also in the JSON's ``summary``)."""
    ctx.results["summary"].append({"stage": stage, "status": status, "seconds": round(seconds, 3), "note": note})
    ctx.clock.save()
    print(f"== {stage}: {status} ({seconds:.1f} s){': ' + note if note else ''}", flush=True)


def run_stage(ctx, stage: str, fn) -> None:
    """``fn()`` as one stage: its status from what it returns (``(status, note)``), or failed
    with the error in one line; the check goes on either way."""
    t = time.perf_counter()
    try:
        status, note = fn()
    except Exception as e:  # one stage's failure is a row of the table, not the end of the run
        print(traceback.format_exc()[-3000:], file=sys.stderr, flush=True)
        msg = str(e).strip().splitlines()[0][:240] if str(e).strip() else ""
        status, note = "failed", f"{type(e).__name__}: {msg}"
    record(ctx, stage, status, time.perf_counter() - t, note)


def build_main_model(ctx) -> None:
    """The model the learner, drift and generation stages share (the others build their own)."""
    import torch

    t = time.perf_counter()
    torch.manual_seed(0)
    ctx.model = build_model(ctx.shape, ctx.device, ctx.dtype, ctx.args.attn)
    sync(ctx.device)
    r = ctx.results
    r["params"] = sum(p.numel() for p in ctx.model.parameters())
    r["param_dtype"] = str(next(ctx.model.parameters()).dtype).replace("torch.", "")
    r["attn_implementation"] = getattr(ctx.model.config, "_attn_implementation", ctx.args.attn)
    ctx.clock.stage("model build (random weights)", time.perf_counter() - t, f"{r['params'] / 1e6:,.1f} M parameters")


def run_all(ctx) -> None:
    """The measuring stages first, with the new stages' expected time kept back from their
    budget; then the new stages."""
    stages = ctx.args.stage_list
    kept_back = reserve_s(stages, ctx.device)
    ctx.clock.budget_s = ctx.args.budget_s - kept_back
    ctx.results["budget_kept_for_new_stages_s"] = kept_back
    if any(x in stages for x in ("learner", "drift", "generation")):  # the slice builds its own
        build_main_model(ctx)
    for stage in LEGACY_STAGES:
        if stage in stages:
            run_stage(ctx, stage, lambda s=stage: (LEGACY_RUNNERS[s](ctx), legacy_outcome(s, ctx.results))[1])
    ctx.model = None
    ctx.clock.budget_s = ctx.args.budget_s
    for stage in NEW_STAGES:
        if stage in stages:
            run_stage(ctx, stage, lambda s=stage: NEW_RUNNERS[s](ctx))


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    wheels = install_wheels(args.wheels) if args.wheels else None
    if wheels:
        print(f"gpu_check: wheels from {args.wheels}: {wheels['status']} {wheels.get('error', '')}", flush=True)
    device = pick_device(args)
    if device is None:
        return 2
    import torch

    ctx = SimpleNamespace(args=args, device=device, dtype=getattr(torch, args.dtype), shape=SHAPES[args.shape], model=None)
    ctx.results = start_results(args, device, wheels)
    ctx.clock = Clock(args.budget_s, args.out, ctx.results)
    ctx.clock.t0 = t_start
    print_header(ctx)
    ctx.clock.stage("startup (torch, CUDA, imports)", time.perf_counter() - t_start)
    run_all(ctx)
    ctx.results["total_s"] = round(time.perf_counter() - t_start, 3)
    ctx.clock.save()
    print_table(ctx.results)
    print_stage_table(ctx.results)
    print(f"wrote {args.out}")
    failed = [r["stage"] for r in ctx.results["summary"] if r["status"] == "failed"]
    return EXIT_FAILED if failed else 0
