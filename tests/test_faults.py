"""Fault injection: each fault injected for real, each test asserting nothing was lost.

Run alone with ``pytest -m faults``; the run ends with the line
``faults injected: N, survived: N, data lost: 0`` (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RLLIB = [sys.executable, "-m", "rllib_exgrpo.cli.main"]

pytestmark = pytest.mark.faults

RESUME_YAML = """
resume-check:
  run: ExGRPO
  env: rllib_exgrpo.envs.reasoning_env:ReasoningEnv
  stop:
    training_iteration: 5
  checkpoint_config:
    checkpoint_frequency: 2
  config:
    seed: 3
    env_config:
      dataset: arithmetic
    model_name_or_path: tiny
    questions_per_step: 32
    group_size: 8
    max_prompt_tokens: 128
    max_response_tokens: 48
    behaviour_logprobs: engine
    lr: 0.0003
    minibatch_size: 128
    loss_agg_mode: token-mean
    entropy_coeff: 0.0
    delayed_start_solve_rate: 0.0
    fill_pool_before_start: true
    num_env_runners: 0
    callbacks: fault_callbacks:PauseForKill
"""


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.pop("EXGRPO_FAULT_PAUSE_MARKER", None)
    # tests/ for fault_callbacks.py, which the experiment file names
    paths = (str(REPO), str(REPO / "tests"), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.update(extra)
    return env


def _train(yaml_file: Path, storage: Path, *extra: str, env: dict | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        RLLIB + ["train", "file", str(yaml_file), "--storage-path", str(storage), *extra],
        cwd=REPO,
        env=_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def _rows(storage: Path) -> dict:
    """Last result row per training iteration of the experiment's single trial."""
    files = list((storage / "resume-check").glob("*/result.json"))
    assert len(files) == 1, files
    rows = {}
    for line in files[0].read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["training_iteration"]] = row
    return rows


def _fingerprint(row: dict) -> dict:
    """What must be equal between an uninterrupted and a resumed run at one iteration."""
    runners, learner = row["env_runners"], row["learners"]["default_policy"]
    return {
        "reward": runners["episode_return_mean"],
        "tokens": runners["num_response_tokens"],
        "sampled_lifetime": runners["num_env_steps_sampled_lifetime"],
        "policy_loss": learner["policy_loss"],
        "experience": {k: v for k, v in row["experience"].items() if not k.endswith("_s")},
    }


@pytest.fixture(scope="module")
def tiny_model() -> str:
    """The embedded tiny model (a few minutes to build on first use, then cached): it
    solves about a third of the questions, so the experience pool fills and replays."""
    from rllib_exgrpo.models import resolve_model_path

    return resolve_model_path("tiny", progress=False)


