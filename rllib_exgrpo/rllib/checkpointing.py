"""Checkpoint files written atomically, and per-rank optimiser shards.

* :func:`atomic_folder`: a folder written under a temporary name next to its final place
  and renamed into place when complete, so a crash mid-save (kill -9, node loss) leaves
  the previous checkpoint or none, never a half-written one (``ExGRPO.save_to_path``, on
  the paths :func:`local_checkpoint_path` accepts).
* :func:`save_shard` / :func:`load_shard`: one rank's optimiser state in one file
  (``torch.save`` of the live state: tensors are written from their own memory, one
  storage at a time, nothing is gathered or copied first), written to a temporary file and
  renamed.

The DeepSpeed learner writes its ZeRO shards with these (``SHARD_FOLDER``); the layout is
described in ``docs/deepspeed.md``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import uuid
from typing import Any, Iterator, Optional, Union

import torch

#: The folder, inside a learner's checkpoint folder, that holds its optimiser shards:
#: ``<SHARD_FOLDER>/<module id>/rank_<r>_of_<n>.pt``.
SHARD_FOLDER = "optimizer_shards"

PathLike = Union[str, os.PathLike]


def shard_file(folder: PathLike, module_id: str, rank: int, world_size: int) -> pathlib.Path:
    return pathlib.Path(folder) / str(module_id) / f"rank_{rank}_of_{world_size}.pt"


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_folder(final: PathLike) -> Iterator[pathlib.Path]:
    """Yield a temporary folder beside ``final``; on success it replaces ``final``.

    An existing ``final`` (a folder Tune created empty for the checkpoint, or an older
    checkpoint at the same path) is renamed aside first and removed after the new folder
    is in place. On an exception the temporary folder is removed and ``final`` is left as
    it was.
    """
    final = pathlib.Path(final).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old: Optional[pathlib.Path] = None
    if final.exists():
        if final.is_dir() and not any(final.iterdir()):
            final.rmdir()
        else:
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
            os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def local_checkpoint_path(path: Optional[PathLike], filesystem=None) -> Optional[str]:
    """``path`` as a local folder (a ``file://`` URI unwrapped) when a checkpoint there can
    be written atomically (:func:`atomic_folder`), else None: no path, another filesystem
    than pyarrow's local one, or a remote URI."""
    if path is None or not (filesystem is None or type(filesystem).__name__ == "LocalFileSystem"):
        return None
    text = str(path)
    if "://" in text:
        return text[len("file://") :] if text.startswith("file://") else None
    return text


def save_shard(state: Any, path: PathLike) -> int:
    """``torch.save`` ``state`` to ``path`` atomically; returns the bytes written."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return path.stat().st_size


def load_shard(path: PathLike, map_location=None) -> Any:
    """Read a file written by :func:`save_shard` (it holds DeepSpeed's own objects, e.g.
    the loss scaler, besides tensors: a trusted checkpoint, so not ``weights_only``)."""
    return torch.load(str(path), map_location=map_location, weights_only=False)
