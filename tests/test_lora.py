"""LoRA learners (``lora_rank > 0``, ``models/lora.py``) on the quick tiny model.

* the fields and their checks; full fine-tuning's module config is unchanged;
* only the adapters require grad and are in the optimiser; an update moves the adapters
  and leaves every base weight as it was;
* the KL reference is the base model (adapters disabled), no second copy;
* what the env runners get (``get_state(inference_only=True)``) is the merged model under
  the plain names, and computing it leaves the base weights untouched;
* end to end (slow): after a training iteration and the collective sync, a remote HF env
  runner's log-probs changed and equal the learner's merged model's (one local learner, and
  two DDP learners); a checkpoint restores adapters and optimiser state exactly into a fresh
  algorithm; ``rllib export`` writes the merged model under plain names.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray.rllib.core import DEFAULT_MODULE_ID

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.groups import Trajectory, learner_batch, to_multi_agent_batch
from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

LORA = dict(lora_rank=4, lora_alpha=8.0)


# --- config ------------------------------------------------------------------------------------
def test_fields_default_off_and_are_checked():
    cfg = ExGRPOConfig()
    assert cfg.lora_rank == 0 and cfg.lora_target_modules == "all-linear"
    assert "lora" not in cfg.llm_model_config  # full fine-tuning: the module config as before
    on = ExGRPOConfig().training(lora_rank=8, lora_target_modules=["q_proj", "v_proj"])
    assert on.llm_model_config["lora"] == {"rank": 8, "alpha": 32.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    for bad, message in [
        ({"lora_rank": -1}, "lora_rank must be an integer >= 0"),
        ({"lora_alpha": 0}, "lora_alpha must be > 0"),
        ({"lora_dropout": 1.0}, "lora_dropout must be in [0, 1)"),
        ({"lora_target_modules": []}, "lora_target_modules must be 'all-linear' or a non-empty"),
        ({"lora_rank": 4, "learner_backend": "deepspeed"}, "lora_rank > 0 with learner_backend: deepspeed needs colocate: true"),
    ]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
            ExGRPOConfig().training(**bad).validate()


# --- one learner in this process -----------------------------------------------------------------
def _learner(model, **training):
    from rllib_exgrpo.models.loading import load_tokenizer
    from rllib_exgrpo.rllib.env_runner import token_spaces

    training = {"loss_agg_mode": "token-mean", "entropy_coeff": 0.0, "grad_clip": None, **LORA, **training}
    cfg = ExGRPOConfig().training(model_name_or_path=model, max_prompt_tokens=16, max_response_tokens=8, lr=1e-2, **training)
    group = cfg.build_learner_group(spaces={DEFAULT_MODULE_ID: token_spaces(len(load_tokenizer(model)), 16, 8)})
    return group, group._learner


def _batch() -> dict:
    trajs = [
        Trajectory("q", np.array([5, 6, 7]), np.array([8, 9, 10]), np.zeros(3, np.float32), 1.0),
        Trajectory("q", np.array([5, 6, 7]), np.array([11, 12, 13]), np.zeros(3, np.float32), 0.0),
    ]
    return learner_batch(trajs, np.asarray([1.0, -1.0], np.float32), pad_id=0)


def _logp(module, batch) -> np.ndarray:
    tensors = {k: torch.as_tensor(batch[k]) for k in (C.INPUT_IDS, C.ATTENTION_MASK, C.RESPONSE_MASK)}
    with torch.no_grad():
        return module._forward_train(tensors)[C.LOGP].numpy() * batch[C.RESPONSE_MASK]


def _plain_module(model, state=None):
    """The env runners' module (inference-only, no adapters), with ``state`` loaded."""
    import gymnasium as gym

    from rllib_exgrpo.rllib.module import LLMTorchRLModule

    module = LLMTorchRLModule(
        observation_space=gym.spaces.Discrete(2),
        action_space=gym.spaces.Discrete(2),
        inference_only=True,
        model_config={"model": model, "dtype": "float32"},
    )
    if state is not None:
        module.set_state(state)
    return module


def _update(group, learner) -> dict:
    batch = _batch()
    batch[C.OLD_LOGP] = _logp(learner.module[DEFAULT_MODULE_ID], batch)
    return group.update(batch=to_multi_agent_batch(batch))[0]


