"""``rllib evaluate --protocol exgrpo`` (``evaluation/protocol.py``) and the evaluation data
rules it relies on (repeated rows counted once, ``limit`` per data source, system messages
kept), on hand-made files and, when ../shared/data has it, the official ExGRPO valid parquet.
"""

from __future__ import annotations

import json

import pytest

from rllib_exgrpo.cli import main as cli
from rllib_exgrpo.evaluation import load_eval_problems
from rllib_exgrpo.evaluation.protocol import (
    EXGRPO,
    EXGRPO_SYSTEM_PROMPT,
    benchmark_of,
    group_averages,
    official_answer_text,
)

SHORT_SYSTEM = "Think, then answer."


@pytest.mark.parametrize(
    "name, expected",
    [
        ("aime", ("AIME24", "in_distribution")),
        ("aime25", ("AIME25", "in_distribution")),
        ("aime24_test", ("AIME24", "in_distribution")),
        ("AIME 2025", ("AIME25", "in_distribution")),
        ("amc", ("AMC", "in_distribution")),
        ("amc23_test", ("AMC", "in_distribution")),
        ("math", ("MATH-500", "in_distribution")),
        ("math500_test", ("MATH-500", "in_distribution")),
        ("minerva", ("Minerva", "in_distribution")),
        ("olympiad_bench", ("OlympiadBench", "in_distribution")),
        ("arc_c", ("ARC-c", "out_of_distribution")),
        ("gpqa", ("GPQA-diamond", "out_of_distribution")),
        ("mmlu_pro", ("MMLU-Pro", "out_of_distribution")),
        ("gsm8k_test", None),
        ("arithmetic", None),
        ("mathqa", None),
    ],
)
def test_data_sources_map_to_the_papers_benchmarks(name, expected):
    assert benchmark_of(name) == expected


def test_group_averages_are_over_the_benchmarks_present():
    per_source = {
        "aime": {"avg_at_k": 0.2, "n_questions": 30},
        "math": {"avg_at_k": 0.8, "n_questions": 500},
        "gpqa": {"avg_at_k": 0.3, "n_questions": 198},
        "arc_c": {"avg_at_k": 0.7, "n_questions": 1172},
        "gsm8k_test": {"avg_at_k": 0.9, "n_questions": 10},  # in no group
    }
    g = group_averages(per_source)
    assert g["in_distribution"]["avg"] == pytest.approx(0.5)
    assert g["in_distribution"]["benchmarks"] == {"AIME24": 0.2, "MATH-500": 0.8}
    assert g["in_distribution"]["missing"] == ["AIME25", "AMC", "Minerva", "OlympiadBench"]
    assert g["out_of_distribution"]["avg"] == pytest.approx(0.5)
    assert group_averages({"gsm8k": {"avg_at_k": 1.0, "n_questions": 1}})["in_distribution"]["avg"] is None
    # One benchmark in two data sources: weighted by questions, counted once.
    two = group_averages({"aime24_a": {"avg_at_k": 1.0, "n_questions": 1}, "aime24_b": {"avg_at_k": 0.0, "n_questions": 3}})
    assert two["in_distribution"]["benchmarks"] == {"AIME24": 0.25}


def test_the_official_think_format():
    # A chat template that opens the thought block: "<think>\n" + completion, text after the first </think>.
    opened = "<|im_start|>assistant\n<think>\n"
    assert official_answer_text(opened, "a </think> \\boxed{2}") == " \\boxed{2}"
    assert official_answer_text(opened, "a </think> x </think> \\boxed{3}") == " x "
    assert official_answer_text(opened, "no closing tag \\boxed{2}") is None  # wrong, not verified
    # Otherwise the whole completion is verified.
    plain = "<|im_start|>assistant\n"
    assert official_answer_text(plain, "\\boxed{2}") == "\\boxed{2}"
    assert EXGRPO.temperature == 0.6 and EXGRPO.top_p == 1.0 and EXGRPO.max_new_tokens == 8192


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def _verl_row(source, question, answer, system=SHORT_SYSTEM):
    return {
        "data_source": source,
        "prompt": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": 0, "split": "test"},
    }


