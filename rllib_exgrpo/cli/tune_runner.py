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
from rllib_exgrpo.rllib import rllib_contract
from rllib_exgrpo.rllib.resources import ResourceError, plan_trials


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
    "num_env_runners",
    "num_cpus_per_env_runner",
    "num_gpus_per_env_runner",
    "num_learners",
    "num_cpus_per_learner",
    "num_gpus_per_learner",
    "num_cpus_for_main_process",
)


def fit_experiment_resources(exp: "Experiment", cluster: Any = None) -> List[str]:
    """Fit the experiment's CPU/GPU request to the cluster before Tune sees it (see
    ``rllib_exgrpo.rllib.resources.plan_trials``): a trial that cannot be placed would stay
    PENDING forever, and a GPU search runs as many trials at once as the GPUs allow, the
    CPUs divided among them. Sets ``exp.max_concurrent_trials`` (what Tune is told) and, for
    a search, prints one line saying how many trials run at once and what each gets. Notes
    go to stderr; a GPU shortfall raises ``ResourceError`` naming the keys and the file.
    Resource fields under a search space are left to Tune. Returns the lines printed."""
    from ray.tune.search.sample import Domain

    config = exp.config
    trials = exp.num_trials or 1
    searched = [k for k in RESOURCE_FIELDS if isinstance(getattr(config, k, None), (dict, Domain))]
    if searched:
        exp.max_concurrent_trials = None
        line = f"{trials} trials; resources searched ({', '.join(searched)}): Tune starts each trial as the cluster's free resources allow"
        print(f"rllib train: experiment {exp.name!r}: {line}", file=sys.stderr, flush=True)
        return [line]
    try:
        plan = plan_trials(config, trials, cluster)
    except ResourceError as e:
        raise ResourceError(f"{exp.source or 'experiment'}: experiment {exp.name!r}: {e}") from None
    exp.max_concurrent_trials = plan.concurrent if trials > 1 else None
    lines = list(plan.notes) + ([plan.line()] if trials > 1 else [])
    for line in lines:
        print(f"rllib train: experiment {exp.name!r}: {line}", file=sys.stderr, flush=True)
    return lines


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

    for exp in experiments:
        if exp.mlflow:
            prepare_mlflow(exp.mlflow)
    started = _init_ray(ray_address, ray_init_kwargs)
    results = []
    try:
        for exp in experiments:
            fit_experiment_resources(exp)
        for exp in experiments:
            tuner = _restored_tuner(exp) if resume else None
            grid = (tuner or _new_tuner(exp, verbose)).fit()
            results.append(ExperimentResult(experiment=exp, result_grid=grid, errors=_trial_errors(grid)))
            for path in write_grid_plots(grid, exp.name):
                print(f"held-out accuracy plot: {path}")
            _print_best_trial(exp, grid)
    finally:
        if started:
            ray.shutdown()
    return results


def _init_ray(ray_address: Optional[str], ray_init_kwargs: Optional[Dict[str, Any]]) -> bool:
    """Start Ray unless it runs already (see :func:`run_experiments`); True if started here."""
    import ray

    if ray.is_initialized():
        return False
    kwargs = dict(ray_init_kwargs or {})
    if ray_address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=ray_address or os.environ["RAY_ADDRESS"], **kwargs)
    else:
        kwargs.setdefault("include_dashboard", False)
        ray.init(address="local", **kwargs)
    return True


