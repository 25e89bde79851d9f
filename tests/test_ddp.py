"""RLlib's DDP with two learners (gloo on CPU): after two ExGRPO iterations the full
parameters are identical on both learners and on the env runner, and equal those of one
learner trained on the same batches.

The helpers here are shared with ``tests/test_deepspeed.py`` (same check, DeepSpeed ZeRO):
``two_learner_config``, ``record_steps``, ``reference_parameters``, ``assert_same_weights``.

The quick tiny model solves almost nothing, so every group would have zero advantages and
no policy gradient; ``record_steps`` gives each learner batch seeded, group-centred
advantages (in the driver, before the minibatches are cut), so the learners see real
sampled rows with a real gradient. The loss is ``seq-mean-token-sum-norm`` without the
entropy term: the mean of two equal shards' losses is then exactly the loss of their
union, which is what lets one learner on the whole batch be the reference.
"""

from __future__ import annotations

import time
from typing import Dict, List

import numpy as np
import pytest

from rllib_exgrpo.core import columns as C

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

MODULE = "default_policy"
#: |data-parallel - single learner| per parameter after two AdamW steps (lr 1e-3). The
#: gradients are summed in another order, and AdamW's g / sqrt(v) turns that rounding into an
#: update difference that is large only where the gradient is near zero: a handful of the
#: 0.87M entries (measured: max 7.6e-6 for DDP and ZeRO-1/2, 1.2e-5 ZeRO-3, 3.3e-5 ZeRO-3 with
#: token-budget passes; 99.99th percentile <= 5e-7 in all). A tenth of one step's size.
REFERENCE_ATOL = 1e-4
#: ||learners - single learner|| / ||single learner - initial||: the whole update agrees, not
#: just its largest entry (measured 1e-5 to 3.1e-5).
REFERENCE_RTOL_NORM = 3e-4


def two_learner_config(model: str, *, num_learners: int = 2, **training):
    """A small ExGRPO run: 8 questions x G=4 = 32 rows, one optimiser step per iteration
    (16 rows on each of two learners), mixed mode (replay) on from the first step."""
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    base = dict(
        model_name_or_path=model,
        questions_per_step=8,
        group_size=4,
        max_prompt_tokens=128,
        max_response_tokens=12,
        lr=1e-3,
        minibatch_size=16,
        loss_agg_mode="seq-mean-token-sum-norm",
        entropy_coeff=0.0,
        delayed_start_solve_rate=0.0,
        grad_clip=1.0,
    )
    base.update(training)
    return (
        ExGRPOConfig()
        .environment(env_config={"dataset": "arithmetic"})
        .training(**base)
        .learners(num_learners=num_learners, num_cpus_per_learner=0.5)
        .debugging(seed=0)
    )


def _synthetic_advantages(group_index: np.ndarray) -> np.ndarray:
    """Seeded N(0, 1) per row, centred per group (as r - mean is): a non-zero gradient."""
    group_index = np.asarray(group_index)
    rng = np.random.default_rng([len(group_index), int(group_index.sum()) % 2**31])
    adv = rng.normal(size=len(group_index))
    for g in np.unique(group_index):
        rows = group_index == g
        adv[rows] -= adv[rows].mean()
    return adv.astype(np.float32)


def record_steps(algo) -> List[dict]:
    """Wrap the algorithm's learner update: synthetic advantages in, and every optimiser
    step recorded as ``{"shards": [numpy columns per learner], "mixed_mode": bool}``."""
    steps: List[dict] = []
    group = algo.learner_group
    update, update_learners = group.update, algo._update_learners

    def recording_update(*args, **kwargs):
        batches = kwargs.get("batches") or ([kwargs["batch"]] if kwargs.get("batch") is not None else None)
        shards = [{k: np.asarray(v) for k, v in b.policy_batches[MODULE].items()} for b in batches]
        steps.append({"shards": shards, "mixed_mode": bool(algo.experience.learner_mixed_mode)})
        return update(*args, **kwargs)

    def with_advantages(batch, group_index):
        batch = dict(batch)
        batch[C.ADVANTAGES] = _synthetic_advantages(group_index)
        return update_learners(batch, group_index)

    group.update = recording_update
    algo._update_learners = with_advantages
    return steps


