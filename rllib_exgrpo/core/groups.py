"""From sampled episodes to scored groups to the learner's padded numpy batch.

Plain dataclasses and numpy, no RLlib or torch state, so that each stage can be tested on
hand-made inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.losses import group_advantages, zero_variance_group_mask
from rllib_exgrpo.core.tokens import prompt_completion_batch


@dataclass
class Trajectory:
    """One completion of one question with what training needs of it."""

    question_id: str
    prompt_ids: np.ndarray  # int [P]
    completion_ids: np.ndarray  # int [R]
    logp: Optional[np.ndarray]  # float32 [R], behaviour log-probs (None until the learners score it: scoring_on: learners)
    reward: float
    #: Off-policy: trained with the recorded log-probs and policy shaping (ExGRPO replay,
    #: and XRPO seeded completions whose log-probs were recorded under another prompt).
    off_policy: bool = False
    #: Generated with in-context examples prepended (XRPO seeding): not the policy's own
    #: unassisted attempt, so it does not count towards the question's correctness.
    seeded: bool = False
    info: dict = field(default_factory=dict)

    @property
    def replayed(self) -> bool:
        """Drawn from ExGRPO's experience pool (off-policy and not a seeded completion)."""
        return self.off_policy and not self.seeded


def trajectories_from_episodes(episodes) -> List[Trajectory]:
    """Turn ``LLMEnvRunner`` episodes back into trajectories."""
    out = []
    for e in episodes:
        info = e.get_infos(-1)
        seeded = bool(info.get("seeded", False))
        # No log-probs recorded: the learners score the completion (scoring_on: learners).
        logp = np.asarray(e.get_extra_model_outputs(C.ACTION_LOGP, 0), dtype=np.float32) if C.ACTION_LOGP in e.extra_model_outputs else None
        out.append(
            Trajectory(
                question_id=info[C.QUESTION_ID],
                prompt_ids=np.asarray(e.get_observations(0)),
                completion_ids=np.asarray(e.get_actions(0)),
                logp=logp,
                reward=float(e.get_return()),
                off_policy=seeded,
                seeded=seeded,
                info=info,
            )
        )
    return out


@dataclass
class ScoredGroups:
    """Trajectories in group order with their advantages and per-group statistics."""

    trajectories: List[Trajectory]
    group_index: np.ndarray  # int64 [N], group of each trajectory
    question_ids: List[str]  # [num_groups]
    advantages: np.ndarray  # float32 [N]
    group_correct: np.ndarray  # int64 [num_groups], k = number of reward-1 completions
    group_size: np.ndarray  # int64 [num_groups]
    zero_variance: np.ndarray  # bool [num_groups]


def score_groups(trajectories: Sequence[Trajectory], *, estimator: str = "mean_centered", eps: float = 1e-6) -> ScoredGroups:
    """Group trajectories by question and compute group-relative advantages.

    Every trajectory of a question (fresh and replayed alike) is in one group, so a
    replayed trajectory's group advantage uses all of the group's rewards.
    """
    order: Dict[str, int] = {}
    for t in trajectories:
        order.setdefault(t.question_id, len(order))
    ordered = sorted(trajectories, key=lambda t: order[t.question_id])
    group_index = np.asarray([order[t.question_id] for t in ordered], dtype=np.int64)
    rewards = torch.as_tensor([t.reward for t in ordered], dtype=torch.float32)
    gidx = torch.as_tensor(group_index)
    adv = group_advantages(rewards, gidx, mode=estimator, eps=eps) if len(ordered) else rewards
    num_groups = len(order)
    correct = np.zeros(num_groups, dtype=np.int64)
    sizes = np.zeros(num_groups, dtype=np.int64)
    np.add.at(correct, group_index, (rewards.numpy() >= 1.0).astype(np.int64))
    np.add.at(sizes, group_index, 1)
    zero_var = zero_variance_group_mask(rewards, gidx).numpy() if len(ordered) else np.zeros(0, dtype=bool)
    return ScoredGroups(
        trajectories=ordered,
        group_index=group_index,
        question_ids=list(order),
        advantages=adv.numpy().astype(np.float32),
        group_correct=correct,
        group_size=sizes,
        zero_variance=zero_var,
    )


def learner_batch(trajectories: Sequence[Trajectory], advantages: np.ndarray, pad_id: int) -> Dict[str, np.ndarray]:
    """Pad trajectories into the learner's column layout (see ``columns.py``)."""
    ids, mask, resp_mask = prompt_completion_batch([t.prompt_ids for t in trajectories], [t.completion_ids for t in trajectories], pad_id)
    width = resp_mask.shape[1]
    old_logp = np.zeros((len(trajectories), width), dtype=np.float32)
    for i, t in enumerate(trajectories):
        old_logp[i, : len(t.logp)] = t.logp
    return {
        C.INPUT_IDS: ids.numpy(),
        C.ATTENTION_MASK: mask.numpy(),
        C.RESPONSE_MASK: resp_mask.numpy().astype(np.float32),
        C.OLD_LOGP: old_logp,
        C.ADVANTAGES: np.asarray(advantages, dtype=np.float32),
        C.REWARDS: np.asarray([t.reward for t in trajectories], dtype=np.float32),
        C.OFF_POLICY: np.asarray([t.off_policy for t in trajectories], dtype=np.float32),
    }


def to_multi_agent_batch(columns: Dict[str, np.ndarray]) -> MultiAgentBatch:
    n = len(columns[C.ADVANTAGES])
    return MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(columns)}, env_steps=n)
