"""XRPO's three mechanisms as steps the algorithm calls (docs/ALGORITHMS.md section 3).

* :class:`AdaptiveRollouts` drives the hierarchical planner over several generation
  rounds of one training step: n0 completions per question, then rounds handing out the
  rest of the B*G budget by priority.
* :class:`InContextSeeder` keeps the corpus of the model's own verified solutions and,
  for questions whose completions all failed, samples extra completions with retrieved
  solved examples prepended. Those completions are trained against the *original* prompt
  as off-policy tokens (recorded log-probs under the seeded prompt, policy shaping like
  ExGRPO's replayed tokens) and do not count towards the question's correctness.
* :func:`sharpen_advantages` applies the novelty bonus to correct but unlikely completions.

Generation is passed in as ``sample(question_ids, counts, prefixes) -> [Trajectory]`` so
this module never touches RLlib.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from rllib_exgrpo.core.groups import ScoredGroups, Trajectory
from rllib_exgrpo.xrpo.icl import SolvedCorpus, format_examples
from rllib_exgrpo.core.losses import novelty_sharpened_advantages
from rllib_exgrpo.xrpo.planner import RolloutPlanner

#: What each XRPO step reports (logged under ``xrpo/``).
PLANNER_METRICS = tuple(f"completions_per_question_{stat}" for stat in ("mean", "min", "max", "std"))
SEEDING_METRICS = ("all_failing_questions", "seeded_questions", "corpus_size", "rescued_fraction", "rescued_questions")
SHARPENING_METRICS = ("sharpening_bonus_mean", "sharpened_fraction")

SampleFn = Callable[[Sequence[str], Sequence[int], Optional[Sequence[Optional[str]]]], List[Trajectory]]


class AdaptiveRollouts:
    """Spend ``len(questions) * group_size`` completions in planner-driven rounds."""

    def __init__(self, config):
        self.planner = RolloutPlanner(
            n0=config.planner_n0,
            budget_per_question=config.group_size,
            rounds=config.planner_rounds,
            lam=config.planner_lambda,
            alpha=config.planner_alpha,
            max_per_question=config.planner_max_per_question,
            allocation=config.planner_allocation,
        )

    def run(self, question_ids: Sequence[str], sample: SampleFn) -> Tuple[List[Trajectory], Dict[str, float]]:
        question_ids = list(question_ids)
        if not question_ids:
            return [], {}
        position = {q: i for i, q in enumerate(question_ids)}
        rewards: List[List[float]] = [[] for _ in question_ids]
        trajectories: List[Trajectory] = []

        def draw(counts: Sequence[int]) -> None:
            ids = [q for q, n in zip(question_ids, counts) if n > 0]
            if not ids:
                return
            new = sample(ids, [n for n in counts if n > 0], None)
            for t in new:
                # An unscored completion still used budget: None keeps it out of the std.
                rewards[position[t.question_id]].append(None if t.info.get("reward_error") else t.reward)
            trajectories.extend(new)

        draw(self.planner.initial(len(question_ids)))
        for r in range(self.planner.rounds):
            draw(self.planner.next_round(rewards, r))
        counts = np.asarray([len(r) for r in rewards])
        return trajectories, {
            "completions_per_question_mean": float(counts.mean()),
            "completions_per_question_min": float(counts.min()),
            "completions_per_question_max": float(counts.max()),
            "completions_per_question_std": float(counts.std()),
        }


class InContextSeeder:
    """XRPO in-context seeding with a corpus of the model's own verified solutions."""

    def __init__(self, config, *, seed: int = 0):
        self.config = config
        self.corpus = SolvedCorpus(capacity=config.icl_corpus_size, seed=seed)

    def remember(self, trajectories: Sequence[Trajectory], question_text: Callable[[str], str]) -> None:
        """Add the step's correct, unassisted completions to the corpus."""
        for t in trajectories:
            if t.reward >= 1.0 and not t.off_policy and t.info.get("completion_text"):
                self.corpus.add(t.question_id, question_text(t.question_id), t.info["completion_text"])

    def seed(
        self, trajectories: Sequence[Trajectory], question_text: Callable[[str], str], sample: SampleFn
    ) -> Tuple[List[Trajectory], Dict[str, float]]:
        """Extra seeded completions for the questions whose unassisted completions all failed."""
        outcome: Dict[str, List[float]] = {}
        for t in trajectories:
            if not t.off_policy:
                outcome.setdefault(t.question_id, []).append(t.reward)
        failing = [q for q, rs in outcome.items() if rs and max(rs) < 1.0]
        if self.config.icl_max_questions is not None:
            failing = failing[: self.config.icl_max_questions]
        prefixes, seeded_ids = [], []
        for qid in failing:
            examples = self.corpus.retrieve(question_text(qid), k=self.config.icl_num_examples, exclude_ids=[qid])
            if examples:
                seeded_ids.append(qid)
                prefixes.append(format_examples(examples))
        metrics = {
            "all_failing_questions": float(len(failing)),
            "seeded_questions": float(len(seeded_ids)),
            "corpus_size": float(len(self.corpus)),
        }
        if not seeded_ids:
            metrics["rescued_fraction"] = 0.0
            return [], metrics
        new = sample(seeded_ids, [self.config.icl_samples] * len(seeded_ids), prefixes)
        rescued = {t.question_id for t in new if t.reward >= 1.0}
        metrics["rescued_questions"] = float(len(rescued))
        metrics["rescued_fraction"] = len(rescued) / len(seeded_ids)
        return new, metrics

    def get_state(self) -> dict:
        return self.corpus.get_state()

    def set_state(self, state: dict) -> None:
        self.corpus.set_state(state)


def sharpen_advantages(groups: ScoredGroups, *, lambda_nov: float, kappa: float) -> Dict[str, float]:
    """Add XRPO's novelty bonus to ``groups.advantages`` in place; returns metrics.

    Novelty uses each completion's length-normalised log-likelihood under the policy that
    sampled it (its recorded behaviour log-probs), so no extra forward pass is needed.
    """
    if not groups.trajectories:
        return {}
    seq_logp = torch.as_tensor([float(np.mean(t.logp)) if len(t.logp) else 0.0 for t in groups.trajectories], dtype=torch.float32)
    rewards = torch.as_tensor([t.reward for t in groups.trajectories], dtype=torch.float32)
    new_adv, bonus = novelty_sharpened_advantages(
        torch.as_tensor(groups.advantages),
        rewards,
        seq_logp,
        torch.as_tensor(groups.group_index),
        lambda_nov=lambda_nov,
        kappa=kappa,
    )
    groups.advantages = new_adv.numpy().astype(np.float32)
    got = bonus > 0
    return {
        "sharpening_bonus_mean": float(bonus[got].mean()) if bool(got.any()) else 0.0,
        "sharpened_fraction": float(got.float().mean()),
    }
