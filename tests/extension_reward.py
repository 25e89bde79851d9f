"""A reward registered from outside rllib_exgrpo (tests/test_extension_points.py): its own
small module, because the verifier workers import it by name to run it."""

from rllib_exgrpo.envs.rewards import register_reward


@register_reward("short_answer")
def short_answer(completion: str, ground_truth: str, **_) -> float:
    """1.0 for a completion of at most 8 characters."""
    return 1.0 if len(completion) <= 8 else 0.0
