"""The time estimate the memory plan prints (``planning/timing.py``): its arithmetic on
hand-made inputs, and its calibration point, the 7B learner update of docs/scaling.md."""

from __future__ import annotations

import math

import pytest

from rllib_exgrpo.planning import timing


def test_mean_completion_of_the_length_mix():
    # E[min(X, cap)] of a log-normal (median 700, sigma 0.8) by numerical integration
    mu, s, cap = math.log(700), 0.8, 4096
    xs = [math.exp(mu + s * (-8 + 16 * i / 40000)) for i in range(40001)]
    dens = [math.exp(-0.5 * ((math.log(x) - mu) / s) ** 2) / (x * s * math.sqrt(2 * math.pi)) for x in xs]
    integral = sum(min(x, cap) * d * (x2 - x) for x, d, x2 in zip(xs, dens, xs[1:]))
    assert timing.mean_completion_tokens(cap) == pytest.approx(0.97 * integral + 0.03 * cap, rel=1e-3)
    # the mix measured by benchmarks/learner_padding.py at the 8192 cap: ~1,150 tokens
    assert 1100 < timing.mean_completion_tokens(8192) < 1200


def test_stages_follow_the_formulas():
    n, completions = 7_615_616_512, 1024
    est = timing.estimate_iteration(
        parameters=n,
        completions=completions,
        prompt_cap=1024,
        completion_cap=8192,
        generating_gpus=4,
        learner_gpus=4,
        card="H100 80 GB",
        lora=False,
        gradient_checkpointing=True,
        colocate=False,
    )
    peak, bandwidth = timing.CARD_SPEEDS["H100 80 GB"]
    mean = timing.mean_completion_tokens(8192)
    per_learner = completions * (157 + mean) / 4
    assert est.stages["update"] == pytest.approx(8 * n * per_learner / (peak * timing.TRAINING_MFU))
    assert est.stages["scoring"] == pytest.approx(2 * n * per_learner / (peak * timing.TRAINING_MFU))
    tokens_per_s = timing.DECODE_STREAMS * bandwidth / (2 * n)
    assert est.stages["generation"] == pytest.approx(completions / 4 * mean / tokens_per_s)
    assert est.stages["weight sync"] == pytest.approx(2 * n / timing.BROADCAST_BYTES_PER_S)
    # calibration: docs/scaling.md's 62 s update and ~90 s generation at this recipe's tokens
    assert 55 < est.stages["update"] < 66 and 80 < est.stages["generation"] < 100
    assert est.seconds == pytest.approx(sum(est.stages.values()))


def test_lora_colocation_and_the_single_stream_floor():
    kw = dict(
        parameters=1_543_714_304,
        completions=16,
        prompt_cap=512,
        completion_cap=8192,
        generating_gpus=1,
        learner_gpus=1,
        card="A10 24 GB",
        gradient_checkpointing=False,
    )
    full = timing.estimate_iteration(lora=False, colocate=True, optimizer_state_bytes=12 * 1.5e9, **kw)
    lora = timing.estimate_iteration(lora=True, colocate=True, **kw)
    assert lora.stages["update"] == pytest.approx(full.stages["update"] * 4 / 6)
    assert full.stages["optimiser offload"] == pytest.approx(2 * 12 * 1.5e9 / timing.HOST_BYTES_PER_S)
    assert "optimiser offload" not in lora.stages
    # 16 completions: the longest one, decoded alone, sets the generation time
    _, bandwidth = timing.CARD_SPEEDS["A10 24 GB"]
    assert full.stages["generation"] == pytest.approx(8192 / (timing.SINGLE_STREAM_EFFICIENCY * bandwidth / (2 * 1_543_714_304)))
    ppo = timing.estimate_iteration(lora=True, colocate=False, value_trunk=True, **kw)
    assert ppo.stages["update"] == pytest.approx(2 * lora.stages["update"])


def test_card_and_run_length():
    assert timing.card_for_estimate(80 * 2**30) == "H100 80 GB"
    assert timing.card_for_estimate(24 * 2**30) == "A10 24 GB"
    assert timing.card_for_estimate(141 * 2**30) == "H200 141 GB"
    assert timing.card_for_estimate(40 * 2**30) is None and timing.card_for_estimate(None) is None
    est = timing.TimeEstimate("H100 80 GB", {"generation": 100.0, "other": 62.0}, iterations=701)
    assert est.describe().endswith("~162 s (generation 100, other 62); 701 iterations: ~32 h")
