"""ExGRPOTorchLearner's own logic on a real (quick) tiny model: the grad-norm skip, the clip
removal in mixed mode, the no-shaping ablation, the frozen KL reference and the numerical
guards (NaN/inf loss or gradients, zero-variance batches, extreme log-ratios)."""

import copy
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
    training = {"loss_agg_mode": "token-mean", "entropy_coeff": 0.0, "grad_clip": None, **training}
    cfg = ExGRPOConfig().training(
        model_name_or_path=model,
        max_prompt_tokens=16,
        max_response_tokens=8,
        lr=1e-2,
        **training,
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


def test_replay_ratio_over_an_iterations_minibatches_is_the_replayed_tokens_own(quick_tiny_model):
    """The algorithm aggregates one learner result per minibatch (``_update_learners``). A
    minibatch with no replayed row must not pull the replayed tokens' mean ratio and shaping
    towards 0: the iteration reports those of the minibatches that held replayed tokens, and
    NaN when none did."""
    from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

    group, learner, _ = _learner(quick_tiny_model)
    learner.set_mixed_mode(True)
    # replayed row and fresh row, behaviour log-probs 1 nat below the current ones: w = e
    mixed = _batch(learner, advantages=[1.0, -1.0], replayed=[True, False], old_logp_shift=1.0)
    logger = MetricsLogger(root=True)  # as the algorithm's
    logger.aggregate(group.update(batch=to_multi_agent_batch(mixed)), key="learners")
    fresh_only = _batch(learner, advantages=[1.0, -1.0], replayed=[False, False])
    logger.aggregate(group.update(batch=to_multi_agent_batch(fresh_only)), key="learners")
    out = logger.reduce()["learners"][DEFAULT_MODULE_ID]
    w = math.e
    assert _value(out["replay_ratio_mean"]) == pytest.approx(w, rel=1e-4)
    assert _value(out["replay_shaping_mean"]) == pytest.approx(w / (w + 0.1), rel=1e-4)
    assert 0.0 < _value(out["replayed_token_fraction"]) < 0.5  # the batch shares are still averaged

    group2, learner2, _ = _learner(quick_tiny_model)  # an iteration with no replayed token at all
    logger2 = MetricsLogger(root=True)
    logger2.aggregate(
        group2.update(batch=to_multi_agent_batch(_batch(learner2, advantages=[1.0, -1.0], replayed=[False, False]))), key="learners"
    )
    out2 = logger2.reduce()["learners"][DEFAULT_MODULE_ID]
    assert math.isnan(_value(out2.get("replay_ratio_mean", float("nan"))))
    assert _value(out2["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)


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


# ------------------------------------------------------------------ numerical guards


def _optimizer_state(learner):
    state = learner.get_optimizer(DEFAULT_MODULE_ID).state_dict()
    return copy.deepcopy(state)


def _same_state(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _warmed_learner(model, **training):
    """A learner after one ordinary step, so AdamW has moments and a step count to keep."""
    group, learner, cfg = _learner(model, **training)
    group.update(batch=to_multi_agent_batch(_batch(learner, advantages=[1.0, -1.0], replayed=[False, False])))
    state = _optimizer_state(learner)
    assert state["state"], "AdamW state should exist after the warm-up step"
    return group, learner, cfg


@pytest.mark.faults
@pytest.mark.parametrize("inject", ["nan_advantage", "nan_old_logp", "nan_old_logp_sequence", "nan_old_logp_replayed"])
def test_nonfinite_loss_skips_the_update_and_is_counted(quick_tiny_model, inject, fault_log):
    training = {"ratio_mode": "sequence"} if inject == "nan_old_logp_sequence" else {}
    group, learner, _ = _warmed_learner(quick_tiny_model, **training)
    replayed = [inject == "nan_old_logp_replayed", False]  # a shaped row, or a fresh one
    batch = _batch(learner, advantages=[1.0, -1.0], replayed=replayed)
    assert batch[C.RESPONSE_MASK][0, 1] == 1
    if inject == "nan_advantage":
        batch[C.ADVANTAGES][0] = np.nan
    else:
        batch[C.OLD_LOGP][0, 1] = np.nan  # a valid response token of row 0
    before, opt_before = _params(learner), _optimizer_state(learner)
    result = group.update(batch=to_multi_agent_batch(batch))[0][DEFAULT_MODULE_ID]
    assert result["skipped_nonfinite"] == 1
    assert result["update_skipped"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _params(learner)))  # nothing moved
    assert _same_state(opt_before, _optimizer_state(learner))  # moments and step count kept
    assert all(p.grad is None for p in learner.module[DEFAULT_MODULE_ID].parameters())
    # the next, healthy step is taken and not counted
    result = group.update(batch=to_multi_agent_batch(_batch(learner, advantages=[1.0, -1.0], replayed=[False, False])))[0]
    assert result[DEFAULT_MODULE_ID]["skipped_nonfinite"] == 0
    assert result[DEFAULT_MODULE_ID]["update_skipped"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, _params(learner)))
    fault_log(survived=True, lost=0)


@pytest.mark.faults
def test_inf_gradients_skip_the_update_and_are_counted(quick_tiny_model, fault_log):
    group, learner, _ = _warmed_learner(quick_tiny_model, skip_update_grad_norm=None)
    first = next(p for p in learner.module[DEFAULT_MODULE_ID].parameters() if p.requires_grad)
    hook = first.register_hook(lambda g: torch.full_like(g, float("inf")))
    try:
        batch = _batch(learner, advantages=[1.0, -1.0], replayed=[False, False])
        before, opt_before = _params(learner), _optimizer_state(learner)
        result = group.update(batch=to_multi_agent_batch(batch))[0][DEFAULT_MODULE_ID]
    finally:
        hook.remove()
    assert math.isfinite(result["total_loss"])  # the loss was fine, the gradient was not
    assert not math.isfinite(result["grad_norm_preclip"])
    assert result["skipped_nonfinite"] == 1 and result["update_skipped"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _params(learner)))
    assert _same_state(opt_before, _optimizer_state(learner))
    fault_log(survived=True, lost=0)


def test_grad_norm_skip_is_not_counted_as_nonfinite(quick_tiny_model):
    group, learner, _ = _learner(quick_tiny_model, skip_update_grad_norm=1e-9)
    result = group.update(batch=to_multi_agent_batch(_batch(learner, advantages=[1.0, -1.0], replayed=[False, False])))[0]
    assert result[DEFAULT_MODULE_ID]["update_skipped"] == 1
    assert result[DEFAULT_MODULE_ID]["skipped_nonfinite"] == 0


def test_skip_counts_add_up_over_minibatches(quick_tiny_model):
    """reduce="sum": two minibatches in one update call, one of them NaN -> 1 skipped, and
    the healthy one is applied; both NaN -> 2."""
    group, learner, _ = _learner(quick_tiny_model)
    batch = _batch(learner, advantages=[1.0, -1.0], replayed=[False, False])
    batch[C.ADVANTAGES][0] = np.nan
    before = _params(learner)
    result = group.update(batch=to_multi_agent_batch(batch), minibatch_size=1, num_epochs=1)[0][DEFAULT_MODULE_ID]
    assert result["skipped_nonfinite"] == 1 and result["update_skipped"] == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, _params(learner)))  # row 1's step
    batch[C.ADVANTAGES][1] = np.nan
    before = _params(learner)
    result = group.update(batch=to_multi_agent_batch(batch), minibatch_size=1, num_epochs=1)[0][DEFAULT_MODULE_ID]
    assert result["skipped_nonfinite"] == 2 and result["update_skipped"] == 2
    assert all(torch.equal(a, b) for a, b in zip(before, _params(learner)))


