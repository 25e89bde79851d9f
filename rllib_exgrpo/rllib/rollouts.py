"""Rollout coordination: a step's sampling and replay scoring spread over the env runners.

:class:`RolloutCoordinator` holds what ``ExGRPO`` needs from RLlib's ``EnvRunnerGroup``:

* :meth:`~RolloutCoordinator.sample`: questions spread over the healthy remote runners (a
  question's group stays on one runner); a runner that dies mid-call returns nothing, so
  its shard is neither lost nor counted twice: the dead runners are restored (the
  algorithm's ``restore_env_runners``: RLlib restarts them, then the current weights go to
  them) and the shard is sampled again, up to ``attempts`` rounds
  (``env_runner_failures`` / ``resampled_questions`` count it). With no remote runners the
  local one samples.
* :meth:`~RolloutCoordinator.score_on_runners`: replay candidates re-scored on every
  healthy runner at once, in contiguous shards of about equal tokens; a shard whose runner
  dies is scored on the local runner.
* :func:`score_on_learners`: the same numbers from the learners (``scoring_on: learners``).

Nothing here needs an ``Algorithm``: the group, a ``MetricsLogger`` and the restore call
are handed in.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from rllib_exgrpo.core.minibatches import shard_by_tokens

logger = logging.getLogger(__name__)

#: Sampling rounds per call before a step gives up on runners that keep dying.
SAMPLE_ATTEMPTS = 3
#: Metric: how many remote runners scored the last replay candidates (0: the local one).
SCORING_RUNNERS_KEY = ("experience", "replay_scoring_runners")
#: What sampling with replacement of failed runners logs at the top level.
ROLLOUT_METRICS = ("env_runner_failures", "resampled_questions")


class RolloutCoordinator:
    """Sampling and scoring across an ``EnvRunnerGroup`` (see the module doc).

    Args:
        env_runner_group: RLlib's ``EnvRunnerGroup`` (or anything with its
            ``num_remote_workers`` / ``healthy_worker_ids`` / ``foreach_env_runner`` /
            ``local_env_runner``).
        metrics: the ``MetricsLogger`` the counts go to.
        restore_failed: brings dead runners back with the current weights.
        attempts: sampling rounds before a call gives up.
    """

    def __init__(self, env_runner_group, metrics, restore_failed: Callable[[], Any], *, attempts: int = SAMPLE_ATTEMPTS):
        self.group = env_runner_group
        self.metrics = metrics
        self.restore_failed = restore_failed
        self.attempts = attempts

    def sample(
        self,
        question_ids: Sequence[str],
        num_samples: Sequence[int],
        prompt_prefixes: Optional[Sequence[Optional[str]]] = None,
        **sample_kwargs,
    ) -> Tuple[list, list]:
        """``(episodes, runner metrics)`` of every question, ``num_samples[i]`` completions
        of ``question_ids[i]`` (after ``prompt_prefixes[i]`` when given); ``sample_kwargs``
        go to ``LLMEnvRunner.sample``. Raises ``RuntimeError`` when runners keep dying."""
        prefixes = list(prompt_prefixes) if prompt_prefixes is not None else [None] * len(question_ids)
        if self.group.num_remote_workers() == 0:
            runner = self.group.local_env_runner
            episodes = runner.sample(
                question_ids=list(question_ids), num_samples=list(num_samples), prompt_prefixes=prefixes, **sample_kwargs
            )
            return episodes, [runner.get_metrics()]
        pending = list(zip(question_ids, num_samples, prefixes))
        episodes, metrics = [], []
        for key in ("env_runner_failures", "resampled_questions"):  # reported as 0, not NaN
            self.metrics.log_value(key, 0, reduce="sum")
        for _ in range(self.attempts):
            failed = self._sample_round(pending, sample_kwargs, episodes, metrics)
            if not failed:
                return episodes, metrics
            self.metrics.log_value("env_runner_failures", len(failed), reduce="sum")
            self.metrics.log_value("resampled_questions", sum(len(shard) for shard in failed), reduce="sum")
            pending = [item for shard in failed for item in shard]
            logger.warning(
                "%d env runner(s) failed while sampling; restarting them and sampling their %d question(s) again", len(failed), len(pending)
            )
            self.restore_failed()
        raise RuntimeError(
            f"env runners kept failing: {len(pending)} question(s) still unsampled after "
            f"{self.attempts} attempts (see the runners' logs for why they die)"
        )

    def _sample_round(self, items, sample_kwargs, episodes: list, metrics: list) -> List[list]:
        """One sampling round over the healthy remote runners; returns the shards of the
        runners that returned nothing (died); the others' episodes and metrics are appended."""
        remote_ids = self.group.healthy_worker_ids()
        if not remote_ids:
            return [items]
        shards = [(wid, shard) for wid, shard in zip(remote_ids, split_evenly(items, len(remote_ids))) if shard]
        funcs = []
        for _, shard in shards:
            qs, ns, ps = ([x[i] for x in shard] for i in range(3))

            def call(r, qs=qs, ns=ns, ps=ps):
                eps = r.sample(question_ids=qs, num_samples=ns, prompt_prefixes=ps, **sample_kwargs)
                return r.worker_index, eps, r.get_metrics()

            funcs.append(call)
        results = self.group.foreach_env_runner(funcs, remote_worker_ids=[w for w, _ in shards], local_env_runner=False)
        returned = set()
        for wid, eps, m in results:
            returned.add(wid)
            episodes += eps
            metrics.append(m)
        return [shard for wid, shard in shards if wid not in returned]

    def score_on_runners(self, prompts, completions) -> Tuple[list, list]:
        """``(logps, entropies)`` of ``(prompt, completion)`` rows in row order, scored where
        the current weights live: sorted by length into contiguous shards of about equal
        tokens, one per healthy runner; a shard whose runner dies is scored on the local
        runner. Logs ``experience/replay_scoring_runners``."""
        group = self.group
        remote_ids = group.healthy_worker_ids() if group.num_remote_workers() > 0 else []
        if not remote_ids or not prompts:
            self.metrics.log_value(SCORING_RUNNERS_KEY, 0, window=1)
            return group.local_env_runner.score_trajectories(prompts, completions)
        shards = shard_by_tokens([len(p) + len(c) for p, c in zip(prompts, completions)], len(remote_ids))
        funcs = []
        for k, rows in enumerate(shards):
            ps, cs = [prompts[i] for i in rows], [completions[i] for i in rows]
            funcs.append(lambda r, k=k, ps=ps, cs=cs: (k, r.score_trajectories(ps, cs)))
        results = group.foreach_env_runner(funcs, remote_worker_ids=remote_ids[: len(shards)], local_env_runner=False)
        scored = {k: out for k, out in results}
        self.metrics.log_value(SCORING_RUNNERS_KEY, len(scored), window=1)
        logps: List[Any] = [None] * len(prompts)
        entropies: List[Any] = [None] * len(prompts)
        for k, rows in enumerate(shards):
            if k not in scored:  # its runner died mid-call
                logger.warning("an env runner failed while scoring replay candidates; scoring its shard locally")
                scored[k] = group.local_env_runner.score_trajectories([prompts[i] for i in rows], [completions[i] for i in rows])
            for j, i in enumerate(rows):
                logps[i], entropies[i] = scored[k][0][j], scored[k][1][j]
        return logps, entropies


