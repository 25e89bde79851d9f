"""The verifier pool: math-verify and reward-function calls in worker processes, with deadlines.

Why this module is more than ``verify(parse(gt), parse(answer))``:

* math-verify bounds its own work with ``signal.alarm``. Off the main thread (thread
  pools, Ray actors with ``max_concurrency > 1``) that raises ``ValueError``, and a
  ``try/except`` around it silently turns every reward into 0 (a real verl bug).
* A signal cannot stop a hang in C code anyway: sympy evaluating ``9^{9^{9^{9^9}}}``
  holds the GIL inside big-integer arithmetic and never returns.

So every math-verify call runs in a small pool of persistent worker *processes*
(plain ``subprocess`` children, so the scheme also works inside daemonic
multiprocessing workers and Ray actors, and never re-imports the caller's ``__main__``).
Each worker runs parse/verify in its own main thread with math-verify's timeouts
disabled; the caller enforces a wall-clock deadline per item and kills and replaces a
worker that overruns. Only the overrunning item times out; the other items of the batch
go on on the other workers. Reward-function calls (``"package.module:function"``, see
:func:`load_function`) run in the same workers under the same deadlines. Genuine failures
(a worker that dies, an exception in the verifier or a reward function, an unparseable
ground truth) come back as the task's error and are counted in :func:`reward_stats`, never
turned into a silent 0.

Why not ``pebble.ProcessPool`` (per-task timeout, kills and replaces an overrunning
worker)? Measured with ``experiments/reward_pool_compare.py`` (pebble 5.2.3, same caller
code, only the pool swapped): it cannot start workers inside a daemonic multiprocessing
worker at all ("daemonic processes are not allowed to have children", every start
method), which this module supports. Where it does work, it matched this pool on hangs
(2.0 s for a 2 s timeout, the neighbours scored) and in a Ray actor, and throughput was
the same within the noise of a shared 2-core machine. But a faithful port needed the
same machinery this pool has anyway: a worker initializer (math-verify timeouts off,
parent-death signal; without it a hung worker outlives a SIGKILLed caller), a long-lived
starter thread, a multiprocessing finalizer (else a non-daemonic multiprocessing child
never exits, as multiprocessing joins pebble's workers), rebuilding a pool pebble
declares broken, a retry for an item whose worker died. And a raw ``os.fork()`` child
that exits normally SIGTERMs one of the parent's pebble workers from pebble's atexit
hook. So the hand-written pool stays.

The reward API on top of this pool (answer extraction, the exact-match fast path,
de-duplication, the built-in reward functions, :class:`~rllib_exgrpo.envs.rewards.RewardResult`)
is :mod:`rllib_exgrpo.envs.rewards`.

This file must stay importable as a bare script with the standard library only: each
worker loads it by path (a worker needs neither the package nor the caller's folder on its
path; math-verify is imported in the worker, by :func:`make_verifier`).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import importlib
import inspect
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from multiprocessing.connection import Connection, wait as _wait_conns
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

#: Environment variable that overrides the default number of verifier processes.
WORKERS_ENV = "ENVS_REWARD_WORKERS"
#: Default cap on verifier processes per calling process (several env runners may share
#: a node; eight processes verify thousands of short answers per second).
MAX_DEFAULT_WORKERS = 8
#: How long a fresh worker may take to import math-verify before we call it broken.
BOOT_TIMEOUT_S = 120.0
#: Longest ``parsed`` string (or reason) carried back from a worker.
_MAX_REPR = 200
#: Tag of a reward-function task on the worker protocol (a math task is (gt, answer text)):
#: ``(FN_TASK, "package.module:function", kwargs, caller's sys.path)``.
FN_TASK = "\x00reward_fn"


# --------------------------------------------------------------------------- reward-function loading


def one_line(x) -> str:
    """``str(x)`` on one line, at most 200 characters."""
    return " ".join(str(x).split())[:_MAX_REPR]


def load_function(spec: str):
    """``(function, accepted keyword names or None for **kwargs)`` of ``"package.module:function"``
    (``function`` may be dotted: ``module:Class.method``).

    Raises ValueError with a one-line reason (no module, no attribute, not callable, no
    ``completion`` keyword).
    """
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError("expected 'package.module:function'")
    module_name, attr = spec.split(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to see
        raise ValueError(f"{type(exc).__name__}: {one_line(exc)}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{attr!r} is a {type(obj).__name__}, not a function")
    return obj, _accepted_keywords(obj)


def _accepted_keywords(fn) -> Optional[frozenset]:
    """The keyword names ``fn`` accepts, or None when it takes ``**kwargs`` (or has no
    introspectable signature: everything is passed). Raises ValueError without a
    ``completion`` keyword."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    accepted = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    if "completion" not in accepted:
        raise ValueError(f"the function takes no 'completion' keyword argument (signature {one_line(inspect.signature(fn))})")
    return accepted