@pytest.mark.parametrize(
    "agg,ratio_mode",
    [
        ("token-mean", "token"),
        ("seq-mean-token-mean", "sequence"),
        ("seq-mean-token-sum-norm", "token"),
        ("seq-mean-token-sum-norm-official", "sequence"),
    ],
)  # every mode x ratio mode x clip x replay is in tests/test_losses.py
def test_zero_variance_batch_gives_a_finite_loss_and_zero_gradient(quick_tiny_model, agg, ratio_mode):
    from rllib_exgrpo.core.losses import group_advantages

    group, learner, _ = _learner(quick_tiny_model, loss_agg_mode=agg, ratio_mode=ratio_mode)
    # one all-correct group: std-normalised advantages are exactly 0 (no 0/0)
    adv = group_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), mode="std_normalized", eps=0.0)
    assert adv.tolist() == [0.0, 0.0]
    batch = _batch(learner, advantages=adv.numpy(), replayed=[False, True], old_logp_shift=0.3)
    result = group.update(batch=to_multi_agent_batch(batch))[0][DEFAULT_MODULE_ID]
    assert math.isfinite(result["total_loss"]) and result["total_loss"] == 0.0
    assert result["grad_norm_preclip"] == 0.0
    assert all(p.grad is None or not p.grad.any() for p in learner.module[DEFAULT_MODULE_ID].parameters())
    assert result["zero_advantage_fraction"] == 1.0
    assert result["zero_advantage_updates"] == 1
    assert result["skipped_nonfinite"] == 0 and result["update_skipped"] == 0
    ordinary = group.update(batch=to_multi_agent_batch(_batch(learner, advantages=[1.0, -1.0], replayed=[False, False])))[0]
    assert ordinary[DEFAULT_MODULE_ID]["zero_advantage_updates"] == 0
    assert ordinary[DEFAULT_MODULE_ID]["zero_advantage_fraction"] == 0.0


