"""The replay positive control's measurements, shared by the arithmetic testbed
(``replay_positive_control.py``) and the hidden-operator task
(``operators_experiment.py --phase positive``).

The control asks whether ExGRPO gets better than GRPO at what it replays: at equal sampled
tokens, both answer every training question greedily, and their accuracies are compared on

* ``pool_hard``: the questions in ExGRPO's pool at the end whose last group solved at most
  :data:`HARD_MAX_CORRECT` of its samples (chosen by ExGRPO's own last samples, which leans
  the set towards questions ExGRPO failed at the end: a bias against ExGRPO);
* ``warm_start_hard``: the questions the warm start solves 1 to :data:`HARD_MAX_CORRECT`
  times in 8 samples at temperature 1, counted once before any training (chosen by neither
  run: the questions ExGRPO pools as hard when it meets them, which GRPO trains on as fresh
  ones);
* ``warm_start_hard_pooled`` / ``warm_start_hard_unpooled``: the warm-start hard questions
  in ExGRPO's pool at the end, and the rest (those it retired as solved G in G, or never
  solved again): what replay acts on, against what retirement takes out of the fresh data;
* ``pooled``: every question in ExGRPO's pool at the end; ``all``: every training question.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import numpy as np

from rllib_exgrpo.core.columns import QUESTION_ID

import experience_testbed as tb

#: A question is "hard" when it is solved in at most this many of G = 8 samples.
HARD_MAX_CORRECT = 3
#: Samples per training question of the warm-start count.
WARM_START_SAMPLES = 8
#: The cache-key entry of a run that records the control's end evaluation; bumped when what
#: :func:`end_eval` records changes.
CONTROL_KEY = {"positive_control": 1}


def end_eval(algo) -> dict:
    """Greedy reward of every training question, and the pool's buckets (ExGRPO); recorded
    as a run's ``"end"`` (``_runs.train_run(end_eval=...)``)."""
    ids = list(algo.sampler.question_ids)
    max_tokens = int(algo.config.max_response_tokens)
    rewards = {}
    for start in range(0, len(ids), 256):
        chunk = ids[start : start + 256]
        episodes = algo.env_runner.sample(
            question_ids=chunk, num_samples=1, temperature=0.0, max_new_tokens=max_tokens, return_logprobs=False
        )
        rewards.update({e.get_infos(-1)[QUESTION_ID]: float(e.get_return()) for e in episodes})
    buffer = algo.experience.buffer
    pool = {q: int(buffer.bucket_of(q)) for q in buffer} if algo.config.experience_replay else {}
    return {"train_greedy": rewards, "pool_buckets": pool}


def warm_start_solve_counts(path: Path, build_algo: Callable[[], object]) -> Dict[str, int]:
    """Correct answers in :data:`WARM_START_SAMPLES` samples at temperature 1 of each training
    question under the warm start (``build_algo()``: the recipe's algorithm before any
    training step), cached at ``path``."""
    if path.exists():
        return json.loads(path.read_text())
    algo = build_algo()
    counts: Dict[str, int] = {}
    try:
        ids = list(algo.sampler.question_ids)
        for start in range(0, len(ids), 64):
            episodes = algo.env_runner.sample(
                question_ids=ids[start : start + 64], num_samples=WARM_START_SAMPLES, temperature=1.0, return_logprobs=False
            )
            for e in episodes:
                q = e.get_infos(-1)[QUESTION_ID]
                counts[q] = counts.get(q, 0) + int(e.get_return() >= 1.0)
    finally:
        algo.stop()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(counts))
    return counts


def control_sets(exgrpo_end: dict, counts: Dict[str, int]) -> Dict[str, List[str]]:
    """The question sets of the control (module docstring), from the ExGRPO run's ``"end"``
    record and the warm-start counts."""
    pool = exgrpo_end["pool_buckets"]
    warm_start_hard = sorted(q for q, c in counts.items() if 1 <= c <= HARD_MAX_CORRECT)
    return {
        "pool_hard": sorted(q for q, b in pool.items() if b <= HARD_MAX_CORRECT),
        "warm_start_hard": warm_start_hard,
        "warm_start_hard_pooled": [q for q in warm_start_hard if q in pool],
        "warm_start_hard_unpooled": [q for q in warm_start_hard if q not in pool],
        "pooled": sorted(pool),
        "all": sorted(exgrpo_end["train_greedy"]),
    }


def accuracy_on(end: dict, questions: List[str]) -> float:
    """A run's mean greedy reward at the end on ``questions`` (its accuracy: the recipes'
    verifier scores 0 or 1); nan for an empty set."""
    greedy = end["train_greedy"]
    return float(np.mean([greedy[q] for q in questions])) if questions else float("nan")


def compare_at_end(
    grpo_end: dict, exgrpo_end: dict, sets: Dict[str, List[str]], names: Sequence[str], diffs: Dict[str, List[float]]
) -> str:
    """One seed of the control: appends ExGRPO - GRPO accuracy on each set in ``names`` to
    ``diffs[name]`` and returns the seed's cells, ``"name (size) GRPO / ExGRPO | ..."``."""
    cells = []
    for k in names:
        a, b = accuracy_on(grpo_end, sets[k]), accuracy_on(exgrpo_end, sets[k])
        diffs[k].append(b - a)
        cells.append(f"{k} ({len(sets[k])}) {a:.3f} / {b:.3f}")
    return " | ".join(cells)


def difference_lines(diffs: Dict[str, List[float]]) -> List[str]:
    """Per set, the paired ExGRPO - GRPO difference over seeds in points (mean ± 95% t,
    seeds with an empty set left out) and each seed's."""
    lines = []
    for k, ds in diffs.items():
        m, h, n = tb.ci95([d for d in ds if d == d])
        lines.append(
            f"ExGRPO - GRPO on {k}: {m * 100:+.1f} ± {h * 100:.1f} points (95% t, n={n}), per seed "
            + " ".join(f"{d * 100:+.1f}" for d in ds)
        )
    return lines
