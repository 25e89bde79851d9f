"""``ExGRPO`` (and on-policy ``GRPO``) as RLlib Algorithms.

One ``training_step``::

    plan -> sample (generate + score on the env runners) -> group & advantages
         -> learner update -> weight sync [-> held-out evaluation]

each stage timed in ``timers/``. With experience replay off this is on-policy GRPO.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ray.rllib.utils.annotations import override
from ray.rllib.utils.checkpoints import Checkpointable
from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig, NotProvided
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.utils.metrics import (
    ENV_RUNNER_RESULTS,
    LEARNER_RESULTS,
    LEARNER_UPDATE_TIMER,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    SYNCH_WORKER_WEIGHTS_TIMER,
    TIMERS,
)

from rllib_exgrpo.rllib import rllib_contract as rc
from rllib_exgrpo.core.groups import (
    Trajectory,
    learner_batch,
    score_groups,
    to_multi_agent_batch,
    trajectories_from_episodes,
)
from rllib_exgrpo.exgrpo.experience import (
    OBSERVE_METRICS,
    POOL_METRICS,
    REPLAY_CHOICE_METRICS,
    ExperienceManager,
)
from rllib_exgrpo.core.minibatches import plan_minibatches, take_rows
from rllib_exgrpo.core.question_sampler import QuestionSampler
from rllib_exgrpo.rllib.resources import apply_threads_for, fit_resources
from rllib_exgrpo.xrpo.steps import (
    PLANNER_METRICS,
    SEEDING_METRICS,
    SHARPENING_METRICS,
    AdaptiveRollouts,
    InContextSeeder,
    sharpen_advantages,
)
from rllib_exgrpo.envs.reasoning_env import ReasoningEnv
from rllib_exgrpo.rllib.config_attributes import ExGRPOConfigFields
from rllib_exgrpo.rllib.config_fields import (
    FIELDS_BY_NAME,
    RLLIB_FIELD_DEFAULTS,
    field_defaults,
    field_errors,
    training_doc,
    training_signature,
)
from rllib_exgrpo.rllib.env_runner import ENV_RUNNER_METRICS, LLMEnvRunner
from rllib_exgrpo.rllib.heldout import HELDOUT, HELDOUT_METRICS, HeldoutEvaluator
from rllib_exgrpo.rllib.learner import LEARNER_METRICS, ExGRPOTorchLearner
from rllib_exgrpo.rllib.module import LLMTorchRLModule
from rllib_exgrpo.rllib.colocation import COLOCATION_METRICS, learner_rank, sample_on_learners
from rllib_exgrpo.rllib.rollouts import ROLLOUT_METRICS, SCORING_RUNNERS_KEY, RolloutCoordinator, score_on_learners
from rllib_exgrpo.rllib.weight_broadcast import WeightBroadcaster, WeightSyncFailed, chosen_path
from rllib_exgrpo.models.loading import load_tokenizer
from rllib_exgrpo.rllib.checkpointing import atomic_folder, local_checkpoint_path
from rllib_exgrpo.rllib.deepspeed_learner import DeepSpeedExGRPOLearner, check_deepspeed_config

logger = logging.getLogger(__name__)

PLAN_TIMER = "plan"
REPLAY_CHOICE_TIMER = "replay_choice"
BUFFER_TIMER = "buffer_update"
EXPERIENCE = "experience"
XRPO = "xrpo"
STEP_TIMES = "step_time_s"
SAMPLE_TIMER = "sample"
LEARNER_SCORING_TIMER = "learner_scoring"
ADVANTAGE_TIMER = "advantages"
HELDOUT_TIMER = "heldout_eval"
STATE_KEY = "exgrpo"
#: The stages each step times (``timers/<stage>`` and ``step_time_s/<stage>``, :meth:`ExGRPO._stage`).
STAGES = (
    PLAN_TIMER,
    REPLAY_CHOICE_TIMER,
    SAMPLE_TIMER,
    LEARNER_SCORING_TIMER,
    ADVANTAGE_TIMER,
    LEARNER_UPDATE_TIMER,
    BUFFER_TIMER,
    SYNCH_WORKER_WEIGHTS_TIMER,
    HELDOUT_TIMER,
)
#: What the algorithm itself logs at the top level of a result.
TOP_LEVEL_METRICS = (
    "reward_mean",
    "solve_rate",
    "zero_variance_group_fraction",
    "all_correct_group_fraction",  # _log_group_metrics
    "num_completions",
    "unscored_completions",
    "optimizer_steps",
    "minibatch_rows_min",
    "minibatch_rows_max",
    "async_batch_staleness",
    "learner_scored_completions",
) + ROLLOUT_METRICS
#: What it logs under ``weight_sync/`` (``weight_sync: collective``, :meth:`ExGRPO._sync_runner_weights`).
WEIGHT_SYNC_METRICS = ("seconds", "bytes_per_runner", "group_generation")


def logged_metric_names() -> Tuple[str, ...]:
    """Every result key this project's code logs, by group, from the declarations beside the
    code that logs them (the keys with a variable part, ``experience/bucket_<k>`` and
    ``env_runners/reward_<name>_mean``, are patterns: ``cli/preflight.py``). What RLlib and
    Tune add is not here."""
    groups = {
        "": TOP_LEVEL_METRICS,
        ENV_RUNNER_RESULTS: ENV_RUNNER_METRICS + COLOCATION_METRICS,
        f"{LEARNER_RESULTS}/{DEFAULT_MODULE_ID}": LEARNER_METRICS,
        EXPERIENCE: POOL_METRICS
        + OBSERVE_METRICS
        + REPLAY_CHOICE_METRICS
        + ("replayed_questions", "replayed_fraction", SCORING_RUNNERS_KEY[1]),
        XRPO: PLANNER_METRICS + SEEDING_METRICS + SHARPENING_METRICS,
        HELDOUT: HELDOUT_METRICS,
        "weight_sync": WEIGHT_SYNC_METRICS,
        TIMERS: STAGES,
        STEP_TIMES: STAGES,
    }
    return tuple(f"{group}/{name}" if group else name for group, names in groups.items() for name in names)


class ExGRPOConfig(AlgorithmConfig, ExGRPOConfigFields):
    """Configuration of :class:`ExGRPO`: RLlib's fields plus those of ``config_fields.FIELDS``.

    Defaults follow ``docs/ALGORITHMS.md``: where the official ExGRPO code and the paper
    differ, the official code's choice is the default and the other is an option. RLlib's
    own fields keep their meaning: ``lr``, ``grad_clip``, ``num_epochs`` and
    ``minibatch_size`` (completions, i.e. learner rows, per learner and optimiser step: an
    iteration of N rows makes ``num_epochs x round(N / (minibatch_size x max(1,
    num_learners)))`` optimiser steps, every row once per epoch; ``core/minibatches.py``).
    Every field with its default and rule: ``docs/config.md``; their types come from
    :class:`~rllib_exgrpo.rllib.config_attributes.ExGRPOConfigFields` (generated).

    Example::

        config = (
            ExGRPOConfig()
            .environment(env=ReasoningEnv, env_config={"dataset": "arithmetic"})
            .training(model_name_or_path="tiny", questions_per_step=32, group_size=8, lr=1e-4)
        )
        algo = config.build_algo()
    """

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or ExGRPO)
        for name, value in RLLIB_FIELD_DEFAULTS.items():
            setattr(self, name, value)
        self.env = ReasoningEnv
        self.env_config = {"dataset": "arithmetic"}
        self.env_runner_cls = LLMEnvRunner
        self.__dict__.update(field_defaults())

    @override(AlgorithmConfig)
    def training(self, **kwargs) -> "ExGRPOConfig":
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in FIELDS_BY_NAME}
        super().training(**kwargs)
        for key, value in own.items():
            if value is not NotProvided:
                setattr(self, key, value)
        return self

    training.__signature__ = training_signature(AlgorithmConfig.training)
    training.__doc__ = training_doc()

    @override(AlgorithmConfig)
    def get_default_rl_module_spec(self) -> RLModuleSpec:
        return RLModuleSpec(module_class=LLMTorchRLModule, model_config=self.llm_model_config)

    @property
    def llm_model_config(self) -> Dict[str, Any]:
        """What the RLModule needs to build the policy network. The DDP learner keeps fp32
        master weights of a bf16 model and computes under autocast (``master_dtype``);
        DeepSpeed keeps its own fp32 master copy in the optimiser, so its module is bf16."""
        mixed = self.model_dtype != "float32" and self.learner_backend == "ddp"
        lora = {}
        if self.lora_rank:  # models/lora.py; absent for full fine-tuning
            lora = {
                "lora": {
                    "rank": self.lora_rank,
                    "alpha": self.lora_alpha,
                    "dropout": self.lora_dropout,
                    "target_modules": self.lora_target_modules,
                }
            }
        return {
            "model": self.model_name_or_path,
            "dtype": self.model_dtype,
            "master_dtype": "float32" if mixed else None,
            "gradient_checkpointing": self.gradient_checkpointing,
            "attn_implementation": self.attn_implementation,
            "logit_chunk_tokens": self.logit_chunk_tokens,
            "temperature": self.temperature,
            **lora,
        }

    @override(AlgorithmConfig)
    def get_default_learner_class(self):
        """``ExGRPOTorchLearner`` (RLlib's DDP with ``num_learners >= 2``), or with
        ``learner_backend="deepspeed"`` the same learner on DeepSpeed ZeRO engines
        (``rllib/deepspeed_learner.py``; its config is checked here, in the driver,
        before RLlib starts a learner)."""
        if self.learner_backend == "deepspeed":
            check_deepspeed_config(self)
            return DeepSpeedExGRPOLearner
        return ExGRPOTorchLearner

    @property
    def completions_per_step(self) -> int:
        return self.questions_per_step * self.group_size

    @override(AlgorithmConfig)
    def validate(self) -> None:
        super().validate()
        errors = list(field_errors(self))
        if errors:
            rc.config_value_error(self, "Invalid ExGRPOConfig:\n  - " + "\n  - ".join(errors))


class GRPOConfig(ExGRPOConfig):
    """On-policy GRPO: ExGRPO with experience replay switched off."""

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or GRPO)
        self.experience_replay = False

    def validate(self) -> None:
        # A copied ExGRPO recipe with its run line changed to GRPO keeps experience_replay: true,
        # which would train ExGRPO under GRPO's name.
        if self.experience_replay:
            rc.config_value_error(self, "experience_replay: true is ExGRPO: use run: ExGRPO, or drop experience_replay for on-policy GRPO")
        super().validate()


class ExGRPO(Algorithm):
    """Experience-driven GRPO on RLlib's env-runner / learner stack."""

    @classmethod
    @override(Algorithm)
    def get_default_config(cls) -> ExGRPOConfig:
        return ExGRPOConfig()

    @classmethod
    @override(Algorithm)
    def default_resource_request(cls, config):
        """RLlib's placement-group request, after fitting the config to the cluster
        (``resources.fit_resources``: ``"auto"`` main-process CPUs resolved, a CPU
        shortfall shared out instead of a trial that stays PENDING forever)."""
        cfg = cls.get_default_config().update_from_dict(config.to_dict() if hasattr(config, "to_dict") else dict(config))
        for note in fit_resources(cfg):
            logger.warning("%s", note)
        return super().default_resource_request(cfg)

    @override(Algorithm)
    def setup(self, config) -> None:
        # Fit CPUs / GPUs to the cluster before RLlib builds any actor (a no-op when the
        # CLI or default_resource_request already did), then size torch's threads to the
        # CPUs this main process holds: it runs the local env runner and local learner.
        with rc.unfrozen(self.config) as cfg:
            for note in fit_resources(cfg):
                logger.warning("%s", note)
        apply_threads_for(self.config, "main")
        super().setup(config)

        cfg = self.config
        train_env = ReasoningEnv({k: v for k, v in cfg.env_config.items() if k != "tokenizer"})
        self.sampler = QuestionSampler([p.id for p in train_env.problems], seed=cfg.seed or 0)
        self._questions = {p.id: p.question for p in train_env.problems}
        self.rollouts = AdaptiveRollouts(cfg) if cfg.xrpo_planner else None
        self.seeder = InContextSeeder(cfg, seed=cfg.seed or 0) if cfg.icl_seeding else None
        self.experience = ExperienceManager(cfg, seed=cfg.seed or 0)
        self._sync_learner_mode()
        # async_rollouts: the batch collected during the last iteration, trained on next.
        self._next_step: Optional[_CollectedStep] = None
        if cfg.async_rollouts:
            # The learner update runs in a thread next to the collection: RLlib's logger
            # takes a real lock then (as APPO / IMPALA do).
            rc.make_metrics_thread_safe(self.metrics)
        self.coordinator = RolloutCoordinator(self.env_runner_group, self.metrics, self._restart_failed_runners)
        self.heldout = HeldoutEvaluator(cfg, self._sample)
        self._pad_id = self._tokenizer_pad_id()
        # The local runner keeps no copy of synced weights while it has no module: it
        # fetches them from the learners if it ever needs one (LLMEnvRunner.weights_source).
        local = self.env_runner_group.local_env_runner
        if isinstance(local, LLMEnvRunner):
            local.weights_source = self._learner_module_state
            if cfg.colocate:  # the learners sample: the main process keeps no copy of the weights
                local.mark_weights_stale()
        # weight_sync: a collective broadcast to the remote runners, or RLlib's object store.
        path, line = chosen_path(cfg)
        self._weight_broadcaster = WeightBroadcaster(cfg.weight_sync_bucket_mb) if path == "collective" else None
        print(line, flush=True)
        # Remote runners build their module lazily; give them the learner's weights now.
        self._sync_runner_weights()

    def _learner_module_state(self) -> dict:
        """The learner's weights as a weight sync ships them (inference-only)."""
        from ray.rllib.core import COMPONENT_LEARNER, COMPONENT_RL_MODULE

        state = self.learner_group.get_state(components=f"{COMPONENT_LEARNER}/{COMPONENT_RL_MODULE}", inference_only=True)
        return state[COMPONENT_LEARNER]

    def _tokenizer_pad_id(self) -> int:

        return load_tokenizer(self.config.model_name_or_path).pad_token_id

    # ---- the training step ---------------------------------------------------------
    @override(Algorithm)
    def training_step(self) -> None:
        """One iteration: collect a step's batch on the runners, train the learners on it,
        update the experience pool, sync the weights (and evaluate held-out questions).

        With ``async_rollouts`` the runners collect step t+1 with the weights of step t
        while the learners train on step t (:meth:`_overlapped_step`)."""
        cfg = self.config
        if self.iteration == 0 and self.heldout.due(0):
            self._evaluate_heldout(after_iteration=0)  # the starting point

        if cfg.async_rollouts:
            self._overlapped_step()
        else:
            step = self._collect_step()
            with self._stage(LEARNER_UPDATE_TIMER):
                self._update_learners(step.batch, step.groups.group_index)
            self._observe_step(step, switch_learner_mode=True)

        with self._stage(SYNCH_WORKER_WEIGHTS_TIMER):
            self._sync_runner_weights()

        done = self.iteration + 1
        if self.heldout.due(done):
            self._evaluate_heldout(after_iteration=done)

    def _overlapped_step(self) -> None:
        """``async_rollouts``: train on the batch collected during the previous iteration
        (with the weights before that iteration's update: one step stale) while the runners
        collect the next one with the current weights, which are synced only afterwards.

        The behaviour log-probs recorded at sampling keep the importance ratio exact (the
        clipped ratio for fresh rows, policy shaping for replayed ones), so staleness is
        bounded by one step; ``async_batch_staleness`` logs it (0 on the first iteration,
        whose batch is collected before training, and after a restore, as the collected
        batch is not part of a checkpoint). The pool sees a step's groups before its
        update, so the next step's plan has them, as in the synchronous order; a delayed
        start that fires switches the learners' mode after the update, as there.
        Sampling metrics (``env_runners/``, rewards) of an iteration are of the batch
        collected during it."""
        from concurrent.futures import ThreadPoolExecutor

        step, stale = self._next_step, 1
        if step is None:
            step, stale = self._collect_step(), 0
        self._next_step = None
        self.metrics.log_value("async_batch_staleness", stale, window=1)
        switched = self._observe_step(step, switch_learner_mode=False)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner-update") as pool:
            update = pool.submit(self._timed_update, step)
            try:
                self._next_step = self._collect_step()
            finally:
                update.result()  # the update's error, if any, is raised here
        if switched:
            self._sync_learner_mode()

    def _timed_update(self, step: "_CollectedStep") -> None:
        with self._stage(LEARNER_UPDATE_TIMER):
            self._update_learners(step.batch, step.groups.group_index)

    def _collect_step(self) -> "_CollectedStep":
        """Plan a step, choose the replayed trajectories, sample on the runners, score the
        groups and build the learner batch (everything before the update)."""
        cfg = self.config
        with self._stage(PLAN_TIMER):
            fresh_ids, replay_ids = self.experience.plan(
                cfg.questions_per_step, self.sampler, len(self.sampler.question_ids), iteration=self.iteration
            )
        with self._stage(REPLAY_CHOICE_TIMER):
            replayed, replay_metrics = self.experience.replayed_trajectories(replay_ids, self._score_trajectories)
            # questions drawn from the pool (with or without a stored trajectory)
            replay_metrics["replayed_questions"] = float(len(replay_ids))

        with self._stage(SAMPLE_TIMER):
            sampled, xrpo_metrics = self._sample_step(fresh_ids, replay_ids)
        if cfg.scoring_on == "learners":
            self._fill_behaviour_logprobs(sampled)

        with self._stage(ADVANTAGE_TIMER):
            groups = score_groups(
                self._drop_unscored(sampled) + replayed,
                estimator=cfg.advantage_estimator,
                eps=cfg.advantage_eps,
            )
            if cfg.novelty_sharpening:
                xrpo_metrics.update(sharpen_advantages(groups, lambda_nov=cfg.novelty_lambda, kappa=cfg.novelty_kappa))
            batch = learner_batch(groups.trajectories, groups.advantages, self._pad_id)
            self._log_group_metrics(groups)
        for key, value in xrpo_metrics.items():
            self.metrics.log_value((XRPO, key), value, window=1)
        return _CollectedStep(groups, batch, replay_metrics)

    def _observe_step(self, step: "_CollectedStep", *, switch_learner_mode: bool) -> bool:
        """The pool update from a step's groups; True when the delayed start fired."""
        with self._stage(BUFFER_TIMER):
            update_metrics = self.experience.observe(step.groups, iteration=self.iteration)
            if update_metrics["switched"]:
                logger.info("ExGRPO delayed start: mixed mode on from iteration %d", self.iteration)
                if switch_learner_mode:
                    self._sync_learner_mode()
        self._log_experience_metrics({**step.replay_metrics, **update_metrics}, step.groups)
        return bool(update_metrics["switched"])

    def _update_learners(self, batch: Dict[str, np.ndarray], group_index: np.ndarray) -> None:
        """Exact minibatching (``minibatches.plan_minibatches``): one ``LearnerGroup.update``
        per optimiser step, one shard per learner, every row once per epoch."""
        cfg = self.config
        num_learners = max(1, cfg.num_learners)
        plan = plan_minibatches(
            group_index,
            minibatch_size=cfg.minibatch_size or len(group_index),
            num_learners=num_learners,
            num_epochs=cfg.num_epochs,
            shuffle=cfg.minibatch_shuffle,
            # Seeded by (seed, iteration): the same order again after a restore.
            rng=np.random.default_rng([(cfg.seed or 0) % 2**32, self.iteration, 11]),
        )
        timesteps = {NUM_ENV_STEPS_SAMPLED_LIFETIME: self.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0)}
        sizes = []
        for epoch in plan:
            for shards in epoch:
                parts = [to_multi_agent_batch(take_rows(batch, rows)) for rows in shards]
                sizes.append(sum(len(rows) for rows in shards))
                if self.learner_group.is_local:
                    results = self.learner_group.update(batch=parts[0], timesteps=timesteps)
                else:
                    results = self._remote_update(parts, timesteps)
                self.metrics.aggregate(results, key=LEARNER_RESULTS)
        self.metrics.log_value("optimizer_steps", len(sizes), window=1)
        self.metrics.log_value("minibatch_rows_min", min(sizes) if sizes else 0, window=1)
        self.metrics.log_value("minibatch_rows_max", max(sizes) if sizes else 0, window=1)

    def _remote_update(self, parts, timesteps):
        """One update on the remote learners; a dead learner ends the run with what to do.

        A learner holds model and optimiser state that the others cannot rebuild in the
        middle of a step (and DDP cannot shrink), so the step is not redone: the run stops
        and resumes from its latest checkpoint (``rllib train file X.yaml --resume``).
        """
        from ray.exceptions import RayActorError

        try:
            return self.learner_group.update(batches=parts, timesteps=timesteps)
        except RayActorError as e:
            raise LearnerDiedError(
                f"a learner actor died during iteration {self.iteration + 1} ({type(e).__name__}); the run "
                "stops here. Continue from the latest checkpoint: `rllib train file <your file> --resume`"
            ) from e

    def _sample_step(self, fresh_ids, replay_ids) -> Tuple[List[Trajectory], Dict[str, float]]:
        """All of a step's generation: fresh groups (G each, or planner rounds), G - 1
        fresh completions next to each replayed trajectory (G for a replayed question that
        comes back alone, ``replay_content: prompt``), then in-context seeding."""
        cfg = self.config
        metrics: Dict[str, float] = {}
        sampled: List[Trajectory] = []
        per_replayed = self.experience.fresh_samples_of_replayed(cfg.group_size)
        if self.rollouts is not None:
            fresh, metrics = self.rollouts.run(fresh_ids, self._sample_trajectories)
            sampled += fresh
            if replay_ids:
                sampled += self._sample_trajectories(replay_ids, [per_replayed] * len(replay_ids))
        else:
            sampled += self._sample_trajectories(
                list(fresh_ids) + list(replay_ids),
                [cfg.group_size] * len(fresh_ids) + [per_replayed] * len(replay_ids),
            )
        if self.seeder is not None:
            seeded, seed_metrics = self.seeder.seed(sampled, self._question_text, self._sample_trajectories)
            self.seeder.remember(sampled, self._question_text)
            sampled += seeded
            metrics.update(seed_metrics)
        return sampled, metrics

    def _question_text(self, question_id: str) -> str:
        return self._questions[question_id]

    def _drop_unscored(self, trajectories):
        """A verifier error means "unscored", not "wrong": keep such completions out."""
        kept = [t for t in trajectories if not t.info.get("reward_error")]
        self.metrics.log_value("unscored_completions", len(trajectories) - len(kept), reduce="sum")
        return kept

    @contextlib.contextmanager
    def _stage(self, name: str):
        """Time one stage of the step: RLlib's smoothed ``timers/<name>`` and the exact
        last value in ``step_time_s/<name>`` (what benchmarks/step_profile.py reads)."""
        start = time.perf_counter()
        with self.metrics.log_time((TIMERS, name)):
            yield
        self.metrics.log_value((STEP_TIMES, name), time.perf_counter() - start, window=1)

    def _sync_learner_mode(self) -> None:
        mixed = self.experience.learner_mixed_mode
        self.learner_group.foreach_learner(lambda learner: learner.set_mixed_mode(mixed))

    def _score_trajectories(self, prompts, completions):
        """Re-score stored trajectories where the current weights live: on the runners
        (``RolloutCoordinator.score_on_runners``) or, with ``scoring_on: learners``, on the
        learners (``rollouts.score_on_learners``)."""
        if self.config.scoring_on == "learners" or self.config.colocate:
            return self._score_on_learners(prompts, completions)
        return self.coordinator.score_on_runners(prompts, completions)

    def _score_on_learners(self, prompts, completions):
        return score_on_learners(self.learner_group, prompts, completions, self._pad_id)

    def _fill_behaviour_logprobs(self, trajectories: List[Trajectory]) -> None:
        """``scoring_on: learners``: the behaviour log-probs the runners did not record
        (``behaviour_logprobs: recompute``), computed by the learners before they train:
        the weights are the ones the runners sampled with (the last sync), so the
        first-step ratio is 1, as with runner scoring. A completion sampled under another
        prompt (XRPO seeding) is scored under that prompt (``score_prompt_ids``)."""
        todo = [t for t in trajectories if t.logp is None or (len(t.logp) != len(t.completion_ids))]
        if not todo:
            return
        with self._stage(LEARNER_SCORING_TIMER):
            logps, _ = self._score_on_learners(
                [t.info.get("score_prompt_ids", t.prompt_ids) for t in todo], [t.completion_ids for t in todo]
            )
        for t, lp in zip(todo, logps):
            t.logp = np.asarray(lp, dtype=np.float32)
        self.metrics.log_value("learner_scored_completions", len(todo), window=1)

    # ---- sampling across runners -----------------------------------------------------
    def _sample(
        self,
        question_ids: Sequence[str],
        num_samples: Sequence[int],
        prompt_prefixes: Optional[Sequence[Optional[str]]] = None,
        **sample_kwargs,
    ):
        """``RolloutCoordinator.sample``: a question's group stays on one runner; dead
        runners are restored and their questions sampled again. With ``colocate`` the
        learners sample (``colocation.sample_on_learners``)."""
        if self.config.colocate:
            return sample_on_learners(self.learner_group, question_ids, num_samples, prompt_prefixes, **sample_kwargs)
        return self.coordinator.sample(question_ids, num_samples, prompt_prefixes, **sample_kwargs)

    def _restart_failed_runners(self) -> None:
        """Bring dead runners back (RLlib restarts the actors) and give them the current
        weights before they sample again (:meth:`restore_env_runners`)."""
        self.restore_env_runners(self.env_runner_group)

    @override(Algorithm)
    def restore_env_runners(self, env_runner_group) -> List[int]:
        """RLlib's restore (called by its training loop and by the rollout coordinator), then the
        current weights to the restored runners before they sample: over the object store to
        those alone, or, with ``weight_sync: collective``, a new weight group with every
        healthy runner (a restarted runner and the others rejoin together) and a broadcast."""
        restored = super().restore_env_runners(env_runner_group)
        if restored and env_runner_group is self.env_runner_group and hasattr(self, "_weight_broadcaster"):
            if self._weight_broadcaster is not None:
                self._weight_broadcaster.invalidate()
            self._sync_runner_weights(to_worker_indices=restored, timeout_seconds=None)
        return restored

    def _sync_runner_weights(self, to_worker_indices=None, timeout_seconds: Optional[float] = 0.0) -> None:
        """The learners' weights to the env runners (``weight_sync``). ``object_store``:
        RLlib's ``sync_weights`` (to ``to_worker_indices``, waiting ``timeout_seconds``; 0 is
        RLlib's fire-and-forget). ``collective``: a broadcast to every healthy remote runner
        (``rllib/weight_broadcast.py``), which returns once every runner holds the weights;
        when a runner fails in it, the failed runners are restored and the group rebuilt, once."""
        if self.config.colocate:
            # The learners sample from their own weights (rllib/colocation.py). A copy the main
            # process's runner fetched for local use (``algo.env_runner``) is now old: it
            # fetches the current weights again when next used.
            local = self.env_runner_group.local_env_runner
            if isinstance(local, LLMEnvRunner):
                local.mark_weights_stale()
            return
        broadcaster = self._weight_broadcaster
        if broadcaster is None:
            self.env_runner_group.sync_weights(
                from_worker_or_learner_group=self.learner_group,
                inference_only=True,
                to_worker_indices=to_worker_indices,
                timeout_seconds=timeout_seconds,
            )
            return
        try:
            sent = broadcaster.sync(self.learner_group, self.env_runner_group)
        except WeightSyncFailed as e:
            logger.warning("%s; restoring the failed env runner(s) and building the weight group again", e)
            super().restore_env_runners(self.env_runner_group)  # RLlib's alone: the sync below follows
            broadcaster.invalidate()
            sent = broadcaster.sync(self.learner_group, self.env_runner_group)
        # The local runner (no module while remote runners sample) keeps no copy; it
        # fetches the current weights if it is ever asked to sample or score.
        local = self.env_runner_group.local_env_runner
        if isinstance(local, LLMEnvRunner):
            local.mark_weights_stale()
        if sent.get("runners"):
            self.metrics.log_value(("weight_sync", "seconds"), sent.get("seconds", 0.0), window=1)
            self.metrics.log_value(("weight_sync", "bytes_per_runner"), sent.get("bytes", 0), window=1)
            self.metrics.log_value(("weight_sync", "group_generation"), sent["generation"], window=1)

    @override(Algorithm)
    def cleanup(self) -> None:
        """Drop the weight group (the root's store lives in the first learner, which may be
        this process) before RLlib stops the actors."""
        broadcaster = getattr(self, "_weight_broadcaster", None)
        if broadcaster is not None and getattr(self, "learner_group", None) is not None:
            try:
                broadcaster.close(self.learner_group)
            except Exception as e:  # best effort: the learners may be gone already
                logger.debug("closing the weight group: %r", e)
        super().cleanup()

    def _sample_trajectories(self, question_ids, num_samples, prefixes=None) -> List[Trajectory]:
        """Generate + score on the runners; runner metrics go into ``env_runners/``."""
        episodes, runner_metrics = self._sample(question_ids, num_samples, prefixes)
        self.metrics.aggregate(runner_metrics, key=ENV_RUNNER_RESULTS)
        return trajectories_from_episodes(episodes)

    # ---- metrics -----------------------------------------------------------------------
    def _log_group_metrics(self, groups) -> None:
        rewards = np.asarray([t.reward for t in groups.trajectories], dtype=np.float64)
        n = max(len(rewards), 1)
        self.metrics.log_value("reward_mean", float(rewards.mean()) if len(rewards) else 0.0, window=1)
        self.metrics.log_value("solve_rate", float((rewards >= 1.0).sum() / n), window=1)
        self.metrics.log_value(
            "zero_variance_group_fraction",
            float(groups.zero_variance.mean()) if len(groups.zero_variance) else 0.0,
            window=1,
        )
        self.metrics.log_value(
            "all_correct_group_fraction",
            float(np.mean(groups.group_correct == groups.group_size)) if len(groups.group_size) else 0.0,
            window=1,
        )
        self.metrics.log_value("num_completions", len(rewards), reduce="sum")

    def _log_experience_metrics(self, step_metrics: Dict[str, float], groups) -> None:
        replayed = sum(t.replayed for t in groups.trajectories)
        values = {
            **self.experience.metrics(),
            "replayed_questions": replayed,
            **step_metrics,
            "replayed_fraction": replayed / max(len(groups.trajectories), 1),
        }
        for key, value in values.items():
            if isinstance(value, float) and np.isnan(value):
                continue
            self.metrics.log_value((EXPERIENCE, key), value, window=1)

    # ---- held-out evaluation ---------------------------------------------------------
    def evaluate_heldout(self) -> Dict[str, float]:
        """Accuracy on the held-out questions under the current weights (avg@k;
        ``rllib/heldout.py``)."""
        return self.heldout.evaluate()

    def _evaluate_heldout(self, after_iteration: int) -> None:
        """Evaluate, log ``heldout/accuracy`` (and the iteration it belongs to)."""
        with self._stage(HELDOUT_TIMER):
            result = self.heldout.evaluate()
        self.heldout.record(self.metrics, result, after_iteration)

    # ---- checkpoints -----------------------------------------------------------------
    @override(Checkpointable)
    def save_to_path(self, path=None, *, state=None, filesystem=None, use_msgpack: bool = False) -> str:
        """RLlib's checkpoint, written atomically on a local path: everything (learner state
        and optimiser shards, env runner state, this algorithm's sampler, experience pool and
        RNG streams) goes into a temporary folder beside ``path`` that is renamed into place
        when complete, so a run killed mid-save keeps its previous checkpoint intact."""
        local = local_checkpoint_path(path, filesystem)
        if local is None:
            return super().save_to_path(path, state=state, filesystem=filesystem, use_msgpack=use_msgpack)
        self._set_learners_checkpointing(True)
        try:
            with atomic_folder(local) as tmp:
                super().save_to_path(str(tmp), state=state, filesystem=filesystem, use_msgpack=use_msgpack)
        finally:
            self._set_learners_checkpointing(False)
        return local

    def _set_learners_checkpointing(self, on: bool) -> None:
        """Tell learners that shard their weights (DeepSpeed ZeRO-3) that a checkpoint is
        being written: each then writes its own partitions instead of the first learner
        gathering the whole model (``rllib/zero3_weights.py``)."""
        if self.config.learner_backend != "deepspeed" or self.learner_group is None:
            return
        self.learner_group.foreach_learner(lambda learner, _on=on: learner.set_checkpointing(_on))

    @override(Algorithm)
    def get_state(self, components=None, *, not_components=None, **kwargs):
        state = super().get_state(components, not_components=not_components, **kwargs)
        state[STATE_KEY] = {
            "sampler": self.sampler.get_state(),
            "experience": self.experience.get_state(),
            "icl_corpus": self.seeder.get_state() if self.seeder is not None else None,
            "initial_heldout": self.heldout.initial_accuracy,
            "rng": self._rng_states(),
        }
        return state

    @override(Algorithm)
    def set_state(self, state) -> None:
        super().set_state(state)
        if STATE_KEY in state:
            self.sampler.set_state(state[STATE_KEY]["sampler"])
            self.experience.set_state(state[STATE_KEY]["experience"])
            self.heldout.initial_accuracy = state[STATE_KEY].get("initial_heldout")
            if self.seeder is not None and state[STATE_KEY].get("icl_corpus") is not None:
                self.seeder.set_state(state[STATE_KEY]["icl_corpus"])
            if state[STATE_KEY].get("rng") is not None:
                self._set_rng_states(state[STATE_KEY]["rng"])
            self._sync_learner_mode()

    def _rng_states(self) -> dict:
        """The sampling RNG streams: torch's in this process (the local env runner and
        learner) and in each remote env runner, so that a resumed run samples what the
        uninterrupted one would have (every other stream is seeded per step or is part of
        the sampler / pool / corpus state)."""
        import torch

        group = self.env_runner_group
        remote = {}
        if group is not None and group.num_remote_workers() > 0:
            ids = group.healthy_worker_ids()
            states = group.foreach_env_runner(lambda r: _torch_rng_state(), local_env_runner=False, remote_worker_ids=ids)
            remote = dict(zip(ids, states))
        return {"torch": torch.get_rng_state(), "remote_env_runners": remote, "learners": self._learner_rng_states()}

    def _learner_rng_states(self) -> Optional[dict]:
        """``colocate`` with remote learners: each learner's torch RNG by rank (they sample)."""
        if not self.config.colocate or self.learner_group is None or self.learner_group.is_local:
            return None
        results = self.learner_group.foreach_learner(lambda learner: (learner_rank(), _torch_rng_state()))
        return dict(r.get() for r in results)

    def _set_rng_states(self, rng: dict) -> None:
        import torch

        torch.set_rng_state(rng["torch"])
        learners = rng.get("learners")
        if learners and self.config.colocate and not self.learner_group.is_local:
            self.learner_group.foreach_learner(
                lambda learner, _st=learners: _set_torch_rng_state(_st[learner_rank()]) if learner_rank() in _st else None
            )
        group = self.env_runner_group
        if group is None or group.num_remote_workers() == 0:
            return
        healthy = set(group.healthy_worker_ids())
        for wid, runner_state in rng.get("remote_env_runners", {}).items():
            if wid in healthy:
                group.foreach_env_runner(
                    lambda r, st=runner_state: _set_torch_rng_state(st), local_env_runner=False, remote_worker_ids=[wid]
                )


class GRPO(ExGRPO):
    """On-policy GRPO: the same stack with experience replay off."""

    @classmethod
    def get_default_config(cls) -> GRPOConfig:
        return GRPOConfig()


class LearnerDiedError(RuntimeError):
    """A learner actor died during an update (see ``ExGRPO._remote_update``)."""


def _torch_rng_state():
    import torch

    return torch.get_rng_state()


def _set_torch_rng_state(state) -> None:
    import torch

    torch.set_rng_state(state)


@dataclasses.dataclass
class _CollectedStep:
    """What a step's collection hands to its update: scored groups, the learner batch, and
    the replay choice's metrics."""

    groups: Any
    batch: Dict[str, np.ndarray]
    replay_metrics: Dict[str, float]