@pytest.mark.parametrize(
    "shift,ratio_mode,mixed",
    [
        (1000.0, "token", False),
        (1000.0, "token", True),
        (-1000.0, "token", True),
        (1000.0, "sequence", True),
        (-1000.0, "sequence", False),
    ],
)
def test_extreme_log_ratios_give_a_finite_loss_and_gradient(quick_tiny_model, shift, ratio_mode, mixed):
    group, learner, _ = _learner(quick_tiny_model, ratio_mode=ratio_mode, skip_update_grad_norm=None)
    learner.set_mixed_mode(mixed)  # mixed mode: no clip on fresh tokens, -w A
    # logp - old_logp = shift on every token; one fresh row, one replayed (shaped) row
    batch = _batch(learner, advantages=[1.0, -1.0], replayed=[False, True], old_logp_shift=shift)
    result = group.update(batch=to_multi_agent_batch(batch))[0][DEFAULT_MODULE_ID]
    assert math.isfinite(result["total_loss"])
    assert math.isfinite(result["grad_norm_preclip"])
    assert result["skipped_nonfinite"] == 0 and result["update_skipped"] == 0
    assert result["ratio_max"] <= math.exp(20.0) * (1 + 1e-6)
    assert result["ratio_min"] >= math.exp(-20.0) * (1 - 1e-6)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in learner.module[DEFAULT_MODULE_ID].parameters())


