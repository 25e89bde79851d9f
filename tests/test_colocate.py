"""Colocated placement (``colocate: true``, ``rllib/colocation.py``).

* the field and its rules;
* the turn protocol with an engine (a stand-in for vLLM's, real AdamW state): the calls in
  order, and no phase with the engine awake while the optimizer state is on the device;
  an engine without sleep mode (vLLM's CPU build) skips sleep and wake, said once;
* end to end (slow) on the quick tiny model, one local learner and two DDP learners:
  2 iterations sampled by the learners, a checkpoint, a restore, a 3rd iteration with
  ExGRPO's replay; after each iteration the sampler's log-probs equal the learner's (also
  with LoRA, where they are the adapted model's, not the base model's).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
from rllib_exgrpo.rllib.colocation import PHASES, ColocatedSampler, OptimizerOffload, TurnRecord


# --- the field ------------------------------------------------------------------------------------
def test_field_defaults_off_and_its_rules():
    assert ExGRPOConfig().colocate is False
    ExGRPOConfig().training(colocate=True).env_runners(num_env_runners=0).validate()
    for change, message in [
        (lambda c: c.training(async_rollouts=True).env_runners(num_env_runners=1), "colocate does not go with async_rollouts"),
        (lambda c: c.env_runners(num_env_runners=2), "colocate needs num_env_runners: 0"),
        (
            lambda c: c.training(
                learner_backend="deepspeed",
                deepspeed_zero_stage=3,
                generation_backend="vllm",
                behaviour_logprobs="recompute",
                scoring_on="runners",
            ),
            "colocate with ZeRO-3 and vLLM needs scoring_on: learners",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            change(ExGRPOConfig().training(colocate=True)).validate()


# --- the turn protocol ----------------------------------------------------------------------------
class _Engine:
    """vLLM's ``LLM`` as far as the protocol uses it."""

    def __init__(self, sleep_mode: bool, calls: list):
        self.calls = calls
        self.llm_engine = types.SimpleNamespace(
            vllm_config=types.SimpleNamespace(model_config=types.SimpleNamespace(enable_sleep_mode=sleep_mode))
        )

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))


class _Backend:
    def __init__(self, sleep_mode: bool):
        self.calls, self.llm, self.awake, self.sleep_mode = [], None, False, sleep_mode

    def build_engine(self):
        self.llm, self.awake = _Engine(self.sleep_mode, self.calls), True
        self.calls.append(("build",))

    def push_weight_buckets(self, buckets, copy=False):
        assert self.awake
        names = tuple(name for bucket in buckets for name in bucket)  # one load: every bucket
        self.calls.append(("push", names))
        return len(names)

    def weights_changed(self):
        self.calls.append(("weights_changed",))


class _Runner:
    def __init__(self, backend):
        from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

        self.backend = backend
        self.settings = types.SimpleNamespace(generation_backend="vllm")
        self.metrics = MetricsLogger()  # the env runner's (a turn logs optimizer_offload_bytes)

    def sample(self, **kwargs):
        assert self.backend.awake
        return ["episode"]


class _Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Linear(3, 2)

    def autocast(self):
        import contextlib

        return contextlib.nullcontext()


def _sampler(sleep_mode=True):
    module = _Module()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module.model(torch.ones(1, 3)).sum().backward()
    opt.step()  # AdamW state exists
    return ColocatedSampler(None, module, optimizers=lambda: [opt], runner=_Runner(_Backend(sleep_mode))), opt


def test_turns_never_hold_engine_and_optimizer_state_at_once():
    sampler, opt = _sampler()
    module = sampler.module
    module.model.train()
    for _ in range(3):
        assert sampler.sample(question_ids=["q"]) == ["episode"]
        assert module.model.training  # eval for the turn only
    record = sampler.record
    assert record.phases == list(PHASES) * 3
    assert record.overlaps() == []
    assert not sampler.engine_awake and sampler.offload.on_device
    calls = sampler.backend.calls
    # Built awake on the first turn, then every weight pushed; after each level-2 sleep every
    # weight is pushed again (one bucket here: the stand-in model has no decoder layers).
    push = [("push", ("weight", "bias")), ("weights_changed",)]
    assert calls[:4] == [("build",), *push, ("sleep", 2)]
    assert calls[4:] == [("wake_up", ("weights",)), *push, ("wake_up", ("kv_cache",)), ("sleep", 2)] * 2
    # AdamW's state is back, usable for the next step.
    assert all(torch.is_tensor(v) for st in opt.state.values() for v in st.values())


def test_the_record_finds_an_overlap():
    record = TurnRecord()
    record.note("wake_weights", engine_awake=True, optimizer_on_device=True)
    assert record.overlaps() == ["wake_weights"]


