"""Paths as users type them: ``rllib evaluate --model`` / ``--data`` and ``rllib export``
take paths relative to the working directory, and a folder that is neither a checkpoint
nor a model folder is a one-line error (exit 2, no traceback)."""

from __future__ import annotations

import json
import os

import pytest

from rllib_exgrpo.cli import main as cli
from rllib_exgrpo.evaluation import PolicyPathError, find_checkpoint, policy_source

from test_evaluation import grpo_checkpoint  # noqa: F401  (a module-scoped fixture: one short GRPO run)


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def test_a_folder_that_is_neither_checkpoint_nor_model_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    assert cli.main(["evaluate", "--model", "notes", "--data", "arithmetic"]) == 2
    _one_line_error(capsys, "rllib evaluate: error: --model notes is not a model folder", "checkpoint", "config.json")
    assert cli.main(["evaluate", "--model", "notes/readme.txt", "--data", "arithmetic"]) == 2
    _one_line_error(capsys, "notes/readme.txt is a file")
    assert cli.main(["evaluate", "--model", "./missing", "--data", "arithmetic"]) == 2
    _one_line_error(capsys, "missing: no such file or folder")
    # checkpoint_* folders that are no checkpoint: still a folder of the wrong kind
    (tmp_path / "trial" / "checkpoint_000001").mkdir(parents=True)
    assert cli.main(["evaluate", "--model", "trial", "--data", "arithmetic"]) == 2
    _one_line_error(capsys, "trial is not a model folder")
    assert cli.main(["export", "notes", "out"]) == 2
    _one_line_error(capsys, "rllib export: error: notes is not a checkpoint; expected an RLlib checkpoint")
    assert cli.main(["export", "missing", "out"]) == 2
    _one_line_error(capsys, "missing: no such file or folder")
    assert not (tmp_path / "out").exists()


def test_policy_source_sorts_names_hub_ids_and_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hf = tmp_path / "models" / "mine"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    assert policy_source("tiny") == "tiny" and policy_source("tiny:max_steps=3") == "tiny:max_steps=3"
    assert policy_source("smollm2") == "smollm2"
    assert policy_source("Qwen/Qwen2.5-Math-7B") == "Qwen/Qwen2.5-Math-7B"  # no such path: a hub id
    assert policy_source("models/mine") == str(hf)  # relative: made absolute
    assert policy_source(os.path.join("models", "..", "models", "mine")) == str(hf)
    with pytest.raises(PolicyPathError, match="no such file"):
        policy_source("models/mine/deeper/still")
    with pytest.raises(PolicyPathError, match="not a model folder"):
        policy_source("models")


def test_relative_data_path_from_another_directory(tmp_path, monkeypatch, capsys):
    bench = tmp_path / "data" / "bench.jsonl"
    bench.parent.mkdir()
    bench.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+"}\n')
    monkeypatch.chdir(tmp_path)
    # the file is found relative to the working directory (its malformed row is reported)
    assert cli.main(["evaluate", "--model", "tiny", "--data", "data/bench.jsonl"]) == 2
    _one_line_error(capsys, "data/bench.jsonl:2:")


@pytest.mark.slow
def test_evaluate_a_relative_checkpoint_path_from_another_directory(grpo_checkpoint, tmp_path, monkeypatch, capsys):  # noqa: F811
    trial, path, _ = grpo_checkpoint
    # cwd = the folder above the trial folder; the paths typed are relative to it
    monkeypatch.chdir(trial.parent)
    relative = os.path.join(trial.name, path.name)
    assert not os.path.isabs(relative)
    assert find_checkpoint(relative)[0] == path
    out = tmp_path / "eval.json"
    for model in (relative, trial.name, "./" + relative + "/"):
        rc = cli.main(
            ["evaluate", "--model", model, "--data", "arithmetic", "--limit", "2", "--temperature", "0", "--output", str(out), "-q"]
        )
        assert rc == 0, capsys.readouterr().err
        data = json.loads(out.read_text())
        assert data["settings"]["checkpoint"]["path"] == str(path)
        assert data["model"] == os.path.abspath(model)  # the report names the folder absolute
        assert data["settings"]["checkpoint"]["algorithm"] == "GRPO"
