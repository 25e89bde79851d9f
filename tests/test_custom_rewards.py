"""Reward functions of your own: ``env_config.reward_fn`` / ``reward_fns`` / ``reward_weights``.

The built-ins and the examples on hand-made strings, the env on a few rows (weights,
per-function metrics, row fields as keywords, crash and hang counting, rehearsal), the
config check before anything starts, and one real training iteration.
"""

from __future__ import annotations

import textwrap
import time

import pytest

from rllib_exgrpo.envs import reward_examples as ex
from rllib_exgrpo.envs.problem import Problem
from rllib_exgrpo.envs.reasoning_env import ReasoningEnv, validate_config
from rllib_exgrpo.envs.rewards import (
    extract_choice,
    format_reward,
    load_reward_fn,
    multiple_choice_reward,
    rehearsal_score,
    reset_reward_stats,
    reward_labels,
    reward_stats,
    score_with_fns,
)

MODULE = "custom_rewards_under_test"

#: Reward functions the env imports by path (in the verifier workers too).
SOURCE = textwrap.dedent("""
    import time

    def quarter(completion, ground_truth):
        return 0.25

    def half_if_long(completion):
        return 0.5 if len(completion) > 3 else 0.0

    def sees_row(completion, ground_truth, question, question_id, data_source, topic=None):
        # no **kwargs: only these keywords are passed
        return 1.0 if (question_id == "r-0" and data_source == "unit" and topic == "algebra"
                       and question.startswith("What")) else 0.0

    def takes_all(completion, **row):
        return float(len(row))

    def boom(completion, **row):
        raise RuntimeError("reward function bug on " + row["question_id"])

    def hang(completion):
        time.sleep(60)
        return 1.0

    def not_a_number(completion):
        return "1.0"

    NOT_CALLABLE = 3

    def no_completion(text):
        return 1.0
""")


@pytest.fixture(scope="module")
def fns_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rewards")
    (folder / f"{MODULE}.py").write_text(SOURCE)
    import sys

    sys.path.insert(0, str(folder))
    yield MODULE
    sys.path.remove(str(folder))
    sys.modules.pop(MODULE, None)


def problems(n=2):
    return [
        Problem(id=f"r-{i}", question=f"What is {i} + 1?", ground_truth=str(i + 1), data_source="unit", extra={"topic": "algebra"})
        for i in range(n)
    ]


def env(**cfg):
    return ReasoningEnv({"problems": problems(), "reward_timeout_s": 2.0, **cfg})


# ------------------------------------------------------------------ built-ins, pure
@pytest.mark.parametrize(
    "text, letter",
    [
        ("so \\boxed{C}", "C"),
        ("\\boxed{(b)}", "B"),
        ("\\boxed{\\text{D}}", "D"),
        ("\\boxed{C) 42}", "C"),
        ("\\boxed{A} at first, then \\boxed{E}", "E"),
        ("\\boxed{42}", None),  # a box that holds no letter: no guessing from the rest
        ("Answer: C", "C"),
        ("I think the answer is (B).", "B"),
        ("The final answer is **D**", "D"),
        ("answer: option J", "J"),
        ("The answer is B, not A... no wait, the answer is A.", "A"),
        ("Options (A) and (C) are wrong; it must be (D)", "D"),
        ("C", "C"),
        ("  (G).  ", "G"),
        ("the answer is a car", None),  # lower case outside a box is an article
        ("Answer: Dogs", None),
        ("no letter here", None),
        ("(K)", None),  # outside A-J
    ],
)
def test_extract_choice(text, letter):
    assert extract_choice(text) == letter


def test_extract_choice_reads_after_the_think_block():
    text = "<think>maybe (A)? the answer is B</think> Answer: C"
    assert extract_choice(text) == "C"
    assert extract_choice(text, think_format=True) == "C"
    assert extract_choice("<think>the answer is B", think_format=True) is None
    assert extract_choice("the answer is B", think_format=True) is None


