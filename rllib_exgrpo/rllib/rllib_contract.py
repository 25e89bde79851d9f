"""Every private RLlib (and Ray Tune) name this package relies on, in one place.

RLlib's new API stack leaves a few things without a public route: the learner's update
loop that this package overrides, its optimiser bookkeeping, the config's frozen flag, the
``EnvRunnerGroup``'s actor manager, the Tune env registry. Each such name is listed in
:data:`PRIVATE_NAMES` (owner, name, kind and, for a method, its expected signature) and
reached through the small accessors below; no other module of the package touches one
(``tests/test_rllib_contract.py`` checks the list against the installed Ray, and scans the
package for private RLlib names used elsewhere). A Ray upgrade that renames or reshapes
one of them fails that test, naming the name and what changed.

Methods the package *overrides* (``_uncompiled_update``, ``_get_optimizer_state``, ...)
are listed too, with ``kind="override"``: their definitions carry ``@override`` in the
subclass, and the test checks the base method still exists with the listed signature.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional

_TORCH_LEARNER = "ray.rllib.core.learner.torch.torch_learner:TorchLearner"
_LEARNER = "ray.rllib.core.learner.learner:Learner"
_CONFIG = "ray.rllib.algorithms.algorithm_config:AlgorithmConfig"
_CHECKPOINTABLE = "ray.rllib.utils.checkpoints:Checkpointable"
_MLFLOW_CALLBACK = "ray.air.integrations.mlflow:MLflowLoggerCallback"


@dataclass(frozen=True)
class PrivateName:
    """One private name: ``owner`` is ``"module:Class"`` (or ``"module"`` for a module
    attribute); ``kind`` is ``"method"`` (called here), ``"override"`` (a method the
    package overrides), ``"attribute"`` (an instance attribute the owner's ``__init__`` or
    setup assigns) or ``"module_attribute"``; ``signature`` is the method's, as
    ``str(inspect.signature(...))`` prints it."""

    owner: str
    name: str
    kind: str
    signature: Optional[str] = None
    used_for: str = ""

    def resolve_owner(self) -> Any:
        module_name, _, attr = self.owner.partition(":")
        obj = importlib.import_module(module_name)
        return getattr(obj, attr) if attr else obj


PRIVATE_NAMES = (
    # --- overridden (definitions carry @override) -----------------------------------------
    PrivateName(
        _TORCH_LEARNER,
        "_uncompiled_update",
        "override",
        "(self, batch: Dict, **kwargs)",
        "the learner's update: micro-batched passes, grad-norm guards, DeepSpeed engine step",
    ),
    PrivateName(
        _TORCH_LEARNER,
        "_make_modules_ddp_if_necessary",
        "override",
        "(self) -> None",
        "DeepSpeed wraps the module in its engine instead of DDP",
    ),
    PrivateName(_TORCH_LEARNER, "_get_optimizer_state", "override", "(self) -> Dict[str, Any]", "DeepSpeed's sharded optimiser state"),
    PrivateName(
        _TORCH_LEARNER, "_set_optimizer_state", "override", "(self, state: Dict[str, Any]) -> None", "DeepSpeed's sharded optimiser state"
    ),
    PrivateName(
        _CHECKPOINTABLE,
        "_restore_all_subcomponents_from_path",
        "override",
        "(self, path, filesystem, only_comp_names=None, component=None, **kwargs)",
        "ZeRO-3 module weights restored partition by partition",
    ),
    # --- methods called -------------------------------------------------------------------
    PrivateName(_TORCH_LEARNER, "_compute_off_policyness", "method", "(self, batch)", "RLlib's metric, kept in the update"),
    PrivateName(_LEARNER, "_check_is_built", "method", "(self, error: bool = True) -> bool", "state API guard"),
    PrivateName(
        _CHECKPOINTABLE,
        "_check_component",
        "method",
        "(self, name, components, not_components) -> bool",
        "which components a get_state asks for",
    ),
    PrivateName(_CHECKPOINTABLE, "_get_subcomponents", "method", "(self, name, components)", "the module ids a get_state asks for"),
    PrivateName(_CONFIG, "_value_error", "method", "(self, errmsg) -> None", "ExGRPOConfig.validate raises as RLlib does"),
    PrivateName(
        _CONFIG, "_translate_special_keys", "method", "(key: str, warn_deprecated: bool = True) -> str", "legacy config keys in the CLI"
    ),
    PrivateName(
        "ray.rllib.core.rl_module.rl_module:RLModuleSpec",
        "_get_model_config",
        "method",
        "(self)",
        "a module spec's model config (also a callable one)",
    ),
    PrivateName("ray.rllib.utils.checkpoints", "_exists_at_fs_path", "module_attribute", None, "a module folder present in a checkpoint"),
    PrivateName("ray.tune.registry", "_global_registry", "module_attribute", None, "registered env names"),
    PrivateName(
        "ray.tune.trainable.metadata",
        "_TrainingRunMetadata",
        "module_attribute",
        None,
        "iterations recorded in a Tune experiment state (resume)",
    ),
    # --- names in Ray's private modules ---------------------------------------------------
    PrivateName(
        "ray._private.serialization",
        "SerializationContext",
        "module_attribute",
        None,
        "count what Ray serialises during a weight sync (benchmarks)",
    ),
    PrivateName("ray._common.deprecation", "DEPRECATED_VALUE", "module_attribute", None, "config attributes RLlib keeps only to reject"),
    PrivateName(
        "ray.train._internal.storage", "get_fs_and_path", "module_attribute", None, "the filesystem of an experiment path (resume)"
    ),
    # --- attributes -----------------------------------------------------------------------
    PrivateName(_CONFIG, "_is_frozen", "attribute", None, "fit resources into a config RLlib froze"),
    PrivateName(_CONFIG, "_rl_module_spec", "attribute", None, "the user's RLModuleSpec"),
    PrivateName(_CONFIG, "_learner_connector", "attribute", None, "PPO needs PadLLMEpisodes"),
    PrivateName(_CONFIG, "_torch_grad_scaler_class", "attribute", None, "refused with DeepSpeed"),
    PrivateName(_CONFIG, "_torch_lr_scheduler_classes", "attribute", None, "refused with DeepSpeed"),
    PrivateName(
        "ray.rllib.utils.metrics.metrics_logger:MetricsLogger",
        "_threading_lock",
        "attribute",
        None,
        "a real lock while the update runs in a thread (async_rollouts)",
    ),
    PrivateName(
        "ray.rllib.env.env_runner_group:EnvRunnerGroup",
        "_worker_manager",
        "attribute",
        None,
        "the runner actors and their health (collective weight sync)",
    ),
    PrivateName(_LEARNER, "_params", "attribute", None, "the parameters' gradients and device"),
    PrivateName(_LEARNER, "_optimizer_parameters", "attribute", None, "zero grads; the optimiser's parameters"),
    PrivateName(_LEARNER, "_named_optimizers", "attribute", None, "the optimiser a DeepSpeed engine takes over"),
    PrivateName(_LEARNER, "_module_optimizers", "attribute", None, "the optimiser names of a module"),
    PrivateName(_LEARNER, "_weights_seq_no", "attribute", None, "skip weights already held"),
    PrivateName(_LEARNER, "_device", "attribute", None, "the learner's device"),
    PrivateName(_TORCH_LEARNER, "_grad_scalers", "attribute", None, "fp16 loss scaling in the passes"),
    # --- Ray AIR's MLflow callback (cli/mlflow_logging.py logs in batches through its client) ----
    PrivateName(_MLFLOW_CALLBACK, "_trial_runs", "attribute", None, "the MLflow run id of each trial"),
    PrivateName(
        "ray.air._internal.mlflow:_MLflowLoggerUtil",
        "_get_client",
        "method",
        "(self) -> 'MlflowClient'",
        "the MLflow client the callback logs through (batched calls)",
    ),
)

PRIVATE_NAMES_BY_NAME: Dict[str, PrivateName] = {p.name: p for p in PRIVATE_NAMES}


# --- AlgorithmConfig ---------------------------------------------------------------------------
@contextlib.contextmanager
def unfrozen(config) -> Iterator[Any]:
    """Edit a frozen AlgorithmConfig in place (RLlib freezes it before ``setup``)."""
    was_frozen = config._is_frozen
    config._is_frozen = False
    try:
        yield config
    finally:
        config._is_frozen = was_frozen


def config_value_error(config, message: str) -> None:
    """Raise as ``AlgorithmConfig.validate`` does (its own error type and wording)."""
    config._value_error(message)


def translate_special_key(config_cls, key: str, warn_deprecated: bool = False) -> str:
    """RLlib's legacy config key translation (``"lambda"`` -> ``"lambda_"``, ...)."""
    return config_cls._translate_special_keys(key, warn_deprecated=warn_deprecated)


