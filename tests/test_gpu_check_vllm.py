"""benchmarks/gpu_check.py's vLLM stages on the engine of vLLM's CPU build (``.venv-vllm``):
``vllm-reload`` builds an engine over a real-vocabulary model made locally, pushes the
learner's (perturbed) weights with the colocated sampler's push, and its prompt log-probs
then match HF's (and did not before the push), with no vLLM warning during the push;
``vllm-sleep-wake`` is skipped on CPU (no sleep mode) and says so."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.mark.vllm
@pytest.mark.slow
def test_gpu_check_vllm_stages_on_cpu(tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed here (it runs in .venv-vllm: bash tests/run.sh vllm)")
    out = tmp_path / "vllm.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.relative_to(REPO)), "--cpu", "--stages", "vllm-reload,vllm-sleep-wake", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {r["stage"]: r for r in res["summary"]}
    assert rows["vllm-reload"]["status"] == "ran", rows
    assert rows["vllm-sleep-wake"]["status"] == "skipped" and "sleep mode" in rows["vllm-sleep-wake"]["note"]
    r = res["vllm_reload"]
    assert r["vocab_size"] == 151936 and r["dtype"] == "float32"
    assert r["push"]["vllm_warnings"] == 0 and r["push"]["tensors"] > 0
    assert r["after_push"]["max_abs_diff"] <= r["tolerance"] < r["before_push"]["max_abs_diff"] / 10
    assert "vllm-reload" in proc.stdout and "| ran" in proc.stdout
