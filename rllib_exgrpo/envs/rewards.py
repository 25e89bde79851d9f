"""Verifier rewards: the math reward, the built-in reward functions and the scoring API.

:func:`score_batch` / :func:`math_reward` score completions against ground truths with
math-verify; :func:`score_with_fns` scores with reward functions (the built-ins of
:data:`REWARD` or ``"package.module:function"``) and sums them with weights.
Every math-verify call and every reward-function call runs in the worker processes of
:mod:`rllib_exgrpo.envs.verifier_pool`, with a real wall-clock deadline, safe from any
thread, Ray actor or subprocess. Genuine failures (a worker that dies, an exception in the
verifier or a reward function, an unparseable ground truth) are reported in
:attr:`RewardResult.error` and counted in :func:`reward_stats`, never turned into a silent 0.

Cheap work stays in the caller: extracting the answer, a normalised exact-match fast
path (equal -> 1 without math-verify) and de-duplication of identical
(ground truth, answer) pairs inside a batch, which GRPO groups produce a lot of.

This module imports the standard library only at module level (and the verifier pool,
itself standard library only): the verifier workers import it to run the built-in
reward functions, and the TRL benchmark imports it in a virtualenv without ray or
gymnasium (``benchmarks/_trl_grpo_runner.py``). The pool's public names (:func:`warm_up`,
:func:`shutdown_workers`, :func:`reward_stats`, :func:`reset_reward_stats`,
:func:`default_num_workers`, :data:`WORKERS_ENV`...) are importable from here too.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from rllib_exgrpo.envs import verifier_pool
from rllib_exgrpo.envs.verifier_pool import (  # noqa: F401 - the pool's public names, re-exported
    BOOT_TIMEOUT_S,
    MAX_DEFAULT_WORKERS,
    WORKERS_ENV,
    default_num_workers,
    make_verifier,
    reset_reward_stats,
    reward_stats,
    shutdown_workers,
    warm_up,
)

from rllib_exgrpo.core.registry import Registry

logger = logging.getLogger(__name__)

#: Reward functions by name, usable in ``env_config.reward_fn`` / ``reward_fns`` besides
#: ``"package.module:function"``. ``"math"`` is math-verify's batched scorer (:func:`score_batch`,
#: run by the env as a batch); every other entry is a per-completion function
#: ``fn(completion, ground_truth, *, think_format=False, **row) -> float`` run in the verifier
#: processes. A user package adds one with ``@register_reward("name")`` (its module must be
#: importable where the env runs: the workers import it by its qualified name).
REWARD: Registry = Registry("reward")
register_reward = REWARD.register
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
_CHOICE_STATED = re.compile(r"answer\s*(?:is|:|=)?\s*(?:option|choice)?\s*[:\-]?\s*[*_]*\s*\(?([A-J])\)?(?![A-Za-z0-9])", re.IGNORECASE)
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


@register_reward("multiple_choice")
def multiple_choice_reward(completion: str, ground_truth: str, *, think_format: bool = False, **_) -> float:
    """1.0 when the completion's final chosen letter (:func:`extract_choice`) is the
    ground-truth letter (``"C"``, ``"(C)"`` or ``"c"``), else 0.0. A ground truth that is
    not a letter A-J raises (counted as a reward error: the data does not fit the reward)."""
    truth = _choice_of_truth(ground_truth)
    return 1.0 if extract_choice(completion, think_format=think_format) == truth else 0.0


@register_reward("format")
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


def rehearsal_score(question_id: str, completion: str) -> float:
    """The stated stand-in score of a rehearsal (the ``rehearsal`` reward).

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


