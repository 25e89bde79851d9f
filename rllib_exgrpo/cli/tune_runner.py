"""Running built experiments with Ray Tune: start or join Ray, fit resources to the
cluster, one ``tune.Tuner`` per experiment, and a one-line report per failed trial.
"""
from __future__ import annotations


import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple


from rllib_exgrpo.cli.console import iteration_lines_callback_class
from rllib_exgrpo.cli.experiment import Experiment
from rllib_exgrpo.cli.mlflow_logging import prepare_mlflow
from rllib_exgrpo.cli.plots import write_grid_plots
from rllib_exgrpo.cli.scheduler import make_scheduler

@dataclass
class ExperimentResult:
    """What :func:`run_experiments` returns per experiment."""

    experiment: Experiment
    result_grid: Any  # ray.tune.ResultGrid
    errors: List[Tuple[str, Optional[str]]] = field(default_factory=list)  # (trial path, error file)

    @property
    def ok(self) -> bool:
        return not self.errors


def _trial_errors(result_grid: Any) -> List[Tuple[str, Optional[str]]]:
    errors = []
    for result in result_grid:
        if result.error is None:
            continue
        path = str(result.path)
        err_file = os.path.join(path, "error.txt")
        errors.append((path, err_file if "://" in path or os.path.exists(err_file) else None))
    return errors


RESOURCE_FIELDS = (
    "num_env_runners", "num_cpus_per_env_runner", "num_gpus_per_env_runner", "num_learners",
    "num_cpus_per_learner", "num_gpus_per_learner", "num_cpus_for_main_process",
)


def fit_experiment_resources(exp: "Experiment", cluster: Any = None) -> List[str]:
    """Fit the experiment's CPU/GPU request to the cluster before Tune sees it (see
    ``rllib_exgrpo.rllib.resources.fit_resources``): a trial that cannot be placed would stay
    PENDING forever. Notes go to stderr; a GPU shortfall raises ``ResourceError`` naming
    the keys and the file. Resource fields under a search space are left to Tune."""
    from rllib_exgrpo.rllib.resources import ResourceError, fit_resources

    from ray.tune.search.sample import Domain

    config = exp.config
    if any(isinstance(getattr(config, k, None), (dict, Domain)) for k in RESOURCE_FIELDS):
        return []
    try:
        notes = fit_resources(config, cluster)
    except ResourceError as e:
        raise ResourceError(f"{exp.source or 'experiment'}: experiment {exp.name!r}: {e}") from None
    for note in notes:
        print(f"rllib train: experiment {exp.name!r}: {note}", file=sys.stderr, flush=True)
    return notes


def run_experiments(
    experiments: Sequence[Experiment],
    *,
    verbose: int = 1,
    ray_address: Optional[str] = None,
    ray_init_kwargs: Optional[Dict[str, Any]] = None,
    resume: bool = False,
) -> List[ExperimentResult]:
    """Run experiments one after another with ``tune.Tuner``; return one result each.

    Ray: an already initialised Ray is used as is; else ``ray.init(address=ray_address)``
    when ``ray_address`` or ``RAY_ADDRESS`` is set; else a private local instance
    (``ray.init(address="local", **ray_init_kwargs)``), shut down at the end. A failing
    trial does not stop later experiments; see ``ExperimentResult.errors``.

    ``resume``: an experiment whose folder holds Tune's state continues from there
    (:func:`_restored_tuner`); one with nothing saved starts fresh (and says so).
    """
    import ray
    from ray import tune

    for exp in experiments:
        if exp.mlflow:
            prepare_mlflow(exp.mlflow)

    started = False
    if not ray.is_initialized():
        kwargs = dict(ray_init_kwargs or {})
        if ray_address or os.environ.get("RAY_ADDRESS"):
            ray.init(address=ray_address or os.environ["RAY_ADDRESS"], **kwargs)
        else:
            kwargs.setdefault("include_dashboard", False)
            ray.init(address="local", **kwargs)
        started = True

    results = []
    try:
        for exp in experiments:
            fit_experiment_resources(exp)
        for exp in experiments:
            tuner = _restored_tuner(exp) if resume else None
            tuner = tuner or tune.Tuner(
                exp.algo_cls,
                param_space=exp.param_space,
                tune_config=tune.TuneConfig(num_samples=exp.num_samples, **_scheduling(exp)),
                run_config=tune.RunConfig(
                    name=exp.name,
                    storage_path=exp.storage_path,
                    stop=exp.stop or None,
                    checkpoint_config=exp.checkpoint_config,
                    # Tune's status tables only when asked for (--verbose); otherwise
                    # one line per iteration.
                    callbacks=list(exp.callbacks) + ([] if verbose > 1 else [iteration_lines_callback_class()()]),
                    verbose=verbose - 1 if verbose > 1 else 0,
                ),
            )
            grid = tuner.fit()
            results.append(ExperimentResult(experiment=exp, result_grid=grid, errors=_trial_errors(grid)))
            for path in write_grid_plots(grid, exp.name):
                print(f"held-out accuracy plot: {path}")
            _print_best_trial(exp, grid)
    finally:
        if started:
            ray.shutdown()
    return results


