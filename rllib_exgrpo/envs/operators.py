"""The embedded hidden-operator family: symbols whose meaning must be found by trial.

A question is a chain of one to three operations on single-digit numbers, written with
made-up operator symbols and tagged with a *family*::

    [F07] 3 # 5 @ 2 =

Each symbol (``#``, ``@``, ``&``) stands for one of ``+``, ``-`` or ``x``
(multiplication), but which one is never said: it is fixed by the family and by the
position of the operation in the chain. The task seed draws, once, a table
``meaning[family][symbol][position]`` (positions 1 to 3, each entry uniform over the three
meanings, independently). A policy can only get these questions right consistently by
learning the table from its rewards, which is what makes the family a probe of how well
reinforcement learning with replay shares what it finds between related questions.

Design choices and why:

* **Position dependence.** A symbol may mean ``+`` as the first operation and ``x`` as the
  second. A family's one-operation questions therefore reveal only the position-1 column
  of its table: solving the easy questions does not give the whole mapping away, and a
  success on a three-operation question reveals three entries at once.
* **Operands 2 to 9.** With 0 or 1 several meanings give the same result (``a + 0 = a - 0``,
  ``a x 1 = a``), so a correct answer would not identify the meaning.
* **Left to right, no precedence.** The running value ``r`` starts at the first operand
  and step ``k`` applies ``meaning(symbol_k, k)`` to ``(r, operand_{k+1})``. Intermediate
  and final values may be negative; the answer is the final integer as a string.
* **Uniform guessing is measurable.** A policy that knows the format and the arithmetic
  but guesses each meaning uniformly succeeds with probability about 1/3, 1/9 and 1/27 for
  chains of length 1, 2 and 3 (slightly more: a few operand pairs give the same result
  under two meanings, e.g. ``2 + 2 = 2 x 2``). That is the baseline learning must beat.
* **A control without shared structure.** With ``shuffled=1`` every question's meanings are
  drawn from a seed derived from the question itself instead of its family's table. The
  prompts look the same (family tags included) and the guessing baseline is the same, but
  nothing learned on one question transfers to another.
* **Balanced tables.** With ``balanced=1`` each (symbol, position) means ``+``, ``-`` and
  ``x`` in equally many families. With independent draws one meaning is right more often
  than the others across families by chance, and a policy gains by answering it
  everywhere without telling families apart; balanced, every answer that ignores the
  family stays at the guessing rate, so accuracy above it is family-specific.

Splits: ``train``, ``validation`` and ``test`` share the families (and so the tables) but
never a question. A question belongs to a split by a stable hash of its text (80 % train,
10 % validation, 10 % test of the whole question space), and each split's generator
rejects the others' questions, so held-out questions are never trained on. Everything is a
pure function of the options: problem ``i`` of a split is the same on every machine, and a
shorter list is a prefix of a longer one.

One-operation questions are few (192 per family, about 19 per family in each held-out
split). A split asking for more of them than exist takes all of them and fills the rest
with longer chains (logged); with ``lengths=1`` alone that is an error.

Worked solutions (for a supervised warm start only, never shown to the policy) spell each
step with its symbol and meaning and end in ``\\boxed{}``::

    3 # 5 = 3 + 5 = 8, 8 @ 2 = 8 x 2 = 16. \\boxed{16}

A warm start should teach the format and the arithmetic but not the tables: with
``meanings=random`` (spec option) or :func:`random_meaning_solution`, each solution uses
meanings drawn uniformly per example, while the problem's ``ground_truth`` stays the true
answer.

Spec (``load_problems("operators:seed=3,families=8", split="validation")``), options
comma-separated ``key=value``:

================  ========  ==========================================================
option            default   meaning
================  ========  ==========================================================
``seed``          0         task seed: draws the family tables and the questions
``families``      24        number of families, tags ``F00`` .. ``F{families-1}`` (1-100)
``lengths``       ``1-3``   chain lengths, ``1-3``, ``2`` or ``1+3``; uniform over them
``n``             3000      train split size
``n_validation``  300       validation split size
``n_test``        500       test split size
``shuffled``      0         1: per-question meanings (the control described above)
``balanced``      0         1: balanced tables (see "Balanced tables" below)
``meanings``      ``true``  ``random``: worked solutions use uniformly random meanings
================  ========  ==========================================================

Problems: ``id`` ``operators-{split}-{index}``, ``difficulty`` = chain length,
``data_source`` ``operators``, and ``extra`` with ``family`` (int), ``symbols`` (e.g.
``"#@"``) and ``meanings`` (the true ones, e.g. ``"+x"``) for per-family analysis;
:func:`parse_question` recovers family, operands and symbols from the question text.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import re
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from rllib_exgrpo.envs.problem import Problem

logger = logging.getLogger(__name__)

DATA_SOURCE = "operators"
SPLITS = ("train", "validation", "test")
SYMBOLS = ("#", "@", "&")
MEANINGS = ("+", "-", "x")
OPERANDS = tuple(range(2, 10))
MAX_LENGTH = 3
MAX_FAMILIES = 100
#: Share of the question space held out for each of the validation and test splits.
HELD_OUT_FRACTION = 0.1

DEFAULTS = {
    "seed": 0,
    "families": 24,
    "lengths": (1, 2, 3),
    "n": 3000,
    "n_validation": 300,
    "n_test": 500,
    "shuffled": False,
    "meanings": "true",
    "balanced": False,
}
#: Spec option holding each split's size.
SIZE_OPTION = {"train": "n", "validation": "n_validation", "test": "n_test"}

_QUESTION_RE = re.compile(r"\[F(\d{2})\] ([2-9](?: [#@&] [2-9]){1,3}) =")
#: Draws of one question of length >= 2 before the split is declared too small for it.
_MAX_DRAWS = 20_000

Table = tuple  # tuple (per family) of dict symbol -> tuple of MAX_LENGTH meanings


@dataclass(frozen=True)
class Question:
    """A question's parts: ``family``, ``operands`` (one more than ``symbols``), ``symbols``."""

    family: int
    operands: tuple[int, ...]
    symbols: tuple[str, ...]

    @property
    def length(self) -> int:
        return len(self.symbols)

    @property
    def text(self) -> str:
        chain = " ".join([str(self.operands[0])] + [f"{s} {b}" for s, b in zip(self.symbols, self.operands[1:])])
        return f"{family_tag(self.family)} {chain} ="


