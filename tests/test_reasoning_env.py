"""ReasoningEnv: gymnasium-valid text spaces, question selection, rewards, no leaked answers."""

from __future__ import annotations

import pytest
from gymnasium.utils.env_checker import check_env

from rllib_exgrpo.envs import ReasoningEnv, arithmetic, render_prompt
from rllib_exgrpo.envs.prompting import DEFAULT_INSTRUCTION
from rllib_exgrpo.envs.rewards import RewardResult

SMALL = "arithmetic:n=40,n_test=10,seed=0"
STEP_INFO_KEYS = {"question_id", "data_source", "parsed", "timed_out", "format_ok", "error", "correct", "completion_truncated"}


def _no_truth_leak(env, obs, info, problem):
    assert set(info) <= STEP_INFO_KEYS
    assert not any("truth" in k or "answer" in k for k in info)
    assert obs == env.prompt_for(problem.id) == render_prompt(problem.question)


def test_check_env_arithmetic():
    env = ReasoningEnv({"dataset": "arithmetic:levels=1-6,n=300,n_test=30"})
    check_env(env.unwrapped, skip_render_check=True)
    assert all(c in env.observation_space.character_set for c in "+-*/^$\\{}")


@pytest.mark.parametrize(
    "relpath", ["simplerl_eval/math500_test.jsonl", "luffy_exgrpo/ExGRPO_data_valid.parquet", "simplerl_eval/gsm8k_test.jsonl"]
)
def test_check_env_shared_data(shared_data, relpath):
    env = ReasoningEnv({"dataset": str(shared_data / relpath)})
    check_env(env.unwrapped, skip_render_check=True)
    for _ in range(50):
        obs, _ = env.reset()
        assert obs in env.observation_space


def test_reset_with_question_id_and_no_leak():
    env = ReasoningEnv({"dataset": SMALL})
    for problem in env.problems[:10]:
        obs, info = env.reset(options={"question_id": problem.id})
        assert info == {"question_id": problem.id, "data_source": "arithmetic"}
        _no_truth_leak(env, obs, info, problem)
        obs, reward, terminated, truncated, info = env.step(f"so \\boxed{{{problem.ground_truth}}}")
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert info["question_id"] == problem.id and info["correct"] and info["format_ok"]
        _no_truth_leak(env, obs, info, problem)
        env.reset(options={"question_id": problem.id})
        _, reward, _, _, info = env.step("I think \\boxed{-1}")
        assert reward == 0.0 and not info["correct"] and info["parsed"] == "-1"
    with pytest.raises(KeyError, match="unknown question id"):
        env.reset(options={"question_id": "nope"})
    with pytest.raises(ValueError, match="unknown reset option"):
        env.reset(options={"question": "x"})


def test_sampler_cycles_epochs_and_is_seeded():
    env = ReasoningEnv({"dataset": SMALL, "seed": 3})
    ids = {p.id for p in env.problems}
    epoch1 = [env.reset()[1]["question_id"] for _ in range(40)]
    epoch2 = [env.reset()[1]["question_id"] for _ in range(40)]
    assert set(epoch1) == set(epoch2) == ids and epoch1 != epoch2
    again = ReasoningEnv({"dataset": SMALL, "seed": 3})
    assert [again.reset()[1]["question_id"] for _ in range(40)] == epoch1
    other = ReasoningEnv({"dataset": SMALL, "seed": 4})
    assert [other.reset()[1]["question_id"] for _ in range(40)] != epoch1
    first = env.reset(seed=11)[1]["question_id"]
    env.reset()
    assert env.reset(seed=11)[1]["question_id"] == first


def test_config_validation():
    with pytest.raises(ValueError, match=r"unknown ReasoningEnv config key\(s\) \['datset'\].*known keys: .*'dataset'"):
        ReasoningEnv({"datset": "arithmetic"})
    with pytest.raises(ValueError, match="reward_timeout_s"):
        ReasoningEnv({"reward_timeout_s": 0})
    with pytest.raises(ValueError, match="problems"):
        ReasoningEnv({"problems": ["not a problem"]})
    with pytest.raises(ValueError, match="skip"):
        ReasoningEnv({"dataset": SMALL, "skip": -2})
    full = ReasoningEnv({"dataset": SMALL, "split": "test"})
    rest = ReasoningEnv({"dataset": SMALL, "split": "test", "skip": 5, "limit": 3})
    assert [p.id for p in rest.problems] == [p.id for p in full.problems[5:8]]
    env = ReasoningEnv()  # no config: the default arithmetic training set
    assert len(env.problems) == 5000 and env.config["instruction"] == DEFAULT_INSTRUCTION


