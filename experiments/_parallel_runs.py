"""Runs of an experiment spread over the machine's cores, one process per core.

An experiment at equal sampled tokens has two kinds of run: a reference (GRPO) that runs its
steps, and runs that spend the reference's tokens, which therefore cannot start before their
seed's reference has finished. Each run here is a child process pinned to one core (its own
Ray instance, one thread), so runs on different cores do not slow each other down through
thread oversubscription.

Which run a freed core takes: the first run in the queue whose reference has finished. The
queue holds every reference first, then the dependent runs, each kind in seed order: the
references are what unlock work, so taking them first keeps both cores busy (with two
cores and five seeds, runs of one length each: references 0+1, 2+3, then 4 beside the
first dependent, then two dependents twice, five run lengths in all; taking dependents first
leaves a core idle while the last reference runs, six).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence


@dataclass
class Job:
    """One run: its name, the command that makes it, and the job it waits for."""

    name: str
    argv: List[str]
    after: Optional[str] = None
    log: Optional[Path] = None
    started: float = field(default=0.0, compare=False)


def pick_next(queue: Sequence[Job], finished: set) -> Optional[Job]:
    """The first job of ``queue`` whose dependency has finished (or that has none)."""
    return next((j for j in queue if j.after is None or j.after in finished), None)


def usable_cores(workers: int) -> List[int]:
    """``workers`` cores of this process's affinity set (one per worker)."""
    cores = sorted(os.sched_getaffinity(0))
    if workers > len(cores):
        raise SystemExit(f"--workers {workers}: this process may use {len(cores)} core(s) ({cores})")
    return cores[:workers]


def run_jobs(jobs: Sequence[Job], workers: int, log: Callable[[str], None] = print) -> Dict[str, float]:
    """Run ``jobs`` on ``workers`` cores, each child pinned to one core with one thread.

    Returns each job's wall seconds. A job that exits non-zero stops the scheduling (the
    running ones are waited for) and raises ``SystemExit`` naming it and its log; runs that
    finished stay in the experiment's cache, so a re-run resumes.
    """
    names = {j.name for j in jobs}
    missing = sorted({j.after for j in jobs if j.after is not None} - names)
    if missing:
        raise ValueError(f"jobs wait for unknown jobs: {missing}")
    cores = usable_cores(workers)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    queue = list(jobs)
    running: Dict[int, tuple] = {}  # core -> (job, process, log file)
    finished: set = set()
    seconds: Dict[str, float] = {}
    failed: Optional[Job] = None
    t0 = time.perf_counter()
    while queue or running:
        for core in cores:
            if core in running or failed is not None:
                continue
            job = pick_next(queue, finished)
            if job is None:
                break
            queue.remove(job)
            out = open(job.log, "w") if job.log else subprocess.DEVNULL
            job.started = time.perf_counter()
            proc = subprocess.Popen(
                job.argv, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=lambda c=core: os.sched_setaffinity(0, {c})
            )
            running[core] = (job, proc, out)
            log(f"[{time.perf_counter() - t0:6.0f} s] core {core}: {job.name} started")
        if not running:
            if failed is not None or queue:
                break
            continue
        time.sleep(1.0)
        for core, (job, proc, out) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[core]
            if out is not subprocess.DEVNULL:
                out.close()
            seconds[job.name] = time.perf_counter() - job.started
            if proc.returncode != 0:
                failed = failed or job
                log(f"[{time.perf_counter() - t0:6.0f} s] core {core}: {job.name} FAILED (exit {proc.returncode})")
            else:
                finished.add(job.name)
                log(f"[{time.perf_counter() - t0:6.0f} s] core {core}: {job.name} done in {seconds[job.name]:.0f} s")
    if failed is not None:
        raise SystemExit(f"run {failed.name} failed" + (f"; its log: {failed.log}" if failed.log else ""))
    if queue:  # only reachable if a dependency can never finish
        raise SystemExit(f"runs never started: {[j.name for j in queue]}")
    return seconds


def python_argv(script: Path, args: Sequence[str]) -> List[str]:
    """The command that runs ``script`` with this interpreter."""
    return [sys.executable, str(script), *args]
