"""ExGRPO / GRPO on RLlib end to end with a real (quick) tiny model, real Ray actors."""

import copy

import numpy as np
import pytest
import torch

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.groups import Trajectory, learner_batch, score_groups, to_multi_agent_batch
from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

pytestmark = pytest.mark.usefixtures("ray_local")


def small_config(model, **kw):
    return (
        ExGRPOConfig()
        .environment(env_config={"dataset": "arithmetic"})
        .training(
            model_name_or_path=model,
            questions_per_step=4,
            group_size=4,
            max_prompt_tokens=128,
            max_response_tokens=12,
            lr=1e-3,
            minibatch_size=16,
            loss_agg_mode="token-mean",
            heldout_dataset="arithmetic",
            heldout_num_questions=4,
            heldout_interval=1,
            **kw,
        )
    )


@pytest.fixture(scope="module")
def algo(quick_tiny_model, tmp_path_factory):
    a = small_config(quick_tiny_model, delayed_start_solve_rate=0.0).build_algo()
    yield a
    a.stop()


def test_training_iteration_reports_stages_and_metrics(algo):
    result = algo.train()
    timers = result["timers"]
    for stage in ("plan", "sample", "advantages", "learner_update_timer", "synch_weights", "heldout_eval"):
        assert timers[stage] > 0, stage
    assert result["env_runners"]["num_episodes"] == 16  # 4 questions x G = 4
    # sampled completion tokens of the iteration (the held-out evaluation is not counted)
    runners = result["env_runners"]
    assert 16 <= runners["num_response_tokens"] <= 16 * algo.config.max_response_tokens
    assert runners["num_response_tokens_lifetime"] == runners["num_response_tokens"]
    # greedy, so measuring again under the same weights gives the same number
    assert result["heldout"]["accuracy"] == algo.evaluate_heldout()["accuracy"]
    learner = result["learners"]["default_policy"]
    assert np.isfinite(learner["total_loss"]) and learner["entropy"] > 0
    assert result["experience"]["mixed_mode"] == 1.0


def _logp_of(algo, batch):
    module = algo.learner_group._learner.module["default_policy"]
    with torch.no_grad():
        out = module._forward_train({k: torch.as_tensor(v) for k, v in batch.items()})
    return (out[C.LOGP] * torch.as_tensor(batch[C.RESPONSE_MASK])).sum(-1).numpy()


def test_learner_step_moves_logp_with_the_advantage_sign(algo):
    runner = algo.env_runner_group.local_env_runner
    prompt = np.asarray(runner.encode_prompt(algo.sampler.question_ids[0]))
    good, bad = np.array([9, 10, 11]), np.array([12, 13, 14])
    trajs = []
    for comp, reward in ((good, 1.0), (bad, 0.0)):
        logp, _ = runner.score_trajectories([prompt], [comp])
        trajs.append(Trajectory("q", prompt, comp, logp[0].astype(np.float32), reward))
    groups = score_groups(trajs)
    batch = learner_batch(groups.trajectories, groups.advantages, algo._pad_id)
    before = _logp_of(algo, batch)
    for _ in range(3):
        algo.learner_group.update(batch=to_multi_agent_batch(batch), minibatch_size=2, num_epochs=1)
    after = _logp_of(algo, batch)
    assert groups.advantages[0] > 0 > groups.advantages[1]
    assert after[0] > before[0] and after[1] < before[1]


