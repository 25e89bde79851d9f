"""Chunked log-probs and entropy (core/chunked_logprobs.py) against the plain formulas.

Values and gradients (of the hidden states and of the LM head, tied or not) match the
whole-logits computation: float32 to 1e-5; bfloat16 within the tolerance stated in
test_bf16_tolerance. The model-level tests check the padded and packed learner passes
against ``model(...).logits`` on a small random Qwen2.
"""

from __future__ import annotations

import pytest
import torch

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.chunked_logprobs import (
    logprobs_entropy_from_hidden,
    logprobs_entropy_from_logits,
    split_causal_lm,
)
from rllib_exgrpo.core.packing import pack_rows, score_packed
from rllib_exgrpo.core.scoring import score_completions


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    z = logits.float() / temperature
    logq = torch.log_softmax(z, dim=-1)
    logp = logq.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    q = logq.exp()
    entropy = -(torch.where(q > 0, q * logq, torch.zeros_like(q))).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_reduction_matches_formula_and_gradient(temperature):
    torch.manual_seed(0)
    logits = (torch.randn(37, 101, dtype=torch.float64) * 3).requires_grad_()
    targets = torch.randint(0, 101, (37,))
    g1, g2 = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    logp, entropy = logprobs_entropy_from_logits(logits.float(), targets, temperature=temperature)
    ref_logp, ref_entropy = _reference(logits, targets, temperature)
    torch.testing.assert_close(logp.double(), ref_logp.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy.double(), atol=1e-5, rtol=1e-5)
    # Gradient of a weighted sum of both outputs, hand-written backward vs autograd.
    leaf = logits.detach().float().requires_grad_()
    lp, en = logprobs_entropy_from_logits(leaf, targets, temperature=temperature)
    (lp * g1.float() + en * g2.float()).sum().backward()
    ref_leaf = logits.detach().clone().requires_grad_()
    rl, re = _reference(ref_leaf, targets, temperature)
    (rl * g1 + re * g2).sum().backward()
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, atol=1e-5, rtol=1e-5)


def test_masked_vocabulary_gives_finite_entropy_and_gradient():
    logits = torch.randn(4, 10)
    logits[:, 5:] = float("-inf")
    leaf = logits.clone().requires_grad_()
    logp, entropy = logprobs_entropy_from_logits(leaf, torch.tensor([0, 1, 2, 3]))
    ref_logp, ref_entropy = _reference(logits, torch.tensor([0, 1, 2, 3]))
    torch.testing.assert_close(entropy, ref_entropy)
    (logp.sum() + entropy.sum()).backward()
    assert torch.isfinite(leaf.grad).all()
    assert (leaf.grad[:, 5:] == 0).all()


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_hidden_chunks_match_whole_logits(chunk):
    """Any chunk size: the same values and gradients (hidden and head weight) as one
    ``head(hidden)`` reduced whole; the head's weight is shared (tied) with an embedding."""
    torch.manual_seed(1)
    emb = torch.nn.Embedding(97, 16)
    head = torch.nn.Linear(16, 97, bias=False)
    head.weight = emb.weight  # tied, as Qwen2.5-Math-1.5B
    hidden = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 97, (50,))
    logp, entropy = logprobs_entropy_from_hidden(hidden, head, targets, temperature=0.9, chunk_tokens=chunk)
    (logp.sum() * 0.3 - entropy.sum() * 0.1).backward()
    grads = (hidden.grad.clone(), emb.weight.grad.clone())
    hidden.grad, emb.weight.grad = None, None
    ref_logp, ref_entropy = _reference(head(hidden), targets, 0.9)
    (ref_logp.sum() * 0.3 - ref_entropy.sum() * 0.1).backward()
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], emb.weight.grad, atol=1e-5, rtol=1e-5)


def test_no_grad_and_empty_inputs():
    head = torch.nn.Linear(8, 11)
    with torch.no_grad():
        logp, entropy = logprobs_entropy_from_hidden(torch.randn(5, 8), head, torch.zeros(5, dtype=torch.long))
    assert logp.shape == (5,) and entropy.shape == (5,) and not logp.requires_grad
    logp, entropy = logprobs_entropy_from_hidden(torch.randn(0, 8), head, torch.zeros(0, dtype=torch.long), with_entropy=False)
    assert logp.shape == (0,) and entropy is None
    with pytest.raises(ValueError, match="chunk_tokens"):
        logprobs_entropy_from_hidden(torch.randn(5, 8), head, torch.zeros(5, dtype=torch.long), chunk_tokens=0)


#: bfloat16 logits carry 8 bits of mantissa: a logit of magnitude ~10 is off by up to
#: ~0.03 after rounding, and so is a log-prob computed from it, whoever reduces it. The
#: chunked and the whole-logits paths round the same bf16 logits, then both reduce in
#: float32: they agree to float32 rounding (1e-5), and both stay within 0.05 (log-prob)
#: of the float32 model.
BF16_LOGP_ATOL = 0.05


