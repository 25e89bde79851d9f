"""The main job against its on-policy twin, through the real ``rllib train`` command.

    python experiments/main_job_seeds.py [--seeds 0 1] [--storage-path /tmp/main-job]
        [--files exgrpo_tiny.yaml grpo_tiny.yaml] [--main-config '{"retire_solved": false}']

For each seed, runs ``rllib train file tuned_examples/<file> --config '{"seed": s}'`` for
the main job (``exgrpo_tiny.yaml``) and its twin (``grpo_tiny.yaml``), one after the other,
exactly as a user would (the tiny model is built and cached by the first run), and prints
held-out accuracy before training and after the last iteration, the gain, ExGRPO minus
GRPO at the end, the peak, and each command's wall time. The held-out figures are the
runs' own ``heldout`` result (greedy, the first 200 arithmetic test questions). Also
prints the sha256 of the warm start the runs used, so a table can be tied to a build.

``--main-config`` adds keys to the main job's ``--config`` (a variant of the main job
against the same twin runs); its runs get their own folders (``<file>-<label>-seed<s>``,
the label from ``--label``), and the twin's runs are shared.

A run whose result folder already holds a finished trial (80 iterations) is read, not run
again: delete ``--storage-path`` to start over.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]


def _trial_rows(folder: Path) -> list:
    """The result rows of the one trial under ``folder`` (empty when none finished a row)."""
    results = sorted(folder.glob("*/*/result.json"))
    if not results:
        return []
    return [json.loads(line) for line in results[-1].read_text().splitlines() if line.strip()]


def _run(file: str, seed: int, storage: Path, rllib: str, extra: Optional[dict] = None, label: str = "") -> dict:
    folder = storage / f"{Path(file).stem}{'-' + label if label else ''}-seed{seed}"
    rows = _trial_rows(folder)
    wall = None
    if not rows or rows[-1]["training_iteration"] < 80:
        if folder.exists():  # an interrupted run: start it over in a clean folder
            shutil.rmtree(folder)
        cmd = [
            rllib,
            "train",
            "file",
            str(ROOT / "tuned_examples" / file),
            "--config",
            json.dumps({"seed": seed, **(extra or {})}),
            "--storage-path",
            str(folder),
        ]
        t0 = time.time()
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        wall = time.time() - t0
        rows = _trial_rows(folder)
    return {**heldout_summary(rows), "wall_s": wall}


def heldout_summary(rows: list) -> dict:
    """Start, end, peak and the held-out curve of one trial from its result rows: the rows
    between evaluations carry a NaN accuracy (no new measurement), which is skipped."""
    measured = [r for r in rows if "heldout" in r and r["heldout"]["accuracy"] == r["heldout"]["accuracy"]]
    curve = {int(r["heldout"]["after_iteration"]): r["heldout"]["accuracy"] for r in measured}
    last = rows[-1]
    return {
        "start": last["heldout"]["initial_accuracy"],
        "end": last["heldout"]["accuracy"],
        "peak": max(curve.values()),
        "curve": curve,
        "iterations": last["training_iteration"],
    }


def _warm_start_sha() -> str:
    from rllib_exgrpo.models import resolve_model_path

    path = Path(resolve_model_path("tiny"))
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--files", nargs=2, default=["exgrpo_tiny.yaml", "grpo_tiny.yaml"], metavar=("MAIN", "TWIN"))
    ap.add_argument("--storage-path", default=str(ROOT / "benchmarks" / "out" / "main_job"))
    ap.add_argument("--main-config", default="{}", help="JSON keys added to the main job's --config")
    ap.add_argument("--label", default="", help="folder label of the main runs under --main-config")
    ap.add_argument("--rllib", default=str(Path(sys.executable).with_name("rllib")))
    args = ap.parse_args()
    storage = Path(args.storage_path).resolve()
    main_file, twin_file = args.files
    extra = json.loads(args.main_config)
    if extra and not args.label:
        ap.error("--main-config needs a --label (its runs get their own folders)")
    print(f"{'seed':>4}  {'main: start -> end (gain)':>28}  {'peak':>5}  {'twin: end':>9}  {'main - twin':>11}  wall main / twin")
    for seed in args.seeds:
        a = _run(main_file, seed, storage, args.rllib, extra, args.label)
        b = _run(twin_file, seed, storage, args.rllib)
        wall = " / ".join("cached" if r["wall_s"] is None else f"{r['wall_s']:.0f} s" for r in (a, b))
        print(
            f"{seed:>4}  {a['start']:.3f} -> {a['end']:.3f} ({100 * (a['end'] - a['start']):+5.1f})  "
            f"{a['peak']:.3f}  {b['end']:>9.3f}  {100 * (a['end'] - b['end']):+11.1f}  {wall}",
            flush=True,
        )
        for label, r in (("main", a), ("twin", b)):
            print(
                f"      {label} held-out by iteration: " + " ".join(f"{it}:{acc:.3f}" for it, acc in sorted(r["curve"].items())), flush=True
            )
    sys.path.insert(0, str(ROOT))
    print(f"warm start: sha256 {_warm_start_sha()[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
