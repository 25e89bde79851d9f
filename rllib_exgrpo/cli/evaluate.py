"""``rllib evaluate``: benchmark a model or an RLlib checkpoint (avg@k / pass@k / maj@k).

Registered in :data:`rllib_exgrpo.cli.main.SUBCOMMANDS`. The work is done by
:func:`rllib_exgrpo.evaluation.evaluate.evaluate`; this module is the command line around it.

Exit codes: 0 done, 2 bad command line, benchmark file or backend (nothing generated; a
malformed row is reported as ``path:line: reason``), 130 interrupted.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from typing import Any

from rllib_exgrpo.cli.args import non_negative_float, positive_int

PROG = "rllib"

_EPILOG = """\
defaults (ExGRPO / LUFFY papers): temperature 0.6, top_p 1.0; k = 32 samples per
question (avg@32) for data sources whose name contains "aime" or "amc", 1 (avg@1)
otherwise. --k overrides k for every source. Temperature 0 is greedy (k = 1).

--model takes a model name or path ("tiny", "smollm2", a hub id, an HF folder) or an
RLlib checkpoint of this project (the folder algo.save_to_path or Tune wrote, or a Tune
trial folder: its latest checkpoint_*; DDP and DeepSpeed, ZeRO-3 shards consolidated).
A checkpoint's prompt settings (instruction, system prompt, think format) and
max_response_tokens are its defaults. Paths are relative to the working directory; a
folder that is neither a checkpoint nor a model folder is an error (exit 2).

--data takes benchmark files (.jsonl / .json / .parquet; malformed rows are errors)
or "arithmetic[:opts]" specs (the held-out "test" split), and can be repeated. A row
repeated in a file is one question (counted once, sampled k times).

--backend auto uses vLLM where vLLM is installed and a GPU is visible: one engine per
--tensor-parallel-size GPUs on every GPU of the machine (or of the Ray cluster at
--ray-address / RAY_ADDRESS), the questions split across them; HF otherwise. --backend
vllm without a GPU runs one engine of vLLM's CPU build. Each question's completion budget
is capped by the model's context: max_position_embeddings - prompt length.

--protocol exgrpo runs the ExGRPO paper's evaluation: temperature 0.6, top-p 1.0, budget
min(8192, context), avg@32 for AIME/AMC and avg@1 elsewhere, each row's chat messages
(system message kept; the official system message for files without one), the official
think format, and the in-distribution (AIME24, AIME25, AMC, MATH-500, Minerva,
OlympiadBench) and out-of-distribution (ARC-c, GPQA-diamond, MMLU-Pro) averages. --k,
--max-new-tokens, --temperature and --top-p still override it.

examples:
  rllib evaluate --model tiny --data arithmetic --limit 200 --temperature 0
  rllib evaluate --model results/exp/GRPO_xxx/checkpoint_000010 \\
      --data data/aime24_test.jsonl --data data/math500_test.jsonl --output eval.json
  rllib evaluate --model results/exp/GRPO_xxx --protocol exgrpo --data data/valid.parquet
