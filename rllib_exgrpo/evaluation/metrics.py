"""The evaluation metrics: avg@k, unbiased pass@k and maj@k per question, aggregated per
source; the per-question record and the report (JSON / Markdown).

Metrics, per question with ``n`` samples of which ``c`` are correct:

- ``avg@k``: mean correctness of the k samples (the papers' accuracy);
- ``pass@j``: the unbiased estimator ``1 - C(n-c, j) / C(n, j)`` (Chen et al. 2021),
  for each ``j`` of ``pass_ks`` with ``j <= n``;
- ``maj@k``: correctness of the majority answer among the parsed answers of the k
  samples (ties go to the answer seen first; samples without an answer do not vote; no
  answer at all counts as wrong). Answers vote by their text with whitespace removed.

A source's figure is the mean over its questions. The overall row is the mean over all
questions; ``macro_avg_at_k`` is the unweighted mean of the sources' avg@k (the papers'
"avg" column over benchmarks).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from rllib_exgrpo.evaluation.protocol import protocol_lines

logger = logging.getLogger(__name__)


DEFAULT_TEMPERATURE = 0.6
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_NEW_TOKENS = 1024
DEFAULT_BATCH_SIZE = 64
#: Samples per question for the small competition benchmarks (the papers' avg@32).
MULTI_SAMPLE_K = 32
MULTI_SAMPLE_MARKERS = ("aime", "amc")
#: Default ``pass_ks``: pass@1 and pass@k, ``"k"`` standing for a source's own k.
DEFAULT_PASS_KS: Tuple[Union[int, str], ...] = (1, "k")
REPORT_VERSION = 1


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate ``1 - C(n-c, k) / C(n, k)`` from ``n`` samples, ``c`` correct.

    Computed in the numerically stable product form ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``
    (no huge binomials). Raises ``ValueError`` when ``k > n`` (not estimable), ``k < 1``,
    or ``c`` is outside ``[0, n]``.
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per question, got n={n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def avg_at_k(correct: Sequence[Union[bool, float]], k: Optional[int] = None) -> float:
    """Mean correctness of the first ``k`` samples (all of them when ``k`` is None)."""
    flags = list(correct)
    if k is not None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if k > len(flags):
            raise ValueError(f"avg@{k} needs {k} samples, got {len(flags)}")
        flags = flags[:k]
    if not flags:
        raise ValueError("avg@k of no samples")
    return float(sum(float(f) for f in flags) / len(flags))


def _vote_key(answer: Optional[str]) -> Optional[str]:
    if answer is None:
        return None
    key = "".join(str(answer).split())
    return key or None


def maj_at_k(answers: Sequence[Optional[str]], correct_flags: Sequence[Union[bool, float]], k: Optional[int] = None) -> float:
    """1.0 when the majority answer of the first ``k`` samples is correct, else 0.0.

    ``answers[i]`` is the parsed answer of sample ``i`` (None: no answer; it does not
    vote) and ``correct_flags[i]`` its verdict. Answers vote by their text with whitespace
    removed; a tie goes to the answer that appeared first. The winner's correctness is
    that of its first sample. No answer at all gives 0.0.
    """
    if len(answers) != len(correct_flags):
        raise ValueError(f"{len(answers)} answers but {len(correct_flags)} correctness flags")
    if k is None:
        k = len(answers)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > len(answers):
        raise ValueError(f"maj@{k} needs {k} samples, got {len(answers)}")
    counts: "OrderedDict[str, list]" = OrderedDict()  # key -> [votes, first index]
    for i in range(k):
        key = _vote_key(answers[i])
        if key is None:
            continue
        if key in counts:
            counts[key][0] += 1
        else:
            counts[key] = [1, i]
    if not counts:
        return 0.0
    best = max(counts.values(), key=lambda v: (v[0], -v[1]))
    return 1.0 if float(correct_flags[best[1]]) >= 1.0 else 0.0


def default_k(data_source: str) -> int:
    """32 for data sources whose name contains ``aime`` or ``amc``, else 1 (the papers')."""
    name = data_source.lower()
    return MULTI_SAMPLE_K if any(m in name for m in MULTI_SAMPLE_MARKERS) else 1


def resolve_k(data_source: str, k: Union[None, int, Mapping[str, int]]) -> int:
    """Samples per question for ``data_source``: ``k`` itself when an int; for a mapping its
    entry for the data source (exact name first, then the first key contained in the name,
    case-insensitive); otherwise :func:`default_k`."""
    if k is None:
        return default_k(data_source)
    if isinstance(k, Mapping):
        if data_source in k:
            value = k[data_source]
        else:
            low = data_source.lower()
            value = next((v for key, v in k.items() if str(key).lower() in low), None)
            if value is None:
                return default_k(data_source)
    else:
        value = k
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"k must be a positive int, got {value!r} for {data_source!r}")
    return value


