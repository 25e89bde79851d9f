"""Turn a data source into a list of :class:`~rllib_exgrpo.envs.problem.Problem`, loudly.

Sources:

* ``"arithmetic"`` or ``"arithmetic:levels=1-4,n=5000,n_test=500,seed=0"``: the embedded
  family (:mod:`rllib_exgrpo.envs.arithmetic`); ``split`` picks ``"train"`` (``n``, default 5000) or
  ``"test"`` (``n_test``, default 500), levels 1-4 by default.
* ``"operators"`` or ``"operators:seed=0,families=24,lengths=1-3,n=3000"``: the embedded
  hidden-operator family (:mod:`rllib_exgrpo.envs.operators`); ``split`` picks ``"train"`` (``n``,
  default 3000), ``"validation"`` (``n_validation``, 300) or ``"test"`` (``n_test``, 500).
* A ``.jsonl``, ``.json`` (a JSON array of rows, or JSON lines) or ``.parquet`` file.
  A file is one split: ``split`` is ignored for files.

Row shapes understood without configuration:

* ``problem`` or ``question`` + ``answer`` (a string or a number). GSM8K answers, which end
  in ``#### <n>``, keep only ``<n>`` with thousands commas removed. Integral floats
  (AMC's ``27.0``) become ``"27"``.
* The verl row: ``prompt`` = list of chat messages (the last user message's content is the
  question, taken verbatim), ``reward_model.ground_truth``, ``data_source``.
* Anything else through ``field_map``, e.g. ``{"question": "input", "ground_truth":
  "target", "id": "uid"}``; values may be dotted paths into nested dicts
  (``"reward_model.ground_truth"``). Known keys: see :data:`FIELD_MAP_KEYS`.

Ids: ``f"{stem}-{row id}"`` when the row has an ``id``, ``idx`` or ``unique_id`` field (the
stem prefix keeps ids unique when benchmarks are mixed), else ``f"{stem}-{line}"``;
a repeated id gets ``#2``, ``#3``... appended (the ExGRPO valid file repeats AIME rows).

Bad rows (bad JSON, missing or empty question/answer, wrong type): with ``strict=True`` a
:class:`DataFormatError` naming file, line and reason; otherwise a warning on logger
``rllib_exgrpo.envs.datasets`` per bad row and the row is skipped. The returned list is a
:class:`ProblemList` whose ``skipped`` attribute counts the skipped rows and whose
``errors`` holds their :class:`DataFormatError` s, so no skip goes unnoticed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from rllib_exgrpo.envs import arithmetic, operators
from rllib_exgrpo.envs.problem import Problem

logger = logging.getLogger("rllib_exgrpo.envs.datasets")

FIELD_MAP_KEYS = ("question", "ground_truth", "id", "data_source", "solution", "difficulty")
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")
DEFAULT_ARITHMETIC_N = 5000
DEFAULT_ARITHMETIC_N_TEST = 500
DEFAULT_ARITHMETIC_LEVELS = (1, 2, 3, 4)
#: Per-row warnings logged per file before switching to a single summary line.
MAX_ROW_WARNINGS = 100

_QUESTION_KEYS = ("problem", "question")
_ANSWER_KEYS = ("answer", "ground_truth")
_ID_KEYS = ("id", "idx", "unique_id")
_CONSUMED = {"problem", "question", "answer", "ground_truth", "prompt", "reward_model", "solution", "data_source", "id", "idx", "unique_id"}


class DataFormatError(ValueError):
    """A row that cannot become a :class:`Problem`. ``str(e) == f"{path}:{line}: {reason}"``."""

    def __init__(self, path: Union[str, os.PathLike], line: int, reason: str):
        self.path, self.line, self.reason = str(path), line, reason
        super().__init__(f"{self.path}:{line}: {reason}")

    def __reduce__(self):  # keep it picklable across Ray / multiprocessing
        return (type(self), (self.path, self.line, self.reason))


class ProblemList(list):
    """A ``list[Problem]`` that also says what was left out.

    Attributes:
        source: What was loaded.
        skipped: Number of malformed rows skipped (always 0 with ``strict=True``).
        errors: One :class:`DataFormatError` per skipped row.
    """

    def __init__(self, problems=(), *, source: str = "", errors: Optional[list] = None):
        super().__init__(problems)
        self.source = source
        self.errors: list[DataFormatError] = list(errors or [])

    @property
    def skipped(self) -> int:
        return len(self.errors)


# --------------------------------------------------------------------------- rows


def _get(row: dict, path: str) -> Any:
    cur: Any = row
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _first(row: dict, keys) -> tuple[Optional[str], Any]:
    for key in keys:
        if row.get(key) is not None:
            return key, row[key]
    return None, None


def _question_of(row: dict, field_map: dict) -> str:
    if "question" in field_map:
        value, where = _get(row, field_map["question"]), field_map["question"]
    else:
        where, value = _first(row, _QUESTION_KEYS)
        if value is None and row.get("prompt") is not None:
            where, value = "prompt", row["prompt"]
    if value is None:
        raise ValueError(f"missing question field ({where or ' / '.join(_QUESTION_KEYS + ('prompt',))})")
    if isinstance(value, (list, tuple)):  # verl: chat messages
        users = [m for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise ValueError(f"{where!r} holds no user message")
        value = users[-1].get("content")
        where = f"{where} user message content"
    if not isinstance(value, str):
        raise ValueError(f"question ({where}) must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"empty question ({where})")
    return value


def _gsm8k(answer: str) -> str:
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def _answer_of(row: dict, field_map: dict) -> str:
    if "ground_truth" in field_map:
        where = field_map["ground_truth"]
        value = _get(row, where)
    elif _get(row, "reward_model.ground_truth") is not None:
        where, value = "reward_model.ground_truth", _get(row, "reward_model.ground_truth")
    else:
        where, value = _first(row, _ANSWER_KEYS)
    if value is None:
        raise ValueError(f"missing answer field ({where or ' / '.join(_ANSWER_KEYS + ('reward_model.ground_truth',))})")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"answer ({where}) must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"answer ({where}) is not a finite number: {value!r}")
        value = str(int(value)) if value.is_integer() else repr(value)
    elif isinstance(value, int):
        value = str(value)
    elif "####" in value:
        value = _gsm8k(value)
    value = value.strip()
    if not value:
        raise ValueError(f"empty answer ({where})")
    return value


def _optional_str(row: dict, field_map: dict, key: str, default_keys) -> Optional[str]:
    value = _get(row, field_map[key]) if key in field_map else _first(row, default_keys)[1]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{key} must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _difficulty_of(row: dict, field_map: dict) -> Optional[int]:
    value = _get(row, field_map["difficulty"]) if "difficulty" in field_map else row.get("level")
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):  # "Level 3" in the MATH train set
        m = re.fullmatch(r"\s*(?:level\s*)?(\d+)\s*", value, re.IGNORECASE)
        return int(m.group(1)) if m else None
    return None


def _row_to_problem(row: Any, *, line: int, stem: str, field_map: dict, data_source: Optional[str]) -> Problem:
    if not isinstance(row, dict):
        raise ValueError(f"row is not an object but {type(row).__name__}")
    question = _question_of(row, field_map)
    answer = _answer_of(row, field_map)
    raw_id = _optional_str(row, field_map, "id", _ID_KEYS)
    source = data_source or _optional_str(row, field_map, "data_source", ("data_source",)) or stem
    solution = _get(row, field_map["solution"]) if "solution" in field_map else row.get("solution")
    extra = {k: v for k, v in row.items() if k not in _CONSUMED and isinstance(v, (str, int, float, bool))}
    extra["line"] = line
    return Problem(
        id=f"{stem}-{raw_id}" if raw_id is not None else f"{stem}-{line}",
        question=question,
        ground_truth=answer,
        data_source=source,
        solution=solution if isinstance(solution, str) else None,
        difficulty=_difficulty_of(row, field_map),
        extra=extra,
    )


# --------------------------------------------------------------------------- files


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any, Optional[str]]]:
    with open(path, encoding="utf-8") as fh:
        for line_no, text in enumerate(fh, start=1):
            if not text.strip():
                continue  # blank lines are layout, not rows
            try:
                yield line_no, json.loads(text), None
            except json.JSONDecodeError as exc:
                yield line_no, None, f"invalid JSON: {exc.msg} (column {exc.colno})"


def _iter_json(path: Path) -> Iterator[tuple[int, Any, Optional[str]]]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # really JSON lines under a .json name
            yield from _iter_jsonl(path)
            return
        raise DataFormatError(path, exc.lineno, f"invalid JSON: {exc.msg} (column {exc.colno})") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}
    if isinstance(data, dict):  # a single JSON-lines row that happens to be the whole file
        yield 1, data, None
        return
    if not isinstance(data, list):
        raise DataFormatError(path, 1, f"expected a JSON array of rows, got {type(data).__name__}")
    for i, row in enumerate(data, start=1):  # "line" = element number for arrays
        yield i, row, None


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any, Optional[str]]]:
    import pyarrow.parquet as pq

    # to_pylist gives plain lists/dicts (pandas would give numpy arrays of dicts).
    for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield i, row, None


_READERS = {".jsonl": _iter_jsonl, ".json": _iter_json, ".parquet": _iter_parquet}


def _load_file(path: Path, *, field_map: dict, strict: bool, data_source: Optional[str], limit: Optional[int]) -> ProblemList:
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {path}")
    if path.is_dir():
        raise IsADirectoryError(f"expected a data file, got a directory: {path}")
    suffix = path.suffix.lower()
    if suffix not in _READERS:
        raise ValueError(
            f"unsupported data file extension {path.suffix!r} for {path}; "
            f"supported: {', '.join(SUPPORTED_SUFFIXES)} (or the 'arithmetic' / 'operators' sources)"
        )
    stem = path.stem
    problems: list[Problem] = []
    errors: list[DataFormatError] = []
    for line, row, parse_error in _READERS[suffix](path):
        if limit is not None and len(problems) >= limit:
            break
        try:
            if parse_error is not None:
                raise ValueError(parse_error)
            problems.append(_row_to_problem(row, line=line, stem=stem, field_map=field_map, data_source=data_source))
        except ValueError as exc:
            err = DataFormatError(path, line, str(exc))
            if strict:
                raise err from None
            errors.append(err)
            if len(errors) <= MAX_ROW_WARNINGS:
                logger.warning("skipping malformed row %s", err)
    if errors:
        more = len(errors) - MAX_ROW_WARNINGS
        logger.warning(
            "%s: skipped %d malformed row(s), kept %d%s",
            path,
            len(errors),
            len(problems),
            f" ({more} not logged individually)" if more > 0 else "",
        )
        if not problems:
            raise ValueError(
                f"no usable rows in {path}: all {len(errors)} rows malformed (first: {errors[0].reason}); "
                "wrong file or a missing field_map?"
            )
    return ProblemList(_unique_ids(problems), source=str(path), errors=errors)


def _unique_ids(problems: list[Problem]) -> list[Problem]:
    seen: dict[str, int] = {}
    out, renamed = [], 0
    for p in problems:
        n = seen.get(p.id, 0) + 1
        seen[p.id] = n
        if n > 1:
            new_id = f"{p.id}#{n}"
            while new_id in seen:  # "x#2" may itself be a real id
                n += 1
                new_id = f"{p.id}#{n}"
            seen[p.id] = n
            seen[new_id] = 1
            p = dataclasses.replace(p, id=new_id)
            renamed += 1
        out.append(p)
    if renamed:
        logger.info("%d repeated problem ids made unique with a '#n' suffix", renamed)
    return out


# --------------------------------------------------------------------------- public


#: The embedded families a dataset spec can name (``"<name>"`` or ``"<name>:<options>"``).
BUILTIN_SOURCES = (arithmetic.DATA_SOURCE, operators.DATA_SOURCE)


def builtin_source(source: Any) -> Optional[str]:
    """The embedded family a spec names (``"arithmetic"``, ``"operators"``), else None.

    Only the text is looked at: callers that also accept files check first that no file
    of that name exists.
    """
    if not isinstance(source, str):
        return None
    name = source.partition(":")[0]
    return name if name in BUILTIN_SOURCES else None


def builtin_splits(name: str) -> tuple:
    """The splits of the embedded family ``name``."""
    return arithmetic.SPLITS if name == arithmetic.DATA_SOURCE else operators.SPLITS


def parse_builtin_spec(source: str) -> dict:
    """Parse a spec of an embedded family; ValueError (one line) on a bad option."""
    module = arithmetic if builtin_source(source) == arithmetic.DATA_SOURCE else operators
    return module.parse_spec(source)


def _is_arithmetic_spec(source: str) -> bool:
    return source == arithmetic.DATA_SOURCE or source.startswith(arithmetic.DATA_SOURCE + ":")


def _load_operators(spec: str, split: str, data_source: Optional[str], limit: Optional[int]) -> ProblemList:
    problems = operators.generate_from_spec(spec, split, limit)
    if data_source:
        problems = [dataclasses.replace(p, data_source=data_source) for p in problems]
    return ProblemList(problems, source=spec)


def _load_arithmetic(spec: str, split: str, data_source: Optional[str], limit: Optional[int]) -> ProblemList:
    opts = arithmetic.parse_spec(spec)
    n_train = opts.pop("n", DEFAULT_ARITHMETIC_N)
    n_test = opts.pop("n_test", DEFAULT_ARITHMETIC_N_TEST)
    opts.setdefault("levels", DEFAULT_ARITHMETIC_LEVELS)
    if split not in arithmetic.SPLITS:
        raise ValueError(f"split must be one of {arithmetic.SPLITS} for {spec!r}, got {split!r}")
    n = n_train if split == "train" else n_test
    if limit is not None:
        n = min(n, limit)
    problems = arithmetic.generate(n, split=split, **opts)
    if data_source:
        problems = [dataclasses.replace(p, data_source=data_source) for p in problems]
    return ProblemList(problems, source=spec)


def load_problems(
    source: Union[str, os.PathLike],
    *,
    split: str = "train",
    field_map: Optional[dict] = None,
    strict: bool = False,
    data_source: Optional[str] = None,
    limit: Optional[int] = None,
    skip: int = 0,
) -> ProblemList:
    """Load problems from ``source`` (see the module docstring for what is understood).

    Args:
        source: ``"arithmetic[:opts]"``, ``"operators[:opts]"`` or a path to a ``.jsonl`` /
            ``.json`` / ``.parquet`` file.
        split: ``"train"`` or ``"test"`` for the arithmetic source, ``"train"``,
            ``"validation"`` or ``"test"`` for the operators source; ignored for files.
        field_map: Row field names (or dotted paths) for ``question``, ``ground_truth``,
            ``id``, ``data_source``, ``solution``, ``difficulty``.
        strict: Raise :class:`DataFormatError` on the first malformed row instead of
            skipping it with a warning.
        data_source: Overrides every problem's ``data_source``.
        limit: Keep at most this many problems (the first ones after ``skip``).
        skip: Leave out the first ``skip`` problems (e.g. train on a file's rows after the
            first N while evaluating on those N: ``skip=N`` here, ``limit=N`` there).

    Returns:
        A :class:`ProblemList` (a ``list`` of :class:`Problem`) with ``.skipped`` and ``.errors``.

    Raises:
        DataFormatError: ``strict`` and a malformed row.
        FileNotFoundError: the file does not exist.
        ValueError: unknown extension, bad option, or no usable row at all.
    """
    field_map = dict(field_map or {})
    unknown = sorted(set(field_map) - set(FIELD_MAP_KEYS))
    if unknown:
        raise ValueError(f"unknown field_map keys {unknown}; known keys: {list(FIELD_MAP_KEYS)}")
    bad = {k: v for k, v in field_map.items() if not isinstance(v, str) or not v}
    if bad:
        raise ValueError(f"field_map values must be non-empty field names, got {bad}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"skip must be a non-negative int, got {skip!r}")
    wanted = None if limit is None else skip + limit
    if isinstance(source, str) and _is_arithmetic_spec(source) and not os.path.exists(source):
        loaded = _load_arithmetic(source, split, data_source, wanted)
    elif isinstance(source, str) and builtin_source(source) == operators.DATA_SOURCE and not os.path.exists(source):
        loaded = _load_operators(source, split, data_source, wanted)
    elif not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be a path, 'arithmetic[:opts]' or 'operators[:opts]', got {type(source).__name__}")
    else:
        loaded = _load_file(Path(source).expanduser(), field_map=field_map, strict=strict, data_source=data_source, limit=wanted)
    if not skip:
        return loaded
    if len(loaded) <= skip:
        raise ValueError(f"{source}: skip={skip} leaves no problem (only {len(loaded)} usable)")
    return ProblemList(loaded[skip:], source=loaded.source, errors=loaded.errors)
