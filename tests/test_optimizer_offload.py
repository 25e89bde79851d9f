"""rllib/optimizer_offload.py: a colocated turn's optimizer offload, with DeepSpeed's real
``offload_states`` / ``reload_states`` under ZeRO-1, 2 and 3 and the learners' real optimizer
(torch AdamW), on CPU (gloo, one rank). The state round-trips bit for bit, what the next
weight push reads never moves, and training after a round trip equals training without one."""

import pytest
import torch

from rllib_exgrpo.rllib.optimizer_offload import (
    KEPT_STATES,
    ZERO3_ENGINE_STATES,
    ZERO12_STATES,
    OptimizerOffload,
    optimizer_state_tensors,
)

deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not importable (pip install 'rllib-exgrpo[deepspeed]')")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _engine(stage: int):
    from rllib_exgrpo.rllib.deepspeed_learner import _prepare_distributed

    _prepare_distributed(torch.device("cpu"))
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 1_000_000,
            "allgather_bucket_size": 1_000_000,
            # every parameter partitioned, none kept whole (ZeRO-3)
            "stage3_param_persistence_threshold": 0,
        },
        "bf16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine


def _step(engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=g)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()


def _optimizer_state(engine):
    return [(k, v.clone(), v.device, v.data_ptr()) for _, k, v in optimizer_state_tensors([engine.optimizer.optimizer])]


def _hp_params(engine, stage):
    zopt = engine.optimizer
    return list(zopt.fp32_partitioned_groups_flat if stage == 3 else zopt.single_partition_of_fp32_groups)


def _lp_params(engine, stage):
    """What a push reads: ZeRO-3's local partitions, ZeRO-1/2's full compute weights."""
    return [p.ds_tensor if stage == 3 else p for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_offload_round_trips_bit_for_bit_and_keeps_the_pushed_weights(stage, capsys):
    engine = _engine(stage)
    _step(engine, 1)
    state = _optimizer_state(engine)
    hp = [(t.clone(), t.data_ptr()) for t in _hp_params(engine, stage)]
    lp = [(t.detach().clone(), t.data_ptr()) for t in _lp_params(engine, stage)]
    assert state and hp

    offload = OptimizerOffload(lambda: [], lambda: [engine])
    moved = offload.offload()
    assert not offload.on_device
    # DeepSpeed's own call ran, with the explicit list (never lp_params).
    offloaded = {s.value for s in engine.optimizer.offloaded_states}
    engine_states = set(ZERO3_ENGINE_STATES if stage == 3 else ZERO12_STATES)
    assert offloaded <= engine_states and "lp_params" not in offloaded
    assert offloaded & engine_states
    # What moved, per kind: optimizer state and fp32 partitions, each its real size.
    assert offload.moved["optim_states"] == sum(v.numel() * v.element_size() for _, v, _, _ in state)
    assert offload.moved["hp_params"] == sum(t.numel() * t.element_size() for t, _ in hp)
    assert moved == sum(offload.moved.values()) > 0
    # The fp32 partitions were copied into other storage (DeepSpeed's pinned buffers under
    # ZeRO-1/2, this module's host copy under ZeRO-3), the moments too under ZeRO-3 (under
    # ZeRO-1/2 DeepSpeed leaves a state already on the host in place: a GPU's moves it).
    assert all(t.data_ptr() != ptr for t, (_, ptr) in zip(_hp_params(engine, stage), hp))
    if stage == 3:
        after = _optimizer_state(engine)
        moments = [i for i, (k, *_rest) in enumerate(state) if k in ("exp_avg", "exp_avg_sq")]
        assert moments and all(after[i][3] != state[i][3] for i in moments)
    # The weights the push reads stayed where they were.
    for t, (value, ptr) in zip(_lp_params(engine, stage), lp):
        assert t.data_ptr() == ptr and torch.equal(t.detach(), value)
    line = offload.describe()
    assert f"ZeRO-{stage}" in line and "optim_states" in line and "hp_params" in line
    assert all(k in line for k in KEPT_STATES) is False  # names what stays in words, not as moved

    assert offload.reload() == moved and offload.on_device
    assert not engine.optimizer.offloaded_states
    for (k, v, dev, _), (k2, v2, dev2, _) in zip(state, _optimizer_state(engine)):
        assert k == k2 and dev == dev2 and torch.equal(v, v2)  # bit for bit, same device
    for t, (value, _) in zip(_hp_params(engine, stage), hp):
        assert torch.equal(t, value)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_training_after_a_round_trip_equals_training_without_one(stage):
    reference = _engine(stage)
    for seed in (1, 2, 3):
        _step(reference, seed)
    expected = [p.detach().clone() for p in _hp_params(reference, stage)]

    engine = _engine(stage)
    offload = OptimizerOffload(lambda: [], lambda: [engine])
    for seed in (1, 2, 3):
        _step(engine, seed)
        offload.offload()
        offload.reload()
    for got, want in zip(_hp_params(engine, stage), expected):
        assert torch.equal(got, want)


def test_a_torch_optimizer_round_trips_through_a_host_copy():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    before = [(v.clone(), v.data_ptr()) for _, _, v in optimizer_state_tensors([opt])]
    offload = OptimizerOffload(lambda: [opt])
    moved = offload.offload()
    assert moved == sum(v.numel() * v.element_size() for v, _ in before) == offload.moved["optim_states"]
    assert all(v.data_ptr() != ptr for (_, _, v), (_, ptr) in zip(optimizer_state_tensors([opt]), before))
    assert "torch optimizer" in offload.describe()
    assert offload.reload() == moved
    assert all(torch.equal(v, b) for (_, _, v), (b, _) in zip(optimizer_state_tensors([opt]), before))


def test_deepspeeds_default_zero3_offload_refuses_the_learners_optimizer():
    """Why ZeRO-3's fp32 partitions and AdamW state are moved beside DeepSpeed's call: its
    ``offload_states`` with no list asserts FusedAdam (DeepSpeed 0.19, runtime/zero/stage3.py)."""
    engine = _engine(3)
    _step(engine, 1)
    with pytest.raises(AssertionError, match="FusedAdam"):
        engine.offload_states(pin_memory=True)
