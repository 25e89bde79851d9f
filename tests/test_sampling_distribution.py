"""Every backend samples exactly the distribution its behaviour log-probs describe.

The learner's importance ratio divides by the recorded log-probs of ``softmax(logits / T)``;
if generation adds a top-k, a repetition penalty or any other processor, the completions
come from another distribution and the ratio is wrong from the first token. transformers
fills every field of a generation config left unset from the model's own
``generation_config`` and then from its global defaults (``top_k=50``). These tests give a
model a generation config full of such settings and check the processed scores
``generate`` sampled from against the raw logits.
"""

import pytest
import torch

from rllib_exgrpo.generation.base import SamplingParams
from rllib_exgrpo.generation.hf import HFGenerationBackend


@pytest.fixture(scope="module")
def model_with_hostile_generation_config():
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    model.generation_config = GenerationConfig(
        top_k=3,
        top_p=0.5,
        min_p=0.2,
        repetition_penalty=3.0,
        no_repeat_ngram_size=1,
        suppress_tokens=[5, 6],
        temperature=0.3,
        do_sample=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    return model


def _scores_and_logits(out):
    scores = torch.stack(out.scores, 1)  # [N, steps, V]: what generate sampled from
    logits = torch.stack(out.logits, 1)  # [N, steps, V]: the raw model logits
    return scores, logits


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0)])
def test_hf_backend_samples_softmax_of_logits_over_temperature(model_with_hostile_generation_config, temperature, top_p):
    model = model_with_hostile_generation_config
    backend = HFGenerationBackend(model, pad_token_id=0)
    params = SamplingParams(max_new_tokens=6, temperature=temperature, top_p=top_p, stop_token_ids=(2,))
    ids = torch.tensor([[7, 8, 9, 10]] * 4)
    out = backend.generate_raw(ids, torch.ones_like(ids), params, output_scores=True, output_logits=True, return_dict_in_generate=True)
    scores, logits = _scores_and_logits(out)
    torch.testing.assert_close(scores, logits / temperature)
    # the model's own config is back in place afterwards
    assert model.generation_config.top_k == 3


def test_the_leak_is_real_without_the_backend(model_with_hostile_generation_config):
    """Control: plain ``generate(temperature=...)`` picks up the model's top-k & co."""
    model = model_with_hostile_generation_config
    ids = torch.tensor([[7, 8, 9, 10]] * 4)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        max_new_tokens=6,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    scores, logits = _scores_and_logits(out)
    assert torch.isinf(scores).any()  # top-k / min-p / suppressed tokens masked out
    assert not torch.allclose(torch.nan_to_num(scores, neginf=0.0), logits)


def test_hf_backend_greedy_is_argmax_of_raw_logits(model_with_hostile_generation_config):
    model = model_with_hostile_generation_config
    backend = HFGenerationBackend(model, pad_token_id=0)
    params = SamplingParams(max_new_tokens=5, temperature=0.0, top_p=1.0, stop_token_ids=(2,))
    ids = torch.tensor([[7, 8, 9, 10]])
    out = backend.generate_raw(ids, torch.ones_like(ids), params, output_scores=True, output_logits=True, return_dict_in_generate=True)
    scores, logits = _scores_and_logits(out)
    torch.testing.assert_close(scores, logits)  # no repetition penalty / suppression
    generated = out.sequences[0, ids.shape[1] :]
    assert generated.tolist() == logits[0].argmax(-1)[: len(generated)].tolist()


def test_logprobs_from_generation_equal_the_scoring_pass(model_with_hostile_generation_config):
    """behaviour_logprobs="engine" on the HF backend: the sampled tokens' log-probs read off
    generate's raw logits are the learner's log_softmax(logits / T), within KV-cache
    round-off, so the scoring forward pass can be skipped."""
    import numpy as np

    model = model_with_hostile_generation_config
    recompute = HFGenerationBackend(model, pad_token_id=0)
    engine = HFGenerationBackend(model, pad_token_id=0, logprobs_from_generation=True)
    prompts = [[7, 8, 9, 10], [11, 12], [13, 14, 15]]
    for temperature in (1.0, 0.7):
        params = SamplingParams(max_new_tokens=8, temperature=temperature, top_p=1.0, stop_token_ids=(2,))
        torch.manual_seed(1)
        groups = engine.generate(prompts, [3, 2, 4], params)
        flat = [(prompts[i], c) for i, g in enumerate(groups) for c in g]
        scored, _ = recompute.score([p for p, _ in flat], [c.token_ids for _, c in flat], temperature=temperature, with_entropy=False)
        for (_, c), ref in zip(flat, scored):
            assert c.logp.shape == c.token_ids.shape
            np.testing.assert_allclose(c.logp, ref, atol=1e-5, rtol=0)


