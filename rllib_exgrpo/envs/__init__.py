"""The single-step text environment, its data and its verifier reward.

Exports resolve lazily (PEP 562) so that ``import rllib_exgrpo.envs.rewards`` -- done by the
reward worker processes for the built-in reward functions -- does not pay for gymnasium,
pyarrow or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "Problem": "rllib_exgrpo.envs.problem",
    "ReasoningEnv": "rllib_exgrpo.envs.reasoning_env",
    "load_problems": "rllib_exgrpo.envs.datasets",
    "DataFormatError": "rllib_exgrpo.envs.datasets",
    "ProblemList": "rllib_exgrpo.envs.datasets",
    "RewardResult": "rllib_exgrpo.envs.rewards",
    "math_reward": "rllib_exgrpo.envs.rewards",
    "score_batch": "rllib_exgrpo.envs.rewards",
    "score_with_fns": "rllib_exgrpo.envs.rewards",
    "render_prompt": "rllib_exgrpo.envs.prompting",
    "DEFAULT_INSTRUCTION": "rllib_exgrpo.envs.prompting",
}
_MODULES = ("arithmetic", "datasets", "prompting", "problem", "reasoning_env", "reward_examples", "rewards", "verifier_pool")

__all__ = sorted(_EXPORTS) + ["arithmetic"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(f"rllib_exgrpo.envs.{name}")
    else:
        raise AttributeError(f"module 'rllib_exgrpo.envs' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for static tools only
    from rllib_exgrpo.envs import arithmetic
    from rllib_exgrpo.envs.datasets import DataFormatError, ProblemList, load_problems
    from rllib_exgrpo.envs.problem import Problem
    from rllib_exgrpo.envs.prompting import DEFAULT_INSTRUCTION, render_prompt
    from rllib_exgrpo.envs.reasoning_env import ReasoningEnv
    from rllib_exgrpo.envs.rewards import RewardResult, math_reward, score_batch, score_with_fns