@pytest.fixture
def hand_made(tmp_path):
    """A verl parquet (aime repeated 3 times, math, gpqa) and a jsonl benchmark (problem + answer)."""
    rows = []
    for _ in range(3):
        rows += [_verl_row("aime", "What is 2 + 3?", "5"), _verl_row("aime", "What is 4 + 4?", "8")]
    rows += [_verl_row("math", f"What is {i} + 1?", str(i + 1)) for i in range(3)]
    rows += [_verl_row("gpqa", "Which is larger?\n\nA) 1\nB) 2", "B")]
    parquet = tmp_path / "valid.parquet"
    _write_parquet(parquet, rows)
    jsonl = tmp_path / "minerva_test.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"problem": f"What is {i} * 2?", "answer": str(2 * i)}) + "\n" for i in range(2))
        + json.dumps({"problem": "What is 0 * 2?", "answer": "0"})
        + "\n"
    )
    return parquet, jsonl


def test_repeated_rows_are_one_question_and_limit_is_per_data_source(hand_made):
    parquet, jsonl = hand_made
    src, js = load_eval_problems([parquet, jsonl], keep_system=True)
    assert src.rows == {"aime": 6, "math": 3, "gpqa": 1}
    assert src.distinct_by_source == {"aime": 2, "math": 3, "gpqa": 1} and src.merged == 4
    assert [p.question for p in src.problems if p.data_source == "aime"] == ["What is 2 + 3?", "What is 4 + 4?"]
    assert set(src.systems.values()) == {SHORT_SYSTEM} and len(src.systems) == 6  # kept, not dropped
    assert js.rows == {"minerva_test": 3} and js.distinct_by_source == {"minerva_test": 2} and not js.systems
    (limited,) = load_eval_problems([parquet], limit=1)
    assert [p.data_source for p in limited.problems] == ["aime", "math", "gpqa"]  # first 1 of each source


def _evaluate_tiny_with_the_protocol(parquet, jsonl, out) -> int:
    """``rllib evaluate --protocol exgrpo`` of the tiny model on the two files (4 new tokens at
    most, the HF backend), its report written to ``out``; returns the exit code."""
    return cli.main(
        [
            "evaluate",
            "--model",
            "tiny",
            "--protocol",
            "exgrpo",
            "--data",
            str(parquet),
            "--data",
            str(jsonl),
            "--max-new-tokens",
            "4",
            "--backend",
            "hf",
            "--output",
            str(out),
        ]
    )