def pass_ks_for(pass_ks: Sequence[Union[int, str]], k: int) -> List[int]:
    out: List[int] = []
    for j in pass_ks:
        j = k if j == "k" else j
        if isinstance(j, bool) or not isinstance(j, int) or j < 1:
            raise ValueError(f"pass_ks entries must be positive ints or 'k', got {j!r}")
        if j not in out:
            out.append(j)
    return sorted(out)


# =========================================================================== results


@dataclass
class QuestionResult:
    """Every sample of one question."""

    id: str
    data_source: str
    source: str  # the spec / file it came from
    correct: List[bool]
    answers: List[Optional[str]]
    response_tokens: List[int]
    truncated: List[bool]
    unscored: int = 0  # verifier errors (counted as wrong)
    timed_out: int = 0
    prompt_tokens: int = 0
    difficulty: Optional[int] = None
    completions: Optional[List[str]] = None

    @property
    def n(self) -> int:
        return len(self.correct)

    @property
    def num_correct(self) -> int:
        return int(sum(self.correct))

    def to_dict(self) -> dict:
        d = {
            "id": self.id,
            "data_source": self.data_source,
            "source": self.source,
            "difficulty": self.difficulty,
            "prompt_tokens": self.prompt_tokens,
            "n": self.n,
            "num_correct": self.num_correct,
            "correct": [bool(c) for c in self.correct],
            "answers": list(self.answers),
            "response_tokens": list(self.response_tokens),
            "truncated": [bool(t) for t in self.truncated],
            "unscored": self.unscored,
            "timed_out": self.timed_out,
        }
        if self.completions is not None:
            d["completions"] = list(self.completions)
        return d


def aggregate(questions: Sequence[QuestionResult], pass_ks: Sequence[Union[int, str]] = DEFAULT_PASS_KS) -> dict:
    """Metrics of a set of questions (each question's k is its number of samples).

    Returns a dict with ``k`` (None when the questions have different k), ``n_questions``,
    ``samples``, ``avg_at_k``, ``pass_at_k`` ({str(j): value}, for each j of ``pass_ks``
    with the mean over questions that have at least j samples), ``maj_at_k``,
    ``mean_response_tokens``, ``truncated_fraction``, ``unscored``, ``timed_out``, and
    ``metrics``: the same figures under their usual names (``avg@32``, ``pass@1``...).
    """
    if not questions:
        raise ValueError("no questions to aggregate")
    ks = sorted({q.n for q in questions})
    k = ks[0] if len(ks) == 1 else None
    js = sorted({j for q in questions for j in pass_ks_for(pass_ks, q.n)})
    pass_at: Dict[str, float] = {}
    for j in js:
        vals = [pass_at_k(q.n, q.num_correct, j) for q in questions if q.n >= j]
        if vals:
            pass_at[str(j)] = float(sum(vals) / len(vals))
    avg = float(sum(avg_at_k(q.correct) for q in questions) / len(questions))
    maj = float(sum(maj_at_k(q.answers, q.correct) for q in questions) / len(questions))
    lengths = [n for q in questions for n in q.response_tokens]
    truncated = [t for q in questions for t in q.truncated]
    label = str(k) if k is not None else "k"
    metrics = {f"avg@{label}": avg, **{f"pass@{j}": v for j, v in pass_at.items()}, f"maj@{label}": maj}
    return {
        "k": k,
        "n_questions": len(questions),
        "samples": len(lengths),
        "avg_at_k": avg,
        "pass_at_k": pass_at,
        "maj_at_k": maj,
        "mean_response_tokens": float(sum(lengths) / len(lengths)) if lengths else 0.0,
        "truncated_fraction": float(sum(truncated) / len(truncated)) if truncated else 0.0,
        "unscored": int(sum(q.unscored for q in questions)),
        "timed_out": int(sum(q.timed_out for q in questions)),
        "metrics": metrics,
    }


