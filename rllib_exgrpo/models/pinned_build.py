"""Build the tiny model in a child process whose CPU numerics are pinned.

Why: the same seeded build gives different weights on different x86 CPUs. PyTorch chooses
its vectorised kernels (``DEFAULT`` / ``AVX2`` / ``AVX512``) once per process from the CPU,
and the choice changes the numbers, not only the speed: even ``torch.randn(64, 64)`` after
``torch.manual_seed(0)`` sums to -464.37 with the AVX-512 kernels and to 36.96 with the
AVX2 ones. MKL, which does PyTorch's float matrix products and some of its element-wise
maths (``exp``, ``log``, ``sqrt`` through its vector-math library), picks its code path
from the CPU too, and from the CPU's vendor: its reproducibility switch ``MKL_CBWR=AVX2``
holds on Intel CPUs only, and an AMD CPU silently gets MKL's own dispatch instead. A model
trained from scratch amplifies such differences into a different model: the default
recipe stopped after 650 supervised steps on an AMD EPYC and after 900 on an Intel Xeon
with the earlier (Intel-only) pin.

Both libraries read their settings from the environment before their first use and never
again, so a process that has already run torch cannot switch. The build therefore runs in
a fresh ``python -m rllib_exgrpo.warm_start.pinned_child`` with :data:`PINNED_ENV`: ATen's
AVX2 kernels (every x86-64 CPU since 2013-2015 has AVX2), MKL's COMPATIBLE branch (SSE2
code without the approximate ``rcpps`` / ``rsqrtps`` instructions, which Intel and AMD
round differently: the one branch MKL runs alike on every vendor's CPU), oneDNN capped at
AVX2, and a fixed OpenMP team (the recipe fixes the thread count). The build's optimiser
is the fused AdamW, whose square root is ATen's own: the default AdamW's goes through
MKL's vector maths, which differed between AMD and Intel even on the COMPATIBLE branch.
Measured (``experiments/warm_start_bits.py``, docs/warm_start.md): an AMD EPYC and an
emulated Intel Haswell build the same bits. Cost: MKL's SSE2 matrix products are about
half the speed of its AVX2 ones, once per recipe.

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

import rllib_exgrpo

#: The environment that pins the build's numerics (see the module docstring).
PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's vectorised kernels: reductions, softmax, randn, ...
    # MKL's conditional numerical reproducibility on its COMPATIBLE (SSE2) branch: the one
    # branch MKL runs alike on Intel and non-Intel CPUs (its AVX2 branch is Intel-only: on an
    # AMD CPU MKL silently falls back to its AUTO dispatch, measured to change the bits).
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_DYNAMIC": "FALSE",  # a fixed thread team, as reproducible MKL results require
}
#: The child's entry point. The build (``rllib_exgrpo.warm_start``) sits above ``models``
#: (it samples through ``generation`` and retrieves through ``xrpo``), so ``models`` reaches
#: it only through this command line, never by an import.
CHILD_MODULE = "rllib_exgrpo.warm_start.pinned_child"
#: What ``torch.backends.cpu.get_cpu_capability()`` reports when the pin took effect.
PINNED_CAPABILITY = "AVX2"


def _import_roots() -> list[str]:
    """Folders the child needs on its path to import this package as the parent
    does (a source checkout run without installation included)."""
    return [str(Path(rllib_exgrpo.__file__).resolve().parent.parent)]


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
    cmd = [sys.executable, "-m", CHILD_MODULE, str(folder), str(os.getpid())]
    if progress:
        cmd.append("--progress")
    proc = subprocess.run(cmd, input=json.dumps(recipe), text=True, env=pinned_environment())
    if proc.returncode != 0:
        raise RuntimeError(f"the tiny model build failed in its child process (exit code {proc.returncode}; its error is printed above)")
