"""Verifier rewards: math-verify scoring that is safe in every execution context.

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
go on on the other workers. Genuine failures (a worker that dies, an exception in the
verifier, an unparseable ground truth) are reported in :attr:`RewardResult.error` and
counted in :func:`reward_stats`, never turned into a silent 0.

Cheap work stays in the caller: extracting the answer, a normalised exact-match fast
path (equal -> 1 without math-verify) and de-duplication of identical
(ground truth, answer) pairs inside a batch, which GRPO groups produce a lot of.

Why not ``pebble.ProcessPool`` (per-task timeout, kills and replaces an overrunning
worker)? Measured with ``benchmarks/reward_pool_compare.py`` (pebble 5.2.3, same caller
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

This file must stay importable as a bare script (workers load it by path): it imports
nothing from the ``envs`` package at module level.
"""
from __future__ import annotations

import atexit
import hashlib
import concurrent.futures
import importlib
import inspect
import logging
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
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
#: Longest ``parsed`` string carried back from a worker.
_MAX_REPR = 200
#: Tag of a reward-function task on the worker protocol (a math task is (gt, answer text)).
_FN_TASK = "\x00reward_fn"
#: Names usable in ``env_config.reward_fn`` / ``reward_fns`` besides ``"package.module:function"``.
BUILTIN_REWARDS = ("math", "multiple_choice", "format")
#: The letters a multiple-choice answer may be (GPQA uses A-D, ARC A-E, MMLU-Pro A-J).
CHOICE_LETTERS = "ABCDEFGHIJ"


@dataclass
class RewardResult:
    """The verifier's verdict on one completion.

    Attributes:
        score: 1.0 when the answer matches the ground truth, else 0.0.
        parsed: The extracted answer text (content of the last ``\\boxed{}``, or with
            ``think_format`` what math-verify extracted after ``</think>``); None when
            no answer was found.
        timed_out: Verification overran ``timeout_s`` and was cut (score 0).
        format_ok: The completion had the required form (a ``\\boxed{}`` answer, or a
            ``</think>`` tag in think format).
        error: Set when verification failed for a reason other than a wrong answer
            (worker crash, verifier exception, unparseable ground truth, a reward
            function that raised or returned no number). Score is 0 for the failed part
            but the sample should be treated as unscored, not as wrong.
        components: With reward functions (:func:`score_with_fns`): each function's own
            score by its metric label (0.0 for a call that crashed or timed out); None
            for the plain math reward.
    """

    score: float
    parsed: Optional[str]
    timed_out: bool
    format_ok: bool
    error: Optional[str] = None
    components: Optional[dict] = None

    @property
    def correct(self) -> bool:
        return self.score >= 1.0

    def as_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- answers

_BOXED = ("\\boxed", "\\fbox")


def _match_braces(text: str, start: int) -> Optional[int]:
    """Index just past the brace group opening at ``text[start] == '{'``, or None."""
    depth, i, n = 0, start, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2  # an escaped brace (\{ or \}) is content, not structure
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def last_boxed(text: str) -> Optional[str]:
    """Content of the last *complete* ``\\boxed{...}`` (or ``\\fbox{}``) in ``text``.

    Nested braces are handled; a final box cut off by the length limit is skipped in
    favour of the previous complete one. ``\\boxed 5`` (no braces) yields ``5``.
    """
    end = len(text)
    while True:
        pos = max(text.rfind(tag, 0, end) for tag in _BOXED)
        if pos < 0:
            return None
        tag = "\\boxed" if text.startswith("\\boxed", pos) else "\\fbox"
        i = pos + len(tag)
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            close = _match_braces(text, i)
            if close is not None:
                return text[i + 1 : close - 1].strip()
        elif i > pos + len(tag) and i < len(text):
            m = re.match(r"[^\s$]+", text[i:])
            if m:
                return m.group(0).rstrip(".")
        end = pos


_NORM_DROP = re.compile(r"\s+|\$|\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\[!,;: ]")


def _normalise(s: str) -> str:
    return _NORM_DROP.sub("", s)