def test_an_engine_without_sleep_mode_skips_sleep_and_wake_and_says_so_once(capsys):
    sampler, _ = _sampler(sleep_mode=False)
    for _ in range(2):
        sampler.sample()
    assert capsys.readouterr().out.count("has no sleep mode") == 1
    assert not [c for c in sampler.backend.calls if c[0] in ("sleep", "wake_up")]
    assert sampler.record.overlaps() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_optimizer_state_moves_to_the_host_and_back_on_a_gpu():
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64, device="cuda")).sum().backward()
    opt.step()
    offload = OptimizerOffload(lambda: [opt])
    before = torch.cuda.memory_allocated()
    assert offload.offload() > 0 and not offload.on_device
    assert all(v.device.type == "cpu" for st in opt.state.values() for v in st.values())
    assert torch.cuda.memory_allocated() < before
    assert offload.reload() > 0 and offload.on_device
    assert all(v.device.type == "cuda" for st in opt.state.values() for k, v in st.items() if k != "step")
    opt.step()


# --- a learner's error while it samples ----------------------------------------------------------
class _FailingLearners:
    """RLlib's remote learner group as ``sample_on_learners`` sees it: ``foreach_learner``
    runs the function on each learner and, as Ray and RLlib do, hands back a learner's
    exception as a ``RayTaskError`` inside RLlib's result object instead of raising it."""

    is_local = False

    def __init__(self, fail_rank: int):
        self.fail_rank = fail_rank

    def __len__(self):
        return 2

    def foreach_learner(self, func):
        import traceback

        from ray.exceptions import RayTaskError
        from ray.rllib.utils.actor_manager import RemoteCallResults, ResultOrError

        results = RemoteCallResults()
        for rank in range(2):
            learner = types.SimpleNamespace(colocated_sample=lambda shards, kw, _r=rank: self._sample(_r, shards))
            try:
                out = ResultOrError(result=func(learner))
            except Exception as e:  # noqa: BLE001 - what Ray does with an actor task's exception
                out = ResultOrError(error=RayTaskError("colocated_sample", traceback.format_exc(), e))
            results.add_result(rank + 1, out, None)
        return results

    def _sample(self, rank, shards):
        if rank == self.fail_rank:
            raise ValueError("question q7 has no prompt in this dataset")
        notes = ["colocate: optimizer offload (torch optimizer) moved to host: optim_states 1.00 MiB"]
        return rank, [f"episode of {q}" for q in shards[rank][0]], None, notes if rank == 0 else []


def test_a_learners_error_while_sampling_reaches_the_user_as_itself_in_one_line(capsys):
    from rllib_exgrpo.rllib.colocation import sample_on_learners

    episodes, _ = sample_on_learners(_FailingLearners(fail_rank=-1), ["q1", "q7"], [2, 2])
    assert episodes == ["episode of q1", "episode of q7"]
    # A learner's note for the user is printed by the driver, once.
    assert capsys.readouterr().err.count("colocate: optimizer offload (torch optimizer) moved to host") == 1
    with pytest.raises(ValueError) as info:
        sample_on_learners(_FailingLearners(fail_rank=1), ["q1", "q7"], [2, 2])
    assert str(info.value) == ("colocated sampling failed on learner actor 2: ValueError: question q7 has no prompt in this dataset")
    assert isinstance(info.value.__cause__, ValueError)


# --- the memory plan's generation turn --------------------------------------------------------------
def test_memory_plan_has_the_generation_turn_and_names_vllms_share_when_it_does_not_fit():
    import sys
    from pathlib import Path

    from rllib_exgrpo.planning.memory import plan_memory

    sys.path.insert(0, str(Path(__file__).parent))
    from test_memory_plan import QWEN15, _config as recipe

    gpu = 80 * (1 << 30)

    def plan(**over):
        cfg = recipe(QWEN15, colocate=True, num_env_runners=0, num_gpus_per_env_runner=0, learner_backend="ddp", **over)
        return plan_memory(cfg, gpu_memory=gpu, gpu_memory_source="test")

    fits = plan(vllm_kwargs={"gpu_memory_utilization": 0.35})
    assert [a.kind for a in fits.actors] == ["learner, training turn (colocate)", "learner, generation turn (colocate)"] and fits.fits
    turn = {it.what for it in fits.actors[1].items}
    assert "vLLM engine" in turn and "optimizer state" not in turn and "gradients" not in turn  # offloaded
    problems = plan(vllm_kwargs={"gpu_memory_utilization": 0.85}).problems()
    assert len(problems) == 1 and problems[0].startswith("config.vllm_kwargs.gpu_memory_utilization")
    hf = {it.what for it in plan(generation_backend="hf").actors[1].items}
    assert {"optimizer state", "HF generation KV cache"} <= hf and "vLLM engine" not in hf


# --- end to end (slow) ----------------------------------------------------------------------------
def _by_value():
    """The helpers below run on remote learners, where this test module is not importable."""
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


