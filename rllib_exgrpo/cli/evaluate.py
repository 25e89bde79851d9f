"""``rllib evaluate``: benchmark a model or an RLlib checkpoint (avg@k / pass@k / maj@k).

Registered in :data:`rllib_exgrpo.cli.main.SUBCOMMANDS`. The work is done by
:func:`rllib_exgrpo.evaluation.evaluate.evaluate`; this module is the command line around it.

Exit codes: 0 done, 2 bad command line or benchmark file (nothing generated; a malformed
row is reported as ``path:line: reason``), 130 interrupted.
"""
from __future__ import annotations

import argparse
import datetime as _dt
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
or "arithmetic[:opts]" specs (the held-out "test" split), and can be repeated.

examples:
  rllib evaluate --model tiny --data arithmetic --limit 200 --temperature 0
  rllib evaluate --model results/exp/GRPO_xxx/checkpoint_000010 \\
      --data data/aime24_test.jsonl --data data/math500_test.jsonl --output eval.json
"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def _pass_k(text: str):
    if text == "k":
        return "k"
    return positive_int(text)


def add_evaluate_parser(subparsers: Any) -> None:
    from rllib_exgrpo.evaluation.metrics import DEFAULT_BATCH_SIZE, DEFAULT_TEMPERATURE, DEFAULT_TOP_P

    p = subparsers.add_parser(
        "evaluate",
        help="evaluate a model or checkpoint on benchmarks (avg@k, pass@k, maj@k)",
        description="Sample completions of benchmark questions with a model or an RLlib checkpoint "
        "of this project, verify them with the env's verifier (math-verify) and report avg@k, "
        "pass@k and maj@k per data source and overall.",
        epilog=_EPILOG,
        formatter_class=_Formatter,
    )
    p.add_argument("--model", required=True, metavar="NAME_PATH_OR_CHECKPOINT",
                   help="model name/path or RLlib checkpoint folder")
    p.add_argument("--data", required=True, action="append", metavar="FILE_OR_SPEC",
                   help="benchmark file or arithmetic spec (repeatable)")
    p.add_argument("--k", type=positive_int, default=None, metavar="K",
                   help="samples per question for every source (default: 32 for aime/amc, else 1)")
    p.add_argument("--temperature", type=non_negative_float, default=DEFAULT_TEMPERATURE, metavar="T",
                   help="sampling temperature; 0: greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, metavar="P", help="nucleus sampling threshold (default: %(default)s)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="first N questions of each benchmark")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                   help="completion budget (default: the checkpoint's max_response_tokens, else 1024)")
    p.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE, metavar="N",
                   help="sequences per generate call (default: %(default)s)")
    p.add_argument("--pass-k", type=_pass_k, action="append", default=None, metavar="J",
                   help="report pass@J (repeatable; 'k' = each source's k; default: 1 and k)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default: %(default)s)")
    p.add_argument("--output", "-o", default=None, metavar="FILE",
                   help="JSON results file (default: ./eval-<timestamp>.json)")
    p.add_argument("--instruction", default=None, metavar="TEXT",
                   help="answer-format instruction appended to each question (default: the checkpoint's or "
                   "the env's); '' for none")
    p.add_argument("--system-prompt", default=None, metavar="TEXT", help="system message")
    p.add_argument("--think-format", action="store_true", default=None,
                   help="ask for <think>...</think> and verify only the text after it")
    p.add_argument("--split", default="test", help="split of arithmetic specs (default: %(default)s)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--keep-completions", action="store_true", help="store completion texts in the JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run_evaluate, _evaluate_parser=p)


def run_evaluate(args: argparse.Namespace) -> int:
    """Handler of ``rllib evaluate``; returns the exit code."""
    from rllib_exgrpo.evaluation import EvalDataError, evaluate, load_eval_problems
    from rllib_exgrpo.evaluation.metrics import DEFAULT_PASS_KS
    from rllib_exgrpo.evaluation.paths import PolicyPathError, policy_source

    def fail(msg: str) -> int:
        print(f"{PROG} evaluate: error: {msg}", file=sys.stderr)
        return 2

    try:
        model = policy_source(args.model)  # a path: absolute, and checked to be a checkpoint or model folder
    except PolicyPathError as e:
        return fail(f"--model {e}")
    if not 0 < args.top_p <= 1:
        return fail(f"--top-p must be in (0, 1], got {args.top_p}")
    # Check every benchmark before loading a model (cheap, and errors come first).
    try:
        load_eval_problems(args.data, limit=args.limit, split=args.split)
    except EvalDataError as e:
        return fail(str(e))

    kwargs = {}
    if args.instruction is not None:
        kwargs["instruction"] = args.instruction or None
    if args.system_prompt is not None:
        kwargs["system_prompt"] = args.system_prompt or None
    if args.think_format:
        kwargs["think_format"] = True
    try:
        report = evaluate(
            model,
            args.data,
            k=args.k,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            limit=args.limit,
            batch_size=args.batch_size,
            seed=args.seed,
            pass_ks=tuple(args.pass_k) if args.pass_k else DEFAULT_PASS_KS,
            split=args.split,
            keep_completions=args.keep_completions,
            device=args.device,
            progress=not args.quiet,
            **kwargs,
        )
    except (EvalDataError, PolicyPathError) as e:
        return fail(str(e))
    output = args.output or f"eval-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path = report.to_json(output)
    print(report.table())
    print(f"{PROG} evaluate: results written to {path}")
    return 0
