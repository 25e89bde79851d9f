"""One way to extend: bucket weighting, trajectory selection, rewards, generation backends and
algorithm names each come from a registry that a package outside rllib_exgrpo adds to with a
decorator (tests/extension_example.py), and each addition is used where the built-ins are."""

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

from rllib_exgrpo.cli.registry import ALGORITHM, resolve_algorithm
from rllib_exgrpo.core.registry import RegistryError
from rllib_exgrpo.envs.rewards import REWARD, load_reward_fn, score_with_fns
from rllib_exgrpo.exgrpo.buffer import BUCKET_WEIGHTING, TRAJECTORY_SELECTION, ExperienceBuffer, choose_trajectory
from rllib_exgrpo.generation.registry import GENERATION_BACKEND
from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

#: What tests/extension_example.py registers, by registry: removed again after this module,
#: so that no other test sees them (the registries are process-wide).
ADDED = (
    (BUCKET_WEIGHTING, "hardest_first"),
    (TRAJECTORY_SELECTION, "last"),
    (REWARD, "short_answer"),
    (GENERATION_BACKEND, "hf_greedy_batch1"),
    (ALGORITHM, "MyGRPO"),
)


@pytest.fixture(scope="module", autouse=True)
def extension_example():
    """Import the user package (registering one extension of each kind); unregister after."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        yield importlib.import_module("extension_example")
    finally:
        for registry, name in ADDED:
            if name in registry:
                registry.unregister(name)
        for module in ("extension_example", "extension_reward"):
            sys.modules.pop(module, None)
        sys.path.remove(str(Path(__file__).parent))


def test_a_registered_bucket_weighting_draws_as_defined():
    buf = ExperienceBuffer(4, bucket_weighting="hardest_first", seed=0)
    traj = (np.array([1, 2], np.int64), np.zeros(2, np.float32))
    for qid, correct in (("easy", 3), ("mid", 2), ("hard", 1)):
        assert buf.update_group(qid, [5], correct, 4, [traj], 0) == "added"
    assert [buf.bucket_of(q) for q in ("hard", "mid", "easy")] == [1, 2, 3]
    assert all(buf.sample_questions(1) == ["hard"] for _ in range(20))
    assert buf.bucket_probabilities() == {1: 1.0, 2: 0.0, 3: 0.0}
    ExGRPOConfig().training(bucket_weighting="hardest_first").validate()


def test_a_registered_trajectory_selection_is_chosen_by_name():
    assert choose_trajectory([(0.1, -1.0), (0.2, -2.0), (0.3, -3.0)], "last") == 2
    ExGRPOConfig().training(trajectory_selection="last").validate()


def test_a_registered_reward_runs_in_the_verifier_workers(extension_example):
    fn, _ = load_reward_fn("short_answer")
    assert fn is extension_example.short_answer
    results = score_with_fns(["42", "a much longer completion"], ["42", "7"], fns=["short_answer"], num_workers=1, timeout_s=60.0)
    assert [r.score for r in results] == [1.0, 0.0] and all(r.error is None for r in results)


def test_a_registered_generation_backend_is_accepted_and_built(extension_example):
    ExGRPOConfig().training(generation_backend="hf_greedy_batch1").validate()
    with pytest.raises(ValueError, match=r"generation_backend must be one of \['hf', 'vllm', 'hf_greedy_batch1'"):
        ExGRPOConfig().training(generation_backend="nope").validate()
    with pytest.raises(RegistryError, match="hf_greedy_batch1"):
        extension_example.GENERATION_BACKEND.get("nope")


def test_a_registered_algorithm_name_resolves(extension_example):
    assert resolve_algorithm("MyGRPO") is extension_example.MyGRPO
