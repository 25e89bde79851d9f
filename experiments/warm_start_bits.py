"""Does the tiny model's warm start give the same bits on another CPU?

Builds one recipe several ways and prints the sha256 of each ``model.safetensors``:

* ``pinned``: the way ``build_tiny_model`` builds (a child process with pinned numerics:
  ATen's AVX2 kernels, MKL's vendor-neutral branch; ``rllib_exgrpo.models.pinned_build``);
* ``native``: the same recipe in this process, whose kernels are whatever this CPU
  offers (AVX-512 on the development machine): what the project did before the pin;
* with ``--qemu-cpu MODEL`` (needs ``qemu-user``, e.g. ``apt install qemu-user``): the pinned
  child (and with ``--qemu-native`` the native build) under ``qemu-x86_64 -cpu MODEL``, i.e.
  on an emulated CPU of another generation and vendor (``Haswell``: an Intel CPU with AVX2
  and no AVX-512, whatever the host is; qemu 7.2 or newer emulates AVX2). Emulation is
  ~40x slower, so use a short recipe there (``--fast``: the tests' 3-step build, ~5 min).

The pinned build should print one hash for this CPU and the emulated one; the native
builds differ from each other (and from the pinned one) wherever the CPUs differ.

Usage::

    python experiments/warm_start_bits.py                         # pinned vs native, here
    python experiments/warm_start_bits.py --qemu-cpu Haswell      # and on an emulated Haswell
    python experiments/warm_start_bits.py --fast --qemu-cpu Haswell   # the hash the tests pin
    python experiments/warm_start_bits.py --max-steps 0           # the full default recipe
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _sha(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def _report(folder: Path) -> dict:
    return json.loads((folder / "warm_start.json").read_text())


def _recipe(max_steps: int) -> dict:
    from rllib_exgrpo.models import tiny_recipe

    if max_steps <= 0:
        return tiny_recipe()
    # Short: a few supervised steps and one small evaluation (the stop rule never fires).
    return tiny_recipe(max_steps=max_steps, target_pass1=1.0, overrides={"eval": {"eval_start": max_steps, "n_eval": 32}})


def _fast_recipe() -> dict:
    """The recipe of tests/test_models.py's FAST build, whose hash that test pins."""
    from rllib_exgrpo.models import tiny_recipe

    return tiny_recipe(
        seed=0,
        target_pass1=0.05,
        max_steps=6,
        overrides={"train": {"n_train": 1500}, "eval": {"eval_start": 3, "eval_every": 3, "n_eval": 16}},
    )


def _child(folder: Path, recipe: dict, env: dict, prefix: list[str], native: bool) -> float:
    """Build in a child: the pinned entry point, or (native) ``build_into`` with the given env."""
    folder.mkdir(parents=True)
    if native:
        code = (
            "import json,sys; from pathlib import Path; from rllib_exgrpo.warm_start.build import build_into; "
            "build_into(Path(sys.argv[1]), json.loads(sys.stdin.read()), False)"
        )
        cmd = prefix + [sys.executable, "-c", code, str(folder)]
    else:
        from rllib_exgrpo.models.pinned_build import CHILD_MODULE

        cmd = prefix + [sys.executable, "-m", CHILD_MODULE, str(folder), str(os.getpid())]
    t0 = time.time()
    subprocess.run(cmd, input=json.dumps(recipe), text=True, env=env, check=True, stderr=subprocess.DEVNULL if prefix else None)
    return time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-steps", type=int, default=30, help="supervised steps (0: the full default recipe)")
    ap.add_argument("--qemu-cpu", default=None, help="also build under qemu-x86_64 -cpu MODEL (e.g. Haswell)")
    ap.add_argument("--qemu-native", action="store_true", help="also the unpinned build under qemu (another ~10 min)")
    ap.add_argument("--fast", action="store_true", help="the tests' 3-step recipe (tests/test_models.py FAST) instead of --max-steps")
    ap.add_argument("--out", default=None, help="folder for the builds (default: a temporary one)")
    args = ap.parse_args()

    from rllib_exgrpo.models.pinned_build import PINNED_ENV, pinned_environment

    recipe = _fast_recipe() if args.fast else _recipe(args.max_steps)
    out = Path(args.out or tempfile.mkdtemp(prefix="warm-start-bits-"))
    plain = pinned_environment()
    for key in PINNED_ENV:  # the native builds: no pin, the CPU's own kernels
        plain.pop(key, None)
    # The pinned child is spawned the way build_tiny_model spawns it (our own pid as parent).
    runs = [("pinned, this CPU", [], pinned_environment(), False), ("native, this CPU", [], plain, True)]
    if args.qemu_cpu:
        qemu = ["qemu-x86_64", "-cpu", args.qemu_cpu]
        runs.append((f"pinned, qemu {args.qemu_cpu}", qemu, pinned_environment(), False))
        if args.qemu_native:
            runs.append((f"native, qemu {args.qemu_cpu}", qemu, plain, True))
    print(f"recipe: {'default' if args.max_steps <= 0 else f'{args.max_steps} steps'}; builds under {out}")
    rows = []
    for i, (label, prefix, env, native) in enumerate(runs):
        folder = out / f"build-{i}"
        seconds = _child(folder, recipe, env, prefix, native)
        rep = _report(folder)
        rows.append((label, _sha(folder), rep["steps"], rep["final_pass1"], rep.get("cpu_capability"), seconds))
        print(
            f"{label:28s} sha256 {rows[-1][1][:16]}  steps {rep['steps']:4d}  pass@1 {rep['final_pass1']:.4f}  "
            f"kernels {rep.get('cpu_capability')}  {seconds:.0f} s",
            flush=True,
        )
    pinned = {sha for label, sha, *_ in rows if label.startswith("pinned")}
    print(f"pinned builds identical: {len(pinned) == 1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
