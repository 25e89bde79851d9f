"""A training checkpoint as a Hugging Face model folder (``rllib export CHECKPOINT OUT``).

The policy's weights are those of the learner's module restored from the checkpoint
(:func:`~rllib_exgrpo.evaluation.checkpoints.restore_module`: a ZeRO-3 checkpoint's
weight shards consolidated first). ``OUT`` gets what ``from_pretrained`` and vLLM read:
``config.json``, ``model.safetensors`` (sharded above the size ``save_pretrained``
chooses), ``generation_config.json`` where the model has one, and the tokenizer files of
the base model the run trained from (chat template included). The weights keep the dtype
they were saved in (a float32 master copy stays float32) unless ``dtype`` asks for
another.

``OUT`` is written under a temporary name beside it and renamed into place when complete
(:func:`rllib_exgrpo.rllib.checkpointing.atomic_folder`): an interrupted export leaves no
half-written folder. An existing, non-empty ``OUT`` is an error unless ``force=True``,
which replaces it (its old files are removed); a folder that holds the checkpoint, the
working directory or one of its parents, and the home folder are never replaced.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Union

from rllib_exgrpo.evaluation.checkpoints import CheckpointInfo, read_checkpoint, restore_module
from rllib_exgrpo.evaluation.paths import PolicyPathError, checkpoint_source, user_path
from rllib_exgrpo.models.loading import no_progress_bars
from rllib_exgrpo.evaluation.checkpoints import zero3_shard_folder
from rllib_exgrpo.models import resolve_model_path
from rllib_exgrpo.models.loading import resolve_dtype


class ExportError(ValueError):
    """An export that cannot be done as asked; the message is one line."""


@dataclass
class ExportResult:
    """What :func:`export_checkpoint` wrote."""

    out: Path
    checkpoint: CheckpointInfo
    files: List[str]
    dtype: str
    zero3: bool


def export_checkpoint(
    checkpoint: Union[str, os.PathLike], out: Union[str, os.PathLike], *, force: bool = False, dtype: Optional[str] = None
) -> ExportResult:
    """Write the policy of ``checkpoint`` as a Hugging Face model folder ``out``.

    Args:
        checkpoint: An algorithm checkpoint, a Tune trial folder (its latest
            ``checkpoint_*``) or a module folder; relative to the working directory.
        out: The folder to write (relative to the working directory).
        force: Replace an existing, non-empty ``out``.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` to cast the weights to;
            default: as saved.

    Raises :class:`ExportError` (one line) for a path that is no checkpoint, an ``out``
    that may not be written, or an unknown ``dtype``.
    """
    # lazy: the CLI's parsers import evaluation/; Ray loads only when a command runs
    from rllib_exgrpo.rllib.checkpointing import atomic_folder

    try:
        source = checkpoint_source(checkpoint)
    except PolicyPathError as e:
        raise ExportError(str(e)) from None
    target = Path(user_path(out))
    torch_dtype = _torch_dtype(dtype)
    info = read_checkpoint(source)
    _check_out(target, out, info, force)
    module = restore_module(info)
    model = _policy_model(module, torch_dtype)
    with atomic_folder(target) as tmp, no_progress_bars():  # the command prints one line
        model.save_pretrained(str(tmp))
        _load_base_tokenizer(info.model_name_or_path).save_pretrained(str(tmp))
    return ExportResult(
        out=target,
        checkpoint=info,
        files=sorted(p.name for p in target.iterdir()),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        zero3=zero3_shard_folder(info.module_path) is not None,
    )


def _torch_dtype(name: Optional[str]):

    if name is None:
        return None
    try:
        return resolve_dtype(name)
    except ValueError as e:
        raise ExportError(str(e)) from None


def _check_out(target: Path, typed: Union[str, os.PathLike], info: CheckpointInfo, force: bool) -> None:
    """Refuse an ``out`` that would lose files (without ``force``) or must never be replaced."""
    shown = os.fspath(typed)
    if target.exists() and not target.is_dir():
        raise ExportError(f"{shown} is a file; OUT must be a folder (new, empty, or replaced with --force)")
    if not target.is_dir() or not any(target.iterdir()):
        return
    if not force:
        raise ExportError(f"{shown} exists and is not empty; give --force to replace it (its files are removed)")
    checkpoint = Path(info.path or info.module_path)
    cwd = Path(os.getcwd()).resolve()
    protected = target.resolve()
    if protected == checkpoint.resolve() or protected in checkpoint.resolve().parents:
        raise ExportError(f"{shown} holds the checkpoint; export to another folder")
    if protected == cwd or protected in cwd.parents or protected == Path.home().resolve():
        raise ExportError(f"{shown} is the working directory, one of its parents or the home folder; export to a folder of its own")


def _policy_model(module, torch_dtype):
    """The module's HF model as it is saved: eval mode, KV cache on (a learner's
    gradient-checkpointing setting turns it off), cast to ``torch_dtype`` where given. A
    LoRA learner's is the plain model with the merged weights, under the plain names (what
    the env runners sample from)."""
    model = module.plain_model()
    if module.model_config.get("gradient_checkpointing"):
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()
    model.config.use_cache = True
    model.eval()
    if torch_dtype is not None:
        model.to(torch_dtype)
    return model


def _load_base_tokenizer(model_name_or_path: str):
    """The base model's tokenizer as it is on disk (no pad token added)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(model_name_or_path))
