"""Paths as users type them: what a model argument names, checked before anything loads.

A path is relative to the working directory (``~`` expanded) and is made absolute here,
once: RLlib reads checkpoints through pyarrow, which takes a relative path for a URI with
no scheme, and a model folder is found by transformers only while the working directory
stays the same.

:func:`policy_source` sorts a model argument (``rllib evaluate --model``) into an embedded
model name, a hub name, or a folder on disk, and checks that a folder is one of the two
things a policy can be loaded from: an RLlib checkpoint of this project or a Hugging Face
model folder. Anything else is a :class:`PolicyPathError` whose message is one line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Union

from rllib_exgrpo.evaluation.checkpoints import RunFolderError, find_checkpoint, is_checkpoint
from rllib_exgrpo.models.rehearsal import is_rehearsal_spec

#: Model names resolved by :func:`rllib_exgrpo.models.resolve_model_path`, never paths.
_EMBEDDED = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
#: A Hugging Face hub id: ``name`` or ``org/name``.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")

#: What a folder given as a policy must be (the end of the one-line errors).
EXPECTED = (
    "an RLlib checkpoint of this project (rllib_checkpoint.json and learner_group/, a Tune "
    "trial folder with checkpoint_* subfolders, a run folder of one trial, or a module folder) or a "
    "Hugging Face model folder (config.json)"
)
EXPECTED_CHECKPOINT = (
    "an RLlib checkpoint of this project (rllib_checkpoint.json and learner_group/, "
    "a Tune trial folder with checkpoint_* subfolders, a run folder of one trial, or a module folder)"
)


class PolicyPathError(ValueError):
    """A model or checkpoint argument that names nothing loadable; the message is one line."""


def user_path(text: Union[str, os.PathLike]) -> str:
    """``text`` as an absolute path: ``~`` expanded, relative to the working directory."""
    return os.path.abspath(os.path.expanduser(os.fspath(text)))


def is_model_name(text: str) -> bool:
    """An embedded model name (``tiny``, ``tiny:...``, ``smollm2``, ``rehearsal:...``)."""
    name = text.strip()
    return name == "tiny" or name.startswith("tiny:") or name.lower() in _EMBEDDED or is_rehearsal_spec(name)


def is_hf_model_dir(path: Union[str, os.PathLike]) -> bool:
    """A folder ``from_pretrained`` reads: it holds a ``config.json``."""
    return (Path(path) / "config.json").is_file()


def policy_source(text: Union[str, os.PathLike]) -> str:
    """What a model argument names, as :func:`rllib_exgrpo.evaluation.evaluate` loads it.

    An embedded model name is returned unchanged, and so is a hub id (``org/name``) that is
    no path on disk; an existing path is returned absolute, after checking that it is a
    checkpoint (:func:`~rllib_exgrpo.evaluation.checkpoints.is_checkpoint`) or a Hugging
    Face model folder. Raises :class:`PolicyPathError` (one line) for a path that does not
    exist or is neither.
    """
    raw = os.fspath(text)
    if is_model_name(raw):
        return raw
    path = user_path(raw)
    if not os.path.exists(path):
        if _HUB_ID.fullmatch(raw):
            return raw
        raise PolicyPathError(f"{raw}: no such file or folder")
    if not os.path.isdir(path):
        raise PolicyPathError(f"{raw} is a file; expected a folder: {EXPECTED}")
    if is_checkpoint(path) or is_hf_model_dir(path):
        return path
    _run_folder_problem(raw, path)
    raise PolicyPathError(f"{raw} is not a model folder; expected {EXPECTED}")


def _run_folder_problem(raw: str, path: str) -> None:
    """A run folder of several trials: :class:`PolicyPathError` saying so (and what to pass)."""
    try:
        find_checkpoint(path)
    except RunFolderError as e:
        message = str(e)
        raise PolicyPathError(raw + message[len(path) :] if message.startswith(path) else message) from None
    except (FileNotFoundError, OSError):
        return


def checkpoint_source(text: Union[str, os.PathLike]) -> str:
    """A checkpoint argument (``rllib export``) as an absolute path; :class:`PolicyPathError`
    (one line) when it is no checkpoint of this project."""
    raw = os.fspath(text)
    path = user_path(raw)
    if not os.path.exists(path):
        raise PolicyPathError(f"{raw}: no such file or folder")
    if not os.path.isdir(path):
        raise PolicyPathError(f"{raw} is a file; expected a folder: {EXPECTED_CHECKPOINT}")
    if not is_checkpoint(path):
        _run_folder_problem(raw, path)
        hint = " (a Hugging Face model folder already)" if is_hf_model_dir(path) else ""
        raise PolicyPathError(f"{raw} is not a checkpoint{hint}; expected {EXPECTED_CHECKPOINT}")
    return path
