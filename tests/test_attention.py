"""Attention that matches the layout (core/attention.py).

* ``sdpa_varlen`` gives the numbers of transformers' ``sdpa`` on padded rows, on
  generation with a cache, and on packed rows (against each row alone);
* a packed pass under it builds no ``[T, T]`` tensor, while under ``sdpa`` it does (so the
  detector sees one where there is one);
* the learner packs only under a variable-length kernel and otherwise falls back to padded
  passes, saying so once;
* ``attn_implementation`` is a config field: "auto" resolves per device, bad values fail.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.attention import (
    SDPA_VARLEN,
    cu_seq_lens,
    packs_rows,
    register_kernels,
    resolve_attn_implementation,
)
from rllib_exgrpo.core.packing import pack_rows, score_packed
from rllib_exgrpo.core.tokens import position_ids_from_mask


def _model(kernel: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    register_kernels()
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=200, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    model.set_attn_implementation(kernel)
    return model


def test_varlen_matches_sdpa_on_padded_rows_and_generation():
    varlen, sdpa = _model(SDPA_VARLEN), _model("sdpa")
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :4] = 0
    mask[1, -2:] = 0
    ids = torch.randint(1, 200, (3, 12)) * mask
    inputs = dict(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
    real = mask.bool().unsqueeze(-1)
    torch.testing.assert_close(varlen(**inputs).logits * real, sdpa(**inputs).logits * real, atol=1e-6, rtol=1e-5)
    left = mask.clone()
    left[1, -2:] = 1  # generation takes left-padded prompts
    gen = dict(input_ids=ids, attention_mask=left, max_new_tokens=6, do_sample=False)
    assert torch.equal(varlen.generate(**gen), sdpa.generate(**gen))


def test_varlen_attends_within_each_packed_row():
    model = _model(SDPA_VARLEN)
    ids = torch.randint(1, 200, (1, 30))
    pos = torch.cat([torch.arange(7), torch.arange(15), torch.arange(8)]).unsqueeze(0)
    alone = torch.cat([model(input_ids=ids[:, s:e]).logits for s, e in ((0, 7), (7, 22), (22, 30))], dim=1)
    torch.testing.assert_close(model(input_ids=ids, position_ids=pos).logits, alone, atol=1e-5, rtol=1e-5)
    bounds = cu_seq_lens(pos)
    assert bounds.tolist() == [0, 7, 22, 30]
    torch.testing.assert_close(model(input_ids=ids, position_ids=pos, cu_seq_lens_q=bounds).logits, alone,
                               atol=1e-5, rtol=1e-5)


class _LargestSquare(TorchDispatchMode):
    """Records the largest ``[.., T, T]`` trailing block of any tensor an op produces."""

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens, self.seen = tokens, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(t) and t.dim() >= 2 and t.shape[-1] >= self.tokens and t.shape[-2] >= self.tokens:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def _packed_batch(rows: int = 6, prompt: int = 5, completion: int = 9):
    mask = torch.ones(rows, prompt + completion, dtype=torch.long)
    for r in range(rows):
        mask[r, : r % 3] = 0  # left-padded prompts
        mask[r, prompt + completion - (r % 4):] = 0  # right-padded completions
    ids = torch.randint(1, 200, mask.shape) * mask
    cols = {C.INPUT_IDS: ids, C.ATTENTION_MASK: mask, C.RESPONSE_MASK: mask[:, prompt:].float()}
    return {**cols, **pack_rows(cols)}


@pytest.mark.parametrize("kernel,dense", [(SDPA_VARLEN, False), ("sdpa", True)])
def test_packed_pass_builds_no_square_tensor_under_a_varlen_kernel(kernel, dense):
    model = _model(kernel)
    batch = _packed_batch()
    tokens = batch[C.PACKED_INPUT_IDS].shape[1]
    watch = _LargestSquare(tokens)
    with watch:
        logp, _ = score_packed(model, batch)
        logp.sum().backward()
    assert bool(watch.seen) == dense, watch.seen[:3]


def test_learner_falls_back_to_padded_passes_without_a_varlen_kernel(quick_tiny_model, caplog):
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
    from rllib_exgrpo.models.loading import load_tokenizer
    from rllib_exgrpo.rllib.env_runner import token_spaces

    for kernel, packs in ((SDPA_VARLEN, True), ("sdpa", False)):
        cfg = ExGRPOConfig().training(model_name_or_path=quick_tiny_model, max_prompt_tokens=16,
                                      max_response_tokens=8, learner_micro_batch_tokens=24,
                                      attn_implementation=kernel)
        vocab = len(load_tokenizer(quick_tiny_model))
        mask = torch.ones(4, 24, dtype=torch.long)
        mask[:, :3] = 0
        batch = {DEFAULT_MODULE_ID: {C.INPUT_IDS: torch.randint(1, vocab, (4, 24)) * mask, C.ATTENTION_MASK: mask,
                                     C.RESPONSE_MASK: mask[:, 16:].float()}}
        with caplog.at_level(logging.WARNING):
            caplog.clear()  # said once, from the build on
            learner = cfg.build_learner_group(spaces={DEFAULT_MODULE_ID: token_spaces(vocab, 16, 8)})._learner
            passes = learner._micro_batches(batch)
            learner._micro_batches(batch)
        assert learner.module[DEFAULT_MODULE_ID].model.config._attn_implementation == kernel
        assert all((C.PACKED_INPUT_IDS in p[DEFAULT_MODULE_ID]) == packs for p in passes)
        said = [r for r in caplog.records if "no variable-length path" in r.getMessage()]
        assert len(said) == (0 if packs else 1)


def test_auto_resolves_per_device_and_the_field_is_checked():
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    assert resolve_attn_implementation("auto", "cpu") == SDPA_VARLEN
    try:
        import flash_attn  # noqa: F401
        expected = "flash_attention_2"
    except ImportError:
        expected = SDPA_VARLEN
    assert resolve_attn_implementation("auto", "cuda") == expected
    assert resolve_attn_implementation("eager", "cuda") == "eager"
    assert packs_rows("flex_attention", "cuda") and not packs_rows("flex_attention", "cpu")
    assert not packs_rows("sdpa") and packs_rows("flash_attention_2")
    cfg = ExGRPOConfig().training(attn_implementation="dense")
    with pytest.raises(ValueError, match="attn_implementation"):
        cfg.validate()