@register_reward("rehearsal")
def rehearsal_reward(completion: str, *, question_id: str, **_) -> float:
    """The built-in ``rehearsal`` reward: :func:`rehearsal_score` of the row's question id
    and the completion, whatever the answer. ``rllib train --rehearse`` selects it with
    ``reward_fns: [<the recipe's rewards>, rehearsal]`` and ``reward_weights: [0, ..., 1]``,
    so the recipe's own rewards (math-verify by default) still run on every completion and
    report their errors and timeouts, and the score is the stand-in."""
    return rehearsal_score(question_id, completion)


def builtin_reward_names() -> tuple:
    """The registered reward names (``"math"`` first)."""
    return REWARD.names()


def _registered_fn(spec: str):
    """The per-completion function registered under ``spec`` (None: not a name, or ``"math"``)."""
    return REWARD.get(spec) if spec in REWARD and spec != "math" else None


def load_reward_fn(spec: str):
    """``(function, accepted keyword names or None for **kwargs)`` of a reward spec: a
    built-in name (not ``"math"``, which is not a function call) or
    ``"package.module:function"`` (``function`` may be dotted: ``module:Class.method``).

    Raises ValueError with a one-line reason (no module, no attribute, not callable, no
    ``completion`` keyword).
    """
    fn = _registered_fn(spec)
    if fn is not None:
        return fn, None
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError("expected a registered name (" + ", ".join(REWARD.names()) + ") or 'package.module:function'")
    return verifier_pool.load_function(spec)


def _worker_spec(spec: str) -> str:
    """The ``"package.module:function"`` a worker imports for a reward spec (a built-in
    name is a function of this module)."""
    fn = _registered_fn(spec)
    return spec if fn is None else f"{fn.__module__}:{fn.__qualname__}"


def reward_labels(specs: Sequence[str]) -> list[str]:
    """The metric label of each reward spec: the built-in name, else the function's name
    (``pkg.mod:exact_match`` -> ``exact_match``), made unique with ``_2``, ``_3``..."""
    labels: list[str] = []
    for spec in specs:
        base = spec if spec in REWARD else spec.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
        base = re.sub(r"[^A-Za-z0-9_]", "_", base) or "fn"
        label, n = base, 1
        while label in labels:
            n += 1
            label = f"{base}_{n}"
        labels.append(label)
    return labels


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


def _check_timeout(timeout_s) -> None:
    if not timeout_s or timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")


@dataclass
class _MathPlan:
    """A batch split into what the caller decided and the unique pairs math-verify gets."""

    results: list  # per completion: a RewardResult decided here, or None
    parsed_of: dict  # completion index -> its extracted answer, for those sent on
    unique: dict  # (ground truth, answer text) -> its index in ``users``
    users: list  # per unique pair: the completion indices that share it
    n_fast: int  # decided 1.0 by the exact-match fast path


def _plan_math(completions, ground_truths, think_format: bool, fast_path: bool) -> _MathPlan:
    """Decide what needs no math-verify; de-duplicate the rest."""
    plan = _MathPlan([None] * len(completions), {}, {}, [], 0)
    for i, (completion, gt) in enumerate(zip(completions, ground_truths)):
        done, answer_text, parsed = _prepare(completion, gt, think_format)
        if done is not None and (fast_path or done.score == 0.0):
            plan.results[i] = done
            plan.n_fast += done.score == 1.0
            continue
        if answer_text is None:  # fast-path hit with fast_path off
            answer_text = "\\boxed{" + parsed + "}" if not think_format else _after_think(completion)
        plan.parsed_of[i] = parsed
        key = (str(gt).strip(), answer_text)
        if key not in plan.unique:
            plan.unique[key] = len(plan.users)
            plan.users.append([])
        plan.users[plan.unique[key]].append(i)
    return plan


