"""Experiments from an experiment file, built and checked without starting Ray.

Library side of ``rllib train file`` (:mod:`rllib_exgrpo.cli.main`):
:func:`build_experiments` reads the file (``experiment_file.py``), checks every key
(``config_keys.py``), runs the preflight checks on each search-space variant
(``preflight.py``: config values, data and model paths, optional packages, GPUs, stop
and checkpoint metric names), and returns :class:`Experiment` records;
``tune_runner.run_experiments`` runs them. Problems come back as one
:class:`CliConfigError` with one line per problem,
``<file>: experiment '<name>': <key>: <what is wrong>``, for every experiment of the file.

File schema (one file may hold several experiments; they run in file order)::

    my-experiment:                 # experiment name: Tune folder, MLflow experiment
      run: ExGRPO                  # project name | RLlib name (PPO) | pkg.mod:Class
      env: CartPole-v1             # registered name | gymnasium id | pkg.mod:Class
      stop: {training_iteration: 10}
      num_samples: 1
      storage_path: ./results      # default ./results, relative to the cwd
      checkpoint_config: {checkpoint_frequency: 5, checkpoint_at_end: true, num_to_keep: 2}
      checkpoint_freq: 5           # legacy spelling of checkpoint_config fields
      checkpoint_at_end: true
      mlflow:                      # optional: adds MLflowLoggerCallback
        tracking_uri: sqlite:///results/mlflow.db  # default sqlite:///<storage_path>/mlflow.db
        experiment_name: my-exp    # default: the experiment's name
      config:                      # AlgorithmConfig settings, by attribute name
        lr: {grid_search: [1.0e-4, 1.0e-3]}
        env_config: {difficulty: {choice: [1, 2]}}
        model_config: {fcnet_hiddens: [64]}        # the RL module's model_config (not key-checked)
        rl_module_spec:                            # optional: the RL module class
          module_class: my_pkg.modules:MyModule    # an RLModule subclass, "pkg.mod:Class"
        learner_connector: my_pkg.conn:MyPiece     # optional: config.learners(learner_connector=...)

Search spaces anywhere in ``config`` (nested dicts too): ``{grid_search: [...]}``,
``{choice: [...]}``, ``{uniform: [lo, hi]}``, ``{quniform: [lo, hi, q]}``,
``{loguniform: [lo, hi]}``, ``{qloguniform: [lo, hi, q]}``, ``{randint: [lo, hi]}``,
``{qrandint: [lo, hi, q]}``, ``{lograndint: [lo, hi]}``, ``{qlograndint: [lo, hi, q]}``,
``{randn: [mean, sd]}``, ``{qrandn: [mean, sd, q]}``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union


from rllib_exgrpo.cli.registry import CliConfigError, resolve_algorithm, resolve_env
from rllib_exgrpo.cli.config_keys import apply_config, check_config_keys, suggest
from rllib_exgrpo.cli.experiment_file import convert_search_spaces, deep_merge, is_number, load_experiment_file
from rllib_exgrpo.cli.scheduler import scheduler_settings
from rllib_exgrpo.cli.mlflow_logging import build_mlflow, make_mlflow_callback
from rllib_exgrpo.cli import preflight

logger = logging.getLogger(__name__)

#: Default for ``storage_path`` (relative to the current directory, made absolute).
DEFAULT_STORAGE_PATH = "./results"

EXPERIMENT_KEYS = (
    "run",
    "env",
    "stop",
    "config",
    "storage_path",
    "num_samples",
    "checkpoint_config",
    "checkpoint_freq",
    "checkpoint_at_end",
    "mlflow",
    "scheduler",
)

# Keys of old RLlib/Tune files that this schema spells differently (or drops).
_RENAMED_EXPERIMENT_KEYS = {
    "local_dir": "was renamed `storage_path`",
    "upload_dir": "is gone; give `storage_path` a URI (e.g. s3://bucket/path) instead",
    "keep_checkpoints_num": "is spelled `checkpoint_config: {num_to_keep: N}` now",
    "checkpoint_score_attr": "is spelled `checkpoint_config: {checkpoint_score_attribute: ...}` now",
    "resources_per_trial": "is not used: RLlib derives trial resources from `config` "
    "(num_env_runners, num_learners, num_gpus_per_learner, ...)",
    "restore": "is not supported by this command",
    "name": "is not a key: the experiment's name is its top-level key in the file",
}

CHECKPOINT_KEYS = (
    "checkpoint_frequency",
    "checkpoint_at_end",
    "num_to_keep",
    "checkpoint_score_attribute",
    "checkpoint_score_order",
)

# Old-stack result names that no longer exist in new-API-stack results.
LEGACY_STOP_KEYS = {
    "episode_reward_mean": "env_runners/episode_return_mean",
    "episode_reward_max": "env_runners/episode_return_max",
    "episode_reward_min": "env_runners/episode_return_min",
    "episode_len_mean": "env_runners/episode_len_mean",
    "timesteps_total": "num_env_steps_sampled_lifetime",
    "episodes_total": "env_runners/num_episodes_lifetime",
}

# -------------------------------------------------------------------- experiments


@dataclass
class Experiment:
    """One experiment of a file, ready for :func:`run_experiments`.

    ``config`` is the algorithm's AlgorithmConfig with the file's settings applied;
    fields under a search space hold ``ray.tune`` objects (``search_space`` lists them
    by path). ``param_space`` is what ``tune.Tuner`` receives.
    """

    name: str
    algo_cls: type
    config: Any
    stop: Dict[str, Any]
    num_samples: int
    storage_path: str
    checkpoint_config: Any  # ray.tune.CheckpointConfig
    callbacks: List[Any] = field(default_factory=list)
    search_space: Dict[str, Any] = field(default_factory=dict)
    env: Any = None
    mlflow: Optional[Dict[str, Any]] = None
    source: Optional[str] = None
    #: What preflight noticed without it being an error (shown by ``--dry-run``).
    notes: List[str] = field(default_factory=list)
    #: What may make the run differ from what its file intends (``warning: ...`` lines,
    #: printed by ``rllib train`` and its ``--dry-run``).
    warnings: List[str] = field(default_factory=list)
    #: The checked ``scheduler:`` section (``cli/scheduler.py``), or None.
    scheduler: Optional[Dict[str, Any]] = None
    #: Trials Tune runs at once (``TuneConfig.max_concurrent_trials``), set when the
    #: resources are fitted to the cluster (``tune_runner.fit_experiment_resources``).
    max_concurrent_trials: Optional[int] = None

    @property
    def param_space(self) -> Dict[str, Any]:
        """The Tune ``param_space``: the config as a dict (search-space objects kept)."""
        return self.config.to_dict()

    @property
    def num_trials(self) -> Optional[int]:
        """Trials Tune will create (grid product x num_samples)."""
        n = 1
        for dom in self.search_space.values():
            if isinstance(dom, dict) and "grid_search" in dom:
                n *= len(dom["grid_search"])
        return n * self.num_samples

    def summary(self) -> str:
        """A few human-readable lines (used by ``rllib train --dry-run``)."""
        lines = [
            f"experiment {self.name!r}" + (f" (from {self.source})" if self.source else ""),
            f"  run:           {self.algo_cls.__module__}.{self.algo_cls.__qualname__}",
            f"  env:           {self.env!r}",
            f"  stop:          {self.stop}",
            f"  num_samples:   {self.num_samples}   trials: {self.num_trials}",
            f"  storage_path:  {self.storage_path}",
            f"  checkpoints:   frequency {self.checkpoint_config.checkpoint_frequency or 'never'}, "
            f"at end: {bool(self.checkpoint_config.checkpoint_at_end)}, "
            f"keep: {self.checkpoint_config.num_to_keep or 'all'}",
        ]
        if self.mlflow:
            lines.append(f"  mlflow:        {self.mlflow['tracking_uri']} (experiment {self.mlflow['experiment_name']!r})")
        for path, dom in self.search_space.items():
            lines.append(f"  search:        {path} = {_describe_domain(dom)}")
        for note in self.notes:
            lines.append(f"  note:          {note}")
        for warning in self.warnings:
            lines.append(f"  {warning}")
        return "\n".join(lines)


def _describe_domain(dom: Any) -> str:
    if isinstance(dom, dict) and "grid_search" in dom:
        return f"grid_search({list(dom['grid_search'])!r})"
    categories = getattr(dom, "categories", None)
    if categories is not None:
        return f"choice({list(categories)!r})"
    lower, upper = getattr(dom, "lower", None), getattr(dom, "upper", None)
    sampler = getattr(dom, "sampler", None)
    kind = type(dom).__name__.lower()
    if lower is not None:
        return f"{kind}[{lower}, {upper}] ({type(sampler).__name__})"
    return repr(dom)


def _as_json_like_dict(value: Any, what: str) -> Dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CliConfigError(f"{what} must be a mapping, got {type(value).__name__}: {value!r}.")
    return value


def _resolve_storage_path(path: Optional[str]) -> str:
    path = path or DEFAULT_STORAGE_PATH
    if "://" in str(path):
        return str(path)
    return os.path.abspath(os.path.expanduser(str(path)))


def _check_stop(stop: Dict[str, Any], errors: List[str]) -> None:
    """Types and old-stack names; the names against the algorithm's metrics are checked
    per variant by ``preflight.variant_problems``."""
    for k, v in stop.items():
        if not isinstance(k, str):
            errors.append(f"stop: keys must be strings, got {k!r}.")
        elif k in LEGACY_STOP_KEYS:
            errors.append(
                f"stop: {k!r} is an old-API-stack result name that new-stack results do "
                f"not contain (Tune would fail after the first iteration); use "
                f"{LEGACY_STOP_KEYS[k]!r}."
            )
        if not is_number(v):
            errors.append(f"stop: {k!r}: value must be a number, got {v!r}.")


def _build_checkpoint_config(spec: Dict[str, Any], errors: List[str]) -> Any:
    from ray import tune

    ckpt = _as_json_like_dict(spec.get("checkpoint_config"), "checkpoint_config")
    ckpt = dict(ckpt)
    for k in ckpt:
        if k not in CHECKPOINT_KEYS:
            errors.append(f"checkpoint_config: unknown key {k!r}.{suggest(str(k), CHECKPOINT_KEYS)} Known: {', '.join(CHECKPOINT_KEYS)}.")
    for legacy, new in (("checkpoint_freq", "checkpoint_frequency"), ("checkpoint_at_end", "checkpoint_at_end")):
        if spec.get(legacy) is not None:
            if new in ckpt and ckpt[new] != spec[legacy]:
                errors.append(f"`{legacy}` ({spec[legacy]!r}) contradicts checkpoint_config.{new} ({ckpt[new]!r}).")
            ckpt[new] = spec[legacy]
    ckpt = {k: v for k, v in ckpt.items() if k in CHECKPOINT_KEYS}
    type_errors = preflight.checkpoint_problems(ckpt)
    if type_errors:
        errors += type_errors
        return tune.CheckpointConfig()
    try:
        return tune.CheckpointConfig(**ckpt)
    except Exception as e:
        errors.append(f"checkpoint_config: {e}")
        return tune.CheckpointConfig()


def build_experiments(
    source: Union[str, os.PathLike, Mapping[str, Any]],
    *,
    stop: Optional[Mapping[str, Any]] = None,
    config_overrides: Optional[Mapping[str, Any]] = None,
    storage_path: Optional[str] = None,
    num_samples: Optional[int] = None,
    experiment_name: Optional[str] = None,
    env: Optional[str] = None,
    mlflow_uri: Optional[str] = None,
    checkpoint_freq: Optional[int] = None,
    checkpoint_at_end: Optional[bool] = None,
    validate: bool = True,
    ray_address: Optional[str] = None,
    ray_num_gpus: Optional[int] = None,
    source_name: Optional[str] = None,
    dry_run: bool = False,
) -> List[Experiment]:
    """Parse and check an experiment file (path) or an already-loaded mapping.

    Nothing starts Ray. Env class paths are registered with ``register_env`` (they
    reach Ray's workers when Ray starts). Overrides apply to every experiment:
    ``stop`` is merged over each file ``stop``, ``config_overrides`` deep-merged over
    each ``config`` (and then checked like it), the others replace the file's values.
    Every experiment goes through the preflight checks (:mod:`rllib_exgrpo.cli.preflight`)
    on up to 32 variants of its search space (every value of each dimension at least
    once); ``validate`` adds ``AlgorithmConfig.validate()`` to them. GPUs are checked
    against the running Ray cluster, else ``ray_num_gpus``, else this machine; not at all
    when ``ray_address`` (or ``RAY_ADDRESS``) names a cluster to join (``tune_runner``
    checks it after joining). ``dry_run``: nothing will start here, so a package only the GPU
    nodes need (vLLM) that is missing here is a note, not an error. ``source_name`` names a
    mapping's origin in messages. Raises :class:`CliConfigError` with one line per problem of
    every experiment, each ``<file>: experiment '<name>': <key>: <problem>``.
    """
    data, src_name = _load_experiments(source, source_name, experiment_name)
    if stop is not None and not isinstance(stop, Mapping):
        raise CliConfigError(f"--stop must be a JSON object, got {stop!r}.")
    if config_overrides is not None and not isinstance(config_overrides, Mapping):
        raise CliConfigError(f"--config must be a JSON object, got {config_overrides!r}.")
    shared = dict(
        src_name=src_name,
        stop=stop,
        config_overrides=config_overrides,
        storage_path=storage_path,
        num_samples=num_samples,
        env_override=env,
        mlflow_uri=mlflow_uri,
        checkpoint_freq=checkpoint_freq,
        checkpoint_at_end=checkpoint_at_end,
        validate=validate,
        cluster=_cluster(ray_address, ray_num_gpus),
        dry_run=dry_run,
    )
    return _build_all(data, experiment_name, shared)


def _build_all(data: Dict[str, Any], experiment_name: Optional[str], shared: Dict[str, Any]) -> List[Experiment]:
    """Every experiment of ``data`` in file order (the one renamed to ``experiment_name`` when
    given), each built with the ``shared`` options. A failing experiment does not stop the
    others: the problems of all of them come back together as one :class:`CliConfigError`."""
    experiments: List[Experiment] = []
    problems: List[str] = []
    for name, spec in data.items():
        try:
            experiments.append(_build_one(str(experiment_name if experiment_name is not None else name), spec, **shared))
        except CliConfigError as e:
            problems.append(str(e))
    if problems:
        raise CliConfigError("\n".join(problems))
    return experiments


def _load_experiments(
    source: Union[str, os.PathLike, Mapping[str, Any]], source_name: Optional[str], experiment_name: Optional[str]
) -> Tuple[Dict[str, Any], Optional[str]]:
    """``(experiments by name, the source's name for messages)`` of a file path or a
    loaded mapping; :class:`CliConfigError` when it holds none, or several while
    ``experiment_name`` renames one."""
    src_name: Optional[str] = source_name
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        src_name = str(source)
        try:
            data = load_experiment_file(source)
        except CliConfigError as e:
            raise CliConfigError(preflight.one_line(str(e))) from None
    if not data:
        raise CliConfigError(f"{src_name or 'experiments'}: no experiments given.")
    if experiment_name is not None and len(data) != 1:
        raise CliConfigError(
            f"--experiment-name renames one experiment, but {src_name or 'the input'} holds {len(data)}: {', '.join(map(str, data))}."
        )
    return data, src_name


def _cluster(ray_address: Optional[str], ray_num_gpus: Optional[int]) -> Optional[preflight.Cluster]:
    try:
        return preflight.Cluster.detect(ray_address=ray_address, num_gpus=ray_num_gpus)
    except Exception:  # noqa: BLE001 - no resource check rather than no run
        logger.debug("could not detect the resources to check against", exc_info=True)
        return None


class _Invalid(Exception):
    """Problems that stop building an experiment (collected, then reported together)."""

    def __init__(self, errors: Iterable[str]):
        super().__init__()
        self.errors = list(errors)


def _stop_if(errors: Sequence[str]) -> None:
    if errors:
        raise _Invalid(errors)


@contextlib.contextmanager
def _as_invalid():
    """A ``CliConfigError`` from a resolver becomes one of this experiment's problems."""
    try:
        yield
    except CliConfigError as e:
        raise _Invalid([str(e)]) from None


def _build_one(name: str, spec: Any, *, src_name: Optional[str], **options: Any) -> Experiment:
    """One experiment, or a ``CliConfigError`` with one line per problem, each naming the
    file and the experiment. A crash inside a check is one such line too, not a traceback."""
    prefix = f"{src_name}: experiment {name!r}" if src_name else f"experiment {name!r}"
    try:
        return _build_checked(name, spec, src_name=src_name, **options)
    except _Invalid as e:
        errors = e.errors
    except CliConfigError as e:
        errors = [str(e)]
    except Exception as e:  # noqa: BLE001 - one line naming the failing check, no traceback
        frame = traceback.extract_tb(e.__traceback__)[-1]
        errors = [f"could not be checked: {type(e).__name__}: {e} (in {frame.name}() at {os.path.basename(frame.filename)}:{frame.lineno})"]
    lines = list(dict.fromkeys(preflight.one_line(m) for m in errors))
    raise CliConfigError("\n".join(f"{prefix}: {m}" for m in lines)) from None


def _build_checked(
    name: str,
    spec: Any,
    *,
    src_name: Optional[str],
    stop: Optional[Mapping[str, Any]],
    config_overrides: Optional[Mapping[str, Any]],
    storage_path: Optional[str],
    num_samples: Optional[int],
    env_override: Optional[str],
    mlflow_uri: Optional[str],
    checkpoint_freq: Optional[int],
    checkpoint_at_end: Optional[bool],
    validate: bool,
    cluster: Optional[preflight.Cluster],
    dry_run: bool = False,
) -> Experiment:
    """The experiment's whole check in order, collecting what it can: keys, algorithm, run
    settings (stop, samples, storage, checkpoints, MLflow; :func:`_run_settings`), then the
    config (:func:`_checked_user_config`) and the preflight of each search-space variant."""
    if not isinstance(spec, dict):
        raise _Invalid([f"expected a mapping with `run`, `env`, `config`, ..., got {type(spec).__name__}."])
    errors: List[str] = _experiment_key_errors(spec)
    algo_cls, config, algo_name = _algorithm_of(spec, errors)
    run = _run_settings(
        name,
        spec,
        stop=stop,
        num_samples=num_samples,
        storage_path=storage_path,
        checkpoint_freq=checkpoint_freq,
        checkpoint_at_end=checkpoint_at_end,
        mlflow_uri=mlflow_uri,
        errors=errors,
    )
    if algo_cls is None:
        raise _Invalid(errors)
    config, found, env, notes = _checked_config(
        spec, config, algo_cls, algo_name, run, config_overrides, env_override, validate, cluster, dry_run, errors
    )
    _stop_if(errors)
    return Experiment(
        name=name,
        algo_cls=algo_cls,
        config=config,
        stop=run.stop,
        num_samples=run.num_samples,
        storage_path=run.storage,
        checkpoint_config=run.checkpoint_config,
        callbacks=[make_mlflow_callback(run.mlflow)] if run.mlflow else [],
        search_space=found,
        env=env,
        mlflow=run.mlflow,
        source=src_name,
        notes=notes,
        scheduler=run.scheduler,
        warnings=preflight.learner_change_warnings(config, spec.get("config"), config_overrides, found),
    )


def _checked_config(
    spec: Mapping[str, Any],
    config: Any,
    algo_cls: type,
    algo_name: str,
    run: _RunSettings,
    config_overrides: Optional[Mapping[str, Any]],
    env_override: Optional[str],
    validate: bool,
    cluster: Optional[preflight.Cluster],
    dry_run: bool,
    errors: List[str],
) -> Tuple[Any, Dict[str, Any], Any, List[str]]:
    """The config stage of :func:`_build_checked`: the user's config checked key by key
    (:func:`_checked_user_config`) and applied to a fresh default config, then the preflight of
    each search-space variant (against the run's metric stop criteria and checkpoint score
    attribute) and the scheduler's metric. ``(config, search space, env, notes)``; the
    problems go to ``errors``."""
    ckpt_block = spec.get("checkpoint_config")
    score_attribute = ckpt_block.get("checkpoint_score_attribute") if isinstance(ckpt_block, dict) else None
    metric_names = [k for k in run.stop if isinstance(k, str) and k not in LEGACY_STOP_KEYS]
    user_config, found, env = _checked_user_config(spec, config, algo_cls, algo_name, config_overrides, env_override, metric_names, errors)
    notes = preflight.absolute_paths(user_config)
    config = _config_of(algo_cls, user_config, env, errors)
    variant_errors, variant_notes = preflight.check_variants(
        algo_cls,
        user_config,
        env,
        found,
        apply_config=apply_config,
        validate=validate,
        cluster=cluster,
        stop={k: run.stop[k] for k in metric_names},
        score_attribute=score_attribute,
        dry_run=dry_run,
    )
    errors += variant_errors
    errors += _scheduler_problems(run.scheduler, algo_cls, config, found)
    return config, found, env, notes + variant_notes


def _algorithm_of(spec: Mapping[str, Any], errors: List[str]) -> Tuple[Optional[type], Any, Optional[str]]:
    """(algorithm class, its default config, its name as written) for the experiment's ``run:``;
    ``(None, None, None)`` when ``run:`` is missing (a key error already) or names no usable
    algorithm, whose problems go to ``errors``."""
    algo_cls = config = algo_name = None
    if "run" in spec:
        try:
            algo_cls, config, algo_name = _default_config(spec["run"])
        except _Invalid as e:
            errors += e.errors
    return algo_cls, config, algo_name


def _scheduler_problems(scheduler: Optional[Mapping[str, Any]], algo_cls: type, config: Any, found: Mapping[str, Any]) -> List[str]:
    """The problems of the ``scheduler:`` section's metric: one the algorithm does not report,
    else (only then) ASHA ranking trials on held-out accuracy before it is measured."""
    problems: List[str] = []
    if scheduler and isinstance(scheduler.get("metric"), str):
        msg = preflight.metric_problem(scheduler["metric"], algo_cls, config, "scheduler.metric")
        problems += [msg] if msg else []
        msg = None if msg else heldout_grace_problem(scheduler, config, found)
        problems += [msg] if msg else []
    return problems


#: ASHA's ``grace_period`` when the ``scheduler:`` section leaves it out (``ASHAScheduler``).
ASHA_DEFAULT_GRACE_PERIOD = 1


def heldout_grace_problem(scheduler: Mapping[str, Any], config: Any, found: Mapping[str, Any]) -> Optional[str]:
    """ASHA comparing trials on a ``heldout/*`` metric before the first held-out evaluation
    after training: held-out accuracy is measured before training and every
    ``heldout_interval`` iterations, and each result carries the last measurement; with
    ``heldout_interval`` longer than ``grace_period`` ASHA's first rung (iteration
    ``grace_period``) would compare every trial on the accuracy of the model they all started
    from, and stop trials at random. One line naming both keys, or None."""
    metric = scheduler.get("metric")
    if scheduler.get("type") != "asha" or not isinstance(metric, str) or not metric.startswith("heldout/"):
        return None
    if scheduler.get("time_attr", "training_iteration") != "training_iteration":
        return None  # rungs in another unit: not comparable with iterations
    if not hasattr(config, "heldout_interval"):
        return None
    grace = scheduler.get("grace_period") or ASHA_DEFAULT_GRACE_PERIOD
    dom = found.get("config/heldout_interval")
    values = preflight._domain_values(dom) if dom is not None else [config.heldout_interval]
    ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    if not ints:
        return None
    worst = 0 if 0 in ints else max(ints)
    if worst and worst <= grace:
        return None
    given = "" if scheduler.get("grace_period") else f" (ASHA's default {ASHA_DEFAULT_GRACE_PERIOD})"
    when = (
        "is measured only before training (heldout_interval 0)"
        if worst == 0
        else f"is measured before training and every {worst} iterations"
    )
    return (
        f"scheduler.grace_period: ASHA compares trials on {metric} from iteration {grace}{given}, "
        f"but it {when}: the first comparison would rank every trial by the model they all started "
        f"from; set config.heldout_interval <= scheduler.grace_period (heldout_interval: {grace}"
        + (f", or grace_period: {worst}" if worst else "")
        + ")."
    )


@dataclass
class _RunSettings:
    """What an experiment sets outside its config (checked without one)."""

    stop: Dict[str, Any]
    num_samples: int
    storage: Any
    checkpoint_config: Any
    mlflow: Any
    scheduler: Any


def _run_settings(
    name: str,
    spec: Mapping[str, Any],
    *,
    stop: Optional[Mapping[str, Any]],
    num_samples: Optional[int],
    storage_path: Optional[str],
    checkpoint_freq: Optional[int],
    checkpoint_at_end: Optional[bool],
    mlflow_uri: Optional[str],
    errors: List[str],
) -> _RunSettings:
    """The run settings of ``spec`` with the command line's overrides: stop (the file's,
    updated by ``stop``), samples, storage, checkpoints, MLflow and the scheduler; their
    problems are added to ``errors`` (a bad value gets a neutral one here)."""
    try:
        with _as_invalid():
            stop_dict = preflight.flatten_stop(dict(_as_json_like_dict(spec.get("stop"), "stop")))
    except _Invalid as e:
        errors += e.errors
        stop_dict = {}
    stop_dict.update(preflight.flatten_stop(stop or {}))
    _check_stop(stop_dict, errors)
    n = num_samples if num_samples is not None else spec.get("num_samples", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        errors.append(f"num_samples must be a positive integer, got {n!r}.")
        n = 1
    if spec.get("storage_path") is not None and not isinstance(spec["storage_path"], str):
        errors.append(f"storage_path must be a string, got {spec['storage_path']!r}.")
    storage = _resolve_storage_path(storage_path or spec.get("storage_path"))
    errors += preflight.storage_problems(storage)
    checkpoint_config = _checkpoint_settings(spec, checkpoint_freq, checkpoint_at_end, errors)
    mlflow_settings = build_mlflow(name, spec, storage, mlflow_uri, errors)
    errors += preflight.mlflow_problems(mlflow_settings)
    scheduler = scheduler_settings(spec.get("scheduler"), errors)
    return _RunSettings(stop_dict, n, storage, checkpoint_config, mlflow_settings, scheduler)


def _checked_user_config(
    spec: Mapping[str, Any],
    config: Any,
    algo_cls: type,
    algo_name: str,
    config_overrides: Optional[Mapping[str, Any]],
    env_override: Optional[str],
    metric_names: List[str],
    errors: List[str],
) -> Tuple[Dict[str, Any], Dict[str, Any], Any]:
    """``(user config, search space, env)`` with every bad key reported in ``errors`` and
    left out, so that the rest of the config is still checked; each key is applied to
    ``config`` (the algorithm's default config) as it is checked. ``env`` is None where it
    cannot be resolved. A config that cannot be read at all raises :class:`_Invalid`."""
    try:
        user_config, found = _user_config(spec, config_overrides)
    except _Invalid as e:
        raise _Invalid(errors + e.errors + preflight.stop_problems_without_config(algo_cls, metric_names)) from None
    env = _experiment_env(spec, user_config, env_override, found, errors)
    bad_keys = set()
    for key, value in user_config.items():
        key_errors = check_config_keys(config, {key: value}, algo_name)
        key_errors = key_errors or apply_config(config, {key: value})
        if key_errors:
            bad_keys.add(key)
            errors += key_errors
    if bad_keys:
        user_config = {k: v for k, v in user_config.items() if k not in bad_keys}
        found = {p: d for p, d in found.items() if p.split("/")[1] not in bad_keys}
    try:
        env = _resolved_env(env, found)
    except _Invalid as e:
        errors += e.errors
        env = None
    return user_config, found, env


def _config_of(algo_cls: type, user_config: Dict[str, Any], env: Any, errors: List[str]) -> Any:
    """A fresh default config of ``algo_cls`` with the good keys (paths already made
    absolute) and ``env``; raises :class:`_Invalid` if it switches the new API stack off."""
    config = algo_cls.get_default_config()
    errors += apply_config(config, user_config)
    if env is not None:
        config.env = env
    if not (config.enable_rl_module_and_learner and config.enable_env_runner_and_connector_v2):
        raise _Invalid(errors + ["the config switches RLlib's new API stack off; this command runs the new API stack only."])
    return config


def _experiment_key_errors(spec: Mapping[str, Any]) -> List[str]:
    errors = []
    for key in spec:
        if key in EXPERIMENT_KEYS:
            continue
        if key in _RENAMED_EXPERIMENT_KEYS:
            errors.append(f"`{key}` {_RENAMED_EXPERIMENT_KEYS[key]}.")
        else:
            errors.append(f"unknown key `{key}`.{suggest(str(key), EXPERIMENT_KEYS)} Known keys: {', '.join(EXPERIMENT_KEYS)}.")
    if "run" not in spec:
        errors.append("missing `run` (an algorithm name such as ExGRPO or PPO, or 'pkg.mod:Class').")
    return errors


def _default_config(run: Any) -> Tuple[type, Any, str]:
    """(algorithm class, its default config, its name as written) for ``run:``."""
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

    with _as_invalid():
        algo_cls = resolve_algorithm(run)
    config = algo_cls.get_default_config()
    if not isinstance(config, AlgorithmConfig):
        raise _Invalid([f"{algo_cls.__name__}.get_default_config() must return an AlgorithmConfig, got {type(config).__name__}."])
    if not (config.enable_rl_module_and_learner and config.enable_env_runner_and_connector_v2):
        raise _Invalid([f"{algo_cls.__name__}'s default config is on RLlib's old API stack; this command runs the new API stack only."])
    return algo_cls, config, str(run) if isinstance(run, str) else algo_cls.__name__


def _user_config(spec: Mapping[str, Any], overrides: Optional[Mapping[str, Any]]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The ``config:`` dict (file, then command-line overrides) with its search spaces
    converted to Tune domains, and those domains by path."""
    with _as_invalid():
        user_config = _as_json_like_dict(spec.get("config"), "config")
        user_config = deep_merge(user_config, overrides) if overrides else copy.deepcopy(user_config)
        user_config, found = convert_search_spaces(user_config)
    _stop_if(
        [
            f"{p}: search spaces cannot sit inside `rl_module_spec` (Tune does not look into an "
            "RLModuleSpec); put them under the top-level `model_config`, which the module spec's "
            "model_config is merged over."
            for p in sorted(found)
            if p.startswith("config/rl_module_spec/")
        ]
    )
    return user_config, found


def _experiment_env(spec, user_config, env_override, found, errors: List[str]) -> Any:
    """The env as written: ``--env`` over the top-level ``env`` over ``config.env``."""
    env = user_config.pop("env", None)
    if spec.get("env") is not None:
        if env is not None and env != spec["env"]:
            errors.append(
                f"`env` ({spec['env']!r}) and `config.env` ({env!r}) disagree; give one (on the command line, override with --env)."
            )
        env = spec["env"]
    if env_override is not None:
        env = env_override
    found.pop("config/env", None)
    return env


def _resolved_env(env: Any, found: Dict[str, Any]) -> Any:
    """The env as RLlib takes it (a grid search over envs stays a search space)."""
    with _as_invalid():
        if isinstance(env, dict) and len(env) == 1 and next(iter(env)) == "grid_search":
            env = {"grid_search": [resolve_env(e) for e in env["grid_search"]]}
            found["config/env"] = env
            return env
        return resolve_env(env)


def _checkpoint_settings(spec, checkpoint_freq, checkpoint_at_end, errors: List[str]) -> Any:
    ckpt_spec = dict(spec)
    if checkpoint_freq is not None:
        ckpt_spec["checkpoint_freq"] = checkpoint_freq
    if checkpoint_at_end is not None:
        ckpt_spec["checkpoint_at_end"] = checkpoint_at_end
    try:
        return _build_checkpoint_config(ckpt_spec, errors)
    except CliConfigError as e:
        errors.append(str(e))
        return None


# ------------------------------------------------------------------------ running