def caller_path() -> tuple:
    """This process's import path for the workers (``''`` is the current folder)."""
    return tuple(os.path.abspath(p) if p else os.getcwd() for p in sys.path if isinstance(p, str))


# --------------------------------------------------------------------------- worker side

_FN_CACHE: dict = {}


def _call_reward_fn(spec: str, kwargs: dict, path: Sequence[str]):
    """Run one reward-function call in a worker: its float score, or a one-line reason
    (a str) when it could not be imported or returned no finite number. An exception
    propagates (the worker loop reports it). ``path``: the caller's import path."""
    entry = _FN_CACHE.get(spec)
    if entry is None:
        for p in path:  # after our own entries: real packages are not shadowed
            if p not in sys.path:
                sys.path.append(p)
        try:
            entry = load_function(spec)
        except ValueError as exc:
            return f"cannot import {spec!r}: {exc}"
        _FN_CACHE[spec] = entry
    fn, accepted = entry
    if accepted is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    value = fn(**kwargs)
    if value is None or isinstance(value, (str, bytes)):
        return f"returned {type(value).__name__}, not a number"
    try:
        score = float(value)
    except (TypeError, ValueError):
        return f"returned {type(value).__name__}, not a number"
    if not math.isfinite(score):
        return f"returned {score}, not a finite number"
    return score


def _set_parent_death_signal(parent_pid: int) -> None:
    """Die with the parent even while stuck in C code (Linux; elsewhere best effort)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:  # pragma: no cover - exotic libc
            pass
    if os.getppid() != parent_pid:  # parent already gone before prctl took effect
        os._exit(0)


class _CapturedErrors(logging.Handler):
    """Collects the exceptions math-verify swallows and logs at debug level."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            self.messages.append(f"{type(exc).__name__}: {str(exc)[:_MAX_REPR]}")


def make_verifier():
    """``verify_one(ground_truth, answer_text) -> (ok, parsed, error, swallowed)`` for this
    process: math-verify with its own signal timeouts off (the caller enforces deadlines),
    its log captured (``swallowed`` counts the errors it logged and hid), ground truths
    parsed once (cached). Runs in a verifier process, not in the caller.
    """
    import functools

    import math_verify.grader as mv_grader
    import math_verify.parser as mv_parser
    from math_verify import parse, verify

    # We disable math-verify's signal timeouts on purpose (the parent enforces
    # deadlines); silence its once-per-process warning about that.
    mv_parser.TIMEOUT_WARNING_SHOWN = True
    mv_grader.TIMEOUT_WARNING_SHOWN = True
    captured = _CapturedErrors()
    mv_logger = logging.getLogger("math_verify")
    mv_logger.handlers[:] = [captured]
    mv_logger.setLevel(logging.DEBUG)
    mv_logger.propagate = False

    @functools.lru_cache(maxsize=16384)
    def gold_of(gt: str):
        # "$gt$" is the official ExGRPO form; the others rescue ground truths that only
        # parse boxed or bare. A fallback chain, not a union: the bare parse of a latex
        # tuple such as "\left( 3, \frac{\pi}{2} \right)" is just "3".
        for text in ("$" + gt + "$", "\\boxed{" + gt + "}", gt):
            parsed = parse(text, parsing_timeout=None)
            if parsed:
                return parsed
        return []

    def answer_repr(pred) -> Optional[str]:
        # Only string elements: str() of a huge sympy object can itself hang.
        for item in pred:
            if isinstance(item, str):
                return item[:_MAX_REPR]
        return None

    def verify_one(gt: str, pred_text: str):
        captured.messages.clear()
        gold = gold_of(gt)
        if not gold:
            return False, None, f"ground truth could not be parsed by math-verify: {gt[:_MAX_REPR]!r}", 0
        pred = parse(pred_text, parsing_timeout=None)
        if not pred:
            return False, None, None, len(captured.messages)
        ok = bool(verify(gold, pred, timeout_seconds=None))
        return ok, answer_repr(pred), None, len(captured.messages)

    return verify_one