def _verify_planned(plan: _MathPlan, timeout_s: float, num_workers: Optional[int]) -> None:
    """Run the plan's unique pairs through math-verify and fill in their completions' results."""
    tasks = list(plan.unique)
    verdicts = verifier_pool.run_tasks(tasks, timeout_s, num_workers)
    n_err = n_timeouts = 0
    for (ok, parsed_repr, error, timed_out), idxs in zip(verdicts, plan.users):
        n_err += (error is not None) * len(idxs)
        n_timeouts += timed_out * len(idxs)
        for i in idxs:
            parsed = plan.parsed_of[i]
            plan.results[i] = RewardResult(
                score=1.0 if ok else 0.0,
                parsed=parsed if parsed is not None else parsed_repr,
                timed_out=timed_out,
                format_ok=True,
                error=error,
            )
    if n_err:
        first = next(v[2] for v in verdicts if v[2])
        logger.warning("%d of %d verifications failed with an error (first: %s)", n_err, len(plan.results), first)
    verifier_pool.count(verified=len(tasks), errors=n_err, timeouts=n_timeouts)


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
    _check_timeout(timeout_s)
    if num_workers is not None and num_workers < 1:
        raise ValueError(f"num_workers must be >= 1 or None, got {num_workers!r}")
    plan = _plan_math(completions, ground_truths, think_format, fast_path)
    if plan.users:
        _verify_planned(plan, timeout_s, num_workers)
    verifier_pool.count(scored=len(completions), fast_path=plan.n_fast)
    return plan.results


@register_reward("math")
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
    return score_batch([completion], [ground_truth], timeout_s=timeout_s, think_format=think_format, num_workers=1, fast_path=fast_path)[0]


@dataclass
class _Terms:
    """Per completion: each reward function's score, the first error, whether a call timed out."""

    scores: list  # [completion][function] -> float
    errors: list  # [completion] -> first error message or None
    timed: list  # [completion] -> bool

    @classmethod
    def empty(cls, n: int, n_fns: int) -> "_Terms":
        return cls([[0.0] * n_fns for _ in range(n)], [None] * n, [False] * n)

    def note_error(self, i: int, message: str) -> None:
        if self.errors[i] is None:
            self.errors[i] = message


def _checked_weights(completions, ground_truths, fns: list, weights, rows, timeout_s) -> list[float]:
    """The arguments of :func:`score_with_fns` checked; -> the weights (1.0 each by default)."""
    n = len(completions)
    if not fns:
        raise ValueError("fns must name at least one reward function")
    if len(ground_truths) != n or (rows is not None and len(rows) != n):
        raise ValueError(f"{n} completions but {len(ground_truths)} ground truths" + (f" and {len(rows)} rows" if rows is not None else ""))
    weights = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
    if len(weights) != len(fns):
        raise ValueError(f"{len(fns)} reward functions but {len(weights)} weights")
    _check_timeout(timeout_s)
    for c in completions:
        if not isinstance(c, str):
            raise TypeError(f"completion must be a str, got {type(c).__name__}")
    return weights


def _math_term(k: int, terms: _Terms, completions, ground_truths, **score_kwargs) -> list[RewardResult]:
    """Score the ``"math"`` function (index ``k``) with :func:`score_batch` into ``terms``."""
    results = score_batch(completions, ground_truths, **score_kwargs)
    for i, r in enumerate(results):
        terms.scores[i][k] = r.score
        terms.timed[i] = terms.timed[i] or r.timed_out
        if r.error is not None:
            terms.note_error(i, f"reward 'math': {r.error}")
    return results


def _fn_tasks(fns: list, completions, ground_truths, rows, think_format: bool) -> tuple[list, list]:
    """The worker tasks of every call of a reward function other than ``"math"``, and
    where each result goes: ``(completion index, function index)``."""
    tasks, where = [], []
    path = verifier_pool.caller_path()
    for k, spec in enumerate(fns):
        if spec == "math":
            continue
        extra = {"think_format": think_format} if _registered_fn(spec) is not None else {}
        worker_spec = _worker_spec(spec)
        for i in range(len(completions)):
            row = rows[i] if rows is not None else {}
            kwargs = {**row, "completion": completions[i], "ground_truth": ground_truths[i], **extra}
            tasks.append((verifier_pool.FN_TASK, worker_spec, kwargs, path))
            where.append((i, k))
    return tasks, where