def _after_think(completion: str) -> Optional[str]:
    tag = "</think>"
    pos = completion.rfind(tag)
    return None if pos < 0 else completion[pos + len(tag) :]


# --------------------------------------------------------------------------- built-in reward functions


def _answer_part(completion: str, think_format: bool) -> Optional[str]:
    """The text an answer is read from: after the last ``</think>`` when there is one
    (required with ``think_format``: None without it), else the whole completion."""
    after = _after_think(completion)
    if after is None:
        return None if think_format else completion
    return after


_CHOICE_IN_BOX = re.compile(r"^\(?([A-Ja-j])\)?(?:[.:)\s]|$)")
_CHOICE_TEXT = re.compile(r"\\text(?:bf)?\{([^{}]*)\}")
_CHOICE_STATED = re.compile(
    r"answer\s*(?:is|:|=)?\s*(?:option|choice)?\s*[:\-]?\s*[*_]*\s*\(?([A-J])\)?(?![A-Za-z0-9])", re.IGNORECASE)
_CHOICE_PAREN = re.compile(r"\(([A-J])\)")
_CHOICE_ALONE = re.compile(r"^\s*\(?([A-J])\)?[.)]?\s*$")


def extract_choice(text: str, *, think_format: bool = False) -> Optional[str]:
    """The final chosen letter (A-J) of a multiple-choice answer, or None.

    Read from the text after the last ``</think>`` (with ``think_format`` that tag is
    required), by the first rule that finds one:

    1. the last complete ``\\boxed{...}`` whose content is a letter, alone or followed by
       punctuation or text: ``\\boxed{C}``, ``\\boxed{(c)}``, ``\\boxed{\\text{C}}``,
       ``\\boxed{C) 42}``; a box holding anything else gives no letter;
    2. the last "answer" statement: ``Answer: C``, ``the answer is (C)``, ``final answer
       is **C**``, ``answer: option C`` (an upper-case letter not followed by a letter or
       digit; "Answer: Dogs" is no choice, "the answer is A big one" reads as A);
    3. the last parenthesised letter ``(C)``;
    4. the whole text being one letter (``C`` or ``C.``).

    Lower-case letters count only inside a box ("a" is an article elsewhere).
    """
    part = _answer_part(text, think_format)
    if part is None:
        return None
    boxed = last_boxed(part)
    if boxed is not None:
        inner = _CHOICE_TEXT.sub(lambda m: m.group(1), boxed).strip().strip("$").strip()
        m = _CHOICE_IN_BOX.match(inner)
        return m.group(1).upper() if m else None
    for rule in (_CHOICE_STATED, _CHOICE_PAREN):
        found = [m for m in rule.finditer(part) if m.group(1).isupper()]
        if found:
            return found[-1].group(1)
    m = _CHOICE_ALONE.match(part)
    return m.group(1) if m else None


def _choice_of_truth(ground_truth) -> str:
    gt = str(ground_truth).strip().strip("()").strip().rstrip(".").upper()
    if len(gt) != 1 or gt not in CHOICE_LETTERS:
        raise ValueError(f"multiple_choice needs a letter A-J as the ground truth, got {str(ground_truth)[:40]!r}")
    return gt


def multiple_choice_reward(completion: str, ground_truth: str, *, think_format: bool = False, **_) -> float:
    """1.0 when the completion's final chosen letter (:func:`extract_choice`) is the
    ground-truth letter (``"C"``, ``"(C)"`` or ``"c"``), else 0.0. A ground truth that is
    not a letter A-J raises (counted as a reward error: the data does not fit the reward)."""
    truth = _choice_of_truth(ground_truth)
    return 1.0 if extract_choice(completion, think_format=think_format) == truth else 0.0


