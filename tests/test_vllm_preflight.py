"""vLLM engines a config cannot have, refused before anything starts (no vLLM needed).

``rllib train`` builds its experiments (``cli/experiment.py``: ``build_experiments``, the
preflight) before Ray starts; a config whose engines cannot work fails there, one line
naming the field (``generation/vllm.py``: ``engine_config_problems``):

* a tensor- or pipeline-parallel engine under ``colocate``;
* engines that together ask for more than the node's memory (vLLM's CPU build: each reserves
  ``gpu_memory_utilization``, default 0.92, of it) or than a GPU they share.

The engine build in the learner says the same, in case a config reaches it another way.
"""

from __future__ import annotations

import pytest

from rllib_exgrpo.cli.experiment import build_experiments
from rllib_exgrpo.cli.registry import CliConfigError
from rllib_exgrpo.generation.vllm import check_engine_config, engine_config_problems
from rllib_exgrpo.rllib.algorithm import GRPOConfig


def _spec(**config):
    return {
        "run": "GRPO",
        "stop": {"training_iteration": 1},
        "config": {"model_name_or_path": "tiny", "generation_backend": "vllm", "num_env_runners": 0, **config},
    }


def _lines(spec) -> list:
    with pytest.raises(CliConfigError) as e:
        build_experiments({"bad": spec})
    return str(e.value).splitlines()


@pytest.mark.parametrize("field", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_parallel_engine_under_colocate_is_refused_in_one_line(field):
    lines = _lines(_spec(colocate=True, num_learners=2, vllm_kwargs={field: 2, "kv_cache_memory_bytes": 1 << 26}))
    ours = [ln for ln in lines if f"vllm_kwargs.{field}" in ln]
    assert len(ours) == 1, lines
    assert ours[0].startswith(f"experiment 'bad': config: vllm_kwargs.{field}: must be 1 with colocate (got 2)")


def test_cpu_engines_that_each_ask_for_most_of_the_node_are_refused():
    lines = _lines(_spec(colocate=True, num_learners=2, vllm_kwargs={"gpu_memory_utilization": 0.92}))
    ours = [ln for ln in lines if "vllm_kwargs.gpu_memory_utilization" in ln]
    assert len(ours) == 1, lines
    assert ours[0].startswith(
        "experiment 'bad': config: vllm_kwargs.gpu_memory_utilization: 2 vLLM engines on CPU "
        "(one per learner) each reserve 0.92 of the node's memory"
    ), ours
    assert "1.84 > 1" in ours[0] and "kv_cache_memory_bytes" in ours[0]


def _cfg(**training):
    learners = training.pop("num_learners", 2)
    gpus = training.pop("num_gpus_per_learner", 0)
    training = {"generation_backend": "vllm", **training}
    return (
        GRPOConfig()
        .training(colocate=True, **training)
        .env_runners(num_env_runners=0)
        .learners(num_learners=learners, num_gpus_per_learner=gpus)
    )


def test_what_fits_passes_and_the_default_share_counts(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert engine_config_problems(_cfg(vllm_kwargs={})) != []  # vLLM's default share, 0.92 each
    assert engine_config_problems(_cfg(vllm_kwargs={"kv_cache_memory_bytes": 1 << 26})) == []  # fixed KV caches
    assert engine_config_problems(_cfg(vllm_kwargs={"gpu_memory_utilization": 0.45})) == []
    assert engine_config_problems(_cfg(num_learners=0, vllm_kwargs={})) == []  # one engine
    assert engine_config_problems(_cfg(generation_backend="hf", vllm_kwargs={"tensor_parallel_size": 4})) == []
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the CPU build's own fixed KV cache
    assert engine_config_problems(_cfg(vllm_kwargs={})) == []


def test_engines_sharing_a_gpu_must_fit_it():
    half = dict(num_learners=4, num_gpus_per_learner=0.5)
    (line,) = engine_config_problems(_cfg(vllm_kwargs={"gpu_memory_utilization": 0.6}, **half))
    assert line.startswith(
        "vllm_kwargs.gpu_memory_utilization: 2 vLLM engines share each GPU (num_gpus_per_learner: 0.5) and each takes 0.6 of it: 1.20 > 1"
    )
    assert engine_config_problems(_cfg(vllm_kwargs={"gpu_memory_utilization": 0.45}, **half)) == []
    assert engine_config_problems(_cfg(vllm_kwargs={"gpu_memory_utilization": 0.9}, num_learners=4, num_gpus_per_learner=1)) == []
    # Env runners (no colocate) that share a GPU: the same rule.
    runners = (
        GRPOConfig()
        .training(generation_backend="vllm", vllm_kwargs={"gpu_memory_utilization": 0.9})
        .env_runners(num_env_runners=3, num_gpus_per_env_runner=0.3)
    )
    (line,) = engine_config_problems(runners)
    assert "3 vLLM engines share each GPU (num_gpus_per_env_runner: 0.3)" in line


def test_the_engine_build_says_the_same_in_one_line():
    with pytest.raises(ValueError, match=r"^config\.vllm_kwargs\.tensor_parallel_size: must be 1 with colocate"):
        check_engine_config(_cfg(vllm_kwargs={"tensor_parallel_size": 2, "kv_cache_memory_bytes": 1 << 26}))
