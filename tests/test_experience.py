"""ExGRPO experience management on hand-made groups: delayed start, plan, replay choice."""

import numpy as np
import pytest

from rllib_exgrpo.core.groups import Trajectory, score_groups
from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
from rllib_exgrpo.exgrpo.experience import ExperienceManager
from rllib_exgrpo.core.question_sampler import QuestionSampler

G = 4


def config(**kw):
    return ExGRPOConfig().training(group_size=G, questions_per_step=4, **kw)


def group(qid, rewards, start=10):
    # Distinct completions so dedupe keeps every correct one.
    return [
        Trajectory(qid, np.array([1, 2]), np.array([start + i, 3]), np.full(2, -0.1, np.float32), float(r)) for i, r in enumerate(rewards)
    ]


def test_delayed_start_and_pool_filling():
    m = ExperienceManager(config())
    assert not m.mixed_mode
    # Solve rate 2/8 = 0.25 <= 0.35: stays on-policy, pool stays empty (official).
    out = m.observe(score_groups(group("a", [1, 0, 0, 0]) + group("b", [1, 0, 0, 0])), iteration=0)
    assert out["step_solve_rate"] == 0.25 and not m.mixed_mode and len(m.buffer) == 0
    # 3/8 = 0.375 > 0.35: switches for good; the switch step's groups are not pooled
    # (official: collection runs before the flag is set).
    m.observe(score_groups(group("a", [1, 1, 0, 0]) + group("b", [1, 0, 0, 0])), iteration=1)
    assert m.mixed_mode and m.switch_iteration == 1 and len(m.buffer) == 0
    m.observe(score_groups(group("a", [1, 1, 0, 0]) + group("b", [1, 0, 0, 0])), iteration=2)
    assert m.buffer.bucket_of("a") == 2 and m.buffer.bucket_of("b") == 1
    m.observe(score_groups(group("c", [0, 0, 0, 0])), iteration=3)
    assert m.mixed_mode  # never switches back


def test_pool_switch_step_option_pools_the_switch_step():
    m = ExperienceManager(config(pool_switch_step=True))
    m.observe(score_groups(group("a", [1, 1, 0, 0]) + group("b", [1, 0, 0, 0])), iteration=0)
    assert m.mixed_mode and m.buffer.bucket_of("a") == 2


def test_solved_questions_retire_from_the_first_step_while_on_policy():
    m = ExperienceManager(config())
    # 5/8 solved would switch; keep the threshold out of reach to stay on-policy
    m.config.delayed_start_solve_rate = 0.99
    m.observe(score_groups(group("a", [1, 1, 1, 1]) + group("b", [1, 0, 0, 0])), iteration=0)
    assert not m.mixed_mode and m.buffer.is_retired("a") and len(m.buffer) == 0
    late = ExperienceManager(config(retire_before_start=False, delayed_start_solve_rate=0.99))
    late.observe(score_groups(group("a", [1, 1, 1, 1])), iteration=0)
    assert not late.buffer.is_retired("a")
    # plain GRPO (no replay) never retires
    grpo = ExperienceManager(config(experience_replay=False, delayed_start_solve_rate=0.99))
    grpo.observe(score_groups(group("a", [1, 1, 1, 1])), iteration=0)
    assert not grpo.buffer.is_retired("a")


def test_fill_pool_before_start_option():
    m = ExperienceManager(config(fill_pool_before_start=True))
    m.observe(score_groups(group("a", [1, 0, 0, 0])), iteration=0)
    assert not m.mixed_mode and "a" in m.buffer


def test_retirement_and_fresh_exclusion():
    m = ExperienceManager(config(delayed_start_solve_rate=0.0, retire_min_remaining=0))
    m.observe(score_groups(group("a", [1, 1, 1, 1]) + group("b", [1, 0, 1, 0])), iteration=0)
    assert m.buffer.is_retired("a") and "a" not in m.buffer and "b" in m.buffer
    ids = [f"q{i}" for i in range(20)] + ["a", "b"]
    sampler = QuestionSampler(ids, seed=0)
    for _ in range(10):
        fresh, replay = m.plan(4, sampler, len(ids))
        assert "a" not in fresh
        assert replay == ["b"] and "b" not in fresh and len(fresh) == 3


