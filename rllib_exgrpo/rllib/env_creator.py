"""Env specifications as RLlib configs hold them -> a callable that builds the env.

Every YAML file names its env as a class path (``envs.reasoning_env:ReasoningEnv``), and a
Python user may write the same string in ``config.environment(...)``. RLlib resolves such a
string only if someone registered it with Tune; a plain-Python config, or an algorithm
restored with ``Algorithm.from_checkpoint`` in a fresh process, has not. The env runner
therefore resolves strings here: a registered name wins, else the string is imported.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def import_object(path: str) -> Any:
    """Import ``"pkg.mod:attr.sub"`` or ``"pkg.mod.attr"``; raise ImportError/AttributeError."""
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
    from ray.tune.registry import ENV_CREATOR, _global_registry

    if _global_registry.contains(ENV_CREATOR, env):
        return _global_registry.get(ENV_CREATOR, env)
    try:
        return import_object(env)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"env {env!r} is neither registered with ray.tune.registry.register_env nor an "
            f"importable class path such as 'envs.reasoning_env:ReasoningEnv' ({type(e).__name__}: {e})"
        ) from None