def learner_error(error: BaseException, learner: Optional[int], what: str) -> BaseException:
    """A remote learner's error as the user should see it: the original exception's type
    (not Ray's ``RayTaskError`` wrapper, whose unpacking would fail as a ``TypeError``) with
    one line naming what failed, where and why; the original is its ``__cause__``."""
    cause = getattr(error, "cause", None)
    original = cause if isinstance(cause, BaseException) else error
    text = str(original).strip().splitlines()
    where = f"learner actor {learner}" if learner is not None else "a learner"
    message = f"{what} failed on {where}: {type(original).__name__}: {text[0] if text else ''}".rstrip(": ")
    try:
        new = type(original)(message)
        if str(new) != message:
            raise TypeError
    except Exception:  # an exception type that takes other arguments
        new = RuntimeError(message)
    new.__cause__ = original
    return new


def score_on_learners(learner_group, prompts, completions, pad_id: int) -> Tuple[list, list]:
    """``scoring_on: learners``: log-probs and entropies of ``(prompt, completion)`` rows
    under the learners' weights, each learner scoring its share
    (``ExGRPOTorchLearner.score_rows``). Returns ``(logps, entropies)`` in row order."""
    logps: List[Any] = [None] * len(prompts)
    entropies: List[Any] = [None] * len(prompts)
    if not prompts:
        return logps, entropies
    prompts = [np.asarray(p, dtype=np.int64) for p in prompts]
    completions = [np.asarray(c, dtype=np.int64) for c in completions]
    results = learner_group.foreach_learner(lambda learner, _p=prompts, _c=completions, _pad=pad_id: learner.score_rows(_p, _c, _pad))
    for result in results:
        if not getattr(result, "ok", True):
            raise learner_error(result.get(), getattr(result, "actor_id", None), "scoring on the learners")
        rows, lp, en = result.get()
        for j, i in enumerate(rows):
            logps[i], entropies[i] = lp[j], en[j]
    missing = [i for i, v in enumerate(logps) if v is None]
    if missing:
        raise RuntimeError(f"scoring on the learners returned no numbers for {len(missing)} of {len(prompts)} rows")
    return logps, entropies


def split_evenly(items: list, parts: int) -> List[list]:
    """``items`` cut into ``parts`` contiguous pieces of ``ceil(len / parts)`` (the last
    ones shorter or empty)."""
    size = math.ceil(len(items) / parts) if parts else 0
    return [items[i * size : (i + 1) * size] for i in range(parts)]
