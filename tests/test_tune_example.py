"""tuned_examples/exgrpo_tune.yaml: a Tune search with ASHA, every trial in MLflow."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rllib_exgrpo.cli.experiment import build_experiments
from rllib_exgrpo.cli.scheduler import make_scheduler, scheduler_settings

REPO = Path(__file__).resolve().parents[1]
TUNE_YAML = REPO / "tuned_examples" / "exgrpo_tune.yaml"


def test_scheduler_section_is_checked_and_builds_asha():
    errors = []
    settings = scheduler_settings({"type": "asha", "metric": "heldout/accuracy", "mode": "max", "max_t": 8,
                                   "grace_period": 2, "reduction_factor": 2}, errors)
    assert not errors
    asha = make_scheduler(settings)
    assert type(asha).__name__ == "AsyncHyperBandScheduler"
    bad = []
    scheduler_settings({"type": "hyperband", "metric": 3, "mode": "up", "grace_period": 0, "typo": 1}, bad)
    assert any(m.startswith("scheduler.type:") for m in bad) and any(m.startswith("scheduler.typo:") for m in bad)
    assert any(m.startswith("scheduler.grace_period:") for m in bad)
    assert make_scheduler(None) is None


def test_scheduler_metric_must_be_reported(tmp_path):
    text = TUNE_YAML.read_text().replace("metric: heldout/accuracy", "metric: heldout/acuracy")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(Exception, match="scheduler.metric: 'heldout/acuracy'"):
        build_experiments(str(bad))


@pytest.mark.slow
def test_tune_example_runs_four_trials_with_asha_and_mlflow_reads_them_back(tmp_path, quick_tiny_model):
    import mlflow

    db = tmp_path / "mlflow.db"
    small = {"model_name_or_path": quick_tiny_model, "questions_per_step": 4, "group_size": 4,
             "minibatch_size": 16, "max_response_tokens": 12, "heldout_num_questions": 8}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "rllib_exgrpo.cli.main", "train", "file", str(TUNE_YAML), "--config", json.dumps(small),
         "--stop", json.dumps({"training_iteration": 4}), "--storage-path", str(tmp_path / "results"),
         "--mlflow-uri", f"sqlite:///{db}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200,
    )
    log = proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, log
    assert "best trial" in proc.stderr, log
    trials = [p for p in (tmp_path / "results" / "exgrpo-tune").iterdir() if p.name.startswith("ExGRPO_")]
    assert len(trials) == 4
    assert "ASHA on heldout/accuracy (max)" in proc.stderr  # the trials ran under ASHA
    for trial in trials:  # the held-out plot next to each trial's results
        assert (trial / "heldout_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", trial
    assert proc.stdout.count("held-out accuracy plot:") == 4
    mlflow.set_tracking_uri(f"sqlite:///{db}")
    runs = mlflow.search_runs(experiment_names=["exgrpo-tune"])
    assert len(runs) == 4
    assert sorted(zip(runs["params.lr"], runs["params.experience_ratio"])) == sorted(
        [(lr, er) for lr in ("0.0001", "0.0003") for er in ("0.25", "0.5")])
    assert runs["metrics.heldout/accuracy"].notna().all()