@pytest.mark.slow
def test_protocol_on_hand_made_files_with_the_tiny_model(hand_made, tmp_path, capsys):
    from rllib_exgrpo.models import resolve_model_path
    from rllib_exgrpo.models.loading import load_tokenizer

    parquet, jsonl = hand_made
    out = tmp_path / "eval.json"
    rc = _evaluate_tiny_with_the_protocol(parquet, jsonl, out)
    assert rc == 0
    captured = capsys.readouterr()
    data = json.loads(out.read_text())
    s = data["settings"]
    assert s["protocol"] == "exgrpo" and s["temperature"] == 0.6 and s["top_p"] == 1.0
    assert s["k_used"] == {"aime": 32, "math": 1, "gpqa": 1, "minerva_test": 1}  # avg@32 for AIME/AMC
    src = data["sources"]
    assert src["aime"]["n_questions"] == 2 and src["aime"]["rows"] == 6 and src["aime"]["distinct_questions"] == 2
    assert src["aime"]["samples"] == 64 and src["math"]["samples"] == 3
    # The prompts: each row's own system message, the question verbatim, the chat template.
    tok = load_tokenizer(resolve_model_path("tiny"))

    def tokens(system, question):
        text = tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        return len(tok(text, add_special_tokens=False)["input_ids"])

    by_q = {q["id"]: q for q in data["questions"]}
    aime = [q for q in data["questions"] if q["data_source"] == "aime"]
    assert aime[0]["prompt_tokens"] == tokens(SHORT_SYSTEM, "What is 2 + 3?")
    # The jsonl rows get the official system message: over the tiny model's 512 positions,
    # so no room is left for an answer: scored wrong, said in one line.
    minerva = [q for q in by_q.values() if q["data_source"] == "minerva_test"]
    assert minerva[0]["prompt_tokens"] == tokens(EXGRPO_SYSTEM_PROMPT, "What is 0 * 2?") > 512
    assert all(q["response_tokens"] == [0] and q["correct"] == [False] for q in minerva)
    assert s["no_room"] == 2 and s["budget_capped"] == 2
    assert sum("capped to max_position_embeddings (512) - prompt length" in line for line in captured.err.splitlines()) == 1
    assert "repeated rows counted once" in captured.err
    # The report: per data source questions, k and score, then the two averages.
    g = data["groups"]
    assert set(g["in_distribution"]["benchmarks"]) == {"AIME24", "MATH-500", "Minerva"}
    assert set(g["out_of_distribution"]["benchmarks"]) == {"GPQA-diamond"}
    lines = captured.out.splitlines()
    aime_line = next(line for line in lines if line.startswith("aime ") and "AIME24" in line)
    assert aime_line.split()[2:4] == ["2", "32"] and "6 rows: 2 distinct" in aime_line
    assert any(line.startswith("in-distribution avg: ") and "over 3 benchmark(s)" in line for line in lines)
    assert any(line.startswith("out-of-distribution avg: ") for line in lines)


def test_protocol_refuses_prompt_options(tmp_path, capsys):
    bench = tmp_path / "b.jsonl"
    bench.write_text(json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\n")
    rc = cli.main(["evaluate", "--model", "tiny", "--protocol", "exgrpo", "--data", str(bench), "--think-format"])
    assert rc == 2 and "--protocol exgrpo sets the prompt; drop --think-format" in capsys.readouterr().err


@pytest.mark.slow
def test_protocol_on_the_official_valid_parquet(shared_data, tmp_path, capsys):
    valid = shared_data / "luffy_exgrpo" / "ExGRPO_data_valid.parquet"
    if not valid.is_file():
        pytest.skip(f"{valid} absent (the official ExGRPO valid set, ExGRPO/data/valid.parquet)")
    out = tmp_path / "eval.json"
    # Its prompts (official system message included) are over 1000 tokens for the tiny
    # model's byte-level tokenizer: keep their last 96 so that the 512 positions leave room.
    rc = cli.main(
        [
            "evaluate",
            "--model",
            "tiny",
            "--protocol",
            "exgrpo",
            "--data",
            str(valid),
            "--limit",
            "2",
            "--k",
            "2",
            "--max-new-tokens",
            "8",
            "--max-prompt-tokens",
            "96",
            "--backend",
            "hf",
            "--output",
            str(out),
            "-q",
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {name: (m["rows"], m["distinct_questions"], m["n_questions"], m["k"]) for name, m in data["sources"].items()}
    assert rows == {
        "aime": (240, 30, 2, 2),
        "aime25": (240, 30, 2, 2),
        "amc": (332, 83, 2, 2),
        "math": (500, 500, 2, 2),
        "minerva": (272, 272, 2, 2),
        "olympiad_bench": (675, 675, 2, 2),
    }
    g = data["groups"]
    assert g["in_distribution"]["missing"] == [] and g["in_distribution"]["avg"] is not None
    assert g["out_of_distribution"]["avg"] is None
    assert data["settings"]["system_prompt"] == EXGRPO_SYSTEM_PROMPT
    (src,) = load_eval_problems([valid], keep_system=True)  # every row's system message is the official one
    assert set(src.systems.values()) == {EXGRPO_SYSTEM_PROMPT} and len(src.systems) == len(src.problems) == 1590
    stdout = capsys.readouterr().out
    assert "in-distribution avg:" in stdout and "(240 rows: 30 distinct, repeats counted once)" in stdout
