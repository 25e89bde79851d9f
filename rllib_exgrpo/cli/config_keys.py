"""Checking and applying the ``config:`` keys of an experiment against the algorithm's
config class: unknown keys with "did you mean", RLlib's deprecated names, old-stack switches,
multi-agent sub-keys, ``rl_module_spec`` and connector paths; each bad key one message.

The project's own fields are attributes of ``ExGRPOConfig`` (``rllib/config_fields.py``),
so they are checked like RLlib's.
"""

from __future__ import annotations


import contextlib
import copy
import difflib
import inspect
import logging
from typing import Any, Dict, List, Mapping, Optional, Sequence

from rllib_exgrpo.rllib import rllib_contract
from rllib_exgrpo.cli.registry import CliConfigError, import_object
from rllib_exgrpo.rllib.env_runner import LLMEnvRunner
from rllib_exgrpo.rllib.module import LLMTorchRLModule
from rllib_exgrpo.rllib.ppo_module import model_config_problems

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


def _translate(config_cls: type, key: str) -> str:
    try:
        return rllib_contract.translate_special_key(config_cls, key, warn_deprecated=False)
    except Exception:  # pragma: no cover - defensive
        return key


def _deprecation_message(config_cls: type, key: str) -> Optional[str]:
    try:
        rllib_contract.translate_special_key(config_cls, key, warn_deprecated=True)
    except Exception as e:
        return str(e)
    return None


_CANDIDATES_CACHE: Dict[type, List[str]] = {}


def _deprecated_attributes(config: Any) -> frozenset:
    """Attributes RLlib keeps only to reject: their default is ``DEPRECATED_VALUE``.

    (Checked for RLlib 2.60: no live setting of ``AlgorithmConfig`` or ``PPOConfig``
    defaults to -1, and every attribute defaulting to it is deprecated.)
    """
    return frozenset(k for k, v in vars(config).items() if type(v) is int and v == rllib_contract.deprecated_value())


def _candidate_keys(config: Any) -> List[str]:
    """Settable, live keys of ``config`` for "did you mean" hints: its attributes that
    are not deprecated, plus properties backed by a private attribute (RLlib's live
    properties such as ``train_batch_size_per_learner``; its deprecated ones have none)."""
    cls = type(config)
    if cls not in _CANDIDATES_CACHE:
        attrs = vars(config)
        deprecated = _deprecated_attributes(config)
        keys = [k for k in attrs if not k.startswith("_") and k not in deprecated]
        keys += [
            name
            for name, prop in inspect.getmembers(cls, lambda a: isinstance(a, property))
            if prop.fset is not None and not name.startswith("_") and f"_{name}" in attrs
        ]
        keys += list(_ALIAS_KEYS) + list(_EXTRA_CONFIG_KEYS)
        _CANDIDATES_CACHE[cls] = sorted(set(keys))
    return _CANDIDATES_CACHE[cls]


def suggest(key: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
    return f" Did you mean: {', '.join(repr(c) for c in close)}?" if close else ""


def check_config_keys(config: Any, user_config: Mapping[str, Any], algo_name: str) -> List[str]:
    """Return one message per bad top-level key of ``user_config``.

    One rule per kind of key RLlib accepts, each with its own message: keys with a rule of
    their own (old-stack switches, multi-agent, module spec, connectors;
    :func:`_special_key_problems`), then the config class's properties, attributes and
    methods (:func:`_attribute_key_problems`).
    """
    deprecated = _deprecated_attributes(config)
    errors: List[str] = []
    for key, value in user_config.items():
        where = f"config key {key!r}"
        if not isinstance(key, str):
            errors.append(f"{where}: keys must be strings.")
            continue
        problems = _special_key_problems(key, value, where)
        if key == "model_config":
            problems = _llm_model_config_problems(config, value, "config.model_config")
        elif key == "rl_module_spec" and not problems and isinstance(value, dict) and "model_config" in value:
            problems = _llm_model_config_problems(
                config, value["model_config"], "config.rl_module_spec.model_config", module_class=value.get("module_class")
            )
        if problems is None:
            problems = _attribute_key_problems(config, deprecated, key, value, where, algo_name)
        errors += problems
    return errors


def _special_key_problems(key: str, value: Any, where: str) -> Optional[List[str]]:
    """The problems of a key that has a rule of its own (None: ``key`` has none, the config
    class's attributes decide)."""
    if key in _OLD_STACK_SWITCHES:
        if value is True:
            return []
        return [
            f"{where}: {value!r}: this command runs RLlib's new API stack only (RLModule, Learner, EnvRunner, ConnectorV2); remove the key."
        ]
    if key in ("_enable_new_api_stack", "api_stack"):
        return [f"{where}: this command always runs RLlib's new API stack; remove the key."]
    if key == "framework" and value not in ("torch", None):
        return [f"{where}: {value!r}: the new API stack supports only 'torch'."]
    if key == "multiagent":
        if not isinstance(value, dict):
            return [f"{where}: must be a mapping."]
        return [
            f"config key 'multiagent/{sub}': unknown.{suggest(str(sub), _MULTIAGENT_KEYS)} Known: {', '.join(_MULTIAGENT_KEYS)}."
            for sub in value
            if sub not in _MULTIAGENT_KEYS
        ]
    if key == "learner_class":
        return []
    if key == "model_config":
        return None  # checked with the config (_llm_model_config_problems)
    if key == "learner_connector":
        if value is not None and not (isinstance(value, str) and _looks_like_class_path(value)):
            return [
                f"{where}: must be a 'pkg.mod:Callable' path (a ConnectorV2 class or a "
                f"function (obs_space, action_space) -> ConnectorV2 piece(s)), got {value!r}."
            ]
        return []
    if key == "rl_module_spec":
        return _check_rl_module_spec(value, where)
    return None


def _is_llm_module_config(config: Any, model_config: Any, module_class: Any = None) -> bool:
    """Whether a ``model_config`` is read by this project's LLM module and env runner under an
    algorithm that is not this project's (RLlib's PPO): the config samples with
    ``LLMEnvRunner``, its module spec (or ``module_class``) is an ``LLMTorchRLModule``, or the
    mapping names an LLM ``model`` (any order of the YAML's keys)."""
    if hasattr(config, "model_name_or_path"):
        return False  # ExGRPO / GRPO: the module's model_config is built from the fields

    runner = getattr(config, "env_runner_cls", None)
    if isinstance(runner, type) and issubclass(runner, LLMEnvRunner):
        return True
    classes = [module_class, getattr(rllib_contract.rl_module_spec(config), "module_class", None)]
    for cls in classes:
        if isinstance(cls, str):
            try:
                cls = import_object(cls)
            except Exception:  # noqa: BLE001 - the module spec's own check reports it
                continue
        if isinstance(cls, type) and issubclass(cls, LLMTorchRLModule):
            return True
    return isinstance(model_config, dict) and isinstance(model_config.get("model"), str)


def _llm_model_config_problems(config: Any, model_config: Any, where: str, module_class: Any = None) -> List[str]:
    """The ``model_config`` of RLlib's PPO on this project's LLM, one line per key it would not
    read as meant (``ppo_module.model_config_problems``); any other ``model_config`` is the
    module's own business."""
    if model_config is None or not _is_llm_module_config(config, model_config, module_class):
        return []

    return model_config_problems(model_config, where)


def _attribute_key_problems(config: Any, deprecated: frozenset, key: str, value: Any, where: str, algo_name: str) -> List[str]:
    """The problems of ``key`` as an attribute of the config: a settable property (whose
    setter accepts ``value``), a non-deprecated attribute, else a method or unknown."""
    cls = type(config)
    name = _translate(cls, key)
    static = inspect.getattr_static(cls, name, None)
    if isinstance(static, property):
        if static.fset is None:
            return [f"{where}: is a read-only property of {cls.__name__}."]
        try:  # deprecated properties raise in their setter
            static.fset(copy.copy(config), value)
        except Exception as e:
            return [f"{where}: {e}"]
        return []
    if name in vars(config):
        if name not in deprecated:
            return []
        msg = _deprecation_message(cls, key)
        return [
            f"{where}: is deprecated and has no effect in RLlib 2.60"
            + (f" ({msg})" if msg else "")
            + "."
            + suggest(key, _candidate_keys(config))
        ]
    if static is not None and callable(static):
        return [
            f"{where}: is a method of {cls.__name__}, not a setting. Write its "
            f"arguments directly under `config:` (e.g. `lr: 0.001` instead of "
            f"`training: {{lr: 0.001}}`)."
        ]
    return [f"{where}: unknown setting for {algo_name} ({cls.__name__}).{suggest(key, _candidate_keys(config))}"]


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
                f"config key 'rl_module_spec/{sub}': unknown.{suggest(str(sub), RL_MODULE_SPEC_KEYS)} "
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


def apply_config(config: Any, user_config: Mapping[str, Any]) -> List[str]:
    errors = []
    for key, value in user_config.items():
        try:
            _apply_key(config, key, value)
        except Exception as e:
            errors.append(f"config key {key!r}: {type(e).__name__}: {e}")
    return errors


@contextlib.contextmanager
def quiet_rllib_logs():
    lg = logging.getLogger("ray.rllib")
    old = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(old)
