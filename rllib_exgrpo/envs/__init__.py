"""The single-step text environment, its data and its verifier reward.

Exports resolve lazily (PEP 562) so that ``import envs.rewards`` -- done by every
reward worker process -- does not pay for gymnasium, pyarrow or transformers.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "Problem": "envs.problem",
    "ReasoningEnv": "envs.reasoning_env",
    "load_problems": "envs.datasets",
    "DataFormatError": "envs.datasets",
    "ProblemList": "envs.datasets",
    "RewardResult": "envs.rewards",
    "math_reward": "envs.rewards",
    "score_batch": "envs.rewards",
    "score_with_fns": "envs.rewards",
    "render_prompt": "envs.prompting",
    "DEFAULT_INSTRUCTION": "envs.prompting",
}
_MODULES = ("arithmetic", "datasets", "prompting", "problem", "reasoning_env", "reward_examples", "rewards")

__all__ = sorted(_EXPORTS) + ["arithmetic"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(f"envs.{name}")
    else:
        raise AttributeError(f"module 'envs' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for static tools only
    from envs import arithmetic
    from envs.datasets import DataFormatError, ProblemList, load_problems
    from envs.problem import Problem
    from envs.prompting import DEFAULT_INSTRUCTION, render_prompt
    from envs.reasoning_env import ReasoningEnv
    from envs.rewards import RewardResult, math_reward, score_batch, score_with_fns
