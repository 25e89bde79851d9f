"""``LLMEnvRunner``: an RLlib EnvRunner that samples groups of LLM completions.

RLlib's ``SingleAgentEnvRunner`` steps one action per env per forward pass and corrupts
text observations (see docs/training_step.md). An LLM wants the opposite: many prompts batched
into one ``generate`` call, G completions each. This runner

1. takes question ids (or draws them from its env's own sampler),
2. renders each prompt through ``ReasoningEnv`` and tokenises it,
3. generates ``num_samples[i]`` completions per prompt with its generation backend,
4. scores every completion through the env's verifier,
5. returns RLlib ``SingleAgentEpisode``s: obs = prompt token ids, action = completion
   token ids, reward = verifier score, per-token behaviour log-probs in the extra model
   outputs (``action_logp``), question id in the infos.

The module (hence the model) is built lazily, at the first sample or weight sync, so a
runner that only answers ``get_spaces`` costs no model memory. With
``generation_backend: vllm`` and ``scoring_on: learners`` a runner builds no torch module
at all (:attr:`LLMEnvRunner.engine_only`): vLLM's engine holds the only copy of the weights
on its GPU, synced weights go straight into it, and the learners score the completions.

Weight syncs keep no copy of the weights: a runner with a module (every remote runner, or
the local one when there are no remote runners) loads them into its module, and its
generation backend takes them from the module's own tensors; the local runner of an
algorithm with remote runners, which has no module, keeps nothing: if it is ever asked to
sample, it builds its module then and fetches the current weights from its
``weights_source`` (set by ``ExGRPO``; without one it keeps the last synced state, as
RLlib's runners do). With ``weight_sync: collective`` (the default) the remote runners
receive the weights over a broadcast instead (:meth:`LLMEnvRunner.receive_weights`,
``rllib/weight_broadcast.py``), straight into the module's parameters; the local runner is
then only marked stale and fetches them from ``weights_source`` if it is ever used.

Settings: the runner reads its LLM settings (model, G, token limits, sampling) through
:class:`RunnerSettings`, so that it serves ``ExGRPOConfig`` (whose fields they are) and any
other ``AlgorithmConfig``, e.g. RLlib's own ``PPOConfig``, which takes them from the RL
module's ``model_config`` dict (see :class:`RunnerSettings`).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import gymnasium as gym
import numpy as np

from ray.rllib.utils.annotations import override
from ray.rllib.core import COMPONENT_RL_MODULE, DEFAULT_MODULE_ID
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.env import INPUT_ENV_SINGLE_SPACES, INPUT_ENV_SPACES
from ray.rllib.env.env_runner import EnvRunner
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.checkpoints import Checkpointable
from ray.rllib.utils.metrics import (
    EPISODE_RETURN_MEAN,
    NUM_ENV_STEPS_SAMPLED,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    NUM_EPISODES,
    WEIGHTS_SEQ_NO,
)

from rllib_exgrpo.rllib import rllib_contract as rc
from rllib_exgrpo.core import columns as C
from rllib_exgrpo.generation.base import SamplingParams
from rllib_exgrpo.generation.sample_and_score import encode_prompt, sample_and_score, stop_token_ids
from rllib_exgrpo.models.loading import load_tokenizer
from rllib_exgrpo.rllib.config_fields import FIELDS, field_defaults
from rllib_exgrpo.rllib.env_creator import env_creator
from rllib_exgrpo.rllib.resources import apply_threads_for, runner_device
from rllib_exgrpo.envs.rewards import warm_up
from rllib_exgrpo.generation.registry import make_backend
from rllib_exgrpo.generation.vllm import VLLMGenerationBackend
from rllib_exgrpo.models.loading import generation_config_holder
from rllib_exgrpo.rllib import weight_broadcast

logger = logging.getLogger(__name__)


def token_spaces(vocab_size: int, max_prompt_tokens: int, max_response_tokens: int):
    """Observation (prompt ids) and action (completion ids) spaces.

    Arrays are variable-length, at most the space's shape; the shape states the bound.
    """
    obs = gym.spaces.Box(0, vocab_size - 1, shape=(max_prompt_tokens,), dtype=np.int64)
    act = gym.spaces.Box(0, vocab_size - 1, shape=(max_response_tokens,), dtype=np.int64)
    return obs, act


#: LLM settings the runner reads besides RLlib's own (``env``, ``env_config``, ``seed``):
#: the config fields marked ``runner=True`` in ``config_fields.FIELDS``, in table order.
RUNNER_SETTINGS = tuple(f.name for f in FIELDS if f.runner)
#: What a training sample logs (``env_runners/``): :meth:`LLMEnvRunner._log_sample_metrics`
#: and ``_log_logprob_mismatch`` (plus ``reward_<name>_mean`` per custom reward function).
ENV_RUNNER_METRICS = (
    EPISODE_RETURN_MEAN,
    NUM_EPISODES,
    NUM_ENV_STEPS_SAMPLED,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    "generation_time_s",
    "scoring_time_s",
    "response_length_mean",
    "num_response_tokens",
    "num_response_tokens_lifetime",
    "truncated_fraction",
    "reward_timeouts",
    "reward_errors",
    "behaviour_logprob_mismatch_mean",
    "behaviour_logprob_mismatch_max",
)

#: Where a setting lives in a module ``model_config`` when its name differs there: the
#: module's own keys (``LLMTorchRLModule`` loads ``model`` in ``dtype``).
MODEL_CONFIG_KEYS = {"model_name_or_path": "model", "model_dtype": "dtype"}


def runner_setting_defaults() -> Dict[str, Any]:
    """The config fields' defaults of :data:`RUNNER_SETTINGS` (one source of defaults)."""
    defaults = field_defaults()
    return {name: defaults[name] for name in RUNNER_SETTINGS}


