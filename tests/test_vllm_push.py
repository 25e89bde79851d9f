"""The weight push into vLLM (``generation/vllm.py``: ``push_weight_buckets``), one load per sync.

* without vLLM: a stream of buckets is one weight-load call; with ``copy`` the tensors that
  vLLM keeps past their bucket (its deferred layers) stay right after the bucket is released
  (as ZeRO-3 releases a gathered layer); an engine in another process gets one bucket of
  bytes per RPC and then one load;
* with vLLM's CPU build (marked ``vllm``): a colocated learner's push into its engine is one
  call of vLLM's in-place reload (``reload_weights`` of the model runner, the function both
  of vLLM's runners call) and vLLM says nothing while it loads (no warning record of the
  ``vllm`` logger, nothing printed but its INFO lines); the engine then scores a fixed sequence as a plain HF
  model with the learner's weights does.
"""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest
import torch

from rllib_exgrpo.generation.vllm import VLLMGenerationBackend, WeightSyncWorkerExtension

NAMES = [f"model.layers.{i}.{p}.weight" for i in range(3) for p in ("q_proj", "k_proj")] + [
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
]


def _backend(llm, *, in_process: bool) -> VLLMGenerationBackend:
    backend = VLLMGenerationBackend(types.SimpleNamespace(seed=0), None, None)
    backend.llm, backend._has_extension, backend._weights_in_process = llm, True, in_process
    backend._model_names = list(NAMES)
    return backend


class _Worker(WeightSyncWorkerExtension):
    """vLLM's worker as the extension sees it: ``reload_weights`` keeps every tensor it is
    given until the end, as vLLM keeps those of a layer it has not finished."""

    def __init__(self):
        self.loads = []

    def reload_weights(self, weights_iterator):
        self.loads.append(list(weights_iterator))


class _LLM:
    """``vllm.LLM.collective_rpc`` over one worker, counting the calls by method."""

    def __init__(self):
        self.worker, self.rpcs = _Worker(), []

    def collective_rpc(self, method, args=(), kwargs=None):
        self.rpcs.append((method, sum(len(a) for a in args if isinstance(a, (bytes, bytearray)))))
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]


def _released_buckets(values):
    """Buckets of ``values``' tensors that are zeroed when the next bucket is asked for (a
    ZeRO-3 layer released after its gather)."""
    from rllib_exgrpo.models.weight_buckets import layer_buckets

    for bucket in layer_buckets({k: v.clone() for k, v in values.items()}):
        yield bucket
        for tensor in bucket.values():
            tensor.zero_()


@pytest.fixture
def values():
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(4, 3, generator=gen) + 5 for name in NAMES}


def test_a_stream_of_buckets_is_one_load_and_copy_keeps_released_tensors(values):
    for copy in (False, True):
        llm = _LLM()
        assert _backend(llm, in_process=True).push_weight_buckets(_released_buckets(values), copy=copy) == len(NAMES)
        assert [m for m, _ in llm.rpcs] == ["rllib_exgrpo_load_weights"]  # one load for the whole model
        (load,) = llm.worker.loads
        assert [n for n, _ in load] == NAMES  # decoder layers in order, then the rest
        kept = all(torch.equal(t, values[n]) for n, t in load)
        assert kept is copy  # without copy the released tensors are gone by the end of the load


def test_a_master_copy_is_cast_to_the_engines_dtype_on_the_way_in(values):
    """fp32 master weights (a DDP learner under bf16 autocast) into a bf16 engine: cast as
    vLLM's loader would cast them, so it has nothing to warn about; a new tensor, so a
    released bucket cannot reach it either."""
    llm = _LLM()
    llm.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.bfloat16))
    _backend(llm, in_process=True).push_weight_buckets(_released_buckets(values), copy=False)
    (load,) = llm.worker.loads
    for name, tensor in load:
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, values[name].bfloat16(), rtol=0, atol=0)


def test_an_engine_in_another_process_gets_a_bucket_of_bytes_per_call_then_one_load(values):
    llm = _LLM()
    backend = _backend(llm, in_process=False)
    assert backend.push_weight_buckets(_released_buckets(values), copy=True) == len(NAMES)
    methods = [m for m, _ in llm.rpcs]
    assert methods == ["rllib_exgrpo_stage_weights"] * 4 + ["rllib_exgrpo_load_staged"]  # 3 layers + the rest
    assert max(size for _, size in llm.rpcs) < 4 * 3 * 4 * 3 + 1024  # a bucket of bytes each, not the model
    (load,) = llm.worker.loads
    assert [n for n, _ in load] == NAMES  # in the order sent
    for name, tensor in load:
        torch.testing.assert_close(tensor, values[name], rtol=0, atol=0)
    assert not getattr(llm.worker, "_rllib_exgrpo_staged", None)  # nothing left staged
    # An env runner's whole state dict takes the same path.
    llm.rpcs.clear()
    backend.weights_changed = lambda: None
    backend.load_weights(values)
    assert [m for m, _ in llm.rpcs] == ["rllib_exgrpo_stage_weights"] * 4 + ["rllib_exgrpo_load_staged"]


# ---- the real engine (vLLM's CPU build) ------------------------------------------------------
@pytest.mark.vllm
def test_every_model_runner_loads_through_vllms_inplace_reload():
    """The CPU build runs model runner V1, CUDA V2 by default: both load through the same
    function (``reload.inplace.reload_weights``), checked on the installed vLLM's classes,
    the GPU ones included; a runner that loads another way is named."""
    pytest.importorskip("vllm", reason="vllm not installed (bash tests/run.sh vllm)")
    from rllib_exgrpo.generation.vllm import _same_reload_problem, vllm_api_problems

    assert vllm_api_problems("cpu") == [] and vllm_api_problems("gpu") == []

    class Elsewhere:
        def reload_weights(self, weights_iterator=None):
            self.model.load_weights(weights_iterator)

    assert "does not load through" in _same_reload_problem(Elsewhere, "Elsewhere.reload_weights")


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(f"{record.name}: {record.getMessage()[:200]}")


