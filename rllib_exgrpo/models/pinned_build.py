"""Build the tiny model in a child process whose CPU kernels are pinned to AVX2.

Why: the same seeded build gives different weights on different x86 CPUs. PyTorch chooses
its vectorised kernels (``DEFAULT`` / ``AVX2`` / ``AVX512``) once per process from the CPU,
and the choice changes the numbers, not only the speed: even ``torch.randn(64, 64)`` after
``torch.manual_seed(0)`` sums to -464.37 with the AVX-512 kernels and to 36.96 on an
AVX2-only CPU (measured here on a Xeon with AVX-512 and under ``qemu-x86_64 -cpu
Haswell``). MKL's matrix products pick their code path from the CPU in the same way. A
model trained from scratch amplifies such differences: the default recipe stopped after 650
supervised steps with the AVX-512 kernels and after 900 with the AVX2 ones.

Both libraries read a setting from the environment before their first use and never again,
so a process that has already run torch cannot switch. The build therefore runs in a fresh
``python -m rllib_exgrpo.models.pinned_build`` with :data:`PINNED_ENV`: ATen's AVX2
kernels, MKL's conditional numerical reproducibility at AVX2 (its promise: the same bits on
every CPU with AVX2, Intel or not, at a fixed thread count, which the recipe fixes) and
oneDNN capped at AVX2. Every x86-64 CPU since 2013-2015 has AVX2, so that is the common
denominator. Cost: ~15% slower steps than AVX-512 on this machine, once per recipe.

A CPU without AVX2 (or an ARM one) cannot run those kernels: the build still works but its
bits differ, and the report says so (``cpu_capability`` in ``warm_start.json``) with a
warning.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: The environment that pins the build's numerics (see the module docstring).
PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's vectorised kernels: reductions, softmax, randn, ...
    "MKL_CBWR": "AVX2",  # MKL conditional numerical reproducibility: same bits on any AVX2 CPU
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_DYNAMIC": "FALSE",  # a fixed thread team, as reproducible MKL results require
}
#: What ``torch.backends.cpu.get_cpu_capability()`` reports when the pin took effect.
PINNED_CAPABILITY = "AVX2"


def _import_roots() -> list[str]:
    """Folders the child needs on its path to import this package and ``envs`` as the parent
    does (a source checkout run without installation included)."""
    import envs
    import rllib_exgrpo

    roots = [str(Path(m.__file__).resolve().parent.parent) for m in (rllib_exgrpo, envs)]
    return list(dict.fromkeys(roots))


def pinned_environment(base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) with :data:`PINNED_ENV` and the import
    roots prepended to ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    env.update(PINNED_ENV)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(list(dict.fromkeys(_import_roots() + path)))
    return env


def build_in_pinned_process(folder: Path, recipe: dict, progress: bool) -> None:
    """Run the build of ``recipe`` into ``folder`` in a child process with the pinned
    environment; its progress and errors go to this process's stdout / stderr.

    Raises:
        RuntimeError: the child failed (its traceback is printed above) or was killed.
    """
    cmd = [sys.executable, "-m", "rllib_exgrpo.models.pinned_build", str(folder), str(os.getpid())]
    if progress:
        cmd.append("--progress")
    proc = subprocess.run(cmd, input=json.dumps(recipe), text=True, env=pinned_environment())
    if proc.returncode != 0:
        raise RuntimeError(
            f"the tiny model build failed in its child process (exit code {proc.returncode}; "
            "its error is printed above)"
        )


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
    from rllib_exgrpo.models.tiny import _build_into

    _build_into(folder, recipe, progress="--progress" in argv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