def family_tag(family: int) -> str:
    """The tag a question of ``family`` starts with, e.g. ``[F07]``."""
    return f"[F{family:02d}]"


def parse_question(text: str) -> Question:
    """The family, operands and symbols of a question text (``"[F07] 3 # 5 @ 2 ="``).

    Raises:
        ValueError: ``text`` is not an operators question.
    """
    m = _QUESTION_RE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not an operators question: {text!r}")
    tokens = m.group(2).split(" ")
    return Question(int(m.group(1)), tuple(int(t) for t in tokens[0::2]), tuple(tokens[1::2]))


def _as_question(question: Union[Problem, Question, str]) -> Question:
    """A :class:`Question` from a problem, a question or a question text."""
    if isinstance(question, Problem):
        question = question.question
    return parse_question(question) if isinstance(question, str) else question


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big")


def split_of(question: str) -> str:
    """The split a question text belongs to, from a stable hash of the text."""
    bucket = _digest(question) % 10_000
    cut = int(HELD_OUT_FRACTION * 10_000)
    return "test" if bucket < cut else "validation" if bucket < 2 * cut else "train"


def family_tables(seed: int, families: int, balanced: bool = False) -> Table:
    """``tables[family][symbol]`` = the meanings of ``symbol`` at positions 1..3.

    Each family's table is drawn from ``(seed, family)`` alone, so the first families of a
    larger task are those of a smaller one with the same seed.

    ``balanced``: for each (symbol, position) the families' meanings are a shuffled list
    holding each meaning equally often (``families`` a multiple of 3; otherwise as equal as
    can be), shuffled on its own for every (symbol, position). Each family's entry is still
    uniform over the meanings and the entries are drawn independently of each other, but no
    answer that ignores the family beats guessing: with independent draws one meaning is
    the majority by chance (seed 0, 24 families: ``-`` is right on 41% of the one-operation
    questions), and a policy can collapse onto it without learning any family.
    """
    if balanced:
        return _balanced_tables(seed, families)
    out = []
    for f in range(families):
        rng = random.Random(f"operators-table:{seed}:{f}")
        out.append({s: tuple(rng.choice(MEANINGS) for _ in range(MAX_LENGTH)) for s in SYMBOLS})
    return tuple(out)


