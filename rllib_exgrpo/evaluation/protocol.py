"""Evaluation protocols by name (``rllib evaluate --protocol exgrpo``).

``exgrpo``: the ExGRPO paper's evaluation as its official code runs it
(github.com/ElliottYan/LUFFY, ``ExGRPO/eval_scripts/generate_vllm.py`` and ``eval.sh``;
the data files ``ExGRPO/data/valid.parquet``, ``test.id.parquet`` and LUFFY's
``data/valid.{arc_c,gpqa,mmlu_pro}.parquet``):

- sampling at temperature 0.6, top-p 1.0; a completion budget of 8192 tokens, capped by the
  model's context (``max_position_embeddings``) and, per question, by what its prompt
  leaves of it;
- avg@32 for AIME and AMC (data sources whose name holds ``aime`` / ``amc``), avg@1
  elsewhere. The official files reach this by repeating rows (AIME 32 times in
  ``test.id.parquet``); here a repeated row is one question sampled k times;
- the prompt is the row's chat messages, the system message kept, through the model's chat
  template with the generation prompt; files without chat messages (``problem`` /
  ``question`` + ``answer`` rows) get the official system message
  (:data:`EXGRPO_SYSTEM_PROMPT`) and the question as the user message, verbatim;
- the think format of the official script: when the rendered prompt ends with
  ``<think>`` (a chat template that opens the thought block), the completion is read as
  ``"<think>\\n" + completion`` and only the text after its first ``</think>`` is
  verified (none: wrong); otherwise the whole completion is;
- per data source its distinct questions, k and score, then the in-distribution average
  (AIME24, AIME25, AMC, MATH-500, Minerva, OlympiadBench) and the out-of-distribution
  average (ARC-c, GPQA-diamond, MMLU-Pro), each over the benchmarks present.

Differences from the official script, on purpose: the system message is kept (the script
drops it, ``--remove_system True``, for models whose chat template brings its own; the
training prompts had it), and completions are verified by this project's math-verify
reward (the script's final label is OAT's boxed grader, ``oat_math_grader.boxed_reward_fn``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

PROTOCOLS = ("exgrpo",)

#: The system message of every row of the official ExGRPO / LUFFY evaluation files.
EXGRPO_SYSTEM_PROMPT = (
    "Your task is to follow a systematic, thorough reasoning process before providing the final solution. "
    "This involves analyzing, summarizing, exploring, reassessing, and refining your thought process through "
    "multiple iterations. Structure your response into two sections: Thought and Solution. In the Thought "
    'section, present your reasoning using the format: "<think>\n {thoughts} </think>\n". Each thought '
    "should include detailed analysis, brainstorming, verification, and refinement of ideas. After "
    '"</think>\n," in the Solution section, provide the final, logical, and accurate answer, clearly '
    "derived from the exploration in the Thought section. If applicable, include the answer in \\boxed{} for "
    "closed-form results like multiple choices or mathematical solutions."
)

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class Protocol:
    name: str
    temperature: float
    top_p: float
    max_new_tokens: int  # before the context cap
    system_prompt: str
    official_think: bool = True


EXGRPO = Protocol(name="exgrpo", temperature=0.6, top_p=1.0, max_new_tokens=8192, system_prompt=EXGRPO_SYSTEM_PROMPT)


def get_protocol(name: str) -> Protocol:
    if name != "exgrpo":
        raise ValueError(f"unknown protocol {name!r}; known: {', '.join(PROTOCOLS)}")
    return EXGRPO


#: (benchmark, group, pattern on the normalised data source name), first match wins. The
#: official files name them aime, aime25, amc, math, minerva, olympiad_bench, arc_c, gpqa,
#: mmlu_pro; the common jsonl files aime24_test, amc23_test, math500_test, ...
BENCHMARKS: Tuple[Tuple[str, str, str], ...] = (
    ("AIME25", "in_distribution", r"aime_?(20)?25"),
    ("AIME24", "in_distribution", r"aime"),
    ("AMC", "in_distribution", r"amc"),
    ("MATH-500", "in_distribution", r"^math(_?500)?(_test)?$|math_?500"),
    ("Minerva", "in_distribution", r"minerva"),
    ("OlympiadBench", "in_distribution", r"olympiad"),
    ("ARC-c", "out_of_distribution", r"arc"),
    ("GPQA-diamond", "out_of_distribution", r"gpqa"),
    ("MMLU-Pro", "out_of_distribution", r"mmlu"),
)
GROUPS = {
    "in_distribution": ("AIME24", "AIME25", "AMC", "MATH-500", "Minerva", "OlympiadBench"),
    "out_of_distribution": ("ARC-c", "GPQA-diamond", "MMLU-Pro"),
}


def _normalise(name: str) -> str:
    base = name.replace("\\", "/").rsplit("/", 1)[-1].lower()
    base = re.sub(r"\.(jsonl|json|parquet)$", "", base)
    return re.sub(r"[^a-z0-9]+", "_", base).strip("_")


def benchmark_of(data_source: str) -> Optional[Tuple[str, str]]:
    """(benchmark, group) of a data source name, or None (reported, in no average)."""
    name = _normalise(data_source)
    for label, group, pattern in BENCHMARKS:
        if re.search(pattern, name):
            return label, group
    return None


def group_averages(per_source: Dict[str, dict]) -> Dict[str, dict]:
    """For each group: the mean of its benchmarks' avg@k over those present, the benchmarks
    it averaged (a benchmark split over several data sources counts once, by question), and
    those missing."""
    by_bench: Dict[str, List[Tuple[float, int]]] = {}
    groups: Dict[str, str] = {}
    for name, m in per_source.items():
        found = benchmark_of(name)
        if found is None:
            continue
        label, group = found
        by_bench.setdefault(label, []).append((m["avg_at_k"], m["n_questions"]))
        groups[label] = group
    out = {}
    for group, labels in GROUPS.items():
        scores = {}
        for label in labels:
            if label in by_bench:
                parts = by_bench[label]
                total = sum(n for _, n in parts)
                scores[label] = sum(s * n for s, n in parts) / total
        out[group] = {
            "avg": (sum(scores.values()) / len(scores)) if scores else None,
            "benchmarks": scores,
            "missing": [label for label in labels if label not in scores],
        }
    return out


def official_answer_text(prompt_text: str, completion: str) -> Optional[str]:
    """The text the official script verifies: after the first ``</think>`` of
    ``"<think>\\n" + completion`` when the prompt ends with ``<think>`` (None when there is
    no ``</think>``: wrong), else the whole completion."""
    if not prompt_text.rstrip().endswith(THINK_START):
        return completion
    parts = (THINK_START + "\n" + completion).split(THINK_END)
    return parts[1] if len(parts) > 1 else None


def protocol_lines(per_source: Dict[str, dict], groups: Dict[str, dict]) -> List[str]:
    """The protocol's summary: per data source its distinct questions, k and score (and the
    rows it came from, where repeated rows were merged), then the two averages."""
    lines = []
    width = max([len(n) for n in per_source] + [len("data source")])
    lines.append(f"{'data source'.ljust(width)}  {'benchmark':<13}  {'questions':>9}  {'k':>3}  {'score':>6}")
    for name, m in per_source.items():
        found = benchmark_of(name)
        k = m.get("k")
        rows, distinct = m.get("rows", m["n_questions"]), m.get("distinct_questions", m["n_questions"])
        note = f"  ({rows} rows: {distinct} distinct, repeats counted once)" if rows != distinct else ""
        lines.append(
            f"{name.ljust(width)}  {(found[0] if found else '-'):<13}  {m['n_questions']:>9}  "
            f"{('mixed' if k is None else k):>3}  {100.0 * m['avg_at_k']:>6.1f}{note}"
        )
    for group, title in (("in_distribution", "in-distribution avg"), ("out_of_distribution", "out-of-distribution avg")):
        g = groups[group]
        if g["avg"] is None:
            lines.append(f"{title}: - (none of {', '.join(GROUPS[group])} present)")
            continue
        present = ", ".join(f"{label} {100.0 * s:.1f}" for label, s in g["benchmarks"].items())
        missing = f"; missing {', '.join(g['missing'])}" if g["missing"] else ""
        lines.append(f"{title}: {100.0 * g['avg']:.1f} over {len(g['benchmarks'])} benchmark(s) ({present}{missing})")
    return lines


def rows_and_distinct(loaded: Sequence) -> Dict[str, Tuple[int, int]]:
    """data source -> (rows in the files, distinct questions in them, before ``limit``)."""
    out: Dict[str, Tuple[int, int]] = {}
    for src in loaded:
        for name, rows in src.rows.items():
            r, d = out.get(name, (0, 0))
            out[name] = (r + rows, d + src.distinct_by_source.get(name, rows))
    return out
