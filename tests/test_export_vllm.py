"""An exported model folder (``rllib export``) loads in vLLM: its greedy completion equals
transformers' greedy output from the same folder. Runs in the vLLM CPU venv
(``bash tests/run.sh vllm tests/test_export_vllm.py``)."""

from __future__ import annotations

import os

import pytest

from rllib_exgrpo.cli import main as cli

MAX_NEW = 16
QUESTION = "Tom has 12 apples and buys 30 more. How many apples does Tom have? Please answer with a number."


@pytest.fixture(scope="module")
def exported(quick_tiny_model, tmp_path_factory):
    """A policy module with its weights moved off the base model's, saved as a module
    folder (a checkpoint ``rllib export`` takes) and exported."""
    import gymnasium as gym
    import numpy as np
    import torch

    from rllib_exgrpo.models.loading import load_tokenizer
    from rllib_exgrpo.rllib.module import LLMTorchRLModule

    tok = load_tokenizer(quick_tiny_model)
    space = gym.spaces.Box(0, len(tok) - 1, shape=(128,), dtype=np.int64)
    module = LLMTorchRLModule(
        observation_space=space, action_space=space, model_config={"model": quick_tiny_model, "dtype": "float32", "temperature": 1.0}
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.3 * float(p.std()) + 1e-3))
    root = tmp_path_factory.mktemp("export_vllm")
    module.save_to_path(str(root / "module"))
    assert cli.main(["export", str(root / "module"), str(root / "hf")]) == 0
    return root / "hf"


def _until_eos(ids, eos):
    ids = list(ids)
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@pytest.mark.vllm
def test_vllm_loads_the_export_and_matches_transformers_greedy(exported):
    pytest.importorskip("vllm", reason="vllm not installed (bash tests/run.sh vllm)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(exported))
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            pad_token_id=tok.pad_token_id or tok.eos_token_id,
        )
    hf_ids = _until_eos(out[0, len(prompt) :].tolist(), tok.eos_token_id)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rllib_exgrpo.generation.vllm import guard_llvmlite_lib_against_vllm_kernel_scan, import_vllm

    vllm = import_vllm()
    guard_llvmlite_lib_against_vllm_kernel_scan()
    llm = vllm.LLM(
        model=str(exported),
        dtype="float32",
        seed=0,
        max_model_len=256,
        max_num_seqs=1,
        kv_cache_memory_bytes=64 << 20,
        block_size=32,
        generation_config="vllm",
    )
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
        (result,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        vllm_ids = _until_eos(result.outputs[0].token_ids, tok.eos_token_id)
    finally:
        del llm
    assert len(hf_ids) > 1
    assert vllm_ids == hf_ids, (tok.decode(vllm_ids), tok.decode(hf_ids))
