"""Benchmark evaluation: the metrics (pass@k, avg@k, maj@k), the report, the
``rllib evaluate`` command, and evaluating an RLlib checkpoint of this project."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest

from rllib_exgrpo.cli import main as cli
from rllib_exgrpo.evaluation import (
    EvalDataError,
    EvalReport,
    QuestionResult,
    aggregate,
    avg_at_k,
    default_k,
    find_checkpoint,
    load_eval_problems,
    maj_at_k,
    pass_at_k,
    resolve_k,
)

REPO = Path(__file__).resolve().parents[1]
REPORT_KEYS = {"version", "created", "model", "settings", "sources", "overall", "wall_time_s", "questions"}
SOURCE_KEYS = {
    "k",
    "n_questions",
    "samples",
    "avg_at_k",
    "pass_at_k",
    "maj_at_k",
    "mean_response_tokens",
    "truncated_fraction",
    "unscored",
    "timed_out",
    "metrics",
    "wall_time_s",
}


# =========================================================================== metrics


def _comb_pass_at_k(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize(
    "samples",
    [
        [True],
        [False],
        [True, False],
        [False, False, True, False, True],
        [True] * 4,
        [False] * 8,
        [False, True, False, False, False, False, False, True, False, False],
        [i % 3 == 0 for i in range(32)],
        [i < 31 for i in range(32)],
    ],
)
def test_pass_at_k_matches_the_unbiased_estimator(samples):
    n, c = len(samples), sum(samples)
    for k in range(1, n + 1):
        assert pass_at_k(n, c, k) == pytest.approx(_comb_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)  # pass@1 is the mean


def test_pass_at_k_grid_and_edges():
    for n in (1, 2, 3, 7, 16, 64):
        for c in range(n + 1):
            for k in sorted({1, 2, n // 2 or 1, n - 1 or 1, n}):
                if k > n:
                    continue
                assert pass_at_k(n, c, k) == pytest.approx(_comb_pass_at_k(n, c, k), abs=1e-12)
            assert pass_at_k(n, 0, n) == 0.0  # c = 0: never
            assert pass_at_k(n, n, 1) == 1.0  # c = n: always
    # large n: the product form stays exact where binomials are astronomically big
    n, c, k = 2000, 3, 1000
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


@pytest.mark.parametrize("args", [(4, 1, 5), (4, 5, 1), (4, -1, 1), (0, 0, 1), (4, 1, 0)])
def test_pass_at_k_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        pass_at_k(*args)


def test_avg_at_k():
    assert avg_at_k([True, False, True, True]) == 0.75
    assert avg_at_k([True, False, True, True], 2) == 0.5
    assert avg_at_k([1.0, 0.0]) == 0.5
    assert avg_at_k([False]) == 0.0
    with pytest.raises(ValueError):
        avg_at_k([True], 2)
    with pytest.raises(ValueError):
        avg_at_k([])


@pytest.mark.parametrize(
    "answers, correct, k, expected",
    [
        (["5", "5", "3"], [True, True, False], None, 1.0),  # majority right
        (["3", "5", "3"], [False, True, False], None, 0.0),  # majority wrong, one sample right
        (["3", "5"], [False, True], None, 0.0),  # tie: the first answer wins
        (["5", "3"], [True, False], None, 1.0),  # tie, other order
        (["3", "5", "5", "3"], [False, True, True, False], None, 0.0),  # 2-2 tie: "3" seen first
        ([None, None, "5"], [False, False, True], None, 1.0),  # None does not vote
        ([None, None], [False, False], None, 0.0),  # nobody answered
        (["5", "3", "3", "3"], [True, False, False, False], 1, 1.0),  # only the first k vote
        (["5", "3", "3", "3"], [True, False, False, False], 3, 0.0),
        (["1 / 2", "1/2", "3"], [True, True, False], None, 1.0),  # whitespace does not split votes
        (["", "4"], [False, True], None, 1.0),  # an empty answer is no answer
    ],
)
def test_maj_at_k(answers, correct, k, expected):
    assert maj_at_k(answers, correct, k) == expected


def test_maj_at_k_errors():
    with pytest.raises(ValueError):
        maj_at_k(["1"], [True, False])
    with pytest.raises(ValueError):
        maj_at_k(["1"], [True], 2)


def test_default_k_and_overrides():
    assert default_k("aime24_test") == 32 and default_k("AMC23") == 32 and default_k("aime25") == 32
    assert default_k("math500_test") == 1 and default_k("arithmetic") == 1 and default_k("minerva") == 1
    assert resolve_k("math500_test", 4) == 4
    assert resolve_k("aime24_test", {"aime24_test": 8}) == 8
    assert resolve_k("aime24_test", {"aime": 16}) == 16  # key contained in the name
    assert resolve_k("math500_test", {"aime": 16}) == 1  # not mentioned: paper default
    with pytest.raises(ValueError):
        resolve_k("x", 0)


def _q(qid, source, correct, answers=None):
    answers = answers if answers is not None else [str(int(c)) for c in correct]
    return QuestionResult(
        id=qid,
        data_source=source,
        source=source,
        correct=list(correct),
        answers=answers,
        response_tokens=[10] * len(correct),
        truncated=[False] * len(correct),
    )


def test_aggregate_per_source_and_overall():
    aime = [_q("a1", "aime", [True, False, False, False]), _q("a2", "aime", [False] * 4)]
    math500 = [_q("m1", "math", [True]), _q("m2", "math", [False]), _q("m3", "math", [True])]
    a = aggregate(aime)
    assert a["k"] == 4 and a["n_questions"] == 2 and a["samples"] == 8
    assert a["avg_at_k"] == pytest.approx(0.125)
    assert a["pass_at_k"] == {"1": pytest.approx(0.125), "4": pytest.approx(0.5)}
    assert a["metrics"]["avg@4"] == pytest.approx(0.125) and "maj@4" in a["metrics"]
    assert a["maj_at_k"] == 0.0  # "0" is every question's majority
    both = aggregate(aime + math500)
    assert both["k"] is None and both["n_questions"] == 5
    # pass@4 only over the questions that have 4 samples; pass@1 over all
    assert both["pass_at_k"]["4"] == pytest.approx(0.5)
    assert both["pass_at_k"]["1"] == pytest.approx((0.25 + 0 + 1 + 0 + 1) / 5)
    assert aggregate(math500, pass_ks=(1, 2, "k"))["pass_at_k"] == {"1": pytest.approx(2 / 3)}


def test_report_table_and_json(tmp_path):
    qs = [_q("a1", "aime24", [True, False]), _q("m1", "math500", [True])]
    sources = {"aime24": aggregate(qs[:1]), "math500": aggregate(qs[1:])}
    overall = {**aggregate(qs), "macro_avg_at_k": 0.75}
    report = EvalReport(
        model="m",
        settings={"temperature": 0.6, "top_p": 1.0, "max_new_tokens": 8, "seed": 0, "pass_ks": [1, "k"]},
        sources=sources,
        overall=overall,
        wall_time_s=1.0,
        questions=qs,
    )
    table = report.table()
    for needle in ("aime24", "math500", "overall", "macro avg", "avg@k", "pass@1", "pass@k", "maj@k", "75.0"):
        assert needle in table, needle
    path = report.to_json(tmp_path / "sub" / "r.json")
    data = json.loads(Path(path).read_text())
    assert REPORT_KEYS <= set(data) and data["questions"][0]["correct"] == [True, False]


# =========================================================================== data + CLI errors


def test_malformed_benchmark_is_a_one_line_error_naming_the_line(tmp_path, capsys):
    bad = tmp_path / "bench.jsonl"
    bad.write_text('{"problem": "1+1?", "answer": "2"}\n\n{"problem": "2+2?"}\n')
    with pytest.raises(EvalDataError, match=r"bench\.jsonl:3: missing answer"):
        load_eval_problems([str(bad)])
    # exits 2 before any model is loaded (the model path does not even exist)
    rc = cli.main(["evaluate", "--model", "no-such-model", "--data", "arithmetic", "--data", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().count("\n") == 0 and f"{bad}:3: missing answer" in err and "Traceback" not in err


def test_malformed_benchmark_from_the_console_script(tmp_path):
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "oops", \n')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "rllib_exgrpo.cli.main", "evaluate", "--model", "tiny", "--data", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    err = proc.stderr.strip()
    assert "\n" not in err and err.startswith(f"rllib evaluate: error: {bad}:2: invalid JSON"), err


def test_other_bad_inputs_exit_2(tmp_path, capsys):
    assert cli.main(["evaluate", "--model", "tiny", "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "data file not found" in capsys.readouterr().err
    assert cli.main(["evaluate", "--model", "tiny", "--data", "arithmetic:bogus=1"]) == 2
    assert "unknown arithmetic option" in capsys.readouterr().err
    assert cli.main(["evaluate", "--model", "./nowhere", "--data", "arithmetic"]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["evaluate", "--model", "tiny"])  # --data is required


def test_arithmetic_sources_use_the_held_out_split():
    (src,) = load_eval_problems(["arithmetic"], limit=5)
    assert len(src.problems) == 5 and all(p.id.startswith("arith-test") for p in src.problems)
    (src,) = load_eval_problems(["arithmetic:levels=5-6"], limit=3)
    assert {p.data_source for p in src.problems} == {"arithmetic:levels=5-6"}


def test_folders_that_are_not_checkpoints(tmp_path):
    from ray.rllib.utils.checkpoints import Checkpointable

    from rllib_exgrpo.evaluation import checkpoints, is_checkpoint

    assert checkpoints._CTOR_FILE == Checkpointable.CLASS_AND_CTOR_ARGS_FILE_NAME

    assert not is_checkpoint(tmp_path / "missing") and not is_checkpoint(tmp_path)
    hf = tmp_path / "hf_model"  # a plain HF model folder
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert not is_checkpoint(hf)
    # checkpoint_* subfolders that are no algorithm checkpoint
    (tmp_path / "checkpoint_000003").mkdir()
    assert not is_checkpoint(tmp_path)
    # RLlib's metadata and learner_group/ but no algorithm state or module: RLlib's
    # get_checkpoint_info rejects it, find_checkpoint says FileNotFoundError
    broken = tmp_path / "checkpoint_000004"
    (broken / "learner_group").mkdir(parents=True)
    (broken / "rllib_checkpoint.json").write_text('{"checkpoint_version": "2.1"}')
    with pytest.raises(FileNotFoundError):
        find_checkpoint(broken)
    assert not is_checkpoint(broken) and not is_checkpoint(tmp_path)


# =========================================================================== real runs


@pytest.mark.slow
def test_cli_on_math500_with_the_tiny_model(shared_data, tmp_path, capsys):
    math500 = shared_data / "simplerl_eval" / "math500_test.jsonl"
    if not math500.is_file():
        pytest.skip(f"{math500} absent")
    out = tmp_path / "results.json"
    rc = cli.main(
        ["evaluate", "--model", "tiny", "--data", str(math500), "--limit", "8", "--max-new-tokens", "32", "--output", str(out), "-q"]
    )
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "math500_test" in stdout and "avg@k" in stdout and str(out) in stdout
    data = json.loads(out.read_text())
    assert REPORT_KEYS <= set(data)
    assert set(data["sources"]) == {"math500_test"}
    m = data["sources"]["math500_test"]
    assert SOURCE_KEYS <= set(m)
    assert m["k"] == 1 and m["n_questions"] == 8 and m["samples"] == 8  # MATH-500: avg@1
    assert set(m["pass_at_k"]) == {"1"} and 0.0 <= m["avg_at_k"] <= 1.0
    assert data["settings"]["temperature"] == 0.6 and data["settings"]["top_p"] == 1.0
    assert data["settings"]["max_new_tokens"] == 32
    assert len(data["questions"]) == 8 and all(len(q["correct"]) == 1 for q in data["questions"])
    assert all(q["prompt_tokens"] > 0 for q in data["questions"])
    # The tiny model's context is 512 positions: each budget is min(32, 512 - prompt), and a
    # prompt that fills the context gets no completion (scored wrong, said in one line).
    for q in data["questions"]:
        room = 512 - q["prompt_tokens"]
        if room <= 0:
            assert q["response_tokens"] == [0] and q["correct"] == [False] and q["truncated"] == [True]
        else:
            assert all(0 < n <= min(32, room) for n in q["response_tokens"])
    full = sum(q["prompt_tokens"] >= 512 for q in data["questions"])
    assert data["settings"]["no_room"] == full and data["settings"]["backend"] == "hf"


@pytest.fixture(scope="module")
def grpo_checkpoint(ray_local, quick_tiny_model, tmp_path_factory):
    """A GRPO checkpoint after one training step (lr high enough to move the weights)."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rllib_exgrpo.rllib.algorithm import GRPOConfig

    cfg = (
        GRPOConfig()
        .environment(env_config={"dataset": "arithmetic", "instruction": "Answer in \\boxed{}."})
        .training(
            model_name_or_path=quick_tiny_model,
            questions_per_step=2,
            group_size=4,
            max_prompt_tokens=128,
            max_response_tokens=8,
            lr=1e-2,
            minibatch_size=8,
            loss_agg_mode="token-mean",
        )
    )
    algo = cfg.build_algo()
    try:
        algo.train()
        trial = tmp_path_factory.mktemp("trial")
        path = trial / "checkpoint_000001"
        algo.save_to_path(str(path))
        learner_state = {k: v.detach().clone() for k, v in algo.learner_group._learner.module[DEFAULT_MODULE_ID].model.state_dict().items()}
    finally:
        algo.stop()
    return trial, path, learner_state