def rl_module_spec(config) -> Any:
    """The RLModuleSpec the user gave ``config.rl_module(rl_module_spec=...)`` (or None)."""
    return getattr(config, "_rl_module_spec", None)


def learner_connector(config) -> Any:
    """The custom learner connector of ``config.learners(learner_connector=...)`` (or None)."""
    return getattr(config, "_learner_connector", None)


def torch_grad_scaler_class(config) -> Any:
    return getattr(config, "_torch_grad_scaler_class", None)


def torch_lr_scheduler_classes(config) -> Any:
    return getattr(config, "_torch_lr_scheduler_classes", None)


def spec_model_config(spec) -> Dict[str, Any]:
    """A module spec's model config (a dict, or the result of a callable one)."""
    return spec._get_model_config()


# --- MetricsLogger, EnvRunnerGroup, Tune -----------------------------------------------------
def make_metrics_thread_safe(metrics) -> None:
    """Give a MetricsLogger a real lock (RLlib's default is a no-op one), as APPO / IMPALA do
    when their learner thread logs next to the main loop."""
    metrics._threading_lock = threading.RLock()


def runner_actor_manager(env_runner_group) -> Any:
    """The ``FaultTolerantActorManager`` of an EnvRunnerGroup (actors, health flags)."""
    return env_runner_group._worker_manager