def _pruned(model, rows, params):
    from rllib_exgrpo.core.tokens import left_pad
    from rllib_exgrpo.generation.hf import pruned_decode

    ids, mask = left_pad(rows, 0)
    return pruned_decode(model, ids, mask, params, pad_token_id=0)


def test_pruned_decode_greedy_equals_generate(model_with_hostile_generation_config):
    import numpy as np

    model = model_with_hostile_generation_config
    rows = [[7, 8, 9, 10], [11, 12], [13, 14, 15], [3]]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(2, 17))
    tokens, logps, reasons = _pruned(model, rows, params)
    backend = HFGenerationBackend(model, pad_token_id=0, decoder="generate")
    ref = backend.generate(rows, [1] * len(rows), params)
    for t, lp, reason, (c,) in zip(tokens, logps, reasons, ref):
        assert t.tolist() == c.token_ids.tolist() and reason == c.finish_reason
        np.testing.assert_allclose(lp, c.logp, atol=1e-5, rtol=0)  # T = 1 when greedy


def test_pruned_decode_samples_softmax_over_temperature(model_with_hostile_generation_config):
    """First-token frequencies of 6000 samples against softmax(logits / T)."""
    model = model_with_hostile_generation_config
    prompt = [7, 8, 9, 10]
    T = 2.0  # a flat distribution: many tokens with visible mass
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1] / T, -1)
    torch.manual_seed(0)
    tokens, _, _ = _pruned(model, [prompt] * 6000, SamplingParams(max_new_tokens=1, temperature=T))
    freq = torch.bincount(torch.tensor([int(t[0]) for t in tokens]), minlength=probs.numel()).float() / 6000
    assert float((freq - probs).abs().max()) < 0.02  # the model's top-k=3 etc. never apply
    assert int((freq > 0).sum()) > 10


def test_pruned_decode_logprobs_equal_the_scoring_pass_and_top_p_keeps_the_nucleus(model_with_hostile_generation_config):
    import numpy as np

    model = model_with_hostile_generation_config
    rows = [[7, 8, 9, 10], [11, 12], [13, 14, 15]] * 3
    scorer = HFGenerationBackend(model, pad_token_id=0)
    torch.manual_seed(2)
    tokens, logps, reasons = _pruned(model, rows, SamplingParams(max_new_tokens=8, temperature=0.8, stop_token_ids=(2,)))
    ref, _ = scorer.score(rows, tokens, temperature=0.8, with_entropy=False)
    for t, lp, r, reason in zip(tokens, logps, ref, reasons):
        np.testing.assert_allclose(lp, r, atol=1e-5, rtol=0)
        assert reason == ("stop" if t[-1] == 2 else "length") and (reason == "stop" or len(t) == 8)
    # a vanishing nucleus keeps only the most likely token: sampling becomes greedy
    greedy, _, _ = _pruned(model, rows, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(2,)))
    tiny_p, _, _ = _pruned(model, rows, SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1e-6, stop_token_ids=(2,)))
    assert [t.tolist() for t in tiny_p] == [t.tolist() for t in greedy]


def test_score_sorts_rows_by_length_and_returns_them_in_the_order_given(model_with_hostile_generation_config):
    """Chunks of similar lengths (less padding), results in the caller's order: the same
    values as scoring each row alone."""
    model = model_with_hostile_generation_config
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (3, 7, 2, 5, 4)]
    completions = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (9, 1, 4, 12, 2)]
    chunked = HFGenerationBackend(model, pad_token_id=0, batch_size=2)
    logps, ents = chunked.score(prompts, completions, temperature=0.8)
    alone = HFGenerationBackend(model, pad_token_id=0, batch_size=1)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        [lp], [en] = alone.score([p], [c], temperature=0.8)
        assert len(logps[i]) == len(c)
        assert torch.allclose(torch.as_tensor(logps[i]), torch.as_tensor(lp), atol=1e-5)
        assert torch.allclose(torch.as_tensor(ents[i]), torch.as_tensor(en), atol=1e-5)
