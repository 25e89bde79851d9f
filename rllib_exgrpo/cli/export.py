"""``rllib export CHECKPOINT OUT``: a training checkpoint as a Hugging Face model folder.

Registered in :data:`rllib_exgrpo.cli.main.SUBCOMMANDS`. The work is done by
:func:`rllib_exgrpo.evaluation.export.export_checkpoint`; this module is the command line
around it.

Exit codes: 0 written, 2 bad command line, a path that is no checkpoint, or an OUT that
may not be written (one line, nothing written), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

PROG = "rllib"

_EPILOG = """\
CHECKPOINT: an algorithm checkpoint (checkpoint_* of a Tune trial, or what algo.save_to_path
wrote), a Tune trial folder (its latest checkpoint_*), or a module folder; DDP and
DeepSpeed checkpoints alike (ZeRO-3 weight shards are consolidated).
OUT gets config.json, model.safetensors, generation_config.json (where the model has one)
and the base model's tokenizer files: transformers' from_pretrained(OUT) and vLLM load it.
Relative paths are relative to the working directory. An existing, non-empty OUT is an
error unless --force, which replaces it (its old files are removed).

examples:
  rllib export results/exgrpo/ExGRPO_xxx/checkpoint_000010 exported/exgrpo-step10
  rllib export results/exgrpo/ExGRPO_xxx exported/latest --force --dtype bfloat16
"""


def add_export_parser(subparsers: Any) -> None:
    # lazy: `rllib --help` and argument errors answer before torch and Ray load
    from rllib_exgrpo.models.loading import MODEL_DTYPES

    p = subparsers.add_parser(
        "export",
        help="write a checkpoint's policy as a Hugging Face model folder",
        description="Write the policy of an RLlib checkpoint of this project as a Hugging Face model "
        "folder (config, safetensors weights, tokenizer, generation config).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint, Tune trial or module folder")
    p.add_argument("out", metavar="OUT", help="model folder to write")
    p.add_argument("--force", action="store_true", help="replace an existing, non-empty OUT")
    p.add_argument(
        "--best", action="store_true", help="CHECKPOINT is a run or trial folder: export its checkpoint of highest heldout/accuracy"
    )
    p.add_argument("--dtype", choices=MODEL_DTYPES, default=None, help="cast the weights (default: the dtype they were saved in)")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    """Handler of ``rllib export``; returns the exit code."""
    # lazy: `rllib --help` and argument errors answer before torch and Ray load
    from rllib_exgrpo.evaluation.export import ExportError, export_checkpoint

    if args.best:
        # lazy: `rllib --help` and argument errors answer before torch and Ray load
        from rllib_exgrpo.evaluation.checkpoints import BEST_METRIC, best_checkpoint

        try:
            folder, value = best_checkpoint(args.checkpoint)
        except FileNotFoundError as e:
            print(f"{PROG} export: error: --best: {e}", file=sys.stderr)
            return 2
        print(f"{PROG} export: best checkpoint by {BEST_METRIC}: {folder} ({value:.4f})")
        args.checkpoint = str(folder)
    try:
        result = export_checkpoint(args.checkpoint, args.out, force=args.force, dtype=args.dtype)
    except ExportError as e:
        print(f"{PROG} export: error: {e}", file=sys.stderr)
        return 2
    ckpt = result.checkpoint
    print(
        f"{PROG} export: {ckpt.algorithm or 'RLlib'} checkpoint {ckpt.path or ckpt.module_path} "
        f"(base model {ckpt.model_name_or_path}{', ZeRO-3 shards consolidated' if result.zero3 else ''})"
    )
    print(f"{PROG} export: {result.dtype} model written to {result.out}: {', '.join(result.files)}")
    return 0
