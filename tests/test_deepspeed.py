"""The DeepSpeed ZeRO learner (``learner_backend="deepspeed"``) on CPU / gloo.

* stages 1, 2, 3 with two learners: after two ExGRPO iterations the full parameters are
  bit-identical on both learners (each one's own ``GatheredParameters`` view), in the
  weights RLlib ships (``get_weights``, gathered without a collective) and on the env
  runner, and equal one plain learner trained on the same batches (``tests/test_ddp.py``
  explains the setup; the same check runs there for RLlib's DDP);
* a ZeRO-3 checkpoint holds each rank's weight partitions and optimiser shard (its module
  folder a manifest, nothing gathered): restored into a new algorithm it gives back the
  same weights and AdamW state, and its next iteration is the one the uninterrupted run
  made; ``zero3_weights.consolidate`` writes the full weights as a module folder that
  ``RLModule.from_checkpoint`` reads;
* the grad-norm skip, and a NaN loss on one learner, drop the step on every engine:
  nothing moves, AdamW's step count stays;
* bf16 (what a GPU gets) runs through the same code on CPU.

Step times are printed (``pytest -s``), never asserted.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from rllib_exgrpo.rllib.deepspeed_learner import build_deepspeed_config, deepspeed_config_errors, deepspeed_importable

from test_ddp import (  # noqa: E402  (tests/ is on sys.path: the shared helpers of the DDP check)
    MODULE,
    REFERENCE_ATOL,
    assert_close_to_reference,
    assert_same_weights,
    record_steps,
    reference_parameters,
    runner_parameters,
    train_and_time,
    train_two_recorded,
    two_learner_config,
)

needs_deepspeed = pytest.mark.skipif(
    not deepspeed_importable(), reason="deepspeed is not importable (pip install 'rllib-exgrpo[deepspeed]')"
)
slow_ray = [pytest.mark.slow, needs_deepspeed, pytest.mark.usefixtures("ray_local")]

#: Every tensor of the tiny model partitioned under ZeRO-3 (the default threshold, 1e5
#: elements, would keep this model's tensors whole on every rank).
STAGE3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def ds_training(stage: int, **extra):
    overrides = dict(STAGE3) if stage == 3 else {}
    overrides.update(extra.pop("deepspeed", {}))
    return dict(learner_backend="deepspeed", deepspeed_zero_stage=stage, deepspeed=overrides, **extra)


def learner_views(algo):
    """Every learner's own full parameters: a collective on all learners at once."""
    return [r.get() for r in algo.learner_group.foreach_learner(lambda learner: learner.full_parameters_collective())]


def local_shares(algo):
    """Per learner: (elements of its fp32 master partition, of its parameter storage,
    of the whole model). ZeRO partitions the optimiser state (all stages) and, under
    ZeRO-3, the parameters themselves."""

    def share(learner):
        engine = learner.deepspeed_engines[MODULE]
        opt = engine.optimizer
        flat = opt.fp32_partitioned_groups_flat if engine.zero_optimization_stage() == 3 else opt.single_partition_of_fp32_groups
        params = list(engine.module.parameters())
        held = sum((p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() for p in params)
        total = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        return sum(t.numel() for t in flat), held, total

    return [r.get() for r in algo.learner_group.foreach_learner(share)]


def _flat_tensors(obj, prefix=""):
    import torch

    if torch.is_tensor(obj):
        return {prefix: obj.detach().float().numpy()}
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flat_tensors(v, f"{prefix}/{i}"))
    return out


def optimizer_tensors(algo):
    """Every rank's ZeRO optimiser state as flat numpy arrays (via the first learner)."""
    from ray.rllib.core import COMPONENT_LEARNER, COMPONENT_OPTIMIZER

    state = algo.learner_group.get_state(components=f"{COMPONENT_LEARNER}/{COMPONENT_OPTIMIZER}")
    return _flat_tensors(state[COMPONENT_LEARNER][COMPONENT_OPTIMIZER]["deepspeed"][MODULE]["shards"])


def adam_steps(algo):
    """AdamW's step count on every rank (the base optimiser inside each ZeRO shard)."""

    def steps(learner):
        opt = learner.deepspeed_engines[MODULE].optimizer.optimizer
        return sorted({float(s["step"]) for s in opt.state.values() if "step" in s})

    return [r.get() for r in algo.learner_group.foreach_learner(steps)]


