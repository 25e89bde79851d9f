"""RLlib's built-in PPO, unmodified, on the LLM through this project's module and runner.

Unit tests of the pieces (:mod:`rllib_exgrpo.rllib.ppo_module`) on hand-made tensors, then one
Tune run of ``tuned_examples/ppo_tiny.yaml`` through the CLI's library functions
(``build_experiments`` / ``run_experiments``: what ``rllib train file`` does) with the
quick tiny model. That model answers no arithmetic question (reward 0 everywhere, so the
value head would be exact from its zero initialisation), so the run scores completions
with a scripted reward that depends on the question: the value head has something to
regress to.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rllib_exgrpo.envs.reasoning_env import ReasoningEnv
from rllib_exgrpo.envs.rewards import RewardResult
from ray.rllib.core.columns import Columns
from rllib_exgrpo.rllib.ppo_module import (
    ACTIONS_LEN,
    OBS_LEN,
    CompletionDistribution,
    LLMPPOTorchRLModule,
    PadLLMEpisodes,
    pack_dist_inputs,
)

REPO = Path(__file__).resolve().parents[1]
PPO_TINY = REPO / "tuned_examples" / "ppo_tiny.yaml"


def scripted_reward(question_id: str, completion: str) -> float:
    """0 or 1, 1 for about three completions in four: a stable hash of question and text."""
    return 0.0 if hashlib.sha1(f"{question_id}|{completion}".encode()).digest()[0] % 4 == 0 else 1.0


class ScriptedRewardEnv(ReasoningEnv):
    """ReasoningEnv whose verifier is replaced by :func:`scripted_reward`."""

    def score(self, question_ids, completions):
        return [
            RewardResult(score=scripted_reward(q, c), parsed=None, timed_out=False, format_ok=True)
            for q, c in zip(question_ids, completions)
        ]


# ------------------------------------------------------------------ distribution


def _dist(token_logp, token_ids, lengths, entropy=None):
    logp = torch.as_tensor(token_logp, dtype=torch.float32)
    ids = torch.as_tensor(token_ids)
    mask = torch.arange(logp.shape[1])[None, :] < torch.as_tensor(lengths)[:, None]
    ent = None if entropy is None else torch.as_tensor(entropy, dtype=torch.float32)
    return CompletionDistribution.from_logits(pack_dist_inputs(logp, ent, mask, ids)), ids * mask


def test_logp_is_the_masked_sum_of_token_logprobs():
    # Padding positions carry garbage log-probs that must not count.
    dist, actions = _dist(
        [[-0.5, -1.0, -2.0], [-0.25, -7.0, -9.0]], [[5, 6, 7], [8, 0, 0]], [3, 1], entropy=[[1.0, 2.0, 3.0], [0.5, 9.0, 9.0]]
    )
    torch.testing.assert_close(dist.logp(actions), torch.tensor([-3.5, -0.25]))
    torch.testing.assert_close(dist.entropy(), torch.tensor([6.0, 0.5]))  # summed, masked
    # Another completion than the one scored is refused, not silently mis-scored.
    with pytest.raises(ValueError, match="only knows"):
        dist.logp(torch.tensor([[5, 6, 8], [8, 0, 0]]))
    with pytest.raises(ValueError, match="do not match"):
        dist.logp(actions[:, :2])
    with pytest.raises(NotImplementedError):
        dist.sample()


def test_kl_is_a_per_completion_k3_estimate():
    ids, lens = [[5, 6, 7], [8, 0, 0]], [3, 1]
    old, actions = _dist([[-0.5, -1.0, -2.0], [-0.25, -5.0, -5.0]], ids, lens)
    new, _ = _dist([[-0.7, -1.0, -1.5], [-0.25, -1.0, -1.0]], ids, lens)
    d = torch.tensor([[-0.2, 0.0, 0.5], [0.0, 0.0, 0.0]])
    expected = torch.exp(d) - 1 - d
    expected[1, 1:] = 0
    torch.testing.assert_close(old.kl(new), expected.sum(-1))
    assert float(old.kl(old).abs().max()) == 0.0
    assert (old.kl(new) >= 0).all()
    other, _ = _dist([[-0.5, -1.0, -2.0], [-0.25, -5.0, -5.0]], [[5, 6, 9], [8, 0, 0]], lens)
    with pytest.raises(ValueError, match="same completions"):
        old.kl(other)


# ------------------------------------------------------------------ connector + module


def _episode(prompt, completion, logp, reward=1.0):
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    obs = np.asarray(prompt, dtype=np.int64)
    return SingleAgentEpisode(
        observations=[obs, obs],
        actions=[np.asarray(completion, dtype=np.int64)],
        rewards=[reward],
        extra_model_outputs={Columns.ACTION_LOGP: [np.asarray(logp, dtype=np.float32)]},
        terminated=True,
        len_lookback_buffer=0,
    )


def test_connector_pads_and_sums_behaviour_logprobs():
    from ray.rllib.connectors.learner import AddOneTsToEpisodesAndTruncate, BatchIndividualItems

    eps = [_episode([1, 2, 3], [4, 5], [-0.5, -1.5]), _episode([7], [8, 9, 10], [-1.0, -2.0, -3.0])]
    batch, shared = {}, {}
    for piece in (AddOneTsToEpisodesAndTruncate(), PadLLMEpisodes(), BatchIndividualItems()):
        batch = piece(rl_module=None, batch=batch, episodes=eps, shared_data=shared)
    # Two rows per episode: the real step and PPO's phantom bootstrap step (a copy).
    np.testing.assert_array_equal(batch[Columns.OBS], [[1, 2, 3]] * 2 + [[0, 0, 7]] * 2)  # left-padded
    np.testing.assert_array_equal(batch[OBS_LEN], [3, 3, 1, 1])
    np.testing.assert_array_equal(batch[Columns.ACTIONS], [[4, 5, 0]] * 2 + [[8, 9, 10]] * 2)  # right-padded
    np.testing.assert_array_equal(batch[ACTIONS_LEN], [2, 2, 3, 3])
    np.testing.assert_allclose(batch[Columns.ACTION_LOGP], [-2.0, -2.0, -6.0, -6.0])
    np.testing.assert_array_equal(batch[Columns.LOSS_MASK], [True, False, True, False])
    behaviour = CompletionDistribution.from_logits(torch.as_tensor(batch[Columns.ACTION_DIST_INPUTS]))
    actions = torch.as_tensor(batch[Columns.ACTIONS])
    torch.testing.assert_close(behaviour.logp(actions), torch.as_tensor(batch[Columns.ACTION_LOGP]))


@pytest.fixture(scope="module")
def ppo_module(quick_tiny_model):
    import gymnasium as gym

    space = gym.spaces.Box(0, 300, shape=(16,), dtype=np.int64)
    return LLMPPOTorchRLModule(
        observation_space=space,
        action_space=space,
        inference_only=False,
        model_config={"model": quick_tiny_model, "temperature": 1.0, "vf_share_layers": False},
    )


def test_module_train_outputs_values_and_inference_only(ppo_module, quick_tiny_model):
    from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy
    from rllib_exgrpo.core.tokens import prompt_completion_batch

    prompts, completions = [[11, 12, 13, 14], [15, 16]], [[20, 21], [22, 23, 24]]
    eps = [_episode(p, c, [0.0] * len(c)) for p, c in zip(prompts, completions)]
    batch = {}
    from ray.rllib.connectors.learner import AddOneTsToEpisodesAndTruncate, BatchIndividualItems

    for piece in (AddOneTsToEpisodesAndTruncate(), PadLLMEpisodes(), BatchIndividualItems()):
        batch = piece(rl_module=None, batch=batch, episodes=eps, shared_data={})
    batch = {k: torch.as_tensor(v) for k, v in batch.items()}
    n = batch[Columns.OBS].shape[0]
    assert n == 4

    out = ppo_module.forward_train(batch)
    dist = CompletionDistribution.from_logits(out[Columns.ACTION_DIST_INPUTS])
    # logp of the real rows = sum of token log-probs, as the runner's scorer computes them.
    ids, mask, resp = prompt_completion_batch(prompts, completions, pad_id=0)
    ref_logp, _ = completion_logprobs_and_entropy(ppo_module.model, ids, mask, resp.shape[1])
    expected = (ref_logp * resp).sum(-1)
    logp = dist.logp(batch[Columns.ACTIONS])
    torch.testing.assert_close(logp[[0, 2]], expected, atol=1e-4, rtol=1e-4)
    assert logp.requires_grad
    # Phantom rows (LOSS_MASK False) get the behaviour inputs back (ratio 1): here logp 0.
    assert float(logp[[1, 3]].detach().abs().max()) == 0.0

    emb = out[Columns.EMBEDDINGS]
    hidden = ppo_module.model.config.hidden_size
    assert emb.shape == (n, hidden)
    values = ppo_module.compute_values(batch, embeddings=emb)
    assert values.shape == (n,)
    values_no_emb = ppo_module.compute_values(batch)  # prompt-only pass, every row
    assert values_no_emb.shape == (n,)
    # Zero-initialised head: V = 0 before training; the trunk is detached (vf_share_layers False).
    assert float(values_no_emb.detach().abs().max()) == 0.0
    ppo_module.value_head.bias.data.fill_(0.25)
    ppo_module.value_head.weight.data.normal_(0, 0.1)
    v_emb, v_prompt = ppo_module.compute_values(batch, embeddings=emb), ppo_module.compute_values(batch)
    torch.testing.assert_close(v_emb[[0, 2]], v_prompt[[0, 2]], atol=1e-4, rtol=1e-4)
    v_emb[[0, 2]].sum().backward()
    assert ppo_module.value_head.weight.grad is not None
    assert all(p.grad is None for p in ppo_module.model.parameters())

    # Inference-only copies (env runners) have no value head; weight syncs leave it out.
    state = ppo_module.get_state(inference_only=True)
    assert not any(k.startswith("value_head") for k in state)
    assert any(k.startswith("value_head") for k in ppo_module.get_state())
    import gymnasium as gym

    space = gym.spaces.Box(0, 300, shape=(16,), dtype=np.int64)
    runner_module = LLMPPOTorchRLModule(
        observation_space=space, action_space=space, inference_only=True, model_config={"model": quick_tiny_model}
    )
    assert not hasattr(runner_module, "value_head")
    runner_module.set_state(state)


def test_runner_settings_from_ppo_model_config():
    from ray.rllib.algorithms.ppo import PPOConfig

    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
    from rllib_exgrpo.rllib.env_runner import RunnerSettings

    cfg = PPOConfig().rl_module(model_config={"model": "tiny", "dtype": "bfloat16", "group_size": 4, "max_response_tokens": 32})
    cfg.training(train_batch_size_per_learner=30).env_runners(num_env_runners=0)
    s = RunnerSettings(cfg)
    assert not s.from_config_fields
    assert (s.model_name_or_path, s.model_dtype, s.group_size, s.max_response_tokens) == ("tiny", "bfloat16", 4, 32)
    defaults = ExGRPOConfig()
    assert s.max_prompt_tokens == defaults.max_prompt_tokens and s.temperature == defaults.temperature
    assert s.completions_per_step == 32  # 30 env steps, rounded up to whole groups of 4
    cfg.env_runners(num_env_runners=2)
    assert RunnerSettings(cfg, worker_index=1).completions_per_step == 16  # 15 per runner
    assert s.lr == cfg.lr  # anything else falls through to the config
    ex = RunnerSettings(ExGRPOConfig().training(questions_per_step=3, group_size=5))
    assert ex.from_config_fields and ex.completions_per_step == 15


def test_runner_without_padding_connector_says_how_to_fix():
    from ray.rllib.algorithms.ppo import PPOConfig

    from rllib_exgrpo.rllib.env_runner import LLMEnvRunner

    cfg = PPOConfig().rl_module(model_config={"model": "tiny"})
    with pytest.raises(ValueError, match="PadLLMEpisodes"):
        LLMEnvRunner(config=cfg)


def _ppo_spec(**config):
    base = {
        "env_runner_cls": "rllib_exgrpo.rllib.env_runner:LLMEnvRunner",
        "rl_module_spec": {"module_class": "rllib_exgrpo.rllib.ppo_module:LLMPPOTorchRLModule"},
        "learner_connector": "rllib_exgrpo.rllib.ppo_module:PadLLMEpisodes",
        "model_config": {"model": "tiny"},
        "num_env_runners": 0,
    }
    base.update(config)
    return {"e": {"run": "PPO", "env": "rllib_exgrpo.envs.reasoning_env:ReasoningEnv", "config": base}}


def test_yaml_names_the_module_class_and_learner_connector():
    from ray.rllib.algorithms.ppo import PPO

    from rllib_exgrpo.cli.experiment import build_experiments

    (exp,) = build_experiments(_ppo_spec(), validate=False)
    assert exp.algo_cls is PPO
    spec = exp.config.rl_module_spec
    assert spec.module_class is LLMPPOTorchRLModule
    assert exp.config._learner_connector is PadLLMEpisodes
    assert exp.config.model_config["model"] == "tiny"


@pytest.mark.parametrize(
    "config, needle",
    [
        ({"rl_module_spec": {"module_klass": "a.b:C"}}, "'rl_module_spec/module_klass': unknown. Did you mean: 'module_class'"),
        ({"rl_module_spec": "rllib_exgrpo.rllib.ppo_module:LLMPPOTorchRLModule"}, "must be a mapping"),
        ({"rl_module_spec": {"module_class": "rllib_exgrpo.rllib.ppo_module:PadLLMEpisodes"}}, "not an RLModule subclass"),
        ({"rl_module_spec": {"module_class": "rllib_exgrpo.rllib.ppo_module:Nope"}}, "cannot import"),
        ({"rl_module_spec": {"model_config": {"lr": {"grid_search": [1, 2]}}}}, "cannot sit inside `rl_module_spec`"),
        ({"learner_connector": 3}, "'pkg.mod:Callable' path"),
        ({"learner_connector": "rllib_exgrpo.rllib.ppo_module:Nope"}, "cannot import"),
    ],
)
def test_yaml_module_spec_and_connector_errors(config, needle):
    from rllib_exgrpo.cli.registry import CliConfigError
    from rllib_exgrpo.cli.experiment import build_experiments

    with pytest.raises(CliConfigError) as e:
        build_experiments(_ppo_spec(**config), validate=False)
    assert needle in str(e.value)


# ------------------------------------------------------------------ stock PPO via the CLI


def _cli_env() -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    # The repository (project packages) and tests/ (this module's ScriptedRewardEnv).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"), env.get("PYTHONPATH")) if p)
    return env


def _train_ppo_tiny_from_cli(cwd: Path, storage: Path, env: str, overrides: dict, iterations: int):
    """`rllib train file tuned_examples/ppo_tiny.yaml` in a subprocess (in ``cwd``, results
    under ``storage``) for ``iterations`` iterations; returns the finished process."""
    t0 = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rllib_exgrpo.cli.main",
            "train",
            "file",
            str(PPO_TINY),
            "--env",
            env,
            "--config",
            json.dumps(overrides),
            "--stop",
            json.dumps({"training_iteration": iterations}),
            "--storage-path",
            str(storage),
            "--ray-num-cpus",
            "2",
        ],
        cwd=cwd,
        env=_cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(f"ppo run: {time.time() - t0:.1f} s")
    return proc


def _check_value_loss_goes_down(rows):
    """The learner's value loss falls, its KL loss is finite and non-negative, returns are 0..1."""
    learner = [r["learners"]["default_policy"] for r in rows]
    vf = [x["vf_loss"] for x in learner]
    kl = [x["mean_kl_loss"] for x in learner]
    ret = [r["env_runners"]["episode_return_mean"] for r in rows]
    secs = [r["time_this_iter_s"] for r in rows]
    print(
        "vf_loss",
        [round(v, 4) for v in vf],
        "kl",
        [round(k, 5) for k in kl],
        "return",
        [round(r, 3) for r in ret],
        "s/iter",
        [round(t, 1) for t in secs],
    )
    assert all(math.isfinite(v) for v in vf + kl) and all(k >= 0 for k in kl)
    # V starts at 0, where the value loss is E[r^2] = E[r] (0/1 rewards, ~0.75 here); it
    # drops towards Var[r] (~0.19) as the head regresses to the mean. The first report is
    # already after one optimiser step (it is the iteration's last minibatch).
    late = float(np.mean(vf[-2:]))
    assert late < vf[0], vf
    assert late < 0.6 * float(np.mean(ret)), (vf, ret)
    assert all(0.0 <= r <= 1.0 for r in ret)


