"""Benchmark sources for evaluation, loaded strictly (a malformed row is an error)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

logger = logging.getLogger(__name__)


class EvalDataError(ValueError):
    """A benchmark source that cannot be loaded; the message is one line (for a malformed
    row: ``path:line: reason``, as :class:`rllib_exgrpo.envs.DataFormatError`)."""


@dataclass
class EvalSource:
    """One ``sources`` entry, loaded."""

    spec: str
    problems: list  # envs.Problem


def load_eval_problems(sources: Sequence[Union[str, os.PathLike]], *, limit: Optional[int] = None,
                       split: str = "test") -> List[EvalSource]:
    """Load every source strictly (a malformed row is an error, not a skip).

    Sources are files (``.jsonl`` / ``.json`` / ``.parquet``) or ``"arithmetic[:opts]"`` /
    ``"operators[:opts]"`` specs (their ``split``, held-out ``"test"`` by default; a spec
    with options becomes its own data source named by the spec). Raises
    :class:`EvalDataError` with a one-line message (``path:line: reason`` for a malformed
    row).
    """
    from rllib_exgrpo.envs.datasets import DataFormatError, builtin_source, load_problems

    if not sources:
        raise EvalDataError("no benchmark given")
    out = []
    for src in sources:
        spec = os.fspath(src)
        is_arith = builtin_source(spec) is not None  # an embedded family: arithmetic, operators
        try:
            problems = load_problems(
                spec, split=split, strict=True, limit=limit,
                data_source=spec if is_arith and spec != "arithmetic" and not os.path.exists(spec) else None,
            )
        except DataFormatError as e:
            raise EvalDataError(str(e)) from e
        except (OSError, ValueError, TypeError) as e:
            raise EvalDataError(f"{spec}: {e}") from e
        if not problems:
            raise EvalDataError(f"{spec}: no problems")
        out.append(EvalSource(spec=spec, problems=list(problems)))
    return out


# =========================================================================== evaluate
