"""Env specifications as RLlib configs hold them -> a callable that builds the env.

A YAML file names its env by a built-in name (``ReasoningEnv``, see :data:`BUILTIN_ENVS`) or a
class path (``my_pkg.my_env:MyEnv``), and a Python user may write the same string in
``config.environment(...)``. RLlib resolves such a string only if someone registered it with
Tune; a plain-Python config, or an algorithm restored with ``Algorithm.from_checkpoint`` in a
fresh process, has not. The env runner therefore resolves strings here: a Tune-registered
name wins, then a built-in name, else the string is imported.

The package's env, datasets and rewards live under ``rllib_exgrpo.envs``; they were once a
top-level ``envs`` package. A class path under that old name that no longer imports fails in
one line saying what to write instead (:func:`import_object`).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from rllib_exgrpo.rllib.rllib_contract import registered_env_creator


#: Env names every config may use without a class path: name -> class path.
BUILTIN_ENVS = {"ReasoningEnv": "rllib_exgrpo.envs.reasoning_env:ReasoningEnv"}

#: The package's env modules once lived in a top-level package of this name.
_OLD_TOP_LEVEL = "envs."


def moved_path_hint(path: str) -> str | None:
    """What to write instead of a class path under the old top-level ``envs`` package, or
    None where ``path`` is not one."""
    if not path.startswith(_OLD_TOP_LEVEL):
        return None
    new = "rllib_exgrpo." + path
    if path in ("envs.reasoning_env:ReasoningEnv", "envs.reasoning_env.ReasoningEnv"):
        return f"{path!r} moved into the package: write 'ReasoningEnv' (or {new!r})"
    return f"{path!r} moved into the package: write {new!r}"


def import_object(path: str) -> Any:
    """Import ``"pkg.mod:attr.sub"`` or ``"pkg.mod.attr"``; raise ImportError/AttributeError.

    A path under the old top-level ``envs`` package that does not import raises an
    ImportError whose message is one line naming the new path."""
    try:
        return _import_object(path)
    except (ImportError, AttributeError):
        hint = moved_path_hint(path)
        if hint is None:
            raise
        raise ImportError(hint) from None


def _import_object(path: str) -> Any:
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr_path.split("."):
            obj = getattr(obj, part)
        return obj
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ImportError(f"{path!r} is no dotted path (expected 'pkg.mod:Class' or 'pkg.mod.Class')")
    return getattr(importlib.import_module(module_name), attr)


def env_creator(env: Any) -> Callable[[dict], Any]:
    """The callable ``env_config -> env`` for ``config.env``: a class or callable as is, a
    name registered with ``ray.tune.registry.register_env``, else a class path imported."""
    if not isinstance(env, str):
        return env

    registered = registered_env_creator(env)
    if registered is not None:
        return registered
    if env in BUILTIN_ENVS:
        return import_object(BUILTIN_ENVS[env])
    try:
        return import_object(env)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"env {env!r} is neither registered with ray.tune.registry.register_env nor an "
            f"importable class path such as 'my_pkg.my_env:MyEnv' ({type(e).__name__}: {e})"
        ) from None