def _balanced_tables(seed: int, families: int) -> Table:
    columns = {}
    for s in SYMBOLS:
        for k in range(MAX_LENGTH):
            column = [MEANINGS[i % len(MEANINGS)] for i in range(families)]
            random.Random(f"operators-balanced:{seed}:{s}:{k}").shuffle(column)
            columns[(s, k)] = column
    return tuple({s: tuple(columns[(s, k)][f] for k in range(MAX_LENGTH)) for s in SYMBOLS} for f in range(families))


def question_meanings(question: Question, *, seed: int = 0, shuffled: bool = False, tables: Optional[Table] = None) -> tuple[str, ...]:
    """The true meaning of each step of ``question``.

    From the family table (``tables``, else :func:`family_tables` of ``seed``), or with
    ``shuffled`` from a seed derived from ``seed`` and the question text.
    """
    if shuffled:
        rng = random.Random(f"operators-shuffled:{seed}:{question.text}")
        return tuple(rng.choice(MEANINGS) for _ in question.symbols)
    if tables is None:
        tables = family_tables(seed, question.family + 1)
    row = tables[question.family]
    return tuple(row[s][k] for k, s in enumerate(question.symbols))


def _apply(a: int, meaning: str, b: int) -> int:
    if meaning == "+":
        return a + b
    if meaning == "-":
        return a - b
    if meaning == "x":
        return a * b
    raise ValueError(f"unknown meaning {meaning!r}; known: {list(MEANINGS)}")


def _check_meanings(question: Question, meanings: Sequence[str]) -> None:
    if len(meanings) != question.length:
        raise ValueError(f"{question.length} meanings needed for {question.text!r}, got {len(meanings)}")


def evaluate(question: Question, meanings: Sequence[str]) -> int:
    """The value of ``question`` left to right with ``meanings[k]`` for step ``k``."""
    _check_meanings(question, meanings)
    running = question.operands[0]
    for meaning, b in zip(meanings, question.operands[1:]):
        running = _apply(running, meaning, b)
    return running


def worked_solution(question: Question, meanings: Sequence[str]) -> str:
    """The worked solution of ``question`` under ``meanings`` (true or guessed)::

    3 # 5 = 3 + 5 = 8, 8 @ 2 = 8 x 2 = 16. \\boxed{16}
    """
    _check_meanings(question, meanings)
    steps, running = [], question.operands[0]
    for symbol, meaning, b in zip(question.symbols, meanings, question.operands[1:]):
        result = _apply(running, meaning, b)
        steps.append(f"{running} {symbol} {b} = {running} {meaning} {b} = {result}")
        running = result
    return ", ".join(steps) + f". \\boxed{{{running}}}"


def random_meanings(length: int, rng: random.Random) -> tuple[str, ...]:
    """``length`` meanings drawn uniformly and independently."""
    return tuple(rng.choice(MEANINGS) for _ in range(length))


def random_meaning_solution(question: Union[Problem, Question, str], rng: random.Random) -> str:
    """A worked solution of ``question`` (a :class:`Problem`, :class:`Question` or question
    text) under meanings drawn uniformly from ``rng``: right format and arithmetic, guessed
    meanings (a warm-start corpus that does not give the tables away)."""
    question = _as_question(question)
    return worked_solution(question, random_meanings(question.length, rng))


_STEP_RE = re.compile(r"(-?\d+) ([#@&]) (\d+) = (-?\d+) ([+x-]) (\d+) = (-?\d+)")
_BOXED_RE = re.compile(r"\. \\boxed\{(-?\d+)\}")


