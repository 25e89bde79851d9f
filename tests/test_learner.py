"""ExGRPOTorchLearner's own logic on a real (quick) tiny model: the grad-norm skip, the clip
removal in mixed mode, the no-shaping ablation and the frozen KL reference."""
import math

import numpy as np
import pytest
import torch

from ray.rllib.core import DEFAULT_MODULE_ID

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.groups import Trajectory, learner_batch, to_multi_agent_batch
from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
from rllib_exgrpo.models.loading import load_tokenizer
from rllib_exgrpo.rllib.env_runner import token_spaces


def _learner(model, **training):
    cfg = ExGRPOConfig().training(
        model_name_or_path=model, max_prompt_tokens=16, max_response_tokens=8, lr=1e-2,
        loss_agg_mode="token-mean", entropy_coeff=0.0, grad_clip=None, **training,
    )
    vocab = len(load_tokenizer(model))
    group = cfg.build_learner_group(spaces={DEFAULT_MODULE_ID: token_spaces(vocab, 16, 8)})
    return group, group._learner, cfg


def _batch(learner, *, advantages, replayed, old_logp_shift=0.0):
    """Two rows; behaviour log-probs = current log-probs - shift (ratio e^shift)."""
    trajs = [
        Trajectory("q", np.array([5, 6, 7]), np.array([8, 9, 10]), np.zeros(3, np.float32), 1.0, off_policy=replayed[0]),
        Trajectory("q", np.array([5, 6, 7]), np.array([11, 12, 13]), np.zeros(3, np.float32), 0.0, off_policy=replayed[1]),
    ]
    batch = learner_batch(trajs, np.asarray(advantages, np.float32), pad_id=0)
    module = learner.module[DEFAULT_MODULE_ID]
    with torch.no_grad():
        logp = module._forward_train({k: torch.as_tensor(v) for k, v in batch.items()})[C.LOGP].numpy()
    batch[C.OLD_LOGP] = (logp - old_logp_shift) * batch[C.RESPONSE_MASK]
    return batch


def _loss(learner, cfg, batch):
    module = learner.module[DEFAULT_MODULE_ID]
    tensors = {k: torch.as_tensor(v) for k, v in batch.items()}
    fwd = module._forward_train(tensors)
    return learner.compute_loss_for_module(module_id=DEFAULT_MODULE_ID, config=cfg, batch=tensors, fwd_out=fwd).item()


def _params(learner):
    return [p.detach().clone() for p in learner.module[DEFAULT_MODULE_ID].parameters()]


def test_update_skipped_when_the_grad_norm_exceeds_the_threshold(quick_tiny_model):
    group, learner, _ = _learner(quick_tiny_model, skip_update_grad_norm=1e-9)
    batch = _batch(learner, advantages=[1.0, -1.0], replayed=[False, False])
    before = _params(learner)
    result = group.update(batch=to_multi_agent_batch(batch))[0]
    assert result[DEFAULT_MODULE_ID]["update_skipped"] == 1
    assert result[DEFAULT_MODULE_ID]["grad_norm_preclip"] > 1e-9
    assert all(torch.equal(a, b) for a, b in zip(before, _params(learner)))  # nothing moved
    group2, learner2, _ = _learner(quick_tiny_model, skip_update_grad_norm=None)
    before = _params(learner2)
    result = group2.update(batch=to_multi_agent_batch(_batch(learner2, advantages=[1.0, -1.0], replayed=[False, False])))[0]
    assert result[DEFAULT_MODULE_ID]["update_skipped"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, _params(learner2)))


def test_mixed_mode_removes_the_clip_on_fresh_tokens(quick_tiny_model):
    _, learner, cfg = _learner(quick_tiny_model)
    # ratio e^1 = 2.72 on every token, A = +1 on both rows: clipped at 1.2
    batch = _batch(learner, advantages=[1.0, 1.0], replayed=[False, False], old_logp_shift=1.0)
    assert _loss(learner, cfg, batch) == pytest.approx(-1.2, abs=1e-4)
    learner.set_mixed_mode(True)
    assert _loss(learner, cfg, batch) == pytest.approx(-math.e, abs=1e-3)  # -w * A, unclipped
    learner.config._is_frozen = False
    learner.config.remove_clip_in_mixed_mode = False
    assert _loss(learner, learner.config, batch) == pytest.approx(-1.2, abs=1e-4)


def test_replayed_rows_are_shaped_and_the_ablation_turns_shaping_off(quick_tiny_model):
    _, learner, cfg = _learner(quick_tiny_model)
    batch = _batch(learner, advantages=[1.0, 1.0], replayed=[True, True], old_logp_shift=1.0)
    w = math.e
    assert _loss(learner, cfg, batch) == pytest.approx(-w / (w + 0.1), abs=1e-4)  # f(w) = w / (w + 0.1)
    learner.config._is_frozen = False
    learner.config.policy_shaping = False  # ablation: replayed tokens get the fresh-token loss
    assert _loss(learner, learner.config, batch) == pytest.approx(-1.2, abs=1e-4)


def test_kl_reference_is_the_frozen_initial_policy(quick_tiny_model):
    group, learner, _ = _learner(quick_tiny_model, kl_coeff=0.5)
    reference = learner._reference_models[DEFAULT_MODULE_ID]
    assert all(not p.requires_grad for p in reference.parameters())
    ref_before = [p.detach().clone() for p in reference.parameters()]
    batch = _batch(learner, advantages=[1.0, -1.0], replayed=[False, False])
    first = group.update(batch=to_multi_agent_batch(batch))[0][DEFAULT_MODULE_ID]
    assert float(first["kl"]) == pytest.approx(0.0, abs=1e-6)  # policy == reference before the step
    for _ in range(3):
        result = group.update(batch=to_multi_agent_batch(batch))[0][DEFAULT_MODULE_ID]
    assert float(result["kl"]) > 1e-6  # the policy moved away; the reference did not
    assert all(torch.equal(a, b) for a, b in zip(ref_before, reference.parameters()))
    _, plain, _ = _learner(quick_tiny_model)
    assert plain._reference_models == {}
