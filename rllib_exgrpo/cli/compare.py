"""``rllib compare``: methods side by side on the same benchmarks (``evaluation/compare.py``).

    rllib compare results/grpo-tiny results/exgrpo-tiny --data arithmetic --temperature 0 --limit 200
    rllib compare eval-grpo.json eval-exgrpo.json            # saved evaluations, nothing re-run

Each RUN is a saved evaluation (``rllib evaluate --output``'s JSON, read as is) or anything
``rllib evaluate --model`` takes (a run or trial folder, a checkpoint, a model), evaluated
here on ``--data`` with the same settings for every RUN; the evaluations are saved beside the
table. Prints the table (avg@k with 95% bootstrap intervals over questions, paired
differences against the first RUN) and writes ``compare.md``, ``compare.csv`` and
``compare.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, List, Optional

from rllib_exgrpo.cli.args import non_negative_float, positive_int

PROG = "rllib"


def add_compare_parser(subparsers: Any) -> None:
    # lazy: `rllib --help` and argument errors answer before torch and Ray load
    from rllib_exgrpo.evaluation.compare import DEFAULT_BOOTSTRAP

    p = subparsers.add_parser(
        "compare",
        help="compare runs or checkpoints on the same benchmarks (table with intervals)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="saved evaluation JSON, run/trial/checkpoint folder or model")
    p.add_argument(
        "--label", action="append", default=None, metavar="NAME", help="a name per RUN, in order (default: the file or folder name)"
    )
    p.add_argument(
        "--data",
        action="append",
        default=None,
        metavar="FILE_OR_SPEC",
        help="benchmark file or arithmetic spec (repeatable; needed when a RUN is evaluated here)",
    )
    p.add_argument("--k", type=positive_int, default=None, help="samples per question (default: the papers')")
    p.add_argument("--temperature", type=non_negative_float, default=None, metavar="T")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="first N distinct questions of each data source")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N")
    p.add_argument("--backend", choices=("auto", "vllm", "hf"), default="auto")
    p.add_argument("--seed", type=int, default=0, help="sampling and bootstrap seed")
    p.add_argument(
        "--bootstrap", type=positive_int, default=DEFAULT_BOOTSTRAP, metavar="B", help=f"bootstrap draws (default {DEFAULT_BOOTSTRAP})"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("compare"),
        metavar="DIR",
        help="where compare.md, compare.csv, compare.png and the evaluations go (default ./compare)",
    )
    p.set_defaults(func=run_compare)


def _label(run: str) -> str:
    name = Path(run.rstrip("/")).name or run
    return re.sub(r"\.json$", "", name)


def run_compare(args: argparse.Namespace) -> int:
    """Handler of ``rllib compare``; returns the exit code."""
    # lazy: `rllib --help` and argument errors answer before torch and Ray load
    from rllib_exgrpo.evaluation.compare import compare_reports, load_report

    def fail(msg: str) -> int:
        print(f"{PROG} compare: error: {msg}", file=sys.stderr)
        return 2

    labels = args.label or [_label(r) for r in args.runs]
    if len(labels) != len(args.runs):
        return fail(f"--label given {len(labels)} time(s) for {len(args.runs)} RUN(s): one per RUN")
    saved = [load_report(r) for r in args.runs]
    to_run = [r for r, s in zip(args.runs, saved) if s is None]
    if to_run:
        problem = _check_runs(to_run, args.data)
        if problem:
            return fail(problem)
    args.out.mkdir(parents=True, exist_ok=True)
    reports = []
    for run, label, report in zip(args.runs, labels, saved):
        reports.append(report if report is not None else _evaluate(run, label, args))
    try:
        table = compare_reports(reports, labels, draws=args.bootstrap, seed=args.seed)
    except ValueError as e:
        return fail(str(e))
    text = table.markdown()
    print(text)
    (args.out / "compare.md").write_text(text, encoding="utf-8")
    (args.out / "compare.csv").write_text(table.csv(), encoding="utf-8")
    table.figure(args.out / "compare.png")
    print(f"written: {args.out / 'compare.md'}, compare.csv, compare.png")
    return 0


def _check_runs(runs: List[str], data: Optional[List[str]]) -> Optional[str]:
    """Why the RUNs to evaluate here cannot be (one line), before any model is loaded."""
    # lazy: `rllib --help` and argument errors answer before torch and Ray load
    from rllib_exgrpo.evaluation import EvalDataError, load_eval_problems
    from rllib_exgrpo.evaluation.paths import PolicyPathError, policy_source

    if not data:
        return f"{runs[0]} is no saved evaluation (JSON with questions): give --data to evaluate it here"
    for run in runs:
        try:
            policy_source(run)
        except PolicyPathError as e:
            return f"RUN {e}"
    try:
        load_eval_problems(data)
    except EvalDataError as e:
        return str(e)
    return None


def _evaluate(run: str, label: str, args: argparse.Namespace) -> dict:
    """Evaluate one RUN with the shared settings; the report is saved as ``eval-<label>.json``."""
    # lazy: `rllib --help` and argument errors answer before torch and Ray load
    from rllib_exgrpo.evaluation import evaluate
    from rllib_exgrpo.evaluation.paths import policy_source

    print(f"{PROG} compare: evaluating {label} ({run})", file=sys.stderr, flush=True)
    report = evaluate(
        policy_source(run),
        args.data,
        k=args.k,
        temperature=args.temperature,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        backend=args.backend,
        seed=args.seed,
        progress=False,
    )
    path = args.out / f"eval-{re.sub(r'[^A-Za-z0-9_.-]', '_', label)}.json"
    report.to_json(path)
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


__all__ = ["add_compare_parser", "run_compare"]
