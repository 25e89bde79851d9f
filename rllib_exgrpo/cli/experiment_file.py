"""Reading an experiment file: strict YAML, Tune search spaces, and merging overrides.

Strict: duplicate keys are errors, and ``1e-3`` is a float as in YAML 1.2 (not the string
PyYAML makes of it). The file schema is in ``cli/experiment.py``.
"""

from __future__ import annotations


import copy
import os
import re
from pathlib import Path
from typing import Any, Dict, Mapping, Tuple, Union

import yaml

from rllib_exgrpo.cli.registry import CliConfigError

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


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _make_domain(kind: str, args: Any, where: str) -> Any:
    from ray import tune

    fn_name, arities = SEARCH_SPACES[kind]
    if kind in ("grid_search", "choice"):
        if not isinstance(args, list) or not args:
            raise CliConfigError(f"{where}: `{kind}` needs a non-empty list, got {args!r}.")
        return getattr(tune, fn_name)(list(args))
    if not isinstance(args, list) or len(args) not in arities or not all(is_number(a) for a in args):
        shape = " or ".join(str(n) for n in arities)
        raise CliConfigError(f"{where}: `{kind}` needs a list of {shape} numbers, got {args!r}.")
    if kind in ("randint", "qrandint", "lograndint", "qlograndint") and not all(isinstance(a, int) for a in args[:2]):
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
        if isinstance(v, dict) and isinstance(out.get(k), dict) and not _is_search_space(v) and not _is_search_space(out[k]):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# -------------------------------------------------------------- config key checks
