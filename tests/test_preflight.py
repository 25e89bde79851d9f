"""Preflight: every bad experiment file fails before Ray starts, in one line per problem.

Each bad file kind goes through the real command (``rllib train file bad.yaml`` in a
subprocess): exit code 2, the key and the file named on one line, no traceback, no
Ray. The wall time of each run is printed (``pytest -s``).
The rest are in-process checks of ``rllib_exgrpo.cli.preflight``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rllib_exgrpo.cli import preflight
from rllib_exgrpo.cli.experiment import build_experiments
from rllib_exgrpo.cli.registry import CliConfigError

REPO = Path(__file__).resolve().parents[1]
QWEN = "tuned_examples/exgrpo_qwen.yaml"


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _rllib() -> list:
    script = Path(sys.executable).with_name("rllib")  # the venv's console script
    return [str(script)] if script.exists() else [sys.executable, "-m", "rllib_exgrpo.cli.main"]


def _run(args, *, cwd, env=None):
    t0 = time.perf_counter()
    proc = subprocess.run(_rllib() + list(args), cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=300)
    return proc, time.perf_counter() - t0


def _check_failed_before_ray(proc, path, keys, storage):
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    assert "Started a local Ray instance" not in out and "ray.init" not in out, out
    assert not storage.exists(), out
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    prefix = "rllib train: error: "
    assert lines and lines[0].startswith(prefix), out
    lines[0] = lines[0][len(prefix) :]
    for ln in lines:  # every line names the file and the experiment
        assert ln.startswith(f"{path}: experiment 'bad': "), out
    for key in keys:
        assert any(key in ln for ln in lines), (key, out)
    return lines


EXGRPO_HEAD = """\
bad:
  run: GRPO
  env: rllib_exgrpo.envs.reasoning_env:ReasoningEnv
  stop: {training_iteration: 1}
  config:
    model_name_or_path: tiny
    num_env_runners: 0
"""

PPO_HEAD = """\
bad:
  run: PPO
  env: CartPole-v1
  stop: {training_iteration: 1}
  config:
    num_env_runners: 0
