"""Methods side by side on the same benchmarks: the paper's table with intervals.

Input: one evaluation report per method (``rllib evaluate --output``'s JSON, or an
:class:`~rllib_exgrpo.evaluation.metrics.EvalReport`), all on the same data. Output: one
row per method, one column per benchmark (data source) plus the macro average over them,
each cell the avg@k score in percent with a 95% bootstrap interval over questions; and the
paired differences against the first row (the same questions resampled for both methods,
so question difficulty cancels).

A question's score is its mean correctness over its k samples (avg@k). The bootstrap
resamples questions with replacement within each benchmark (``B`` draws, seeded), and the
macro average resamples every benchmark at once. Pure functions of the per-question scores:
``tests/test_compare.py`` checks them on hand-made reports.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

#: Bootstrap draws and the interval's level.
DEFAULT_BOOTSTRAP = 2000
LEVEL = 0.95
MACRO = "macro avg"


@dataclass
class Cell:
    """A score (percent) and its 95% interval; ``n`` questions."""

    mean: float
    low: float
    high: float
    n: int

    def text(self, signed: bool = False) -> str:
        fmt = "{:+.1f}" if signed else "{:.1f}"
        return f"{fmt.format(self.mean)} [{fmt.format(self.low)}, {fmt.format(self.high)}]"


def question_scores(report: Mapping) -> Dict[str, Dict[str, float]]:
    """``data_source -> {question id: avg@k}`` of a report dict (with its ``questions``)."""
    questions = report.get("questions")
    if not questions:
        raise ValueError("the report has no per-question results (evaluate without include_questions=False)")
    out: Dict[str, Dict[str, float]] = {}
    for q in questions:
        correct = q["correct"]
        out.setdefault(q["data_source"], {})[str(q["id"])] = float(np.mean(correct)) if correct else 0.0
    return out


def _bootstrap_means(values: np.ndarray, draws: int, rng: np.random.Generator) -> np.ndarray:
    """``[draws]`` means of ``values`` resampled with replacement."""
    idx = rng.integers(0, len(values), size=(draws, len(values)))
    return values[idx].mean(axis=1)


def _cell(values: np.ndarray, boot: np.ndarray) -> Cell:
    tail = (1.0 - LEVEL) / 2
    return Cell(
        mean=100 * float(values.mean()),
        low=100 * float(np.quantile(boot, tail)),
        high=100 * float(np.quantile(boot, 1 - tail)),
        n=int(len(values)),
    )


def _common_ids(scores: Sequence[Dict[str, Dict[str, float]]], source: str) -> List[str]:
    ids = set(scores[0].get(source, {}))
    for s in scores[1:]:
        ids &= set(s.get(source, {}))
    return sorted(ids)


def compare_scores(
    scores: Sequence[Dict[str, Dict[str, float]]], *, draws: int = DEFAULT_BOOTSTRAP, seed: int = 0
) -> Tuple[List[str], List[Dict[str, Cell]], List[Dict[str, Cell]]]:
    """``(benchmarks, cells per method, paired differences per method against the first)``.

    Only questions every method answered count (the same questions for all); a benchmark no
    method shares is left out. Differences of the first method against itself are omitted
    (its entry is empty)."""
    sources = [s for s in scores[0] if _common_ids(scores, s)]
    if not sources:
        raise ValueError("the reports share no question: evaluate every method on the same data")
    rng = np.random.default_rng(seed)
    # One resampling of question indices per benchmark, shared by every method (paired).
    ids = {s: _common_ids(scores, s) for s in sources}
    picks = {s: rng.integers(0, len(ids[s]), size=(draws, len(ids[s]))) for s in sources}
    cells: List[Dict[str, Cell]] = []
    diffs: List[Dict[str, Cell]] = []
    base = {s: np.array([scores[0][s][i] for i in ids[s]]) for s in sources}
    for m, method in enumerate(scores):
        values = {s: np.array([method[s][i] for i in ids[s]]) for s in sources}
        cells.append(_method_cells(values, picks))
        diffs.append({} if m == 0 else _method_cells({s: values[s] - base[s] for s in sources}, picks))
    return sources, cells, diffs


def _method_cells(values: Mapping[str, np.ndarray], picks: Mapping[str, np.ndarray]) -> Dict[str, Cell]:
    out = {s: _cell(v, v[picks[s]].mean(axis=1)) for s, v in values.items()}
    macro_values = np.array([v.mean() for v in values.values()])
    macro_boot = np.mean([values[s][picks[s]].mean(axis=1) for s in values], axis=0)
    out[MACRO] = _cell(macro_values, macro_boot)
    out[MACRO].n = int(sum(len(v) for v in values.values()))
    return out


@dataclass
class Comparison:
    labels: List[str]
    benchmarks: List[str]
    cells: List[Dict[str, Cell]]
    diffs: List[Dict[str, Cell]]

    @property
    def columns(self) -> List[str]:
        return self.benchmarks + [MACRO]

    def markdown(self) -> str:
        cols = self.columns
        n = {c: self.cells[0][c].n for c in cols}
        head = "| method | " + " | ".join(f"{c} (n={n[c]})" for c in cols) + " |"
        lines = ["avg@k in percent, 95% bootstrap interval over questions:", "", head, "|" + "---|" * (len(cols) + 1)]
        lines += ["| " + label + " | " + " | ".join(row[c].text() for c in cols) + " |" for label, row in zip(self.labels, self.cells)]
        if len(self.labels) > 1:
            lines += ["", f"paired difference against {self.labels[0]} (points, 95% interval):", "", head, "|" + "---|" * (len(cols) + 1)]
            lines += [
                "| " + label + " | " + " | ".join(row[c].text(signed=True) for c in cols) + " |"
                for label, row in zip(self.labels[1:], self.diffs[1:])
            ]
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["method", "benchmark", "questions", "score", "low", "high", "diff_vs_first", "diff_low", "diff_high"])
        for label, row, diff in zip(self.labels, self.cells, self.diffs):
            for c in self.columns:
                d = diff.get(c)
                w.writerow(
                    [
                        label,
                        c,
                        row[c].n,
                        f"{row[c].mean:.3f}",
                        f"{row[c].low:.3f}",
                        f"{row[c].high:.3f}",
                        "" if d is None else f"{d.mean:.3f}",
                        "" if d is None else f"{d.low:.3f}",
                        "" if d is None else f"{d.high:.3f}",
                    ]
                )
        return buf.getvalue()

    def figure(self, path: Union[str, os.PathLike]) -> str:
        """Grouped bars per benchmark with the intervals as error bars (PNG)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        cols = self.columns
        width = 0.8 / len(self.labels)
        fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(cols)), 3.2))
        for m, (label, row) in enumerate(zip(self.labels, self.cells)):
            x = np.arange(len(cols)) + (m - (len(self.labels) - 1) / 2) * width
            means = np.array([row[c].mean for c in cols])
            err = np.array([[row[c].mean - row[c].low for c in cols], [row[c].high - row[c].mean for c in cols]])
            ax.bar(x, means, width, yerr=err, capsize=3, label=label)
        ax.set_xticks(np.arange(len(cols)), cols)
        ax.set_ylabel("avg@k (%)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return str(path)


def compare_reports(reports: Sequence[Mapping], labels: Sequence[str], *, draws: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> Comparison:
    """The comparison of report dicts (the first is the reference of the differences)."""
    if len(reports) != len(labels) or not reports:
        raise ValueError("one label per report, at least one report")
    benchmarks, cells, diffs = compare_scores([question_scores(r) for r in reports], draws=draws, seed=seed)
    return Comparison(list(labels), benchmarks, cells, diffs)


def load_report(path: Union[str, os.PathLike]) -> Optional[dict]:
    """A saved evaluation (``rllib evaluate --output``), or None when ``path`` is not one."""
    if not str(path).endswith(".json") or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    return data if isinstance(data, dict) and "questions" in data and "sources" in data else None
