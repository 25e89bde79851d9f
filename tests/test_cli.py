"""The ``rllib`` command: parsing, validation before Ray starts, and one real Tune run.

Fast tests use RLlib's built-in PPO (this project's algorithms are resolved lazily and
need not exist). The end-to-end test runs ``python -m rllib_exgrpo.cli.main`` in a
subprocess with a private local Ray (Ray's token authentication on, as by default),
results and MLflow store under ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rllib_exgrpo.cli import main as cli
from rllib_exgrpo.cli.registry import ALGORITHM, CliConfigError, register_algorithm, resolve_algorithm, resolve_env
from rllib_exgrpo.cli.experiment import build_experiments
from rllib_exgrpo.cli.experiment_file import convert_search_spaces, deep_merge, load_experiment_file

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def _ppo(config=None, **spec):
    spec.setdefault("run", "PPO")
    spec.setdefault("env", "CartPole-v1")
    spec["config"] = {"num_env_runners": 0, **(config or {})}
    return {"exp": spec}


# ----------------------------------------------------------------- command line


def test_help_of_module_and_console_script():
    out = subprocess.run(
        [sys.executable, "-m", "rllib_exgrpo.cli.main", "--help"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
        check=True,
    ).stdout
    assert "train" in out and "usage: rllib" in out
    out = subprocess.run(
        [sys.executable, "-m", "rllib_exgrpo.cli.main", "train", "--help"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
        check=True,
    ).stdout
    for flag in (
        "--stop",
        "--config",
        "--storage-path",
        "--num-samples",
        "--experiment-name",
        "--mlflow-uri",
        "-f FILE",
        "{file}",
        "grid_search",
        "RAY_AUTH_MODE",
        "--dry-run",
    ):
        assert flag in out, flag
    script = Path(sys.executable).with_name("rllib")
    if script.exists():  # installed with `pip install -e .`
        out = subprocess.run(
            [str(script), "train", "file", "--help"], capture_output=True, text=True, env=_env(), timeout=60, check=True
        ).stdout
        assert "experiment YAML file" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "file", "x.yaml", "--stop", '{"training_iteration": 2}', "--config", '{"lr": 0.1}', "-v"],
        ["train", "-f", "x.yaml", "--stop", '{"training_iteration": 2}', "--config", '{"lr": 0.1}', "-v"],
        ["train", "--stop", '{"training_iteration": 2}', "-v", "file", "x.yaml", "--config", '{"lr": 0.1}'],
    ],
)
def test_train_file_and_dash_f_spellings_parse_alike(argv):
    args = cli.build_parser().parse_args(argv)
    assert args.func is cli.run_train
    assert args.config_file == "x.yaml"
    assert args.stop == {"training_iteration": 2}
    assert args.config == {"lr": 0.1}
    assert args.verbose == 1


def test_bad_json_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["train", "file", "x.yaml", "--stop", "{not json"])
    assert e.value.code == 2
    assert "--stop" in capsys.readouterr().err


def test_misspelled_key_fails_before_ray_with_suggestion(tmp_path, capsys):
    was_up = _ray_initialized()
    with pytest.raises(CliConfigError) as e:
        build_experiments(_ppo({"num_env_runner": 0, "trian_batch_size_per_learner": 64}))
    msg = str(e.value)
    assert "'num_env_runner'" in msg and "'num_env_runners'" in msg
    assert "'trian_batch_size_per_learner'" in msg and "'train_batch_size_per_learner'" in msg

    # The same through the command: exit code 2, nothing started.
    f = tmp_path / "typo.yaml"
    f.write_text("typo:\n  run: PPO\n  env: CartPole-v1\n  config:\n    lerning_rate: 0.1\n    lr_schedual: null\n")
    assert cli.main(["train", "file", str(f), "--storage-path", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "'lr_schedual'" in err and "'lr_schedule'" in err and "'lerning_rate'" in err
    assert not (tmp_path / "r").exists()
    assert _ray_initialized() == was_up


def test_config_override_is_checked_too():
    with pytest.raises(CliConfigError, match="'gama'.*'gamma'"):
        build_experiments(_ppo(), config_overrides={"gama": 0.9})


def test_unknown_run_lists_known_names():
    with pytest.raises(CliConfigError) as e:
        build_experiments(_ppo(run="PP0"))
    msg = str(e.value)
    for name in ("ExGRPO", "GRPO", "PPO", "APPO", "IMPALA"):
        assert name in msg
    assert "Did you mean: PPO" in msg


def test_run_resolution_orders():
    from ray.rllib.algorithms.ppo import PPO

    assert resolve_algorithm("PPO") is PPO
    assert resolve_algorithm("ray.rllib.algorithms.ppo:PPO") is PPO
    assert resolve_algorithm("ray.rllib.algorithms.ppo.PPO") is PPO
    assert ALGORITHM.get("ExGRPO").target == "rllib_exgrpo.rllib.algorithm:ExGRPO"
    with pytest.raises(CliConfigError, match="not a subclass"):
        resolve_algorithm("collections:OrderedDict")
    with pytest.raises(CliConfigError, match="could not be imported"):
        resolve_algorithm("no_such_pkg.mod:Algo")


def test_project_registry_is_lazy_and_reports_import_errors():
    register_algorithm("Broken", "rllib_exgrpo.no_such_module:Broken")
    register_algorithm("MyPPO", "ray.rllib.algorithms.ppo:PPO")
    try:
        with pytest.raises(CliConfigError, match="Broken.*could not be imported.*no_such_module"):
            resolve_algorithm("Broken")
        (exp,) = build_experiments(_ppo(run="MyPPO"))
        assert exp.algo_cls.__name__ == "PPO"
    finally:
        ALGORITHM.unregister("Broken")
        ALGORITHM.unregister("MyPPO")


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "config, needle",
    [
        ({"enable_rl_module_and_learner": False}, "new API stack only"),
        ({"enable_env_runner_and_connector_v2": False}, "new API stack only"),
        ({"framework": "tf2"}, "only 'torch'"),
        ({"monitor": True}, "deprecated"),
        ({"num_rollout_workers": 2}, "num_env_runners"),
        ({"training": {"lr": 0.1}}, "is a method"),
        ({"total_train_batch_size": 5}, "read-only"),
        ({"multiagent": {"polices": {}}}, "'multiagent/polices'"),
        ({"minibatch_size": 100000}, "must be <= `train_batch_size_per_learner`"),
    ],
)
def test_config_errors(config, needle):
    with pytest.raises(CliConfigError) as e:
        build_experiments(_ppo(config))
    assert needle in str(e.value)


def test_legacy_aliases_and_subdicts_are_accepted():
    (exp,) = build_experiments(
        _ppo(
            {
                "lambda": 0.9,  # -> lambda_
                "num_workers": 0,  # -> num_env_runners
                "callbacks": "ray.rllib.callbacks.callbacks:RLlibCallback",
                "model_config": {"fcnet_hiddens": [16], "anything": 1},  # not key-checked
                "env_config": {"free": {"form": True}},
                "learner_config_dict": {"whatever": 1},
                "evaluation_interval": 2,
            }
        )
    )
    c = exp.config
    assert c.lambda_ == 0.9 and c.num_env_runners == 0 and c.evaluation_interval == 2
    assert c.model_config["fcnet_hiddens"] == [16]
    assert c.env_config == {"free": {"form": True}}
    assert c.callbacks_class.__name__ == "RLlibCallback"


@pytest.mark.parametrize(
    "spec, needle",
    [
        ({"local_dir": "/tmp"}, "renamed `storage_path`"),
        ({"stopp": {}}, "unknown key `stopp`. Did you mean: 'stop'"),
        ({"stop": {"episode_reward_mean": 100}}, "env_runners/episode_return_mean"),
        ({"stop": {"training_iteration": "two"}}, "must be a number"),
        ({"num_samples": 0}, "positive integer"),
        ({"checkpoint_config": {"checkpoint_freq": 1}}, "'checkpoint_frequency'"),
        ({"mlflow": {"tracking_url": "x"}}, "'tracking_uri'"),
        ({"env": "CartPol-v1"}, "Did you mean: CartPole-v1"),
    ],
)
def test_experiment_level_errors(spec, needle):
    with pytest.raises(CliConfigError) as e:
        build_experiments(_ppo(**spec))
    assert needle in str(e.value)


def test_yaml_floats_and_duplicate_keys(tmp_path):
    f = tmp_path / "a.yaml"
    f.write_text("a:\n  run: PPO\n  config:\n    lr: 1e-3\n    gamma: 9.9e-1\n")
    assert load_experiment_file(f)["a"]["config"] == {"lr": 0.001, "gamma": 0.99}
    f.write_text("a:\n  run: PPO\n  config:\n    lr: 1\n    lr: 2\n")
    with pytest.raises(CliConfigError, match="duplicate key 'lr'"):
        load_experiment_file(f)


# --------------------------------------------------------------- search spaces


def test_search_space_conversion():
    from ray.tune.search.sample import Categorical, Float, Integer

    conv, found = convert_search_spaces(
        {
            "lr": {"grid_search": [1e-4, 1e-3]},
            "gamma": {"choice": [0.9, 0.99]},
            "env_config": {
                "a": {"uniform": [0, 1]},
                "b": {"loguniform": [1e-5, 1e-2]},
                "c": {"randint": [1, 10]},
                "d": {"x": 1},
                "e": [{"grid_search": [1]}],
            },
        }
    )
    assert conv["lr"] == {"grid_search": [1e-4, 1e-3]}
    assert isinstance(conv["gamma"], Categorical)
    assert isinstance(conv["env_config"]["a"], Float) and isinstance(conv["env_config"]["b"], Float)
    assert isinstance(conv["env_config"]["c"], Integer)
    assert conv["env_config"]["d"] == {"x": 1}
    assert conv["env_config"]["e"] == [{"grid_search": [1]}]  # lists are literal
    assert set(found) == {"config/lr", "config/gamma", "config/env_config/a", "config/env_config/b", "config/env_config/c"}
    for bad, needle in [
        ({"uniform": [1]}, "2 numbers"),
        ({"uniform": [2, 1]}, "lower < upper"),
        ({"loguniform": [0, 1]}, "positive lower"),
        ({"grid_search": []}, "non-empty"),
        ({"randint": [0.5, 3]}, "integers"),
    ]:
        with pytest.raises(CliConfigError, match=needle):
            convert_search_spaces({"x": bad})


def test_search_spaces_in_experiment_are_key_checked_and_validated():
    (exp,) = build_experiments(
        _ppo(
            {
                "lr": {"grid_search": [1e-4, 1e-3]},
                "env_config": {"seed_offset": {"choice": [0, 1]}},
            }
        ),
        num_samples=2,
    )
    assert exp.num_trials == 4
    assert set(exp.search_space) == {"config/lr", "config/env_config/seed_offset"}
    space = exp.param_space
    assert space["lr"] == {"grid_search": [1e-4, 1e-3]}
    assert type(space["env_config"]["seed_offset"]).__name__ == "Categorical"

    with pytest.raises(CliConfigError, match="'lrr'.*'lr'"):
        build_experiments(_ppo({"lrr": {"grid_search": [1e-4]}}))
    # Every grid variant goes through AlgorithmConfig.validate() before Ray starts.
    with pytest.raises(CliConfigError, match="variant minibatch_size=9999"):
        build_experiments(_ppo({"minibatch_size": {"grid_search": [32, 9999]}}))


def test_stop_and_config_overrides_merge():
    spec = _ppo(
        {"lr": {"grid_search": [1e-4, 1e-3]}, "gamma": 0.9, "env_config": {"a": 1, "b": {"c": 2}}},
        stop={"training_iteration": 5, "time_total_s": 60},
    )
    (exp,) = build_experiments(
        spec,
        stop={"training_iteration": 2},
        config_overrides={"lr": 0.01, "env_config": {"b": {"d": 3}}},
        storage_path="rel/results",
        num_samples=3,
    )
    assert exp.stop == {"training_iteration": 2, "time_total_s": 60}
    assert exp.config.lr == 0.01 and exp.config.gamma == 0.9
    assert exp.config.env_config == {"a": 1, "b": {"c": 2, "d": 3}}
    assert exp.search_space == {}
    assert exp.num_samples == 3
    assert exp.storage_path == os.path.abspath("rel/results")
    assert deep_merge({"a": {"grid_search": [1]}}, {"a": {"x": 1}}) == {"a": {"x": 1}}


def test_storage_checkpoint_mlflow_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (exp,) = build_experiments(_ppo(checkpoint_freq=3, checkpoint_at_end=True, checkpoint_config={"num_to_keep": 2}, mlflow={}))
    assert exp.storage_path == str(tmp_path / "results")
    ck = exp.checkpoint_config
    assert (ck.checkpoint_frequency, ck.checkpoint_at_end, ck.num_to_keep) == (3, True, 2)
    assert exp.mlflow == {"tracking_uri": f"sqlite:///{tmp_path}/results/mlflow.db", "experiment_name": "exp"}
    assert [type(cb).__name__ for cb in exp.callbacks] == ["BatchedMLflowLoggerCallback"]
    (exp,) = build_experiments(_ppo(), mlflow_uri="sqlite:///x.db", experiment_name="renamed")
    assert exp.name == "renamed" and exp.mlflow["tracking_uri"] == "sqlite:///x.db"
    assert exp.mlflow["experiment_name"] == "renamed"
    with pytest.raises(CliConfigError, match="exactly one|holds 2"):
        build_experiments({"a": _ppo()["exp"], "b": _ppo()["exp"]}, experiment_name="x")


def test_several_experiments_keep_file_order(tmp_path):
    f = tmp_path / "two.yaml"
    f.write_text(
        textwrap.dedent("""\
        second: {run: PPO, env: CartPole-v1, config: {num_env_runners: 0}}
        first: {run: PPO, env: CartPole-v1, config: {num_env_runners: 0}}
    """)
    )
    assert [e.name for e in build_experiments(f)] == ["second", "first"]


# ------------------------------------------------------------------------ envs


def test_dotted_env_path_is_imported_and_registered():
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv
    from ray.tune.registry import ENV_CREATOR, _global_registry

    for path in ("gymnasium.envs.classic_control.cartpole:CartPoleEnv", "gymnasium.envs.classic_control.cartpole.CartPoleEnv"):
        (exp,) = build_experiments(_ppo(env=path, config={"env_config": {}}))
        assert exp.config.env == path
        assert _global_registry.contains(ENV_CREATOR, path)
        env = _global_registry.get(ENV_CREATOR, path)({})
        assert isinstance(env, CartPoleEnv)
    # config.env works as well as the top-level key, and gym ids pass through as is.
    (exp,) = build_experiments({"e": {"run": "PPO", "config": {"env": "CartPole-v1"}}})
    assert exp.config.env == "CartPole-v1"
    assert resolve_env("CartPole-v1") == "CartPole-v1"
    # gymnasium's own "module:EnvId-v0" syntax is left to gymnasium.
    assert resolve_env("gymnasium.envs.classic_control:CartPole-v1") == "gymnasium.envs.classic_control:CartPole-v1"
    (exp,) = build_experiments(_ppo(), env="Pendulum-v1")  # --env overrides the file
    assert exp.config.env == "Pendulum-v1"
    with pytest.raises(CliConfigError, match="could not be imported"):
        resolve_env("no_such_pkg.envs:Env")
    with pytest.raises(CliConfigError, match="disagree"):
        build_experiments({"e": {"run": "PPO", "env": "CartPole-v1", "config": {"env": "Pendulum-v1"}}})


def test_builtin_env_name_and_the_old_top_level_path():
    """``env: ReasoningEnv`` is a built-in name (the env runner builds it without Tune's
    registry); a path under the old top-level ``envs`` package fails in one line naming
    what to write, in the CLI and in ``import_object`` (reward functions)."""
    from rllib_exgrpo.envs.reasoning_env import ReasoningEnv
    from rllib_exgrpo.rllib.env_creator import env_creator, import_object

    assert resolve_env("ReasoningEnv") == "ReasoningEnv"
    assert env_creator("ReasoningEnv") is ReasoningEnv
    with pytest.raises(CliConfigError) as e:
        resolve_env("envs.reasoning_env:ReasoningEnv")
    assert str(e.value) == (
        "env: 'envs.reasoning_env:ReasoningEnv' moved into the package: write "
        "'ReasoningEnv' (or 'rllib_exgrpo.envs.reasoning_env:ReasoningEnv')."
    )
    with pytest.raises(
        ImportError,
        match="^'envs.reward_examples:exact_match' moved into the package: write 'rllib_exgrpo.envs.reward_examples:exact_match'$",
    ):
        import_object("envs.reward_examples:exact_match")
    assert import_object("rllib_exgrpo.envs.reward_examples:exact_match").__name__ == "exact_match"


def test_dry_run_prints_and_starts_nothing(tmp_path, capsys):
    f = tmp_path / "x.yaml"
    f.write_text("x:\n  run: PPO\n  env: CartPole-v1\n  config:\n    lr: {grid_search: [0.1, 0.2]}\n")
    was_up = _ray_initialized()
    assert cli.main(["train", "-f", str(f), "--dry-run", "--storage-path", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "trials: 2" in out and "grid_search([0.1, 0.2])" in out and "nothing started" in out
    assert not (tmp_path / "r").exists()
    assert _ray_initialized() == was_up


# ------------------------------------------------------------------ end to end


E2E_YAML = """\
ppo-grid:
  run: PPO
  env: CartPole-v1
  stop: {{training_iteration: 5}}
  mlflow:
    tracking_uri: "sqlite:///{db}"
  config:
    num_env_runners: 0
    lr: {{grid_search: [1.0e-4, 1e-3]}}
    train_batch_size_per_learner: 128
    minibatch_size: 64
    num_epochs: 1
    model_config: {{fcnet_hiddens: [16]}}
