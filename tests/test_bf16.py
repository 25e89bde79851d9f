"""bf16 end to end: build, train, checkpoint and restore with ``model_dtype: bfloat16``.

The DDP learner keeps fp32 master weights and computes under bf16 autocast; the env runners
sample with a bf16 model; module state leaves a process as bf16 (never ``.numpy()`` on
bf16, never widened to fp32 for the runners) and checkpoints keep the fp32 master copy.
"""

import numpy as np
import pytest
import torch

from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
from rllib_exgrpo.rllib.module import shippable

pytestmark = pytest.mark.usefixtures("ray_local")


def bf16_config(model, **overrides):
    training = dict(
        model_name_or_path=model,
        model_dtype="bfloat16",
        questions_per_step=4,
        group_size=4,
        max_prompt_tokens=128,
        max_response_tokens=8,
        lr=1e-3,
        minibatch_size=16,
    )
    training.update(overrides)
    return (
        # The env as every YAML file names it: a class path string.
        ExGRPOConfig()
        .environment("rllib_exgrpo.envs.reasoning_env:ReasoningEnv", env_config={"dataset": "arithmetic"})
        .training(**training)
    )


def _learner_module(algo):
    return algo.learner_group._learner.module["default_policy"].unwrapped()


def test_shippable_keeps_bf16_and_numpy_elsewhere():
    t = torch.randn(3, 4)
    assert isinstance(shippable(t), np.ndarray) and shippable(t).dtype == np.float32
    b = shippable(t, torch.bfloat16)
    assert torch.is_tensor(b) and b.dtype == torch.bfloat16 and torch.equal(b, t.to(torch.bfloat16))
    assert torch.is_tensor(shippable(t.to(torch.bfloat16)))
    # A snapshot, not a view: the live tensor moves on, the shipped state does not.
    shipped, shipped_bf16, live_bf16 = shippable(t), shippable(t, torch.bfloat16), t.to(torch.bfloat16)
    kept = shippable(live_bf16)
    t.add_(1.0)
    live_bf16.add_(1.0)
    assert not np.array_equal(shipped, t.numpy()) and not torch.equal(kept, live_bf16)
    assert torch.equal(shipped_bf16, (t - 1.0).to(torch.bfloat16))


def test_bf16_builds_trains_checkpoints_and_restores(quick_tiny_model, tmp_path):
    algo = bf16_config(quick_tiny_model).build_algo()
    try:
        module = _learner_module(algo)
        # Learner: fp32 master weights, bf16 compute.
        assert next(module.model.parameters()).dtype == torch.float32
        assert module.compute_dtype == torch.bfloat16
        runner = algo.env_runner_group.local_env_runner
        runner._ensure_module()
        assert next(runner.module.model.parameters()).dtype == torch.bfloat16
        # What the runners get is bf16 (2 bytes a parameter), equal to the master cast down.
        synced = algo.learner_group.get_state(components="learner/rl_module", inference_only=True)
        synced = synced["learner"]["rl_module"]["default_policy"]
        assert all(torch.is_tensor(v) and v.dtype == torch.bfloat16 for v in synced.values())

        before = {k: v.detach().clone() for k, v in module.model.named_parameters()}
        result = algo.train()
        assert np.isfinite(result["learners"]["default_policy"]["total_loss"])
        after = dict(module.model.named_parameters())
        changed = sum(int((after[k] != before[k]).sum()) for k in before)
        assert changed > 0
        # The runner samples with the learner's new weights, in bf16.
        for name, p in runner.module.model.named_parameters():
            assert torch.equal(p, after[name].detach().to(torch.bfloat16)), name
        # Optimiser state in fp32, next to the master copy.
        optim = algo.learner_group._learner.get_optimizer()
        moments = [s["exp_avg"] for s in optim.state.values()]
        assert moments and all(m.dtype == torch.float32 for m in moments)

        path = algo.save(str(tmp_path / "ckpt")).checkpoint.path
        weights = {k: v.detach().clone() for k, v in module.model.named_parameters()}
        algo.train()  # move on, then restore into the same algorithm
        algo.restore(path)
        for k, v in _learner_module(algo).model.named_parameters():
            assert v.dtype == torch.float32 and torch.equal(v, weights[k]), k
    finally:
        algo.stop()

    # A fresh process-level restore of the whole algorithm, env given as a string.
    from ray.rllib.algorithms.algorithm import Algorithm

    restored = Algorithm.from_checkpoint(path)
    try:
        for k, v in _learner_module(restored).model.named_parameters():
            assert torch.equal(v, weights[k]), k
        assert np.isfinite(restored.train()["learners"]["default_policy"]["total_loss"])
    finally:
        restored.stop()


def test_master_weights_keep_updates_that_bf16_would_round_away(quick_tiny_model):
    """An lr-1e-6 AdamW step: the fp32 master copy moves; a bf16 weight mostly would not."""
    algo = bf16_config(quick_tiny_model, lr=1e-6, experience_replay=False).build_algo()
    try:
        module = _learner_module(algo)
        before = {k: v.detach().clone() for k, v in module.model.named_parameters()}
        algo.train()
        moved = total = rounded_away = 0
        for k, p in module.model.named_parameters():
            delta = p.detach() != before[k]
            moved += int(delta.sum())
            total += p.numel()
            # The same step applied to bf16 weights: how much of it survives rounding.
            as_bf16 = before[k].to(torch.bfloat16)
            rounded_away += int((delta & (p.detach().to(torch.bfloat16) == as_bf16)).sum())
        assert moved > 0.5 * total
        assert rounded_away > 0.5 * moved
    finally:
        algo.stop()


def test_float16_with_the_ddp_learner_is_one_clear_error():
    cfg = ExGRPOConfig().training(model_dtype="float16")
    with pytest.raises(ValueError, match="learner_backend.*model_dtype: bfloat16"):
        cfg.validate()
