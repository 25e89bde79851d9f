"""The embedded arithmetic problem family: no download, deterministic, with a difficulty knob.

This is what the main job trains on by default. Every problem is generated from
``(seed, split, index)`` alone, so two machines with the same seed see the same data.

Difficulty levels (``LEVELS``), easy to hard:

1. one operation on one-digit numbers            ``What is 7 + 5?``
2. addition / subtraction of two-digit numbers   ``What is 37 + 45?``
3. a two-digit number times a one-digit number   ``What is 23 * 4?``
4. two operations on two-digit numbers           ``What is 37 + 45 - 18?``
5. a two-step word problem                       ``Tom has 37 apples...``
6. three operations, up to three digits          ``What is 120 - 37 + 45 - 9?``

Train and held-out splits never overlap: a problem belongs to the held-out split when a
stable hash of its question text falls in the held-out fraction, and each split's
generator rejects problems of the other split.

Every problem carries a short worked solution ending in ``\\boxed{answer}``; it is used for
the supervised warm start of the embedded tiny model and never shown to the policy.
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable, Iterable, Optional, Sequence

from rllib_exgrpo.envs.problem import Problem

DATA_SOURCE = "arithmetic"
LEVELS = (1, 2, 3, 4, 5, 6)
SPLITS = ("train", "test")
#: Share of the whole problem space that belongs to the held-out ("test") split.
HELD_OUT_FRACTION = 0.1

_NAMES = ("Tom", "Ana", "Li", "Sam", "Mia", "Omar", "Eva", "Raj")
_ITEMS = ("apples", "books", "coins", "marbles", "stamps", "cards", "shells", "pens")


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big")


def split_of(question: str) -> str:
    """The split a question belongs to, from a stable hash of its text."""
    return "test" if (_digest(question) % 10_000) < HELD_OUT_FRACTION * 10_000 else "train"


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _chain(rng: random.Random, n_ops: int, lo: int, hi: int, ops: str = "+-"):
    """Operands and operators for ``n_ops`` operations, kept non-negative at every step."""
    values = [rng.randint(lo, hi)]
    operators: list[str] = []
    running = values[0]
    for _ in range(n_ops):
        op = rng.choice(ops)
        b = rng.randint(lo, hi)
        if op == "-" and b > running:
            op = "+"
        operators.append(op)
        values.append(b)
        running = _apply(running, op, b)
    return values, operators


def _worked(values: Sequence[int], operators: Sequence[str]) -> tuple[str, int]:
    steps, running = [], values[0]
    for op, b in zip(operators, values[1:]):
        result = _apply(running, op, b)
        steps.append(f"{running} {op} {b} = {result}")
        running = result
    return ", ".join(steps) + f". \\boxed{{{running}}}", running


def _expression_problem(values, operators) -> tuple[str, str, str]:
    expr = " ".join([str(values[0])] + [f"{op} {b}" for op, b in zip(operators, values[1:])])
    solution, answer = _worked(values, operators)
    return f"What is {expr}?", solution, str(answer)


def _level_1(rng):
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    op = rng.choice("+-*")
    if op == "-" and b > a:
        a, b = b, a
    return _expression_problem([a, b], [op])


def _level_2(rng):
    return _expression_problem(*_chain(rng, 1, 10, 99))


def _level_3(rng):
    return _expression_problem([rng.randint(10, 99), rng.randint(2, 9)], ["*"])


def _level_4(rng):
    return _expression_problem(*_chain(rng, 2, 10, 99))


def _level_5(rng):
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    c = rng.randint(1, a + b)
    question = f"{name} has {a} {item}. {name} gets {b} more and then gives away {c}. How many {item} does {name} have now?"
    solution, answer = _worked([a, b, c], ["+", "-"])
    return question, solution, str(answer)


def _level_6(rng):
    return _expression_problem(*_chain(rng, 3, 1, 199))


_GENERATORS: dict[int, Callable[[random.Random], tuple[str, str, str]]] = {
    1: _level_1,
    2: _level_2,
    3: _level_3,
    4: _level_4,
    5: _level_5,
    6: _level_6,
}


def _validate(n: int, split: str, levels: Sequence[int], weights: Optional[Sequence[float]]):
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not levels:
        raise ValueError("levels must name at least one difficulty level")
    unknown = [lv for lv in levels if lv not in _GENERATORS]
    if unknown:
        raise ValueError(f"unknown arithmetic levels {unknown}; known levels are {list(LEVELS)}")
    if weights is not None and (len(weights) != len(levels) or min(weights) < 0 or sum(weights) <= 0):
        raise ValueError("level_weights must be non-negative, one per level, and not all zero")


def generate(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    levels: Sequence[int] = (1, 2, 3, 4),
    level_weights: Optional[Sequence[float]] = None,
    order: str = "shuffle",
) -> list[Problem]:
    """Generate ``n`` distinct problems of one split.

    Args:
        n: Number of problems.
        split: ``"train"`` or ``"test"`` (held-out); the two never share a question.
        seed: Everything is a pure function of ``seed`` (and the other arguments).
        levels: Difficulty levels to draw from (see the module docstring).
        level_weights: Relative share of each level; uniform by default.
        order: ``"shuffle"`` (levels interleaved) or ``"curriculum"`` (easy to hard).

    Raises:
        ValueError: on an unknown split, level or order, or when the requested levels
            cannot provide ``n`` distinct problems.
    """
    _validate(n, split, levels, level_weights)
    if order not in ("shuffle", "curriculum"):
        raise ValueError(f"order must be 'shuffle' or 'curriculum', got {order!r}")
    rng = random.Random(f"arithmetic:{seed}:{split}")
    weights = list(level_weights) if level_weights is not None else [1.0] * len(levels)
    seen: set[str] = set()
    problems: list[Problem] = []
    attempts, max_attempts = 0, 50 * n + 1000
    while len(problems) < n:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(
                f"levels {list(levels)} cannot provide {n} distinct {split} problems "
                f"(got {len(problems)}); add harder levels or ask for fewer"
            )
        level = rng.choices(levels, weights=weights)[0]
        question, solution, answer = _GENERATORS[level](rng)
        if question in seen or split_of(question) != split:
            continue
        seen.add(question)
        problems.append(
            Problem(
                id=f"arith-{split}-L{level}-{_digest(question):016x}",
                question=question,
                ground_truth=answer,
                data_source=DATA_SOURCE,
                solution=solution,
                difficulty=level,
            )
        )
    if order == "curriculum":
        problems.sort(key=lambda p: p.difficulty)
    return problems


def parse_spec(spec: str) -> dict:
    """Parse a dataset spec such as ``"arithmetic"`` or ``"arithmetic:levels=1-4,n=5000"``.

    Recognised keys: ``levels`` (``1-4`` or ``1+3+5``), ``n`` (train size), ``n_test``,
    ``seed``, ``order``. Returns keyword arguments for :func:`generate` plus ``n`` and
    ``n_test``.
    """
    name, _, rest = spec.partition(":")
    if name != DATA_SOURCE:
        raise ValueError(f"not an arithmetic spec: {spec!r}")
    out: dict = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"bad arithmetic option {part!r} in {spec!r}; expected key=value")
        if key == "levels":
            if "-" in value:
                lo, hi = (int(x) for x in value.split("-", 1))
                out["levels"] = tuple(range(lo, hi + 1))
            else:
                out["levels"] = tuple(int(x) for x in value.split("+"))
        elif key in ("n", "n_test", "seed"):
            out[key] = int(value)
        elif key == "order":
            out["order"] = value
        else:
            raise ValueError(f"unknown arithmetic option {key!r} in {spec!r}; known: levels, n, n_test, seed, order")
    return out


def iter_levels(problems: Iterable[Problem]) -> dict[int, int]:
    """Count problems per difficulty level (for logs and tests)."""
    counts: dict[int, int] = {}
    for p in problems:
        counts[p.difficulty] = counts.get(p.difficulty, 0) + 1
    return dict(sorted(counts.items()))