def _new_tuner(exp: Experiment, verbose: int) -> Any:
    """A fresh ``tune.Tuner`` of ``exp``."""
    from ray import tune

    return tune.Tuner(
        exp.algo_cls,
        param_space=exp.param_space,
        tune_config=tune.TuneConfig(num_samples=exp.num_samples, max_concurrent_trials=exp.max_concurrent_trials, **_scheduling(exp)),
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


def _restored_tuner(exp: Experiment) -> Any:
    """Tune's own restore of ``<storage_path>/<name>``, or None when nothing was saved.

    Tune keeps the experiment's state (trials, their configs, stop criteria, callbacks,
    each trial's latest *completed* checkpoint) in that folder; a checkpoint still being
    written when the run died is not registered there, so the restore starts from the
    last whole one. Unfinished and errored trials continue from their checkpoint (the
    algorithm's state restores model, optimiser, experience pool, sampler position,
    delayed-start state, counters and RNG streams). A finished trial continues the same
    way when this invocation's ``stop`` lies beyond its last result
    (:func:`_extend_finished_trials`); one that meets it stays finished.
    """
    from ray import tune

    path = os.path.join(exp.storage_path, exp.name)
    if not tune.Tuner.can_restore(path):
        print(f"rllib train: --resume: nothing saved in {path} yet; experiment {exp.name!r} starts fresh", file=sys.stderr)
        return None
    print(f"rllib train: --resume: experiment {exp.name!r} continues from {path}", file=sys.stderr)
    _extend_finished_trials(exp, path)
    return tune.Tuner.restore(path, trainable=exp.algo_cls, param_space=exp.param_space, resume_unfinished=True, resume_errored=True)


# Why the trial records in Tune's experiment state are edited before the restore:
#
# * Tune 2.60's restore brings every trial back with the status and the stop criteria it
#   was saved with. A TERMINATED trial is never scheduled again, and the `stop` given to
#   the restored run reaches only trials created after the restore, not the saved ones.
# * `ResumeConfig(finished=RESUME)` (through `Tuner.restore(_resume_config=...)`) decides
#   by status, for all finished trials alike: those that already meet the new stop would
#   be started too and run one more iteration (Tune checks the stop on a new result only),
#   and the continued ones would still carry their old stop, met at once.
# * A new Tuner whose trainable loads the trial's checkpoint in `setup` makes new trials:
#   new ids and folders, the history split over two folders (result.json, progress.csv),
#   the trial's Tune counters (training_iteration, time_total_s) to carry over by hand.
#
# So each saved trial is decided here, and the decision written into the two fields of
# its record that Tune's restore reads for it: `status` (a finished trial that must go on
# becomes PENDING, which Tune treats as unfinished and resumes from its latest
# checkpoint) and `stopping_criterion` (this invocation's merged `stop`, for every trial
# that runs). Everything else is then Tune's own machinery, as for a killed run: the
# same trial id and folder, result rows appended, and `Trainable.restore` bringing back
# the algorithm's state (`Algorithm.load_checkpoint`) and Tune's counters (iteration,
# time). MLflow logs the continuation as a new run of the trial, as after a kill.
# The rest of each record is left as Tune wrote it (plain JSON in, plain
# JSON out: nothing pickled is re-encoded); the run metadata (last result, latest
# checkpoint) is only read, through Tune's own decoder. The file is replaced atomically.
_STATE_FILE_PATTERN = "experiment_state-*.json"


def _extend_finished_trials(exp: Experiment, path: str) -> List[str]:
    """Prepare the saved trials of ``path`` for ``--resume`` under ``exp.stop`` and print
    one line per trial saying what happens to it; return those lines.

    * unfinished (killed, interrupted) or errored: continues from its latest checkpoint,
      as before; it now stops at this invocation's ``stop``.
    * finished at its stop, the new ``stop`` not met by its last result: continues from
      its latest checkpoint to the new ``stop`` (config, folder, history, counters kept).
    * finished and meeting the new ``stop``, or ended before its own stop was reached
      (a scheduler's early stop, ``done`` from the algorithm): stays finished.
    * finished, the new ``stop`` not met, but no checkpoint: stays finished (restarting it
      from scratch would silently throw away its results); the line says how to rerun it.
    """
    import json

    fs, fs_path = rllib_contract.fs_and_path(path)
    found = _read_experiment_state(fs, fs_path)
    if found is None:
        return []
    state_path, state = found
    new_stop = dict(exp.stop or {})
    prefix = f"rllib train: --resume: experiment {exp.name!r}: trial"
    lines, changed = [], False
    for entry in state.get("trial_data", []):
        record = json.loads(entry[0])
        meta = rllib_contract.training_run_metadata(entry[1])
        # its folder under the experiment's (what the user finds on disk; holds the trial id)
        name = record.get("relative_logdir") or f"{record.get('trainable_name')}_{record.get('trial_id')}"
        go_on, line = _trial_resume_plan(record, meta, new_stop)
        if go_on and new_stop and record.get("stopping_criterion") != new_stop:
            record["stopping_criterion"] = new_stop
        if go_on and record != json.loads(entry[0]):
            entry[0] = json.dumps(record, indent=2)
            changed = True
        lines.append(f"{prefix} {name} {line}")
        print(lines[-1], file=sys.stderr, flush=True)
    if changed:
        folder, _, file_name = state_path.rpartition("/")
        tmp_path = f"{folder}/.{file_name}.tmp"  # not matched by Tune's pattern
        with fs.open_output_stream(tmp_path) as f:
            f.write(json.dumps(state).encode("utf-8"))
        fs.move(tmp_path, state_path)
    return lines


def _read_experiment_state(fs: Any, fs_path: str) -> Optional[Tuple[str, Dict[str, Any]]]:
    """``(path, state)`` of the experiment state file Tune's restore reads (the newest
    under ``fs_path``), or None when there is none."""
    import fnmatch
    import json

    names = [info.base_name for info in fs.get_file_info(_file_selector(fs_path))]
    state_files = sorted(fnmatch.filter(names, _STATE_FILE_PATTERN))
    if not state_files:
        return None
    state_path = f"{fs_path.rstrip('/')}/{state_files[-1]}"  # the one Tune's restore reads
    with fs.open_input_stream(state_path) as f:
        return state_path, json.loads(f.readall().decode("utf-8"))


def _trial_resume_plan(record: Dict[str, Any], meta: Any, new_stop: Dict[str, Any]) -> Tuple[bool, str]:
    """``(goes on, what happens)`` for one saved trial (its Tune ``record`` and run
    ``meta``) under ``new_stop``: the cases of :func:`_extend_finished_trials`. A finished
    trial that continues is set back to ``PENDING`` in ``record``."""
    last = dict(meta.last_result or {})
    at = f"iteration {last.get('training_iteration', 0)}"
    ckpt = _latest_checkpoint(meta)
    status = record.get("status")
    if status != "TERMINATED":
        to = f"to {_stop_text(new_stop) or 'no stop'}"
        if status != "ERROR" and not last and ckpt is None:
            return True, f"had not started; starts {to}"
        what = "errored" if status == "ERROR" else "was interrupted"
        start = f"from {_checkpoint_text(ckpt, last)}" if ckpt is not None else "from scratch (no checkpoint was saved)"
        return True, f"{what} at {at}; continues {start} {to}"
    old_stop = dict(record.get("stopping_criterion") or {})
    if not new_stop:
        return False, f"finished at {at}; stays finished (no stop criteria given to continue to)"
    if _stop_met(new_stop, last):
        return False, f"finished at {at} and meets the stop ({_stop_text(new_stop)}); stays finished"
    if not _stop_met(old_stop, last):
        return False, (
            f"ended at {at} before its stop ({_stop_text(old_stop) or 'none'}) was reached "
            "(a scheduler's early stop, or the algorithm said done); stays finished"
        )
    if ckpt is None:
        return False, (
            f"finished at {at} with no checkpoint to continue from (checkpoint_config."
            "checkpoint_at_end was off); stays finished; to train it further run the "
            "experiment again without --resume (or under another --experiment-name)"
        )
    record["status"] = "PENDING"
    return True, f"finished at {at}; continuing to {_stop_text(new_stop)} from {_checkpoint_text(ckpt, last)}"


def _file_selector(fs_path: str) -> Any:
    import pyarrow.fs

    return pyarrow.fs.FileSelector(fs_path, allow_not_found=True, recursive=False)


def _latest_checkpoint(meta: Any) -> Any:
    """The trial's latest registered checkpoint result (checkpoint + its metrics), or None."""
    manager = getattr(meta, "checkpoint_manager", None)
    result = getattr(manager, "latest_checkpoint_result", None) if manager is not None else None
    return result if result is not None and getattr(result, "checkpoint", None) is not None else None


def _stop_met(stop: Dict[str, Any], last_result: Dict[str, Any]) -> bool:
    """Tune's rule for a dict ``stop`` (``Trial.should_stop``) on a saved last result: any
    criterion reached; a key the result lacks is not reached. The result's own ``done``
    flag is left out: it only says that the trial ended, not why."""
    from ray.tune.utils import flatten_dict

    flat = flatten_dict({k: v for k, v in last_result.items() if k != "done"})
    reached = [(_number(flat.get(k)), _number(v)) for k, v in stop.items()]
    return any(got is not None and limit is not None and got >= limit for got, limit in reached)


def _number(x: Any) -> Optional[float]:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _stop_text(stop: Dict[str, Any]) -> str:
    return " or ".join(f"{k} {v}" for k, v in stop.items())


def _checkpoint_text(ckpt: Any, last: Dict[str, Any]) -> str:
    """``checkpoint_000001`` (plus its iteration when older than the last result: the
    iterations after it are run again)."""
    name = os.path.basename(str(ckpt.checkpoint.path).rstrip("/"))
    it, last_it = (ckpt.metrics or {}).get("training_iteration"), last.get("training_iteration")
    if it is not None and last_it is not None and it < last_it:
        again = f"iteration {last_it} is" if it + 1 == last_it else f"iterations {it + 1}-{last_it} are"
        return f"{name} (iteration {it}; {again} run again)"
    return name


def _scheduling(exp: Experiment) -> Dict[str, Any]:
    """TuneConfig's scheduler, metric and mode from the experiment's ``scheduler:``."""
    settings = exp.scheduler or {}
    out: Dict[str, Any] = {}
    scheduler = make_scheduler(settings)
    if scheduler is not None:
        out["scheduler"] = scheduler
        knobs = ", ".join(f"{k} {settings[k]}" for k in ("max_t", "grace_period", "reduction_factor") if settings.get(k))
        print(
            f"rllib train: experiment {exp.name!r}: ASHA on {settings['metric']} ({settings['mode']})" + (f", {knobs}" if knobs else ""),
            file=sys.stderr,
        )
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
    print(
        f"rllib train: experiment {exp.name!r}: best trial {best.path} ({settings['metric']} "
        f"{settings['mode']} {'?' if value is None else format(value, '.4g')}): {chosen}",
        file=sys.stderr,
    )