def test_checkpoint_restores_buffer_and_training_continues(algo, tmp_path):
    from rllib_exgrpo.rllib.algorithm import ExGRPO

    def group(qid, rewards, start):
        return [
            Trajectory(qid, np.array([3, 4]), np.array([start + i, 7]), np.full(2, -0.2, np.float32), float(r))
            for i, r in enumerate(rewards)
        ]

    ids = algo.sampler.question_ids
    algo.experience.observe(
        score_groups(group(ids[0], [1, 0, 0, 0], 20) + group(ids[1], [1, 1, 1, 1], 30) + group(ids[2], [1, 1, 0, 1], 40)),
        iteration=algo.iteration,
    )
    algo.save_to_path(str(tmp_path))
    restored = ExGRPO.from_checkpoint(str(tmp_path))
    try:
        buf, ref = restored.experience.buffer, algo.experience.buffer
        assert set(buf) == set(ref) and set(buf.retired) == set(ref.retired) == {ids[1]}
        for q in ref:
            assert buf.bucket_of(q) == ref.bucket_of(q)
            assert [t.completion_ids.tolist() for t in buf.trajectories(q)] == [t.completion_ids.tolist() for t in ref.trajectories(q)]
        assert restored.sampler.get_state() == algo.sampler.get_state()
        assert restored.iteration == algo.iteration
        result = restored.train()
        assert result["training_iteration"] == algo.iteration + 1
        # Replay happened from the restored pool: its questions were chosen this step.
        assert result["experience"]["replayed_questions"] >= 1
    finally:
        restored.stop()


@pytest.mark.slow
def test_remote_env_runners_and_xrpo(quick_tiny_model):
    """Two remote runners: XRPO's planner, seeding and sharpening, and ExGRPO's replay
    choice scored on both runners at once (a pool seeded with medium-bucket questions)."""
    cfg = small_config(
        quick_tiny_model,
        xrpo_planner=True,
        planner_n0=2,
        novelty_sharpening=True,
        icl_seeding=True,
        delayed_start_solve_rate=0.0,
    ).env_runners(num_env_runners=2, num_cpus_per_env_runner=0.5)
    a = cfg.build_algo()
    try:
        ids = a.sampler.question_ids
        seeded = [
            Trajectory(qid, np.array([3, 4]), np.array([20 + 10 * q + i, 7] + [9] * i), np.full(2 + i, -0.2, np.float32), float(r))
            for q, qid in enumerate(ids[:4])
            for i, r in enumerate([1, 1, 0, 1])
        ]
        a.experience.observe(score_groups(seeded), iteration=a.iteration)
        result = a.train()
        assert result["env_runners"]["num_episodes"] >= 8
        xrpo = result["xrpo"]
        assert xrpo["completions_per_question_mean"] == pytest.approx(4.0)
        assert "sharpened_fraction" in xrpo and "all_failing_questions" in xrpo
        experience = result["experience"]
        assert experience["replayed_questions"] >= 1
        assert experience["replay_scored_trajectories"] >= 3 and experience["replay_scoring_runners"] == 2
        # Every key of a real result (XRPO, replay, remote runners) is one preflight knows, so
        # any of them may be a stop key: the declared metric names cover what the code logs.
        from rllib_exgrpo.cli import preflight

        # (Tune's Trainable adds pid, hostname, ... to every result: not metrics of the algorithm)
        leaves = preflight.flatten_stop({k: v for k, v in result.items() if k not in ("config", "pid", "node_ip")})
        unknown = [
            k
            for k, v in leaves.items()
            if isinstance(v, (int, float))
            and not isinstance(v, bool)
            and preflight.metric_problem(k, type(a), a.config, "stop") is not None
        ]
        assert not unknown, unknown
    finally:
        a.stop()


def test_replay_scoring_shards_are_sorted_and_balanced_by_tokens():
    from rllib_exgrpo.core.minibatches import shard_by_tokens

    lengths = [5, 100, 7, 50, 6, 52]
    shards = shard_by_tokens(lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(6))
    assert shards == [[0, 4, 2, 3, 5], [1]]  # sorted by length: 120 and 100 tokens
    assert shard_by_tokens([3], 4) == [[0]] and shard_by_tokens([], 2) == []