def read_worked_solution(question: Union[Problem, Question, str], completion: str) -> Optional[tuple[str, ...]]:
    """The meanings a completion used, if it is a well-formed worked solution of ``question``
    whose arithmetic is right under those meanings (whatever they are); else ``None``.

    Well-formed means exactly the shape of :func:`worked_solution`: one step per operation
    in order, each restating the question's running value, symbol and operand, then the
    boxed last result (trailing text after the box is ignored). This separates what a warm
    start must get right (format and arithmetic) from what it must not know (the tables):
    the share of completions that read back is its *self-consistency*.
    """
    question = _as_question(question)
    body, sep, _ = completion.partition("}")
    if not sep:
        return None
    steps_text, box = body.rsplit(". \\boxed{", 1) if ". \\boxed{" in body else (None, None)
    if steps_text is None or not re.fullmatch(r"-?\d+", box):
        return None
    parts = steps_text.split(", ")
    if len(parts) != question.length:
        return None
    used, running = [], question.operands[0]
    for part, symbol, b in zip(parts, question.symbols, question.operands[1:]):
        m = _STEP_RE.fullmatch(part)
        if not m:
            return None
        a1, s, b1, a2, meaning, b2, result = m.groups()
        if (int(a1), s, int(b1)) != (running, symbol, b) or (int(a2), int(b2)) != (running, b):
            return None
        if int(result) != _apply(running, meaning, b):
            return None
        used.append(meaning)
        running = int(result)
    if int(box) != running:
        return None
    return tuple(used)


def guessing_rate(question: Union[Problem, Question, str], answer: int) -> float:
    """The chance that meanings drawn uniformly give ``answer`` on ``question``: the exact
    pass@1 of a policy that computes right and guesses every meaning (about 1/3, 1/9, 1/27
    by chain length; more where two meanings coincide, as in ``2 + 2 = 2 x 2``)."""
    question = _as_question(question)
    combos = list(itertools.product(MEANINGS, repeat=question.length))
    return sum(evaluate(question, m) == answer for m in combos) / len(combos)


# --------------------------------------------------------------------------- generation


def _draw(rng: random.Random, families: int, length: int) -> Question:
    return Question(
        rng.randrange(families), tuple(rng.choice(OPERANDS) for _ in range(length + 1)), tuple(rng.choice(SYMBOLS) for _ in range(length))
    )


def _one_op_pool(seed: int, families: int, split: str) -> list[Question]:
    """Every one-operation question of ``split``, in a seeded order."""
    pool = [Question(f, (a, b), (s,)) for f in range(families) for s in SYMBOLS for a in OPERANDS for b in OPERANDS]
    pool = [q for q in pool if split_of(q.text) == split]
    random.Random(f"operators-pool:{seed}:{split}").shuffle(pool)
    return pool


