"""Colocated placement: after every push, the weights the sampler generates from equal the
learner's.

For two data-parallel learners (DDP) and two ZeRO-3 learners (DeepSpeed), full fine-tuning
and LoRA, with vLLM's CPU build (marked ``vllm``) and, under ZeRO-3, the HF backend: the algorithm
trains (real updates move the weights, adapters included), then each learner runs a
generation turn (the push) and, inside it, its sampler's weights are read back and
compared with the learner's own, gathered from its ZeRO-3 partitions and, for LoRA, merged
by the formula ``W + (alpha / r) B A`` from the adapter tensors (not by the product's merge
code). With the HF backend and DDP the sampler generates from the learner's model object
itself (checked as the same object); under ZeRO-3 from a plain copy refilled each turn.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

RANK, ALPHA = 4, 8.0


def _by_value():
    """The helpers below run on remote learners, where this test module is not importable."""
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


_by_value()


def _learners_weights(learner):
    """The learner's plain weights (float32): gathered, and merged by the formula with LoRA."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rllib_exgrpo.rllib.colocation import gathered

    model = learner.module[DEFAULT_MODULE_ID].unwrapped().model
    with gathered(list(model.parameters())):
        state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    out = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if key.endswith(".base_layer.weight"):
            owner = key[: -len(".base_layer.weight")]
            a, b = state[f"{owner}.lora_A.default.weight"], state[f"{owner}.lora_B.default.weight"]
            value = value + (ALPHA / RANK) * (b @ a)
        out[key.replace(".base_layer.", ".")] = value
    return out


def _engine_state(worker):
    """A vLLM worker's model weights (runs in the worker: in process here)."""
    return {k: v.detach().float().cpu().clone() for k, v in worker.model_runner.model.state_dict().items()}


def _as_engine_names(plain):
    """The plain weights under vLLM's fused names (q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""
    out = dict(plain)
    for key in list(plain):
        for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            if f".{parts[0]}." in key:
                names = [key.replace(f".{parts[0]}.", f".{p}.") for p in parts]
                if all(n in plain for n in names):
                    out[key.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat([plain[n] for n in names])
    return out


#: A fixed token sequence whose log-probs the engine and the learner's weights are compared on.
IDS = list(range(3, 67))


def _engine_prompt_logprobs(llm):
    """The engine's log-prob of each token of :data:`IDS` after the ones before it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=IDS)], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return np.asarray([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], IDS[1:])], np.float64)


def _plain_logprobs(config, weights):
    """The same log-probs from a plain HF model holding ``weights`` (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0, :-1].double()
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(IDS[1:])[:, None])[:, 0]
    return logp.numpy()


def _sync_and_compare(learner):
    """One generation turn (the push) and, inside it, the sampler's weights against the
    learner's. Returns ``(largest weight difference, names compared, largest log-prob
    difference (vLLM), the engine's log-probs (vLLM), the learner's weights' sum)``."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    sampler = learner.colocated_sampler()
    want = _learners_weights(learner)
    total = float(sum(v.sum() for v in want.values()))
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    logp_gap, engine_logp = 0.0, None
    with sampler.turn():
        if sampler.uses_engine:
            got = sampler.backend.llm.collective_rpc(_engine_state)[0]
            # vLLM's CPU build keeps its linear layers in its own packed layout (their state
            # tensors are empty): those are compared through the model's output instead.
            engine_logp = _engine_prompt_logprobs(sampler.backend.llm)
            logp_gap = float(np.abs(engine_logp - _plain_logprobs(module.model.config, want)).max())
            want = _as_engine_names(want)
        elif sampler.runner.module is module:  # HF without partitions: the learner's own model
            return 0.0, -1, 0.0, None, total
        else:
            got = {k: v.detach().float() for k, v in sampler.runner.module.model.state_dict().items()}
    common = [k for k in got if k in want and got[k].numel() > 0]
    # vLLM pads the vocabulary rows of its embedding and output head: the real rows compared.
    worst = max(float((got[k][: want[k].shape[0]] - want[k]).abs().max()) for k in common)
    return worst, len(common), logp_gap, engine_logp, total


def _config(model, backend: str, learner_backend: str, lora: bool):
    training = dict(
        model_name_or_path=model,
        questions_per_step=4,
        group_size=4,
        max_prompt_tokens=128,
        max_response_tokens=8,
        minibatch_size=8,
        loss_agg_mode="token-mean",
        delayed_start_solve_rate=0.0,
        colocate=True,
        lr=1e-2,
        generation_backend=backend,
        learner_backend=learner_backend,
        scoring_on="learners",
    )
    if learner_backend == "deepspeed":
        training["deepspeed_zero_stage"] = 3
    if lora:
        training.update(lora_rank=RANK, lora_alpha=ALPHA)
    if backend == "vllm":
        from rllib_exgrpo.cli.rehearsal import VLLM_CPU_KWARGS

        training.update(behaviour_logprobs="engine", generation_batch_size=16, vllm_kwargs=dict(VLLM_CPU_KWARGS))
    return (
        ExGRPOConfig()
        .environment(env_config={"dataset": "arithmetic"})
        .training(**training)
        .env_runners(num_env_runners=0)
        .learners(num_learners=2, num_cpus_per_learner=0.5)
    )


def _check(cfg):
    algo = cfg.build_algo()
    try:
        sums, engine_logps = [], []
        for _ in range(2):
            algo.train()  # a sampling turn and a real update
            results = [r.get() for r in algo.learner_group.foreach_learner(_sync_and_compare)]
            assert len(results) == 2
            for worst, compared, logp_gap, _, _ in results:
                assert compared != 0
                assert worst <= 1e-6, worst
                assert logp_gap <= 2e-3, logp_gap  # vLLM's CPU kernels against torch's, float32
            assert results[0][4] == pytest.approx(results[1][4], rel=1e-6)  # the ranks hold the same weights
            sums.append(results[0][4])
            engine_logps.append(results[0][3])
        assert sums[0] != sums[1]  # the update moved the weights between the two pushes
        if engine_logps[0] is not None:  # ... and the engine's output with them: not stale
            assert float(np.abs(engine_logps[0] - engine_logps[1]).max()) > 1e-2
    finally:
        algo.stop()


CASES = [("ddp", False), ("ddp", True), ("deepspeed", False), ("deepspeed", True)]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("lora", [False, True], ids=["zero3", "zero3-lora"])
def test_hf_sampler_holds_the_learners_weights_after_every_push(quick_tiny_model, lora):
    """ZeRO-3: the HF copy refilled each turn. (With DDP learners the HF sampler is the
    learner's model object itself: tests/test_colocate.py checks it is the same object and
    scores as the learner, two DDP learners and LoRA included.)"""
    pytest.importorskip("deepspeed")
    _check(_config(quick_tiny_model, "hf", "deepspeed", lora))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("learner_backend,lora", CASES, ids=["ddp", "ddp-lora", "zero3", "zero3-lora"])
def test_vllm_engine_holds_the_learners_weights_after_every_push(quick_tiny_model, learner_backend, lora):
    pytest.importorskip("vllm", reason="vllm not installed (bash tests/run.sh vllm)")
    if learner_backend == "deepspeed":
        pytest.importorskip("deepspeed")
    _check(_config(quick_tiny_model, "vllm", learner_backend, lora))