# --- config (fast, no Ray) --------------------------------------------------------------------
def test_fields_default_to_ddp_and_stage_2_and_are_checked():
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
    from rllib_exgrpo.rllib.learner import ExGRPOTorchLearner

    cfg = ExGRPOConfig()
    assert (cfg.learner_backend, cfg.deepspeed_zero_stage, cfg.deepspeed) == ("ddp", 2, {})
    assert cfg.learner_class is ExGRPOTorchLearner
    with pytest.raises(ValueError, match=r"deepspeed_zero_stage must be one of \[1, 2, 3\], got 4"):
        ExGRPOConfig().training(deepspeed_zero_stage=4).validate()
    with pytest.raises(ValueError, match=r"learner_backend must be one of \['ddp', 'deepspeed'\]"):
        ExGRPOConfig().training(learner_backend="fsdp").validate()


@needs_deepspeed
def test_deepspeed_config_is_generated_merged_and_checked():
    import torch

    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
    from rllib_exgrpo.rllib.deepspeed_learner import DeepSpeedExGRPOLearner

    cfg = ExGRPOConfig().training(
        learner_backend="deepspeed", deepspeed_zero_stage=3, grad_clip=0.5, deepspeed={"zero_optimization": {"overlap_comm": False}}
    )
    assert cfg.learner_class is DeepSpeedExGRPOLearner
    cpu = build_deepspeed_config(cfg, torch.device("cpu"))
    assert cpu["zero_optimization"]["stage"] == 3 and cpu["zero_optimization"]["overlap_comm"] is False
    assert (
        build_deepspeed_config(cfg, torch.device("cpu"), num_parameters=2_000_000)["zero_optimization"]["reduce_bucket_size"] == 2_000_000
    )  # buckets sized to the model, at most DeepSpeed's 5e8
    assert cpu["gradient_clipping"] == 0.5 and cpu["gradient_accumulation_steps"] == 1
    assert not cpu["bf16"]["enabled"] and not cpu["fp16"]["enabled"]  # fp32 on CPU
    assert build_deepspeed_config(cfg, torch.device("cuda", 0))["bf16"]["enabled"]  # bf16 on GPU
    assert deepspeed_config_errors(cfg) == []

    bad = ExGRPOConfig().training(
        learner_backend="deepspeed",
        deepspeed_zero_stage=2,
        grad_clip_by="value",
        deepspeed={"zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam"}},
    )
    errors = "\n".join(deepspeed_config_errors(bad))
    assert "disagrees with deepspeed_zero_stage = 2" in errors
    assert "deepspeed['optimizer'] cannot be set" in errors
    assert "grad_clip_by must be 'global_norm'" in errors
    # Checked where the learner class is chosen: in the driver, before any learner starts.
    with pytest.raises(ValueError, match="Invalid DeepSpeed learner config"):
        bad.learner_class


# --- training with two learners ---------------------------------------------------------------
@pytest.mark.parametrize("stage,micro", [(1, None), (2, None), (3, None), (2, 4), (3, "rows+tokens")])
@pytest.mark.slow
@needs_deepspeed
@pytest.mark.usefixtures("ray_local")
def test_two_zero_learners_match_one_learner_and_the_runner(quick_tiny_model, stage, micro):
    """``micro``: learner_micro_batch_rows (4 passes of 4 rows per learner and step, the
    gradients accumulated under DeepSpeed's boundary), against the same one-pass reference."""
    # "rows+tokens": at most 4 rows and 100 padded positions a pass; the learners' pass
    # counts differ and are agreed on (every ZeRO-3 forward gathers parameters from all ranks).
    # Its log-probs go in chunks of 5 positions: the LM head (tied) is called, and recomputed
    # in the backward, once a chunk under ZeRO-3's parameter hooks.
    fields = (
        {"learner_micro_batch_rows": 4, "learner_micro_batch_tokens": 100, "logit_chunk_tokens": 5}
        if micro == "rows+tokens"
        else {"learner_micro_batch_rows": micro}
    )
    training = ds_training(stage, **fields)
    t_build = time.perf_counter()
    algo = two_learner_config(quick_tiny_model, **training).build_algo()
    t_build = time.perf_counter() - t_build
    try:
        initial, steps, per_step, wall = train_two_recorded(algo)
        for master, held, total in local_shares(algo):
            assert master <= total // 2 + 64, f"fp32 master partition {master} of {total}: not sharded"
            if stage == 3:
                assert held <= total // 2 + 64, f"ZeRO-3 learner holds {held} of {total} parameters"
            else:
                assert held == total
        views = learner_views(algo)
        shipped = algo.learner_group.get_weights()[MODULE]
        assert_same_weights(views + [shipped, runner_parameters(algo)], ["learner 0", "learner 1", "get_weights", "env runner"])
    finally:
        algo.stop()
    reference = reference_parameters(quick_tiny_model, steps)
    worst = assert_close_to_reference(views[0], reference, initial, atol=REFERENCE_ATOL)
    print(
        f"\nZeRO-{stage} x2{f' micro-batches ({micro})' if micro else ''}: learner step {np.mean(per_step) * 1e3:.1f} ms (iterations: "
        f"{', '.join(f'{t * 1e3:.1f}' for t in per_step)} ms), 2 iterations {wall:.1f} s, build {t_build:.1f} s, "
        f"max |ZeRO - single learner| = {worst:.2g}"
    )


