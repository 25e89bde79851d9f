"""Time from starting the main job to its first iteration's result line, on an empty model cache.

Runs ``rllib train file tuned_examples/exgrpo_tiny.yaml`` (or ``--file``) as a subprocess
with ``RLLIB_EXGRPO_CACHE`` pointing at a fresh temporary folder (so the model comes from the
package's shipped build, or is built when ``--rebuild`` sets ``RLLIB_EXGRPO_REBUILD_MODEL=1``)
and results in another temporary folder, watches its output for the first ``iter    1``
line, then stops it (SIGINT, which shuts its Ray down; SIGKILL for whatever is left of its
process group after a grace period). Prints each milestone line with its time since the
start, then ``first_iteration_seconds=X`` as the last line.

The first iteration includes the held-out evaluation before training (200 questions at
iteration 0, reported with iteration 1).

Usage::

    python benchmarks/first_iteration.py
    python benchmarks/first_iteration.py --rebuild          # an empty cache and no shipped model
    python benchmarks/first_iteration.py --file tuned_examples/grpo_tiny.yaml --timeout 1800
    python benchmarks/first_iteration.py --config '{"questions_per_step": 2, "minibatch_size": 16, "heldout_num_questions": 4}'
                                                             # a small first iteration, seconds
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_ITERATION = re.compile(r"\] iter\s+1\b")
#: Output lines worth a timestamp: where the time before the first iteration goes.
MILESTONES = re.compile(
    r"shipped|warm-starting tiny model|Started a local Ray|Trial .* started|errored|Traceback|"
    r"Error|\] iter\s+\d+"
)


def rllib_command() -> list[str]:
    """The ``rllib`` console script next to this interpreter, else the module."""
    script = Path(sys.executable).with_name("rllib")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rllib_exgrpo.cli.main"]


def _session_pids(sid: int) -> list[int]:
    """Processes whose session is ``sid`` (the job started its own session)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # fields after "pid (comm)": state ppid pgrp session ...
            pids.append(int(stat.parent.name))
    return pids


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGINT (``rllib train`` stops its trial and Ray on it), then SIGKILL for anything of its
    session still running after ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    for pid in _session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.wait(timeout=10)


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", default=str(ROOT / "tuned_examples" / "exgrpo_tiny.yaml"))
    parser.add_argument("--timeout", type=float, default=1200.0, help="give up after this many seconds")
    parser.add_argument(
        "--rebuild", action="store_true", help="build the model from its recipe (RLLIB_EXGRPO_REBUILD_MODEL=1) instead of the shipped copy"
    )
    parser.add_argument("--config", default=None, help="JSON settings passed to `rllib train --config` (merged over the file's config)")
    parser.add_argument("--log", help="also write the job's whole output here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (model cache, results with the iteration's timers)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="first-iteration-"))
    env = dict(os.environ, RLLIB_EXGRPO_CACHE=str(work / "cache"), PYTHONUNBUFFERED="1")
    if args.rebuild:
        env["RLLIB_EXGRPO_REBUILD_MODEL"] = "1"
    else:
        env.pop("RLLIB_EXGRPO_REBUILD_MODEL", None)
    cmd = rllib_command() + ["train", "file", args.file, "--storage-path", str(work / "results")]
    if args.config:
        cmd += ["--config", args.config]
    print("command:", " ".join(cmd), flush=True)
    print(f"model cache: {work / 'cache'} (empty); load average before: {os.getloadavg()}", flush=True)

    log = open(args.log, "w") if args.log else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True
    )
    found = threading.Event()
    elapsed: list[float] = []

    def watch():
        for line in proc.stdout:
            now = time.perf_counter() - t0
            if log:
                log.write(f"{now:8.1f} {line}")
            if MILESTONES.search(line):
                print(f"{now:8.1f} s  {line.rstrip()[:160]}", flush=True)
            if not found.is_set() and FIRST_ITERATION.search(line):
                elapsed.append(now)
                found.set()

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    try:
        deadline = t0 + args.timeout
        while not found.is_set() and proc.poll() is None and time.perf_counter() < deadline:
            found.wait(0.2)
    finally:
        stop(proc)
        reader.join(timeout=10)
        if log:
            log.close()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average after: {os.getloadavg()}")
    if not elapsed:
        print(f"no first iteration line (exit code {proc.returncode})", file=sys.stderr)
        print("first_iteration_seconds=nan")
        return 1
    print(f"first_iteration_seconds={elapsed[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
