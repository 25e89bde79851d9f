"""Attention that matches the layout (core/attention.py).

* ``sdpa_varlen`` gives the numbers of transformers' ``sdpa`` on padded rows, on
  generation with a cache, and on packed rows (against each row alone);
* a packed pass under it builds no ``[T, T]`` tensor, while under ``sdpa`` it does (so the
  detector sees one where there is one);
* the learner packs only under a variable-length kernel and otherwise falls back to padded
  passes, saying so once;
* under a mask ``sdpa_varlen`` calls SDPA with as many key/value heads as query heads and no
  ``enable_gqa`` (a call CUDA's memory-efficient kernel takes, not only the math kernel), with
  the old call's results;
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
    config = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=200,
        tie_word_embeddings=True,
    )
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
    torch.testing.assert_close(model(input_ids=ids, position_ids=pos, cu_seq_lens_q=bounds).logits, alone, atol=1e-5, rtol=1e-5)


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
        mask[r, prompt + completion - (r % 4) :] = 0  # right-padded completions
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
        cfg = ExGRPOConfig().training(
            model_name_or_path=quick_tiny_model,
            max_prompt_tokens=16,
            max_response_tokens=8,
            learner_micro_batch_tokens=24,
            attn_implementation=kernel,
        )
        vocab = len(load_tokenizer(quick_tiny_model))
        mask = torch.ones(4, 24, dtype=torch.long)
        mask[:, :3] = 0
        batch = {
            DEFAULT_MODULE_ID: {
                C.INPUT_IDS: torch.randint(1, vocab, (4, 24)) * mask,
                C.ATTENTION_MASK: mask,
                C.RESPONSE_MASK: mask[:, 16:].float(),
            }
        }
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


# ------------------------------------------------------------------ masked calls reach a fused kernel


def _old_masked_call(query, key, value, mask):
    """What sdpa_varlen called under a mask before: grouped-query heads with a mask, which on
    CUDA only SDPA's math kernel takes (flash refuses masks, memory-efficient GQA)."""
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=query.shape[1] != key.shape[1])


class _Module:
    training = False


def _qkv(rows=3, heads=6, kv_heads=2, q_len=24, kv_len=24, dim=8, dtype=torch.float32):
    torch.manual_seed(1)
    make = lambda h, n: torch.randn(rows, h, n, dim, dtype=dtype, requires_grad=True)  # noqa: E731
    return make(heads, q_len), make(kv_heads, kv_len), make(kv_heads, kv_len)


def _padding(rows, kv_len):
    mask = torch.ones(rows, kv_len, dtype=torch.long)
    mask[0, :5] = 0  # left-padded prompt
    mask[1, -4:] = 0  # right-padded completion
    return mask


@pytest.mark.parametrize("q_len,kv_len", [(24, 24), (1, 24)], ids=["padded-pass", "decode-step"])
def test_masked_call_matches_the_query_heads_without_gqa_and_the_old_results(monkeypatch, q_len, kv_len):
    """Under a mask sdpa_varlen calls SDPA with as many key/value heads as query heads and no
    ``enable_gqa`` (a padded pass: k and v repeated; a decoding step: the query's heads
    folded onto their key/value head), and gives the old call's outputs and gradients."""
    from rllib_exgrpo.core.attention import _padding_mask_4d, sdpa_varlen_forward

    query, key, value = _qkv(q_len=q_len, kv_len=kv_len)
    mask2d = _padding(3, kv_len)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append(
            (tuple(q.shape), tuple(k.shape), tuple(v.shape), kwargs.get("attn_mask") is not None, bool(kwargs.get("enable_gqa", False)))
        )
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    out, _ = sdpa_varlen_forward(_Module(), query, key, value, mask2d)
    monkeypatch.undo()
    assert len(calls) == 1
    q_shape, k_shape, v_shape, masked, gqa = calls[0]
    assert masked and not gqa, calls
    assert q_shape[1] == k_shape[1] == v_shape[1], calls
    ref = _old_masked_call(query, key, value, _padding_mask_4d(mask2d, q_len)).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), (query, key, value))
    ref_grads = torch.autograd.grad((ref * torch.linspace(-1, 1, ref.numel()).view_as(ref)).sum(), (query, key, value))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


def test_a_model_s_masked_calls_under_sdpa_varlen_have_no_gqa(monkeypatch):
    """Every masked SDPA call of a padded forward and of cached generation (GQA model: 4 query
    heads, 2 key/value heads) has matched heads and no enable_gqa; unmasked ones may keep GQA."""
    model = _model(SDPA_VARLEN)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        if kwargs.get("attn_mask") is not None:
            calls.append((q.shape[1], k.shape[1], v.shape[1], bool(kwargs.get("enable_gqa", False))))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    mask = _padding(3, 12)
    ids = torch.randint(1, 200, (3, 12)) * mask
    model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
    left = torch.ones_like(mask)
    left[0, :4] = 0
    model.generate(input_ids=ids, attention_mask=left, max_new_tokens=3, do_sample=False)
    assert len(calls) >= 2 * 2, calls  # both layers, the pass and the generation steps
    assert all(hq == hk == hv and not gqa for hq, hk, hv, gqa in calls), calls


def test_masked_calls_run_on_a_fused_kernel_without_the_math_fallback():
    """With SDPA's math kernel switched off the masked calls still run: on a CUDA device under
    the memory-efficient kernel alone (what a padded pass gets there), on this CPU build under
    its fused flash kernel. The CPU build has no memory-efficient kernel: asking for it alone
    is refused whatever the call, so that part is checked only where torch has the kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rllib_exgrpo.core.attention import _padding_mask_4d, masked_sdpa

    for q_len in (24, 1):
        query, key, value = _qkv(q_len=q_len)
        mask = _padding_mask_4d(_padding(3, 24), q_len)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            fused = masked_sdpa(query, key, value, mask)
        torch.testing.assert_close(fused, _old_masked_call(query, key, value, mask), atol=1e-6, rtol=1e-5)
    if torch.cuda.is_available():
        query, key, value = (t.detach().cuda().bfloat16().requires_grad_() for t in _qkv(q_len=64, kv_len=64))
        mask = _padding_mask_4d(_padding(3, 64).cuda(), 64)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            masked_sdpa(query, key, value, mask).sum().backward()
        return
    query, key, value = _qkv()
    mask = _padding_mask_4d(_padding(3, 24), 24)
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            masked_sdpa(query, key, value, mask)
    except RuntimeError as e:
        assert "No viable backend" in str(e)
        pytest.skip(
            "this torch CPU build has no memory-efficient SDPA kernel (only flash and math on CPU); "
            "the masked call's shape is checked above"
        )