def module_model_config(config) -> Dict[str, Any]:
    """The ``model_config`` dict the config's RL module will get (config-level
    ``model_config`` overlaid with a user ``RLModuleSpec``'s own ``model_config``, as
    ``AlgorithmConfig.get_rl_module_spec`` merges them)."""
    merged = dict(config.model_config or {})
    spec = rc.rl_module_spec(config)
    if isinstance(spec, RLModuleSpec) and spec.model_config:
        merged.update(rc.spec_model_config(spec))
    return merged


class RunnerSettings:
    """The LLM settings of an :class:`LLMEnvRunner`, read from any ``AlgorithmConfig``.

    * A config that has the fields (``ExGRPOConfig`` / ``GRPOConfig``; recognised by its
      ``model_name_or_path`` attribute) is read as is, ``completions_per_step`` included.
    * Any other config (RLlib's ``PPOConfig``, ...) is read from the RL module's
      ``model_config`` dict (:func:`module_model_config`) under the same names, except
      the model and its dtype, which are the module's own keys ``model`` and ``dtype``
      (:data:`MODEL_CONFIG_KEYS`; so module and runner cannot disagree, and
      ``temperature`` is shared the same way). A missing key
      takes ``ExGRPOConfig``'s default. ``completions_per_step`` -- what one ``sample()``
      call without arguments returns -- follows RLlib's sampling contract there: the
      runner's rollout fragment (``train_batch_size_per_learner`` split over the env
      runners, ``config.get_rollout_fragment_length``) rounded up to whole groups of
      ``group_size``.

    Any other attribute is looked up on the config itself, so this object can stand in
    for the config wherever LLM settings are read (e.g. by a generation backend).
    """

    def __init__(self, config, worker_index: int = 0):
        self._config = config
        self._worker_index = worker_index or 0
        self.from_config_fields = hasattr(config, "model_name_or_path")
        if self.from_config_fields:
            values = {name: getattr(config, name) for name in RUNNER_SETTINGS}
        else:
            mc = module_model_config(config)
            values = runner_setting_defaults()
            for name in RUNNER_SETTINGS:
                key = MODEL_CONFIG_KEYS.get(name, name)
                if key in mc and mc[key] is not None:
                    values[name] = mc[key]
        self.__dict__.update(values)

    @property
    def completions_per_step(self) -> int:
        if self.from_config_fields:
            return self._config.completions_per_step
        cfg = self._config
        fragment = cfg.get_rollout_fragment_length(self._worker_index) * (cfg.num_envs_per_env_runner or 1)
        questions = max(1, -(-int(fragment) // self.group_size))
        return questions * self.group_size

    def __getattr__(self, name):
        # Only reached for names not set above: fall through to the config.
        if name.startswith("__") or name == "_config":
            raise AttributeError(name)
        return getattr(self._config, name)

    def as_dict(self) -> Dict[str, Any]:
        return {name: getattr(self, name) for name in RUNNER_SETTINGS + ("completions_per_step",)}


class LLMEnvRunner(EnvRunner, Checkpointable):
    """Samples groups of completions for given questions; see the module docstring."""

    def __init__(self, *, config, **kwargs):
        super().__init__(config=config, **kwargs)

        # Ray starts actors with OMP_NUM_THREADS=1: size torch to the CPUs held instead.
        # The local runner (index 0) lives in the main process and shares its CPUs.
        apply_threads_for(self.config, "env_runner", self.worker_index or 0)
        self.settings = RunnerSettings(self.config, worker_index=self.worker_index)
        self._check_learner_pipeline()
        self.tokenizer = load_tokenizer(self.settings.model_name_or_path)
        self.obs_space, self.act_space = token_spaces(
            len(self.tokenizer), self.settings.max_prompt_tokens, self.settings.max_response_tokens
        )
        self.env = self.make_env()
        #: Held-out envs by split of ``heldout_dataset``, each built on first use.
        self._heldout_envs: dict = {}
        # Start the verifier's worker processes now, so their start-up is not charged to
        # the first verification's timeout.

        warm_up()
        self.module = None
        self.backend = None
        self._pending_module_state = None
        #: A callable returning the current module state as a sync brings it
        #: (``{"rl_module": ..., "weights_seq_no": ...}``); lets a runner without a module
        #: keep no copy of synced weights (see the module docstring).
        self.weights_source = None
        self._weights_dropped = False
        self._held_weights_seq_no = 0
        self._stop_token_ids = None

    @property
    def held_weights_seq_no(self) -> int:
        """The sequence number of the weights this runner holds (0: its first ones)."""
        return self._held_weights_seq_no

    # ---- construction -------------------------------------------------------------
    def _check_learner_pipeline(self):
        """Fail early, with the fix, where RLlib's default learner pipeline would later
        fail to stack this runner's ragged token arrays (``np.stack`` shape errors)."""
        cfg = self.config
        if self.settings.from_config_fields:
            return  # ExGRPO / GRPO batch episodes themselves (rllib_exgrpo.core.groups).
        if rc.learner_connector(cfg) is None and getattr(cfg, "add_default_connectors_to_learner_pipeline", True):
            raise ValueError(
                "LLMEnvRunner returns variable-length token arrays (prompt ids as "
                "observations, completion ids as actions), which RLlib's default learner "
                "connector pipeline cannot stack into a batch. With RLlib's PPO, set "
                "config.learners(learner_connector=rllib_exgrpo.rllib.ppo_module.PadLLMEpisodes) "
                "(YAML: `learner_connector: rllib_exgrpo.rllib.ppo_module:PadLLMEpisodes`) and "
                "the module rllib_exgrpo.rllib.ppo_module.LLMPPOTorchRLModule; see "
                "tuned_examples/ppo_tiny.yaml."
            )

    @override(EnvRunner)
    def make_env(self, overrides: Optional[dict] = None):
        env_config = dict(self.config.env_config)
        env_config.update(overrides or {})
        env_config["tokenizer"] = self.tokenizer
        env_config.setdefault("seed", (self.config.seed or 0) + (self.worker_index or 0))
        return env_creator(self.config.env)(env_config)

    @property
    def engine_only(self) -> bool:
        """vLLM with ``scoring_on: learners``: no torch module here, the engine's weights only."""
        return self.settings.generation_backend == "vllm" and self.settings.scoring_on == "learners"

    def _make_engine_only(self):
        """The vLLM backend without a module; the engine is built with the first weights."""
        self.backend = VLLMGenerationBackend(self.settings, None, self.tokenizer)
        state = None
        if self._pending_module_state is not None:
            state, self._pending_module_state = self._pending_module_state, None
        elif self._weights_dropped:
            self._weights_dropped = False
            state = self.weights_source()
        if state is not None:
            self._load_module_state(state)

    @override(EnvRunner)
    def make_module(self):
        if self.engine_only:
            self._make_engine_only()
            return
        spec = self.config.get_rl_module_spec(spaces={DEFAULT_MODULE_ID: (self.obs_space, self.act_space)}, inference_only=True)
        self.module = spec.build()
        self.module.to(runner_device(self.config))
        self.module.eval()
        if self._pending_module_state is not None:
            pending, self._pending_module_state = self._pending_module_state, None
            self.module.set_state(pending)
            del pending
        elif self._weights_dropped:
            # Weights were synced while this runner had no module: fetch them now.
            self._weights_dropped = False
            self._load_module_state(self.weights_source())
        self.backend = self._make_backend()

    def attach_module(self, module) -> None:
        """Sample from ``module`` itself (``colocate``: a learner's own module, in the learner
        process; ``rllib/colocation.py``): no module of its own is built and no weights are
        synced into it; a vLLM backend's engine takes the module's weights when it wakes."""
        self.module = module
        self.weights_source = None
        self._pending_module_state, self._weights_dropped = None, False
        self.backend = self._make_backend()

    def _make_backend(self):

        return make_backend(self.settings.generation_backend, self.settings, self.module, self.tokenizer)

    def _ensure_module(self):
        if self.backend is None:
            self.make_module()
        elif self._weights_dropped and self.weights_source is not None:
            # A collective sync went to the remote runners only (mark_weights_stale): the
            # current weights are fetched now that this runner's module is needed.
            self._weights_dropped = False
            self._load_module_state(self.weights_source())

    @property
    def stop_token_ids(self) -> tuple:
        if self._stop_token_ids is None:
            if self.module is not None:
                self._stop_token_ids = stop_token_ids(self.module.model, self.tokenizer)
            else:  # engine only: the generation config as the model folder has it
                self._stop_token_ids = stop_token_ids(generation_config_holder(self.settings.model_name_or_path), self.tokenizer)
        return self._stop_token_ids

    # ---- EnvRunner API -------------------------------------------------------------
    @override(EnvRunner)
    def assert_healthy(self):
        assert self.env is not None and self.tokenizer is not None, "LLMEnvRunner not set up"

    @override(EnvRunner)
    def get_spaces(self):
        return {
            INPUT_ENV_SPACES: (self.obs_space, self.act_space),
            INPUT_ENV_SINGLE_SPACES: (self.obs_space, self.act_space),
            DEFAULT_MODULE_ID: (self.obs_space, self.act_space),
        }

    @property
    def heldout_env(self):
        """The env over the held-out set (``heldout_dataset``, ``heldout_split``), built on
        first use."""
        return self.heldout_split_env(self.settings.heldout_split)

    def heldout_split_env(self, split: str):
        """The env over one split of ``heldout_dataset`` (e.g. ``"validation"`` beside the
        configured ``"test"``: what a tuning benchmark selects on), built on first use."""
        if split not in self._heldout_envs:
            if not self.settings.heldout_dataset:
                raise ValueError("no held-out set configured (heldout_dataset is None)")
            self._heldout_envs[split] = self.make_env({"dataset": self.settings.heldout_dataset, "split": split})
        return self._heldout_envs[split]

    def encode_prompt(self, question_id: str, prefix: Optional[str] = None, env=None) -> List[int]:
        """Prompt token ids of a question, left-truncated to ``max_prompt_tokens``."""
        text = (env or self.env).prompt_for(question_id)
        return encode_prompt(self.tokenizer, (prefix or "") + text, self.settings.max_prompt_tokens)

    @override(EnvRunner)
    def sample(
        self,
        *,
        question_ids: Optional[Sequence[str]] = None,
        num_samples: Optional[Sequence[int] | int] = None,
        num_episodes: Optional[int] = None,
        explore: bool = True,
        temperature: Optional[float] = None,
        max_new_tokens: Optional[int] = None,
        return_logprobs: bool = True,
        heldout: bool | str = False,
        prompt_prefixes: Optional[Sequence[Optional[str]]] = None,
        **kwargs,
    ) -> List[SingleAgentEpisode]:
        """Sample completions and return them as single-step episodes.

        Args:
            question_ids: Questions to answer; when None, ``num_episodes // group_size``
                questions are drawn from the env's own sampler.
            num_samples: Completions per question (an int for all, or one per question);
                default ``group_size``.
            explore: False samples greedily (temperature 0) unless ``temperature`` is given.
            temperature, max_new_tokens: Override the config for this call (evaluation).
            return_logprobs: Record behaviour log-probs (needed for training).
            heldout: Take the questions from the held-out env instead of the training one;
                a split name takes them from that split of the held-out dataset.
            prompt_prefixes: Optional text per question put before its rendered prompt for
                generation only (XRPO in-context seeding). The episode keeps the original
                prompt as its observation, so the completion trains against it; its
                recorded log-probs are those under the seeded prompt (off-policy), and its
                infos say ``seeded``.
        """
        self._ensure_module()
        question_ids, num_samples = self._questions_to_sample(question_ids, num_samples, num_episodes)
        cfg = self.settings
        if temperature is None:
            temperature = cfg.temperature if explore else 0.0
        # scoring_on: learners: recomputed behaviour log-probs come from the learners.
        learners_score = return_logprobs and cfg.scoring_on == "learners" and cfg.behaviour_logprobs == "recompute"
        params = SamplingParams(
            max_new_tokens=max_new_tokens or cfg.max_response_tokens,
            temperature=temperature,
            top_p=cfg.top_p,
            stop_token_ids=self.stop_token_ids,
            return_logprobs=return_logprobs and not learners_score,
        )
        env = self.heldout_split_env(heldout) if isinstance(heldout, str) else self.heldout_env if heldout else self.env
        prompts = [self.encode_prompt(q, env=env) for q in question_ids]
        prefixes = list(prompt_prefixes) if prompt_prefixes is not None else [None] * len(question_ids)
        gen_prompts = [self.encode_prompt(q, prefix=pre, env=env) if pre else p for q, p, pre in zip(question_ids, prompts, prefixes)]
        batch = sample_and_score(self.backend, self.tokenizer, gen_prompts, num_samples, params, question_ids, env.score)
        # A seeded completion that the learners score is scored under its generation prompt.
        score_prompts = [g if learners_score and pre else None for g, pre in zip(gen_prompts, prefixes)]
        episodes = [
            self._episode(
                question_ids[i.prompt_index],
                prompts[i.prompt_index],
                i.completion,
                i.text,
                i.result,
                seeded=bool(prefixes[i.prompt_index]),
                score_prompt=score_prompts[i.prompt_index],
            )
            for i in batch.items
        ]
        if not heldout:
            self._log_training_sample(episodes, batch, env)
        return episodes

    def _questions_to_sample(self, question_ids, num_samples, num_episodes) -> Tuple[List[str], List[int]]:
        """``sample``'s questions and completions per question: those given, else
        ``num_episodes // group_size`` questions from the env's sampler, ``group_size`` each."""
        cfg = self.settings
        if question_ids is None:
            n_questions = max(1, (num_episodes or cfg.completions_per_step) // cfg.group_size)
            question_ids = [self.env.reset()[1][C.QUESTION_ID] for _ in range(n_questions)]
        question_ids = list(question_ids)
        if num_samples is None:
            num_samples = cfg.group_size
        if isinstance(num_samples, int):
            num_samples = [num_samples] * len(question_ids)
        return question_ids, list(num_samples)

    def _log_training_sample(self, episodes, batch, env) -> None:
        """The metrics of a training sample: counts, rewards, timings, log-prob mismatch and
        (``env_config.reward_fn`` / ``reward_fns``) each custom reward's mean score."""
        self._log_sample_metrics(episodes, [i.result for i in batch.items], generation_s=batch.generation_s, scoring_s=batch.scoring_s)
        self._log_logprob_mismatch([i.completion for i in batch.items])
        for key, value in getattr(env, "reward_metrics", dict)().items():
            self.metrics.log_value(key, value, window=1)

    def _episode(self, question_id, prompt_ids, completion, text, result, seeded=False, score_prompt=None) -> SingleAgentEpisode:
        obs = np.asarray(prompt_ids, dtype=np.int64)
        info = {
            C.QUESTION_ID: question_id,
            "completion_text": text,
            "finish_reason": completion.finish_reason,
            "parsed": result.parsed,
            "timed_out": result.timed_out,
            "format_ok": result.format_ok,
            "reward_error": result.error,
            "seeded": seeded,
        }
        if score_prompt is not None:  # sampled under another prompt, scored later by the learners
            info["score_prompt_ids"] = np.asarray(score_prompt, dtype=np.int64)
        extra = {}
        if completion.logp is not None:
            extra[C.ACTION_LOGP] = [completion.logp.astype(np.float32)]
        return SingleAgentEpisode(
            observations=[obs, obs],
            actions=[completion.token_ids.astype(np.int64)],
            rewards=[float(result.score)],
            infos=[{C.QUESTION_ID: question_id}, info],
            extra_model_outputs=extra,
            terminated=True,
            observation_space=self.obs_space,
            action_space=self.act_space,
            len_lookback_buffer=0,
        )

    def _log_sample_metrics(self, episodes, results, *, generation_s, scoring_s):
        n = len(episodes)
        self.num_env_steps_sampled_lifetime += n
        rewards = [e.get_return() for e in episodes]
        self.metrics.log_value(EPISODE_RETURN_MEAN, float(np.mean(rewards)) if n else 0.0, window=1)
        self.metrics.log_value(NUM_EPISODES, n, reduce="sum")
        self.metrics.log_value(NUM_ENV_STEPS_SAMPLED, n, reduce="sum")
        self.metrics.log_value(NUM_ENV_STEPS_SAMPLED_LIFETIME, n, reduce="lifetime_sum")
        self.metrics.log_value("generation_time_s", generation_s, reduce="sum")
        self.metrics.log_value("scoring_time_s", scoring_s, reduce="sum")
        lengths = [len(e.actions[0]) for e in episodes]
        self.metrics.log_value("response_length_mean", float(np.mean(lengths)) if n else 0.0, window=1)
        # Sampled completion tokens: the budget experiments/compare.py equalises across methods.
        self.metrics.log_value("num_response_tokens", int(sum(lengths)), reduce="sum")
        self.metrics.log_value("num_response_tokens_lifetime", int(sum(lengths)), reduce="lifetime_sum")
        self.metrics.log_value(
            "truncated_fraction",
            float(np.mean([e.get_infos(-1)["finish_reason"] == "length" for e in episodes])) if n else 0.0,
            window=1,
        )
        self.metrics.log_value("reward_timeouts", sum(r.timed_out for r in results), reduce="sum")
        self.metrics.log_value("reward_errors", sum(r.error is not None for r in results), reduce="sum")

    def _log_logprob_mismatch(self, completions) -> None:
        """|engine - recomputed| behaviour log-probs per token, where both exist (vLLM)."""
        diffs = [
            np.abs(c.engine_logp.astype(np.float64) - c.logp.astype(np.float64))
            for c in completions
            if c.engine_logp is not None and c.logp is not None and c.logp is not c.engine_logp and len(c.logp) == len(c.engine_logp)
        ]
        if diffs:
            flat = np.concatenate(diffs)
            if len(flat):
                self.metrics.log_value("behaviour_logprob_mismatch_mean", float(flat.mean()), window=1)
                self.metrics.log_value("behaviour_logprob_mismatch_max", float(flat.max()), window=1)

    def score_trajectories(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> tuple[List[np.ndarray], List[np.ndarray]]:
        """Per-token log-probs and entropies of stored trajectories under the current
        weights, in one batched pass (ExGRPO's trajectory selection)."""
        self._ensure_module()
        return self.backend.score(prompts, completions, temperature=self.settings.temperature)

    @override(EnvRunner)
    def get_metrics(self):
        return self.metrics.reduce()

    # ---- state -----------------------------------------------------------------------
    @override(Checkpointable)
    def get_state(self, components=None, *, not_components=None, **kwargs):
        state = {NUM_ENV_STEPS_SAMPLED_LIFETIME: self.num_env_steps_sampled_lifetime}
        if rc.check_component(self, COMPONENT_RL_MODULE, components, not_components):
            if components is None and self.module is None and self.weights_source is not None and not self._samples_here():
                # The whole state of a runner without a module (an algorithm's local
                # runner; RLlib's restore_env_runners asks for it): no weights, rather than
                # a model built on the driver for them. The restored runners get the
                # learner's weights from the algorithm's sync. Asked for explicitly, the
                # module is built and fetches the current weights.
                return state
            self._ensure_module()
            if self.module is None:  # engine only: its weights are vLLM's, not a module state
                return state
            state[COMPONENT_RL_MODULE] = self.module.get_state(**kwargs)
            state[WEIGHTS_SEQ_NO] = self._held_weights_seq_no
        return state

    @override(Checkpointable)
    def set_state(self, state: Dict[str, Any]) -> None:
        if COMPONENT_RL_MODULE in state:
            seq_no = state.get(WEIGHTS_SEQ_NO, 0)
            if seq_no == 0 or self._held_weights_seq_no < seq_no:
                module_state = state[COMPONENT_RL_MODULE]
                if isinstance(module_state, dict) and DEFAULT_MODULE_ID in module_state:
                    module_state = module_state[DEFAULT_MODULE_ID]
                if self.backend is not None:
                    self._load_module_state(module_state)
                elif self._samples_here():
                    # It will sample: build the module now and load straight into it.
                    self.make_module()
                    self._load_module_state(module_state)
                elif self.weights_source is None:
                    self._pending_module_state = module_state
                else:
                    # No module, and the weights can be fetched if one is ever built:
                    # keep no copy (see the module docstring).
                    self._pending_module_state = None
                    self._weights_dropped = True
            if seq_no > 0:
                self._held_weights_seq_no = seq_no
        if NUM_ENV_STEPS_SAMPLED_LIFETIME in state:
            self.num_env_steps_sampled_lifetime = state[NUM_ENV_STEPS_SAMPLED_LIFETIME]

    def _samples_here(self) -> bool:
        """Whether this runner samples in training: a remote runner, or the local one
        of an algorithm without remote runners."""
        if self.settings.colocate:
            return False  # the learners sample (rllib/colocation.py)
        return bool(self.worker_index) or not (self.config.num_env_runners or 0)

    def _load_module_state(self, module_state) -> None:
        """New weights into the module, then into the generation backend from the
        module's own tensors (the backend never gets another copy of the state)."""
        if isinstance(module_state, dict) and COMPONENT_RL_MODULE in module_state:
            module_state = module_state[COMPONENT_RL_MODULE]
        if isinstance(module_state, dict) and DEFAULT_MODULE_ID in module_state:
            module_state = module_state[DEFAULT_MODULE_ID]
        if self.module is None:  # engine only: straight into vLLM, nothing kept here
            self.backend.load_weights(module_state)
            return
        self.module.set_state(module_state)
        if self.backend is not None:
            self.backend.load_weights(self.module.state_dict())

    # ---- weights over a collective (weight_sync: collective; rllib/weight_broadcast.py) ----
    def weight_receive_device(self) -> str:
        """Where this runner receives broadcast weights (``"cpu"`` / ``"cuda"``), its module
        (or vLLM backend) built first: a member of the weight group needs somewhere to put them."""
        self._ensure_module()
        return runner_device(self.config).type

    def join_weight_group(self, address, rank: int) -> dict:
        """Join a generation of the weight group as ``rank`` (blocks until every member has);
        ``{"ok": ...}``, never raises (an exception would end this actor)."""
        self._ensure_module()
        names = list(self.module.state_dict()) if self.module is not None else []
        _, status = weight_broadcast.runner_join(self, address, rank, runner_device(self.config), names)
        return status

    def receive_weights(self, generation: int, sync: int) -> dict:
        """One collective sync: the broadcast buckets straight into the module's parameters
        (then the generation backend loads from the module's tensors: a no-op for HF), or,
        without a module (vLLM engine only), collected and pushed into the engine through
        ``load_weights``. ``{"ok": ...}``, never raises."""
        targets = self.module.state_dict() if self.module is not None else None
        seq_no, collected, status = weight_broadcast.runner_receive(self, generation, sync, targets)
        if not status["ok"]:
            return status
        try:
            if collected is not None:
                self.backend.load_weights(collected)
                del collected
            elif self.backend is not None:
                self.backend.load_weights(self.module.state_dict())
        except Exception as e:
            logger.exception("loading the broadcast weights into the generation backend failed")
            return {"ok": False, "error": repr(e)}
        self._pending_module_state, self._weights_dropped = None, False
        if seq_no > 0:
            self._held_weights_seq_no = seq_no
        return status

    def mark_weights_stale(self) -> None:
        """The learners' weights moved on without passing through this runner (a collective
        sync reaches the remote runners only): keep no copy, and fetch the current ones from
        :attr:`weights_source` if this runner's module is ever needed (without a source it
        keeps what it has, as RLlib's runners do)."""
        if self.weights_source is not None:
            self._pending_module_state = None
            self._weights_dropped = True

    @override(Checkpointable)
    def get_ctor_args_and_kwargs(self):
        return ((), {"config": self.config})

    @override(Checkpointable)
    def get_checkpointable_components(self):
        return []

    @override(EnvRunner)
    def stop(self):
        for env in (self.env, *self._heldout_envs.values()):
            env.close()
