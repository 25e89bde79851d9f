"""benchmarks/gpu_check.py on CPU with the tiny shape: it runs from the repository root as a
plain script, imports no Ray for the learner's functions, and writes every figure."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_gpu_check_tiny_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.relative_to(REPO)), "--shape", "tiny", "--device", "cpu", "--steps", "1",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "learner step" in proc.stdout and "generation" in proc.stdout  # the table
    res = json.loads(out.read_text())

    for key in ("shape", "device", "dtype", "torch", "transformers", "imports", "params", "stage_times_s",
                "total_s", "learner", "generation", "learner_static_gib"):
        assert key in res, key
    assert res["shape"] == "tiny" and res["device"] == "cpu" and res["param_dtype"] == "bfloat16"
    assert res["imports_pull_in_ray"] is False
    assert res["imports"]["rllib_exgrpo.core.scoring+losses"] == []
    assert _positive(res["params"]) and _positive(res["total_s"])
    # bf16 weights without an fp32 master copy: an lr 1e-6 AdamW step leaves most unchanged
    assert 0.0 <= res["param_update_fraction"] < 0.5
    assert res["stage_times_s"] and all(_positive(v) for v in res["stage_times_s"].values())

    # two response lengths, each with and without gradient checkpointing
    assert sorted((e["response"], e["gradient_checkpointing"]) for e in res["learner"]) == [
        (16, False), (16, True), (48, False), (48, True)]
    for e in res["learner"]:
        assert e["status"] == "ok", e
        for key in ("step_s_mean", "step_s_min", "tokens_per_s", "valid_tokens_per_s", "peak_gib",
                    "score_nograd_s", "score_nograd_tokens_per_s", "tokens_per_step", "valid_tokens_per_step"):
            assert _positive(e[key]), (e["name"], key, e.get(key))
        assert e["steps"] == 1
        assert e["valid_tokens_per_step"] < e["tokens_per_step"]  # padded like a learner batch

    assert {e["decoder"] for e in res["generation"]} == {"generate", "pruned"}
    for e in res["generation"]:
        assert e["status"] == "ok", e
        assert e["generated_tokens"] == e["batch"] * e["new_tokens"]  # no stop token: full length
        for key in ("seconds", "tokens_per_s", "peak_gib"):
            assert _positive(e[key]), (e["name"], key, e.get(key))


def test_gpu_check_full_shape_without_cuda_says_so_in_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "never.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.relative_to(REPO)), "--shape", "qwen2.5-1.5b", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "CUDA" in lines[0], lines
    assert not out.exists()