@pytest.mark.vllm
def test_colocated_push_is_one_reload_and_vllm_says_nothing(quick_tiny_model):
    pytest.importorskip("vllm", reason="vllm not installed (bash tests/run.sh vllm)")
    import vllm.v1.worker.gpu_model_runner as v1_runner
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rllib_exgrpo.cli.rehearsal import VLLM_CPU_KWARGS
    from rllib_exgrpo.models.loading import load_tokenizer
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
    from rllib_exgrpo.rllib.env_runner import token_spaces
    from test_colocate_sync import _engine_prompt_logprobs, _plain_logprobs

    cfg = (
        ExGRPOConfig()
        .environment(env_config={"dataset": "arithmetic"})
        .training(
            model_name_or_path=quick_tiny_model,
            max_prompt_tokens=96,
            max_response_tokens=8,
            colocate=True,
            generation_backend="vllm",
            behaviour_logprobs="engine",
            generation_batch_size=8,
            vllm_kwargs=dict(VLLM_CPU_KWARGS),
        )
        .env_runners(num_env_runners=0)
    )
    tok = load_tokenizer(quick_tiny_model)
    group = cfg.build_learner_group(spaces={DEFAULT_MODULE_ID: token_spaces(len(tok), 96, 8)})
    learner = group._learner
    sampler = learner.colocated_sampler()
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    reloads = []
    inner = v1_runner.reload_weights
    said = _Said()
    try:
        sampler.backend.build_engine()  # what the engine says while it starts is not counted
        v1_runner.reload_weights = lambda *a, **k: (reloads.append(1), inner(*a, **k))[1]
        logging.getLogger("vllm").addHandler(said)
        gen = torch.Generator().manual_seed(1)
        for turn in range(2):
            with torch.no_grad():  # new weights, as an update brings them
                for p in module.model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.02)
            pushed = sampler.push_weights()
            assert pushed == len(module.model.state_dict())
            assert len(reloads) == turn + 1  # one in-place reload per push, for the whole model
        logging.getLogger("vllm").removeHandler(said)
        # (vLLM's own INFO lines are not read here: a capture of the process's output breaks
        # when an earlier test in the worker left vLLM's handler on a closed stream.)
        assert said.records == [], said.records
        weights = {k: v.detach().float() for k, v in module.model.state_dict().items()}
        gap = np.abs(_engine_prompt_logprobs(sampler.backend.llm) - _plain_logprobs(module.model.config, weights))
        assert float(gap.max()) <= 2e-3
    finally:
        v1_runner.reload_weights = inner
        logging.getLogger("vllm").removeHandler(said)
        sampler.backend.close()
        group.shutdown()


@pytest.mark.vllm
@pytest.mark.slow
def test_an_engine_in_its_own_process_takes_the_weights_a_layer_of_bytes_at_a_time(quick_tiny_model, monkeypatch):
    """``VLLM_ENABLE_V1_MULTIPROCESSING=1``: the engine (and on the CPU build its worker) in
    processes of their own. A sync sends one decoder layer of bytes per RPC, then one load;
    the engine then scores as a plain HF model with the new weights."""
    pytest.importorskip("vllm", reason="vllm not installed (bash tests/run.sh vllm)")
    import gymnasium as gym

    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
    from rllib_exgrpo.rllib.module import LLMTorchRLModule
    from test_colocate_sync import IDS, _engine_prompt_logprobs, _plain_logprobs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    cfg = ExGRPOConfig()
    cfg.model_name_or_path, cfg.model_dtype, cfg.seed = quick_tiny_model, "float32", 0
    cfg.max_prompt_tokens, cfg.max_response_tokens, cfg.generation_batch_size = 96, 8, 8
    cfg.vllm_kwargs = {"kv_cache_memory_bytes": 64 << 20, "block_size": 32, "enforce_eager": True}
    space = gym.spaces.Discrete(2)
    module = LLMTorchRLModule(
        observation_space=space, action_space=space, model_config={"model": quick_tiny_model, "dtype": "float32"}
    ).eval()
    backend = VLLMGenerationBackend(cfg, module, None)
    try:
        backend.build_engine()
        assert not backend._weights_in_process
        rpcs = []
        rpc = backend.llm.collective_rpc

        def counting(method, *args, **kwargs):
            payload = sum(len(a) for a in kwargs.get("args", ()) if isinstance(a, (bytes, bytearray)))
            rpcs.append((method, payload))
            return rpc(method, *args, **kwargs)

        backend.llm.collective_rpc = counting
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in module.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        backend.load_weights(module.get_state())
        layers = module.model.config.num_hidden_layers
        assert [m for m, _ in rpcs] == ["rllib_exgrpo_stage_weights"] * (layers + 1) + ["rllib_exgrpo_load_staged"]
        total = sum(v.numel() * v.element_size() for v in module.model.state_dict().values())
        assert max(size for _, size in rpcs) < total / 2  # a layer (or the embeddings) per message, not the model
        weights = {k: v.detach().float() for k, v in module.model.state_dict().items()}
        gap = np.abs(_engine_prompt_logprobs(backend.llm) - _plain_logprobs(module.model.config, weights))
        assert float(gap.max()) <= 2e-3 and len(gap) == len(IDS) - 1
    finally:
        backend.close()