@pytest.mark.slow
def test_rllib_ppo_trains_the_llm_and_its_value_loss_goes_down(tmp_path, quick_tiny_model):
    from ray.rllib.algorithms.ppo import PPO

    from rllib_exgrpo.cli.experiment import build_experiments

    iterations = 5
    overrides = {
        "model_config": {"model": quick_tiny_model, "group_size": 4, "max_prompt_tokens": 128, "max_response_tokens": 12},
        "train_batch_size_per_learner": 64,  # 16 questions x 4 samples
        "minibatch_size": 64,  # learner rows, PPO's phantom rows included: 2 steps/iteration
        "lr": 0.002,
        # Exercise the distribution's KL under PPO's default KL loss too.
        "use_kl_loss": True,
        "kl_coeff": 0.2,
    }
    env = "test_ppo:ScriptedRewardEnv"
    # What `rllib train file` resolves the file to: RLlib's own PPO class, not a subclass or copy.
    (exp,) = build_experiments(PPO_TINY, config_overrides=overrides)
    assert exp.algo_cls is PPO and exp.algo_cls.__module__ == "ray.rllib.algorithms.ppo.ppo"

    storage = tmp_path / "results"
    proc = _train_ppo_tiny_from_cli(tmp_path, storage, env, overrides, iterations)
    log = proc.stdout[-4000:] + "\n--- stderr ---\n" + proc.stderr[-8000:]
    assert proc.returncode == 0, log
    (trial,) = [p for p in (storage / "ppo-tiny").iterdir() if p.is_dir() and p.name.startswith("PPO_")]
    rows = [json.loads(line) for line in (trial / "result.json").read_text().splitlines() if line.strip()]
    assert [r["training_iteration"] for r in rows] == list(range(1, iterations + 1))
    _check_value_loss_goes_down(rows)
    assert any(p.name.startswith("checkpoint_") for p in trial.iterdir())  # the file's checkpoint_at_end