def test_no_replay_before_switch_or_when_off():
    m = ExperienceManager(config(fill_pool_before_start=True))
    m.observe(score_groups(group("a", [1, 0, 0, 0])), iteration=0)
    assert m.num_replayed(4) == 0  # pooled, but mixed mode is off
    off = ExperienceManager(config(experience_replay=False, delayed_start_solve_rate=0.0))
    off.observe(score_groups(group("a", [1, 0, 0, 0])), iteration=0)
    assert off.num_replayed(4) == 0 and len(off.buffer) == 0


def test_replay_count_is_min_of_pool_and_ratio():
    m = ExperienceManager(config(delayed_start_solve_rate=0.0, experience_ratio=0.5))
    for q in "abc":
        m.observe(score_groups(group(q, [1, 0, 0, 0])), iteration=0)
    assert m.num_replayed(4) == 2  # floor(0.5 * 4)
    assert m.num_replayed(10) == 3  # only 3 pooled


def test_replay_chooses_lowest_entropy_under_current_policy():
    m = ExperienceManager(config(delayed_start_solve_rate=0.0))
    m.observe(score_groups(group("a", [1, 1, 1, 0], start=20)), iteration=0)
    stored = m.buffer.trajectories("a")
    assert len(stored) == 3
    wanted = 1  # give the second stored trajectory the lowest mean entropy

    def scorer(prompts, completions):
        assert len(completions) == 3  # every stored trajectory re-scored in one call
        ent = [np.full(len(c), 2.0 - (i == wanted) * 1.5) for i, c in enumerate(completions)]
        return [np.zeros(len(c)) for c in completions], ent

    chosen, metrics = m.replayed_trajectories(["a"], scorer)
    assert len(chosen) == 1 and chosen[0].off_policy and chosen[0].reward == 1.0
    np.testing.assert_array_equal(chosen[0].completion_ids, stored[wanted].completion_ids)
    assert metrics["chosen_trajectory_entropy"] == pytest.approx(0.5)


def test_replay_candidates_per_question_scores_the_most_recent_only():
    m = ExperienceManager(config(delayed_start_solve_rate=0.0, replay_candidates_per_question=2))
    m.observe(score_groups(group("a", [1, 1, 1, 0], start=20)), iteration=0)
    stored = m.buffer.trajectories("a")
    seen = []

    def scorer(prompts, completions):
        seen.extend(c.tolist() for c in completions)
        return [np.zeros(len(c)) for c in completions], [np.full(len(c), float(i)) for i, c in enumerate(completions)]

    chosen, metrics = m.replayed_trajectories(["a"], scorer)
    assert seen == [t.completion_ids.tolist() for t in stored[-2:]]  # the 2 most recent of 3
    np.testing.assert_array_equal(chosen[0].completion_ids, stored[1].completion_ids)  # lowest entropy of the 2
    assert metrics["replay_scored_trajectories"] == 2
    assert metrics["replay_scored_tokens"] == sum(len(t.completion_ids) for t in stored[-2:])


def test_seeded_completions_do_not_count_or_enter_pool():
    m = ExperienceManager(config(delayed_start_solve_rate=0.0))
    ts = group("a", [0, 0, 0, 0])
    seeded = group("a", [1, 1], start=50)
    for t in seeded:
        t.off_policy = t.seeded = True
    m.observe(score_groups(ts + seeded), iteration=0)
    assert "a" not in m.buffer


def test_state_round_trip():
    m = ExperienceManager(config(delayed_start_solve_rate=0.0, retire_min_remaining=0))
    m.observe(score_groups(group("a", [1, 0, 0, 0]) + group("b", [1, 1, 1, 1]) + group("c", [1, 1, 0, 0])), iteration=3)
    state = m.get_state()
    m2 = ExperienceManager(config())
    m2.set_state(state)
    assert m2.mixed_mode and m2.switch_iteration == 0
    assert set(m2.buffer) == {"a", "c"} and set(m2.buffer.retired) == {"b"}
    assert m2.buffer.sample_questions(2) == m.buffer.sample_questions(2)