def registered_env_creator(name: str) -> Any:
    """The env creator Tune's registry holds under ``name`` (None when not registered)."""
    from ray.tune.registry import ENV_CREATOR, _global_registry

    return _global_registry.get(ENV_CREATOR, name) if _global_registry.contains(ENV_CREATOR, name) else None


def training_run_metadata(json_state) -> Any:
    """A Tune trial's run metadata from its JSON state (``experiment_state-*.json``)."""
    from ray.tune.trainable.metadata import _TrainingRunMetadata

    return _TrainingRunMetadata.from_json_state(json_state)


def serialization_context_class() -> Any:
    """Ray's ``SerializationContext`` (its ``serialize`` sees every object Ray serialises)."""
    from ray._private.serialization import SerializationContext

    return SerializationContext


def deprecated_value() -> Any:
    """The value RLlib gives a config attribute that it keeps only to reject."""
    from ray._common.deprecation import DEPRECATED_VALUE

    return DEPRECATED_VALUE


def fs_and_path(path: str) -> Any:
    """``(pyarrow filesystem, path on it)`` of a local path or URI, as Ray Train resolves it."""
    from ray.train._internal.storage import get_fs_and_path

    return get_fs_and_path(path)


def exists_at_fs_path(filesystem, path: str) -> bool:
    from ray.rllib.utils.checkpoints import _exists_at_fs_path

    return _exists_at_fs_path(filesystem, path)


# --- Learner ----------------------------------------------------------------------------------
def base_uncompiled_update(parent, batch, **kwargs):
    """``super()._uncompiled_update(batch, **kwargs)``: pass the ``super()`` proxy."""
    return parent._uncompiled_update(batch, **kwargs)


def compute_off_policyness(learner, batch) -> None:
    learner._compute_off_policyness(batch)


def check_is_built(learner) -> None:
    learner._check_is_built()


def check_component(checkpointable, name: str, components, not_components) -> bool:
    return checkpointable._check_component(name, components, not_components)


def get_subcomponents(checkpointable, name: str, components) -> Any:
    return checkpointable._get_subcomponents(name, components)


def learner_params(learner) -> Dict[Any, Any]:
    """Parameter id -> parameter, of every optimiser of the learner."""
    return learner._params


def optimizer_parameters(learner) -> Dict[Any, Any]:
    """Optimiser -> its parameters."""
    return learner._optimizer_parameters


def named_optimizers(learner) -> Dict[str, Any]:
    return learner._named_optimizers


def module_optimizers(learner) -> Dict[Any, Any]:
    """Module id -> the names of its optimisers."""
    return learner._module_optimizers


def grad_scalers(learner) -> Any:
    """The TorchLearner's fp16 grad scalers by module (None without one)."""
    return learner._grad_scalers


def learner_device(learner) -> Any:
    return getattr(learner, "_device", None)


def weights_seq_no(learner) -> int:
    return int(getattr(learner, "_weights_seq_no", 0) or 0)


# --- Ray AIR's MLflow callback -----------------------------------------------------------------
def mlflow_trial_runs(callback) -> Dict[Any, str]:
    """The trial -> MLflow run id table of an ``MLflowLoggerCallback`` (read and written)."""
    return callback._trial_runs


def mlflow_client(callback) -> Any:
    """The ``MlflowClient`` an ``MLflowLoggerCallback`` logs through."""
    return callback.mlflow_util._get_client()