_by_value()


def _config(model, **training):
    return (
        ExGRPOConfig()
        .environment(env_config={"dataset": "arithmetic"})
        .training(
            model_name_or_path=model,
            questions_per_step=4,
            group_size=4,
            max_prompt_tokens=128,
            minibatch_size=16,
            loss_agg_mode="token-mean",
            heldout_dataset="arithmetic",
            heldout_num_questions=4,
            heldout_interval=2,
            delayed_start_solve_rate=0.0,
            colocate=True,
            **{"max_response_tokens": 12, "lr": 1e-3, **training},
        )
        .env_runners(num_env_runners=0)
    )


def _rows(algo, n=6):
    """A few (prompt, completion) rows of real questions."""
    from rllib_exgrpo.models.loading import load_tokenizer
    from rllib_exgrpo.generation.sample_and_score import encode_prompt

    tok = load_tokenizer(algo.config.model_name_or_path)
    env = algo.env_runner_group.local_env_runner.env
    prompts = [encode_prompt(tok, env.prompt_for(q), 128) for q in algo.sampler.question_ids[:n]]
    completions = [np.arange(5 + i, 12 + 2 * i) % 50 + 3 for i in range(n)]
    return [np.asarray(p, np.int64) for p in prompts], [np.asarray(c, np.int64) for c in completions]


def _sampler_and_learner_logps(learner, prompts, completions, pad_id):
    """The learner's colocated sampler's and the learner's own log-probs of the same rows,
    and (LoRA) the base model's."""

    from ray.rllib.core import DEFAULT_MODULE_ID

    sampler = learner.colocated_sampler()
    ours, _ = sampler.score_trajectories(prompts, completions)
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    assert sampler.module is module and sampler.runner.module is module  # one copy of the weights
    rows, theirs, _ = learner.score_rows(prompts, completions, pad_id)
    full = [None] * len(prompts)
    for j, i in enumerate(rows):
        full[i] = theirs[j]
    base = None
    if module.lora_model is not None:
        with module.lora_model.disable_adapter():
            base, _ = sampler.score_trajectories(prompts, completions)
    return ours, full, base


def _check_logps(algo, lora: bool):
    prompts, completions = _rows(algo)
    pad = algo._pad_id
    results = algo.learner_group.foreach_learner(
        lambda learner, _p=prompts, _c=completions, _pad=pad: _sampler_and_learner_logps(learner, _p, _c, _pad)
    )
    got = [r.get() for r in results]
    for ours, theirs, base in got:
        for a, b in zip(ours, theirs):
            if b is not None:  # a DDP learner scores its share only
                np.testing.assert_allclose(a, b, atol=1e-5)
        if lora:  # generation comes from the adapted weights
            assert max(float(np.abs(a - b).max()) for a, b in zip(ours, base)) > 1e-4
    for ours, _, _ in got[1:]:  # every learner samples from the same weights
        for a, b in zip(ours, got[0][0]):
            np.testing.assert_allclose(a, b, atol=1e-5)


def _sampler_logps(learner, prompts, completions):
    return learner.colocated_sampler().score_trajectories(prompts, completions)[0]


def _check_local_runner(algo):
    """The main process's runner (``algo.env_runner``, which evaluation scripts use), read
    after an update, scores with the learners' current weights, not a copy fetched earlier."""
    prompts, completions = _rows(algo)
    ours, _ = algo.env_runner.score_trajectories(prompts, completions)
    theirs = [
        r.get() for r in algo.learner_group.foreach_learner(lambda learner, _p=prompts, _c=completions: _sampler_logps(learner, _p, _c))
    ][0]
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, atol=1e-4)


def _seed_pool(algo):
    from rllib_exgrpo.core.groups import Trajectory, score_groups

    def group(qid, rewards, start):
        return [
            Trajectory(qid, np.array([3, 4]), np.array([start + i, 7]), np.full(2, -0.2, np.float32), float(r))
            for i, r in enumerate(rewards)
        ]

    ids = algo.sampler.question_ids
    algo.experience.observe(score_groups(group(ids[0], [1, 0, 0, 0], 20) + group(ids[2], [1, 1, 0, 1], 40)), iteration=algo.iteration)