def _validate(n, split, seed, families, lengths, shuffled, meanings, balanced=False) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} for the operators source, got {split!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if isinstance(families, bool) or not isinstance(families, int) or not 1 <= families <= MAX_FAMILIES:
        raise ValueError(f"families must be an int from 1 to {MAX_FAMILIES}, got {families!r}")
    if not lengths or any(isinstance(x, bool) or x not in range(1, MAX_LENGTH + 1) for x in lengths):
        raise ValueError(f"lengths must be chain lengths from 1 to {MAX_LENGTH}, got {lengths!r}")
    if not isinstance(shuffled, bool):
        raise ValueError(f"shuffled must be a bool, got {shuffled!r}")
    if not isinstance(balanced, bool):
        raise ValueError(f"balanced must be a bool, got {balanced!r}")
    if meanings not in ("true", "random"):
        raise ValueError(f"meanings must be 'true' or 'random', got {meanings!r}")


def generate(
    n: int,
    *,
    split: str = "train",
    seed: int = DEFAULTS["seed"],
    families: int = DEFAULTS["families"],
    lengths: Sequence[int] = DEFAULTS["lengths"],
    shuffled: bool = DEFAULTS["shuffled"],
    meanings: str = DEFAULTS["meanings"],
    balanced: bool = DEFAULTS["balanced"],
) -> list[Problem]:
    """``n`` distinct problems of one split (see the module docstring).

    Args:
        n: Number of problems.
        split: ``"train"``, ``"validation"`` or ``"test"``; no two share a question.
        seed: Task seed (family tables, questions, per-question draws).
        families: Number of families (1-100).
        lengths: Chain lengths to draw from, uniformly.
        shuffled: Per-question meanings instead of the family tables (the control).
        meanings: ``"true"``: worked solutions use the true meanings; ``"random"``: meanings
            drawn uniformly per problem (from the seed and the question). ``ground_truth``
            is the true answer either way.
        balanced: Balanced tables (:func:`family_tables`): no family-blind answer beats
            guessing.

    Raises:
        ValueError: a bad argument, or ``lengths`` holding too few questions of ``split``.
    """
    lengths = tuple(sorted(set(lengths))) if lengths else ()
    _validate(n, split, seed, families, lengths, shuffled, meanings, balanced)
    tables = family_tables(seed, families, balanced)
    rng = random.Random(f"operators:{seed}:{split}:{families}")
    pool = _one_op_pool(seed, families, split) if 1 in lengths else []
    live = list(lengths)
    seen: set[str] = set()
    problems: list[Problem] = []
    while len(problems) < n:
        length = rng.choice(live)
        if length == 1:
            question = _pop_one_op(pool, live, split, families, n, len(problems))
            if question is None:
                continue
        else:
            question = _draw_unseen(rng, seen, split, families, length, lengths, n, len(problems))
        seen.add(question.text)
        problems.append(
            _problem(question, f"{DATA_SOURCE}-{split}-{len(problems)}", seed=seed, shuffled=shuffled, tables=tables, meanings=meanings)
        )
    return problems


def _pop_one_op(pool: list[Question], live: list[int], split: str, families: int, n: int, made: int) -> Optional[Question]:
    """The next unused one-operation question, or None when all are used: length 1 then
    leaves ``live`` (an error when no length is left; ``made`` of ``n`` problems so far)."""
    if pool:
        return pool.pop()
    live.remove(1)
    if not live:
        raise ValueError(
            f"lengths=1 with families={families} has only {made} {split} questions, "
            f"{n} asked for; add families or lengths, or ask for fewer"
        )
    logger.info("operators %s: all %d one-operation questions used; longer chains fill the rest", split, made)
    return None


def _draw_unseen(
    rng: random.Random, seen: set[str], split: str, families: int, length: int, lengths: Sequence[int], n: int, made: int
) -> Question:
    """A new question of ``length`` operations that belongs to ``split`` (at most
    :data:`_MAX_DRAWS` draws; ``made`` of ``n`` problems so far)."""
    for _ in range(_MAX_DRAWS):
        question = _draw(rng, families, length)
        if question.text not in seen and split_of(question.text) == split:
            return question
    raise ValueError(
        f"families={families} with lengths={list(lengths)} cannot provide {n} distinct {split} "
        f"questions (stuck at {made}); add families or ask for fewer"
    )


def _problem(question: Question, problem_id: str, *, seed: int, shuffled: bool, tables, meanings: str) -> Problem:
    """The problem of a question: its true answer, and a worked solution with the true
    meanings (``meanings="true"``) or with meanings drawn from the seed and the question."""
    true = question_meanings(question, seed=seed, shuffled=shuffled, tables=tables)
    if meanings == "random":
        shown = random_meanings(question.length, random.Random(f"operators-guess:{seed}:{question.text}"))
    else:
        shown = true
    return Problem(
        id=problem_id,
        question=question.text,
        ground_truth=str(evaluate(question, true)),
        data_source=DATA_SOURCE,
        solution=worked_solution(question, shown),
        difficulty=question.length,
        extra={"family": question.family, "symbols": "".join(question.symbols), "meanings": "".join(true)},
    )


# --------------------------------------------------------------------------- spec


def _bad(spec: str, key: str, value: str, want: str) -> ValueError:
    return ValueError(f"bad operators option {key}={value!r} in {spec!r}: {want}")


def _int(spec: str, key: str, value: str, lo: Optional[int], hi: Optional[int] = None) -> int:
    want = f"an integer from {lo} to {hi}" if hi is not None else f"an integer >= {lo}" if lo is not None else "an integer"
    try:
        out = int(value)
    except ValueError:
        raise _bad(spec, key, value, f"{key} must be {want}") from None
    if (lo is not None and out < lo) or (hi is not None and out > hi):
        raise _bad(spec, key, value, f"{key} must be {want}")
    return out


def _lengths(spec: str, value: str) -> tuple[int, ...]:
    want = f"lengths are written 1-3, 2 or 1+3, each from 1 to {MAX_LENGTH}"
    try:
        if "-" in value:
            lo, hi = (int(x) for x in value.split("-", 1))
            out = tuple(range(lo, hi + 1))
        else:
            out = tuple(int(x) for x in value.split("+"))
    except ValueError:
        raise _bad(spec, "lengths", value, want) from None
    if not out or any(x not in range(1, MAX_LENGTH + 1) for x in out):
        raise _bad(spec, "lengths", value, want)
    return tuple(sorted(set(out)))


def parse_spec(spec: str) -> dict:
    """Parse ``"operators"`` or ``"operators:seed=3,families=8,lengths=1-3,n=3000"``.

    Returns every option (defaults filled in): the keyword arguments of :func:`generate`
    plus the split sizes ``n``, ``n_validation`` and ``n_test``. A bad option name or
    value raises ``ValueError`` with a one-line message naming the option.
    """
    name, _, rest = spec.partition(":")
    if name != DATA_SOURCE:
        raise ValueError(f"not an operators spec: {spec!r}")
    out = dict(DEFAULTS)
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = (x.strip() for x in part.partition("="))
        if not sep:
            raise ValueError(f"bad operators option {part!r} in {spec!r}; expected key=value")
        if key == "seed":
            out[key] = _int(spec, key, value, None)
        elif key == "families":
            out[key] = _int(spec, key, value, 1, MAX_FAMILIES)
        elif key in ("n", "n_validation", "n_test"):
            out[key] = _int(spec, key, value, 0)
        elif key == "lengths":
            out[key] = _lengths(spec, value)
        elif key in ("shuffled", "balanced"):
            if value not in ("0", "1"):
                raise _bad(spec, key, value, f"{key} must be 0 or 1")
            out[key] = value == "1"
        elif key == "meanings":
            if value not in ("true", "random"):
                raise _bad(spec, key, value, "meanings must be 'true' or 'random'")
            out[key] = value
        else:
            raise ValueError(f"unknown operators option {key!r} in {spec!r}; known: {', '.join(DEFAULTS)}")
    return out


def generate_from_spec(spec: str, split: str = "train", limit: Optional[int] = None) -> list[Problem]:
    """The problems of ``split`` for a spec: its split size, at most ``limit``."""
    opts = parse_spec(spec)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} for {spec!r}, got {split!r}")
    n = opts[SIZE_OPTION[split]]
    if limit is not None:
        n = min(n, limit)
    return generate(n, split=split, **{k: opts[k] for k in ("seed", "families", "lengths", "shuffled", "meanings", "balanced")})


def family_blind_accuracy(spec: str, split: str = "test") -> dict[int, float]:
    """Accuracy by chain length, on ``split`` of the task ``spec``, of the best answers that
    ignore the family tag: every step uses the meaning its (symbol, position) has in most
    families (ties: the first in :data:`MEANINGS`). A policy above it on one-operation
    questions has learnt something family-specific."""
    from collections import Counter

    opts = parse_spec(spec)
    tables = family_tables(opts["seed"], opts["families"], opts["balanced"])
    blind = {(s, k): Counter(t[s][k] for t in tables).most_common(1)[0][0] for s in SYMBOLS for k in range(MAX_LENGTH)}
    hits: dict[int, list[int]] = {}
    for p in generate_from_spec(spec, split=split):
        q = parse_question(p.question)
        guess = evaluate(q, [blind[(s, k)] for k, s in enumerate(q.symbols)])
        hits.setdefault(q.length, []).append(int(str(guess) == str(p.ground_truth)))
    return {length: sum(v) / len(v) for length, v in sorted(hits.items())}