ppo-broken:
  run: PPO
  env: CartPole-v1
  mlflow:
    tracking_uri: "sqlite:///{db}"
  config:
    num_env_runners: 0
    env_config: {{no_such_cartpole_kwarg: 1}}
"""


@pytest.mark.slow
def test_end_to_end_ppo_grid_with_mlflow(tmp_path):
    """Two PPO trials (grid over lr) for one iteration each, logged to MLflow; then a
    second experiment whose trial dies in setup: the command exits 1 and names the
    trial's error file, and the first experiment's results stay intact."""
    db = tmp_path / "mlflow.db"
    f = tmp_path / "ppo.yaml"
    f.write_text(E2E_YAML.format(db=db))
    storage = tmp_path / "results"
    t0 = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rllib_exgrpo.cli.main",
            "train",
            "file",
            str(f),
            "--stop",
            json.dumps({"training_iteration": 1}),
            "--storage-path",
            str(storage),
            "--ray-num-cpus",
            "2",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    elapsed = time.time() - t0
    print(f"e2e wall time: {elapsed:.1f} s")
    log = proc.stdout[-4000:] + "\n--- stderr ---\n" + proc.stderr[-8000:]
    assert proc.returncode == 1, log

    # ppo-grid: two trials, one iteration each.
    assert "experiment 'ppo-grid': all trials finished" in proc.stdout, log
    trials = sorted(p for p in (storage / "ppo-grid").iterdir() if p.is_dir() and p.name.startswith("PPO_"))
    assert len(trials) == 2, log
    for t in trials:
        rows = [json.loads(line) for line in (t / "result.json").read_text().splitlines() if line.strip()]
        assert rows[-1]["training_iteration"] == 1

    # ppo-broken: errored, error file named and present.
    assert "experiment 'ppo-broken': trial" in proc.stderr and "error.txt" in proc.stderr, log
    err_file = proc.stderr.split("error file: ")[-1].strip().splitlines()[0]
    assert Path(err_file).is_file() and "no_such_cartpole_kwarg" in Path(err_file).read_text()

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name("ppo-grid")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 2
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert sorted(float(r.data.params["lr"]) for r in runs) == [1e-4, 1e-3]
    for r in runs:
        assert r.data.metrics["training_iteration"] == 1
        assert "env_runners/episode_return_mean" in r.data.metrics


def _train_exgrpo_tiny_from_cli(folder: Path, overrides: dict, db: Path):
    """One iteration per trial of tuned_examples/exgrpo_tiny.yaml through ``rllib train file`` in a
    subprocess run in ``folder`` (results under ``folder/results``), logged to MLflow in
    ``db``; returns the finished process."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rllib_exgrpo.cli.main",
            "train",
            "file",
            str(REPO / "tuned_examples" / "exgrpo_tiny.yaml"),
            "--stop",
            json.dumps({"training_iteration": 1}),
            "--config",
            json.dumps(overrides),
            "--storage-path",
            str(folder / "results"),
            "--mlflow-uri",
            f"sqlite:///{db}",
            "--ray-num-cpus",
            "2",
        ],
        cwd=folder,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_main_job_yaml_grid_over_two_learning_rates(tmp_path, quick_tiny_model):
    """The embedded default's own file (tuned_examples/exgrpo_tiny.yaml) through the
    command with a grid over two learning rates: two ExGRPO trials, one iteration each,
    both logged to MLflow with their lr. Small batch and the quick model keep it short."""
    db = tmp_path / "mlflow.db"
    overrides = {
        "model_name_or_path": quick_tiny_model,
        "questions_per_step": 4,
        "group_size": 4,
        "minibatch_size": 16,
        "max_response_tokens": 16,
        "heldout_num_questions": 8,
        "lr": {"grid_search": [1e-4, 3e-4]},
    }
    proc = _train_exgrpo_tiny_from_cli(tmp_path, overrides, db)
    log = proc.stdout[-4000:] + "\n--- stderr ---\n" + proc.stderr[-6000:]
    assert proc.returncode == 0, log
    trials = sorted(p for p in (tmp_path / "results" / "exgrpo-tiny").iterdir() if p.is_dir() and p.name.startswith("ExGRPO_"))
    assert len(trials) == 2, log
    lrs = []
    for t in trials:
        rows = [json.loads(line) for line in (t / "result.json").read_text().splitlines() if line.strip()]
        assert rows[-1]["training_iteration"] == 1
        # the starting point, logged with the iteration it belongs to (0) and kept as initial
        assert rows[-1]["heldout"]["after_iteration"] == 0
        assert rows[-1]["heldout"]["initial_accuracy"] == rows[-1]["heldout"]["accuracy"]
        lrs.append(json.loads((t / "params.json").read_text())["lr"])
    assert sorted(lrs) == [1e-4, 3e-4]

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("exgrpo-tiny").experiment_id])
    assert sorted(float(r.data.params["lr"]) for r in runs) == [1e-4, 3e-4]
    for r in runs:  # held-out accuracy only where it was measured: the starting point
        history = client.get_metric_history(r.info.run_id, "heldout/accuracy")
        assert [m.step for m in history] == [0], history
    # one console line per iteration instead of Tune's tables
    assert proc.stdout.count(" iter    1  reward ") == 2, log
    assert "Trial status:" not in proc.stdout, log


