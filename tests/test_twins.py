"""The GRPO and PPO twins of every ExGRPO GPU recipe (``tuned_examples/grpo_qwen*.yaml``,
``tuned_examples/ppo_qwen*.yaml``).

A twin must train on the same data and model, sample the same token budget (questions x
group size x max tokens x iterations), and evaluate on the same held-out set with the same
settings as its ExGRPO recipe, so that the three compare like with like; these tests read the
files and fail on any drift. Each twin's rehearsal runs an iteration and its held-out
evaluation on the CPU with one learner and at most 1 env runner (the ExGRPO recipe's rehearsal covers its full actor counts, and
checkpoint and resume); their dry runs (memory plan fits the card)
are in tests/test_memory_plan.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TUNED = REPO / "tuned_examples"
#: The ExGRPO GPU recipes that have twins (the tune recipe is a search over one of them).
EXGRPO_GPU = sorted(p for p in TUNED.glob("exgrpo_qwen*.yaml") if not p.stem.endswith("_tune"))
TWINS = sorted(TUNED.glob("grpo_qwen*.yaml")) + sorted(TUNED.glob("ppo_qwen*.yaml"))
#: ExGRPO-only settings a GRPO twin leaves out (replay; GRPO refuses experience_replay: true).
REPLAY_KEYS = {
    "experience_replay",
    "experience_ratio",
    "delayed_start_solve_rate",
    "bucket_weighting",
    "trajectory_selection",
    "replay_candidates_per_question",
    "policy_shaping_beta",
    "remove_clip_in_mixed_mode",
}
HELDOUT_KEYS = (
    "heldout_dataset",
    "heldout_split",
    "heldout_num_questions",
    "heldout_interval",
    "heldout_samples",
    "heldout_temperature",
    "heldout_max_response_tokens",
)


def _spec(path: Path):
    return next(iter(yaml.safe_load(path.read_text()).items()))


def _defaults():
    from rllib_exgrpo.rllib.config_fields import field_defaults

    return field_defaults()


def _summary(path: Path) -> dict:
    """What a twin must share with its ExGRPO recipe, read the way each algorithm reads it."""
    _, spec = _spec(path)
    c = spec["config"]
    d = _defaults()
    if spec["run"] == "PPO":
        mc = c["model_config"]
        get = lambda k: mc.get(k, d[k])  # noqa: E731 - the runner and callback read model_config
        questions = c["train_batch_size_per_learner"] * max(1, c.get("num_learners", 0)) // mc["group_size"]
        model, dtype = mc["model"], mc.get("dtype", d["model_dtype"])
    else:
        get = lambda k: c.get(k, d[k])  # noqa: E731
        questions = c["questions_per_step"]
        model, dtype = c["model_name_or_path"], c.get("model_dtype", d["model_dtype"])
    iterations = spec["stop"]["training_iteration"]
    return {
        "data": c["env_config"],
        "seed": c.get("seed"),
        "model": (model, dtype),
        "sampling": {
            k: get(k) for k in ("group_size", "temperature", "top_p", "max_prompt_tokens", "max_response_tokens", "generation_backend")
        },
        "token_budget": questions * get("group_size") * get("max_response_tokens") * iterations,
        "questions_per_iteration": questions,
        "iterations": iterations,
        "heldout": {k: get(k) for k in HELDOUT_KEYS},
        "checkpoint_frequency": spec.get("checkpoint_config", {}).get("checkpoint_frequency"),
    }


def test_every_exgrpo_gpu_recipe_has_both_twins_and_nothing_else_is_one():
    assert len(EXGRPO_GPU) == 6, EXGRPO_GPU
    expected = {p.name.replace("exgrpo_", k) for p in EXGRPO_GPU for k in ("grpo_", "ppo_")}
    assert {p.name for p in TWINS} == expected


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_twin_matches_its_exgrpo_recipe(twin):
    source = TUNED / ("exgrpo_" + twin.name.split("_", 1)[1])
    ours, theirs = _summary(twin), _summary(source)
    for key in theirs:
        assert ours[key] == theirs[key], (key, ours[key], theirs[key])
    assert theirs["heldout"]["heldout_dataset"], "the recipe evaluates on a held-out set"
    name, spec = _spec(twin)
    src_name, src = _spec(source)
    assert name == src_name.replace("exgrpo-", twin.stem.split("_")[0] + "-")
    c = spec["config"]
    if spec["run"] == "GRPO":
        # Everything but replay as in the ExGRPO recipe: same hardware layout, learner, passes.
        assert not REPLAY_KEYS & set(c)
        assert c == {k: v for k, v in src["config"].items() if k not in REPLAY_KEYS}
    else:
        assert spec["run"] == "PPO"
        assert c["callbacks"] == "rllib_exgrpo.rllib.ppo_module:LLMHeldoutCallback"  # the held-out evaluation
        assert c["rl_module_spec"]["module_class"] == "rllib_exgrpo.rllib.ppo_module:LLMPPOTorchRLModule"
        assert c["learner_connector"] == "rllib_exgrpo.rllib.ppo_module:PadLLMEpisodes"
        mc = c["model_config"]
        assert mc.get("gpu_memory_gb", 80) == src["config"].get("gpu_memory_gb", 80)  # the same card
        # The same GPUs: what the ExGRPO recipe's actors hold in all, split between PPO's.
        gpus = lambda cfg: (
            cfg.get("num_env_runners", 0) * cfg.get("num_gpus_per_env_runner", 0)  # noqa: E731
            + max(1, cfg.get("num_learners", 0)) * cfg.get("num_gpus_per_learner", 0)
        )
        assert gpus(c) == gpus(src["config"])
        if src["config"].get("lora_rank"):
            assert mc["lora_rank"] == src["config"]["lora_rank"]


def test_grpo_refuses_experience_replay(tmp_path):
    """A GRPO twin copied with experience_replay: true is refused before anything starts."""
    from rllib_exgrpo.cli.experiment import CliConfigError, build_experiments

    name, spec = _spec(TUNED / "grpo_qwen1.5b.yaml")
    spec["config"].update(experience_replay=True, env_config={"dataset": "arithmetic"}, heldout_dataset="arithmetic")
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump({name: spec}))
    with pytest.raises(CliConfigError, match="experience_replay"):
        build_experiments(str(path), ray_num_gpus=8, dry_run=True, storage_path=str(tmp_path / "r"))


def test_ppo_twin_refuses_what_ppo_cannot_do_in_one_line(tmp_path):
    """An unknown model_config key and what the PPO path cannot do (colocate, DeepSpeed, learner
    micro-batches, learner scoring without engine log-probs) are refused, one line each naming
    the key, before anything starts."""
    from rllib_exgrpo.cli.experiment import CliConfigError, build_experiments

    name, spec = _spec(TUNED / "ppo_qwen1.5b.yaml")
    spec["config"]["env_config"] = {"dataset": "arithmetic"}
    spec["config"]["model_config"].update(
        lroa=64, colocate=True, learner_backend="deepspeed", learner_micro_batch_tokens=32768, scoring_on="learners"
    )
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump({name: spec}))
    with pytest.raises(CliConfigError) as err:
        build_experiments(str(path), ray_num_gpus=8, dry_run=True, storage_path=str(tmp_path / "r"))
    lines = [ln for ln in str(err.value).splitlines() if "config.model_config." in ln]
    for key, needle in [
        ("lroa", "Did you mean: 'lora'"),
        ("colocate", "cannot colocate"),
        ("learner_backend", "DeepSpeed"),
        ("learner_micro_batch_tokens", "minibatch_size"),
        ("scoring_on", "behaviour log-probs"),
    ]:
        hits = [ln for ln in lines if f"config.model_config.{key}:" in ln]
        assert len(hits) == 1 and needle in hits[0], (key, lines)


# ------------------------------------------------------- rehearsals: an iteration and its evaluation


#: The smallest run a rehearsal allows: its own caps, completions of 8 tokens and a held-out
#: evaluation of 2 questions after every iteration (before training, and after the one
#: iteration: the loop from sampling through the update to the evaluation on the new weights).
#: PPO's held-out settings live in model_config, which the rehearsal's rules do not read (its
#: held-out file is not swapped, nor its size scaled): given here.
def _smallest(spec: dict) -> dict:
    if spec["run"] == "PPO":
        return {
            "model_config": {"heldout_dataset": "arithmetic", "heldout_num_questions": 2, "heldout_interval": 1, "max_response_tokens": 8}
        }
    return {"heldout_num_questions": 2, "heldout_interval": 1, "max_response_tokens": 8}


def _fewer_actors(spec: dict) -> dict:
    """One learner and at most 1 env runner, GRPO 16 questions a step, PPO at most 16 optimiser
    steps. The recipes' full counts (4 vLLM runners and 4 learners, or 8 colocated learners) are rehearsed by the
    ExGRPO recipe's own rehearsal
    (tests/test_rehearsal.py), which a twin shares apart from the algorithm: starting 4 CPU
    vLLM engines and 4 learners again for each twin cost 3-4 minutes of a 2-core CI run each,
    and two eight-learner runs side by side on its two test workers overran gloo's timeout."""
    c = spec.get("config", {})
    out = {}
    if spec["run"] == "PPO":
        # At most 16 optimiser steps an iteration: the 1-GPU recipes' minibatches of 4-8 rows
        # make 256-512 steps, RLlib's per-minibatch round trip 256 times on a tiny model (4 of
        # a 2-core CI run's minutes), not another path. (The rehearsal scales minibatch_size
        # with its batch; this is the value before that.)
        rows = 2 * int(c["train_batch_size_per_learner"])
        out["minibatch_size"] = max(int(c["minibatch_size"]), rows // 16)
    else:
        # 16 questions (128 completions): the rehearsal keeps 62 of the recipes' 128 for two
        # micro-batch passes per learner, 496 completions of 151,936-wide logits an iteration
        # (35-45 s each on 2 cores); one pass shows the twin's path as well.
        out["questions_per_step"] = min(int(c["questions_per_step"]), 16)
    if int(c.get("num_learners", 0) or 0) > 1:
        out["num_learners"] = 1
    if int(c.get("num_env_runners", 0) or 0) > 1:
        out["num_env_runners"] = 1
    return out


def _twin_params():
    params = []
    for path in TWINS:
        marks = [pytest.mark.slow]
        if "generation_backend: vllm" in path.read_text():
            marks.append(pytest.mark.vllm)  # rehearsed with vLLM's CPU build (tests/run.sh)
        params.append(pytest.param(path, marks=marks, id=path.stem))
    return params


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("twin", _twin_params())
def test_every_twin_rehearses_an_iteration_and_its_evaluation(twin, tmp_path, capsys):
    from rllib_exgrpo.cli.main import main
    from rllib_exgrpo.cli.rehearsal import SUFFIX

    name, spec = _spec(twin)
    storage = tmp_path / "results"
    overrides = {**_smallest(spec), **_fewer_actors(spec)}
    assert (
        main(
            [
                "train",
                "file",
                str(twin),
                "--rehearse",
                "--storage-path",
                str(storage),
                "--stop",
                '{"training_iteration": 1}',
                "--config",
                json.dumps(overrides),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "rehearsal:" in err
    rows = []
    for f in sorted((storage / (name + SUFFIX)).glob("*/result.json")):
        rows.append([json.loads(line) for line in f.read_text().splitlines() if line.strip()])
    assert rows and all([r["training_iteration"] for r in trial] == [1] for trial in rows), rows
    last = rows[0][-1]
    # The held-out evaluation ran (before training and after the iteration), as in the ExGRPO recipe.
    assert "accuracy" in last["heldout"] and last["heldout"]["after_iteration"] == 1, last.get("heldout")
    assert "initial_accuracy" in last["heldout"]
    if spec["run"] == "PPO":
        learner = last["learners"]["default_policy"]
        assert "vf_loss" in learner and "policy_loss" in learner