def _check_zero3_checkpoint_layout(path, saved_weights):
    """The ZeRO-3 checkpoint at ``path`` (two learners): the module folder holds a manifest (no
    partitioned weights); each rank wrote its own partitions and optimiser shard."""
    from ray.rllib.core.rl_module.rl_module import RLModule

    from rllib_exgrpo.rllib import zero3_weights

    learner_dir = path / "learner_group" / "learner"
    manifest = zero3_weights._read_pickle(learner_dir / "rl_module" / MODULE / "module_state.pkl")
    assert zero3_weights.is_manifest(manifest)
    entry = manifest[zero3_weights.MANIFEST_KEY]
    assert entry["world_size"] == 2 and entry["shapes"] and set(entry["shapes"]).isdisjoint(entry["whole"])
    assert sorted(p.name for p in (learner_dir / "module_shards" / MODULE).iterdir()) == ["rank_0_of_2.pt", "rank_1_of_2.pt"]
    assert sorted(p.name for p in (learner_dir / "optimizer_shards" / MODULE).iterdir()) == ["rank_0_of_2.pt", "rank_1_of_2.pt"]
    with pytest.raises(ValueError, match="ZeRO-3 checkpoint's module folder"):
        RLModule.from_checkpoint(learner_dir / "rl_module" / MODULE)
    # Consolidated, the full weights are the saved ones, and RLlib's own loader reads them.
    written = zero3_weights.consolidate(path, path.parent / f"{path.name}_full")
    module = RLModule.from_checkpoint(written[MODULE])
    consolidated = {k: v.detach().float().numpy() for k, v in module.state_dict().items()}
    assert_same_weights([saved_weights, {k: consolidated[k] for k in saved_weights}], ["saved", "consolidated"])


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.usefixtures("ray_local")
def test_zero3_checkpoint_restores_weights_and_optimizer_and_trains_on(quick_tiny_model, tmp_path):
    from rllib_exgrpo.rllib.algorithm import ExGRPO

    algo = two_learner_config(quick_tiny_model, **ds_training(3)).build_algo()
    try:
        record_steps(algo)
        train_and_time(algo, 2)
        saved_weights = algo.learner_group.get_weights()[MODULE]
        saved_optimizer = optimizer_tensors(algo)
        t0 = time.perf_counter()
        algo.save_to_path(str(tmp_path))
        t_save = time.perf_counter() - t0
        train_and_time(algo, 1)  # the uninterrupted run's third iteration
        expected = learner_views(algo)[0]
    finally:
        algo.stop()

    _check_zero3_checkpoint_layout(tmp_path, saved_weights)

    t0 = time.perf_counter()
    restored = ExGRPO.from_checkpoint(str(tmp_path))
    t_restore = time.perf_counter() - t0
    try:
        assert restored.iteration == 2
        assert restored.learner_group.get_weights()[MODULE].keys() == saved_weights.keys()
        assert_same_weights(
            [saved_weights, restored.learner_group.get_weights()[MODULE], *learner_views(restored), runner_parameters(restored)],
            ["saved", "restored get_weights", "restored learner 0", "restored learner 1", "env runner"],
        )
        restored_optimizer = optimizer_tensors(restored)
        assert restored_optimizer.keys() == saved_optimizer.keys() and len(saved_optimizer) >= 4
        for key, value in saved_optimizer.items():
            assert np.array_equal(restored_optimizer[key], value), key
        assert adam_steps(restored) == [[2.0], [2.0]]
        record_steps(restored)
        train_and_time(restored, 1)  # trains on ...
        after = learner_views(restored)[0]
    finally:
        restored.stop()
    # ... and makes the step the uninterrupted run made (same samples: RNG, sampler and
    # pool are part of the checkpoint).
    worst = max(float(np.max(np.abs(after[k] - expected[k]))) for k in expected)
    assert worst <= 1e-6, f"restored run's third iteration differs from the uninterrupted one by {worst:.3g}"
    print(
        f"\nZeRO-3 checkpoint: save {t_save:.1f} s, from_checkpoint {t_restore:.1f} s, "
        f"{len(saved_optimizer)} optimizer tensors restored, |restored - uninterrupted| = {worst:.2g}"
    )


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.slow
@needs_deepspeed
@pytest.mark.usefixtures("ray_local")
def test_grad_norm_skip_drops_the_engine_step(quick_tiny_model, stage):
    algo = two_learner_config(quick_tiny_model, **ds_training(stage, skip_update_grad_norm=1e-12)).build_algo()
    try:
        initial = runner_parameters(algo)
        record_steps(algo)
        result = algo.train()
        learner = result["learners"][MODULE]
        assert learner["update_skipped"] == result["optimizer_steps"] == 1
        assert learner["grad_norm_preclip"] > 1e-12
        assert_same_weights([initial, *learner_views(algo), runner_parameters(algo)], ["initial", "learner 0", "learner 1", "env runner"])
        assert adam_steps(algo) == [[], []]  # AdamW never stepped: no state at all
    finally:
        algo.stop()


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.slow
@needs_deepspeed
@pytest.mark.usefixtures("ray_local")
def test_a_nan_loss_on_one_learner_drops_the_step_on_both(quick_tiny_model, stage):
    """Learner 0's shard gets NaN behaviour log-probs: its loss is NaN, the averaged
    gradient is NaN on both ranks, both drop the step; the next clean step trains."""
    from rllib_exgrpo.core import columns as C

    algo = two_learner_config(quick_tiny_model, **ds_training(stage)).build_algo()
    try:
        initial = runner_parameters(algo)
        record_steps(algo)
        update, calls = algo.learner_group.update, []

        def poisoned(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                shard = kwargs["batches"][0].policy_batches[MODULE]
                shard[C.OLD_LOGP] = np.full_like(shard[C.OLD_LOGP], np.nan)
            return update(*args, **kwargs)

        algo.learner_group.update = poisoned
        result = algo.train()
        learner = result["learners"][MODULE]
        assert learner["update_skipped"] == learner["skipped_nonfinite"] == 1
        assert_same_weights([initial, *learner_views(algo), runner_parameters(algo)], ["initial", "learner 0", "learner 1", "env runner"])
        assert adam_steps(algo) == [[], []]
        result = algo.train()  # a clean step is taken
        assert result["learners"][MODULE]["update_skipped"] == 0
        assert adam_steps(algo) == [[1.0], [1.0]]
        assert any(not np.array_equal(v, initial[k]) for k, v in runner_parameters(algo).items())
    finally:
        algo.stop()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.slow
@needs_deepspeed
@pytest.mark.usefixtures("ray_local")
def test_bf16_trains_with_fp32_master_weights(quick_tiny_model, stage):
    """bf16 (the GPU default) on CPU: the engine holds bf16 weights and fp32 master
    copies; the runner gets the bf16 weights as the float32 tensors it was built with."""
    algo = two_learner_config(quick_tiny_model, **ds_training(stage, deepspeed={"bf16": {"enabled": True}})).build_algo()
    try:
        initial = runner_parameters(algo)
        record_steps(algo)
        per_step = train_and_time(algo, 1)
        shipped = algo.learner_group.get_weights()[MODULE]
        runner = runner_parameters(algo)
        assert_same_weights([shipped, runner], ["get_weights", "env runner"])
        assert all(v.dtype == np.float32 for v in runner.values())
        assert any(not np.array_equal(runner[k], initial[k]) for k in initial)
        dtypes = algo.learner_group.foreach_learner(lambda learner: str(next(learner.deepspeed_engines[MODULE].module.parameters()).dtype))
        assert [d.get() for d in dtypes] == ["torch.bfloat16"] * 2
        print(f"\nZeRO-{stage} bf16 x2 (CPU): learner step {per_step[0] * 1e3:.1f} ms")
    finally:
        algo.stop()