# ------------------------------------------------------------------ the GPU path's pieces


def _train_batch(prompts, completions):
    from ray.rllib.connectors.learner import AddOneTsToEpisodesAndTruncate, BatchIndividualItems

    eps = [_episode(p, c, [0.0] * len(c)) for p, c in zip(prompts, completions)]
    batch = {}
    for piece in (AddOneTsToEpisodesAndTruncate(), PadLLMEpisodes(), BatchIndividualItems()):
        batch = piece(rl_module=None, batch=batch, episodes=eps, shared_data={})
    return {k: torch.as_tensor(v) for k, v in batch.items()}


def test_bf16_lora_module_scores_in_chunks_under_autocast(quick_tiny_model, monkeypatch):
    """bf16: fp32 master weights and autocast on the learner (bf16 on runners); flat LoRA keys
    give adapters; the training pass goes through the chunked log-prob code, logit_chunk_tokens
    positions at a time (never whole [tokens x vocabulary] logits)."""
    import gymnasium as gym

    from rllib_exgrpo.core import chunked_logprobs

    space = gym.spaces.Box(0, 300, shape=(16,), dtype=np.int64)
    build = lambda mc, inf=False: LLMPPOTorchRLModule(  # noqa: E731
        observation_space=space, action_space=space, inference_only=inf, model_config={"model": quick_tiny_model, **mc}
    )
    learner = build({"dtype": "bfloat16", "logit_chunk_tokens": 2})
    assert learner.compute_dtype == torch.bfloat16
    assert next(learner.model.parameters()).dtype == torch.float32  # master weights
    assert next(build({"dtype": "bfloat16"}, inf=True).model.parameters()).dtype == torch.bfloat16
    calls = []
    real = chunked_logprobs.logprobs_entropy_from_hidden

    def spy(hidden, head, targets, **kw):
        calls.append((tuple(hidden.shape), kw.get("chunk_tokens"), torch.is_autocast_enabled("cpu")))
        return real(hidden, head, targets, **kw)

    monkeypatch.setattr("rllib_exgrpo.core.scoring.logprobs_entropy_from_hidden", spy)
    batch = _train_batch([[11, 12, 13], [15, 16]], [[20, 21, 22], [23]])
    out = learner.forward_train(batch)
    ((shape, chunk, autocast),) = calls
    assert shape[0] == 2 * 3 and chunk == 2 and autocast  # 2 real rows x 3 positions: hidden states, not logits
    assert CompletionDistribution.from_logits(out[Columns.ACTION_DIST_INPUTS]).logp(batch[Columns.ACTIONS]).requires_grad

    lora = build({"dtype": "bfloat16", "lora_rank": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"]})
    assert lora.lora_model is not None and lora.compute_dtype is None  # the base stays bf16, no master copy
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or n.startswith("value_head") for n in trainable)
    assert any(n.startswith("value_head") for n in trainable)
    state = lora.get_state(inference_only=True)
    assert not any(".lora_" in k or k.startswith("value_head") for k in state)  # merged weights for the runners


def test_model_config_keys_are_checked_and_documented():
    from rllib_exgrpo.rllib.ppo_module import PPO_REFUSED, model_config_problems, ppo_model_config_keys

    keys = ppo_model_config_keys()
    doc = (REPO / "docs" / "ppo.md").read_text()
    for key, (default, _, _) in keys.items():
        assert f"| `{key}` | `{default!r}` |" in doc, key
    for key in PPO_REFUSED:
        assert f"`{key}" in doc, key
    # Both shipped CPU recipes and every ppo_qwen* twin pass; one line per bad key, naming it.
    for path in [PPO_TINY, REPO / "tuned_examples" / "ppo_smollm2_cpu.yaml", *sorted((REPO / "tuned_examples").glob("ppo_qwen*.yaml"))]:
        import yaml

        spec = next(iter(yaml.safe_load(path.read_text()).values()))
        assert model_config_problems(spec["config"]["model_config"]) == [], path
    (line,) = model_config_problems({"model": "tiny", "lroa": 8})
    assert line.startswith("config.model_config.lroa: ") and "Did you mean: 'lora'" in line
    assert model_config_problems({"colocate": False, "learner_backend": "ddp"}) == []
    assert model_config_problems({"scoring_on": "learners", "behaviour_logprobs": "engine"}) == []


def test_ppo_memory_plan_counts_the_value_head_and_one_pass_per_minibatch():
    from ray.rllib.algorithms.ppo import PPOConfig

    from rllib_exgrpo.cli.config_keys import apply_config
    from rllib_exgrpo.planning.memory import plan_memory
    from rllib_exgrpo.rllib.ppo_memory_plan import plan_ppo_memory, ppo_plan_view, value_head_bytes
    import yaml

    spec = next(iter(yaml.safe_load((REPO / "tuned_examples" / "ppo_qwen1.5b.yaml").read_text()).values()))
    cfg = PPOConfig()
    assert apply_config(cfg, spec["config"]) == []
    plan = plan_ppo_memory(cfg)
    learner, runner = plan.actors
    head = next(it for it in learner.items if it.what == "value head")
    assert head.bytes == value_head_bytes(1536) == 16 * 1537
    assert plan.fits and "32 learner rows (16 completions" in plan.render()
    # Without the value head it is the ExGRPO plan of the same settings, DDP, 16 rows a pass.
    base = plan_memory(ppo_plan_view(cfg))
    assert learner.total - base.actors[0].total == head.bytes
    assert "16 rows x 5120 tokens" in base.render()
    # A minibatch too large for the GPU names minibatch_size, with a size that fits.
    cfg.training(minibatch_size=256)
    (problem,) = plan_ppo_memory(cfg).problems()
    assert problem.startswith("config.minibatch_size: ") and "minibatch_size: " in problem.split("are left")[1]