def test_gpus_the_machine_lacks_fail_in_one_line_before_anything_starts(capsys):
    from rllib_exgrpo.cli.main import main

    rc = main(
        [
            "train",
            "file",
            str(REPO / "tuned_examples" / "grpo_tiny.yaml"),
            "--dry-run",
            "--config",
            json.dumps({"num_env_runners": 2, "num_gpus_per_env_runner": 1}),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "grpo_tiny.yaml" in err[0] and "num_gpus_per_env_runner" in err[0] and "cluster has 0" in err[0]


@pytest.mark.slow
def test_two_env_runners_on_two_cores_train_instead_of_pending(tmp_path, quick_tiny_model):
    """The README's own example (num_env_runners: 2) on a 2-CPU Ray: 3 CPUs asked, the
    request is shared out (stated on stderr) and the trial trains; it used to wait in
    PENDING forever."""
    overrides = {
        "model_name_or_path": quick_tiny_model,
        "num_env_runners": 2,
        "questions_per_step": 4,
        "group_size": 4,
        "minibatch_size": 16,
        "max_response_tokens": 8,
        "heldout_dataset": None,
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rllib_exgrpo.cli.main",
            "train",
            "file",
            str(REPO / "tuned_examples" / "grpo_tiny.yaml"),
            "--stop",
            json.dumps({"training_iteration": 1}),
            "--config",
            json.dumps(overrides),
            "--storage-path",
            str(tmp_path / "results"),
            "--ray-num-cpus",
            "2",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout[-3000:] + "\n--- stderr ---\n" + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert "asks for 3 CPUs" in proc.stderr and "0.66 CPU" in proc.stderr, log
    (result,) = (tmp_path / "results" / "grpo-tiny").glob("*/result.json")
    row = json.loads(result.read_text().splitlines()[-1])
    assert row["training_iteration"] == 1 and row["num_completions"] == 16


def test_heldout_is_reported_once_per_evaluation():
    from rllib_exgrpo.cli.mlflow_logging import new_heldout_step

    seen = {}
    results = [{"heldout": {"after_iteration": a}} for a in (0, 0, 0, 10, 10, 20)] + [{}]
    assert [new_heldout_step(seen, "t", r) for r in results] == [0, None, None, 10, None, 20, None]
    assert new_heldout_step(seen, "other trial", {"heldout": {"after_iteration": 20}}) == 20