@pytest.mark.slow
@pytest.mark.parametrize("num_learners,expected_steps", [(0, 4), (2, 2)])
def test_optimizer_steps_and_rows_trained_per_iteration(quick_tiny_model, num_learners, expected_steps):
    """16 rows (4 questions x G = 4), minibatch 4 rows per learner: 16 / (4 x learners)
    optimiser steps, and every row trained exactly once (none repeated, none dropped)."""
    cfg = small_config(quick_tiny_model).learners(num_learners=num_learners)
    cfg.minibatch_size, cfg.heldout_dataset = 4, None
    algo = cfg.build_algo()
    try:
        result = algo.train()
    finally:
        algo.stop()
    assert result["optimizer_steps"] == expected_steps
    assert result["minibatch_rows_min"] == result["minibatch_rows_max"] == 16 // expected_steps
    learner = result["learners"]["default_policy"]
    assert learner["num_module_steps_trained"] == result["num_completions"] == 16


@pytest.mark.slow
def test_async_rollouts_train_on_the_batch_collected_during_the_last_iteration(quick_tiny_model):
    """async_rollouts: the first iteration collects its batch first (staleness 0), later ones
    train on the batch collected during the previous iteration (staleness 1) while the next
    is collected; the pool, the learner and the weight sync go on as in strict alternation."""
    cfg = small_config(
        quick_tiny_model,
        delayed_start_solve_rate=0.0,
        async_rollouts=True,
    ).env_runners(num_env_runners=1, num_cpus_per_env_runner=0.5)
    a = cfg.build_algo()
    try:
        results = [a.train() for _ in range(3)]
        assert [r["async_batch_staleness"] for r in results] == [0, 1, 1]
        # Two batches collected in the first iteration, one in each later one.
        assert [r["env_runners"]["num_episodes"] for r in results] == [32, 16, 16]
        for r in results:
            learner = r["learners"]["default_policy"]
            assert np.isfinite(learner["total_loss"]) and learner["num_module_steps_trained"] == 16
        assert "heldout" in results[1]
        assert a._next_step is not None  # the batch for iteration 4, collected with the current weights
        from ray.rllib.core import COMPONENT_RL_MODULE

        synced = a.env_runner_group.foreach_env_runner(
            lambda r: {k: np.asarray(v, dtype=np.float32) for k, v in r.module.get_state().items()}, local_env_runner=False
        )[0]
        learned = a.learner_group.get_state(components=f"learner/{COMPONENT_RL_MODULE}", inference_only=True)
        learned = learned["learner"][COMPONENT_RL_MODULE]["default_policy"]
        assert all(np.allclose(synced[k], np.asarray(learned[k], dtype=np.float32)) for k in synced)
    finally:
        a.stop()


def test_async_rollouts_need_a_remote_runner(quick_tiny_model):
    with pytest.raises(ValueError, match="async_rollouts: needs num_env_runners >= 1"):
        small_config(quick_tiny_model, async_rollouts=True).validate()


def test_prompt_replay_samples_replayed_questions_afresh_and_trains_no_stored_row(quick_tiny_model):
    """replay_content: prompt: a pooled question is re-selected but comes back with G fresh
    samples and no stored trajectory (no off-policy row reaches the learner); the held-out
    dataset's other splits are evaluable beside the configured one."""
    algo = small_config(quick_tiny_model, delayed_start_solve_rate=0.0, replay_content="prompt").build_algo()
    try:
        ids = algo.sampler.question_ids
        algo.experience.observe(
            score_groups(
                [
                    Trajectory(q, np.array([3, 4]), np.array([20 + i, 7]), np.full(2, -0.2, np.float32), float(i == 0))
                    for q in ids[:3]
                    for i in range(4)
                ]
            ),
            iteration=0,
        )
        assert len(algo.experience.buffer) == 3
        result = algo.train()
        assert result["experience"]["replayed_questions"] >= 1, result["experience"]
        assert result["env_runners"]["num_episodes"] == 16  # 4 questions x G, replayed ones too
        assert result["learners"]["default_policy"]["replayed_token_fraction"] == 0.0

        runner = algo.env_runner
        assert runner.heldout_split_env(algo.config.heldout_split) is runner.heldout_env
        train_env = runner.heldout_split_env("train")
        assert not {p.id for p in train_env.problems[:50]} & {p.id for p in runner.heldout_env.problems[:50]}
        episodes = runner.sample(
            question_ids=[p.id for p in train_env.problems[:2]], num_samples=1, heldout="train", temperature=0.0, return_logprobs=False
        )
        assert len(episodes) == 2
    finally:
        algo.stop()


