"""Name resolution for the ``rllib`` command: ``run:`` (algorithm) and ``env:``.

Everything here imports lazily, so the command keeps working before (or without)
this project's algorithm modules, and ``rllib --help`` stays fast.

``run:`` is resolved in this order:

1. this project's algorithms, by name, through the :data:`ALGORITHM` registry
   (``ExGRPO``, ``GRPO``; extend it with :func:`register_algorithm`);
2. RLlib's built-in algorithms, by name (``"PPO"``, ``"APPO"``, ...), through
   ``ray.rllib.algorithms.registry.ALGORITHMS`` (only the named one is imported);
3. a dotted path, ``"pkg.mod:Class"`` or ``"pkg.mod.Class"``.

``env:`` is resolved in this order:

1. a name already registered with ``ray.tune.registry.register_env`` -> as is;
2. a registered gymnasium id (``"CartPole-v1"``) -> as is;
3. gymnasium's ``"module:EnvId-v0"`` syntax (the part after ``:`` is no Python
   identifier) -> as is (gymnasium imports the module itself);
4. a dotted path ``"pkg.mod:Class"`` / ``"pkg.mod.Class"`` (a ``gymnasium.Env``
   subclass or any env-creator callable) -> imported here and registered with
   ``register_env`` under that very string, called as ``obj(env_config)`` like RLlib
   calls env classes. (RLlib's new API stack cannot use dotted paths by itself.)
"""

from __future__ import annotations

import difflib
import functools
import importlib
from typing import Any, Callable, Dict, List, Union

from rllib_exgrpo.core.registry import Registry
from rllib_exgrpo.rllib.env_creator import BUILTIN_ENVS, import_object, moved_path_hint  # noqa: F401  (import_object re-exported: callers import it from here)
from rllib_exgrpo.rllib.rllib_contract import registered_env_creator

__all__ = [
    "ALGORITHM",
    "CliConfigError",
    "register_algorithm",
    "known_algorithm_names",
    "resolve_algorithm",
    "resolve_env",
    "import_object",
]


class CliConfigError(ValueError):
    """A problem in an experiment file or in the command-line overrides.

    Raised before Ray starts; the message is meant for the user as is.
    """


