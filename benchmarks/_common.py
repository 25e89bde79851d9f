"""Shared helpers of the benchmark scripts: configs from the tuned examples, local Ray."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Recipes compared by the benchmarks: tuned example file + config overrides.
RECIPES = {
    "ppo": ("ppo_tiny.yaml", {}),
    "grpo": ("grpo_stream_tiny.yaml", {}),
    "exgrpo": ("exgrpo_stream_tiny.yaml", {}),
    "xrpo": ("xrpo_tiny.yaml", {}),
    "exgrpo_xrpo": ("exgrpo_xrpo_tiny.yaml", {}),
    "grpo_ops": ("grpo_operators_tiny.yaml", {}),
    "exgrpo_ops": ("exgrpo_operators_tiny.yaml", {}),
}


def start_ray():
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    return ray


def recipe_config(name: str, **overrides):
    """The validated AlgorithmConfig of a tuned example, with overrides applied."""
    from rllib_exgrpo.cli.experiment import build_experiments

    file, base = RECIPES[name]
    experiments = build_experiments(str(ROOT / "tuned_examples" / file), config_overrides={**base, **overrides})
    return experiments[0].config
