"""Hand-written verifier pool (rllib_exgrpo/envs/verifier_pool.py) versus a pebble ``ProcessPool``, measured.

A review asked whether ``pebble.ProcessPool`` (per-task ``timeout``; an overrunning
worker is terminated and replaced) could replace the hand-written pool in
``rllib_exgrpo/envs/verifier_pool.py``. This script answers by measurement. The pebble candidate
(:class:`PebblePool`) is plugged in *behind the same caller code* (answer extraction,
exact-match fast path, de-duplication, stats, :class:`rllib_exgrpo.envs.rewards.RewardResult`), so
only the process pool differs between backends:

* ``current``          -- rllib_exgrpo/envs/verifier_pool.py as it is (subprocess workers).
* ``pebble:fork``      -- pebble, fork start method (Linux default on Python <= 3.13),
* ``pebble:spawn``     -- pebble, spawn,
* ``pebble:forkserver``-- pebble, forkserver (the default from Python 3.14),
  each with the workarounds a faithful port needs: a worker initializer that imports
  math-verify with its signal timeouts off, restores SIGTERM's default action (pebble's
  own SIGTERM handler is Python code, which cannot run while sympy holds the GIL, so
  every kill would otherwise wait pebble's 3 s SIGKILL grace period) and sets the
  parent-death signal; the pool is started from one long-lived thread (the parent-death
  signal follows the *thread* that forked); a pool that pebble declares broken is
  rebuilt and the unfinished items resubmitted; an item whose worker died is retried once.
* ``pebble:fork:stock``-- pebble as documented, without those workarounds (hang case only).

Every scenario runs in a fresh interpreter and prints one JSON line; the summary table
comes at the end. Scenarios: ``paired`` (the workloads of benchmarks/reward_throughput.py,
backends alternated workload by workload inside one process, so that a busy machine
slows them alike; median of per-round ratios), ``throughput`` (reward_throughput.py
itself, one fresh interpreter per backend and round; noisy on a shared machine),
``hang`` (13-item batch with one ``9^{9^{9^{9^9}}}``, 2 s timeout, then a thread-pool
variant), ``ray`` (actor with max_concurrency=4: 4 concurrent batches, singles, a hang;
worker processes left over after ``ray.shutdown()``), ``mp_daemon`` / ``mp_plain``
(multiprocessing children, fork and spawn: scores and whether the child exits),
``os_fork`` (a raw ``os.fork()`` child scores and exits normally; is the parent's pool
intact?), ``atexit`` (normal exit with a hang in flight: exit time, orphans),
``parent_death`` (SIGKILL the caller while a worker hangs: orphans), ``killed``
(every worker SIGKILLed from outside, then a batch).

Usage: python experiments/reward_pool_compare.py [--backends current,pebble:fork,...]
           [--scenarios throughput,hang,...] [--throughput-limit 500] [--repeat 3] [--only arithmetic]
Needs ``pip install pebble`` for the pebble backends.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rllib_exgrpo.envs import rewards, verifier_pool  # noqa: E402

HANG = "\\boxed{9^{9^{9^{9^9}}}}"
CASES = [  # (completion, ground truth, expected score), through math-verify
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{3}", "0.5", 0.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{(3, \\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{4.666}", "\\frac{14}{3}", 0.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{\\sqrt{3}/2}", "\\frac{\\sqrt{3}}{2}", 1.0),
]
SCENARIOS = ("paired", "hang", "ray", "mp_daemon", "mp_plain", "os_fork", "atexit", "parent_death", "killed")
BACKENDS = ("current", "pebble:fork", "pebble:spawn", "pebble:forkserver", "pebble:fork:stock")


# --------------------------------------------------------------------------- pebble candidate: worker side

_VERIFY = None


def _pebble_init(parent_pid: Optional[int], stock: bool) -> None:
    """Worker initializer: what rllib_exgrpo.envs.verifier_pool._worker_main does before its loop."""
    global _VERIFY
    if not stock:
        # pebble's worker installs a Python SIGTERM handler; a worker stuck in sympy's C
        # code never runs it, so terminate() would only bite after pebble's 3 s grace.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        verifier_pool._set_parent_death_signal(parent_pid if parent_pid is not None else os.getppid())
    verify_one = rewards.make_verifier()
    verify_one("1", "\\boxed{1}")
    _VERIFY = verify_one


def _pebble_verify(gt: str, pred_text: str):
    try:
        return _VERIFY(gt, pred_text)
    except BaseException as exc:  # noqa: BLE001 - reported, not hidden
        return False, None, f"{type(exc).__name__}: {str(exc)[:200]}", 0


def _pebble_ready(delay: float) -> int:
    time.sleep(delay)
    return os.getpid()


# --------------------------------------------------------------------------- pebble candidate: caller side


class _Starter:
    """One long-lived thread per process that starts pools (PR_SET_PDEATHSIG follows the
    forking *thread*; pebble forks its first workers from whichever thread calls first)."""

    def __init__(self):
        import queue

        self._q: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._run, name="pebble-starter", daemon=True).start()

    def _run(self):
        while True:
            fn, fut = self._q.get()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001
                fut.set_exception(exc)

    def call(self, fn):
        fut: cf.Future = cf.Future()
        self._q.put((fn, fut))
        return fut.result()


_STARTER: Optional[_Starter] = None
_STARTER_PID = -1


def _stop_pebble(pp, owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked copy: those workers are the parent's
        return
    pp.stop()
    try:
        pp.join(timeout=10)
    except Exception:  # noqa: BLE001
        pass


class PebblePool:
    """Drop-in for ``rllib_exgrpo.envs.verifier_pool._Pool`` (size, pid, grow_to, warm, run, close) on pebble."""

    method = "fork"
    stock = False

    def __init__(self, size: int):
        import multiprocessing

        self.size = size
        self.pid = os.getpid()
        self._all: tuple = ()  # rllib_exgrpo.envs.verifier_pool._after_fork_in_child iterates this
        self._lock = threading.Lock()
        self._pp = None
        self._pp_size = 0
        self._closed = False
        self._ctx = multiprocessing.get_context(self.method)

    def _new_pebble(self):
        import pebble

        global _STARTER, _STARTER_PID
        parent = None if self.method == "forkserver" else os.getpid()
        pp = pebble.ProcessPool(max_workers=self.size, initializer=_pebble_init, initargs=(parent, self.stock), context=self._ctx)
        if self.stock:
            pp.active  # noqa: B018 - starts the pool from this thread, as plain use does
        else:
            if _STARTER is None or _STARTER_PID != os.getpid():
                _STARTER, _STARTER_PID = _Starter(), os.getpid()
            _STARTER.call(lambda: pp.active)
        if not self.stock:
            # A multiprocessing child joins its non-daemonic children (pebble's workers) on
            # exit without running atexit: stop the pool from a multiprocessing finalizer.
            import multiprocessing.util as mpu

            mpu.Finalize(None, _stop_pebble, args=(pp, os.getpid()), exitpriority=100)
        verifier_pool.count(worker_starts=self.size)
        return pp

    def _pebble(self):
        with self._lock:
            if self._closed:
                raise RuntimeError("the math-verify worker pool was shut down during this call")
            if self._pp is None or not self._pp.active or self._pp_size < self.size:
                old, self._pp = self._pp, None
                if old is not None:
                    old.stop()
                self._pp, self._pp_size = self._new_pebble(), self.size
            return self._pp

    def worker_pids(self) -> list:
        pp = self._pp
        return [] if pp is None else list(pp._pool_manager.worker_manager.workers)

    def grow_to(self, size: int) -> None:
        with self._lock:
            self.size = max(self.size, size)

    def warm(self, n: int) -> None:
        pp = self._pebble()
        futs = [pp.schedule(_pebble_ready, args=(0.2,)) for _ in range(min(n, self.size))]
        cf.wait(futs, timeout=rewards.BOOT_TIMEOUT_S)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pp, self._pp = self._pp, None
        if pp is not None:
            _stop_pebble(pp, self.pid)

    def run(self, tasks: Sequence[tuple], timeout_s: float, max_parallel: int) -> list:
        from pebble import ProcessExpired

        results: list = [None] * len(tasks)
        pending = list(range(len(tasks)))[::-1]
        retried: set = set()
        active: dict = {}
        swallowed = 0
        rebuilds = 0
        # pebble itself runs at most `size` tasks at once: when the caller may use the whole
        # pool, queue everything (no round trip through our thread between two items).
        window = len(tasks) if max_parallel >= self.size else max_parallel
        while pending or active:
            while pending and len(active) < window:
                idx = pending.pop()
                try:
                    fut = self._pebble().schedule(_pebble_verify, args=tasks[idx], timeout=timeout_s)
                except RuntimeError:
                    if self._closed:
                        raise
                    pending.append(idx)  # pool went into ERROR between the check and here
                    rebuilds += 1
                    if rebuilds > 3:
                        raise
                    continue
                active[fut] = idx
            done, _ = cf.wait(list(active), return_when=cf.FIRST_COMPLETED)
            for fut in done:
                idx = active.pop(fut)
                exc = fut.exception()
                if exc is None:
                    ok, parsed, error, n_sw = fut.result()
                    swallowed += n_sw
                    results[idx] = (ok, parsed, error, False)
                elif isinstance(exc, cf.TimeoutError):
                    verifier_pool.count(worker_kills=1)
                    results[idx] = (False, None, None, True)
                elif isinstance(exc, (ProcessExpired, cf.process.BrokenProcessPool)) and idx not in retried:
                    verifier_pool.count(worker_deaths=1, retries=1)
                    retried.add(idx)
                    pending.append(idx)
                else:
                    results[idx] = (False, None, f"{type(exc).__name__}: {str(exc)[:200]}", False)
        if swallowed:
            verifier_pool.count(swallowed_exceptions=swallowed)
        return results


_CURRENT_POOL = verifier_pool._Pool


def install(backend: str) -> None:
    """Make ``rllib_exgrpo.envs.rewards`` use ``backend`` for every later call in this process."""
    if backend == "current":
        rewards.shutdown_workers()
        verifier_pool._Pool = _CURRENT_POOL
        return
    kind, method, *flags = backend.split(":")
    assert kind == "pebble", backend
    PebblePool.method, PebblePool.stock = method, "stock" in flags
    rewards.shutdown_workers()
    verifier_pool._Pool = PebblePool  # _pool() builds the pool from this name


def worker_pids() -> list:
    pool = verifier_pool._POOL
    if pool is None:
        return []
    if isinstance(pool, PebblePool):
        return pool.worker_pids()
    with pool._lock:
        return [w.proc.pid for w in pool._all]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_gone(pids, seconds: float = 10.0) -> list:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


# --------------------------------------------------------------------------- scenarios (run in a fresh interpreter)


def _scores(results):
    return [r.score for r in results]


def sc_throughput(backend: str, limit: int) -> dict:
    import contextlib
    import io

    sys.path.insert(0, str(REPO / "benchmarks"))
    import reward_throughput

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        reward_throughput.main(["--limit", str(limit)])
    lines = buf.getvalue().splitlines()
    out = {}
    for line in lines:
        head, _, rest = line.partition(":")
        if "/s" in rest:
            out[head.strip()] = float(rest.split("/s")[0].split()[-1])
        elif head.startswith("pool"):
            out["pool start s"] = float(rest.split("started in")[1].split()[0])
    out["stats"] = rewards.reward_stats()
    out["raw"] = lines
    return out


def _workloads(limit: int) -> dict:
    """The workloads of benchmarks/reward_throughput.py: name -> (calls, answers)."""
    from rllib_exgrpo.envs import arithmetic
    from rllib_exgrpo.envs.datasets import load_problems

    out = {}
    math500 = REPO.parent / "shared" / "data" / "simplerl_eval" / "math500_test.jsonl"
    if math500.exists():
        truths = [p.ground_truth for p in load_problems(math500, strict=True)][:limit]
        wrong = [
            next(truths[(i + j) % len(truths)] for j in range(1, len(truths)) if truths[(i + j) % len(truths)].strip() != t.strip())
            for i, t in enumerate(truths)
        ]
        for label, answers in (("correct", truths), ("incorrect", wrong)):
            comps = [f"The answer is \\boxed{{{a}}}." for a in answers]
            out[f"math500 {label} batched"] = ([(comps, truths, False)], len(comps))
            out[f"math500 {label} single"] = ([([c], [t], False) for c, t in zip(comps, truths)], len(comps))
    problems = arithmetic.generate(2560, seed=0, levels=(1, 2, 3, 4))
    steps = [problems[i : i + 256] for i in range(0, len(problems), 256)]

    def step_data(step, k):
        comps = [
            p.solution if (i + k) % 2 == 0 else p.solution.replace(f"\\boxed{{{p.ground_truth}}}", f"\\boxed{{{int(p.ground_truth) + 1}}}")
            for i, p in enumerate(step)
        ]
        return comps, [p.ground_truth for p in step]

    for fast in (True, False):
        out[f"arithmetic 256/step batched fast_path={fast}"] = ([(*step_data(st, k), fast) for k, st in enumerate(steps)], 2560)
    comps, truths = step_data(steps[0], 0)
    out["arithmetic single, fast_path=False"] = ([([c], [t], False) for c, t in zip(comps, truths)], 256)
    return out


def sc_paired(backends: Sequence[str], limit: int, rounds: int, only: str = "") -> dict:
    """Throughput, backends alternated workload by workload in one process, each timed run
    on a freshly started pool (cold math-verify caches, as reward_throughput.py does): a
    busy machine then slows every backend alike, and the median of the per-round ratios
    against ``current`` is what to read."""
    work = {k: v for k, v in _workloads(limit).items() if only in k}
    rates: dict = {name: {b: [] for b in backends} for name in work}
    for _ in range(rounds):
        for name, (calls, n) in work.items():
            for b in backends:
                install(b)
                rewards.warm_up()
                start = time.perf_counter()
                for comps, truths, fast in calls:
                    if len(comps) == 1:
                        rewards.math_reward(comps[0], truths[0], fast_path=fast)
                    else:
                        rewards.score_batch(comps, truths, fast_path=fast)
                rates[name][b].append(n / (time.perf_counter() - start))
    rewards.shutdown_workers()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    out = {}
    for name, per in rates.items():
        row = {b: round(med(v), 1) for b, v in per.items()}
        for b in backends:
            if b != "current" and "current" in per:
                row[f"{b} / current"] = round(med([x / y for x, y in zip(per[b], per["current"])]), 3)
        out[name] = row
    return out


def sc_hang(backend: str) -> dict:
    rewards.warm_up()
    completions = [HANG] + [f"\\boxed{{{i}.0}}" for i in range(12)]
    truths = ["5"] + [str(i if i % 3 else i + 1) for i in range(12)]
    kills = rewards.reward_stats().get("worker_kills", 0)
    start = time.monotonic()
    res = rewards.score_batch(completions, truths, timeout_s=2.0)
    wall = time.monotonic() - start
    others_ok = _scores(res[1:]) == [0.0 if i % 3 == 0 else 1.0 for i in range(12)] and not any(r.timed_out or r.error for r in res[1:])
    kills = rewards.reward_stats().get("worker_kills", 0) - kills
    after = rewards.math_reward("\\boxed{0.5}", "\\frac{1}{2}", fast_path=False)
    # thread-pool variant (as tests/test_rewards.py): 4 threads, math_reward each
    rewards.warm_up()
    jobs = [(HANG, "5")] + [(f"\\boxed{{{i}}}", str(i)) for i in range(6)]
    start = time.monotonic()
    with cf.ThreadPoolExecutor(max_workers=4) as tp:
        tres = list(tp.map(lambda a: rewards.math_reward(*a, timeout_s=1.5, fast_path=False), jobs))
    twall = time.monotonic() - start
    return {
        "batch wall s (2 s timeout)": round(wall, 2),
        "hang timed_out, no error": bool(res[0].timed_out and res[0].score == 0.0 and res[0].error is None),
        "others scored right": others_ok,
        "kills": kills,
        "recovered": after.score == 1.0 and after.error is None,
        "threads wall s (1.5 s timeout)": round(twall, 2),
        "threads ok": bool(tres[0].timed_out and _scores(tres[1:]) == [1.0] * 6),
    }


def sc_ray(backend: str) -> dict:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})

    @ray.remote(max_concurrency=4)
    class Scorer:
        def __init__(self, backend):
            from experiments import reward_pool_compare as c

            c.install(backend)
            self.c = c

        def score(self, completions, truths):
            from rllib_exgrpo.envs.rewards import score_batch

            return [r.score for r in score_batch(completions, truths, fast_path=False)]

        def one(self, completion, truth):
            from rllib_exgrpo.envs.rewards import math_reward

            return math_reward(completion, truth, fast_path=False).score

        def timed(self, completions, truths, timeout_s):
            from rllib_exgrpo.envs.rewards import score_batch

            start = time.monotonic()
            out = score_batch(completions, truths, timeout_s=timeout_s)
            return time.monotonic() - start, [(r.score, r.timed_out, r.error) for r in out]

        def pids(self):
            return os.getpid(), self.c.worker_pids()

    out: dict = {}
    try:
        pids = _probe_ray_scorer(ray, Scorer.remote(backend), out)
    except Exception as exc:  # noqa: BLE001 - the finding
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        pids = []
    ray.shutdown()
    out["orphans after ray.shutdown"] = len(wait_gone(pids))
    return out


def _probe_ray_scorer(ray, actor, out: dict) -> list:
    """The findings of the scorer actor into ``out`` as they come (concurrent batches, single
    calls, the steady-state rate, a hang under its timeout); returns its worker pids."""
    comps, truths, expected = [c for c, _, _ in CASES], [t for _, t, _ in CASES], [e for _, _, e in CASES]
    start = time.monotonic()
    batches = ray.get([actor.score.remote(comps, truths) for _ in range(4)], timeout=180)
    out["4 concurrent batches ok"] = all(b == expected for b in batches)
    out["first batches s"] = round(time.monotonic() - start, 2)
    singles = ray.get([actor.one.remote(c, t) for c, t in zip(comps, truths)], timeout=180)
    out["singles ok"] = singles == expected
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < 3.0:  # steady-state rate through the actor
        ray.get([actor.score.remote(comps, truths) for _ in range(4)], timeout=60)
        n += 4 * len(comps)
    out["actor answers/s"] = round(n / (time.monotonic() - start), 1)
    elapsed, verdicts = ray.get(actor.timed.remote([HANG, "\\boxed{2.0}"], ["5", "2"], 1.5), timeout=60)
    out["hang wall s (1.5 s timeout)"] = round(elapsed, 2)
    out["hang verdicts ok"] = [(s, t) for s, t, _ in verdicts] == [(0.0, True), (1.0, False)]
    actor_pid, pids = ray.get(actor.pids.remote(), timeout=30)
    out["worker pids"] = len(pids)
    return pids


def _child_score(q):
    rewards.warm_up()
    q.put(_scores(rewards.score_batch(["\\boxed{0.5}", "\\boxed{2}", HANG], ["\\frac{1}{2}", "3", "1"], timeout_s=1.0, fast_path=False)))


def _child_entry(backend, q):
    install(backend)
    try:
        _child_score(q)
    except BaseException as exc:  # noqa: BLE001
        q.put(f"{type(exc).__name__}: {str(exc)[:200]}")


def _sc_mp(backend: str, daemon: bool) -> dict:
    import multiprocessing

    rewards.warm_up()  # the parent has a pool too
    out = {}
    for method in ("fork", "spawn"):
        ctx = multiprocessing.get_context(method)
        q = ctx.Queue()
        child = ctx.Process(target=_child_entry, args=(backend, q), daemon=daemon)
        start = time.monotonic()
        child.start()
        try:
            got = q.get(timeout=60)
        except Exception as exc:  # noqa: BLE001
            got = f"no answer: {type(exc).__name__}"
        child.join(15)
        exited = not child.is_alive()
        if not exited:
            child.kill()
            child.join()
        out[method] = {"result": got, "ok": got == [1.0, 0.0, 0.0], "child exited": exited, "s": round(time.monotonic() - start, 2)}
    parent = rewards.math_reward("\\boxed{0.5}", "\\frac{1}{2}", fast_path=False)
    out["parent still ok"] = parent.score == 1.0 and parent.error is None
    return out


def sc_mp_daemon(backend: str) -> dict:
    return _sc_mp(backend, daemon=True)


def sc_mp_plain(backend: str) -> dict:
    return _sc_mp(backend, daemon=False)


def sc_os_fork(backend: str) -> dict:
    rewards.warm_up()
    before = worker_pids()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: score, then a *normal* interpreter exit (atexit handlers run)
        os.close(r)
        try:
            got = _scores(rewards.score_batch(["\\boxed{0.5}", "\\boxed{2}"], ["\\frac{1}{2}", "3"], fast_path=False))
        except BaseException as exc:  # noqa: BLE001
            got = f"{type(exc).__name__}: {exc}"
        os.write(w, json.dumps(got).encode())
        os.close(w)
        sys.stdout.flush()
        sys.exit(0)
    os.close(w)
    child_got = json.loads(os.fdopen(r).read() or "null")
    os.waitpid(pid, 0)
    time.sleep(0.5)
    survivors = [p for p in before if alive(p)]
    res = rewards.score_batch(["\\boxed{0.5}", "\\boxed{2}"], ["\\frac{1}{2}", "3"], fast_path=False)
    return {
        "child ok": child_got == [1.0, 0.0],
        "child result": child_got,
        "parent workers surviving child exit": f"{len(survivors)}/{len(before)}",
        "parent ok after": _scores(res) == [1.0, 0.0] and all(x.error is None for x in res),
        "parent errors": [x.error for x in res if x.error],
    }


_ATEXIT_CHILD = """
import sys, threading, time
sys.path.insert(0, {repo!r})
from experiments import reward_pool_compare as c
c.install({backend!r})
from rllib_exgrpo.envs import rewards
rewards.warm_up()
threading.Thread(target=rewards.score_batch, args=([{hang!r}], ['5']), kwargs={{'timeout_s': 600}}, daemon=True).start()
time.sleep(1.0)
print(' '.join(map(str, c.worker_pids())), flush=True)
{tail}
"""


def _child(backend: str, tail: str):
    code = _ATEXIT_CHILD.format(repo=str(REPO), backend=backend, hang=HANG, tail=tail)
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)


def sc_atexit(backend: str) -> dict:
    proc = _child(backend, "sys.exit(0)")
    pids = [int(x) for x in proc.stdout.readline().split()]
    start = time.monotonic()  # the child calls sys.exit(0) right after printing the pids
    try:
        proc.wait(30)
        exit_s = round(time.monotonic() - start, 2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        exit_s = "hung > 30 s (killed)"
    return {"exit s": exit_s, "returncode": proc.returncode, "workers": len(pids), "orphans": len(wait_gone(pids))}


def sc_parent_death(backend: str) -> dict:
    proc = _child(backend, "time.sleep(600)")
    pids = [int(x) for x in proc.stdout.readline().split()]
    proc.kill()
    proc.wait()
    left = wait_gone(pids)
    for p in left:  # clean up what the backend left behind
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"workers": len(pids), "orphans 10 s after SIGKILL": len(left)}


def sc_killed(backend: str) -> dict:
    rewards.warm_up()
    victims = worker_pids()
    for p in victims:
        os.kill(p, signal.SIGKILL)
    time.sleep(0.5)
    try:
        res = rewards.score_batch(["\\boxed{0.5}", "\\boxed{2}"], ["\\frac{1}{2}", "3"], fast_path=False)
        out = {"ok": _scores(res) == [1.0, 0.0] and all(r.error is None for r in res), "errors": [r.error for r in res if r.error]}
    except Exception as exc:  # noqa: BLE001
        out = {"ok": False, "raised": f"{type(exc).__name__}: {str(exc)[:200]}"}
    out["killed"] = len(victims)
    return out


# --------------------------------------------------------------------------- driver


def _run_one(backend: str, scenario: str, limit: int, timeout: float = 300) -> dict:
    cmd = [sys.executable, __file__, "--one", backend, scenario, "--throughput-limit", str(limit)]
    try:
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"scenario did not finish in {timeout} s"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": f"rc={out.returncode}: {out.stderr.strip()[-400:]}"}


def _parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--throughput-limit", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds of the throughput scenario")
    ap.add_argument("--only", default="", help="paired: only workloads whose name contains this")
    ap.add_argument("--one", nargs=2, metavar=("BACKEND", "SCENARIO"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _run_paired(args, backends: Sequence[str]) -> None:
    """The paired throughput scenario in a child process (every non-stock backend in
    alternated rounds); prints its median answers per second."""
    t0 = time.monotonic()
    cmd = [
        sys.executable,
        __file__,
        "--one",
        ",".join(b for b in backends if not b.endswith(":stock")),
        "paired",
        "--throughput-limit",
        str(args.throughput_limit),
        "--repeat",
        str(args.repeat),
        "--only",
        args.only,
    ]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("{")), None)
    if line is None:
        print(f"paired: rc={out.returncode} {out.stderr[-400:]}")
        return
    print(
        f"\npaired throughput, answers/s, median of {args.repeat} alternated rounds "
        f"({time.monotonic() - t0:.0f} s, load now {os.getloadavg()[0]:.1f})"
    )
    for name, row in json.loads(line).items():
        print(f"  {name:42s} " + "  ".join(f"{k}: {v}" for k, v in row.items()))


def _print_rounds(scenario: str, runs: dict, rounds: int, backends: Sequence[str]) -> None:
    """Per metric, each backend's median (and best) answers per second over the rounds."""
    print(f"\n{scenario}: answers/s over {rounds} interleaved rounds, median (best)")
    metrics = [k for k in next(iter(v for v in runs.values() if v))[0] if k != "pool start s"]
    print(f"{'':52s}" + "".join(f"{b:>20s}" for b in backends if runs[b]))
    for m in metrics:
        cells = []
        for b in backends:
            vals = sorted(x[m] for x in runs[b] if m in x)
            if vals:
                cells.append(f"{vals[len(vals) // 2]:>11.0f} ({vals[-1]:>5.0f})")
        print(f"{m:52s}" + "".join(f"{c:>20s}" for c in cells))