def _run_task(task: tuple, verify_one) -> tuple:
    """One task in a worker -> ``(ok, parsed, error, swallowed)``: a math task
    ``(gold text, answer text)`` through ``verify_one``, or a reward-function call
    ``(FN_TASK, spec, kwargs, caller's sys.path)`` whose ``ok`` is its score. An
    exception is reported as the error, never raised."""
    try:
        if len(task) == 4 and task[0] == FN_TASK:
            score = _call_reward_fn(task[1], task[2], task[3])
            if isinstance(score, str):  # not a score: the reason it failed
                return 0.0, None, score, 0
            return score, None, None, 0
        gt, pred_text = task
        return verify_one(gt, pred_text)
    except BaseException as exc:  # noqa: BLE001 - reported to the caller, not hidden
        return False, None, f"{type(exc).__name__}: {str(exc)[:_MAX_REPR]}", 0


def _worker_main(in_fd: int, out_fd: int, parent_pid: int) -> None:
    """Loop of a verifier process: receive (task id, *task), run it, send the verdict."""
    _set_parent_death_signal(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    # Keep the protocol pipe ours alone: stray prints from libraries go to stderr.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    inbox, outbox = Connection(in_fd, writable=False), Connection(out_fd, readable=False)

    verify_one = make_verifier()
    verify_one("1", "\\boxed{1}")  # import the lazy parts of sympy/antlr before "ready"
    outbox.send(("ready", os.getpid()))
    while True:
        try:
            msg = inbox.recv()
        except (EOFError, OSError):
            return
        try:
            outbox.send((msg[0], *_run_task(msg[1:], verify_one)))
        except (BrokenPipeError, OSError):
            return


_BOOT = (
    "import sys, importlib.util as u\n"
    # The caller's cwd may hold modules that shadow real packages: keep it off the path.
    "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"
    "s = u.spec_from_file_location('_envs_verifier_worker', sys.argv[1])\n"
    "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m)\n"
    "m._worker_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))\n"
)


# --------------------------------------------------------------------------- caller side

_STATS: Counter = Counter()
_STATS_LOCK = threading.Lock()


def count(**increments: int) -> None:
    with _STATS_LOCK:
        _STATS.update(increments)


def reward_stats() -> dict:
    """Counters of this process since import (or :func:`reset_reward_stats`).

    Keys: ``scored`` (results returned), ``fast_path`` (decided by exact match),
    ``verified`` (sent to math-verify, after de-duplication), ``timeouts``, ``errors``,
    ``swallowed_exceptions`` (exceptions math-verify caught internally while comparing,
    which it counts as "not equal" by design), ``worker_starts``, ``worker_kills``,
    ``worker_deaths`` (died without being killed by us), ``retries``; with reward
    functions (:func:`score_with_fns`) also ``fn_calls`` (calls sent to the workers),
    ``fn_errors`` (calls that raised or returned no number) and ``fn_timeouts`` (calls
    cut at the timeout), which are counted in ``errors`` and ``timeouts`` too.
    """
    with _STATS_LOCK:
        return dict(_STATS)


def reset_reward_stats() -> None:
    with _STATS_LOCK:
        _STATS.clear()


class _Worker:
    __slots__ = ("proc", "inbox", "outbox", "ready", "killed")

    def __init__(self, proc, inbox: Connection, outbox: Connection):
        self.proc, self.inbox, self.outbox = proc, inbox, outbox
        self.ready = False
        self.killed = False

    def kill(self) -> None:
        self.killed = True
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:  # pragma: no cover - already reaped
            pass
        for conn in (self.inbox, self.outbox):
            try:
                conn.close()
            except OSError:
                pass


class _Spawner:
    """Starts workers from one long-lived thread.

    Linux delivers the parent-death signal when the *thread* that started a child exits,
    so workers started from a short-lived caller thread would die with it.
    """

    def __init__(self):
        self._requests: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="envs-reward-spawner", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            fut = self._requests.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(self._start())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)

    @staticmethod
    def _start() -> _Worker:
        if not sys.executable:
            raise RuntimeError("cannot start math-verify workers: sys.executable is empty")
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, os.path.abspath(__file__), str(to_child_r), str(from_child_w), str(os.getpid())],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        count(worker_starts=1)
        return _Worker(proc, Connection(to_child_w, readable=False), Connection(from_child_r, writable=False))

    def spawn(self) -> _Worker:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._requests.put(fut)
        return fut.result()