def test_multiple_choice_reward():
    assert multiple_choice_reward("\\boxed{C}", "C") == 1.0
    assert multiple_choice_reward("\\boxed{C}", "(c)") == 1.0
    assert multiple_choice_reward("the answer is B", "C") == 0.0
    assert multiple_choice_reward("nothing", "C") == 0.0
    with pytest.raises(ValueError, match="letter A-J"):
        multiple_choice_reward("\\boxed{C}", "42")


@pytest.mark.parametrize(
    "text, think, expected",
    [
        ("so \\boxed{5}", False, 1.0),
        ("so \\boxed{5}.", False, 1.0),
        ("no box, 5", False, 0.0),
        ("\\boxed{4} or \\boxed{5}", False, 0.0),  # exactly one answer
        ("\\boxed{}", False, 0.0),  # empty
        ("\\boxed{5", False, 0.0),  # cut off
        ("<think>\\boxed{4}?</think> \\boxed{5}", False, 1.0),  # boxes in the think block do not count
        ("<think>still thinking \\boxed{5}", False, 0.0),  # an open think block
        ("<think>a</think><think>b</think> \\boxed{5}", False, 0.0),
        ("<think>why</think>\n\\boxed{5}", True, 1.0),
        ("reasoning</think>\n\\boxed{5}", True, 1.0),  # the template opened the block
        ("\\boxed{5}", True, 0.0),  # think format needs the block
        ("<think>why</think> 5", True, 0.0),
    ],
)
def test_format_reward(text, think, expected):
    assert format_reward(text, think_format=think) == expected


def test_labels_and_loading():
    assert reward_labels(["math", "a.b:exact_match", "c:exact_match", "m:Cls.score"]) == ["math", "exact_match", "exact_match_2", "score"]
    fn, accepted = load_reward_fn("rllib_exgrpo.envs.reward_examples:keyword_match")
    assert fn is ex.keyword_match and accepted == {"completion", "ground_truth", "keywords"}
    assert load_reward_fn("format")[1] is None  # **kwargs: everything is passed
    for bad, why in [
        ("nocolon", "package.module:function"),
        ("no_such_mod:f", "ModuleNotFoundError"),
        ("rllib_exgrpo.envs.rewards:nope", "no attribute 'nope'"),
        ("rllib_exgrpo.envs.rewards:CHOICE_LETTERS", "not a function"),
        ("rllib_exgrpo.envs.rewards:last_boxed", "no 'completion' keyword"),
    ]:
        with pytest.raises(ValueError, match=why):
            load_reward_fn(bad)


def test_examples():
    assert ex.exact_match("so \\boxed{ Paris. }", "paris") == 1.0
    assert ex.exact_match("it is 12 apples", "12") == 1.0  # no box: the last number
    assert ex.exact_match("\\boxed{0.5}", "1/2") == 0.0
    assert ex.exact_match("<think>7</think> nothing", "7") == 0.0
    assert ex.keyword_match("Chlorophyll drives photosynthesis.", "", keywords="photosynthesis, chlorophyll") == 1.0
    assert ex.keyword_match("photosynthetic", "", keywords="photosynthesis,light") == 0.0
    assert ex.keyword_match("It is Paris", "paris") == 1.0
    assert ex.short_answer("x" * 10) == 1.0 and ex.short_answer("x" * 300) == 0.5 and ex.short_answer("x" * 500) == 0.0


# ------------------------------------------------------------------ config
def test_config_checks_name_the_key(fns_module):
    assert validate_config({})["reward_fn"] is None  # nothing set: math-verify, as always
    cases = [
        ({"reward_fn": "x.y:z"}, "'reward_fn' cannot import 'x.y:z': ModuleNotFoundError"),
        ({"reward_fn": f"{fns_module}:NOT_CALLABLE"}, "not a function"),
        ({"reward_fns": ["math", "x.y:z"]}, r"'reward_fns' cannot import 'x.y:z' \(entry 2\)"),
        ({"reward_fn": "math", "reward_fns": ["format"]}, "cannot be set together with reward_fns"),
        ({"reward_fns": ["math", "format"], "reward_weights": [1.0]}, "'reward_weights' must be a list of 2"),
        ({"reward_fn": "format", "reward_weights": [1.0]}, "only with reward_fns"),
        ({"reward_fns": []}, "'reward_fns' must be a non-empty list"),
        ({"reward_fn": 3}, "'reward_fn' must be"),
    ]
    for cfg, match in cases:
        with pytest.raises(ValueError, match=match):
            validate_config(cfg)


