"""A user package's extensions, one of each kind (the reward in extension_reward.py, a light
module the verifier workers import by name), registered from outside rllib_exgrpo with
the decorators the built-ins use (tests/test_extension_points.py imports it)."""

import numpy as np

from rllib_exgrpo.cli.registry import register_algorithm
from rllib_exgrpo.exgrpo.buffer import register_bucket_weighting, register_trajectory_selection
from rllib_exgrpo.generation.registry import GENERATION_BACKEND, register_generation_backend
from rllib_exgrpo.rllib.algorithm import GRPO

from extension_reward import short_answer  # noqa: F401  (registers the reward)


@register_bucket_weighting("hardest_first")
def hardest_first(G: int, mu: float, sigma: float) -> np.ndarray:
    """Only bucket 1 (one correct answer in G) is ever drawn."""
    logw = np.full(G - 1, -np.inf)
    logw[0] = 0.0
    return logw


@register_trajectory_selection("last")
def last_trajectory(trajectory_stats, rng=None) -> int:
    return len(trajectory_stats) - 1


@register_generation_backend("hf_greedy_batch1")
def hf_batch_of_one(settings, module, tokenizer):
    """The HF backend, one prompt per batch."""
    from rllib_exgrpo.generation.hf import HFGenerationBackend

    return HFGenerationBackend(module.model, pad_token_id=tokenizer.pad_token_id, batch_size=1)


@register_algorithm("MyGRPO")
class MyGRPO(GRPO):
    """GRPO under a name of the user's."""


__all__ = ["GENERATION_BACKEND"]
