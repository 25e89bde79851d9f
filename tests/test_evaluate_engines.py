"""Generation engines of ``rllib evaluate`` (``evaluation/engines.py``) without vLLM: the
backend choice, the engine layout over GPUs, how questions are split across engines, the
per-question budget, and the Ray path of several engines (a stand-in engine class on
Ray's logical GPUs). The real vLLM engine: tests/test_evaluate_vllm.py."""

from __future__ import annotations

import sys

import pytest

from rllib_exgrpo.evaluation import engines
from rllib_exgrpo.evaluation.engines import (
    BackendError,
    choose_backend,
    completion_budgets,
    plan_engines,
    split_requests,
)
from rllib_exgrpo.generation.base import SamplingParams


def test_backend_choice(monkeypatch):
    monkeypatch.setattr(engines, "vllm_installed", lambda: True)
    assert choose_backend("auto", gpus=2) == "vllm"
    assert choose_backend("auto", gpus=0) == "hf"  # no GPU: HF
    assert choose_backend("auto", gpus=2, device="cpu") == "hf"
    assert choose_backend("hf", gpus=8) == "hf"
    assert choose_backend("vllm", gpus=0) == "vllm"  # vLLM's CPU build: one CPU engine
    monkeypatch.setattr(engines, "vllm_installed", lambda: False)
    assert choose_backend("auto", gpus=8) == "hf"
    with pytest.raises(BackendError, match="--backend vllm needs vLLM: pip install"):
        choose_backend("vllm", gpus=8)
    with pytest.raises(BackendError, match="backend must be one of auto, vllm, hf"):
        choose_backend("tgi")


def test_engine_layout():
    assert plan_engines(8, 1).engines == 8
    lay = plan_engines(8, 2)
    assert (lay.engines, lay.gpus_per_engine) == (4, 2) and "4 vLLM engine(s) x 2 GPU(s)" in lay.describe
    assert "1 GPU(s) left idle" in plan_engines(7, 2).describe
    assert plan_engines(8, 2, num_engines=1).engines == 1
    cpu = plan_engines(0, 1)
    assert (cpu.engines, cpu.gpus_per_engine) == (1, 0) and cpu.describe == "1 vLLM engine on CPU"
    assert "Ray cluster at ray://head:10001" in plan_engines(4, 1, address="ray://head:10001").describe
    with pytest.raises(BackendError, match="needs 4 GPUs per engine; 2 visible"):
        plan_engines(2, 4)
    with pytest.raises(BackendError, match="needs GPUs"):
        plan_engines(0, 2)
    with pytest.raises(BackendError, match="--num-engines 3 x --tensor-parallel-size 2 needs 6 GPUs; 4 visible"):
        plan_engines(4, 2, num_engines=3)


def test_engine_kwargs():
    kw = engines.engine_kwargs(
        "/m", plan_engines(8, 2), dtype="bfloat16", seed=3, max_model_len=4096, extra={"gpu_memory_utilization": 0.85}
    )
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "mp"
    assert kw["dtype"] == "bfloat16" and kw["max_model_len"] == 4096 and kw["gpu_memory_utilization"] == 0.85
    assert kw["generation_config"] == "vllm" and "kv_cache_memory_bytes" not in kw
    cpu = engines.engine_kwargs("/m", plan_engines(0, 1), dtype="float32", seed=0, max_model_len=512)
    assert cpu["tensor_parallel_size"] == 1 and cpu["kv_cache_memory_bytes"] == engines.CPU_KV_CACHE_BYTES


def test_questions_are_split_evenly_and_completely():
    costs = [32, 32, 1, 1, 1, 1, 32, 1, 1, 1]
    parts = split_requests(costs, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    assert all(p == sorted(p) for p in parts)
    loads = sorted(sum(costs[i] for i in p) for p in parts)
    assert loads == [34, 34, 35]
    assert split_requests([1, 1], 4) == [[0], [1], [], []]
    assert split_requests(costs, 3) == parts  # deterministic


def test_completion_budgets_respect_the_context():
    budgets, capped = completion_budgets([10, 480, 500, 512, 600], 32, 512)
    assert budgets == [32, 32, 12, 0, 0] and capped == 3
    assert completion_budgets([10, 5000], 32, None) == ([32, 32], 0)


class FakeEngine:
    """Stands in for VLLMEngine inside a Ray actor: sample j of a request is
    [first prompt token, engine seed, j, max tokens, stop]."""

    def __init__(self, engine_kwargs):
        import os

        self.seed = engine_kwargs["seed"]
        self.gpus = os.environ.get("CUDA_VISIBLE_DEVICES")

    def ready(self):
        return 512

    def generate(self, requests, temperature, top_p, stop_token_ids):
        return [[([ids[0], self.seed, j, m, stop_token_ids[0], 99], "stop") for j in range(n)] for ids, n, m in requests]


@pytest.mark.slow
def test_several_engines_run_as_ray_actors_and_answer_in_question_order(monkeypatch):
    import ray
    from ray import cloudpickle  # Ray's own copy pickles the actor class

    if ray.is_initialized():
        ray.shutdown()  # the engines' own Ray (logical GPUs); the shared one restarts when wanted
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setattr(engines, "VLLMEngine", FakeEngine)
    layout = plan_engines(2, 1)
    gen = engines.VLLMGenerator("/m", layout, dtype="float32", seed=7, max_model_len=512)
    try:
        assert gen.max_model_len == 512 and len(gen.actors) == 2
        prompts = [[100 + i, 1, 2] for i in range(7)]
        counts = [4, 1, 1, 0, 2, 1, 1]
        budgets = [8, 8, 0, 8, 8, 5, 8]  # a question with no room, one with no samples
        params = SamplingParams(max_new_tokens=8, temperature=0.6, stop_token_ids=(999,), return_logprobs=False)
        out = gen.generate(prompts, counts, budgets, params)
    finally:
        gen.close()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert not ray.is_initialized()
    assert [len(g) for g in out] == [4, 1, 0, 0, 2, 1, 1]
    seeds = set()
    for i, group in enumerate(out):
        for j, c in enumerate(group):
            assert c.prompt_index == i and c.finish_reason == "stop"
            assert list(c.token_ids[:1]) == [100 + i] and c.token_ids[2] == j and c.token_ids[3] == budgets[i]
            assert list(c.token_ids[4:]) == [999]  # cut after the stop token
            seeds.add(int(c.token_ids[1]))
    assert seeds == {7, 8}  # both engines answered, seeded seed + engine index
