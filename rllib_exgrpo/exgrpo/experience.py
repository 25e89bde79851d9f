"""ExGRPO's experience management around the buffer: plan, replay choice, update, switch.

``ExperienceManager`` holds what ExGRPO adds to a GRPO step (docs/ALGORITHMS.md section 2):

* **plan**: of B questions, ``min(#pooled, floor(rho * B))`` come from the pool (in mixed
  mode), the rest are fresh questions that are not retired; with ``replay_cooldown_steps``
  c > 0 (not in the papers) a question replayed at step t can be replayed again from step
  t + c + 1 on;
* **replay choice**: every stored trajectory of a replayed question is re-scored under the
  current policy (one batched pass by a ``scorer`` callable) and the one with the lowest
  mean token entropy (or the configured rule) is replayed;
* **update**: after scoring, each group updates the pool (buckets, retirement, new
  correct trajectories);
* **delayed start**: mixed mode switches on for good once a step's solve rate exceeds
  the threshold.

No RLlib here: the algorithm passes in the scorer (an env runner's batched forward pass)
and the scored groups, so this class is testable on hand-made data.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from rllib_exgrpo.core.groups import ScoredGroups, Trajectory
from rllib_exgrpo.exgrpo.buffer import UPDATE_RESULTS, ExperienceBuffer, choose_trajectory, mean_over_tokens

#: The metrics the manager reports (logged under ``experience/``): :meth:`ExperienceManager.metrics`
#: (besides one ``bucket_<k>`` per correctness bucket), :meth:`~ExperienceManager.observe`
#: (one ``pool_<outcome>`` per outcome of an update) and the replay choice.
POOL_METRICS = ("mixed_mode", "pool_size", "pool_trajectories", "retired", "switch_iteration")
OBSERVE_METRICS = ("step_solve_rate", "switched") + tuple(f"pool_{outcome}" for outcome in UPDATE_RESULTS)
REPLAY_CHOICE_METRICS = ("chosen_trajectory_entropy", "replay_scored_trajectories", "replay_scored_tokens")

#: (prompts, completions) -> (per-token log-probs, per-token entropies), one array per row.
Scorer = Callable[[Sequence[np.ndarray], Sequence[np.ndarray]], Tuple[List[np.ndarray], List[np.ndarray]]]


class ExperienceManager:
    def __init__(self, config, *, seed: int = 0):
        self.config = config
        self.buffer = ExperienceBuffer(
            config.group_size,
            capacity=config.buffer_capacity,
            bucket_weighting=config.bucket_weighting,
            mu=config.bucket_mu,
            sigma=config.bucket_sigma,
            logp_dtype=config.buffer_logp_dtype,
            seed=seed,
        )
        self.mixed_mode = config.delayed_start_solve_rate == 0
        self.switch_iteration: Optional[int] = 0 if self.mixed_mode else None
        self._rng = np.random.default_rng([seed, 7])
        #: question id -> the iteration it was last replayed at (only while cooling down).
        self._last_replayed: Dict[str, int] = {}

    # ---- plan --------------------------------------------------------------------------
    def num_replayed(self, questions_per_step: int) -> int:
        if not (self.config.experience_replay and self.mixed_mode):
            return 0
        return min(len(self.buffer), math.floor(self.config.experience_ratio * questions_per_step))

    def fresh_exclusions(self, num_questions: int, questions_per_step: int) -> set:
        """Retired questions leave the fresh data while enough questions remain (official)."""
        if not self.config.retire_solved:
            return set()
        retired = set(self.buffer.retired)
        if num_questions - len(retired) > questions_per_step + self.config.retire_min_remaining:
            return retired
        return set()

    def cooling_down(self, iteration: int) -> set:
        """Pooled questions replayed within the last ``replay_cooldown_steps`` iterations,
        which this iteration's draw skips (forgetting the ones whose wait is over)."""
        cooldown = self.config.replay_cooldown_steps
        self._last_replayed = {q: t for q, t in self._last_replayed.items() if iteration - t <= cooldown}
        return set(self._last_replayed)

    def plan(self, questions_per_step: int, fresh_sampler, num_questions: int, iteration: int = 0) -> Tuple[List[str], List[str]]:
        """Question ids of one step: (fresh, replayed)."""
        n_replay = self.num_replayed(questions_per_step)
        if self.config.replay_cooldown_steps and n_replay:
            replay_ids = self.buffer.sample_questions(n_replay, exclude=self.cooling_down(iteration))
            self._last_replayed.update(dict.fromkeys(replay_ids, iteration))
        else:
            replay_ids = self.buffer.sample_questions(n_replay)
        exclude = self.fresh_exclusions(num_questions, questions_per_step) | set(replay_ids)
        fresh_ids = fresh_sampler.next_batch(questions_per_step - len(replay_ids), exclude=exclude)
        return fresh_ids, replay_ids

    def fresh_samples_of_replayed(self, group_size: int) -> int:
        """Fresh completions a replayed question gets: G - 1 beside its stored trajectory,
        or G when only the question comes back (``replay_content: prompt``)."""
        return group_size if self.config.replay_content == "prompt" else group_size - 1

    # ---- replay choice ---------------------------------------------------------------
    def replayed_trajectories(self, replay_ids: Sequence[str], scorer: Optional[Scorer]) -> Tuple[List[Trajectory], Dict[str, float]]:
        """The trajectory to replay for each question, chosen under the current policy
        (none with ``replay_content: prompt``: the question alone comes back)."""
        if not replay_ids or self.config.replay_content == "prompt":
            return [], {}
        mode = self.config.trajectory_selection
        cap = self.config.replay_candidates_per_question

        def candidates_of(qid: str):  # the most recent ``cap`` stored trajectories (None: all)
            trajs = self.buffer.trajectories(qid)
            return trajs[-cap:] if cap else trajs

        candidates = [(qid, t) for qid in replay_ids for t in candidates_of(qid)]
        need_scores = mode != "random"
        entropies: List[np.ndarray] = []
        logps: List[np.ndarray] = []
        if need_scores:
            prompts = [self.buffer.prompt_ids(qid) for qid, _ in candidates]
            logps, entropies = scorer(prompts, [t.completion_ids for _, t in candidates])
        mean_h = mean_over_tokens(entropies) if need_scores else np.zeros(len(candidates))
        mean_lp = mean_over_tokens(logps) if need_scores else np.zeros(len(candidates))
        chosen: List[Trajectory] = []
        chosen_entropy: List[float] = []
        start = 0
        for qid in replay_ids:
            n = len(candidates_of(qid))
            stats = [(mean_h[start + i], mean_lp[start + i]) for i in range(n)]
            pick = start + choose_trajectory(stats, mode, self._rng)
            stored = candidates[pick][1]
            chosen.append(
                Trajectory(
                    question_id=qid,
                    prompt_ids=np.asarray(self.buffer.prompt_ids(qid), dtype=np.int64),
                    completion_ids=np.asarray(stored.completion_ids, dtype=np.int64),
                    logp=stored.logp_float32(),
                    reward=1.0,
                    off_policy=True,
                )
            )
            chosen_entropy.append(float(mean_h[pick]))
            start += n
        metrics = {
            "chosen_trajectory_entropy": float(np.mean(chosen_entropy)) if need_scores else float("nan"),
            "replay_scored_trajectories": float(len(candidates) if need_scores else 0),
            "replay_scored_tokens": float(sum(len(t.completion_ids) for _, t in candidates) if need_scores else 0),
        }
        return chosen, metrics

    # ---- update ------------------------------------------------------------------------
    def check_delayed_start(self, solve_rate: float, iteration: int) -> bool:
        """ExGRPO's delayed start, the one place it is decided: mixed mode (replay, policy
        shaping, clip removal) switches on for good the first time a step's solve rate
        exceeds ``delayed_start_solve_rate`` (0: on from the first step, set in
        ``__init__``). Returns True on the step it fires."""
        if self.mixed_mode or solve_rate <= self.config.delayed_start_solve_rate:
            return False
        self.mixed_mode, self.switch_iteration = True, iteration
        return True

    @property
    def learner_mixed_mode(self) -> bool:
        """What the learner is told: mixed-mode loss only where experience is replayed."""
        return self.mixed_mode and self.config.experience_replay

    def observe(self, groups: ScoredGroups, *, iteration: int) -> Dict[str, float]:
        """Delayed-start check and pool update from one step's scored groups."""
        fresh_rewards = [t.reward for t in groups.trajectories if not t.off_policy]
        # Seeded completions had help: they neither count towards a question's
        # correctness nor enter the pool (their log-probs belong to another prompt).
        solve_rate = float(np.mean(np.asarray(fresh_rewards) >= 1.0)) if fresh_rewards else 0.0
        cfg = self.config
        # Official order: the step's groups are collected first, the switch is checked
        # after, so the groups of the switch step are not pooled (pool_switch_step=False).
        collect = cfg.experience_replay and (self.mixed_mode or cfg.fill_pool_before_start)
        switched = self.check_delayed_start(solve_rate, iteration)
        if switched:
            collect = collect or (cfg.experience_replay and cfg.pool_switch_step)
        # Before the pool fills, solved (G/G) questions are still retired (official: from
        # the first step): update_group on an all-correct group retires without storing.
        retire_only = not collect and cfg.experience_replay and cfg.retire_solved and cfg.retire_before_start
        outcomes: Dict[str, int] = {}
        if collect or retire_only:
            by_group: Dict[int, List[Trajectory]] = {}
            for g, t in zip(groups.group_index, groups.trajectories):
                if not t.seeded:
                    by_group.setdefault(int(g), []).append(t)
            for g, members in by_group.items():
                correct = [t for t in members if t.reward >= 1.0]
                if retire_only and len(correct) < len(members):
                    continue
                result = self.buffer.update_group(
                    groups.question_ids[g],
                    members[0].prompt_ids,
                    len(correct),
                    len(members),
                    [(t.completion_ids, t.logp) for t in correct],
                    iteration,
                )
                outcomes[result] = outcomes.get(result, 0) + 1
        return {"step_solve_rate": solve_rate, "switched": float(switched), **{f"pool_{k}": v for k, v in outcomes.items()}}

    # ---- metrics and state -----------------------------------------------------------
    def metrics(self) -> Dict[str, float]:
        out = {
            "mixed_mode": float(self.mixed_mode),
            "pool_size": len(self.buffer),
            "pool_trajectories": self.buffer.num_trajectories,
            "retired": self.buffer.num_retired,
            "switch_iteration": -1 if self.switch_iteration is None else self.switch_iteration,
        }
        histogram = self.buffer.bucket_histogram()
        for k in range(1, self.config.group_size):
            out[f"bucket_{k}"] = histogram.get(k, 0)
        return out

    def get_state(self) -> dict:
        return {
            "buffer": self.buffer.get_state(),
            "mixed_mode": self.mixed_mode,
            "switch_iteration": self.switch_iteration,
            "rng": self._rng.bit_generator.state,
            "last_replayed": dict(self._last_replayed),
        }

    def set_state(self, state: dict) -> None:
        self.buffer.set_state(state["buffer"])
        self.mixed_mode = state["mixed_mode"]
        self.switch_iteration = state["switch_iteration"]
        self._rng.bit_generator.state = state["rng"]
        self._last_replayed = {q: int(t) for q, t in state.get("last_replayed", {}).items()}
