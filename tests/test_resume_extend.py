"""`rllib train ... --resume` with a raised `stop`: a finished trial goes on from its latest
checkpoint to the new stop, in its own folder, its history and counters kept; one that
meets the stop, ended early, or has no checkpoint stays finished; one stderr line each."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

RECIPE = """
resume-extend:
  run: ExGRPO
  env: rllib_exgrpo.envs.reasoning_env:ReasoningEnv
  stop:
    training_iteration: 80
  config:
    seed: 0
    env_config:
      dataset: "arithmetic:levels=1-4,n=64"
    model_name_or_path: {model}
    questions_per_step: 4
    group_size: 4
    minibatch_size: 16
    max_prompt_tokens: 128
    max_response_tokens: 16
    behaviour_logprobs: engine
    heldout_dataset: null
    num_env_runners: 0
"""


def _rows(result_json: Path) -> list:
    return [json.loads(line) for line in result_json.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_resume_with_a_raised_stop_continues_a_finished_trial(tmp_path, ray_local, quick_tiny_model, capsys):
    """`--stop 2` with a checkpoint at the end, then `--resume --stop 3`: the same trial
    (one folder, same id) reports iteration 3 once, after iterations 1-2 kept as they
    were, with the algorithm's counters going on from the checkpoint's; a third call
    with the same stop leaves it finished and adds nothing."""
    from rllib_exgrpo.cli.main import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(model=quick_tiny_model))
    base = ["train", "file", str(recipe), "--storage-path", str(tmp_path / "results"), "--checkpoint-at-end"]

    assert main(base + ["--stop", '{"training_iteration": 2}']) == 0
    (trial,) = (tmp_path / "results" / "resume-extend").glob("ExGRPO_*")
    before = (trial / "result.json").read_text().splitlines()
    assert [r["training_iteration"] for r in _rows(trial / "result.json")] == [1, 2]
    assert list(trial.glob("checkpoint_*"))
    capsys.readouterr()

    assert main(base + ["--resume", "--stop", '{"training_iteration": 3}']) == 0
    err = capsys.readouterr().err
    trial_id = _rows(trial / "result.json")[0]["trial_id"]
    lines = [ln for ln in err.splitlines() if ln.startswith("rllib train: --resume: experiment 'resume-extend': trial")]
    assert len(lines) == 1, err[-3000:]
    assert f"trial {trial.name} finished at iteration 2; continuing to training_iteration 3 from checkpoint_" in lines[0]

    assert list((tmp_path / "results" / "resume-extend").glob("ExGRPO_*")) == [trial]
    after = (trial / "result.json").read_text().splitlines()
    assert after[:2] == before  # iterations 1-2 kept as they were
    rows = _rows(trial / "result.json")
    assert [r["training_iteration"] for r in rows] == [1, 2, 3]
    assert {r["trial_id"] for r in rows} == {trial_id}
    # The algorithm's state came from the checkpoint: its counters go on from iteration 2's.
    sampled = [r["env_runners"]["num_env_steps_sampled_lifetime"] for r in rows]
    assert sampled[2] - sampled[1] == sampled[1] - sampled[0] > 0, sampled
    trained = [r["learners"]["__all_modules__"]["num_env_steps_trained_lifetime"] for r in rows]
    assert trained[2] - trained[1] == trained[1] - trained[0] > 0, trained
    tokens = [r["env_runners"]["num_response_tokens_lifetime"] for r in rows]
    assert tokens[2] > tokens[1] > tokens[0] > 0, tokens
    assert [r["iterations_since_restore"] for r in rows] == [1, 2, 1]  # iteration 3 ran after a restore
    progress = (trial / "progress.csv").read_text().splitlines()
    assert len(progress) == 1 + 3  # header once, one row per iteration

    assert main(base + ["--resume", "--stop", '{"training_iteration": 3}']) == 0
    err = capsys.readouterr().err
    assert f"trial {trial.name} finished at iteration 3 and meets the stop (training_iteration 3); stays finished" in err
    assert (trial / "result.json").read_text().splitlines() == after


# --- the other cases, on a toy trainable (seconds) -------------------------------------


def _toy_trainable():
    """A Trainable counting steps (its count is its checkpoint); `mode` in its config:
    'early' reports done at iteration 1, 'fail_once' raises at its first step while the
    marker file is absent (and creates it)."""
    from ray import tune

    class Toy(tune.Trainable):
        def setup(self, config):
            self.count = 0

        def step(self):
            marker = self.config.get("marker")
            if self.config.get("mode") == "fail_once" and marker and not os.path.exists(marker):
                open(marker, "w").close()
                raise RuntimeError("injected failure")
            self.count += 1
            return {"count": self.count, "done": self.config.get("mode") == "early"}

        def save_checkpoint(self, checkpoint_dir):
            Path(checkpoint_dir, "count.json").write_text(json.dumps(self.count))

        def load_checkpoint(self, checkpoint_dir):
            self.count = json.loads(Path(checkpoint_dir, "count.json").read_text())

    return Toy


def _toy_run(tmp_path, name, param_space, checkpoint_at_end, toy):
    from ray import tune

    tuner = tune.Tuner(
        toy,
        param_space=param_space,
        run_config=tune.RunConfig(
            name=name,
            storage_path=str(tmp_path),
            stop={"training_iteration": 2},
            verbose=0,
            checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=checkpoint_at_end),
        ),
    )
    return tuner.fit()


def _toy_resume(tmp_path, name, param_space, toy, stop):
    from rllib_exgrpo.cli.tune_runner import _restored_tuner

    exp = SimpleNamespace(name=name, storage_path=str(tmp_path), algo_cls=toy, param_space=param_space, stop=stop)
    return _restored_tuner(exp).fit()


def _counts(grid) -> dict:
    frames = {r.config["mode"]: r.metrics_dataframe for r in grid}
    return {mode: df["count"].tolist() if df is not None and "count" in df else [] for mode, df in frames.items()}


def test_toy_finished_trials_continue_or_stay_and_errored_ones_resume(tmp_path, ray_local, capsys):
    from ray import tune

    toy = _toy_trainable()
    space = {"mode": tune.grid_search(["normal", "early", "fail_once"]), "marker": str(tmp_path / "failed-once")}
    grid = _toy_run(tmp_path, "toy", space, True, toy)
    assert _counts(grid)["normal"] == [1, 2] and _counts(grid)["early"] == [1]
    assert sum(r.error is not None for r in grid) == 1
    capsys.readouterr()

    grid = _toy_resume(tmp_path, "toy", space, toy, {"training_iteration": 3})
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("rllib train: --resume: experiment 'toy': trial")]
    assert len(lines) == 3, err
    assert any("finished at iteration 2; continuing to training_iteration 3 from checkpoint_000000" in ln for ln in lines)
    assert any(
        "ended at iteration 1 before its stop (training_iteration 2) was reached" in ln and ln.endswith("stays finished") for ln in lines
    )
    assert any("errored at iteration 0; continues from scratch (no checkpoint was saved) to training_iteration 3" in ln for ln in lines)
    counts = _counts(grid)
    assert counts["normal"] == [1, 2, 3]  # the count comes back from the checkpoint
    assert counts["early"] == [1]
    assert counts["fail_once"] == [1, 2, 3]  # errored trials now stop at the new stop too
    assert all(r.error is None for r in grid)


def test_toy_finished_trial_without_checkpoint_stays_finished(tmp_path, ray_local, capsys):
    toy = _toy_trainable()
    space = {"mode": "normal"}
    _toy_run(tmp_path, "toy-nockpt", space, False, toy)
    capsys.readouterr()
    grid = _toy_resume(tmp_path, "toy-nockpt", space, toy, {"training_iteration": 3})
    err = capsys.readouterr().err
    assert "finished at iteration 2 with no checkpoint to continue from" in err
    assert "stays finished; to train it further run the experiment again without --resume" in err
    (result,) = grid
    assert result.metrics_dataframe["count"].tolist() == [1, 2]