"""


def _no_tokenizer_model(tmp_path: Path) -> str:
    folder = tmp_path / "model_without_tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


# name -> (file text, keys that must be named, optional setup returning format kwargs)
BAD_FILES = {
    "missing_dataset": (
        EXGRPO_HEAD + "    env_config: {dataset: /nonexistent/preflight/train.jsonl}\n",
        ["config.env_config.dataset: no such file: /nonexistent/preflight/train.jsonl"],
    ),
    "missing_heldout_dataset": (
        EXGRPO_HEAD + "    heldout_dataset: /nonexistent/preflight/valid.parquet\n",
        ["config.heldout_dataset: no such file: /nonexistent/preflight/valid.parquet"],
    ),
    "bad_dataset_spec": (
        EXGRPO_HEAD + "    env_config: {dataset: 'arithmetic:levels=1,2'}\n",
        ["config.env_config.dataset: bad dataset spec"],
    ),
    "misspelled_env_config_key": (EXGRPO_HEAD + "    env_config: {datset: arithmetic}\n", ["config.env_config.datset", "'dataset'"]),
    "missing_model_folder": (
        EXGRPO_HEAD.replace("model_name_or_path: tiny", "model_name_or_path: ./no/such/model"),
        ["config.model_name_or_path: no such model folder"],
    ),
    "model_folder_without_tokenizer": (
        EXGRPO_HEAD.replace("model_name_or_path: tiny", "model_name_or_path: {model}"),
        ["config.model_name_or_path", "no tokenizer files"],
    ),
    "uncached_hub_model_offline": (
        EXGRPO_HEAD.replace("model_name_or_path: tiny", "model_name_or_path: no-such-org/no-such-model-preflight"),
        ["config.model_name_or_path", "HF_HUB_OFFLINE"],
    ),
    "misspelled_stop_key": (
        EXGRPO_HEAD.replace("stop: {training_iteration: 1}", "stop: {env_runners/episode_retrun_mean: 0.9}"),
        ["stop: 'env_runners/episode_retrun_mean'", "'env_runners/episode_return_mean'"],
    ),
    "stop_key_not_reported_by_config": (
        EXGRPO_HEAD.replace("stop: {training_iteration: 1}", "stop: {heldout/accuracy: 0.5}"),
        ["stop: 'heldout/accuracy'", "heldout_dataset"],
    ),
    "misspelled_stop_key_ppo": (
        PPO_HEAD.replace("stop: {training_iteration: 1}", "stop: {trainig_iteration: 2}"),
        ["stop: 'trainig_iteration'", "'training_iteration'"],
    ),
    "field_values": (
        EXGRPO_HEAD + "    group_size: 1\n    temperature: -1.0\n",
        ["config.group_size: must be", "config.temperature: must be"],
    ),
    "rllib_validate": (PPO_HEAD + "    minibatch_size: 100000\n", ["config: `minibatch_size`"]),
    "grid_search_value": (
        EXGRPO_HEAD + "    env_config:\n      dataset: {grid_search: [arithmetic, /nonexistent/preflight/b.jsonl]}\n",
        ["config.env_config.dataset: no such file", "variant env_config/dataset="],
    ),
    "checkpoint_config": (
        EXGRPO_HEAD.replace(
            "  config:", "  checkpoint_config: {checkpoint_frequency: -1, checkpoint_score_attribute: solve_rat}\n  config:"
        ),
        ["checkpoint_config.checkpoint_frequency", "checkpoint_config.checkpoint_score_attribute", "'solve_rate'"],
    ),
    "too_many_gpus": (EXGRPO_HEAD + "    num_learners: 2\n    num_gpus_per_learner: 512\n", ["config.num_gpus_per_learner", "GPU"]),
    "vllm_not_installed": (EXGRPO_HEAD + "    generation_backend: vllm\n", ["config.generation_backend", "vllm"]),
}


@pytest.mark.faults
@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_file_fails_before_ray_in_one_line_per_problem(kind, tmp_path, fault_log):
    if kind == "vllm_not_installed" and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    text, keys = BAD_FILES[kind]
    if "{model}" in text:
        text = text.replace("{model}", _no_tokenizer_model(tmp_path))
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    storage = tmp_path / "results"
    env = _env(HF_HUB_OFFLINE="1") if kind == "uncached_hub_model_offline" else _env()
    proc, wall = _run(["train", "file", str(bad), "--storage-path", str(storage)], cwd=tmp_path, env=env)
    print(f"\npreflight {kind}: exit {proc.returncode} after {wall:.1f} s")
    lines = _check_failed_before_ray(proc, str(bad), keys, storage)
    assert len(lines) == len(set(lines))
    fault_log(survived=True, lost=0)  # refused in one line each, nothing started or written


def test_dry_run_of_the_qwen_example_lists_its_problems_on_this_machine(tmp_path):
    """exgrpo_qwen.yaml needs its parquet files and 8 GPUs: --dry-run names each that this
    machine lacks, one line each, instead of "1 experiment(s) valid". vLLM, which only the
    GPU nodes need, is not one of them: a dry run plans without it."""
    import torch

    expected = []
    if not Path("/data/exgrpo/train.parquet").exists():
        expected.append("config.env_config.dataset: no such file: /data/exgrpo/train.parquet")
    if not Path("/data/exgrpo/valid.parquet").exists():
        expected.append("config.heldout_dataset: no such file: /data/exgrpo/valid.parquet")
    if torch.cuda.device_count() < 8:
        expected.append("config.num_gpus_per_env_runner, config.num_gpus_per_learner: the config asks for 8 GPU(s)")
    if not expected:
        pytest.skip("this machine has everything exgrpo_qwen.yaml needs")
    proc, wall = _run(["train", "file", QWEN, "--dry-run", "--storage-path", str(tmp_path / "r")], cwd=REPO)
    print(f"\npreflight qwen dry run: exit {proc.returncode} after {wall:.1f} s")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "valid" not in proc.stdout, out
    assert "Traceback" not in out, out
    lines = [ln.replace("rllib train: error: ", "", 1) for ln in proc.stderr.splitlines() if ln.strip()]
    assert all(ln.startswith(f"{QWEN}: experiment 'exgrpo-qwen': ") for ln in lines), out
    for needle in expected:
        assert sum(needle in ln for ln in lines) == 1, (needle, out)
    assert len(lines) == len(expected), out
    assert "generation_backend" not in proc.stderr, out


# ------------------------------------------------------------------ in process


def test_tuned_examples_pass_preflight_on_this_machine():
    from rllib_exgrpo.models import smollm2_available

    for f in sorted((REPO / "tuned_examples").glob("*.yaml")):
        if f.name.startswith(("exgrpo_qwen", "grpo_qwen", "ppo_qwen")) or ("smollm2" in f.name and not smollm2_available()):  # GPU recipes
            continue
        (exp,) = build_experiments(str(f))
        assert exp.name, f


def _build_error(spec) -> str:
    with pytest.raises(CliConfigError) as e:
        build_experiments({"bad": spec})
    return str(e.value)


def test_every_problem_of_every_experiment_is_reported_one_line_each():
    spec_a = {"run": "GRPO", "stop": {"solve_rat": 1}, "config": {"group_size": 0, "heldout_dataset": "/nonexistent/h.jsonl"}}
    spec_b = {
        "run": "PPO",
        "env": "CartPole-v1",
        "stop": {"training_iteration": 1},
        "config": {"lr": -1, "num_env_runners": 0, "num_gpus_per_learner": 4096},
    }
    with pytest.raises(CliConfigError) as e:
        build_experiments({"a": spec_a, "b": spec_b})
    lines = str(e.value).splitlines()
    assert any(ln.startswith("experiment 'a': config.group_size: must be") for ln in lines), lines
    assert any(ln.startswith("experiment 'a': config.heldout_dataset: no such file") for ln in lines), lines
    assert any(ln.startswith("experiment 'a': stop: 'solve_rat'") and "'solve_rate'" in ln for ln in lines), lines
    assert any(ln.startswith("experiment 'b': config.num_gpus_per_learner") for ln in lines), lines
    assert "To suppress all validation errors" not in str(e.value)


def test_search_space_values_are_checked_one_by_one():
    msg = _build_error(
        {
            "run": "GRPO",
            "config": {
                "model_name_or_path": {"choice": ["tiny", "/nonexistent/model"]},
                "temperature": {"grid_search": [1.0, 0.5, -2.0]},
            },
        }
    )
    lines = msg.splitlines()
    assert len(lines) == 2, lines
    assert "config.model_name_or_path: no such model folder: /nonexistent/model (variant model_name_or_path=" in msg
    assert "config.temperature: must be > 0 for sampling, got -2.0 (variant temperature=-2.0)." in msg


def test_beyond_max_variants_every_value_is_still_checked(monkeypatch):
    monkeypatch.setattr(preflight, "MAX_VARIANTS", 4)
    msg = _build_error({"run": "GRPO", "config": {"group_size": {"grid_search": [2, 3, 4, 1]}, "lr": {"grid_search": [1e-4, 1e-3]}}})
    assert "config.group_size: must be an integer >= 2 (a group needs a baseline), got 1" in msg


def test_stop_criteria_nested_and_flattened():
    (exp,) = build_experiments(
        {
            "ok": {
                "run": "PPO",
                "env": "CartPole-v1",
                "stop": {"env_runners": {"episode_return_mean": 150}, "training_iteration": 3},
                "config": {"num_env_runners": 0},
            }
        }
    )
    assert exp.stop == {"env_runners/episode_return_mean": 150, "training_iteration": 3}
    (exp,) = build_experiments(
        {
            "ok": {
                "run": "GRPO",
                "stop": {"heldout/accuracy": 0.5, "experience/bucket_7": 3, "learners/default_policy/total_loss": -1},
                "config": {"heldout_dataset": "arithmetic"},
            }
        }
    )
    msg = _build_error({"run": "GRPO", "stop": {"experience/bucket_8": 1, "xrpo/sharpened_fraction": 0.1}})
    assert "experience/bucket_7 (group_size 8)" in msg and "novelty_sharpening is off" in msg


def test_other_algorithm_classes_may_report_their_own_metrics():
    assert preflight.metric_problem("my_own_metric", object, None, "stop") is None
    assert "'training_iteration'" in preflight.metric_problem("training_iteraton", object, None, "stop")


def test_relative_paths_become_absolute_because_trials_run_in_their_own_folder(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    monkeypatch.chdir(tmp_path)
    (exp,) = build_experiments(
        {
            "ok": {
                "run": "GRPO",
                "config": {
                    "env_config": {"dataset": "data/train.jsonl"},
                    "heldout_dataset": {"grid_search": ["arithmetic", "./data/train.jsonl"]},
                },
            }
        }
    )
    assert exp.config.env_config["dataset"] == str(tmp_path / "data" / "train.jsonl")
    assert exp.config.heldout_dataset == {"grid_search": ["arithmetic", str(tmp_path / "data" / "train.jsonl")]}
    assert any("trials run in their own folder" in n for n in exp.notes)
    # a file that does not parse is named with its problem
    (tmp_path / "data" / "bad.jsonl").write_text('{"question": "no answer"}\n')
    msg = _build_error({"run": "GRPO", "config": {"env_config": {"dataset": "data/bad.jsonl"}}})
    assert "config.env_config.dataset:" in msg and "missing answer field" in msg


def test_no_gpu_check_when_joining_a_cluster(monkeypatch):
    import ray

    if ray.is_initialized():
        pytest.skip("a running Ray cluster is what preflight checks against")
    spec = {"run": "GRPO", "config": {"num_learners": 1, "num_gpus_per_learner": 1}}
    (exp,) = build_experiments({"ok": spec}, ray_address="ray://somewhere:10001")
    assert exp.config.num_gpus_per_learner == 1
    monkeypatch.setenv("RAY_ADDRESS", "somewhere:6379")
    build_experiments({"ok": spec})
    monkeypatch.delenv("RAY_ADDRESS")
    build_experiments({"ok": spec}, ray_num_gpus=1)


def _log_value_names(path: Path, module) -> set:
    """The literal names of ``log_value`` calls in a module's source (a tuple key joined by
    "/"; module constants resolved; calls whose key is computed are left out)."""

    def const(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and isinstance(getattr(module, node.id, None), (str, tuple)):
            value = getattr(module, node.id)
            return "/".join(value) if isinstance(value, tuple) else value
        return None

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "log_value" and node.args:
            parts = node.args[0].elts if isinstance(node.args[0], ast.Tuple) else [node.args[0]]
            values = [const(p) for p in parts]
            if all(values):
                names.add("/".join(values))
    return names


def test_project_result_keys_cover_what_the_code_logs():
    """Every literal metric name a ``log_value`` call of the package logs is a known result key
    (a renamed metric must not make a valid stop key an error): the env runner's under
    ``env_runners/``, a learner's under ``learners/<module>/`` (any module id), the algorithm's
    as written."""
    import importlib

    from rllib_exgrpo.rllib import algorithm

    keys = set(preflight.project_result_keys())
    learner_keys = {k.split("/", 2)[2] for k in keys if k.startswith("learners/default_policy/")}
    runner_side = ("env_runner.py", "colocation.py")
    checked = 0
    for path in sorted((REPO / "rllib_exgrpo").rglob("*.py")):
        module = importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
        for name in _log_value_names(path, module):
            checked += 1
            if path.name in ("learner.py", "deepspeed_learner.py"):
                assert name.split("/", 1)[-1] in learner_keys, (path.name, name)
            elif path.name in runner_side:
                assert f"env_runners/{name}" in keys, (path.name, name)
            else:
                assert name in keys, (path.name, name)
    assert checked > 30
    for stage in algorithm.STAGES:
        assert f"timers/{stage}" in keys and f"{algorithm.STEP_TIMES}/{stage}" in keys


def test_every_declared_metric_name_is_logged_where_it_is_declared():
    """The declarations :func:`preflight.project_result_keys` reads sit beside the code that
    logs or produces each name: every declared name is written in its module (as a string, a
    module constant, or a key composed there), so a metric that is no longer logged cannot stay
    declared."""
    from rllib_exgrpo.core import losses
    from rllib_exgrpo.exgrpo import experience
    from rllib_exgrpo.rllib import algorithm, colocation, env_runner, heldout, learner, rollouts
    from rllib_exgrpo.xrpo import steps

    def strings(module) -> str:
        return Path(module.__file__).read_text()

    declared = [
        (losses, losses.LOSS_METRICS),
        (env_runner, env_runner.ENV_RUNNER_METRICS[4:]),
        (colocation, colocation.COLOCATION_METRICS),
        (heldout, heldout.HELDOUT_METRICS),
        (rollouts, rollouts.ROLLOUT_METRICS),
        (experience, experience.POOL_METRICS),
        (experience, experience.REPLAY_CHOICE_METRICS),
        (experience, experience.OBSERVE_METRICS[:2]),
        (steps, steps.SEEDING_METRICS + steps.SHARPENING_METRICS),
        (algorithm, algorithm.WEIGHT_SYNC_METRICS),
        (algorithm, [m for m in algorithm.TOP_LEVEL_METRICS if m not in rollouts.ROLLOUT_METRICS]),
        (learner, [m for m in learner.LEARNER_METRICS if m not in losses.LOSS_METRICS]),
    ]
    for module, names in declared:
        text = strings(module)
        for name in names:  # once in the declaration, at least once where it is logged or produced
            assert text.count(f'"{name}"') >= 2, f"{module.__name__}: {name!r} is declared but not logged there"
    # composed keys: one pool_<outcome> per outcome of an update, one statistic per planner stat
    assert "pool_{k}" in strings(experience) and "completions_per_question_" in strings(steps)


def test_dry_run_summary_shows_notes(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    from rllib_exgrpo.cli import main as cli

    f = tmp_path / "hub.yaml"
    f.write_text(
        textwrap.dedent("""\
        hub:
          run: GRPO
          config: {model_name_or_path: no-such-org/no-such-model-preflight}
    """)
    )
    assert cli.main(["train", "file", str(f), "--dry-run", "--storage-path", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "note:" in out and "not in the local Hugging Face cache" in out
