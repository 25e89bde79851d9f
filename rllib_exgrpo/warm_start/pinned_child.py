"""Entry point of the tiny model's pinned build child (``python -m`` this module).

``models.pinned_build.build_in_pinned_process`` starts it in a fresh interpreter whose
environment pins the CPU numerics (it names this module on the command line and never
imports it: the build sits above ``models``); here the child ties its life to the
parent's and runs the build (``warm_start.build``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this child when the builder that spawned it dies (a killed
    builder must not leave an orphan build running into a folder the next one removes)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        sys.exit(1)


def main(argv: list[str]) -> int:
    """Child entry point: ``FOLDER PARENT_PID [--progress]``, the recipe as JSON on stdin."""
    folder, parent_pid = Path(argv[0]), int(argv[1])
    _die_with_parent(parent_pid)
    recipe = json.loads(sys.stdin.read())
    # lazy: the build (torch) loads after the child ties its life to the parent's
    from rllib_exgrpo.warm_start.build import build_into

    build_into(folder, recipe, progress="--progress" in argv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
