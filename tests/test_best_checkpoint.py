"""Keeping and picking the best checkpoint: a run that checkpoints every iteration keeps the
best by held-out accuracy (and the latest), and `rllib evaluate --best` / `rllib export --best`
on the run folder take the checkpoint whose recorded heldout/accuracy is highest."""

import json

import pytest
import yaml

from rllib_exgrpo.cli.main import main
from rllib_exgrpo.evaluation.checkpoints import best_checkpoint

RUN = {
    "best-tiny": {
        "run": "GRPO",
        "env": "ReasoningEnv",
        "stop": {"training_iteration": 4},
        "checkpoint_config": {
            "checkpoint_frequency": 1,
            "checkpoint_score_attribute": "heldout/accuracy",
            "checkpoint_score_order": "max",
            "num_to_keep": 2,
        },
        "config": {
            "seed": 0,
            "env_config": {"dataset": "arithmetic:levels=1-2,n=64"},
            "model_name_or_path": "tiny",
            "questions_per_step": 4,
            "group_size": 4,
            "max_prompt_tokens": 128,
            "max_response_tokens": 16,
            "behaviour_logprobs": "engine",
            "minibatch_size": 16,
            "lr": 0.003,
            "heldout_dataset": "arithmetic",
            "heldout_num_questions": 16,
            "heldout_interval": 1,
            "heldout_temperature": 0.0,
            "num_env_runners": 0,
        },
    }
}


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_best_checkpoint_is_kept_and_picked(tmp_path, capsys):
    path = tmp_path / "best.yaml"
    path.write_text(yaml.safe_dump(RUN))
    storage = tmp_path / "results"
    assert main(["train", "file", str(path), "--storage-path", str(storage)]) == 0
    run = storage / "best-tiny"
    (trial,) = [t for t in run.iterdir() if (t / "result.json").is_file()]
    rows = [json.loads(line) for line in (trial / "result.json").read_text().splitlines() if line.strip()]
    kept = sorted(p.name for p in trial.glob("checkpoint_*"))
    assert 2 <= len(kept) <= 3  # the best two by held-out accuracy, and the latest
    folder, value = best_checkpoint(run)
    assert folder.parent == trial and folder.name in kept
    # Every iteration checkpoints and the best two by held-out accuracy are kept: the best of
    # all iterations is among them.
    assert value == max(r["heldout"]["accuracy"] for r in rows)

    capsys.readouterr()
    assert (
        main(
            [
                "evaluate",
                "--model",
                str(run),
                "--best",
                "--data",
                "arithmetic",
                "--limit",
                "4",
                "--temperature",
                "0",
                "--max-new-tokens",
                "16",
                "--output",
                str(tmp_path / "e.json"),
                "-q",
            ]
        )
        == 0
    )
    assert f"best checkpoint by heldout/accuracy: {folder}" in capsys.readouterr().err
    assert main(["export", str(run), str(tmp_path / "model"), "--best"]) == 0
    assert f"best checkpoint by heldout/accuracy: {folder}" in capsys.readouterr().out
    assert (tmp_path / "model" / "config.json").is_file()
    # Without --best, the run folder of one trial is that trial's latest checkpoint.
    assert main(["export", str(run), str(tmp_path / "latest")]) == 0
    assert (tmp_path / "latest" / "config.json").is_file()


def test_best_without_a_trial_is_one_line(tmp_path, capsys):
    assert main(["evaluate", "--model", str(tmp_path), "--best", "--data", "arithmetic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--best" in err[0] and "no Tune run" in err[0]


def test_a_run_folder_of_one_trial_is_that_trials_checkpoint_and_of_several_is_refused(tmp_path):
    """``rllib evaluate --model RUN``, ``rllib compare RUN ...`` and ``rllib export RUN``: a run
    folder (storage_path/<experiment>) with one trial stands for that trial's latest
    checkpoint; with several, one line names them and says what to pass."""
    from rllib_exgrpo.evaluation.checkpoints import RunFolderError, find_checkpoint
    from rllib_exgrpo.evaluation.paths import PolicyPathError, checkpoint_source, policy_source

    def checkpoint(folder):
        (folder / "learner_group").mkdir(parents=True)
        (folder / "rllib_checkpoint.json").write_text("{}")

    run = tmp_path / "grpo-tiny"
    checkpoint(run / "GRPO_ReasoningEnv_0_00000" / "checkpoint_000001")
    checkpoint(run / "GRPO_ReasoningEnv_0_00000" / "checkpoint_000003")
    (run / "basic-variant-state.json").write_text("{}")
    from rllib_exgrpo.evaluation import checkpoints

    assert checkpoints._single_trial_checkpoint(run) == run / "GRPO_ReasoningEnv_0_00000" / "checkpoint_000003"
    checkpoint(run / "GRPO_ReasoningEnv_1_00001" / "checkpoint_000002")
    with pytest.raises(RunFolderError, match="run folder of 2 trials"):
        find_checkpoint(run)
    for check in (policy_source, checkpoint_source):
        with pytest.raises(PolicyPathError) as err:
            check(str(run))
        message = str(err.value)
        assert message.startswith(f"{run} is a run folder of 2 trials (GRPO_ReasoningEnv_0_00000, ")
        assert "--best" in message and "\n" not in message