def _named(module) -> dict:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_only_adapters_train_and_the_base_weights_stay(quick_tiny_model):
    group, learner = _learner(quick_tiny_model)
    module = learner.module[DEFAULT_MODULE_ID]
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # every linear layer but the head ("all-linear"): attention and MLP
    assert any("mlp.down_proj.lora_A" in n for n in trainable) and any("self_attn.q_proj.lora_B" in n for n in trainable)
    optimised = {id(p) for g in learner.get_optimizer().param_groups for p in g["params"]}
    assert optimised == {id(p) for p in module.parameters() if p.requires_grad}
    before = _named(module)
    result = _update(group, learner)
    assert result[DEFAULT_MODULE_ID]["update_skipped"] == 0
    after = _named(module)
    base = [n for n in before if n not in trainable]
    assert base and all(torch.equal(before[n], after[n]) for n in base)
    assert any(not torch.equal(before[n], after[n]) for n in trainable if ".lora_B." in n)


def test_bf16_lora_learner_keeps_the_frozen_base_in_bf16_and_fp32_adapters(quick_tiny_model):
    """No fp32 master copy of a frozen base (the memory plan counts 2 B per base weight);
    the adapters train in fp32 under autocast, and what runners get is in bf16."""
    group, learner = _learner(quick_tiny_model, model_dtype="bfloat16")
    module = learner.module[DEFAULT_MODULE_ID]
    dtypes = {(".lora_" in n, p.dtype) for n, p in module.named_parameters() if p.is_floating_point()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    before = _named(module)
    assert _update(group, learner)[DEFAULT_MODULE_ID]["update_skipped"] == 0
    after = _named(module)
    assert any(not torch.equal(before[n], after[n]) for n in after if ".lora_B." in n)
    assert all(v.dtype == torch.bfloat16 for v in module.get_state(inference_only=True).values() if torch.as_tensor(v).is_floating_point())


def test_kl_reference_is_the_base_model_with_adapters_disabled(quick_tiny_model):
    group, learner = _learner(quick_tiny_model, kl_coeff=0.1)
    assert learner._reference_models == {}  # no second copy of the model
    _update(group, learner)
    batch = _batch()
    tensors = {k: torch.as_tensor(v) for k, v in batch.items()}
    ref = learner._reference_logp(DEFAULT_MODULE_ID, tensors, learner.config).numpy() * batch[C.RESPONSE_MASK]
    np.testing.assert_allclose(ref, _logp(_plain_module(quick_tiny_model), batch), rtol=0, atol=1e-6)
    assert not np.allclose(ref, _logp(learner.module[DEFAULT_MODULE_ID], batch), rtol=0, atol=1e-6)


def test_runners_get_the_merged_weights_under_plain_names(quick_tiny_model):
    group, learner = _learner(quick_tiny_model)
    module = learner.module[DEFAULT_MODULE_ID]
    _update(group, learner)
    before = _named(module)
    state = module.get_state(inference_only=True)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())  # nothing merged in place
    plain = _plain_module(quick_tiny_model)
    assert set(state) == set(plain.state_dict())
    plain.set_state(state)
    batch = _batch()
    np.testing.assert_allclose(_logp(plain, batch), _logp(module, batch), rtol=0, atol=1e-5)
    assert not np.allclose(_logp(plain, batch), _logp(_plain_module(quick_tiny_model), batch), rtol=0, atol=1e-6)


# --- end to end ---------------------------------------------------------------------------------
def _algo_config(model, **training):
    return (
        ExGRPOConfig()
        .environment(env_config={"dataset": "arithmetic"})
        .training(
            model_name_or_path=model,
            questions_per_step=4,
            group_size=2,
            max_prompt_tokens=128,
            max_response_tokens=8,
            lr=1e-2,
            minibatch_size=8,
            loss_agg_mode="token-mean",
            delayed_start_solve_rate=0.0,
            **LORA,
            **training,
        )
        .env_runners(num_env_runners=1, num_cpus_per_env_runner=0.5)
    )


def _runner_logp(algo, batch) -> np.ndarray:
    columns = {k: batch[k] for k in (C.INPUT_IDS, C.ATTENTION_MASK, C.RESPONSE_MASK)}

    def score(runner):  # self-contained: it runs in the runner's process
        tensors = {k: torch.as_tensor(v) for k, v in columns.items()}
        with torch.no_grad():
            return runner.module._forward_train(tensors)[C.LOGP].numpy() * columns[C.RESPONSE_MASK]

    (out,) = algo.env_runner_group.foreach_env_runner(score, local_env_runner=False)
    return out