def main(argv=None) -> None:
    args = _parse_args(argv)

    if args.one:
        backend, scenario = args.one
        if scenario == "paired":
            print(json.dumps(sc_paired(backend.split(","), args.throughput_limit, args.repeat, args.only)), flush=True)
            return
        install(backend)
        fn = globals()[f"sc_{scenario}"]
        out = fn(backend, args.throughput_limit) if scenario == "throughput" else fn(backend)
        print(json.dumps(out), flush=True)
        return

    backends = args.backends.split(",")
    for scenario in args.scenarios.split(","):
        if scenario == "paired":
            _run_paired(args, backends)
            continue
        rounds = args.repeat if scenario == "throughput" else 1
        runs: dict = {b: [] for b in backends}
        for r in range(rounds):  # interleaved, so a busy machine hurts every backend alike
            for backend in backends:
                if backend.endswith(":stock") and scenario not in ("hang", "parent_death"):
                    continue
                t0 = time.monotonic()
                res = _run_one(backend, scenario, args.throughput_limit)
                res.pop("raw", None)
                res.pop("stats", None)
                runs[backend].append(res)
                load = os.getloadavg()[0]
                print(f"{scenario:12s} {backend:18s} ({time.monotonic() - t0:5.1f} s, load {load:.1f}) {json.dumps(res)}", flush=True)
        if rounds > 1:
            _print_rounds(scenario, runs, rounds, backends)


if __name__ == "__main__":
    main()