class _Import:
    """A registered algorithm not imported yet: calling it imports ``target`` ("pkg.mod:Class")."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __call__(self) -> Any:
        return import_object(self.target)

    def __repr__(self) -> str:
        return f"_Import({self.target!r})"


#: This project's algorithms (and any a user package registers): name -> the class, or an
#: ``_Import`` of its "module:attribute", imported only when a YAML file names it.
ALGORITHM: Registry = Registry("algorithm")
ALGORITHM.register("ExGRPO")(_Import("rllib_exgrpo.rllib.algorithm:ExGRPO"))
ALGORITHM.register("GRPO")(_Import("rllib_exgrpo.rllib.algorithm:GRPO"))


def register_algorithm(name: str, target: Union[str, type, None] = None):
    """Make ``run: <name>`` resolve to ``target`` ("pkg.mod:Class" or a class); without a
    target, a class decorator: ``@register_algorithm("MyAlgo") class MyAlgo(Algorithm): ...``."""
    if target is None:
        return ALGORITHM.register(name)
    if not isinstance(target, (str, type)):
        raise TypeError(f"target must be a 'pkg.mod:Class' string or a class, got {target!r}")
    ALGORITHM.register(name)(_Import(target) if isinstance(target, str) else target)
    return target


def _rllib_algorithm_table() -> Dict[str, Callable]:
    from ray.rllib.algorithms.registry import ALGORITHMS as RLLIB_ALGORITHMS

    return RLLIB_ALGORITHMS


def _rllib_aliases() -> Dict[str, str]:
    try:
        from ray.rllib.algorithms.registry import ALGORITHMS_CLASS_TO_NAME
    except ImportError:  # pragma: no cover - older/newer RLlib
        return {}
    return dict(ALGORITHMS_CLASS_TO_NAME)


def known_algorithm_names() -> List[str]:
    """All names ``run:`` accepts without a dotted path (project's first)."""
    names = list(ALGORITHM.names())
    for n in list(_rllib_algorithm_table()) + list(_rllib_aliases()):
        if n not in names:
            names.append(n)
    return names


def _looks_like_path(name: str) -> bool:
    return ":" in name or "." in name


def _check_algorithm_class(obj: Any, name: str, origin: str) -> type:
    from ray.rllib.algorithms.algorithm import Algorithm

    if not (isinstance(obj, type) and issubclass(obj, Algorithm)):
        raise CliConfigError(f"run: {name!r} ({origin}) is {obj!r}, which is not a subclass of ray.rllib.algorithms.algorithm.Algorithm.")
    return obj


def resolve_algorithm(name: Any) -> type:
    """Return the Algorithm class that ``run: <name>`` designates (see module doc)."""
    if isinstance(name, type):
        return _check_algorithm_class(name, name.__name__, "class")
    if not isinstance(name, str) or not name:
        raise CliConfigError(f"run: must be an algorithm name or 'pkg.mod:Class' path, got {name!r}.")

    # 1. This project's algorithms.
    if name in ALGORITHM:
        target = ALGORITHM.get(name)
        if isinstance(target, type):
            return _check_algorithm_class(target, name, "project registry")
        try:
            obj = target()
        except (ImportError, AttributeError) as e:
            raise CliConfigError(
                f"run: {name!r} maps to {getattr(target, 'target', target)!r} (registered with "
                f"rllib_exgrpo.cli.registry.register_algorithm), which could not be imported: {type(e).__name__}: {e}"
            ) from e
        return _check_algorithm_class(obj, name, getattr(target, "target", "project registry"))

    # 2. RLlib's built-in algorithms (only the one named is imported).
    table = _rllib_algorithm_table()
    rllib_name = name if name in table else _rllib_aliases().get(name)
    if rllib_name in table:
        try:
            algo_cls, _ = table[rllib_name]()
        except ImportError as e:
            raise CliConfigError(f"run: RLlib algorithm {name!r} could not be imported: {e}") from e
        return _check_algorithm_class(algo_cls, name, "RLlib")

    # 3. A dotted path.
    if _looks_like_path(name):
        try:
            obj = import_object(name)
        except (ImportError, AttributeError) as e:
            raise CliConfigError(
                f"run: {name!r} is no known algorithm name and could not be imported as a class path: {type(e).__name__}: {e}"
            ) from e
        return _check_algorithm_class(obj, name, "class path")

    known = known_algorithm_names()
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    close += [k for k in known if k.lower() == name.lower() and k not in close]
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise CliConfigError(
        f"run: unknown algorithm {name!r}.{hint} Known names: {', '.join(known)}. "
        "Or give a class path such as 'my_pkg.my_module:MyAlgorithm'."
    )


def _make_env(env_obj: Callable, env_config: Any) -> Any:
    """Env creator registered for dotted paths (a module-level function, so it pickles
    by reference: Ray workers import the env's module, not a copy of a closure)."""
    return env_obj(env_config)


def _gym_ids() -> List[str]:
    import gymnasium as gym

    return list(gym.envs.registry.keys())


def _tune_registered(name: str) -> bool:

    return registered_env_creator(name) is not None


def resolve_env(env: Any, *, register: bool = True) -> Any:
    """Return what goes into ``config.environment(env=...)`` for a YAML ``env:`` value.

    A dotted path is imported and (if ``register``) registered with Tune under the
    same string, which is returned. Raises :class:`CliConfigError` on unknown names.
    """
    if env is None or not isinstance(env, str):
        # None (the algorithm brings its own env runner/env) or a class/callable
        # passed programmatically: RLlib handles those itself.
        return env
    if not env:
        raise CliConfigError("env: must not be empty.")

    if _tune_registered(env) or env in BUILTIN_ENVS:
        return env
    import gymnasium as gym

    if env in gym.envs.registry:
        return env

    if _looks_like_path(env):
        module_part, sep, attr_part = env.partition(":")
        if sep and not all(p.isidentifier() for p in attr_part.split(".")):
            # gymnasium's "module:EnvId-v0" syntax: gymnasium imports the module.
            try:
                importlib.import_module(module_part)
            except ImportError as e:
                raise CliConfigError(f"env: {env!r}: module {module_part!r} cannot be imported: {e}") from e
            return env
        try:
            obj = import_object(env)
        except (ImportError, AttributeError) as e:
            if moved_path_hint(env):
                raise CliConfigError(f"env: {moved_path_hint(env)}.") from None
            raise CliConfigError(
                f"env: {env!r} is neither a registered env nor a gymnasium id, and could not "
                f"be imported as 'pkg.mod:Class': {type(e).__name__}: {e}"
            ) from e
        if not callable(obj):
            raise CliConfigError(f"env: {env!r} resolves to {obj!r}, which is neither an env class nor a callable.")
        if register:
            from ray.tune.registry import register_env

            register_env(env, functools.partial(_make_env, obj))
        return env

    close = difflib.get_close_matches(env, _gym_ids(), n=3, cutoff=0.6)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise CliConfigError(
        f"env: {env!r} is neither registered with ray.tune.registry.register_env nor a "
        f"gymnasium id.{hint} Give a gymnasium id, a name registered at import time of "
        "the algorithm's module, or a class path such as 'my_pkg.envs:MyEnv'."
    )