@pytest.mark.slow
def test_sigkill_then_resume_continues_exactly(tmp_path, tiny_model, fault_log):
    """SIGKILL of the whole `rllib train` process group once iteration 3 is reported
    (checkpoints every 2), a half-written newer checkpoint folder left behind, then
    `--resume`: iterations 3 to 5 equal an uninterrupted run's exactly (rewards,
    sampled tokens, counters, loss, experience-pool metrics), so the model, optimiser,
    pool, sampler position, delayed-start state and RNG streams came back."""
    yaml_file = tmp_path / "resume.yaml"
    yaml_file.write_text(RESUME_YAML)

    ref = _train(yaml_file, tmp_path / "uninterrupted")
    out, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, out[-3000:]
    expected = _rows(tmp_path / "uninterrupted")

    # The killed run holds still after iteration 3 (fault_callbacks.PauseForKill): the
    # kill lands at the same point on a slow or a fast machine.
    killed, marker = tmp_path / "killed", tmp_path / "paused-after-3"
    proc = _train(yaml_file, killed, env={"EXGRPO_FAULT_PAUSE_MARKER": str(marker)}, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and not marker.exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    assert marker.exists(), "the run never reached iteration 3"
    time.sleep(5)  # let Tune's driver record the iteration-2 checkpoint in its state
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    done = max(_rows(killed), default=0)
    assert done <= 3, "killed too late to test anything"
    # A checkpoint being written when the process died: a newer, half-written folder.
    trial = next((killed / "resume-check").glob("ExGRPO_*"))
    partial = trial / "checkpoint_000009"
    (partial / "learner_group").mkdir(parents=True)
    (partial / "rllib_checkpoint.json").write_text('{"type": "Algorithm", "checkpoint_vers')

    resumed = _train(yaml_file, killed, "--resume")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    assert "--resume: experiment 'resume-check' continues from" in out
    got = _rows(killed)
    for it in range(3, 6):  # from the last checkpoint before the kill to the end
        assert _fingerprint(got[it]) == _fingerprint(expected[it]), f"iteration {it} differs after resume"
    fault_log(survived=True, lost=0)  # the SIGKILL
    fault_log(survived=True, lost=0)  # the half-written checkpoint (Tune restores the last registered one)


def test_resume_with_nothing_saved_starts_fresh(tmp_path, tiny_model, fault_log):
    yaml_file = tmp_path / "resume.yaml"
    assert "training_iteration: 5" in RESUME_YAML
    yaml_file.write_text(RESUME_YAML.replace("training_iteration: 5", "training_iteration: 1"))
    proc = _train(yaml_file, tmp_path / "fresh", "--resume")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert "nothing saved in" in out and 1 in _rows(tmp_path / "fresh")
    fault_log(survived=True, lost=0)


# --- a remote env runner killed mid-sample ------------------------------------------------
#: Set by the test before the runners are built (the class travels to them by value).
KILL_MARKER = ""


def _kill_once_runner_cls():
    from rllib_exgrpo.rllib.env_runner import LLMEnvRunner

    class KillOnceRunner(LLMEnvRunner):
        """Runner 1 kills its own actor (``ray.kill``) in the middle of its first sample()."""

        def sample(self, **kwargs):
            if self.worker_index == 1 and kwargs.get("question_ids") and not os.path.exists(KILL_MARKER):
                import ray

                open(KILL_MARKER, "w").close()
                ray.kill(ray.get_runtime_context().current_actor, no_restart=False)
                time.sleep(60)  # never returns: the kill lands first
            return super().sample(**kwargs)

    return KillOnceRunner


@pytest.mark.slow
def test_runner_killed_mid_sample_is_restarted_and_its_questions_sampled_again(ray_local, quick_tiny_model, tmp_path, fault_log):
    from ray import cloudpickle

    from rllib_exgrpo import ExGRPOConfig

    global KILL_MARKER
    KILL_MARKER = str(tmp_path / "killed-once")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = (
        ExGRPOConfig()
        .environment(env_config={"dataset": "arithmetic"})
        .env_runners(num_env_runners=2, num_cpus_per_env_runner=0.5, env_runner_cls=_kill_once_runner_cls())
        .training(
            model_name_or_path=quick_tiny_model,
            questions_per_step=4,
            group_size=4,
            max_prompt_tokens=128,
            max_response_tokens=12,
            lr=1e-3,
            minibatch_size=16,
            loss_agg_mode="token-mean",
        )
    )
    algo = cfg.build_algo()
    try:
        result = algo.train()
        assert os.path.exists(KILL_MARKER), "the fault was not injected"
        # every question sampled exactly once with its whole group: nothing lost, nothing twice
        assert result["num_completions"] == 4 * 4
        assert result["env_runner_failures"] == 1 and result["resampled_questions"] == 2
        again = algo.train()
        assert again["num_completions"] == 16 and again["env_runner_failures"] == 0
        deadline = time.time() + 120  # the restarted actor loads its model again first
        while len(algo.env_runner_group.healthy_worker_ids()) < 2 and time.time() < deadline:
            algo.restore_env_runners(algo.env_runner_group)
            time.sleep(1)
        assert len(algo.env_runner_group.healthy_worker_ids()) == 2  # the killed one came back
        assert algo.train()["num_completions"] == 16
    finally:
        algo.stop()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    fault_log(survived=True, lost=0)


@pytest.mark.slow
def test_dead_learner_ends_the_run_with_a_clear_message(ray_local, quick_tiny_model, fault_log):
    import ray

    from rllib_exgrpo import ExGRPOConfig
    from rllib_exgrpo.rllib.algorithm import LearnerDiedError

    cfg = (
        ExGRPOConfig()
        .environment(env_config={"dataset": "arithmetic"})
        .learners(num_learners=2, num_cpus_per_learner=0.5)
        .training(
            model_name_or_path=quick_tiny_model,
            questions_per_step=4,
            group_size=4,
            max_prompt_tokens=128,
            max_response_tokens=12,
            lr=1e-3,
            minibatch_size=8,
            loss_agg_mode="token-mean",
        )
    )
    algo = cfg.build_algo()
    try:
        algo.train()
        victim = next(iter(algo.learner_group._worker_manager._actors.values()))
        ray.kill(victim, no_restart=True)
        with pytest.raises(LearnerDiedError, match="a learner actor died during iteration 2.*--resume"):
            algo.train()
    finally:
        algo.stop()
    fault_log(survived=True, lost=0)


# --- bad data and a bad verifier inside a training step ----------------------------------
HANG_TRUTH = "9^{9^{9^{9^9}}}"  # sympy evaluates it for ever: the verifier hangs on it


def _write_faulty_data(data: Path) -> None:
    """A jsonl training file of 6 good questions, a broken JSON row (line 3), an empty question
    (line 6) and, last, a question whose verification hangs."""
    rows = [
        json.dumps({"problem": f"What is {a} + {b}?", "answer": str(a + b)})
        for a, b in [(3, 4), (12, 30), (7, 8), (21, 5), (9, 9), (14, 6)]
    ]
    rows.insert(2, '{"problem": "What is 1 + 1?", "answer": ')  # line 3: broken JSON
    rows.insert(5, json.dumps({"problem": "", "answer": "2"}))  # line 6: empty question
    rows.append(json.dumps({"problem": "What is 2 + 2?", "answer": HANG_TRUTH}))
    data.write_text("\n".join(rows) + "\n")


@pytest.mark.slow
def test_malformed_rows_hanging_and_crashing_verifier_do_not_stop_the_step(ray_local, tiny_model, tmp_path, caplog, fault_log):
    """A data file with two malformed rows, a question whose verification hangs, and the
    verifier's worker processes killed while the step scores: the step completes with
    every completion of every good question, the bad rows reported by file and line,
    the hangs scored 0 as timeouts and counted."""
    import logging
    import threading

    from rllib_exgrpo.envs import verifier_pool
    from rllib_exgrpo import ExGRPOConfig

    data = tmp_path / "train.jsonl"
    _write_faulty_data(data)

    cfg = (
        ExGRPOConfig()
        .environment(env_config={"dataset": str(data), "reward_timeout_s": 1.0})
        .training(
            model_name_or_path=tiny_model,
            questions_per_step=7,
            group_size=4,
            max_prompt_tokens=128,
            max_response_tokens=24,
            lr=1e-4,
            minibatch_size=28,
            loss_agg_mode="token-mean",
            experience_replay=False,
        )
    )
    stop = threading.Event()

    def kill_verifier_workers():  # a verifier that crashes mid-step, for real
        while not stop.wait(0.3):
            pool = verifier_pool._POOL
            if pool is not None:
                with pool._lock:
                    for w in list(pool._all):
                        w.proc.kill()
                return

    with caplog.at_level(logging.WARNING, logger="rllib_exgrpo.envs.datasets"):
        algo = cfg.build_algo()
    killer = threading.Thread(target=kill_verifier_workers, daemon=True)
    try:
        killer.start()
        result = algo.train()
    finally:
        stop.set()
        algo.stop()
    warnings = "\n".join(r.getMessage() for r in caplog.records)
    assert f"{data}:3" in warnings and f"{data}:6" in warnings
    assert result["num_completions"] + result["unscored_completions"] == 7 * 4  # none lost
    assert result["env_runners"]["reward_timeouts"] >= 1  # the hanging question, cut at 1 s
    fault_log(survived=True, lost=0)  # malformed rows
    fault_log(survived=True, lost=0)  # hanging verifier
    fault_log(survived=True, lost=0)  # crashing verifier