def _ragged_batch(learner, n_rows: int = 6, seed: int = 0, lengths=None):
    """n_rows completions of different lengths, some replayed, behaviour log-probs a
    little off the current ones (ratios != 1, so the clip and the shaping both act).
    ``lengths``: (prompt, completion) tokens of each row (default: prompts of 3, completions
    of 1-8)."""
    rng = np.random.default_rng(seed)
    lengths = lengths or [(3, 1 + i % 8) for i in range(n_rows)]
    trajs = []
    for i, (p_len, length) in enumerate(lengths):
        prompt = np.array([5, 6, 7]) if p_len == 3 else rng.integers(5, 60, size=p_len)
        trajs.append(
            Trajectory(
                f"q{i // 3}", prompt, rng.integers(8, 60, size=length), np.zeros(length, np.float32), float(i % 2), off_policy=(i % 3 == 2)
            )
        )
    n_rows = len(lengths)
    adv = rng.normal(size=n_rows).astype(np.float32)
    batch = learner_batch(trajs, adv, pad_id=0)
    module = learner.module[DEFAULT_MODULE_ID]
    with torch.no_grad():
        logp = module._forward_train({k: torch.as_tensor(v) for k, v in batch.items()})[C.LOGP].numpy()
    batch[C.OLD_LOGP] = (logp - rng.normal(scale=0.2, size=logp.shape)) * batch[C.RESPONSE_MASK]
    return batch


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm-official"])
@pytest.mark.parametrize("micro", [1, 4])
def test_micro_batches_give_the_one_pass_update(quick_tiny_model, agg, micro):
    """learner_micro_batch_rows cuts the pass, not the update: the gradient of the step
    (left in ``p.grad``, after the clip) and the loss equal the one-pass learner's (float
    tolerance; parameters are not compared: AdamW's first step is ~lr * sign(g), which
    turns float noise on near-zero gradients into lr-sized differences)."""
    results, params = [], []
    for rows in (None, micro):
        group, learner, _ = _learner(
            quick_tiny_model, loss_agg_mode=agg, entropy_coeff=0.01, kl_coeff=0.05, grad_clip=1.0, learner_micro_batch_rows=rows
        )
        learner.set_mixed_mode(True)
        batch = _ragged_batch(learner)
        results.append(group.update(batch=to_multi_agent_batch(batch))[0][DEFAULT_MODULE_ID])
        params.append([p.grad.detach().clone() for p in learner.module[DEFAULT_MODULE_ID].parameters()])
    one, cut = _assert_same_update(results, params)
    assert cut["update_skipped"] == one["update_skipped"] == 0


def _value(stat) -> float:
    return float(stat.peek() if hasattr(stat, "peek") else stat)


def _assert_same_update(results, grads):
    """Two learners' results and gradients of one update: equal within float tolerance."""
    one, cut = results
    scale = max(float(g.abs().max()) for g in grads[0])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5 * scale, rtol=1e-4)
    # the ratio statistics too: each weighted by the tokens it is taken over (a pass with no
    # replayed token leaves the replayed ratios out rather than adding a 0)
    for key in (
        "policy_loss",
        "total_loss",
        "grad_norm_preclip",
        "ratio_max",
        "ratio_min",
        "ratio_mean",
        "clip_fraction",
        "replay_ratio_mean",
        "replay_shaping_mean",
        "replayed_token_fraction",
        "entropy",
    ):
        assert _value(cut[key]) == pytest.approx(_value(one[key]), rel=1e-4, abs=1e-6), key
    return one, cut


def test_a_nonfinite_micro_batch_drops_the_whole_update(quick_tiny_model):
    group, learner, _ = _learner(quick_tiny_model, learner_micro_batch_rows=2)
    batch = _ragged_batch(learner)
    batch[C.ADVANTAGES][5] = np.nan  # only the last micro-batch
    before = _params(learner)
    result = group.update(batch=to_multi_agent_batch(batch))[0][DEFAULT_MODULE_ID]
    assert result["update_skipped"] == 1 and result["skipped_nonfinite"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _params(learner)))


def _long_tailed_batch(learner, seed=0, n_rows=12):
    """Rows with prompts of 2-6 tokens and completions of 1-8, one row much longer than the rest."""
    return _ragged_batch(learner, seed=seed, lengths=[(2 + i % 5, 8 if i == 7 else 1 + (i * 5) % 4) for i in range(n_rows)])