def _evaluate_greedy_from_the_cli(model: Path, out: Path) -> int:
    """``rllib evaluate --model MODEL`` on 6 arithmetic questions at temperature 0 (asking for
    ``--k 4``), quiet, its report written to ``out``; returns the exit code."""
    return cli.main(
        [
            "evaluate",
            "--model",
            str(model),
            "--data",
            "arithmetic",
            "--limit",
            "6",
            "--temperature",
            "0",
            "--k",
            "4",
            "--output",
            str(out),
            "-q",
        ]
    )


@pytest.mark.slow
def test_checkpoint_weights_and_cli_evaluate(grpo_checkpoint, quick_tiny_model, tmp_path, capsys):
    import torch

    from rllib_exgrpo.evaluation import evaluate, load_policy_from_checkpoint, read_checkpoint
    from rllib_exgrpo.models.loading import load_causal_lm

    trial, path, learner_state = grpo_checkpoint
    module_dir = path / "learner_group" / "learner" / "rl_module" / "default_policy"
    # a Tune trial folder resolves to its latest checkpoint
    assert find_checkpoint(trial) == (path, module_dir)
    assert find_checkpoint(path) == (path, module_dir) and find_checkpoint(module_dir) == (None, module_dir)
    info = read_checkpoint(path)
    assert info.algorithm == "GRPO" and info.model_name_or_path == quick_tiny_model
    assert info.env_config["instruction"] == "Answer in \\boxed{}."
    assert info.config["max_response_tokens"] == 8 and info.module_path == str(module_dir)

    t0 = time.perf_counter()
    model, tokenizer = load_policy_from_checkpoint(path)
    print(f"load_policy_from_checkpoint: {time.perf_counter() - t0:.2f}s")
    assert not model.training and model.config.use_cache
    state = model.state_dict()
    for name, value in learner_state.items():
        assert torch.equal(state[name], value), name
    # the module folder alone: same weights; no algorithm config to read
    only_module = read_checkpoint(module_dir)
    assert only_module.path is None and only_module.algorithm is None and only_module.config == {}
    assert only_module.model_name_or_path == quick_tiny_model
    from_module, _ = load_policy_from_checkpoint(module_dir)
    assert all(torch.equal(v, state[n]) for n, v in from_module.state_dict().items())
    base = load_causal_lm({"model": quick_tiny_model}).state_dict()
    assert any(not torch.equal(base[n], learner_state[n]) for n in learner_state), "training moved no weight"

    out = tmp_path / "ckpt.json"
    rc = _evaluate_greedy_from_the_cli(trial, out)
    assert rc == 0
    data = json.loads(out.read_text())
    s = data["settings"]
    assert s["checkpoint"]["algorithm"] == "GRPO" and s["checkpoint"]["path"] == str(path)
    assert s["instruction"] == "Answer in \\boxed{}."  # the checkpoint's prompt settings
    assert s["max_new_tokens"] == 8  # the checkpoint's max_response_tokens
    assert data["sources"]["arithmetic"]["k"] == 1  # greedy: one sample per question
    assert data["sources"]["arithmetic"]["n_questions"] == 6

    # the (model, tokenizer) form gives the same greedy answers as the checkpoint form
    report = evaluate((model, tokenizer), ["arithmetic"], limit=6, temperature=0, max_new_tokens=8, instruction="Answer in \\boxed{}.")
    assert [q.answers for q in report.questions] == [q["answers"] for q in data["questions"]]
    # sampling is seeded: the same seed gives the same samples
    r1 = evaluate((model, tokenizer), ["arithmetic"], limit=3, k=2, max_new_tokens=8, seed=3)
    r2 = evaluate((model, tokenizer), ["arithmetic"], limit=3, k=2, max_new_tokens=8, seed=3)
    assert [q.response_tokens for q in r1.questions] == [q.response_tokens for q in r2.questions]
    assert r1.sources["arithmetic"]["k"] == 2 and set(r1.sources["arithmetic"]["pass_at_k"]) == {"1", "2"}