def test_bf16_tolerance():
    torch.manual_seed(2)
    head = torch.nn.Linear(32, 500, bias=False)
    hidden = torch.randn(64, 32)
    targets = torch.randint(0, 500, (64,))
    ref_logp, ref_entropy = _reference(head(hidden), targets)
    head_bf16 = torch.nn.Linear(32, 500, bias=False).to(torch.bfloat16)
    head_bf16.weight.data.copy_(head.weight.data)
    h16 = hidden.to(torch.bfloat16)
    logp, entropy = logprobs_entropy_from_hidden(h16, head_bf16, targets, chunk_tokens=16)
    whole_logp, whole_entropy = _reference(head_bf16(h16), targets)
    torch.testing.assert_close(logp, whole_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, whole_entropy, atol=1e-5, rtol=1e-5)
    assert (logp - ref_logp).abs().max() < BF16_LOGP_ATOL
    assert (entropy - ref_entropy).abs().max() < BF16_LOGP_ATOL


def _small_qwen2(tied: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=300,
        tie_word_embeddings=tied,
    )
    return Qwen2ForCausalLM(config).eval()


def _rows():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 0], [0, 11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24, 25, 26, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0]])
    return ids, mask, mask[:, 4:].float()


def _reference_scores(model, ids, mask, r, temperature):
    from rllib_exgrpo.core.tokens import position_ids_from_mask

    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    return _reference(logits[:, -r - 1 : -1], ids[:, -r:], temperature)


@pytest.mark.parametrize("tied", [True, False])
def test_padded_and_packed_passes_match_full_forward(tied):
    model = _small_qwen2(tied)
    assert split_causal_lm(model) is not None
    ids, mask, resp = _rows()
    ref_logp, ref_entropy = _reference_scores(model, ids, mask, 4, 0.8)
    logp, entropy, _ = score_completions(model, ids, mask, 4, temperature=0.8, chunk_tokens=5)
    torch.testing.assert_close(logp * resp, ref_logp * resp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy * resp, ref_entropy * resp, atol=1e-5, rtol=1e-5)
    packed = {C.INPUT_IDS: ids, C.ATTENTION_MASK: mask, C.RESPONSE_MASK: resp}
    packed.update(pack_rows(packed))
    p_logp, p_entropy = score_packed(model, packed, temperature=0.8, chunk_tokens=3)
    torch.testing.assert_close(p_logp, ref_logp * resp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p_entropy, ref_entropy * resp, atol=1e-5, rtol=1e-5)


def test_padded_gradient_matches_full_forward():
    model = _small_qwen2(tied=True)
    ids, mask, resp = _rows()
    logp, entropy, _ = score_completions(model, ids, mask, 4, chunk_tokens=2)
    ((logp * resp).sum() + 0.1 * (entropy * resp).sum()).backward()
    chunked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref_logp, ref_entropy = _reference_scores(model, ids, mask, 4, 1.0)
    ((ref_logp * resp).sum() + 0.1 * (ref_entropy * resp).sum()).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(chunked[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_model_without_standard_head_uses_full_forward():
    """A model that scales its logits (a transform the chunked head does not reproduce) is
    scored through its own forward, with the same numbers."""
    model = _small_qwen2(tied=False)
    model.config.logit_scale = 1.0  # the identity: still split
    assert split_causal_lm(model) is not None
    model.config.logit_scale = 0.5
    assert split_causal_lm(model) is None
    ids, mask, resp = _rows()
    logp, entropy, _ = score_completions(model, ids, mask, 4, chunk_tokens=3)
    ref_logp, ref_entropy = _reference_scores(model, ids, mask, 4, 1.0)
    torch.testing.assert_close(logp * resp, ref_logp * resp, atol=1e-5, rtol=1e-5)


def test_min_chunks_calls_the_head_as_often_in_forward_and_backward():
    """``min_chunks``: extra head calls on no positions, in the forward and in the backward's
    recomputation alike (ZeRO-3 ranks must make the same number of head calls); the values
    and gradients are those without them."""
    torch.manual_seed(4)
    head = torch.nn.Linear(8, 13, bias=False)
    calls = []
    head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    hidden = torch.randn(10, 8, requires_grad=True)
    targets = torch.randint(0, 13, (10,))
    logp, entropy = logprobs_entropy_from_hidden(hidden, head, targets, chunk_tokens=4, min_chunks=5)
    assert calls == [4, 4, 2, 0, 0]
    (logp.sum() + entropy.sum()).backward()
    assert sorted(calls[5:]) == [0, 0, 2, 4, 4]  # each chunk recomputed once
    grad = hidden.grad.clone()
    hidden.grad = None
    ref_logp, ref_entropy = logprobs_entropy_from_hidden(hidden, head, targets, chunk_tokens=4)
    (ref_logp.sum() + ref_entropy.sum()).backward()
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(grad, hidden.grad)
