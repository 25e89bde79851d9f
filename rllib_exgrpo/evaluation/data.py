"""Benchmark sources for evaluation, loaded strictly (a malformed row is an error).

A row repeated in a file (the same data source, question, answer and, for chat rows, the
same system message: the official ExGRPO valid set repeats AIME 8 times and AMC 4 times,
its test set 32 times, to get several samples per question from one sample per row) is one
question: it is kept once and sampled k times (:func:`dedupe`); ``EvalSource.rows`` keeps
each data source's row count, ``EvalSource.merged`` how many rows were repeats.

``limit`` keeps the first N distinct questions of each data source (a file holding several
benchmarks keeps N of each).
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from rllib_exgrpo.envs.datasets import DataFormatError, builtin_source, load_problems

logger = logging.getLogger(__name__)


class EvalDataError(ValueError):
    """A benchmark source that cannot be loaded; the message is one line (for a malformed
    row: ``path:line: reason``, as :class:`rllib_exgrpo.envs.DataFormatError`)."""


@dataclass
class EvalSource:
    """One ``sources`` entry, loaded."""

    spec: str
    problems: list  # envs.Problem, distinct questions
    #: data source -> rows in the file (repeats included), in first-seen order.
    rows: Dict[str, int] = field(default_factory=dict)
    #: problem id -> the row's system message (chat rows with one; ``keep_system``).
    systems: Dict[str, str] = field(default_factory=dict)
    #: data source -> distinct questions in the file (before ``limit``).
    distinct_by_source: Dict[str, int] = field(default_factory=dict)

    @property
    def merged(self) -> int:
        """Rows that repeated a question already kept."""
        return sum(self.rows.values()) - sum(self.distinct_by_source.values())

    def distinct(self) -> Dict[str, int]:
        """data source -> distinct questions kept."""
        out: Dict[str, int] = OrderedDict()
        for p in self.problems:
            out[p.data_source] = out.get(p.data_source, 0) + 1
        return out


def load_eval_problems(
    sources: Sequence[Union[str, os.PathLike]], *, limit: Optional[int] = None, split: str = "test", keep_system: bool = False
) -> List[EvalSource]:
    """Load every source strictly (a malformed row is an error, not a skip).

    Sources are files (``.jsonl`` / ``.json`` / ``.parquet``) or ``"arithmetic[:opts]"`` /
    ``"operators[:opts]"`` specs (their ``split``, held-out ``"test"`` by default; a spec
    with options becomes its own data source named by the spec). Repeated rows are merged
    (:func:`dedupe`); ``limit`` keeps the first N distinct questions of each data source.
    ``keep_system``: read each chat row's system message (``prompt`` = a list of messages)
    into ``EvalSource.systems``. Raises :class:`EvalDataError` with a one-line message
    (``path:line: reason`` for a malformed row).
    """
    if not sources:
        raise EvalDataError("no benchmark given")
    out = []
    for src in sources:
        spec = os.fspath(src)
        is_builtin = builtin_source(spec) is not None and not os.path.exists(spec)  # arithmetic, operators
        try:
            problems = load_problems(
                spec,
                split=split,
                strict=True,
                limit=limit if is_builtin else None,
                data_source=spec if is_builtin and spec != "arithmetic" else None,
            )
            systems = {} if is_builtin or not keep_system else _system_messages(Path(spec), problems)
        except DataFormatError as e:
            raise EvalDataError(str(e)) from e
        except (OSError, ValueError, TypeError) as e:
            raise EvalDataError(f"{spec}: {e}") from e
        if not problems:
            raise EvalDataError(f"{spec}: no problems")
        rows: Dict[str, int] = OrderedDict()
        for p in problems:
            rows[p.data_source] = rows.get(p.data_source, 0) + 1
        kept = dedupe(list(problems), systems)
        distinct: Dict[str, int] = OrderedDict()
        for p in kept:
            distinct[p.data_source] = distinct.get(p.data_source, 0) + 1
        source = EvalSource(
            spec=spec,
            problems=_first_per_source(kept, limit),
            rows=dict(rows),
            systems={p.id: systems[p.id] for p in kept if p.id in systems},
            distinct_by_source=dict(distinct),
        )
        out.append(source)
    return out


def dedupe(problems: list, systems: Optional[Dict[str, str]] = None) -> list:
    """The first row of each (data source, question, answer, system message)."""
    seen = set()
    kept = []
    for p in problems:
        key = (p.data_source, p.question, p.ground_truth, (systems or {}).get(p.id))
        if key in seen:
            continue
        seen.add(key)
        kept.append(p)
    return kept


def _first_per_source(problems: list, limit: Optional[int]) -> list:
    if limit is None:
        return problems
    count: Dict[str, int] = {}
    out = []
    for p in problems:
        if count.get(p.data_source, 0) < limit:
            count[p.data_source] = count.get(p.data_source, 0) + 1
            out.append(p)
    return out


def _system_messages(path: Path, problems: list) -> Dict[str, str]:
    """problem id -> the system message of its row (rows whose ``prompt`` is a chat list
    with one), matched by the row number the loader kept (``Problem.extra["line"]``)."""
    prompts = _prompt_column(path)
    if not prompts:
        return {}
    out = {}
    for p in problems:
        messages = prompts.get(p.extra.get("line"))
        if isinstance(messages, (list, tuple)):
            system = next((m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "system"), None)
            if isinstance(system, str) and system.strip():
                out[p.id] = system
    return out


def _prompt_column(path: Path) -> Dict[int, object]:
    """row number (as the loader counts it) -> the row's ``prompt`` value."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        if "prompt" not in pq.read_schema(path).names:
            return {}
        column = pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist()
        return {i: v for i, v in enumerate(column, start=1)}
    rows: Dict[int, object] = {}
    text = path.read_text(encoding="utf-8")
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
            data = next(iter(data.values()))
        if isinstance(data, list):
            return {i: r.get("prompt") for i, r in enumerate(data, start=1) if isinstance(r, dict)}
        if isinstance(data, dict):
            return {1: data.get("prompt")}
    for line_no, line in enumerate(text.splitlines(), start=1):  # JSON lines
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows[line_no] = row.get("prompt")
    return rows