def format_reward(completion: str, *, think_format: bool = False, **_) -> float:
    """1.0 when the completion has exactly the expected final-answer form, else 0.0.

    The form is the one :func:`math_reward` reads: exactly one complete, non-empty
    ``\\boxed{...}`` (or ``\\fbox{}``) in the answer part. The answer part is the text
    after the think block: with ``think_format`` the completion must hold exactly one
    ``</think>`` (and at most one ``<think>``, before it); without it a think block is
    optional, but a ``<think>`` left open (no ``</think>`` after it) fails the form.
    """
    opens, closes = completion.count("<think>"), completion.count("</think>")
    if think_format and closes != 1:
        return 0.0
    if opens > 1 or closes > 1 or (opens and (not closes or completion.find("<think>") > completion.find("</think>"))):
        return 0.0
    part = _answer_part(completion, think_format)
    if part is None:
        return 0.0
    tags = len(re.findall(r"\\(?:boxed|fbox)(?![A-Za-z])", part))
    boxed = last_boxed(part)
    return 1.0 if tags == 1 and boxed else 0.0


_BUILTIN_FNS = {"multiple_choice": multiple_choice_reward, "format": format_reward}


def load_reward_fn(spec: str):
    """``(function, accepted keyword names or None for **kwargs)`` of a reward spec: a
    built-in name (not ``"math"``, which is not a function call) or
    ``"package.module:function"`` (``function`` may be dotted: ``module:Class.method``).

    Raises ValueError with a one-line reason (no module, no attribute, not callable, no
    ``completion`` keyword).
    """
    if spec in _BUILTIN_FNS:
        return _BUILTIN_FNS[spec], None
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError("expected a built-in name (" + ", ".join(BUILTIN_REWARDS) + ") or 'package.module:function'")
    module_name, attr = spec.split(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to see
        raise ValueError(f"{type(exc).__name__}: {_one_line(exc)}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{attr!r} is a {type(obj).__name__}, not a function")
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: pass everything
        return obj, None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return obj, None
    accepted = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    if "completion" not in accepted:
        raise ValueError("the function takes no 'completion' keyword argument (signature "
                         f"{_one_line(inspect.signature(obj))})")
    return obj, accepted


def _one_line(x) -> str:
    return " ".join(str(x).split())[:_MAX_REPR]


def reward_labels(specs: Sequence[str]) -> list[str]:
    """The metric label of each reward spec: the built-in name, else the function's name
    (``pkg.mod:exact_match`` -> ``exact_match``), made unique with ``_2``, ``_3``..."""
    labels: list[str] = []
    for spec in specs:
        base = spec if spec in BUILTIN_REWARDS else spec.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
        base = re.sub(r"[^A-Za-z0-9_]", "_", base) or "fn"
        label, n = base, 1
        while label in labels:
            n += 1
            label = f"{base}_{n}"
        labels.append(label)
    return labels


# --------------------------------------------------------------------------- worker side

_FN_CACHE: dict = {}


def _call_reward_fn(spec: str, kwargs: dict, caller_path: Sequence[str]):
    """Run one reward-function call in a worker: its float score, or a one-line reason
    (a str) when it returned no finite number. An exception propagates (the worker loop
    reports it)."""
    entry = _FN_CACHE.get(spec)
    if entry is None:
        for p in caller_path:  # after our own entries: real packages are not shadowed
            if p not in sys.path:
                sys.path.append(p)
        try:
            entry = load_reward_fn(spec)
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


def _worker_main(in_fd: int, out_fd: int, parent_pid: int) -> None:
    """Loop of a verifier process: receive (task id, gold text, answer text), verify."""
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
        task_id, task = msg[0], msg[1:]
        try:
            if len(task) == 4 and task[0] == _FN_TASK:  # (tag, spec, kwargs, caller's sys.path)
                ok, parsed, error, swallowed = _call_reward_fn(task[1], task[2], task[3]), None, None, 0
                if isinstance(ok, str):  # not a score: the reason it failed
                    ok, error = 0.0, ok
            else:
                gt, pred_text = task
                ok, parsed, error, swallowed = verify_one(gt, pred_text)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, not hidden
            ok, parsed, error, swallowed = False, None, f"{type(exc).__name__}: {str(exc)[:_MAX_REPR]}", 0
        try:
            outbox.send((task_id, ok, parsed, error, swallowed))
        except (BrokenPipeError, OSError):
            return


_BOOT = (
    "import sys, importlib.util as u\n"
    # The caller's cwd may hold modules that shadow real packages: keep it off the path.
    "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"
    "s = u.spec_from_file_location('_envs_reward_worker', sys.argv[1])\n"
    "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m)\n"
    "m._worker_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))\n"
)


# --------------------------------------------------------------------------- caller side

_STATS: Counter = Counter()
_STATS_LOCK = threading.Lock()


def _count(**increments: int) -> None:
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
                [sys.executable, "-c", _BOOT, os.path.abspath(__file__),
                 str(to_child_r), str(from_child_w), str(os.getpid())],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        _count(worker_starts=1)
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
                    _count(worker_deaths=1)
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
                            f"a math-verify worker exited while starting (exit code {w.proc.poll()}); "
                            "its stderr above says why"
                        ) from None
                    if msg[0] != "ready":  # pragma: no cover - protocol bug
                        raise RuntimeError(f"unexpected first message from worker: {msg!r}")
                    w.ready = True
        finally:
            for w in held:
                self.release(w)

    # -- the dispatch loop
    def run(self, tasks: Sequence[tuple[str, str]], timeout_s: float, max_parallel: int) -> list[tuple]:
        """Verify ``tasks`` = [(ground truth, answer text)] -> [(ok, parsed, error, timed_out)].

        A task may also be a reward-function call ``(_FN_TASK, spec, kwargs, sys_path)``;
        its ``ok`` is then the function's float score.
        """
        results: list = [None] * len(tasks)
        pending: deque = deque(range(len(tasks)))
        retried: set = set()
        active: dict = {}  # worker -> [task index or None while booting, deadline]
        swallowed = 0

        def send(w: _Worker) -> None:
            idx = pending.popleft()
            try:
                w.inbox.send((idx, *tasks[idx]))
            except (OSError, ValueError):  # worker gone: not the task's fault, retry it
                pending.appendleft(idx)
                _count(worker_deaths=1)
                self.discard(w, replace=True)
                return
            active[w] = [idx, time.monotonic() + timeout_s]

        def dead(w: _Worker, idx: Optional[int]) -> None:
            code = w.proc.poll()
            del active[w]
            self.discard(w, replace=True)
            _count(worker_deaths=1)
            if idx is None:
                raise RuntimeError(
                    f"a math-verify worker exited while starting (exit code {code}); "
                    "its stderr above says why (is math-verify installed for "
                    f"{sys.executable}?)"
                )
            if idx not in retried:  # e.g. killed from outside: give the item one more go
                retried.add(idx)
                pending.appendleft(idx)
                _count(retries=1)
            else:
                results[idx] = (False, None, f"verifier worker died while verifying (exit code {code})", False)

        try:
            while pending or active:
                while pending and len(active) < max_parallel:
                    w = self.checkout()
                    if w is None:
                        break
                    if w.ready:
                        send(w)
                    else:
                        active[w] = [None, time.monotonic() + BOOT_TIMEOUT_S]
                if not active:  # every worker is busy with other callers' batches
                    self.wait_for_release(0.05)
                    continue
                timeout = max(0.0, min(d for _, d in active.values()) - time.monotonic())
                by_conn = {w.outbox: w for w in active}
                for conn in _wait_conns(list(by_conn), timeout):
                    w = by_conn[conn]
                    idx = active[w][0]
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        dead(w, idx)
                        continue
                    del active[w]
                    if idx is None:
                        w.ready = True
                    else:
                        _, ok, parsed, error, n_swallowed = msg
                        swallowed += n_swallowed
                        results[idx] = (ok, parsed, error, False)
                    if pending:
                        send(w)
                    else:
                        self.release(w)
                now = time.monotonic()
                for w, (idx, deadline) in list(active.items()):
                    if deadline <= now and not w.outbox.poll(0):
                        del active[w]
                        _count(worker_kills=1)
                        self.discard(w, replace=True)
                        if idx is None:
                            raise RuntimeError(f"math-verify worker did not start within {BOOT_TIMEOUT_S} s")
                        results[idx] = (False, None, None, True)
        finally:
            # Interrupted mid-batch: the state of in-flight workers is unknown.
            for w in list(active):
                self.discard(w, replace=False)
            if swallowed:
                _count(swallowed_exceptions=swallowed)
        return results


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


