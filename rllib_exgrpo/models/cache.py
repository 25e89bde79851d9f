"""The model cache: one folder per name under a cache root, built once, atomically.

The root is ``cache_dir`` / ``$RLLIB_EXGRPO_CACHE`` / ``~/.cache/rllib_exgrpo``. Builds go to
a temporary folder that is renamed into place atomically, under a file lock (``filelock``),
so concurrent callers (several Ray actors) wait for one build instead of racing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from filelock import FileLock

CACHE_ENV_VAR = "RLLIB_EXGRPO_CACHE"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "rllib_exgrpo")
#: The tiny model's build report, written last: the marker of a complete folder unless a
#: builder names its own (``builder.marker``).
WARM_START_FILE = "warm_start.json"


def cache_root(cache_dir: Optional[str] = None) -> Path:
    """``cache_dir``, else ``$RLLIB_EXGRPO_CACHE``, else ``~/.cache/rllib_exgrpo``."""
    root = cache_dir or os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_DIR
    return Path(os.path.expanduser(root)).resolve()


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a complete tiny model build (its report is there)."""
    return (folder / WARM_START_FILE).is_file()


def build_cached(root: Path, name: str, builder) -> Path:
    """Return ``root/name``, building it first with ``builder(tmp_dir)`` when missing.

    The builder writes into a fresh temporary folder inside ``root``; the folder is renamed to
    ``root/name`` only when the builder returned, so readers never see a half-built folder.
    A completed folder is one that holds ``warm_start.json`` (or whatever marker the builder
    writes last, see ``marker``). One builder at a time per name (file lock); the others wait
    and then reuse its result.
    """
    final = root / name
    marker = getattr(builder, "marker", WARM_START_FILE)
    if (final / marker).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / f".{name}.lock"):  # one builder per name; the others wait
        if (final / marker).is_file():
            return final
        # Only the lock holder builds, so any temporary folder of this name is left over
        # from a builder that was killed (SIGKILL skips the cleanup below).
        for stale in root.glob(f".tmp-{name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            builder(tmp)
            if not (tmp / marker).is_file():
                raise RuntimeError(f"builder for {name} did not write {marker}")
            if final.exists():  # left over from an interrupted manual copy: replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
