"""Loading problems: every row shape, and malformed rows that never pass silently."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from rllib_exgrpo.envs.datasets import DataFormatError, ProblemList, load_problems
from rllib_exgrpo.envs.problem import Problem


def _write_jsonl(path: Path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(row if isinstance(row, str) else json.dumps(row))
            fh.write("\n")
    return path


GOOD = {"problem": "What is 1+1?", "answer": "2"}
BAD_ROWS = [
    ("{not json", "invalid JSON"),
    (json.dumps({"problem": "What is 2+2?"}), "missing answer"),
    (json.dumps({"problem": "What is 3+3?", "answer": "  "}), "empty answer"),
    (json.dumps({"problem": "What is 4+4?", "answer": [8]}), "must be a string or a number"),
    (json.dumps({"answer": "5"}), "missing question"),
    (json.dumps(["a", "list"]), "not an object"),
]


@pytest.fixture
def messy(tmp_path):
    rows = [GOOD] + [text for text, _ in BAD_ROWS] + [{"question": "What is 9-1?", "answer": 8}]
    return _write_jsonl(tmp_path / "messy.jsonl", rows)


def test_strict_names_file_line_and_reason(tmp_path):
    for i, (text, reason) in enumerate(BAD_ROWS):
        path = _write_jsonl(tmp_path / f"bad{i}.jsonl", [GOOD, "", text])
        with pytest.raises(DataFormatError) as info:
            load_problems(path, strict=True)
        err = info.value
        assert err.path == str(path) and err.line == 3  # 1-based, blank lines counted
        assert reason in err.reason
        assert str(err) == f"{path}:3: {err.reason}"
        assert isinstance(err, ValueError)


def test_non_strict_skips_warns_and_counts(messy, caplog):
    with caplog.at_level(logging.WARNING, logger="rllib_exgrpo.envs.datasets"):
        problems = load_problems(messy)
    assert isinstance(problems, ProblemList)
    assert [p.ground_truth for p in problems] == ["2", "8"]
    assert problems.skipped == len(BAD_ROWS)
    assert [e.line for e in problems.errors] == list(range(2, 2 + len(BAD_ROWS)))
    row_warnings = [
        r for r in caplog.records if r.name == "rllib_exgrpo.envs.datasets" and r.getMessage().startswith("skipping malformed row")
    ]
    assert len(row_warnings) == len(BAD_ROWS)
    assert any(f"skipped {len(BAD_ROWS)} malformed" in r.getMessage() for r in caplog.records)


def test_all_rows_bad_is_an_error(tmp_path):
    path = _write_jsonl(tmp_path / "x.jsonl", [{"input": "q", "target": "1"}])
    with pytest.raises(ValueError, match="no usable rows"):
        load_problems(path)
    assert load_problems(path, field_map={"question": "input", "ground_truth": "target"})[0].question == "q"


def test_gsm8k_answers_and_numbers(tmp_path):
    path = _write_jsonl(
        tmp_path / "gsm.jsonl",
        [
            {"question": "q1", "answer": "Some work <<2*3=6>>\n#### 1,234", "idx": 7},
            {"question": "q2", "answer": 27.0},
            {"question": "q3", "answer": 2.5},
            {"question": "q4", "answer": 12},
        ],
    )
    problems = load_problems(path)
    assert [p.ground_truth for p in problems] == ["1234", "27", "2.5", "12"]
    assert problems[0].id == "gsm-7"


def test_field_map_with_nested_paths(tmp_path):
    path = _write_jsonl(
        tmp_path / "custom.jsonl",
        [
            {"input": "What is 6*7?", "target": {"value": "42"}, "uid": "a"},
            {"input": "What is 6*8?", "target": {"value": "48"}, "uid": "b"},
        ],
    )
    problems = load_problems(path, field_map={"question": "input", "ground_truth": "target.value", "id": "uid"})
    assert [(p.id, p.question, p.ground_truth) for p in problems] == [
        ("custom-a", "What is 6*7?", "42"),
        ("custom-b", "What is 6*8?", "48"),
    ]
    with pytest.raises(ValueError, match="unknown field_map keys"):
        load_problems(path, field_map={"prompt": "input"})


def test_verl_rows_in_parquet_with_bad_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {
            "data_source": "math",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  What is $1+1$?  "}],
            "reward_model": {"ground_truth": "2", "style": "rule"},
        },
        {
            "data_source": "math",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
            "reward_model": {"ground_truth": "", "style": "rule"},
        },
    ]
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    problems = load_problems(path)
    assert problems.skipped == 1 and problems.errors[0].line == 2
    (p,) = problems
    assert p.question == "  What is $1+1$?  "  # the user message verbatim
    assert (p.ground_truth, p.data_source, p.id) == ("2", "math", "verl-1")
    with pytest.raises(DataFormatError, match=r"verl\.parquet:2: empty answer"):
        load_problems(path, strict=True)


def test_json_array_and_json_lines_named_json(tmp_path):
    array = tmp_path / "arr.json"
    array.write_text(json.dumps([GOOD, {"question": "q", "answer": "3"}]))
    assert [p.ground_truth for p in load_problems(array)] == ["2", "3"]
    lines = _write_jsonl(tmp_path / "lines.json", [GOOD, GOOD])
    assert len(load_problems(lines)) == 2


def test_ids_unique_data_source_and_limit(tmp_path):
    path = _write_jsonl(
        tmp_path / "dup.jsonl",
        [
            {"problem": "a", "answer": "1", "id": 5},
            {"problem": "b", "answer": "2", "id": 5},
            {"problem": "c", "answer": "3", "data_source": "mine"},
        ],
    )
    problems = load_problems(path)
    assert [p.id for p in problems] == ["dup-5", "dup-5#2", "dup-3"]
    assert [p.data_source for p in problems] == ["dup", "dup", "mine"]
    assert {p.data_source for p in load_problems(path, data_source="forced")} == {"forced"}
    assert len(load_problems(path, limit=2)) == 2
    # skip + limit: the rows after the first N (train) vs the first N (evaluate)
    assert [p.question for p in load_problems(path, skip=1)] == ["b", "c"]
    assert [p.question for p in load_problems(path, skip=1, limit=1)] == ["b"]
    with pytest.raises(ValueError, match="skip=3 leaves no problem"):
        load_problems(path, skip=3)
    with pytest.raises(ValueError, match="skip must be"):
        load_problems(path, skip=-1)
    test = load_problems("arithmetic", split="test")
    assert [p.id for p in load_problems("arithmetic", split="test", skip=200)] == [p.id for p in test[200:]]


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_problems(tmp_path / "nope.jsonl")
    odd = tmp_path / "data.csv"
    odd.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unsupported data file extension '\.csv'"):
        load_problems(odd)


def test_arithmetic_source():
    train = load_problems("arithmetic")
    assert len(train) == 5000 and all(isinstance(p, Problem) for p in train)
    assert {p.difficulty for p in train} == {1, 2, 3, 4}
    test = load_problems("arithmetic", split="test")
    assert len(test) == 500
    custom = load_problems("arithmetic:levels=5-6,n=40,n_test=10,seed=3", limit=25)
    assert len(custom) == 25 and {p.difficulty for p in custom} <= {5, 6}
    assert len(load_problems("arithmetic:n=40,n_test=10", split="test")) == 10
    with pytest.raises(ValueError):
        load_problems("arithmetic:bogus=1")
    with pytest.raises(ValueError, match="split"):
        load_problems("arithmetic", split="valid")


def test_shared_benchmarks_load_strictly(shared_data):
    expected = {"aime24": 30, "amc23": 40, "gsm8k": 1319, "math500": 500}
    for bench, n in expected.items():
        problems = load_problems(shared_data / "simplerl_eval" / f"{bench}_test.jsonl", strict=True)
        assert len(problems) == n and problems.skipped == 0
        assert len({p.id for p in problems}) == n
        assert all(p.question.strip() and p.ground_truth for p in problems)
    gsm = load_problems(shared_data / "simplerl_eval" / "gsm8k_test.jsonl")
    assert gsm[0].ground_truth == "18" and all("####" not in p.ground_truth for p in gsm)
    assert all("," not in p.ground_truth for p in gsm)
    valid = load_problems(shared_data / "luffy_exgrpo" / "ExGRPO_data_valid.parquet", strict=True)
    assert len(valid) == 2259 and len({p.id for p in valid}) == 2259
    assert {p.data_source for p in valid} == {"aime", "aime25", "amc", "math", "minerva", "olympiad_bench"}
    assert valid[0].ground_truth == "204" and valid[0].question.startswith("Every morning Aya")