def test_a_replayed_row_is_its_stored_success_under_its_own_prompt_and_the_update_raises_it(quick_tiny_model):
    """The replay path end to end: a pooled question's stored correct trajectory reaches the
    learner under that question's prompt, with its recorded log-probs as behaviour, marked
    off-policy, with the group-relative advantage of reward 1 among its G - 1 fresh
    neighbours; one update makes it more likely than the same update without its advantage."""
    from rllib_exgrpo.exgrpo.buffer import decode_logp, encode_logp

    algo = small_config(quick_tiny_model, delayed_start_solve_rate=0.0, experience_ratio=0.5).build_algo()
    try:
        runner = algo.env_runner_group.local_env_runner
        pooled = algo.sampler.question_ids[:2]
        stored = {}
        trajs = []
        for q in pooled:
            prompt = np.asarray(runner.encode_prompt(q))
            success = np.array([20, 21, 22])
            logp, _ = runner.score_trajectories([prompt], [success])
            stored[q] = (prompt, success, logp[0].astype(np.float32))
            trajs.append(Trajectory(q, prompt, success, logp[0].astype(np.float32), 1.0))
            trajs += [Trajectory(q, prompt, np.array([30 + i, 7]), np.full(2, -3.0, np.float32), 0.0) for i in range(3)]
        algo.experience.observe(score_groups(trajs), iteration=0)
        assert set(algo.experience.buffer) == set(pooled)

        step = algo._collect_step()
        batch, groups = step.batch, step.groups
        rows = np.flatnonzero(batch[C.OFF_POLICY] > 0)
        assert len(rows) == 2  # floor(0.5 x 4 questions), both pooled questions
        for i in rows:
            t = groups.trajectories[i]
            prompt, success, logp = stored[t.question_id]
            assert np.array_equal(t.prompt_ids, prompt) and np.array_equal(t.completion_ids, success)
            n = int(batch[C.RESPONSE_MASK][i].sum())
            assert n == len(success)
            # the behaviour log-probs are the recorded ones (through the pool's storage dtype)
            want = decode_logp(encode_logp(logp, algo.config.buffer_logp_dtype))
            np.testing.assert_allclose(batch[C.OLD_LOGP][i][:n], want, rtol=0, atol=1e-6)
            members = groups.group_index == groups.group_index[i]
            assert members.sum() == algo.config.group_size  # 1 replayed + G - 1 fresh
            rewards = np.array([tr.reward for tr, m in zip(groups.trajectories, members) if m])
            assert batch[C.ADVANTAGES][i] == pytest.approx(1.0 - rewards.mean())
        # Whether a row's log-prob rises in absolute terms also depends on its fresh
        # neighbours (Adam's first step is close to sign(gradient of the whole batch)), so the
        # claim is counterfactual: the same update from the same learner state with the
        # replayed rows' advantages zeroed leaves them less likely than the real one does.
        learner = algo.learner_group._learner
        start = copy.deepcopy(learner.get_state())  # module weights and optimizer moments
        before = _logp_of(algo, batch)
        algo._timed_update(step)
        after = _logp_of(algo, batch)
        learner.set_state(start)
        np.testing.assert_allclose(_logp_of(algo, batch), before, rtol=0, atol=1e-5)
        muted = dict(batch)
        muted[C.ADVANTAGES] = batch[C.ADVANTAGES].copy()
        muted[C.ADVANTAGES][rows] = 0.0
        algo._update_learners(muted, groups.group_index)
        without = _logp_of(algo, batch)
        positive = rows[batch[C.ADVANTAGES][rows] > 0]
        assert len(positive) > 0 and np.all(after[positive] > without[positive])
    finally:
        algo.stop()
