"""Benchmark evaluation of a policy (``rllib evaluate``): avg@k, pass@k, maj@k per source.

``evaluate`` (``evaluate.py``) runs the policy; ``metrics.py`` holds the metrics and the
report, ``checkpoints.py`` reads this project's RLlib checkpoints, ``data.py`` loads the
benchmark sources.
"""
from rllib_exgrpo.evaluation.checkpoints import (
    CheckpointInfo,
    find_checkpoint,
    is_checkpoint,
    load_policy_from_checkpoint,
    read_checkpoint,
)
from rllib_exgrpo.evaluation.data import EvalDataError, load_eval_problems
from rllib_exgrpo.evaluation.evaluate import evaluate
from rllib_exgrpo.evaluation.metrics import (
    EvalReport,
    QuestionResult,
    aggregate,
    avg_at_k,
    default_k,
    maj_at_k,
    pass_at_k,
    resolve_k,
)

__all__ = [
    "CheckpointInfo", "EvalDataError", "EvalReport", "QuestionResult", "aggregate", "avg_at_k",
    "default_k", "evaluate", "find_checkpoint", "is_checkpoint", "load_eval_problems",
    "load_policy_from_checkpoint", "maj_at_k", "pass_at_k", "read_checkpoint", "resolve_k",
]
