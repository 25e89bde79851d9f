"""rllib compare (evaluation/compare.py, cli/compare.py): the table's scores, bootstrap
intervals and paired differences on hand-made reports, against the formulas; the command on
saved evaluations and on models it evaluates itself; bad input in one line."""

import json

import numpy as np
import pytest

from rllib_exgrpo.cli.main import main
from rllib_exgrpo.evaluation.compare import MACRO, compare_reports, question_scores


def _report(scores_by_source):
    """A report dict whose question ``i`` of a source has k=4 samples, ``round(4 * score)`` correct."""
    questions = []
    for source, scores in scores_by_source.items():
        for i, s in enumerate(scores):
            c = int(round(4 * s))
            questions.append({"id": f"{source}-{i}", "data_source": source, "source": source, "correct": [True] * c + [False] * (4 - c)})
    return {"model": "m", "sources": {s: {} for s in scores_by_source}, "questions": questions}


A = _report({"math": [0.0, 0.25, 0.5, 1.0], "aime": [0.0, 0.0, 0.25]})
B = _report({"math": [0.25, 0.5, 0.5, 1.0], "aime": [0.0, 0.5, 0.25]})


def test_scores_intervals_and_paired_differences_follow_the_formulas():
    assert question_scores(A)["math"] == {"math-0": 0.0, "math-1": 0.25, "math-2": 0.5, "math-3": 1.0}
    table = compare_reports([A, B], ["grpo", "exgrpo"], draws=4000, seed=1)
    assert table.benchmarks == ["math", "aime"]
    grpo, exgrpo = table.cells
    assert grpo["math"].mean == pytest.approx(100 * np.mean([0, 0.25, 0.5, 1.0]))
    assert grpo[MACRO].mean == pytest.approx(100 * np.mean([np.mean([0, 0.25, 0.5, 1]), np.mean([0, 0, 0.25])]))
    for row in table.cells:
        for cell in row.values():
            assert cell.low <= cell.mean <= cell.high
    diff = table.diffs[1]
    assert diff["math"].mean == pytest.approx(exgrpo["math"].mean - grpo["math"].mean)  # 12.5 points
    assert diff["math"].low >= 0.0  # every question equal or better: no resample can be negative
    assert table.diffs[0] == {}
    text = table.markdown()
    assert "| exgrpo | +12.5 [" in text and "paired difference against grpo" in text
    assert "grpo,math,4,43.750," in table.csv()


def test_only_questions_every_method_answered_count():
    short = _report({"math": [0.0, 0.25]})
    table = compare_reports([A, short], ["a", "b"], draws=100)
    assert table.benchmarks == ["math"] and table.cells[0]["math"].n == 2
    with pytest.raises(ValueError, match="share no question"):
        compare_reports([A, _report({"gsm8k": [1.0]})], ["a", "b"], draws=10)


def test_the_command_on_saved_evaluations(tmp_path, capsys):
    a, b = tmp_path / "eval-grpo.json", tmp_path / "eval-exgrpo.json"
    a.write_text(json.dumps(A))
    b.write_text(json.dumps(B))
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp"), "--bootstrap", "500"]) == 0
    out = capsys.readouterr().out
    assert "| eval-grpo |" in out and "| eval-exgrpo | +" in out and "[" in out
    for name in ("compare.md", "compare.csv", "compare.png"):
        assert (tmp_path / "cmp" / name).stat().st_size > 0


def test_bad_input_is_one_line_before_anything_runs(tmp_path, capsys):
    assert main(["compare", "tiny", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give --data" in err[0]
    assert main(["compare", str(tmp_path / "nope"), "--data", "arithmetic", "--out", str(tmp_path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main(["compare", "tiny", "tiny", "--label", "one", "--data", "arithmetic"]) == 2


def test_the_command_evaluates_models_itself(tmp_path, capsys):
    args = [
        "compare",
        "tiny",
        "tiny",
        "--label",
        "first",
        "--label",
        "second",
        "--data",
        "arithmetic",
        "--temperature",
        "0",
        "--limit",
        "12",
        "--max-new-tokens",
        "24",
        "--backend",
        "hf",
        "--bootstrap",
        "200",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| first |" in out and "| second | +0.0 [+0.0, +0.0]" in out  # the same greedy model twice
    assert (tmp_path / "eval-first.json").is_file() and (tmp_path / "eval-second.json").is_file()