# --------------------------------------------------------------------------- public API


def _prepare(completion: str, ground_truth, think_format: bool):
    """-> (final RewardResult or None, answer text for math-verify, parsed)."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int, float)):
        raise TypeError(f"ground_truth must be a str, got {type(ground_truth).__name__}")
    gt = str(ground_truth).strip()
    if think_format:
        after = _after_think(completion)
        if after is None:  # official ExGRPO: no </think>, no reward
            return RewardResult(0.0, None, False, False), None, None
        boxed = last_boxed(after)
        answer_text, parsed = after, boxed
    else:
        boxed = last_boxed(completion)
        if boxed is None:
            return RewardResult(0.0, None, False, False), None, None
        answer_text, parsed = "\\boxed{" + boxed + "}", boxed
    if not gt:
        return RewardResult(0.0, parsed, False, True, error="empty ground truth"), None, parsed
    if boxed is not None:
        if not boxed:
            return RewardResult(0.0, "", False, True), None, parsed
        if _normalise(boxed) == _normalise(gt):
            return RewardResult(1.0, parsed, False, True), None, parsed
    if not answer_text.strip():
        return RewardResult(0.0, parsed, False, True), None, parsed
    return None, answer_text, parsed


def score_batch(
    completions: Sequence[str],
    ground_truths: Sequence[str],
    *,
    timeout_s: float = 5.0,
    think_format: bool = False,
    num_workers: Optional[int] = None,
    fast_path: bool = True,
) -> list[RewardResult]:
    """Score ``completions[i]`` against ``ground_truths[i]``, in parallel across processes.

    Args:
        completions: Model outputs.
        ground_truths: Reference answers (latex or plain numbers), one per completion.
        timeout_s: Wall-clock limit per verification, counted from when the item reaches
            a worker. An overrun scores 0 with ``timed_out=True``; its worker is killed
            and replaced while the other items continue.
        think_format: Official ExGRPO reward: the completion must contain ``</think>`` and
            only the text after the last one is verified.
        num_workers: At most this many verifier processes for this call (default: the
            pool size, :func:`default_num_workers`). The pool grows if asked for more.
        fast_path: Decide equal normalised strings without math-verify (tests of the
            verifier itself turn this off).

    Safe from any thread, any Ray actor and any subprocess.
    """
    if len(completions) != len(ground_truths):
        raise ValueError(f"{len(completions)} completions but {len(ground_truths)} ground truths")
    if not timeout_s or timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if num_workers is not None and num_workers < 1:
        raise ValueError(f"num_workers must be >= 1 or None, got {num_workers!r}")
    results: list[Optional[RewardResult]] = [None] * len(completions)
    parsed_of: dict[int, Optional[str]] = {}
    unique: dict[tuple[str, str], int] = {}
    users: list[list[int]] = []
    n_fast = 0
    for i, (completion, gt) in enumerate(zip(completions, ground_truths)):
        done, answer_text, parsed = _prepare(completion, gt, think_format)
        if done is not None and (fast_path or done.score == 0.0):
            results[i] = done
            n_fast += done.score == 1.0
            continue
        if answer_text is None:  # fast-path hit with fast_path off
            answer_text = "\\boxed{" + parsed + "}" if not think_format else _after_think(completion)
        parsed_of[i] = parsed
        key = (str(gt).strip(), answer_text)
        if key not in unique:
            unique[key] = len(users)
            users.append([])
        users[unique[key]].append(i)

    if users:
        pool = _pool()
        if num_workers:
            pool.grow_to(num_workers)
        tasks = list(unique)
        verdicts = pool.run(tasks, timeout_s, min(num_workers or pool.size, len(tasks)))
        n_err = n_timeouts = 0
        for (ok, parsed_repr, error, timed_out), idxs in zip(verdicts, users):
            n_err += (error is not None) * len(idxs)
            n_timeouts += timed_out * len(idxs)
            for i in idxs:
                results[i] = RewardResult(
                    score=1.0 if ok else 0.0,
                    parsed=parsed_of[i] if parsed_of[i] is not None else parsed_repr,
                    timed_out=timed_out,
                    format_ok=True,
                    error=error,
                )
        if n_err:
            first = next(v[2] for v in verdicts if v[2])
            logger.warning("%d of %d verifications failed with an error (first: %s)", n_err, len(completions), first)
        _count(verified=len(tasks), errors=n_err, timeouts=n_timeouts)
    _count(scored=len(completions), fast_path=n_fast)
    return results  # type: ignore[return-value]


def math_reward(
    completion: str,
    ground_truth: str,
    *,
    timeout_s: float = 5.0,
    think_format: bool = False,
    fast_path: bool = True,
) -> RewardResult:
    """Score one completion; see :func:`score_batch` for the arguments.

    The answer is the content of the last ``\\boxed{...}`` (no box: score 0,
    ``format_ok=False``), or with ``think_format`` the text after ``</think>`` (no tag:
    score 0, ``format_ok=False``), verified by math-verify against
    ``parse("$" + ground_truth + "$")``.
    """
    return score_batch([completion], [ground_truth], timeout_s=timeout_s, think_format=think_format,
                       num_workers=1, fast_path=fast_path)[0]


def _caller_path() -> tuple:
    """This process's import path for the workers (``''`` is the current folder)."""
    return tuple(os.path.abspath(p) if p else os.getcwd() for p in sys.path if isinstance(p, str))