def test_a_bad_reward_fn_is_one_cli_error_line_before_anything_starts(tmp_path, capsys):
    from rllib_exgrpo.cli.main import main

    f = tmp_path / "bad.yaml"
    f.write_text(
        textwrap.dedent("""
        bad:
          run: GRPO
          env: rllib_exgrpo.envs.reasoning_env:ReasoningEnv
          stop: {training_iteration: 1}
          config:
            env_config: {dataset: arithmetic, reward_fn: "no_such_package.rewards:score"}
            model_name_or_path: tiny
    """)
    )
    assert main(["train", "file", str(f), "--storage-path", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("rllib train: error: ")
    assert ("config.env_config.reward_fn: cannot import 'no_such_package.rewards:score': ModuleNotFoundError") in err[0]
    assert not (tmp_path / "r").exists()  # nothing started


# ------------------------------------------------------------------ the env
def test_default_is_math_verify_unchanged():
    e = env()
    [r] = e.score(["r-0"], ["\\boxed{1}"])
    assert r.score == 1.0 and r.components is None and e.reward_metrics() == {}


def test_constant_reward_fn_and_row_fields(fns_module):
    e = env(reward_fn=f"{fns_module}:quarter")
    results = e.score(["r-0", "r-1"], ["\\boxed{1}", "anything"])
    assert [r.score for r in results] == [0.25, 0.25]
    assert not any(r.correct for r in results)  # correct means reward >= 1.0
    assert results[0].components == {"quarter": 0.25}
    assert e.reward_metrics() == {"reward_quarter_mean": 0.25}
    assert e.reward_metrics() == {}  # reset on read

    e = env(reward_fns=[f"{fns_module}:sees_row", f"{fns_module}:takes_all"])
    r0, r1 = e.score(["r-0", "r-1"], ["x", "y"])
    assert r0.components["sees_row"] == 1.0 and r1.components["sees_row"] == 0.0
    # ground_truth, question, question_id, data_source, solution, difficulty, topic
    assert r0.components["takes_all"] == 7.0


def test_weighted_sum_and_a_metric_per_function(fns_module):
    e = env(reward_fns=["math", f"{fns_module}:half_if_long", "format"], reward_weights=[0.5, 2.0, 0.25])
    right, short = e.score(["r-0", "r-1"], ["so \\boxed{1}", "2"])
    assert right.components == {"math": 1.0, "half_if_long": 0.5, "format": 1.0}
    assert right.score == pytest.approx(0.5 * 1.0 + 2.0 * 0.5 + 0.25 * 1.0) and right.correct
    assert short.components == {"math": 0.0, "half_if_long": 0.0, "format": 0.0} and short.score == 0.0
    assert e.reward_metrics() == pytest.approx({"reward_math_mean": 0.5, "reward_half_if_long_mean": 0.25, "reward_format_mean": 0.5})
    # the single-episode API gives the same reward and each function's score in the info
    obs, info = e.reset(options={"question_id": "r-0"})
    _, reward, terminated, _, info = e.step("so \\boxed{1}")
    assert reward == right.score and terminated and info["correct"]
    assert info["reward_math"] == 1.0 and info["reward_half_if_long"] == 0.5


def test_multiple_choice_env():
    e = ReasoningEnv({"problems": [Problem("mc-1", "Which? (A) x (B) y (C) z", "C", "gpqa")], "reward_fn": "multiple_choice"})
    right, wrong = e.score(["mc-1", "mc-1"], ["The answer is (C).", "\\boxed{B}"])
    assert (right.score, right.parsed, wrong.score, wrong.parsed) == (1.0, "C", 0.0, "B")


def test_crash_and_hang_are_counted_and_the_step_goes_on(fns_module):
    e = env(reward_fns=[f"{fns_module}:quarter", f"{fns_module}:boom", f"{fns_module}:not_a_number"], reward_timeout_s=2.0)
    reset_reward_stats()
    results = e.score(["r-0", "r-1"], ["a", "b"])
    stats = reward_stats()
    assert stats["fn_calls"] == 6 and stats["fn_errors"] == stats["errors"] == 4
    for r, qid in zip(results, ["r-0", "r-1"]):
        assert r.components == {"quarter": 0.25, "boom": 0.0, "not_a_number": 0.0} and r.score == 0.25
        assert f"reward 'boom' ({fns_module}:boom): RuntimeError: reward function bug on {qid}" == r.error

    e = env(reward_fns=[f"{fns_module}:hang", f"{fns_module}:quarter"], reward_timeout_s=1.0)
    reset_reward_stats()
    start = time.monotonic()
    results = e.score(["r-0", "r-1"], ["a", "b"])
    elapsed = time.monotonic() - start
    stats = reward_stats()
    assert stats["fn_timeouts"] == stats["timeouts"] == 2 and stats["worker_kills"] == 2
    assert elapsed < 10, elapsed  # cut at the timeout, not after the 60 s sleep
    for r in results:
        assert r.timed_out and r.error is None and r.components == {"hang": 0.0, "quarter": 0.25}
    # the pool goes on: the next call is scored as usual
    assert [r.score for r in e.score(["r-0"], ["c"])] == [0.25]


def test_rehearsal_reward_scores_while_the_functions_still_run(fns_module):
    e = env(reward_fns=[f"{fns_module}:quarter", "rehearsal"], reward_weights=[0, 1])
    completions = [f"text {i}" for i in range(8)]
    results = e.score(["r-0", "r-1"] * 4, completions)
    expected = [rehearsal_score(q, c) for q, c in zip(["r-0", "r-1"] * 4, completions)]
    assert [r.score for r in results] == expected
    assert all(r.components == {"quarter": 0.25, "rehearsal": x} for r, x in zip(results, expected))
    assert e.reward_metrics() == {"reward_quarter_mean": 0.25, "reward_rehearsal_mean": sum(expected) / 8}
    # The stand-in needs the row's question id: without rows the call is an error, not a score.
    (direct,) = score_with_fns(["text"], ["1"], fns=["rehearsal"])
    assert direct.score == 0.0 and "question_id" in direct.error


def test_the_old_rehearsal_flag_says_what_to_write_instead():
    for value in (True, False):
        with pytest.raises(
            ValueError,
            match=r"'rehearsal_reward' is gone: .*reward_fns: \[math, rehearsal\] "
            r"with reward_weights: \[0, 1\]",
        ):
            validate_config({"rehearsal_reward": value})


def test_direct_score_with_fns_lengths():
    with pytest.raises(ValueError, match="2 reward functions but 1 weights"):
        score_with_fns(["a"], ["b"], fns=["format", "math"], weights=[1.0])


# ------------------------------------------------------------------ a real training iteration
@pytest.mark.usefixtures("ray_local")
def test_constant_reward_is_the_iterations_reward_mean(fns_module, quick_tiny_model):
    from rllib_exgrpo.rllib.algorithm import GRPOConfig

    config = (
        GRPOConfig()
        .environment(env_config={"dataset": "arithmetic", "reward_fn": f"{fns_module}:quarter"})
        .env_runners(num_env_runners=0)
        .training(
            model_name_or_path=quick_tiny_model,
            questions_per_step=2,
            group_size=2,
            max_prompt_tokens=128,
            max_response_tokens=8,
            lr=1e-4,
            minibatch_size=4,
            loss_agg_mode="token-mean",
            heldout_interval=0,
        )
    )
    algo = config.build_algo()
    try:
        result = algo.train()
    finally:
        algo.stop()
    assert result["reward_mean"] == 0.25
    assert result["solve_rate"] == 0.0  # 0.25 < 1.0: never correct
    assert result["env_runners"]["episode_return_mean"] == 0.25
    assert result["env_runners"]["reward_errors"] == 0
    assert result["env_runners"]["reward_quarter_mean"] == 0.25  # the function's own metric