@dataclass
class EvalReport:
    """Result of :func:`evaluate`.

    Attributes:
        model: What was evaluated (name, path or checkpoint folder).
        settings: Sampling and prompt settings (temperature, top_p, max_new_tokens, seed...).
        sources: data source name -> :func:`aggregate` dict (plus ``wall_time_s``).
        overall: :func:`aggregate` over every question, plus ``macro_avg_at_k``.
        wall_time_s: Whole evaluation, model loading included.
        questions: Every question's samples.
        groups: With a protocol, its averages over groups of benchmarks.
    """

    model: str
    settings: dict
    sources: Dict[str, dict]
    overall: dict
    wall_time_s: float
    questions: List[QuestionResult] = field(default_factory=list)
    #: With a protocol: the in- and out-of-distribution averages
    #: (:func:`rllib_exgrpo.evaluation.protocol.group_averages`).
    groups: Optional[dict] = None
    created: str = field(default_factory=lambda: _dt.datetime.now().isoformat(timespec="seconds"))

    def to_dict(self, *, include_questions: bool = True) -> dict:
        d = {
            "version": REPORT_VERSION,
            "created": self.created,
            "model": self.model,
            "settings": self.settings,
            "sources": self.sources,
            "overall": self.overall,
            "wall_time_s": self.wall_time_s,
        }
        if self.groups is not None:
            d["groups"] = self.groups
        if include_questions:
            d["questions"] = [q.to_dict() for q in self.questions]
        return d

    def to_json(self, path: Union[str, os.PathLike], *, include_questions: bool = True) -> str:
        """Write the report as JSON (parent folders created); returns the path."""
        path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(include_questions=include_questions), fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
        return path

    def table(self) -> str:
        """A plain-text table: one row per data source, then overall and macro average.
        Accuracies in percent; ``pass@k`` is at each source's own k."""
        pass_cols = [j for j in self.settings.get("pass_ks", DEFAULT_PASS_KS)]
        pass_cols = list(dict.fromkeys(pass_cols))
        header = (
            ["source", "k", "questions", "samples", "avg@k"] + [f"pass@{j}" for j in pass_cols] + ["maj@k", "resp.tok", "trunc%", "time s"]
        )

        def pct(x: Optional[float]) -> str:
            return "-" if x is None else f"{100.0 * x:.1f}"

        def row(name: str, m: dict, seconds: Optional[float]) -> List[str]:
            k = m.get("k")
            cells = [name, "mixed" if k is None else str(k), str(m["n_questions"]), str(m["samples"]), pct(m["avg_at_k"])]
            for j in pass_cols:
                jj = k if j == "k" else j
                cells.append(pct(m["pass_at_k"].get(str(jj))) if jj is not None else "-")
            cells += [
                pct(m["maj_at_k"]),
                f"{m['mean_response_tokens']:.1f}",
                f"{100.0 * m['truncated_fraction']:.1f}",
                "-" if seconds is None else f"{seconds:.1f}",
            ]
            return cells

        rows = [row(name, m, m.get("wall_time_s")) for name, m in self.sources.items()]
        rows.append(row("overall", self.overall, self.wall_time_s))
        if len(self.sources) > 1:
            macro = ["macro avg", "", "", "", pct(self.overall.get("macro_avg_at_k"))]
            macro += [""] * (len(header) - len(macro))
            rows.append(macro)
        widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

        def fmt(cells):
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

        rule = "-" * len(fmt(header))
        s = self.settings
        lines = [
            f"model: {self.model}",
            f"temperature {s.get('temperature')}  top_p {s.get('top_p')}  max_new_tokens {s.get('max_new_tokens')}"
            f"  seed {s.get('seed')}  (accuracies in %)",
            rule,
            fmt(header),
            rule,
        ]
        lines += [fmt(r) for r in rows[: len(self.sources)]]
        lines.append(rule)
        lines += [fmt(r) for r in rows[len(self.sources) :]]
        unscored = self.overall.get("unscored", 0)
        if unscored:
            lines.append(f"note: {unscored} sample(s) could not be verified (verifier error) and count as wrong")
        if self.groups is not None:
            lines.append(rule)
            lines.append(f"protocol {s.get('protocol')}: per data source its distinct questions, k and avg@k (%)")
            lines += protocol_lines(self.sources, self.groups)
        return "\n".join(lines)


# =========================================================================== checkpoints