def _learner_merged_logp(algo, model, batch) -> np.ndarray:
    """The log-probs of the first learner's merged model, in a plain module here."""
    state = algo.learner_group.get_state(components="learner/rl_module", inference_only=True)
    return _logp(_plain_module(model, state["learner"]["rl_module"][DEFAULT_MODULE_ID]), batch)


def _train_and_check_the_runner(algo, model) -> None:
    assert algo.config.weight_sync == "collective"
    batch = _batch()
    before = _runner_logp(algo, batch)
    result = algo.train()
    assert result["weight_sync"]["bytes_per_runner"] > 0  # the collective broadcast ran
    after = _runner_logp(algo, batch)
    assert not np.allclose(after, before, rtol=0, atol=1e-6), "the runner still samples the base model"
    np.testing.assert_allclose(after, _learner_merged_logp(algo, model, batch), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def lora_algo(ray_local, quick_tiny_model):
    algo = _algo_config(quick_tiny_model).build_algo()
    yield algo
    if not getattr(algo, "stopped_by_a_test", False):
        algo.stop()


def _adapter_and_optimizer(algo) -> tuple:
    state = algo.learner_group.get_state(components="learner")["learner"]
    adapters = {k: np.asarray(v) for k, v in state["rl_module"][DEFAULT_MODULE_ID].items() if ".lora_" in k}
    return adapters, state["optimizer"]


def _assert_same_tree(a, b, where="") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _assert_same_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{where}/{i}")
    elif isinstance(a, (np.ndarray, torch.Tensor)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), where
    else:
        assert a == b, where


@pytest.mark.slow
def test_runner_samples_the_merged_model_after_a_sync(lora_algo, quick_tiny_model):
    _train_and_check_the_runner(lora_algo, quick_tiny_model)


@pytest.mark.slow
def test_checkpoint_restores_adapters_and_optimizer_exactly_and_exports_merged(lora_algo, quick_tiny_model, tmp_path):
    from rllib_exgrpo.evaluation.export import export_checkpoint
    from rllib_exgrpo.rllib.algorithm import ExGRPO
    from test_export import assert_same_logits

    if lora_algo.iteration == 0:
        lora_algo.train()
    lora_algo.save_to_path(str(tmp_path / "ckpt"))
    adapters, optimizer = _adapter_and_optimizer(lora_algo)
    assert adapters and optimizer
    export_checkpoint(tmp_path / "ckpt", tmp_path / "exported")
    state = lora_algo.learner_group.get_state(components="learner/rl_module", inference_only=True)
    merged = _plain_module(quick_tiny_model, state["learner"]["rl_module"][DEFAULT_MODULE_ID])
    assert_same_logits(tmp_path / "exported", merged.model)
    lora_algo.stop()  # the session's 2 CPUs: one algorithm at a time
    lora_algo.stopped_by_a_test = True
    restored = ExGRPO.from_checkpoint(str(tmp_path / "ckpt"))
    try:
        got_adapters, got_optimizer = _adapter_and_optimizer(restored)
        _assert_same_tree(got_adapters, adapters)
        _assert_same_tree(got_optimizer, optimizer)
        batch = _batch()
        np.testing.assert_allclose(
            _runner_logp(restored, batch), _learner_merged_logp(restored, quick_tiny_model, batch), rtol=0, atol=1e-5
        )
    finally:
        restored.stop()


@pytest.mark.slow
def test_ddp_learners_runner_samples_the_merged_model_after_a_sync(ray_local, quick_tiny_model):
    algo = _algo_config(quick_tiny_model).learners(num_learners=2, num_cpus_per_learner=0.5).build_algo()
    try:
        _train_and_check_the_runner(algo, quick_tiny_model)
        adapters = algo.learner_group.foreach_learner(
            lambda learner: {
                n: p.detach().clone() for n, p in learner.module[DEFAULT_MODULE_ID].unwrapped().named_parameters() if p.requires_grad
            }
        )
        first, second = [r.get() if hasattr(r, "get") else r for r in adapters]
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    finally:
        algo.stop()
