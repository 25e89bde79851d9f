"""The types of ``ExGRPOConfig``'s own fields, for type checkers and IDEs.

Generated from ``rllib_exgrpo/rllib/config_fields.py`` (``python -m
rllib_exgrpo.rllib.config_fields``); do not edit. Annotations only: the defaults,
checks and documentation are in ``config_fields.FIELDS``.
"""
from __future__ import annotations

from typing import Any, Dict, Literal, Optional, Union


class ExGRPOConfigFields:
    """The fields ``ExGRPOConfig`` adds to RLlib's ``AlgorithmConfig`` (``docs/config.md``)."""

    # policy model
    model_name_or_path: str
    model_dtype: Literal['float32', 'bfloat16', 'float16']
    gradient_checkpointing: bool
    attn_implementation: Literal['auto', 'sdpa_varlen', 'flash_attention_2', 'flash_attention_3', 'flex_attention', 'sdpa', 'eager']

    # sampling
    questions_per_step: int
    group_size: int
    temperature: float
    top_p: float
    max_prompt_tokens: int
    max_response_tokens: int
    generation_backend: str
    generation_batch_size: int
    hf_decoder: Literal['pruned', 'generate']
    vllm_kwargs: Dict[str, Any]
    behaviour_logprobs: Literal['recompute', 'engine']
    scoring_on: Literal['runners', 'learners']
    behaviour_ratio_cap: float
    async_rollouts: bool
    colocate: bool

    # GRPO objective
    advantage_estimator: str
    advantage_eps: float
    clip_eps_low: float
    clip_eps_high: float
    ratio_mode: str
    loss_agg_mode: str
    official_micro_batch_rows: int
    entropy_coeff: float
    weight_decay: float
    minibatch_shuffle: Literal['groups', 'rows', 'none']
    kl_coeff: float
    skip_update_grad_norm: Optional[float]

    # ExGRPO experience management (docs/ALGORITHMS.md section 2)
    experience_replay: bool
    experience_ratio: float
    delayed_start_solve_rate: float
    fill_pool_before_start: bool
    bucket_weighting: str
    replay_cooldown_steps: int
    bucket_mu: float
    bucket_sigma: float
    replay_content: Literal['trajectory', 'prompt']
    trajectory_selection: str
    replay_candidates_per_question: Optional[int]
    policy_shaping: bool
    policy_shaping_beta: float
    remove_clip_in_mixed_mode: bool
    retire_solved: bool
    retire_before_start: bool
    pool_switch_step: bool
    retire_min_remaining: int
    buffer_capacity: int
    buffer_logp_dtype: Literal['float16', 'bfloat16', 'float32']

    # XRPO (docs/ALGORITHMS.md section 3); all off by default, each composes with ExGRPO
    xrpo_planner: bool
    planner_n0: int
    planner_rounds: int
    planner_lambda: float
    planner_alpha: float
    planner_allocation: Literal['proportional', 'top']
    planner_max_per_question: Optional[int]
    icl_seeding: bool
    icl_num_examples: int
    icl_samples: int
    icl_corpus_size: int
    icl_max_questions: Optional[int]
    novelty_sharpening: bool
    novelty_lambda: float
    novelty_kappa: float

    # evaluation on held-out questions
    heldout_dataset: Optional[str]
    heldout_split: str
    heldout_interval: int
    heldout_num_questions: int
    heldout_samples: int
    heldout_temperature: float
    heldout_max_response_tokens: Optional[int]

    # learners (docs/deepspeed.md)
    learner_micro_batch_rows: Optional[int]
    learner_micro_batch_tokens: Optional[int]
    learner_sequence_packing: bool
    logit_chunk_tokens: int
    learner_backend: Literal['ddp', 'deepspeed']
    deepspeed_zero_stage: Literal[1, 2, 3]
    deepspeed: Dict[str, Any]

    # LoRA (docs/training_step.md)
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    lora_target_modules: Any

    # weight sync (docs/scaling.md)
    weight_sync: Literal['collective', 'object_store']
    weight_sync_bucket_mb: float

    # GPU memory plan (docs/memory_plan.md)
    gpu_memory_gb: Optional[Union[float, str]]
