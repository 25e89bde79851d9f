"""``rllib train file X.yaml --rehearse``: every recipe runs in shape on a CPU.

The rules (``rllib_exgrpo/cli/rehearsal.py``) on hand-made experiment files, the stand-in
reward, and then every file in ``tuned_examples/`` through the real command: 2 iterations
with a checkpoint, then ``--resume`` to a third; a recipe whose restore path another recipe
already resumes (:data:`RESUME_SHOWN_BY`) runs its 3 iterations in one go, checkpoint at the
end (the GRPO / PPO twins of the ExGRPO GPU recipes: in tests/test_twins.py). The recipes that sample with vLLM rehearse
with vLLM's CPU build, in its own virtualenv (marked ``vllm``; see ``tests/run.sh``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from rllib_exgrpo.envs.rewards import rehearsal_score
from rllib_exgrpo.cli.rehearsal import (
    DEFAULT_ITERATIONS,
    ROWS_PER_ITERATION,
    SUFFIX,
    TOKEN_CAPS,
    VLLM_CPU_KWARGS,
    rehearse_experiments,
)

REPO = Path(__file__).resolve().parents[1]
#: The GRPO / PPO twins of the ExGRPO GPU recipes rehearse in tests/test_twins.py (an iteration:
#: the checkpoint and resume paths are their ExGRPO recipe's, rehearsed here).
TWINS = {p.name for pattern in ("grpo_qwen*.yaml", "ppo_qwen*.yaml") for p in (REPO / "tuned_examples").glob(pattern)}
RECIPES = sorted(p for p in (REPO / "tuned_examples").glob("*.yaml") if p.name not in TWINS)
#: Recipe -> the recipe whose ``--resume`` restores the same state the same way: only the
#: data set, reward, model family or the search around it differs, and the checkpoint holds
#: the same components (pool, sampler position, planner, learner shards). These rehearse
#: their 3 iterations without the second start (each costs every actor again: 10-110 s).
RESUME_SHOWN_BY = {
    "grpo_operators_tiny": "grpo_tiny",  # another data set
    "grpo_custom_reward_tiny": "grpo_tiny",  # another reward
    "grpo_smollm2_cpu": "grpo_tiny",  # another model family (Llama), the same state
    "grpo_finite_tiny": "exgrpo_finite_tiny",  # the finite set's position, without the pool
    "grpo_stream_tiny": "exgrpo_stream_tiny",  # the stream's position, without the pool
    "exgrpo_operators_tiny": "exgrpo_tiny",
    "exgrpo_smollm2_cpu": "exgrpo_tiny",
    "xrpo_tiny": "exgrpo_xrpo_tiny",  # the planner's state, without the pool
    "ppo_smollm2_cpu": "ppo_tiny",
    # The 4-runner / 4-learner layout of exgrpo_qwen at ZeRO-2 (stage-2 shards written and
    # read back by each learner: tests/test_sharded_checkpoints.py).
    "exgrpo_qwen1.5b": "exgrpo_qwen",
    # ZeRO-3 learners restored as in exgrpo_qwen; colocated samplers after a restore (their
    # engine or copy refilled from the restored weights): tests/test_colocate.py.
    "exgrpo_qwen_colocate": "exgrpo_qwen",
    # One colocated LoRA learner with vLLM: the 7B's untied head, or a one-trial search.
    "exgrpo_qwen_lora_1gpu": "exgrpo_qwen1.5b_lora_24gb",
    "exgrpo_qwen1.5b_lora_tune": "exgrpo_qwen1.5b_lora_24gb",
}


def _one(spec, **kw):
    data, swaps = rehearse_experiments({"x": spec}, **kw)
    assert list(data) == [f"x{SUFFIX}"]
    return data[f"x{SUFFIX}"], {s.key: s for s in swaps[f"x{SUFFIX}"]}


GPU_SPEC = {
    "run": "ExGRPO",
    "env": "rllib_exgrpo.envs.reasoning_env:ReasoningEnv",
    "stop": {"training_iteration": 701},
    "config": {
        "env_config": {"dataset": "/no/such/train.parquet"},
        "model_name_or_path": "Qwen/Qwen2.5-Math-7B",
        "model_dtype": "bfloat16",
        "learner_backend": "deepspeed",
        "deepspeed_zero_stage": 3,
        "generation_backend": "vllm",
        "vllm_kwargs": {"gpu_memory_utilization": 0.5, "max_num_seqs": 256},
        "questions_per_step": 128,
        "group_size": 8,
        "minibatch_size": 128,
        "learner_micro_batch_rows": 4,
        "max_prompt_tokens": 1024,
        "max_response_tokens": 8192,
        "behaviour_logprobs": "recompute",
        "heldout_dataset": "/no/such/valid.parquet",
        "heldout_num_questions": 500,
        "heldout_interval": 50,
        "num_env_runners": 4,
        "num_gpus_per_env_runner": 1,
        "num_learners": 4,
        "num_gpus_per_learner": 1,
    },
}


def test_a_gpu_recipe_keeps_its_structure_and_swaps_what_a_cpu_cannot_hold():
    spec, swaps = _one(GPU_SPEC, vllm=False)
    c = spec["config"]
    # Kept as written: dtype, learner backend and stage, counts, micro-batches, log-prob mode.
    for key in (
        "model_dtype",
        "learner_backend",
        "deepspeed_zero_stage",
        "num_env_runners",
        "num_learners",
        "learner_micro_batch_rows",
        "behaviour_logprobs",
        "group_size",
    ):
        assert c[key] == GPU_SPEC["config"][key], key
        assert key not in swaps
    # The vocabulary and tying of the recipe's model are kept (published shapes table).
    assert c["model_name_or_path"] == "rehearsal:qwen2:vocab=152064,untied"
    assert c["num_gpus_per_env_runner"] == c["num_gpus_per_learner"] == 0
    assert c["max_prompt_tokens"] == TOKEN_CAPS["max_prompt_tokens"]
    assert c["max_response_tokens"] == TOKEN_CAPS["max_response_tokens"]
    assert c["generation_backend"] == "hf" and "vllm_kwargs" not in c
    assert "not installed" in swaps["generation_backend"].why
    assert c["env_config"]["dataset"] == c["heldout_dataset"] == "arithmetic"
    # The stand-in reward is selected as any reward is; math-verify still runs, at weight 0.
    assert c["env_config"]["reward_fns"] == ["math", "rehearsal"] and c["env_config"]["reward_weights"] == [0.0, 1.0]
    assert spec["stop"] == {"training_iteration": DEFAULT_ITERATIONS}
    assert spec["checkpoint_config"]["checkpoint_at_end"] is True
    # Fewer completions, the same optimiser steps per iteration and >= 2 passes per step.
    rows = c["questions_per_step"] * c["group_size"]
    assert rows <= ROWS_PER_ITERATION
    steps = lambda q, m: q * 8 / (m * 4)  # noqa: E731
    assert steps(c["questions_per_step"], c["minibatch_size"]) == steps(128, 128) == 2
    assert c["minibatch_size"] >= 2 * c["learner_micro_batch_rows"]
    assert c["heldout_num_questions"] <= 8 and c["heldout_interval"] == 2
    # A token budget scales with the token limits: the same rows per pass at full width.
    tokens = dict(
        GPU_SPEC,
        config={**{k: v for k, v in GPU_SPEC["config"].items() if k != "learner_micro_batch_rows"}, "learner_micro_batch_tokens": 32768},
    )
    t_spec, t_swaps = _one(tokens, vllm=False)
    budget = t_spec["config"]["learner_micro_batch_tokens"]
    assert budget == round(32768 * (128 + 16) / 9216) and "same rows per pass" in t_swaps["learner_micro_batch_tokens"].why
    assert t_spec["config"]["minibatch_size"] >= 2 * (budget // (128 + 16))
    # One line per swap, naming the key, the values and why.
    line = swaps["model_name_or_path"].line()
    assert "Qwen/Qwen2.5-Math-7B" in line and "rehearsal:qwen2:vocab=152064,untied" in line and "no download" in line
    assert "vocabulary of 152,064 and untied embeddings kept" in line
    tied, _ = _one({**GPU_SPEC, "config": {**GPU_SPEC["config"], "model_name_or_path": "Qwen/Qwen2.5-Math-1.5B"}}, vllm=False)
    assert tied["config"]["model_name_or_path"] == "rehearsal:qwen2:vocab=151936,tied"


def test_with_vllm_installed_the_engine_stays_and_its_cache_is_sized_in_bytes():
    spec, swaps = _one(GPU_SPEC, vllm=True)
    c = spec["config"]
    assert c["generation_backend"] == "vllm" and "generation_backend" not in swaps
    assert c["vllm_kwargs"] == {"max_num_seqs": 256, **VLLM_CPU_KWARGS}
    assert "sleep" not in swaps["vllm_kwargs"].why
    colocated = {**GPU_SPEC, "config": {**GPU_SPEC["config"], "colocate": True, "num_env_runners": 0}}
    _, swaps = _one(colocated, vllm=True)
    assert "no sleep mode, so each learner's engine skips its sleep and wake calls" in swaps["vllm_kwargs"].why
    # More colocated learners than engines a CPU machine holds: HF in each learner, said.
    eight = {**colocated, "config": {**colocated["config"], "num_learners": 8}}
    spec, swaps = _one(eight, vllm=True)
    assert spec["config"]["generation_backend"] == "hf" and "vllm_kwargs" not in spec["config"]
    assert "8 vLLM engines" in swaps["generation_backend"].why


def test_overrides_stop_and_search_spaces():
    spec, swaps = _one(GPU_SPEC, vllm=False, config_overrides={"max_response_tokens": 12, "num_learners": 2}, stop_given=True)
    c = spec["config"]
    assert c["max_response_tokens"] == 12 and "max_response_tokens" not in swaps
    assert c["num_learners"] == 2
    assert spec["stop"] == GPU_SPEC["stop"] and "stop" not in swaps  # the command line's --stop is merged later
    searched = {**GPU_SPEC, "config": {**GPU_SPEC["config"], "questions_per_step": {"grid_search": [64, 128]}}}
    spec, swaps = _one({**searched, "num_samples": 3}, vllm=False)
    # A search rehearses as one trial: its first value, then scaled like any value.
    assert spec["num_samples"] == 1 and "num_samples" in swaps
    assert isinstance(spec["config"]["questions_per_step"], int) and spec["config"]["questions_per_step"] <= 64


def test_rllib_ppo_on_the_llm_runner_and_a_non_llm_recipe():
    ppo = yaml.safe_load((REPO / "tuned_examples" / "ppo_tiny.yaml").read_text())["ppo-tiny"]
    spec, swaps = _one(ppo, vllm=False)
    c = spec["config"]
    assert c["model_config"]["model"] == "rehearsal:qwen2:tied"  # the tiny model's own tokenizer and tying
    assert c["model_config"]["max_response_tokens"] == TOKEN_CAPS["max_response_tokens"]
    assert c["train_batch_size_per_learner"] == ROWS_PER_ITERATION
    assert c["minibatch_size"] == 128  # 256 -> 128 with the batch: the same 1 step per iteration
    cartpole = {"run": "PPO", "env": "CartPole-v1", "config": {"num_gpus_per_learner": 1, "lr": 0.001}}
    spec, swaps = _one(cartpole, vllm=False)
    assert spec["config"] == {"num_gpus_per_learner": 0, "lr": 0.001}
    assert set(swaps) == {"num_gpus_per_learner", "checkpoint_config.checkpoint_at_end", "stop"}


def test_the_recipes_own_rewards_keep_running_at_weight_zero():
    from rllib_exgrpo.envs.reasoning_env import validate_config

    for env_config, fns in [
        ({"reward_fn": "multiple_choice"}, ["multiple_choice"]),
        ({"reward_fns": ["math", "format"], "reward_weights": [0.9, 0.1]}, ["math", "format"]),
    ]:
        spec = {**GPU_SPEC, "config": {**GPU_SPEC["config"], "env_config": {"dataset": "arithmetic", **env_config}}}
        rehearsed, swaps = _one(spec, vllm=False)
        now = rehearsed["config"]["env_config"]
        assert "reward_fn" not in now
        assert now["reward_fns"] == fns + ["rehearsal"] and now["reward_weights"] == [0.0] * len(fns) + [1.0]
        assert "rehearsal" in swaps["env_config.reward_fns"].why
        validate_config(now)  # the env takes it as written
    already = {**GPU_SPEC, "config": {**GPU_SPEC["config"], "env_config": {"reward_fn": "rehearsal"}}}
    rehearsed, swaps = _one(already, vllm=False)
    assert rehearsed["config"]["env_config"]["reward_fn"] == "rehearsal" and "env_config.reward_fns" not in swaps


def test_rehearsal_reward_is_deterministic_and_varied():
    questions = [f"q{i}" for i in range(200)]
    rewards = np.array([[rehearsal_score(q, f"completion {j}") for j in range(8)] for q in questions])
    assert set(np.unique(rewards)) == {0.0, 1.0}
    assert 0.55 < rewards.mean() < 0.7
    per_question = rewards.mean(axis=1)
    assert per_question.std() > 0.15  # questions differ: buckets of every correctness fill
    assert ((per_question > 0) & (per_question < 1)).mean() > 0.6  # most groups have variance
    assert rehearsal_score("q1", "same text") == rehearsal_score("q1", "same text")


# --------------------------------------------------------------- every recipe, end to end
def _recipe_params():
    params = []
    for path in RECIPES:
        text = path.read_text()
        marks = [pytest.mark.slow]
        if "generation_backend: vllm" in text:
            marks.append(pytest.mark.vllm)  # rehearsed with vLLM's CPU build (tests/run.sh)
        params.append(pytest.param(path, marks=marks, id=path.stem))
    return params


def _results(storage: Path, name: str):
    rows = []
    for f in sorted((storage / name).glob("*/result.json")):
        rows.append([json.loads(line) for line in f.read_text().splitlines() if line.strip()])
    return rows


def test_each_recipe_that_skips_the_resume_names_one_that_resumes():
    names = {p.stem for p in RECIPES}
    for recipe, shown_by in RESUME_SHOWN_BY.items():
        assert recipe in names and shown_by in names and shown_by not in RESUME_SHOWN_BY, (recipe, shown_by)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("recipe", _recipe_params())
def test_every_recipe_rehearses_checkpoints_and_resumes(recipe, tmp_path, capsys):
    from rllib_exgrpo.cli.main import main

    storage = tmp_path / "results"
    common = ["train", "file", str(recipe), "--rehearse", "--storage-path", str(storage)]
    resumes = recipe.stem not in RESUME_SHOWN_BY
    assert main(common + ["--stop", '{"training_iteration": %d}' % (2 if resumes else 3)]) == 0
    err = capsys.readouterr().err
    assert "rehearsal:" in err and "model" in err  # the swaps were said
    if (
        "colocate: true" in recipe.read_text()
        and "generation_backend: 'vllm' -> 'hf'" not in err
        and "generation_backend: vllm" in recipe.read_text()
    ):
        assert "skips its sleep and wake calls" in err, err  # vLLM's CPU build has no sleep mode
    name = next(iter(yaml.safe_load(recipe.read_text()))) + SUFFIX
    trials = _results(storage, name)
    assert trials and all(rows[-1]["training_iteration"] == (2 if resumes else 3) for rows in trials)
    if "colocate: true" in recipe.read_text() and (
        "deepspeed_zero_stage: 3" in recipe.read_text() or "generation_backend: 'vllm' -> 'hf'" not in err
    ):
        # The learners' turns offloaded the optimizer state (DeepSpeed's offload and reload
        # under ZeRO-3): the bytes moved reach the results.
        assert all(rows[-1]["env_runners"]["optimizer_offload_bytes"] > 0 for rows in trials), trials
    assert all(list((storage / name).glob("*/checkpoint_*")) for _ in trials)

    if resumes:
        assert main(common + ["--resume", "--stop", '{"training_iteration": 3}']) == 0
        trials = _results(storage, name)
    for rows in trials:
        iterations = [r["training_iteration"] for r in rows]
        assert iterations == [1, 2, 3], iterations
    spec = next(iter(yaml.safe_load(recipe.read_text()).values()))
    cfg = spec.get("config", {})
    if spec["run"] == "ExGRPO" and cfg.get("experience_replay", True):
        # The delayed start fired and replayed rows reached the learners by iteration 3.
        third = [rows[2] for rows in trials]
        assert any(r["experience"]["replayed_questions"] > 0 for r in third), [r["experience"] for r in third]
        assert any(r["learners"]["default_policy"]["replayed_token_fraction"] > 0 for r in third)


#: A recipe nobody wrote for this test suite's sake: another architecture family, learner
#: backend and ZeRO stage, other runner / learner counts and micro-batches.
UNWRITTEN = {
    "llama-zero1": {
        "run": "ExGRPO",
        "env": "rllib_exgrpo.envs.reasoning_env:ReasoningEnv",
        "stop": {"training_iteration": 500},
        "checkpoint_config": {"checkpoint_frequency": 1},
        "config": {
            "seed": 3,
            "env_config": {"dataset": "/data/missing/train.parquet"},
            "model_name_or_path": "meta-llama/Llama-3.2-3B",
            "model_dtype": "bfloat16",
            "learner_backend": "deepspeed",
            "deepspeed_zero_stage": 1,
            "gradient_checkpointing": True,
            "questions_per_step": 96,
            "group_size": 4,
            "minibatch_size": 64,
            "learner_micro_batch_rows": 2,
            "max_prompt_tokens": 2048,
            "max_response_tokens": 4096,
            "delayed_start_solve_rate": 0.2,
            "trajectory_selection": "random",
            "num_env_runners": 1,
            "num_gpus_per_env_runner": 1,
            "num_learners": 3,
            "num_gpus_per_learner": 1,
        },
    },
}


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(None, id="llama-deepspeed-zero1-3-learners"),
        # The 7B recipe's structure on the DDP learner (bf16 with fp32 master weights), 2 learners.
        pytest.param({"learner_backend": "ddp", "num_learners": 2, "num_env_runners": 1}, id="ddp-bf16-2-learners"),
    ],
)
def test_a_recipe_nobody_wrote_rehearses(overrides, tmp_path, capsys):
    from rllib_exgrpo.cli.main import main

    path = tmp_path / "unwritten.yaml"
    path.write_text(yaml.safe_dump(UNWRITTEN))
    storage = tmp_path / "results"
    args = ["train", "file", str(path), "--rehearse", "--storage-path", str(storage), "--stop", '{"training_iteration": 3}']
    if overrides:
        args += ["--config", json.dumps(overrides)]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "'meta-llama/Llama-3.2-3B' -> 'rehearsal:llama'" in err
    (rows,) = _results(storage, f"llama-zero1{SUFFIX}")
    assert [r["training_iteration"] for r in rows] == [1, 2, 3]
    assert rows[-1]["optimizer_steps"] == 96 * 4 / (64 * (overrides or {}).get("num_learners", 3))
    assert rows[-1]["experience"]["replayed_questions"] > 0
