"""The one record every data source is turned into."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Problem:
    """A reasoning question with its verifiable answer.

    Attributes:
        id: Stable, unique identifier (used by the replay buffer and the retired set).
        question: The question text shown to the policy (no answer in it).
        ground_truth: The reference answer the verifier compares against. Never shown
            to the policy.
        data_source: Name of the benchmark / family the problem comes from.
        solution: Optional worked solution (used only for supervised warm starts).
        difficulty: Optional integer difficulty level (higher is harder).
    """

    id: str
    question: str
    ground_truth: str
    data_source: str
    solution: Optional[str] = None
    difficulty: Optional[int] = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)
