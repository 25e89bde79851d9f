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
    settings = scheduler_settings(
        {"type": "asha", "metric": "heldout/accuracy", "mode": "max", "max_t": 8, "grace_period": 2, "reduction_factor": 2}, errors
    )
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
    small = {
        "model_name_or_path": quick_tiny_model,
        "questions_per_step": 4,
        "group_size": 4,
        "minibatch_size": 16,
        "max_response_tokens": 12,
        "heldout_num_questions": 8,
    }
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rllib_exgrpo.cli.main",
            "train",
            "file",
            str(TUNE_YAML),
            "--config",
            json.dumps(small),
            "--stop",
            json.dumps({"training_iteration": 4}),
            "--storage-path",
            str(tmp_path / "results"),
            "--mlflow-uri",
            f"sqlite:///{db}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
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
        [(lr, er) for lr in ("0.0001", "0.0003") for er in ("0.25", "0.5")]
    )
    assert runs["metrics.heldout/accuracy"].notna().all()


# ------------------------------------------------------------------ a search on GPUs

GPU_TUNE_YAML = REPO / "tuned_examples" / "exgrpo_qwen1.5b_lora_tune.yaml"
#: The data only the GPU machine has, swapped for the built-in family (nothing else changes).
HERE_DATA = {"env_config": {"dataset": "arithmetic"}, "heldout_dataset": "arithmetic"}


def _dry_run(monkeypatch, capsys, *argv):
    """``rllib train file ... --dry-run`` in this process: (exit code, stdout, stderr)."""
    import ray

    from rllib_exgrpo.cli import main

    monkeypatch.chdir(REPO)
    for var in ("RAY_ADDRESS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    if ray.is_initialized():  # preflight would check that (GPU-less) cluster instead
        ray.shutdown()
    rc = main.main(["train", "file", *argv, "--dry-run"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_gpu_search_recipe_dry_run_runs_its_four_trials_at_once_on_four_gpus(monkeypatch, capsys, tmp_path):
    """The recipe's dry run on this machine (no GPU, no vLLM, no model download: the shape
    comes from the published table) with the 4 GPUs of a local Ray instance: 4 trials, all at
    once, one GPU each, the CPUs divided, and each trial's one-GPU memory plan fitting."""
    common = [
        str(GPU_TUNE_YAML.relative_to(REPO)),
        "--ray-num-gpus",
        "4",
        "--storage-path",
        str(tmp_path / "r"),
        "--config",
        json.dumps(HERE_DATA),
    ]
    rc, out, err = _dry_run(monkeypatch, capsys, *common)
    assert rc == 0, out + err
    assert "rllib train: experiment 'exgrpo-qwen1.5b-lora-tune': 4 trials, 4 at once (1 GPU each of 4; " in err, err
    assert "trials: 4" in out and "ASHA" not in err  # (the scheduler is built when the run starts)
    assert out.count(": fits") == 2 and "DOES NOT FIT" not in out, out
    rc, out, err = _dry_run(monkeypatch, capsys, *common, "--ray-num-cpus", "32")
    assert rc == 0 and "4 trials, 4 at once (1 GPU each of 4; 8 CPUs each of 32)" in err, err
    # two GPUs: two trials at a time, each with half the CPUs
    rc, out, err = _dry_run(monkeypatch, capsys, *common[:2], "2", *common[3:], "--ray-num-cpus", "32")
    assert rc == 0 and "4 trials, 2 at once (1 GPU each of 2; 16 CPUs each of 32)" in err, err


def test_the_cpu_search_still_runs_one_trial_at_a_time(monkeypatch, capsys, tmp_path):
    rc, out, err = _dry_run(monkeypatch, capsys, str(TUNE_YAML), "--storage-path", str(tmp_path / "r"), "--ray-num-cpus", "2")
    assert rc == 0, out + err
    assert "rllib train: experiment 'exgrpo-tune': 4 trials, 1 at a time (no GPUs; 2 CPUs each of 2)" in err, err


def test_tune_is_told_how_many_trials_run_at_once(monkeypatch):
    from ray import tune

    from rllib_exgrpo.cli import tune_runner
    from rllib_exgrpo.rllib.resources import ClusterResources

    (exp,) = build_experiments(str(GPU_TUNE_YAML), config_overrides=HERE_DATA, ray_num_gpus=8, dry_run=True)
    lines = tune_runner.fit_experiment_resources(exp, ClusterResources(cpus=64, gpus=8, max_node_cpus=64))
    assert lines == ["4 trials, 4 at once (1 GPU each of 8; 16 CPUs each of 64)"]
    seen = {}
    monkeypatch.setattr(tune, "Tuner", lambda *a, **kw: seen.update(kw))
    tune_runner._new_tuner(exp, verbose=1)
    assert seen["tune_config"].max_concurrent_trials == 4
    assert seen["param_space"]["num_cpus_for_main_process"] == 16  # each trial's "auto": its share


def _with(text: str, **config) -> dict:
    import yaml

    data = yaml.safe_load(text)
    spec = next(iter(data.values()))
    for key, value in config.items():
        if key.startswith("scheduler."):
            spec["scheduler"][key.split(".", 1)[1]] = value
        else:
            spec["config"][key] = value
    return data


@pytest.mark.parametrize(
    "config, bad",
    [
        ({"heldout_interval": 4}, "every 4 iterations"),  # longer than grace_period 2
        ({"heldout_interval": {"grid_search": [1, 3]}}, "every 3 iterations"),  # one value of a search
        ({"heldout_interval": 0}, "only before training"),
        ({"scheduler.grace_period": None, "heldout_interval": 2}, "(ASHA's default 1)"),
    ],
)
def test_asha_before_the_first_heldout_evaluation_is_refused_in_one_line(config, bad):
    from rllib_exgrpo.cli.registry import CliConfigError

    with pytest.raises(CliConfigError) as e:
        build_experiments(_with(TUNE_YAML.read_text(), **config), source_name="exgrpo_tune.yaml")
    (line,) = str(e.value).splitlines()
    assert line.startswith("exgrpo_tune.yaml: experiment 'exgrpo-tune': scheduler.grace_period: "), line
    assert "heldout_interval" in line and bad in line, line
    # at or within the grace period: accepted
    build_experiments(_with(TUNE_YAML.read_text(), heldout_interval=2))


def test_the_grace_period_rule_stops_the_command_before_anything_starts(monkeypatch, capsys, tmp_path):
    rc, out, err = _dry_run(
        monkeypatch,
        capsys,
        str(GPU_TUNE_YAML.relative_to(REPO)),
        "--ray-num-gpus",
        "4",
        "--storage-path",
        str(tmp_path / "r"),
        "--config",
        json.dumps({**HERE_DATA, "heldout_interval": 75}),
    )
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert "scheduler.grace_period: ASHA compares trials on heldout/accuracy from iteration 50" in lines[0]
    assert "every 75 iterations" in lines[0] and "heldout_interval" in lines[0]
    assert "4 trials" not in out + err and "memory plan" not in out
