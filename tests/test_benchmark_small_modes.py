"""Every product benchmark in benchmarks/ runs in its small setting and still ends with its
figure line, ``name=value ...`` with finite numbers, so that none can stop working unseen.

Each benchmark runs as a subprocess from the repository root, exactly as its usage line
gives it, with tiny sizes; the ones that start Ray start their own (this module starts
none). A benchmark that writes its figures as JSON writes them under the test's temporary
folder, never over a real measurement in benchmarks/out. peer_trl needs the TRL venv that
it makes on first use (benchmarks/out/trl-venv, a few GB of installs): it is skipped where
that venv is not there. memory_plan.py is not here: its smallest setting (``--quick``) takes
one to two minutes on 2 cores, most of what all the others here take together.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"

SMALL_STEP = {"questions_per_step": 2, "minibatch_size": 16, "max_response_tokens": 16}


def figures(line: str) -> dict:
    """``{"name": float}`` of a figure line ``a=1.0 b=2``; AssertionError on anything else."""
    pairs = [tok.split("=", 1) for tok in line.split()]
    assert pairs and all(len(p) == 2 and p[0] and p[1] for p in pairs), f"not a figure line: {line!r}"
    return {name: float(value) for name, value in pairs}


def run_benchmark(script: str, *args: str, timeout: float = 600) -> dict:
    """Run ``benchmarks/<script>`` with ``args``; the figures of its last stdout line."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    tail = f"\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{script} exited {proc.returncode}{tail}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"{script} printed nothing{tail}"
    return figures(lines[-1])


def check(found: dict, names) -> None:
    assert set(found) == set(names), sorted(found)
    bad = {k: v for k, v in found.items() if not math.isfinite(v)}
    assert not bad, bad


def test_figures_parses_a_line_and_refuses_prose():
    assert figures("a=1.5 b_c=-2 n=3e6") == {"a": 1.5, "b_c": -2.0, "n": 3e6}
    with pytest.raises(AssertionError):
        figures("wrote benchmarks/out/x.json")
    with pytest.raises(ValueError):
        figures("a=x")


# ---- no Ray: a few seconds each -----------------------------------------------------------
def test_buffer_scaling_small():
    check(
        run_benchmark("buffer_scaling.py", "--sizes", "1000"),
        ["pool", "add_us", "sample_us_per_q", "retire_us", "bytes_per_token", "overhead_bytes_per_q"],
    )


def test_logprob_memory_small(tmp_path):
    check(
        run_benchmark(
            "logprob_memory.py",
            "--tokens",
            "256",
            "--vocab",
            "4096",
            "--whole-tokens",
            "64",
            "--out",
            str(tmp_path / "logprob_memory.json"),
        ),
        ["peak_over_logits_fp32"],
    )


def test_learner_memory_small():
    check(
        run_benchmark("learner_memory.py", "--model", "tiny", "--rows", "2", "--prompt", "16", "--response", "16", "--no-checkpointing"),
        ["streamed_peak_mb", "plain_peak_mb", "streamed_over_plain_growth"],
    )


def test_learner_padding_small():
    check(
        run_benchmark("learner_padding.py", "--seeds", "1", "--scale", "256", "--repeats", "1", "--timing-rows", "16"), ["padded_over_real"]
    )


def test_reward_throughput_small():
    check(
        run_benchmark("reward_throughput.py", "--limit", "16", "--steps", "1", "--workers", "1"),
        ["arithmetic_batched_per_s", "arithmetic_verify_per_s", "arithmetic_single_per_s"],
    )


# ---- each starts a Ray of its own: 20-40 s each on 2 cores --------------------------------
@pytest.mark.slow
def test_weight_sync_small(tmp_path):
    check(
        run_benchmark("weight_sync.py", "--layers", "1", "--hidden", "64", "--syncs", "1", "--out", str(tmp_path / "weight_sync.json")),
        ["collective_object_store_bytes", "collective_seconds", "object_store_seconds"],
    )


@pytest.mark.slow
def test_checkpoint_memory_small(tmp_path):
    check(
        run_benchmark(
            "checkpoint_memory.py",
            "--learners",
            "2",
            "--layers",
            "1",
            "--hidden",
            "64",
            "--repeats",
            "1",
            "--out",
            str(tmp_path / "checkpoint_memory.json"),
        ),
        ["peak_over_shard"],
    )


@pytest.mark.slow
def test_async_rollouts_small():
    overrides = {**SMALL_STEP, "heldout_num_questions": 4, "heldout_interval": 2}
    check(
        run_benchmark("async_rollouts.py", "--seeds", "0", "--iterations", "2", "--overrides", json.dumps(overrides)),
        ["heldout_async_minus_sync"],
    )


@pytest.mark.slow
def test_planner_overhead_small():
    check(
        run_benchmark(
            "planner_overhead.py", "--steps", "1", "--warmup", "0", "--arms", "grpo", "planner", "--overrides", json.dumps(SMALL_STEP)
        ),
        ["grpo_step_s", "planner_over_grpo"],
    )


@pytest.mark.slow
def test_step_profile_small():
    check(
        run_benchmark("step_profile.py", "--iterations", "2", "--warmup", "0", "--algos", "exgrpo", "--overrides", json.dumps(SMALL_STEP)),
        ["exgrpo_step_s"],
    )


@pytest.mark.slow
def test_first_iteration_small():
    config = {"questions_per_step": 2, "minibatch_size": 16, "heldout_num_questions": 4}
    check(run_benchmark("first_iteration.py", "--config", json.dumps(config), "--timeout", "300"), ["first_iteration_seconds"])


def _trl_venv_ready() -> bool:
    sys.path.insert(0, str(BENCH))
    try:
        from _trl_venv import trl_venv_ready
    finally:
        sys.path.remove(str(BENCH))
    return trl_venv_ready() is not None


@pytest.mark.slow
@pytest.mark.skipif(not _trl_venv_ready(), reason="no TRL venv (benchmarks/out/trl-venv; peer_trl.py makes it)")
def test_peer_trl_small(tmp_path):
    check(
        run_benchmark("peer_trl.py", "--seeds", "0", "--iterations", "1", "--heldout", "8", "--out", str(tmp_path)),
        ["ours_over_trl_time", "gain_ours_minus_trl"],
    )
