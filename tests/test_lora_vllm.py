"""LoRA learners with the vLLM backend (marked ``vllm``: ``bash tests/run.sh vllm``).

A LoRA learner's module with non-zero adapters hands the env runner its merged weights
(``get_state(inference_only=True)``); the runner loads them into its plain module and from
there into the vLLM engine, as ``LLMEnvRunner._load_module_state`` does. The engine's own
log-probs of its samples then equal the merged model's (within the CPU kernels' round-off,
as in ``test_vllm_backend.py``) and no longer the base model's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rllib_exgrpo.generation.base import SamplingParams

from test_vllm_backend import QUESTIONS, vllm_module  # noqa: F401  (the skip-unless-vLLM fixture)

MAX_NEW = 16


def _module(model, *, lora: bool):
    import gymnasium as gym

    from rllib_exgrpo.rllib.module import LLMTorchRLModule

    config = {"model": model, "dtype": "float32", "temperature": 1.0}
    if lora:
        config["lora"] = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
    space = gym.spaces.Discrete(2)
    return LLMTorchRLModule(observation_space=space, action_space=space, model_config=config, inference_only=not lora).eval()


def _module_logp(model, prompts, groups, pad_id) -> list:
    from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy
    from rllib_exgrpo.core.tokens import prompt_completion_batch

    flat = [(prompts[i], c) for i, g in enumerate(groups) for c in g]
    ids, mask, resp = prompt_completion_batch([p for p, _ in flat], [c.token_ids for _, c in flat], pad_id)
    with torch.no_grad():
        logp, _ = completion_logprobs_and_entropy(model, ids, mask, resp.shape[1], temperature=1.0)
    return [logp[k, : len(c.token_ids)].numpy() for k, (_, c) in enumerate(flat)]


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_logprobs_after_a_sync_equal_the_merged_models(vllm_module, quick_tiny_model):  # noqa: F811
    from rllib_exgrpo.generation.vllm import VLLMGenerationBackend
    from rllib_exgrpo.models.loading import load_tokenizer
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    cfg = ExGRPOConfig().training(
        model_name_or_path=quick_tiny_model,
        max_prompt_tokens=128,
        max_response_tokens=MAX_NEW,
        generation_batch_size=16,
        vllm_kwargs={"kv_cache_memory_bytes": 64 << 20, "block_size": 32},
    )
    tok = load_tokenizer(quick_tiny_model)
    learner = _module(quick_tiny_model, lora=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # adapters as training leaves them: B no longer zero
        for name, p in learner.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    runner = _module(quick_tiny_model, lora=False)
    prompts = [
        tok(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )["input_ids"]
        for q in QUESTIONS
    ]
    backend = VLLMGenerationBackend(cfg, runner, tok)
    try:
        runner.set_state(learner.get_state(inference_only=True))  # the sync, as the env runner loads it
        backend.load_weights(runner.state_dict())
        params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, stop_token_ids=(tok.eos_token_id,))
        groups = backend.generate(prompts, [2] * len(prompts), params)
        merged = _module_logp(learner.model, prompts, groups, tok.pad_token_id)  # the learner's LoRA forward
        base = _module_logp(_module(quick_tiny_model, lora=False).model, prompts, groups, tok.pad_token_id)
        engine = [c.engine_logp for g in groups for c in g]
        for got, want in zip(engine, merged):
            np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
        assert max(float(np.abs(e - b).max()) for e, b in zip(engine, base)) > 2e-2, "the engine runs the base model"
    finally:
        backend.close()