def _cooldown_manager(cooldown):
    m = ExperienceManager(
        config(delayed_start_solve_rate=0.0, retire_min_remaining=0, experience_ratio=0.5, replay_cooldown_steps=cooldown)
    )
    groups = []
    for q in "abcd":  # four pooled questions, all in bucket 2
        groups += group(q, [1, 1, 0, 0])
    m.observe(score_groups(groups), iteration=0)
    return m, QuestionSampler([f"f{i}" for i in range(20)], seed=0)


def test_replay_cooldown_spreads_the_draw_and_survives_a_restore():
    # B = 4, rho 0.5: 2 replayed questions a step out of 4 pooled ones.
    m, fresh = _cooldown_manager(cooldown=1)
    replayed = [set(m.plan(4, fresh, 20, iteration=t)[1]) for t in range(1, 7)]
    for t in range(1, len(replayed)):
        # a question replayed at step t waits one step: steps t and t+1 share none
        assert len(replayed[t]) == 2 and not (replayed[t] & replayed[t - 1])
    assert set().union(*replayed) == set("abcd")
    # the cooldown is part of the state: a restored manager skips the same questions
    state = m.get_state()
    m2, _ = _cooldown_manager(cooldown=1)
    m2.set_state(state)
    assert m2.cooling_down(7) == m.cooling_down(7) == replayed[-1]
    # official (no cooldown): nothing is excluded
    off, _ = _cooldown_manager(cooldown=0)
    off.plan(4, fresh, 20, iteration=1)
    assert off.cooling_down(2) == set()


def test_replay_cooldown_longer_than_the_pool_allows_replays_less():
    # 4 pooled questions, 2 slots, cooldown 3: after two steps everything is cooling down.
    m, fresh = _cooldown_manager(cooldown=3)
    sizes = [len(m.plan(4, fresh, 20, iteration=t)[1]) for t in range(1, 6)]
    assert sizes == [2, 2, 0, 0, 2]
    # the step's remaining slots go to fresh questions
    fresh_ids, replay_ids = m.plan(4, fresh, 20, iteration=6)
    assert len(fresh_ids) + len(replay_ids) == 4


def test_check_delayed_start_fires_once_above_the_threshold():
    m = ExperienceManager(config(delayed_start_solve_rate=0.35))
    assert not m.check_delayed_start(0.35, iteration=0)  # strictly above
    assert m.check_delayed_start(0.36, iteration=3) and m.switch_iteration == 3
    assert not m.check_delayed_start(0.9, iteration=4) and m.switch_iteration == 3  # for good, once
    assert m.learner_mixed_mode
    grpo = ExperienceManager(config(experience_replay=False, delayed_start_solve_rate=0.0))
    assert grpo.mixed_mode and not grpo.learner_mixed_mode  # on-policy GRPO never mixes


def test_prompt_replay_brings_back_the_question_alone():
    """replay_content: prompt (the control): a pooled question is drawn as usual but comes
    back with G fresh samples and no stored trajectory, so nothing is scored for it."""
    m = ExperienceManager(config(replay_content="prompt", delayed_start_solve_rate=0.0))
    m.observe(score_groups(group("a", [1, 1, 0, 0]) + group("b", [1, 0, 0, 0])), iteration=0)
    assert len(m.buffer) == 2 and m.mixed_mode
    sampler = QuestionSampler(["a", "b", "c", "d", "e", "f"], seed=0)
    fresh, replay = m.plan(4, sampler, 6)
    assert len(replay) == 2 and not set(replay) & set(fresh)

    def scorer(*_):
        raise AssertionError("nothing is scored when only the question comes back")

    assert m.replayed_trajectories(replay, scorer) == ([], {})
    assert m.fresh_samples_of_replayed(G) == G
    assert ExperienceManager(config()).fresh_samples_of_replayed(G) == G - 1
    with pytest.raises(ValueError, match="replay_content"):
        config(replay_content="questions").validate()
