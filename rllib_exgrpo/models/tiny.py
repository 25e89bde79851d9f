"""The embedded tiny model: a ~0.8M-parameter Qwen2 warm-started on the arithmetic family.

The default training job must run on a fresh CPU machine with no downloads, so the project
builds its own small causal LM and tokenizer on first use and caches the result:

1. **Tokenizer.** A byte-level BPE with exactly Qwen2's pre-tokenization, checked to reload
   unchanged through ``AutoTokenizer`` (:mod:`rllib_exgrpo.models.tiny_tokenizer`).
2. **Model.** A transformers ``Qwen2ForCausalLM`` (hidden 128, 3 layers, 4 heads of 32,
   MLP 512, tied embeddings: about 0.83M parameters). Measured here, 3 layers reached the
   target band in fewer steps than 4 (700 vs 900 at batch 64) and cost ~25% less per step.
3. **Supervised warm start** on ``render_prompt(p.question, tokenizer=tok) + p.solution +
   eos`` (loss on the completion only), AdamW with warmup + cosine decay. Every
   ``eval_every`` steps the held-out (``split="test"``) pass@1 at temperature 1.0 is
   measured; training stops at the first evaluation that reaches ``target_pass1 - band``
   (or at ``max_steps``). Stopping early, before the model is sure of itself, leaves RL a
   policy with room to improve and enough entropy to explore (:mod:`rllib_exgrpo.warm_start`).

Everything that shapes the result is the recipe (:mod:`rllib_exgrpo.models.recipe`).
The build runs in a child process with pinned numerics (``pinned_build``), so a recipe
gives the same weights on any x86-64 machine with AVX2, Intel or AMD (docs/warm_start.md).
Measured on 2 AMD EPYC cores (torch 2.13 CPU, transformers 5.24), default recipe (version
3), seed 0: stopped at step 630 after 504 s with held-out pass@1 0.305 at temperature 1
(levels 1-4: 0.69 / 0.48 / 0.05 / 0.16), mean token entropy 0.12 nats; 0.83M parameters,
vocab 322, prompts 31-37 tokens, completions 15-34 tokens. The step at which the model "gets" carries
varies with the seed: seed 1 was still at 0.25 when it hit ``max_steps=1500``
(``reached_target: false`` in the report, with a warning).

The folder is cached under ``cache_dir`` / ``$RLLIB_EXGRPO_CACHE`` / ``~/.cache/rllib_exgrpo``
in a subfolder keyed by a hash of the whole recipe, built once under a file lock
(:mod:`rllib_exgrpo.models.cache`). The default recipe's folder ships with the package
(``shipped``): a cache without it gets a verified copy in a second instead of a build
(``RLLIB_EXGRPO_REBUILD_MODEL=1`` builds instead).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

import rllib_exgrpo.models.shipped as shipped
from rllib_exgrpo.models.cache import WARM_START_FILE, build_cached, cache_root
from rllib_exgrpo.models.recipe import recipe_key, tiny_recipe

__all__ = ["WARM_START_FILE", "build_tiny_model", "load_tiny_model", "read_warm_start"]

_REBUILD_HINT = "RLLIB_EXGRPO_REBUILD_MODEL=1 on an empty cache builds it from its recipe instead"


def build_tiny_model(
    cache_dir: Optional[str] = None,
    *,
    seed: int = 0,
    target_pass1: float = 0.35,
    levels: Sequence[int] = (1, 2, 3, 4),
    max_steps: int = 1500,
    progress: bool = True,
    overrides: Optional[dict] = None,
    icl_fraction: float = 0.0,
    task: str = "arithmetic",
    known_families: int = 0,
    tag_tokens: bool = False,
    boxed_fraction: float = 1.0,
    continue_steps: int = 0,
) -> str:
    """Build (once) and return the folder of the warm-started tiny model.

    The folder loads offline with ``AutoModelForCausalLM.from_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)`` and holds ``warm_start.json`` (recipe, steps,
    wall time, held-out pass@1 overall and per level, mean token entropy, history).
    ``cache_dir`` is the cache root (default ``$RLLIB_EXGRPO_CACHE`` or
    ``~/.cache/rllib_exgrpo``); ``progress`` shows the build's progress; every other
    argument is the recipe's (:func:`~rllib_exgrpo.models.recipe.tiny_recipe`). A
    continued recipe (``continue_steps`` > 0) builds its base first, in the same cache root.
    A second call with the same recipe returns at once; concurrent callers wait for a single
    build.
    """
    # what a continued build's base shares with it (everything but icl and continue)
    base_args = dict(
        seed=seed,
        target_pass1=target_pass1,
        levels=levels,
        max_steps=max_steps,
        overrides=overrides,
        task=task,
        known_families=known_families,
        tag_tokens=tag_tokens,
        boxed_fraction=boxed_fraction,
    )
    recipe = tiny_recipe(**base_args, icl_fraction=icl_fraction, continue_steps=continue_steps)
    name = f"tiny-{recipe_key(recipe)}"
    if continue_steps:  # the base first, in the same cache root (the build reads it there)
        build_tiny_model(cache_dir, progress=progress, **base_args)
    took_shipped: list[bool] = []
    folder = build_cached(cache_root(cache_dir), name, _builder(name, recipe, progress, took_shipped))
    if took_shipped:
        print(
            f"rllib-exgrpo: tiny model {name}: copied the build shipped with the package (sha256 verified) to {folder} ({_REBUILD_HINT})",
            file=sys.stderr,
            flush=True,
        )
    return str(folder)


def _builder(name: str, recipe: dict, progress: bool, took_shipped: list):
    """The cache's builder for ``name``: a verified copy of the shipped folder when there is
    one (and no rebuild is asked for), else the pinned build of ``recipe``."""

    def builder(tmp: Path) -> None:
        # looked up when called: tests replace it
        from rllib_exgrpo.models.pinned_build import build_in_pinned_process

        if shipped.shipped_folder(name) is not None and not shipped.rebuild_requested():
            try:
                shipped.copy_verified(name, tmp)
                took_shipped.append(True)
                return
            except shipped.ShippedModelMismatch as exc:
                warnings.warn(f"{exc}: building the model from its recipe instead (minutes)", RuntimeWarning, stacklevel=4)
                for leftover in tmp.iterdir():
                    leftover.unlink()
        build_in_pinned_process(tmp, recipe, progress)

    return builder


def read_warm_start(path: str) -> dict:
    """The ``warm_start.json`` report of a built tiny model folder."""
    with open(os.path.join(path, WARM_START_FILE)) as fh:
        return json.load(fh)


def load_tiny_model(path: Optional[str] = None, **build_kwargs):
    """``(model, tokenizer)`` of a tiny model folder (built with ``build_kwargs`` if no path)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = path or build_tiny_model(**build_kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer
