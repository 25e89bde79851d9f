"""Classic RLlib experiment files, run on RLlib's new API stack through Ray Tune.

Library side of the ``rllib`` command (:mod:`rllib_exgrpo.cli.main`):

* :func:`load_experiment_file` reads a YAML file (strictly: duplicate keys are errors,
  and ``1e-3`` is a float as in YAML 1.2, not the string PyYAML makes of it);
* :func:`build_experiments` does all parsing and validation **without starting Ray**
  and returns :class:`Experiment` records;
* :func:`run_experiments` starts (or joins) Ray and runs them one after another with
  ``tune.Tuner``.

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
import difflib
import inspect
import logging
import math
import os
import sys
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import yaml

from rllib_exgrpo.cli.registry import CliConfigError, import_object, resolve_algorithm, resolve_env

__all__ = [
    "CliConfigError",
    "Experiment",
    "ExperimentResult",
    "build_experiments",
    "convert_search_spaces",
    "deep_merge",
    "load_experiment_file",
    "run_experiments",
    "DEFAULT_STORAGE_PATH",
]

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

MLFLOW_KEYS = (
    "tracking_uri",
    "experiment_name",
    "tags",
    "save_artifact",
    "log_params_on_trial_end",
    "registry_uri",
)

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

# Config keys that the new API stack cannot honour.
_OLD_STACK_SWITCHES = ("enable_rl_module_and_learner", "enable_env_runner_and_connector_v2")

# Extra config keys besides the AlgorithmConfig attributes (translated in _apply_key).
_EXTRA_CONFIG_KEYS = ("multiagent", "model_config", "learner_class", "learner_connector", "rl_module_spec")
# Keys of a YAML `rl_module_spec:` mapping (RLModuleSpec fields that a file can give).
RL_MODULE_SPEC_KEYS = ("module_class", "model_config", "catalog_class")
# The legacy aliases that AlgorithmConfig._translate_special_keys maps (2.60).
_ALIAS_KEYS = (
    "callbacks",
    "create_env_on_driver",
    "custom_eval_function",
    "framework",
    "input",
    "lambda",
    "num_cpus_for_driver",
    "num_workers",
)
_MULTIAGENT_KEYS = (
    "policies",
    "policy_map_capacity",
    "policy_mapping_fn",
    "policies_to_train",
    "policy_states_are_swappable",
    "observation_fn",
    "count_steps_by",
)

# Search-space specs: name -> (tune function name, allowed argument counts).
SEARCH_SPACES: Dict[str, Tuple[str, Tuple[int, ...]]] = {
    "grid_search": ("grid_search", ()),
    "choice": ("choice", ()),
    "uniform": ("uniform", (2,)),
    "quniform": ("quniform", (3,)),
    "loguniform": ("loguniform", (2, 3)),
    "qloguniform": ("qloguniform", (3, 4)),
    "randint": ("randint", (2,)),
    "qrandint": ("qrandint", (2, 3)),
    "lograndint": ("lograndint", (2, 3)),
    "qlograndint": ("qlograndint", (3, 4)),
    "randn": ("randn", (0, 1, 2)),
    "qrandn": ("qrandn", (3,)),
}

_MAX_VALIDATED_VARIANTS = 32


# --------------------------------------------------------------------------- YAML


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads ``1e-3`` as a float."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:  # unhashable key: let the base constructor complain
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_experiment_file(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """Read an experiment YAML file into ``{name: spec}`` (no validation beyond YAML)."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:  # a file object: marks name the file
            data = yaml.load(f, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except OSError as e:
        raise CliConfigError(f"cannot read experiment file {str(path)!r}: {e}") from e
    except yaml.YAMLError as e:
        raise CliConfigError(f"{path}: invalid YAML: {e}") from e
    if data is None:
        raise CliConfigError(f"{path}: the file holds no experiments.")
    if not isinstance(data, dict):
        raise CliConfigError(f"{path}: expected a mapping {{experiment_name: {{run: ..., ...}}}}, got {type(data).__name__}.")
    return data


# ------------------------------------------------------------------ search spaces


def _is_search_space(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and next(iter(value)) in SEARCH_SPACES


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _make_domain(kind: str, args: Any, where: str) -> Any:
    from ray import tune

    fn_name, arities = SEARCH_SPACES[kind]
    if kind in ("grid_search", "choice"):
        if not isinstance(args, list) or not args:
            raise CliConfigError(f"{where}: `{kind}` needs a non-empty list, got {args!r}.")
        return getattr(tune, fn_name)(list(args))
    if not isinstance(args, list) or len(args) not in arities or not all(_is_number(a) for a in args):
        shape = " or ".join(str(n) for n in arities)
        raise CliConfigError(f"{where}: `{kind}` needs a list of {shape} numbers, got {args!r}.")
    if kind in ("randint", "qrandint", "lograndint", "qlograndint") and not all(
        isinstance(a, int) for a in args[:2]
    ):
        raise CliConfigError(f"{where}: `{kind}` bounds must be integers, got {args!r}.")
    if kind not in ("randn", "qrandn"):
        lo, hi = args[0], args[1]
        if not lo < hi:
            raise CliConfigError(f"{where}: `{kind}` needs lower < upper, got {args!r}.")
        if kind.startswith(("log", "qlog")) and lo <= 0:
            raise CliConfigError(f"{where}: `{kind}` needs a positive lower bound, got {args!r}.")
    try:
        return getattr(tune, fn_name)(*args)
    except Exception as e:  # tune's own checks
        raise CliConfigError(f"{where}: `{kind}` {args!r}: {e}") from e


def convert_search_spaces(value: Any, path: str = "config") -> Tuple[Any, Dict[str, Any]]:
    """Turn ``{grid_search: [...]}``-style dicts (at any dict depth) into ``ray.tune`` objects.

    Returns ``(converted_value, {"config/a/b": tune_object, ...})``. Lists are not
    searched (the values of a ``grid_search`` are taken literally).
    """
    found: Dict[str, Any] = {}
    if _is_search_space(value):
        kind, args = next(iter(value.items()))
        dom = _make_domain(kind, args, path)
        found[path] = dom
        return dom, found
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out[k], sub = convert_search_spaces(v, f"{path}/{k}")
            found.update(sub)
        return out, found
    return value, found


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> Dict[str, Any]:
    """Merge ``override`` into a copy of ``base``: dicts merge recursively; any other
    value (and any search-space dict, on either side) replaces."""
    out = copy.deepcopy(dict(base))
    for k, v in override.items():
        if (
            isinstance(v, dict)
            and isinstance(out.get(k), dict)
            and not _is_search_space(v)
            and not _is_search_space(out[k])
        ):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# -------------------------------------------------------------- config key checks


def _translate(config_cls: type, key: str) -> str:
    try:
        return config_cls._translate_special_keys(key, warn_deprecated=False)
    except Exception:  # pragma: no cover - defensive
        return key


def _deprecation_message(config_cls: type, key: str) -> Optional[str]:
    try:
        config_cls._translate_special_keys(key, warn_deprecated=True)
    except Exception as e:
        return str(e)
    return None


_CANDIDATES_CACHE: Dict[type, List[str]] = {}
_DEPRECATED_CACHE: Dict[type, frozenset] = {}
_DEPRECATED_RE = re.compile(r"self\.(\w+)\s*=\s*DEPRECATED_VALUE\b")


def _deprecated_attributes(cls: type) -> frozenset:
    """Attributes that ``cls`` or a base assigns ``DEPRECATED_VALUE`` (read from the
    source: the value is -1, which a real setting may also hold)."""
    if cls not in _DEPRECATED_CACHE:
        names = set()
        for klass in cls.__mro__:
            if klass is object:
                continue
            try:
                names.update(_DEPRECATED_RE.findall(inspect.getsource(klass)))
            except (OSError, TypeError):
                continue
        _DEPRECATED_CACHE[cls] = frozenset(names)
    return _DEPRECATED_CACHE[cls]


def _candidate_keys(config: Any) -> List[str]:
    """Settable, non-deprecated keys of ``config`` (for "did you mean" hints)."""
    cls = type(config)
    if cls in _CANDIDATES_CACHE:
        return _CANDIDATES_CACHE[cls]
    deprecated = _deprecated_attributes(cls)
    keys = [k for k in vars(config) if not k.startswith("_") and k not in deprecated]
    probe = copy.copy(config)
    for name, attr in inspect.getmembers(cls, lambda a: isinstance(a, property)):
        if name.startswith("_") or attr.fset is None:
            continue
        try:  # deprecated properties raise in their setter
            setattr(probe, name, getattr(probe, name))
        except Exception:
            continue
        keys.append(name)
    keys += list(_ALIAS_KEYS) + list(_EXTRA_CONFIG_KEYS)
    _CANDIDATES_CACHE[cls] = sorted(set(keys))
    return _CANDIDATES_CACHE[cls]


def _suggest(key: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
    return f" Did you mean: {', '.join(repr(c) for c in close)}?" if close else ""


def _check_config_keys(config: Any, user_config: Mapping[str, Any], algo_name: str) -> List[str]:
    """Return one message per bad top-level key of ``user_config``."""
    cls = type(config)
    deprecated = _deprecated_attributes(cls)
    errors: List[str] = []
    for key, value in user_config.items():
        where = f"config key {key!r}"
        if not isinstance(key, str):
            errors.append(f"{where}: keys must be strings.")
            continue
        if key in _OLD_STACK_SWITCHES:
            if value is not True:
                errors.append(
                    f"{where}: {value!r}: this command runs RLlib's new API stack only "
                    "(RLModule, Learner, EnvRunner, ConnectorV2); remove the key."
                )
            continue
        if key in ("_enable_new_api_stack", "api_stack"):
            errors.append(
                f"{where}: this command always runs RLlib's new API stack; remove the key."
            )
            continue
        if key == "framework" and value not in ("torch", None):
            errors.append(f"{where}: {value!r}: the new API stack supports only 'torch'.")
            continue
        if key == "multiagent":
            if not isinstance(value, dict):
                errors.append(f"{where}: must be a mapping.")
                continue
            for sub in value:
                if sub not in _MULTIAGENT_KEYS:
                    errors.append(
                        f"config key 'multiagent/{sub}': unknown.{_suggest(str(sub), _MULTIAGENT_KEYS)} "
                        f"Known: {', '.join(_MULTIAGENT_KEYS)}."
                    )
            continue
        if key in ("model_config", "learner_class"):
            continue
        if key == "learner_connector":
            if value is not None and not (isinstance(value, str) and _looks_like_class_path(value)):
                errors.append(
                    f"{where}: must be a 'pkg.mod:Callable' path (a ConnectorV2 class or a "
                    f"function (obs_space, action_space) -> ConnectorV2 piece(s)), got {value!r}."
                )
            continue
        if key == "rl_module_spec":
            errors += _check_rl_module_spec(value, where)
            continue
        name = _translate(cls, key)
        static = inspect.getattr_static(cls, name, None)
        if isinstance(static, property):
            if static.fset is None:
                errors.append(f"{where}: is a read-only property of {cls.__name__}.")
                continue
            try:  # deprecated properties raise in their setter
                static.fset(copy.copy(config), value)
            except Exception as e:
                errors.append(f"{where}: {e}")
            continue
        if name in vars(config):
            if name in deprecated:
                msg = _deprecation_message(cls, key)
                errors.append(
                    f"{where}: is deprecated and has no effect in RLlib 2.60"
                    + (f" ({msg})" if msg else "")
                    + "."
                    + _suggest(key, _candidate_keys(config))
                )
            continue
        if static is not None and callable(static):
            errors.append(
                f"{where}: is a method of {cls.__name__}, not a setting. Write its "
                f"arguments directly under `config:` (e.g. `lr: 0.001` instead of "
                f"`training: {{lr: 0.001}}`)."
            )
            continue
        errors.append(
            f"{where}: unknown setting for {algo_name} ({cls.__name__}).{_suggest(key, _candidate_keys(config))}"
        )
    return errors


def _looks_like_class_path(value: str) -> bool:
    return bool(value) and (":" in value or "." in value) and not value.startswith((".", ":"))


def _check_rl_module_spec(value: Any, where: str) -> List[str]:
    """Messages for a YAML ``rl_module_spec:`` mapping (RLModuleSpec fields by name)."""
    if not isinstance(value, dict):
        return [
            f"{where}: must be a mapping with keys {', '.join(RL_MODULE_SPEC_KEYS)} "
            f"(e.g. {{module_class: 'my_pkg.modules:MyModule'}}), got {value!r}."
        ]
    errors = []
    for sub, v in value.items():
        if sub not in RL_MODULE_SPEC_KEYS:
            errors.append(
                f"config key 'rl_module_spec/{sub}': unknown.{_suggest(str(sub), RL_MODULE_SPEC_KEYS)} "
                f"Known: {', '.join(RL_MODULE_SPEC_KEYS)}."
            )
        elif sub in ("module_class", "catalog_class"):
            if not (isinstance(v, str) and _looks_like_class_path(v)):
                errors.append(f"config key 'rl_module_spec/{sub}': must be a 'pkg.mod:Class' path, got {v!r}.")
        elif sub == "model_config" and not isinstance(v, dict):
            errors.append(f"config key 'rl_module_spec/model_config': must be a mapping, got {v!r}.")
    return errors


def _build_rl_module_spec(value: Mapping[str, Any]) -> Any:
    """A YAML ``rl_module_spec:`` mapping -> ``RLModuleSpec`` (classes imported, checked)."""
    from ray.rllib.core.rl_module.rl_module import RLModule, RLModuleSpec

    kwargs: Dict[str, Any] = {}
    for sub in ("module_class", "catalog_class"):
        if value.get(sub) is not None:
            try:
                kwargs[sub] = import_object(value[sub])
            except (ImportError, AttributeError) as e:
                raise CliConfigError(f"rl_module_spec/{sub}: cannot import {value[sub]!r}: {type(e).__name__}: {e}") from e
    module_class = kwargs.get("module_class")
    if module_class is not None and not (isinstance(module_class, type) and issubclass(module_class, RLModule)):
        raise CliConfigError(f"rl_module_spec/module_class: {value['module_class']!r} is not an RLModule subclass.")
    if value.get("model_config") is not None:
        kwargs["model_config"] = dict(value["model_config"])
    return RLModuleSpec(**kwargs)


def _apply_key(config: Any, key: str, value: Any) -> None:
    """Set one YAML config entry on an AlgorithmConfig (the update_from_dict way, plus
    the few keys it cannot set: ``model_config``, ``learner_class``, ``learner_connector``,
    ``rl_module_spec``, class paths)."""
    if isinstance(value, str) and (key.endswith(("_cls", "_class")) or key == "callbacks"):
        if ":" in value or "." in value:
            try:
                value = import_object(value)
            except (ImportError, AttributeError) as e:
                raise CliConfigError(f"cannot import {value!r}: {type(e).__name__}: {e}") from e
    if key == "model_config":
        config.rl_module(model_config=value)
    elif key == "rl_module_spec":
        config.rl_module(rl_module_spec=_build_rl_module_spec(value))
    elif key == "learner_connector":
        if isinstance(value, str):
            try:
                value = import_object(value)
            except (ImportError, AttributeError) as e:
                raise CliConfigError(f"cannot import {value!r}: {type(e).__name__}: {e}") from e
            if not callable(value):
                raise CliConfigError(f"{value!r} is not callable (a ConnectorV2 class or builder function).")
        config.learners(learner_connector=value)
    elif key == "learner_class":
        config.training(learner_class=value)
    else:
        config.update_from_dict({key: value})


def _apply_config(config: Any, user_config: Mapping[str, Any]) -> List[str]:
    errors = []
    for key, value in user_config.items():
        try:
            _apply_key(config, key, value)
        except Exception as e:
            errors.append(f"config key {key!r}: {type(e).__name__}: {e}")
    return errors


@contextlib.contextmanager
def _quiet_rllib_logs():
    lg = logging.getLogger("ray.rllib")
    old = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(old)


def _validate_variants(
    algo_cls: type, user_config: Dict[str, Any], env: Any, found: Dict[str, Any]
) -> List[str]:
    """Run ``AlgorithmConfig.validate()`` on (up to 32) resolved variants of the search space."""
    from ray.tune.search.variant_generator import generate_variants

    if found:
        variants = []
        for i, (assignment, resolved) in enumerate(generate_variants(copy.deepcopy(user_config))):
            if i >= _MAX_VALIDATED_VARIANTS:
                break
            desc = ", ".join(f"{'/'.join(map(str, k))}={v!r}" for k, v in assignment.items())
            variants.append((desc, resolved))
    else:
        variants = [("", user_config)]
    errors: List[str] = []
    for desc, resolved in variants:
        cfg = algo_cls.get_default_config()
        apply_errors = _apply_config(cfg, resolved)
        where = f" (variant {desc})" if desc else ""
        if apply_errors:
            errors += [e + where for e in apply_errors]
            continue
        if env is not None:
            cfg.env = env
        try:
            with _quiet_rllib_logs():
                cfg.validate()
        except Exception as e:
            msg = f"invalid config{where}: {type(e).__name__}: {e}"
            if not isinstance(e, ValueError):  # a crash inside validate(), not a verdict
                frame = traceback.extract_tb(e.__traceback__)[-1]
                msg += (
                    f" (raised in {frame.name}() at {frame.filename}:{frame.lineno}; "
                    "`rllib train --no-validate` / validate=False skips this check)"
                )
            if msg not in errors:
                errors.append(msg)
    return errors


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
    for k, v in stop.items():
        if not isinstance(k, str):
            errors.append(f"stop: keys must be strings, got {k!r}.")
        elif k in LEGACY_STOP_KEYS:
            errors.append(
                f"stop: {k!r} is an old-API-stack result name that new-stack results do "
                f"not contain (Tune would fail after the first iteration); use "
                f"{LEGACY_STOP_KEYS[k]!r}."
            )
        if not _is_number(v):
            errors.append(f"stop: {k!r}: value must be a number, got {v!r}.")


def _build_checkpoint_config(spec: Dict[str, Any], errors: List[str]) -> Any:
    from ray import tune

    ckpt = _as_json_like_dict(spec.get("checkpoint_config"), "checkpoint_config")
    ckpt = dict(ckpt)
    for k in ckpt:
        if k not in CHECKPOINT_KEYS:
            errors.append(
                f"checkpoint_config: unknown key {k!r}.{_suggest(str(k), CHECKPOINT_KEYS)} "
                f"Known: {', '.join(CHECKPOINT_KEYS)}."
            )
    for legacy, new in (("checkpoint_freq", "checkpoint_frequency"), ("checkpoint_at_end", "checkpoint_at_end")):
        if spec.get(legacy) is not None:
            if new in ckpt and ckpt[new] != spec[legacy]:
                errors.append(f"`{legacy}` ({spec[legacy]!r}) contradicts checkpoint_config.{new} ({ckpt[new]!r}).")
            ckpt[new] = spec[legacy]
    ckpt = {k: v for k, v in ckpt.items() if k in CHECKPOINT_KEYS}
    try:
        return tune.CheckpointConfig(**ckpt)
    except Exception as e:
        errors.append(f"checkpoint_config: {e}")
        return tune.CheckpointConfig()


def _is_file_store(uri: str) -> bool:
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    return scheme in ("", "file")


def _build_mlflow(
    name: str, spec: Dict[str, Any], storage_path: str, mlflow_uri: Optional[str], errors: List[str]
) -> Optional[Dict[str, Any]]:
    block = spec.get("mlflow")
    if block is None and mlflow_uri is None:
        return None
    if block is False and mlflow_uri is None:
        return None
    if block is True or block is None or block is False:  # --mlflow-uri wins over `false`
        block = {}
    if not isinstance(block, dict):
        errors.append(f"mlflow: must be a mapping (or true), got {block!r}.")
        return None
    for k in block:
        if k not in MLFLOW_KEYS:
            errors.append(f"mlflow: unknown key {k!r}.{_suggest(str(k), MLFLOW_KEYS)} Known: {', '.join(MLFLOW_KEYS)}.")
    settings = {k: v for k, v in block.items() if k in MLFLOW_KEYS}
    uri = mlflow_uri or settings.get("tracking_uri")
    if not uri:
        if "://" in storage_path:
            errors.append("mlflow: give `tracking_uri` when storage_path is a remote URI.")
            return None
        uri = f"sqlite:///{os.path.join(storage_path, 'mlflow.db')}"
    settings["tracking_uri"] = str(uri)
    settings.setdefault("experiment_name", name)
    return settings


_SAFE_MLFLOW_CLS: Optional[type] = None


def _chunks(items: List[Any], n: int) -> Iterable[List[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _mlflow_callback_class() -> type:
    """``MLflowLoggerCallback`` with two fixes for Ray 2.60:

    * ``log_trial_end`` indexes ``self._trial_runs[trial]`` unguarded: a trial whose
      actor dies in ``__init__`` (bad env, bad config) never got a run, and the
      KeyError aborts the whole Tune run instead of marking one trial errored;
    * params and metrics are logged one call (one DB transaction) per key: an
      AlgorithmConfig has ~300 keys and a result ~100 metrics, which cost seconds per
      trial start and per iteration on a sqlite store, blocking Tune's driver loop.
      Here they go in ``log_batch`` calls (falling back to Ray's way on any error).
    """
    global _SAFE_MLFLOW_CLS
    if _SAFE_MLFLOW_CLS is None:
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        class BatchedMLflowLoggerCallback(MLflowLoggerCallback):
            def _client(self):
                return self.mlflow_util._get_client()

            def _log_params_batched(self, run_id: str, config: Dict[str, Any]) -> None:
                from mlflow.entities import Param
                from ray.tune.utils import flatten_dict

                params = [Param(str(k), str(v)[:6000]) for k, v in flatten_dict(config).items()]
                client = self._client()
                for chunk in _chunks(params, 100):
                    client.log_batch(run_id, params=chunk, synchronous=True)

            def log_trial_start(self, trial):
                if self.log_params_on_trial_end:
                    return super().log_trial_start(trial)
                if trial not in self._trial_runs:
                    tags = dict(self.tags)
                    tags["trial_name"] = str(trial)
                    run = self.mlflow_util.start_run(tags=tags, run_name=str(trial))
                    self._trial_runs[trial] = run.info.run_id
                try:
                    self._log_params_batched(self._trial_runs[trial], trial.config)
                except Exception:  # e.g. a restored trial whose params exist
                    self.mlflow_util.log_params(run_id=self._trial_runs[trial], params_to_log=trial.config)

            def log_trial_result(self, iteration: int, trial, result: Dict):
                from mlflow.entities import Metric
                from ray.tune.result import TIMESTEPS_TOTAL, TRAINING_ITERATION
                from ray.tune.utils import flatten_dict

                if trial not in self._trial_runs:
                    return
                run_id = self._trial_runs[trial]
                step = result.get(TIMESTEPS_TOTAL) or result[TRAINING_ITERATION]
                now = int(time.time() * 1000)
                # heldout/* only on the iterations that measured it, at the step it belongs
                # to (0 for the starting point), not repeated (or NaN) in between.
                heldout_step = _new_heldout_step(self.__dict__.setdefault("_heldout_seen", {}), trial, result)
                metrics = []
                for k, v in flatten_dict(result).items():
                    if isinstance(v, bool):
                        v = float(v)
                    at = step
                    if str(k).startswith("heldout/"):
                        if heldout_step is None:
                            continue
                        at = heldout_step
                    try:
                        metrics.append(Metric(str(k), float(v), now, int(at)))
                    except (TypeError, ValueError):
                        continue
                try:
                    client = self._client()
                    for chunk in _chunks(metrics, 1000):
                        client.log_batch(run_id, metrics=chunk, synchronous=True)
                except Exception:
                    super().log_trial_result(iteration, trial, result)

            def log_trial_end(self, trial, failed: bool = False):
                if trial not in self._trial_runs:
                    return
                super().log_trial_end(trial, failed=failed)

        _SAFE_MLFLOW_CLS = BatchedMLflowLoggerCallback
    return _SAFE_MLFLOW_CLS


def _new_heldout_step(seen: Dict[Any, Any], trial: Any, result: Mapping[str, Any]) -> Optional[int]:
    """The iteration a result's held-out evaluation belongs to, if it was not logged yet."""
    after = (result.get("heldout") or {}).get("after_iteration")
    if after is None or isinstance(after, float) and math.isnan(after):
        return None
    if seen.get(trial) == after:
        return None
    seen[trial] = after
    return int(after)


def _progress_callback_class() -> type:
    """A Tune callback that prints one line per training iteration (Tune's own tables only
    with ``--verbose``): reward, solve rate, held-out accuracy when measured, s/iteration."""
    from ray.tune import Callback

    class IterationLines(Callback):
        def __init__(self):
            self._heldout_seen: Dict[Any, Any] = {}

        def on_trial_result(self, iteration, trials, trial, result, **info):
            runners = result.get("env_runners") or {}
            reward = result.get("reward_mean", runners.get("episode_return_mean"))
            parts = [f"[{trial.trial_id}] iter {result.get('training_iteration', 0):4d}"]
            if reward is not None:
                parts.append(f"reward {float(reward):.3f}")
            if "solve_rate" in result:
                parts.append(f"solve {float(result['solve_rate']):.3f}")
            step = _new_heldout_step(self._heldout_seen, trial, result)
            if step is not None:
                parts.append(f"held-out {float(result['heldout']['accuracy']):.3f} (after {step})")
            if "time_this_iter_s" in result:
                parts.append(f"{float(result['time_this_iter_s']):.2f} s/it")
            print("  ".join(parts), flush=True)

        def on_trial_error(self, iteration, trials, trial, **info):
            print(f"[{trial.trial_id}] errored: see {trial.error_file or trial.path}", flush=True)

    return IterationLines


def _make_mlflow_callback(settings: Dict[str, Any]) -> Any:
    return _mlflow_callback_class()(**settings)


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
) -> List[Experiment]:
    """Parse and validate an experiment file (path) or an already-loaded mapping.

    Nothing starts Ray. Env class paths are registered with ``register_env`` (they
    reach Ray's workers when Ray starts). Overrides apply to every experiment:
    ``stop`` is merged over each file ``stop``, ``config_overrides`` deep-merged over
    each ``config`` (and then checked like it), the others replace the file's values.
    ``validate`` also runs ``AlgorithmConfig.validate()`` on up to 32 variants of the
    search space. Raises :class:`CliConfigError` naming every problem found in the
    first bad experiment.
    """
    src_name: Optional[str] = None
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        src_name = str(source)
        data = load_experiment_file(source)
    if not data:
        raise CliConfigError(f"{src_name or 'experiments'}: no experiments given.")
    if experiment_name is not None and len(data) != 1:
        raise CliConfigError(
            f"--experiment-name renames one experiment, but {src_name or 'the input'} holds "
            f"{len(data)}: {', '.join(map(str, data))}."
        )
    if stop is not None and not isinstance(stop, Mapping):
        raise CliConfigError(f"--stop must be a JSON object, got {stop!r}.")
    if config_overrides is not None and not isinstance(config_overrides, Mapping):
        raise CliConfigError(f"--config must be a JSON object, got {config_overrides!r}.")

    experiments = []
    for name, spec in data.items():
        experiments.append(
            _build_one(
                str(experiment_name if experiment_name is not None else name),
                spec,
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
            )
        )
    return experiments


def _build_one(
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
) -> Experiment:
    prefix = f"{src_name}: experiment {name!r}" if src_name else f"experiment {name!r}"

    def fail(errors: Iterable[str]) -> None:
        errors = list(errors)
        if errors:
            raise CliConfigError(prefix + ":\n  - " + "\n  - ".join(errors))

    if not isinstance(spec, dict):
        fail([f"expected a mapping with `run`, `env`, `config`, ..., got {type(spec).__name__}."])
    errors: List[str] = []
    for key in spec:
        if key in EXPERIMENT_KEYS:
            continue
        if key in _RENAMED_EXPERIMENT_KEYS:
            errors.append(f"`{key}` {_RENAMED_EXPERIMENT_KEYS[key]}.")
        else:
            errors.append(
                f"unknown key `{key}`.{_suggest(str(key), EXPERIMENT_KEYS)} "
                f"Known keys: {', '.join(EXPERIMENT_KEYS)}."
            )
    if "run" not in spec:
        errors.append("missing `run` (an algorithm name such as ExGRPO or PPO, or 'pkg.mod:Class').")
    fail(errors)

    # --- algorithm and its default config
    try:
        algo_cls = resolve_algorithm(spec["run"])
    except CliConfigError as e:
        fail([str(e)])
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

    config = algo_cls.get_default_config()
    if not isinstance(config, AlgorithmConfig):
        fail([f"{algo_cls.__name__}.get_default_config() must return an AlgorithmConfig, got {type(config).__name__}."])
    if not (config.enable_rl_module_and_learner and config.enable_env_runner_and_connector_v2):
        fail([f"{algo_cls.__name__}'s default config is on RLlib's old API stack; this command runs the new API stack only."])
    algo_name = str(spec["run"]) if isinstance(spec["run"], str) else algo_cls.__name__

    # --- config dict: file, then overrides, then search spaces
    try:
        user_config = _as_json_like_dict(spec.get("config"), "config")
    except CliConfigError as e:
        fail([str(e)])
    if config_overrides:
        user_config = deep_merge(user_config, config_overrides)
    else:
        user_config = copy.deepcopy(user_config)
    try:
        user_config, found = convert_search_spaces(user_config)
    except CliConfigError as e:
        fail([str(e)])
    nested = sorted(p for p in found if p.startswith("config/rl_module_spec/"))
    if nested:
        fail([
            f"{p}: search spaces cannot sit inside `rl_module_spec` (Tune does not look "
            "into an RLModuleSpec); put them under the top-level `model_config`, which "
            "the module spec's model_config is merged over." for p in nested
        ])

    # --- env: --env > top-level env > config.env
    env = user_config.pop("env", None)
    if spec.get("env") is not None:
        if env is not None and env != spec["env"]:
            errors.append(
                f"`env` ({spec['env']!r}) and `config.env` ({env!r}) disagree; give one "
                "(on the command line, override with --env)."
            )
        env = spec["env"]
    if env_override is not None:
        env = env_override
    found.pop("config/env", None)

    errors += _check_config_keys(config, user_config, algo_name)
    fail(errors)

    try:
        if isinstance(env, dict) and len(env) == 1 and next(iter(env)) in ("grid_search",):
            env = {"grid_search": [resolve_env(e) for e in env["grid_search"]]}
            found["config/env"] = env
        else:
            env = resolve_env(env)
    except CliConfigError as e:
        fail([str(e)])

    errors += _apply_config(config, user_config)
    fail(errors)
    if env is not None:
        config.env = env
    if not (config.enable_rl_module_and_learner and config.enable_env_runner_and_connector_v2):
        fail(["the config switches RLlib's new API stack off; this command runs the new API stack only."])

    if validate:
        fail(_validate_variants(algo_cls, user_config, env, found))

    # --- run settings
    try:
        stop_dict = dict(_as_json_like_dict(spec.get("stop"), "stop"))
    except CliConfigError as e:
        fail([str(e)])
    if stop:
        stop_dict.update(stop)
    _check_stop(stop_dict, errors)

    n = num_samples if num_samples is not None else spec.get("num_samples", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        errors.append(f"num_samples must be a positive integer, got {n!r}.")
        n = 1

    if spec.get("storage_path") is not None and not isinstance(spec["storage_path"], str):
        errors.append(f"storage_path must be a string, got {spec['storage_path']!r}.")
    storage = _resolve_storage_path(storage_path or spec.get("storage_path"))

    ckpt_spec = dict(spec)
    if checkpoint_freq is not None:
        ckpt_spec["checkpoint_freq"] = checkpoint_freq
    if checkpoint_at_end is not None:
        ckpt_spec["checkpoint_at_end"] = checkpoint_at_end
    try:
        checkpoint_config = _build_checkpoint_config(ckpt_spec, errors)
    except CliConfigError as e:
        errors.append(str(e))
        checkpoint_config = None

    mlflow_settings = _build_mlflow(name, spec, storage, mlflow_uri, errors)
    fail(errors)
    callbacks = [_make_mlflow_callback(mlflow_settings)] if mlflow_settings else []

    return Experiment(
        name=name,
        algo_cls=algo_cls,
        config=config,
        stop=stop_dict,
        num_samples=n,
        storage_path=storage,
        checkpoint_config=checkpoint_config,
        callbacks=callbacks,
        search_space=found,
        env=env,
        mlflow=mlflow_settings,
        source=src_name,
    )


# ------------------------------------------------------------------------ running


@dataclass
class ExperimentResult:
    """What :func:`run_experiments` returns per experiment."""

    experiment: Experiment
    result_grid: Any  # ray.tune.ResultGrid
    errors: List[Tuple[str, Optional[str]]] = field(default_factory=list)  # (trial path, error file)

    @property
    def ok(self) -> bool:
        return not self.errors


def _prepare_mlflow(settings: Dict[str, Any]) -> None:
    uri = settings["tracking_uri"]
    if _is_file_store(uri):
        # mlflow 3 refuses file stores unless opted in.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).expanduser().parent.mkdir(parents=True, exist_ok=True)


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
) -> List[ExperimentResult]:
    """Run experiments one after another with ``tune.Tuner``; return one result each.

    Ray: an already initialised Ray is used as is; else ``ray.init(address=ray_address)``
    when ``ray_address`` or ``RAY_ADDRESS`` is set; else a private local instance
    (``ray.init(address="local", **ray_init_kwargs)``), shut down at the end. A failing
    trial does not stop later experiments; see ``ExperimentResult.errors``.
    """
    import ray
    from ray import tune

    for exp in experiments:
        if exp.mlflow:
            _prepare_mlflow(exp.mlflow)

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
            tuner = tune.Tuner(
                exp.algo_cls,
                param_space=exp.param_space,
                tune_config=tune.TuneConfig(num_samples=exp.num_samples),
                run_config=tune.RunConfig(
                    name=exp.name,
                    storage_path=exp.storage_path,
                    stop=exp.stop or None,
                    checkpoint_config=exp.checkpoint_config,
                    # Tune's status tables only when asked for (--verbose); otherwise
                    # one line per iteration.
                    callbacks=list(exp.callbacks) + ([] if verbose > 1 else [_progress_callback_class()()]),
                    verbose=verbose - 1 if verbose > 1 else 0,
                ),
            )
            grid = tuner.fit()
            results.append(ExperimentResult(experiment=exp, result_grid=grid, errors=_trial_errors(grid)))
    finally:
        if started:
            ray.shutdown()
    return results