def _fn_terms(tasks: list, where: list, fns: list, terms: _Terms, timeout_s: float, num_workers: Optional[int]) -> None:
    """Run the reward-function calls in the workers into ``terms``; log and count the
    calls that failed or overran."""
    labels = reward_labels(fns)
    verdicts = verifier_pool.run_tasks(tasks, timeout_s, num_workers)
    n_err = n_timeouts = 0
    first = None
    for (value, _, error, timed_out), (i, k) in zip(verdicts, where):
        if timed_out:
            terms.timed[i] = True
            n_timeouts += 1
        elif error is not None:
            n_err += 1
            msg = f"reward {labels[k]!r} ({fns[k]}): {error}"
            first = first or msg
            terms.note_error(i, msg)
        else:
            terms.scores[i][k] = float(value)
    if n_err:
        logger.warning("%d of %d reward-function calls failed (first: %s)", n_err, len(tasks), first)
    if n_timeouts:
        logger.warning("%d of %d reward-function calls overran reward_timeout_s=%s", n_timeouts, len(tasks), timeout_s)
    verifier_pool.count(fn_calls=len(tasks), fn_errors=n_err, fn_timeouts=n_timeouts, errors=n_err, timeouts=n_timeouts)


def _answer_seen(completion: str, fns: list, think_format: bool) -> tuple[Optional[str], bool]:
    """``(parsed, format_ok)`` of a completion scored without ``"math"``: the chosen letter
    with ``multiple_choice``, else the last box; the form is a box (or with
    ``think_format`` the ``</think>`` tag)."""
    part = _answer_part(completion, think_format)
    if part is None:
        return None, False
    format_ok = think_format or last_boxed(part) is not None
    if "multiple_choice" in fns:
        return extract_choice(completion, think_format=think_format), format_ok
    return last_boxed(part), format_ok


def _weighted_results(
    completions: Sequence[str],
    fns: list,
    weights: list[float],
    terms: _Terms,
    math_results: Optional[list[RewardResult]],
    think_format: bool,
) -> list[RewardResult]:
    """One :class:`RewardResult` per completion from the functions' ``terms``: the weighted sum,
    each function's score under its label, and the parsed answer and format check (from the
    ``"math"`` term when there is one, else read off the completion)."""
    labels = reward_labels(fns)
    results = []
    for i, completion in enumerate(completions):
        if math_results is not None:
            parsed, format_ok = math_results[i].parsed, math_results[i].format_ok
        else:
            parsed, format_ok = _answer_seen(completion, fns, think_format)
        results.append(
            RewardResult(
                score=float(sum(w * x for w, x in zip(weights, terms.scores[i]))),
                parsed=parsed,
                timed_out=terms.timed[i],
                format_ok=format_ok,
                error=terms.errors[i],
                components=dict(zip(labels, terms.scores[i])),
            )
        )
    return results


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
            ``"multiple_choice"``, ``"format"``, ``"rehearsal"`` or
            ``"package.module:function"``.
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
    weights = _checked_weights(completions, ground_truths, fns, weights, rows, timeout_s)
    terms = _Terms.empty(len(completions), len(fns))
    math_results: Optional[list[RewardResult]] = None
    for k in (k for k, spec in enumerate(fns) if spec == "math"):
        math_results = _math_term(
            k, terms, completions, ground_truths, timeout_s=timeout_s, think_format=think_format, num_workers=num_workers
        )
    tasks, where = _fn_tasks(fns, completions, ground_truths, rows, think_format)
    if tasks:
        _fn_terms(tasks, where, fns, terms, timeout_s, num_workers)
    if math_results is None:
        verifier_pool.count(scored=len(completions))
    return _weighted_results(completions, fns, weights, terms, math_results, think_format)