def merge_shards(shards: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """One learner batch of the shards' rows, in the layout of ``core/tokens.py``: prompts
    left-padded, completions right-padded to the widest shard."""
    widths_r = [s[C.RESPONSE_MASK].shape[1] for s in shards]
    widths_p = [s[C.ATTENTION_MASK].shape[1] - r for s, r in zip(shards, widths_r)]
    P, R = max(widths_p), max(widths_r)
    out = {}
    for key in shards[0]:
        parts = []
        for s, p, r in zip(shards, widths_p, widths_r):
            v = s[key]
            if v.ndim == 2 and v.shape[1] == p + r:
                v = np.pad(v, ((0, 0), (P - p, R - r)))
            elif v.ndim == 2 and v.shape[1] == r:
                v = np.pad(v, ((0, 0), (0, R - r)))
            parts.append(v)
        out[key] = np.concatenate(parts)
    return out


def reference_parameters(model: str, steps: List[dict], **training) -> Dict[str, np.ndarray]:
    """The same optimiser steps on one local learner (RLlib's TorchLearner, no DDP), each
    on the union of that step's shards."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rllib_exgrpo.core.groups import to_multi_agent_batch
    from rllib_exgrpo.models.loading import load_tokenizer
    from rllib_exgrpo.rllib.env_runner import token_spaces

    training = {**training, "learner_backend": "ddp"}
    cfg = two_learner_config(model, num_learners=0, **training)
    spaces = {DEFAULT_MODULE_ID: token_spaces(len(load_tokenizer(model)), cfg.max_prompt_tokens, cfg.max_response_tokens)}
    group = cfg.build_learner_group(spaces=spaces)
    learner = group._learner
    for step in steps:
        rows = [len(s[C.ADVANTAGES]) for s in step["shards"]]
        assert len(set(rows)) == 1, f"shards of unequal size {rows}: the shard mean is not the union's loss"
        learner.set_mixed_mode(step["mixed_mode"])
        group.update(batch=to_multi_agent_batch(merge_shards(step["shards"])))
    return learner.module[MODULE].get_state()


def runner_parameters(algo) -> Dict[str, np.ndarray]:
    from ray.rllib.core import COMPONENT_RL_MODULE

    return algo.env_runner_group.local_env_runner.get_state(components=COMPONENT_RL_MODULE)[COMPONENT_RL_MODULE]


def assert_same_weights(views: List[Dict[str, np.ndarray]], names: List[str]) -> None:
    """Bit-identical parameters (same keys, same values) across ``views``."""
    first = views[0]
    for view, name in zip(views[1:], names[1:]):
        assert set(view) == set(first), f"{name}: keys differ from {names[0]}"
        for key in first:
            assert np.array_equal(np.asarray(view[key]), np.asarray(first[key])), f"{name} != {names[0]} at {key}"


def assert_close_to_reference(
    params: Dict[str, np.ndarray], reference: Dict[str, np.ndarray], initial: Dict[str, np.ndarray], *, atol: float
) -> float:
    """``params`` equal the single-learner reference within ``atol`` per entry and within
    ``REFERENCE_RTOL_NORM`` of the update's norm; the parameters moved by much more than
    ``atol``. Returns the largest difference."""
    diff = np.concatenate([np.abs(params[k] - reference[k]).ravel() for k in reference])
    update = np.concatenate([np.abs(reference[k] - initial[k]).ravel() for k in reference])
    worst, moved = float(diff.max()), float(update.max())
    relative = float(np.linalg.norm(diff) / np.linalg.norm(update))
    assert worst <= atol, f"max |learners - single learner| = {worst:.3g} > {atol:g}"
    assert relative <= REFERENCE_RTOL_NORM, f"||learners - single learner|| / ||update|| = {relative:.3g} > {REFERENCE_RTOL_NORM:g}"
    assert moved > 10 * atol, f"training barely moved the parameters ({moved:.3g}): the comparison says nothing"
    return worst


def train_and_time(algo, iterations: int) -> List[float]:
    """Train; returns the learner time per optimiser step of each iteration (seconds)."""
    per_step = []
    for _ in range(iterations):
        result = algo.train()
        learner = result["learners"][MODULE]
        assert np.isfinite(learner["total_loss"]) and learner["update_skipped"] == 0
        per_step.append(result["step_time_s"]["learner_update_timer"] / max(1, result["optimizer_steps"]))
    return per_step


def train_two_recorded(algo):
    """The runner's initial weights, two recorded iterations (each with one shard per
    learner), their learner time per step and their wall time."""
    initial = runner_parameters(algo)
    steps = record_steps(algo)
    t0 = time.perf_counter()
    per_step = train_and_time(algo, 2)
    wall = time.perf_counter() - t0
    assert len(steps) == 2 and all(len(s["shards"]) == 2 for s in steps)
    return initial, steps, per_step, wall


@pytest.mark.parametrize("micro", [None, 4, "tokens"])
def test_ddp_two_learners_match_one_learner_and_the_runner(quick_tiny_model, micro):
    """``micro``: learner_micro_batch_rows=4 (4 passes per learner and step, DDP's
    all-reduce only in the last backward), or ``"tokens"``: learner_micro_batch_tokens=100
    (sorted rows packed under 100 padded positions: the two learners' pass counts differ
    and are agreed on), against the same one-pass reference."""
    fields = {"learner_micro_batch_tokens": 100} if micro == "tokens" else {"learner_micro_batch_rows": micro}
    algo = two_learner_config(quick_tiny_model, **fields).build_algo()
    try:
        initial, steps, per_step, wall = train_two_recorded(algo)
        from ray.rllib.core import COMPONENT_RL_MODULE

        views = [
            r.get()
            for r in algo.learner_group.foreach_learner(
                lambda learner: learner.get_state(components=COMPONENT_RL_MODULE)[COMPONENT_RL_MODULE][MODULE]
            )
        ]
        assert_same_weights(views + [runner_parameters(algo)], ["learner 0", "learner 1", "env runner"])
    finally:
        algo.stop()
    reference = reference_parameters(quick_tiny_model, steps)
    worst = assert_close_to_reference(views[0], reference, initial, atol=REFERENCE_ATOL)
    print(
        f"\nDDP x2{f' micro-batches ({micro})' if micro else ''}: learner step {np.mean(per_step) * 1e3:.1f} ms (iterations: "
        f"{', '.join(f'{t * 1e3:.1f}' for t in per_step)} ms), 2 iterations {wall:.1f} s, "
        f"max |DDP - single learner| = {worst:.2g}"
    )


def test_ddp_a_nan_loss_on_one_learner_drops_the_step_on_both(quick_tiny_model):
    from ray.rllib.core import COMPONENT_RL_MODULE

    algo = two_learner_config(quick_tiny_model).build_algo()
    try:
        record_steps(algo)
        update, calls = algo.learner_group.update, []

        def poisoned(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:  # learner 0's shard: NaN behaviour log-probs -> NaN loss there
                shard = kwargs["batches"][0].policy_batches[MODULE]
                shard[C.OLD_LOGP] = np.full_like(shard[C.OLD_LOGP], np.nan)
            return update(*args, **kwargs)

        algo.learner_group.update = poisoned
        result = algo.train()
        assert result["learners"][MODULE]["skipped_nonfinite"] == 1
        views = [
            r.get()
            for r in algo.learner_group.foreach_learner(
                lambda learner: learner.get_state(components=COMPONENT_RL_MODULE)[COMPONENT_RL_MODULE][MODULE]
            )
        ]
        assert_same_weights(views, ["learner 0", "learner 1"])
    finally:
        algo.stop()