"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def _pass_k(text: str):
    if text == "k":
        return "k"
    return positive_int(text)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def add_evaluate_parser(subparsers: Any) -> None:
    # lazy: `rllib --help` and argument errors answer before torch and Ray load
    from rllib_exgrpo.evaluation.engines import BACKENDS
    from rllib_exgrpo.evaluation.metrics import DEFAULT_BATCH_SIZE, DEFAULT_TEMPERATURE, DEFAULT_TOP_P
    from rllib_exgrpo.evaluation.protocol import PROTOCOLS

    p = subparsers.add_parser(
        "evaluate",
        help="evaluate a model or checkpoint on benchmarks (avg@k, pass@k, maj@k)",
        description="Sample completions of benchmark questions with a model or an RLlib checkpoint "
        "of this project, verify them with the env's verifier (math-verify) and report avg@k, "
        "pass@k and maj@k per data source and overall.",
        epilog=_EPILOG,
        formatter_class=_Formatter,
    )
    p.add_argument("--model", required=True, metavar="NAME_PATH_OR_CHECKPOINT", help="model name/path or RLlib checkpoint folder")
    p.add_argument(
        "--best", action="store_true", help="--model is a run or trial folder: evaluate its checkpoint of highest heldout/accuracy"
    )
    p.add_argument("--data", required=True, action="append", metavar="FILE_OR_SPEC", help="benchmark file or arithmetic spec (repeatable)")
    _add_sampling_arguments(p, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_BATCH_SIZE)
    p.add_argument("--output", "-o", default=None, metavar="FILE", help="JSON results file (default: ./eval-<timestamp>.json)")
    _add_prompt_arguments(p, PROTOCOLS)
    _add_backend_arguments(p, BACKENDS)
    p.add_argument("--keep-completions", action="store_true", help="store completion texts in the JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run_evaluate, _evaluate_parser=p)


def _add_sampling_arguments(p: argparse.ArgumentParser, default_temperature: float, default_top_p: float, default_batch_size: int) -> None:
    """Which questions, how many samples of each and how they are drawn: k, temperature, top-p,
    limits, token budgets, batch size, pass@J, seed.

    The defaults come from :mod:`rllib_exgrpo.evaluation.metrics`, imported lazily by the caller.
    """
    p.add_argument(
        "--k", type=positive_int, default=None, metavar="K", help="samples per question for every source (default: 32 for aime/amc, else 1)"
    )
    p.add_argument(
        "--temperature",
        type=non_negative_float,
        default=None,
        metavar="T",
        help=f"sampling temperature; 0: greedy (default: {default_temperature})",
    )
    p.add_argument("--top-p", type=float, default=None, metavar="P", help=f"nucleus sampling threshold (default: {default_top_p})")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="first N questions of each benchmark")
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="completion budget, capped by the model's context (default: the protocol's 8192, else "
        "the checkpoint's max_response_tokens, else 1024)",
    )
    p.add_argument(
        "--max-prompt-tokens", type=positive_int, default=None, metavar="N", help="left-truncate prompts to N tokens (default: no limit)"
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=default_batch_size,
        metavar="N",
        help="sequences per generate call (default: %(default)s)",
    )
    p.add_argument(
        "--pass-k",
        type=_pass_k,
        action="append",
        default=None,
        metavar="J",
        help="report pass@J (repeatable; 'k' = each source's k; default: 1 and k)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default: %(default)s)")


def _add_prompt_arguments(p: argparse.ArgumentParser, protocols: tuple) -> None:
    """How questions are put to the model: instruction, system message, think format, split, protocol.

    ``protocols`` is :data:`rllib_exgrpo.evaluation.protocol.PROTOCOLS`, imported lazily by the caller.
    """
    p.add_argument(
        "--instruction",
        default=None,
        metavar="TEXT",
        help="answer-format instruction appended to each question (default: the checkpoint's or the env's); '' for none",
    )
    p.add_argument("--system-prompt", default=None, metavar="TEXT", help="system message")
    p.add_argument("--think-format", action="store_true", default=None, help="ask for <think>...</think> and verify only the text after it")
    p.add_argument("--split", default="test", help="split of arithmetic specs (default: %(default)s)")
    p.add_argument("--protocol", choices=protocols, default=None, help="a paper's evaluation protocol by name (exgrpo: see below)")


def _add_backend_arguments(p: argparse.ArgumentParser, backends: tuple) -> None:
    """Where and how completions are generated: backend, vLLM engines and their Ray cluster, dtype, device.

    ``backends`` is :data:`rllib_exgrpo.evaluation.engines.BACKENDS`, imported lazily by the caller.
    """
    p.add_argument(
        "--backend",
        choices=backends,
        default="auto",
        help="generation: vLLM engines or transformers (default: auto: vLLM where vLLM and a GPU are present, else hf)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        metavar="N",
        help="GPUs per vLLM engine (default: %(default)s); engines = GPUs // N",
    )
    p.add_argument("--num-engines", type=positive_int, default=None, metavar="N", help="vLLM engines (default: as many as the GPUs allow)")
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="Ray cluster whose GPUs the vLLM engines use (default: RAY_ADDRESS, else this machine)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="weights' dtype (default: float32 with hf, the model config's with vllm)",
    )
    p.add_argument(
        "--vllm-kwargs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="extra vllm.LLM arguments, e.g. '{\"gpu_memory_utilization\": 0.85}'",
    )
    p.add_argument("--device", default=None, help="torch device of the hf backend (default: cuda when available, else cpu)")