def _restored_tuner(exp: Experiment) -> Any:
    """Tune's own restore of ``<storage_path>/<name>``, or None when nothing was saved.

    Tune keeps the experiment's state (trials, their configs, stop criteria, callbacks,
    each trial's latest *completed* checkpoint) in that folder; a checkpoint still being
    written when the run died is not registered there, so the restore starts from the
    last whole one. Unfinished and errored trials continue from their checkpoint (the
    algorithm's state restores model, optimiser, experience pool, sampler position,
    delayed-start state, counters and RNG streams); finished ones stay finished.
    """
    from ray import tune

    path = os.path.join(exp.storage_path, exp.name)
    if not tune.Tuner.can_restore(path):
        print(f"rllib train: --resume: nothing saved in {path} yet; experiment {exp.name!r} starts fresh",
              file=sys.stderr)
        return None
    print(f"rllib train: --resume: experiment {exp.name!r} continues from {path}", file=sys.stderr)
    return tune.Tuner.restore(path, trainable=exp.algo_cls, param_space=exp.param_space,
                              resume_unfinished=True, resume_errored=True)


def _scheduling(exp: Experiment) -> Dict[str, Any]:
    """TuneConfig's scheduler, metric and mode from the experiment's ``scheduler:``."""
    settings = exp.scheduler or {}
    out: Dict[str, Any] = {}
    scheduler = make_scheduler(settings)
    if scheduler is not None:
        out["scheduler"] = scheduler
        knobs = ", ".join(f"{k} {settings[k]}" for k in ("max_t", "grace_period", "reduction_factor") if settings.get(k))
        print(f"rllib train: experiment {exp.name!r}: ASHA on {settings['metric']} ({settings['mode']})"
              + (f", {knobs}" if knobs else ""), file=sys.stderr)
    if settings.get("metric"):
        out.update(metric=settings["metric"], mode=settings["mode"])
    return out


def _print_best_trial(exp: Experiment, grid: Any) -> None:
    """With a scheduler metric: the best trial, its value and its searched settings."""
    settings = exp.scheduler or {}
    if not settings.get("metric") or not exp.search_space:
        return
    try:
        best = grid.get_best_result(metric=settings["metric"], mode=settings["mode"], scope="all")
    except (RuntimeError, KeyError, ValueError):
        return
    value = best.metrics_dataframe[settings["metric"]].agg(settings["mode"]) if best.metrics_dataframe is not None else None
    chosen = {}
    for path in exp.search_space:
        node: Any = best.config
        for part in path.split("/")[1:]:
            node = node.get(part) if isinstance(node, dict) else None
        chosen[path.split("/", 1)[1]] = node
    print(f"rllib train: experiment {exp.name!r}: best trial {best.path} ({settings['metric']} "
          f"{settings['mode']} {'?' if value is None else format(value, '.4g')}): {chosen}", file=sys.stderr)
