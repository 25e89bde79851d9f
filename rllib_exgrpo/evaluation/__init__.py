"""Benchmark evaluation of a policy (``rllib evaluate``): avg@k, pass@k, maj@k per source.

``evaluate`` (``evaluate.py``) runs the policy; ``metrics.py`` holds the metrics and the
report, ``checkpoints.py`` reads this project's RLlib checkpoints, ``data.py`` loads the
benchmark sources, ``paths.py`` checks model and checkpoint paths as users type them, and
``export.py`` writes a checkpoint's policy as a Hugging Face model folder (``rllib export``).
"""

from rllib_exgrpo.evaluation.checkpoints import (
    CheckpointInfo,
    find_checkpoint,
    is_checkpoint,
    load_policy_from_checkpoint,
    read_checkpoint,
    restore_module,
)
from rllib_exgrpo.evaluation.data import EvalDataError, load_eval_problems
from rllib_exgrpo.evaluation.evaluate import evaluate
from rllib_exgrpo.evaluation.export import ExportError, ExportResult, export_checkpoint
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
from rllib_exgrpo.evaluation.paths import PolicyPathError, checkpoint_source, policy_source

__all__ = [
    "CheckpointInfo",
    "EvalDataError",
    "EvalReport",
    "ExportError",
    "ExportResult",
    "PolicyPathError",
    "QuestionResult",
    "aggregate",
    "avg_at_k",
    "checkpoint_source",
    "default_k",
    "evaluate",
    "export_checkpoint",
    "find_checkpoint",
    "is_checkpoint",
    "load_eval_problems",
    "load_policy_from_checkpoint",
    "maj_at_k",
    "pass_at_k",
    "policy_source",
    "read_checkpoint",
    "resolve_k",
    "restore_module",
]