@pytest.mark.parametrize(
    "agg,budget,rows,extra_passes,packing",
    [
        *[
            (agg, 24, None, 0, True)
            for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum-norm-official")
        ],
        ("seq-mean-token-mean", 24, None, 0, False),
        ("seq-mean-token-mean", 40, 3, 0, False),
        ("token-mean", 24, None, 2, True),
    ],
)
def test_token_budget_passes_give_the_one_pass_update(quick_tiny_model, monkeypatch, agg, budget, rows, extra_passes, packing):
    """learner_micro_batch_tokens packs the passes (end to end without padding, or padded,
    sorted and trimmed), and the step's gradient and loss still equal the one-pass
    learner's; so do empty passes (``extra_passes``: as a data-parallel learner with fewer
    rows than another runs them). The KL term (kl_coeff) scores the reference model on the
    same packed passes."""
    grads, results = [], []
    for fields in ({}, {"learner_micro_batch_tokens": budget, "learner_micro_batch_rows": rows, "learner_sequence_packing": packing}):
        group, learner, _ = _learner(quick_tiny_model, loss_agg_mode=agg, entropy_coeff=0.01, kl_coeff=0.05, grad_clip=1.0, **fields)
        if fields and extra_passes:
            real = type(learner)._agreed_pass_count
            monkeypatch.setattr(type(learner), "_agreed_pass_count", lambda self, n: real(self, n) + extra_passes)
        learner.set_mixed_mode(True)
        batch = _long_tailed_batch(learner)
        results.append(group.update(batch=to_multi_agent_batch(batch))[0][DEFAULT_MODULE_ID])
        grads.append([p.grad.detach().clone() for p in learner.module[DEFAULT_MODULE_ID].parameters()])
        monkeypatch.undo()
    one, cut = _assert_same_update(results, grads)
    assert _value(cut["learner_passes"]) >= 2
    if packing:
        assert _value(cut["learner_padded_over_real"]) == 1.0
    else:
        assert 1.0 < _value(cut["learner_padded_over_real"]) < 1.6


def test_token_budget_passes_are_trimmed_to_their_longest_row(quick_tiny_model):
    """What the forward sees: every pass under the budget (or one row), sorted, trimmed."""
    from rllib_exgrpo.core.minibatches import real_lengths

    for packing in (False, True):
        group, learner, _ = _learner(quick_tiny_model, learner_micro_batch_tokens=24, learner_sequence_packing=packing)
        batch = {DEFAULT_MODULE_ID: {k: torch.as_tensor(v) for k, v in _long_tailed_batch(learner).items()}}
        passes = learner._micro_batches(batch)
        seen = 0
        for chunk in passes:
            cols = chunk[DEFAULT_MODULE_ID]
            n, width = cols[C.INPUT_IDS].shape
            prompt, completion = real_lengths(cols)
            assert width == prompt.max() + completion.max()  # nothing but the pass's own padding
            if packing:  # and what is computed: the real tokens end to end, within the budget
                assert cols[C.PACKED_INPUT_IDS].shape == (1, prompt.sum() + completion.sum())
                assert cols[C.PACKED_INPUT_IDS].shape[1] <= 24 or n == 1
            else:
                assert n * width <= 24 or n == 1
            seen += n
        assert seen == 12


def test_packed_scoring_equals_padded_scoring(quick_tiny_model):
    """core/packing.py: the rows end to end, positions restarting per row, give each
    completion token the log-prob and entropy of the padded layout (and 0 where masked)."""
    from rllib_exgrpo.core.packing import pack_rows, score_packed
    from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy

    group, learner, _ = _learner(quick_tiny_model)
    model = learner.module[DEFAULT_MODULE_ID].model
    cols = {k: torch.as_tensor(v) for k, v in _long_tailed_batch(learner).items()}
    with torch.no_grad():
        logp, ent = completion_logprobs_and_entropy(
            model, cols[C.INPUT_IDS], cols[C.ATTENTION_MASK], cols[C.RESPONSE_MASK].shape[1], temperature=0.7
        )
        packed = {**cols, **pack_rows(cols)}
        p_logp, p_ent = score_packed(model, packed, temperature=0.7)
    mask = cols[C.RESPONSE_MASK] > 0
    assert packed[C.PACKED_INPUT_IDS].shape[1] == int(cols[C.ATTENTION_MASK].sum())
    assert torch.allclose(p_logp[mask], logp[mask], atol=1e-5) and torch.allclose(p_ent[mask], ent[mask], atol=1e-5)
    assert not p_logp[~mask].any() and not p_ent[~mask].any()