def score_with_fns(
    completions: Sequence[str],
    ground_truths: Sequence[str],
    *,
    fns: Sequence[str],
    weights: Optional[Sequence[float]] = None,
    rows: Optional[Sequence[dict]] = None,
    timeout_s: float = 5.0,
    think_format: bool = False,
    num_workers: Optional[int] = None,
) -> list[RewardResult]:
    """Score with reward functions: ``score = sum(weight_k * fn_k(...))``.

    Args:
        completions, ground_truths: As for :func:`score_batch`.
        fns: Reward specs: ``"math"`` (:func:`score_batch`: 1.0 or 0.0),
            ``"multiple_choice"``, ``"format"`` or ``"package.module:function"``.
        weights: One per spec (default 1.0 each).
        rows: Per completion, the row's other fields, passed as keyword arguments
            (``question``, ``question_id``, ``data_source``...).
        timeout_s, think_format, num_workers: As for :func:`score_batch`; the timeout is
            per function call.

    Every call except ``"math"`` runs in the verifier processes as
    ``fn(completion=..., ground_truth=..., **row)`` (only the keywords it accepts unless
    it takes ``**kwargs``; the built-ins also get ``think_format``). A call that raises or
    returns no finite number scores 0, sets :attr:`RewardResult.error` and counts in
    ``errors`` and ``fn_errors``; one that overruns ``timeout_s`` scores 0, sets
    ``timed_out`` and counts in ``timeouts`` and ``fn_timeouts``. Each function's own
    score is in :attr:`RewardResult.components` under its :func:`reward_labels` label.
    """
    fns = list(fns)
    n = len(completions)
    if not fns:
        raise ValueError("fns must name at least one reward function")
    if len(ground_truths) != n or (rows is not None and len(rows) != n):
        raise ValueError(f"{n} completions but {len(ground_truths)} ground truths"
                         + (f" and {len(rows)} rows" if rows is not None else ""))
    weights = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
    if len(weights) != len(fns):
        raise ValueError(f"{len(fns)} reward functions but {len(weights)} weights")
    if not timeout_s or timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    for c in completions:
        if not isinstance(c, str):
            raise TypeError(f"completion must be a str, got {type(c).__name__}")
    labels = reward_labels(fns)
    scores = [[0.0] * len(fns) for _ in range(n)]
    errors: list[Optional[str]] = [None] * n
    timed = [False] * n
    math_results: Optional[list[RewardResult]] = None
    tasks, where = [], []
    path = _caller_path()
    for k, spec in enumerate(fns):
        if spec == "math":
            math_results = score_batch(completions, ground_truths, timeout_s=timeout_s, think_format=think_format,
                                       num_workers=num_workers)
            for i, r in enumerate(math_results):
                scores[i][k] = r.score
                timed[i] = timed[i] or r.timed_out
                if r.error is not None and errors[i] is None:
                    errors[i] = f"reward 'math': {r.error}"
            continue
        extra = {"think_format": think_format} if spec in _BUILTIN_FNS else {}
        for i in range(n):
            row = rows[i] if rows is not None else {}
            kwargs = {**row, "completion": completions[i], "ground_truth": ground_truths[i], **extra}
            tasks.append((_FN_TASK, spec, kwargs, path))
            where.append((i, k))
    if tasks:
        pool = _pool()
        if num_workers:
            pool.grow_to(num_workers)
        verdicts = pool.run(tasks, timeout_s, min(num_workers or pool.size, len(tasks)))
        n_err = n_timeouts = 0
        first = None
        for (value, _, error, timed_out), (i, k) in zip(verdicts, where):
            if timed_out:
                timed[i] = True
                n_timeouts += 1
            elif error is not None:
                n_err += 1
                msg = f"reward {labels[k]!r} ({fns[k]}): {error}"
                first = first or msg
                if errors[i] is None:
                    errors[i] = msg
            else:
                scores[i][k] = float(value)
        if n_err:
            logger.warning("%d of %d reward-function calls failed (first: %s)", n_err, len(tasks), first)
        if n_timeouts:
            logger.warning("%d of %d reward-function calls overran reward_timeout_s=%s", n_timeouts, len(tasks),
                           timeout_s)
        _count(fn_calls=len(tasks), fn_errors=n_err, fn_timeouts=n_timeouts, errors=n_err, timeouts=n_timeouts)
    if math_results is None:
        _count(scored=n)
    results = []
    for i, completion in enumerate(completions):
        if math_results is not None:
            parsed, format_ok = math_results[i].parsed, math_results[i].format_ok
        else:
            part = _answer_part(completion, think_format)
            format_ok = part is not None and (think_format or last_boxed(part) is not None)
            if part is None:
                parsed = None
            elif "multiple_choice" in fns:
                parsed = extract_choice(completion, think_format=think_format)
            else:
                parsed = last_boxed(part)
        results.append(RewardResult(
            score=float(sum(w * x for w, x in zip(weights, scores[i]))),
            parsed=parsed, timed_out=timed[i], format_ok=format_ok, error=errors[i],
            components=dict(zip(labels, scores[i])),
        ))
    return results


def rehearsal_score(question_id: str, completion: str) -> float:
    """The stated stand-in reward of a rehearsal (``env_config.rehearsal_reward``).

    A rehearsal runs a recipe with a randomly initialised model, which never answers
    correctly: every group would be all-wrong, and no path that depends on success
    (advantages with variance, correctness buckets, the delayed start, replay) would run.
    This reward stands in for the verdict: each question gets a success rate ``p`` in
    [0.3, 0.95] from a hash of its id, and a completion scores 1.0 when a hash of (question
    id, completion text) falls below ``p`` -- deterministic like a verifier (the same text
    always gets the same reward), about 0.6 on average (a first step of 16 questions clears
    the official delayed start, a solve rate of 0.35, by several standard deviations),
    varied within and across groups.
    """
    def unit(text: str) -> float:
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2.0**64

    rate = 0.3 + 0.65 * unit(f"rate\x00{question_id}")
    return 1.0 if unit(f"draw\x00{question_id}\x00{completion}") < rate else 0.0