def _perturb_adapters(learner):
    """Adapters as training leaves them (B no longer zero), the same on every learner."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in learner.module["default_policy"].unwrapped().named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _run_train_restore_train(cfg, tmp_path, lora=False):
    from rllib_exgrpo.rllib.algorithm import ExGRPO

    algo = cfg.build_algo()
    try:
        if lora:
            algo.learner_group.foreach_learner(_perturb_adapters)
        assert algo.env_runner_group.local_env_runner.module is None  # no copy in the main process
        for i in range(2):
            result = algo.train()
            assert result["env_runners"]["num_episodes"] == 16
            assert np.isfinite(result["learners"]["default_policy"]["total_loss"])
            _check_logps(algo, lora)
            _check_local_runner(algo)  # fetched after the 1st update, current again after the 2nd
        assert "accuracy" in result["heldout"]
        _seed_pool(algo)
        algo.save_to_path(str(tmp_path / "ckpt"))
    finally:
        algo.stop()
    restored = ExGRPO.from_checkpoint(str(tmp_path / "ckpt"))
    try:
        assert restored.iteration == 2
        result = restored.train()
        assert result["training_iteration"] == 3
        assert result["experience"]["replayed_questions"] >= 1  # ExGRPO's replay reached
        assert result["env_runners"]["num_episodes"] >= 12
        _check_logps(restored, lora)
        assert restored.env_runner_group.local_env_runner.module is None
    finally:
        restored.stop()


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_one_local_learner_samples_trains_checkpoints_and_resumes(quick_tiny_model, tmp_path):
    _run_train_restore_train(_config(quick_tiny_model), tmp_path)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_two_ddp_learners_sample_their_shares(quick_tiny_model, tmp_path):
    cfg = _config(quick_tiny_model).learners(num_learners=2, num_cpus_per_learner=0.5)
    _run_train_restore_train(cfg, tmp_path)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_lora_learner_samples_from_its_adapted_weights(quick_tiny_model, tmp_path):
    _run_train_restore_train(_config(quick_tiny_model, lora_rank=4, lora_alpha=8.0, lr=1e-2), tmp_path, lora=True)


# --- vLLM in the learner (vLLM's CPU build: no sleep mode) ------------------------------------------
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_in_the_learner_takes_turns_and_samples_the_updated_weights(quick_tiny_model):
    pytest.importorskip("vllm", reason="vllm not installed (bash tests/run.sh vllm)")
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rllib_exgrpo.cli.rehearsal import VLLM_CPU_KWARGS
    from rllib_exgrpo.core.groups import trajectories_from_episodes
    from rllib_exgrpo.envs.reasoning_env import ReasoningEnv
    from rllib_exgrpo.models.loading import load_tokenizer
    from rllib_exgrpo.rllib.env_runner import token_spaces

    tok = load_tokenizer(quick_tiny_model)
    cfg = _config(quick_tiny_model, lora_rank=4, lora_alpha=8.0).training(
        max_response_tokens=8,
        generation_backend="vllm",
        behaviour_logprobs="engine",
        generation_batch_size=16,
        vllm_kwargs=dict(VLLM_CPU_KWARGS),
    )
    group = cfg.build_learner_group(spaces={DEFAULT_MODULE_ID: token_spaces(len(tok), 128, 8)})
    learner = group._learner
    ids = [p.id for p in ReasoningEnv({"dataset": "arithmetic"}).problems[:3]]
    gen = torch.Generator().manual_seed(0)
    try:
        for turn in range(2):
            _, episodes, _, _ = learner.colocated_sample([[ids, [2] * len(ids), [None] * len(ids)]], {})
            trajs = trajectories_from_episodes(episodes)
            assert len(trajs) == 6
            rows, want, _ = learner.score_rows([t.prompt_ids for t in trajs], [t.completion_ids for t in trajs], tok.pad_token_id)
            for j, i in enumerate(rows):  # the engine sampled from the learner's current (merged) weights
                np.testing.assert_allclose(trajs[i].logp, want[j], atol=2e-3, rtol=0)
            with torch.no_grad():  # the adapters move, as an update moves them
                for name, p in learner.module[DEFAULT_MODULE_ID].named_parameters():
                    if ".lora_B." in name:
                        p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        sampler = learner.colocated_sampler()
        assert sampler.record.phases == list(PHASES) * 2 and sampler.record.overlaps() == []
        assert sampler._said_no_sleep  # the CPU build: sleep and wake skipped, said once
    finally:
        learner.colocated_sampler().backend.close()
        group.shutdown()


def test_a_learners_error_while_scoring_reaches_the_user_as_itself():
    from rllib_exgrpo.rllib.rollouts import score_on_learners

    class _Scoring(_FailingLearners):
        def foreach_learner(self, func):
            import traceback

            from ray.exceptions import RayTaskError
            from ray.rllib.utils.actor_manager import RemoteCallResults, ResultOrError

            results = RemoteCallResults()
            try:
                raise RuntimeError("gloo: connection closed by peer")
            except RuntimeError as e:
                results.add_result(1, ResultOrError(error=RayTaskError("score_rows", traceback.format_exc(), e)), None)
            return results

    with pytest.raises(RuntimeError, match="scoring on the learners failed on learner actor 1: RuntimeError: gloo"):
        score_on_learners(_Scoring(fail_rank=-1), [[1, 2]], [[3]], 0)
