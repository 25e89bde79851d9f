"""Colocated placement: after every push, the weights the sampler generates from equal the
learner's.

For two data-parallel learners (DDP) and two ZeRO-3 learners (DeepSpeed), full fine-tuning
and LoRA, with the HF backend and with vLLM's CPU build (marked ``vllm``): the algorithm
trains (real updates move the weights, adapters included), then each learner runs a
generation turn (the push) and, inside it, its sampler's weights are read back and
compared with the learner's own, gathered from its ZeRO-3 partitions and, for LoRA, merged
by the formula ``W + (alpha / r) B A`` from the adapter tensors (not by the product's merge
code). With the HF backend and DDP the sampler generates from the learner's model object
itself (checked as the same object); under ZeRO-3 from a plain copy refilled each turn.
"""
from __future__ import annotations

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


def _sync_and_compare(learner):
    """One generation turn (the push) and, inside it, the sampler's weights against the
    learner's. Returns ``(largest difference, names compared, the learner's weights' sum)``."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    sampler = learner.colocated_sampler()
    want = _learners_weights(learner)
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    with sampler.turn():
        if sampler.uses_engine:
            got = sampler.backend.llm.collective_rpc(_engine_state)[0]
            want = _as_engine_names(want)
        elif sampler.runner.module is module:  # HF without partitions: the learner's own model
            return 0.0, -1, float(sum(v.sum() for v in want.values()))
        else:
            got = {k: v.detach().float() for k, v in sampler.runner.module.model.state_dict().items()}
    common = [k for k in got if k in want]
    # vLLM pads the vocabulary rows of its embedding and output head: the real rows compared.
    worst = max(float((got[k][: want[k].shape[0]] - want[k]).abs().max()) for k in common)
    return worst, len(common), float(sum(v.sum() for v in want.values()))


def _config(model, backend: str, learner_backend: str, lora: bool):
    training = dict(
        model_name_or_path=model, questions_per_step=4, group_size=4, max_prompt_tokens=128, max_response_tokens=8,
        minibatch_size=8, loss_agg_mode="token-mean", delayed_start_solve_rate=0.0, colocate=True, lr=1e-2,
        generation_backend=backend, learner_backend=learner_backend, scoring_on="learners",
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
        sums = []
        for _ in range(2):
            algo.train()  # a sampling turn and a real update
            results = [r.get() for r in algo.learner_group.foreach_learner(_sync_and_compare)]
            assert len(results) == 2
            for worst, compared, _ in results:
                assert compared != 0
                assert worst <= 1e-6, worst
            assert results[0][2] == pytest.approx(results[1][2], rel=1e-6)  # the ranks hold the same weights
            sums.append(results[0][2])
        assert sums[0] != sums[1]  # the update moved the weights between the two pushes
    finally:
        algo.stop()


CASES = [("ddp", False), ("ddp", True), ("deepspeed", False), ("deepspeed", True)]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("learner_backend,lora", CASES, ids=["ddp", "ddp-lora", "zero3", "zero3-lora"])
def test_hf_sampler_holds_the_learners_weights_after_every_push(quick_tiny_model, learner_backend, lora):
    if learner_backend == "deepspeed":
        pytest.importorskip("deepspeed")
    _check(_config(quick_tiny_model, "hf", learner_backend, lora))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("learner_backend,lora", CASES, ids=["ddp", "ddp-lora", "zero3", "zero3-lora"])
def test_vllm_engine_holds_the_learners_weights_after_every_push(quick_tiny_model, learner_backend, lora):
    pytest.importorskip("vllm", reason="vllm not installed (bash tests/run.sh vllm)")
    if learner_backend == "deepspeed":
        pytest.importorskip("deepspeed")
    _check(_config(quick_tiny_model, "vllm", learner_backend, lora))