def run_evaluate(args: argparse.Namespace) -> int:
    """Handler of ``rllib evaluate``; returns the exit code."""
    # lazy: `rllib --help` and argument errors answer before torch and Ray load
    from rllib_exgrpo.evaluation import EvalDataError, evaluate, load_eval_problems
    from rllib_exgrpo.evaluation.engines import BackendError
    from rllib_exgrpo.evaluation.metrics import DEFAULT_PASS_KS
    from rllib_exgrpo.evaluation.paths import PolicyPathError, policy_source

    def fail(msg: str) -> int:
        print(f"{PROG} evaluate: error: {msg}", file=sys.stderr)
        return 2

    if args.best:
        # lazy: `rllib --help` and argument errors answer before torch and Ray load
        from rllib_exgrpo.evaluation.checkpoints import BEST_METRIC, best_checkpoint

        try:
            folder, value = best_checkpoint(args.model)
        except FileNotFoundError as e:
            return fail(f"--best: {e}")
        print(f"{PROG} evaluate: best checkpoint by {BEST_METRIC}: {folder} ({value:.4f})", file=sys.stderr)
        args.model = str(folder)
    try:
        model = policy_source(args.model)  # a path: absolute, and checked to be a checkpoint or model folder
    except PolicyPathError as e:
        return fail(f"--model {e}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        return fail(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.protocol:
        given = [
            flag
            for flag, v in (
                ("--instruction", args.instruction),
                ("--system-prompt", args.system_prompt),
                ("--think-format", args.think_format),
            )
            if v is not None
        ]
        if given:
            return fail(f"--protocol {args.protocol} sets the prompt; drop {', '.join(given)}")
    # Check every benchmark before loading a model (cheap, and errors come first).
    try:
        load_eval_problems(args.data, limit=args.limit, split=args.split)
    except EvalDataError as e:
        return fail(str(e))

    try:
        report = evaluate(model, args.data, **_evaluate_options(args, DEFAULT_PASS_KS))
    except (EvalDataError, PolicyPathError, BackendError) as e:
        return fail(str(e))
    output = args.output or f"eval-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path = report.to_json(output)
    print(report.table())
    print(f"{PROG} evaluate: results written to {path}")
    return 0


def _evaluate_options(args: argparse.Namespace, default_pass_ks: tuple) -> dict:
    """The keyword arguments of :func:`rllib_exgrpo.evaluation.evaluate.evaluate` that the command line sets.

    The prompt options are passed only when given, so that a checkpoint's own prompt settings stay
    the defaults; ``default_pass_ks`` is ``DEFAULT_PASS_KS``, imported lazily by the caller.
    """
    options = dict(
        k=args.k,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        batch_size=args.batch_size,
        seed=args.seed,
        pass_ks=tuple(args.pass_k) if args.pass_k else default_pass_ks,
        split=args.split,
        keep_completions=args.keep_completions,
        device=args.device,
        progress=not args.quiet,
        max_prompt_tokens=args.max_prompt_tokens,
        backend=args.backend,
        tensor_parallel_size=args.tensor_parallel_size,
        num_engines=args.num_engines,
        ray_address=args.ray_address,
        dtype=args.dtype,
        vllm_kwargs=args.vllm_kwargs,
        protocol=args.protocol,
    )
    if args.instruction is not None:
        options["instruction"] = args.instruction or None
    if args.system_prompt is not None:
        options["system_prompt"] = args.system_prompt or None
    if args.think_format:
        options["think_format"] = True
    return options