_SPAWNER: Optional[_Spawner] = None
_SPAWNER_PID = -1
_SPAWNER_LOCK = threading.Lock()


def _spawner() -> _Spawner:
    """One spawner thread per process, for the life of the process (see :class:`_Spawner`)."""
    global _SPAWNER, _SPAWNER_PID
    with _SPAWNER_LOCK:
        if _SPAWNER is None or _SPAWNER_PID != os.getpid():  # threads do not survive fork
            _SPAWNER, _SPAWNER_PID = _Spawner(), os.getpid()
        return _SPAWNER


class _Pool:
    """Thread-safe set of verifier workers, checked out by callers one at a time."""

    def __init__(self, size: int):
        self.size = size
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._reserved = 0  # being spawned right now
        self._closed = False
        self._spawner = _spawner()

    # -- membership
    def _spawn_into_idle(self) -> None:
        try:
            w = self._spawner.spawn()
        except BaseException:
            with self._lock:
                self._reserved -= 1
                self._released.notify_all()
            raise
        with self._lock:
            self._reserved -= 1
            if not self._closed:
                self._all.add(w)
                self._idle.append(w)
                self._released.notify_all()
                return
        w.kill()  # the pool was shut down meanwhile

    def grow_to(self, size: int) -> None:
        with self._lock:
            self.size = max(self.size, size)

    def checkout(self) -> Optional[_Worker]:
        """A ready idle worker, else a booting one, else a new one, else None (all busy)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the math-verify worker pool was shut down during this call")
            for w in list(self._idle):
                if w.proc.poll() is not None:  # died while idle (killed from outside)
                    self._idle.remove(w)
                    self._all.discard(w)
                    count(worker_deaths=1)
                    w.kill()
            for w in self._idle:
                if w.ready:
                    self._idle.remove(w)
                    return w
            if self._idle:
                return self._idle.pop()
            if len(self._all) + self._reserved >= self.size:
                return None
            self._reserved += 1
        self._spawn_into_idle()
        return self.checkout()

    def release(self, w: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(w)
                self._released.notify_all()
                return
        w.kill()

    def discard(self, w: _Worker, *, replace: bool) -> None:
        w.kill()
        with self._lock:
            self._all.discard(w)
            replace = replace and not self._closed
            if replace:
                self._reserved += 1
        if replace:  # boot the successor now, while the rest of the batch goes on
            try:
                self._spawn_into_idle()
            except Exception:
                logger.exception("could not start a replacement math-verify worker")

    def wait_for_release(self, timeout: float) -> None:
        with self._lock:
            self._released.wait(timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all, self._idle = list(self._all), set(), []
        for w in workers:
            w.kill()

    def warm(self, n: int) -> None:
        """Start ``n`` workers (or up to the pool size) and wait until they are ready."""
        held = []
        try:
            while len(held) < n:
                w = self.checkout()
                if w is None:
                    break
                held.append(w)
            deadline = time.monotonic() + BOOT_TIMEOUT_S
            for w in held:
                if not w.ready:
                    if not w.outbox.poll(max(0.0, deadline - time.monotonic())):
                        raise RuntimeError("math-verify worker did not start in time")
                    try:
                        msg = w.outbox.recv()
                    except (EOFError, OSError):
                        raise RuntimeError(
                            f"a math-verify worker exited while starting (exit code {w.proc.poll()}); its stderr above says why"
                        ) from None
                    if msg[0] != "ready":  # pragma: no cover - protocol bug
                        raise RuntimeError(f"unexpected first message from worker: {msg!r}")
                    w.ready = True
        finally:
            for w in held:
                self.release(w)

    # -- the dispatch loop
    def run(self, tasks: Sequence[tuple], timeout_s: float, max_parallel: int) -> list[tuple]:
        """Verify ``tasks`` = [(ground truth, answer text)] -> [(ok, parsed, error, timed_out)],
        on at most ``max_parallel`` workers at once.

        A task may also be a reward-function call ``(FN_TASK, spec, kwargs, sys_path)``;
        its ``ok`` is then the function's float score.
        """
        batch = _Dispatch(self, tasks, timeout_s)
        try:
            while batch.pending or batch.active:
                batch.fill(max_parallel)
                if not batch.active:  # every worker is busy with other callers' batches
                    self.wait_for_release(0.05)
                    continue
                batch.receive()
                batch.expire()
        finally:
            batch.abandon()
        return batch.results


class _Dispatch:
    """One call's tasks on a :class:`_Pool`: which worker runs which task until when, the
    tasks still to send, and the verdicts so far."""

    def __init__(self, pool: _Pool, tasks: Sequence[tuple], timeout_s: float):
        self.pool, self.tasks, self.timeout_s = pool, tasks, timeout_s
        self.results: list = [None] * len(tasks)
        self.pending: deque = deque(range(len(tasks)))
        self.retried: set = set()
        self.active: dict = {}  # worker -> [task index or None while booting, deadline]
        self.swallowed = 0

    def fill(self, max_parallel: int) -> None:
        """Hand pending tasks to workers (a booting one is watched until it is ready)."""
        while self.pending and len(self.active) < max_parallel:
            w = self.pool.checkout()
            if w is None:
                break
            if w.ready:
                self.send(w)
            else:
                self.active[w] = [None, time.monotonic() + BOOT_TIMEOUT_S]

    def send(self, w: _Worker) -> None:
        idx = self.pending.popleft()
        try:
            w.inbox.send((idx, *self.tasks[idx]))
        except (OSError, ValueError):  # worker gone: not the task's fault, retry it
            self.pending.appendleft(idx)
            count(worker_deaths=1)
            self.pool.discard(w, replace=True)
            return
        self.active[w] = [idx, time.monotonic() + self.timeout_s]

    def receive(self) -> None:
        """Take the verdicts (and "ready" messages) that arrive before the nearest deadline;
        a worker that answered gets the next task or goes back to the pool."""
        timeout = max(0.0, min(d for _, d in self.active.values()) - time.monotonic())
        by_conn = {w.outbox: w for w in self.active}
        for conn in _wait_conns(list(by_conn), timeout):
            w = by_conn[conn]
            idx = self.active[w][0]
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self.dead(w, idx)
                continue
            del self.active[w]
            if idx is None:
                w.ready = True
            else:
                _, ok, parsed, error, n_swallowed = msg
                self.swallowed += n_swallowed
                self.results[idx] = (ok, parsed, error, False)
            if self.pending:
                self.send(w)
            else:
                self.pool.release(w)

    def dead(self, w: _Worker, idx: Optional[int]) -> None:
        """A worker died: a booting one is an error; its task gets one more go, elsewhere."""
        code = w.proc.poll()
        del self.active[w]
        self.pool.discard(w, replace=True)
        count(worker_deaths=1)
        if idx is None:
            raise RuntimeError(
                f"a math-verify worker exited while starting (exit code {code}); "
                "its stderr above says why (is math-verify installed for "
                f"{sys.executable}?)"
            )
        if idx not in self.retried:  # e.g. killed from outside: give the item one more go
            self.retried.add(idx)
            self.pending.appendleft(idx)
            count(retries=1)
        else:
            self.results[idx] = (False, None, f"verifier worker died while verifying (exit code {code})", False)

    def expire(self) -> None:
        """Kill and replace each worker past its deadline; its task times out."""
        now = time.monotonic()
        for w, (idx, deadline) in list(self.active.items()):
            if deadline <= now and not w.outbox.poll(0):
                del self.active[w]
                count(worker_kills=1)
                self.pool.discard(w, replace=True)
                if idx is None:
                    raise RuntimeError(f"math-verify worker did not start within {BOOT_TIMEOUT_S} s")
                self.results[idx] = (False, None, None, True)

    def abandon(self) -> None:
        """End of the call: workers still busy (an interrupted batch) are in an unknown
        state and are replaced lazily; swallowed exceptions are counted."""
        for w in list(self.active):
            self.pool.discard(w, replace=False)
        if self.swallowed:
            count(swallowed_exceptions=self.swallowed)


_POOL: Optional[_Pool] = None
_POOL_LOCK = threading.Lock()


def default_num_workers() -> int:
    """``$ENVS_REWARD_WORKERS`` if set, else the usable cores capped at 8."""
    env = os.environ.get(WORKERS_ENV)
    if env:
        n = int(env)
        if n < 1:
            raise ValueError(f"{WORKERS_ENV} must be >= 1, got {env!r}")
        return n
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_WORKERS))


def _pool() -> _Pool:
    global _POOL
    with _POOL_LOCK:
        # After a fork the child must not touch the parent's pipes: start its own pool.
        if _POOL is None or _POOL.pid != os.getpid():
            _POOL = _Pool(default_num_workers())
        return _POOL


def shutdown_workers() -> None:
    """Kill the verifier processes (they are restarted lazily on the next call)."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None and pool.pid == os.getpid():
        pool.close()