def test_step_before_reset_and_twice():
    env = ReasoningEnv({"dataset": SMALL})
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("\\boxed{1}")
    env.reset()
    env.step("\\boxed{1}")
    with pytest.raises(RuntimeError, match="reset"):
        env.step("\\boxed{1}")
    env.reset()
    with pytest.raises(TypeError):
        env.step(42)


def test_problems_override_helpers_and_batch_score():
    problems = arithmetic.generate(6, seed=9)
    env = ReasoningEnv({"problems": problems, "instruction": None, "system_prompt": "Be exact."})
    assert env.problems == problems
    p = problems[0]
    assert env.get_problem(p.id) is p
    assert env.prompt_for(p.id) == render_prompt(p.question, system_prompt="Be exact.", instruction=None)
    with pytest.raises(KeyError, match="unknown question id"):
        env.get_problem("missing")
    ids = [q.id for q in problems] * 2
    completions = [f"\\boxed{{{q.ground_truth}}}" for q in problems] + ["\\boxed{-5}"] * 6
    results = env.score(ids, completions)
    assert all(isinstance(r, RewardResult) for r in results)
    assert [r.score for r in results] == [1.0] * 6 + [0.0] * 6
    for qid, completion, batched in zip(ids, completions, results):
        env.reset(options={"question_id": qid})
        _, reward, _, _, info = env.step(completion)
        assert reward == batched.score and info["parsed"] == batched.parsed


def test_length_limits():
    problems = arithmetic.generate(5, seed=1, levels=(5,))
    short_q = min(problems, key=lambda p: len(p.question))
    limit = len(render_prompt(short_q.question))
    env = ReasoningEnv({"problems": problems, "max_prompt_chars": limit, "max_completion_chars": 100})
    assert short_q.id in {p.id for p in env.problems}
    assert env.dropped_long_prompts == len(problems) - len(env.problems)
    dropped = next((p for p in problems if p.id not in {q.id for q in env.problems}), None)
    if dropped is not None:
        with pytest.raises(KeyError, match="max_prompt_chars"):
            env.get_problem(dropped.id)
    env.reset(options={"question_id": short_q.id})
    _, reward, _, _, info = env.step("x" * 500 + f" \\boxed{{{short_q.ground_truth}}}")
    assert reward == 1.0 and info["completion_truncated"]


def test_think_format_env():
    env = ReasoningEnv({"dataset": SMALL, "think_format": True})
    obs, info = env.reset()
    assert "<think>" in obs
    truth = env.get_problem(info["question_id"]).ground_truth
    _, reward, _, _, step_info = env.step(f"\\boxed{{{truth}}}")  # no </think>: official reward 0
    assert reward == 0.0 and not step_info["format_ok"]
    env.reset(options={"question_id": info["question_id"]})
    assert env.step(f"<think>easy</think> \\boxed{{{truth}}}")[1] == 1.0


def _tiny_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(tmp_path / "tok")
    return fast, tmp_path / "tok"


def test_tokenizer_object_and_path(tmp_path):
    fast, path = _tiny_tokenizer(tmp_path)
    by_object = ReasoningEnv({"dataset": SMALL, "tokenizer": fast, "system_prompt": "Think."})
    by_path = ReasoningEnv({"dataset": SMALL, "tokenizer": str(path), "system_prompt": "Think."})
    p = by_object.problems[0]
    expected = render_prompt(p.question, tokenizer=fast, system_prompt="Think.")
    assert expected.startswith("<|im_start|>system\nThink.<|im_end|>")
    assert by_object.prompt_for(p.id) == by_path.prompt_for(p.id) == expected
    check_env(by_path.unwrapped, skip_render_check=True)
    with pytest.raises(ValueError, match="could not load tokenizer"):
        ReasoningEnv({"dataset": SMALL, "tokenizer": str(tmp_path / "absent")})


def test_rllib_env_context():
    env_context = pytest.importorskip("ray.rllib.env.env_context")
    ctx0 = env_context.EnvContext({"dataset": SMALL, "seed": 1}, worker_index=1, vector_index=0)
    ctx1 = env_context.EnvContext({"dataset": SMALL, "seed": 1}, worker_index=2, vector_index=0)
    a, b = ReasoningEnv(ctx0), ReasoningEnv(ctx1)
    order_a = [a.reset()[1]["question_id"] for _ in range(10)]
    order_b = [b.reset()[1]["question_id"] for _ in range(10)]
    assert order_a != order_b  # env runners draw different orders from one config
    with pytest.raises(ValueError, match="unknown ReasoningEnv config key"):
        ReasoningEnv(env_context.EnvContext({"dataset": SMALL, "typo": 1}, worker_index=0))
