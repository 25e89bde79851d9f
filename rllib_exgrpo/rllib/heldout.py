"""Held-out evaluation: accuracy (avg@k) on held-out questions under the current weights.

:class:`HeldoutEvaluator` reads the held-out questions (``heldout_dataset`` /
``heldout_split``, the first ``heldout_num_questions``), samples them through the sampling
call it is given (``RolloutCoordinator.sample`` in ``ExGRPO``) with the held-out settings
(``heldout_samples`` per question, ``heldout_temperature``, no log-probs), and logs
``heldout/accuracy``, ``heldout/after_iteration`` and ``heldout/initial_accuracy`` (the
accuracy before the first update, kept in checkpoints). Nothing here needs an ``Algorithm``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from rllib_exgrpo.envs.reasoning_env import ReasoningEnv

logger = logging.getLogger(__name__)

HELDOUT = "heldout"
#: What the held-out evaluation logs under ``heldout/``.
HELDOUT_METRICS = ("accuracy", "after_iteration", "initial_accuracy")


def heldout_env_config(config) -> dict:
    """The env config of the held-out questions: the training env's, on ``heldout_dataset``
    and ``heldout_split`` (no tokenizer, no inline problems)."""
    env_config = {k: v for k, v in config.env_config.items() if k not in ("tokenizer", "problems")}
    env_config.update(dataset=config.heldout_dataset, split=config.heldout_split)
    return env_config


def heldout_question_ids(config) -> Optional[List[str]]:
    """The ids of the first ``heldout_num_questions`` held-out questions (None: no set)."""
    if not config.heldout_dataset:
        return None

    env = ReasoningEnv(heldout_env_config(config))
    return [p.id for p in env.problems][: config.heldout_num_questions]


class HeldoutEvaluator:
    """Evaluates the held-out questions (see the module doc).

    Args:
        config: the ``ExGRPOConfig``.
        sample: ``sample(question_ids, num_samples, **sample_kwargs) -> (episodes, metrics)``.
        question_ids: the held-out question ids (default: read from ``config``).
    """

    def __init__(self, config, sample: Callable[..., Tuple[list, Any]], question_ids: Optional[List[str]] = None):
        self.config = config
        self.sample = sample
        self.question_ids = question_ids if question_ids is not None else heldout_question_ids(config)
        #: Accuracy before the first update (iteration 0), once evaluated.
        self.initial_accuracy: Optional[float] = None

    @property
    def enabled(self) -> bool:
        return bool(self.question_ids)

    def due(self, iterations_done: int) -> bool:
        """Whether an evaluation follows iteration ``iterations_done`` (0: the starting point)."""
        if not self.enabled:
            return False
        interval = self.config.heldout_interval
        return iterations_done == 0 or (interval > 0 and iterations_done % interval == 0)

    def evaluate(self) -> Dict[str, float]:
        """``{"accuracy", "num_questions", "samples_per_question"}`` under the current weights."""
        cfg = self.config
        if not self.enabled:
            raise ValueError("no held-out set: set heldout_dataset in the config")
        episodes, _ = self.sample(
            self.question_ids,
            [cfg.heldout_samples] * len(self.question_ids),
            heldout=True,
            temperature=cfg.heldout_temperature,
            max_new_tokens=cfg.heldout_max_response_tokens or cfg.max_response_tokens,
            return_logprobs=False,
        )
        rewards = np.asarray([e.get_return() for e in episodes], dtype=np.float64)
        return {
            "accuracy": float(rewards.mean()) if len(rewards) else 0.0,
            "num_questions": len(self.question_ids),
            "samples_per_question": cfg.heldout_samples,
        }

    def record(self, metrics, result: Dict[str, float], after_iteration: int) -> None:
        """Log ``heldout/...`` of one evaluation to ``metrics`` (a ``MetricsLogger``)."""
        metrics.log_value((HELDOUT, "accuracy"), result["accuracy"], window=1)
        metrics.log_value((HELDOUT, "after_iteration"), after_iteration, window=1)
        if after_iteration == 0:
            self.initial_accuracy = result["accuracy"]
        if self.initial_accuracy is not None:
            metrics.log_value((HELDOUT, "initial_accuracy"), self.initial_accuracy, window=1)
        # Logged, not printed: `rllib train`'s one line per iteration shows it already.
        logger.info(
            "held-out accuracy after %d iterations: %.3f (%d questions x %d)",
            after_iteration,
            result["accuracy"],
            result["num_questions"],
            result["samples_per_question"],
        )