atexit.register(shutdown_workers)


def _after_fork_in_child() -> None:
    # The parent's workers stay the parent's: drop our copies of their pipes, and fresh
    # locks in case another thread held one at the fork.
    global _POOL, _POOL_LOCK, _SPAWNER, _SPAWNER_LOCK, _STATS_LOCK
    old, _POOL = _POOL, None
    if old is not None:
        for w in list(old._all):
            for conn in (w.inbox, w.outbox):
                try:
                    conn.close()
                except OSError:
                    pass
    _SPAWNER = None
    _POOL_LOCK, _SPAWNER_LOCK, _STATS_LOCK = threading.Lock(), threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def warm_up(num_workers: Optional[int] = None) -> None:
    """Start the verifier processes now rather than on the first call (~0.5 s each, in parallel)."""
    pool = _pool()
    n = num_workers or pool.size
    pool.grow_to(n)
    pool.warm(n)


def run_tasks(tasks: Sequence[tuple], timeout_s: float, num_workers: Optional[int] = None) -> list[tuple]:
    """Run ``tasks`` on this process's pool -> one ``(ok, parsed, error, timed_out)`` each
    (see :meth:`_Pool.run`), on at most ``num_workers`` workers at once (default: the pool
    size, :func:`default_num_workers`; the pool grows if asked for more)."""
    pool = _pool()
    if num_workers:
        pool.grow_to(num_workers)
    return pool.run(tasks, timeout_s, min(num_workers or pool.size, len(tasks)))
