"""rllib-exgrpo: ExGRPO, XRPO and GRPO for LLM reasoning as Ray RLlib algorithms.

As with RLlib's own algorithms (``from ray.rllib.algorithms.ppo import PPO, PPOConfig``)
the algorithms and their configs are at the package top::

    from rllib_exgrpo import ExGRPO, ExGRPOConfig, GRPO, GRPOConfig
    from rllib_exgrpo import ExGRPOTorchLearner, LLMTorchRLModule, LLMEnvRunner

They resolve lazily (PEP 562): importing a submodule (``rllib_exgrpo.models``, say) does
not pay for ``ray.rllib``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ExGRPO": "rllib_exgrpo.rllib.algorithm",
    "GRPO": "rllib_exgrpo.rllib.algorithm",
    "ExGRPOConfig": "rllib_exgrpo.rllib.algorithm",
    "GRPOConfig": "rllib_exgrpo.rllib.algorithm",
    "ExGRPOTorchLearner": "rllib_exgrpo.rllib.learner",
    "LLMTorchRLModule": "rllib_exgrpo.rllib.module",
    "LLMEnvRunner": "rllib_exgrpo.rllib.env_runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rllib_exgrpo' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
