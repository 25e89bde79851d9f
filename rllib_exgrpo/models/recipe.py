"""The tiny model's recipe: everything that shapes a build, and the key the cache hashes.

A recipe (:func:`tiny_recipe`) is a JSON-serialisable dict: the model's shape, the tokenizer's
size, the warm start's data, optimiser and stopping rule, the evaluation, and a fingerprint
of the data the build would see. Its hash (:func:`recipe_key`) names the cache folder
``tiny-<key>``, so any change rebuilds, and the shipped folders (``shipped``) are found by it.

The options beyond seed, target, levels and length:

* ``task``: the family the warm start learns, ``"arithmetic"`` (the default model) or
  ``"operators"`` (:mod:`rllib_exgrpo.envs.operators`: format and arithmetic with every
  meaning guessed, see :data:`OPERATORS_TASK`; ``levels`` are then chain lengths, default
  1-3).
* ``known_families`` > 0 (operators only) adds that many *other* families, tagged after the
  task's own, whose solutions always show their true meanings: the warm start then learns
  that a meaning is read off the family tag and the symbol, without seeing any meaning of
  the families the RL task uses (each family's table is drawn on its own).
* ``tag_tokens`` (operators only) gives every family tag (``[F07]``) a token of its own. The
  512-token BPE otherwise spells a tag with the digit tokens the operands use, so a family's
  identity lives in the embeddings every question shares, and what RL learns about one
  family's meanings spills onto all others; a tag token gives each family a representation
  of its own, as a large model's vocabulary and width give distinct names.
* ``overrides``: a nested dict merged into the defaults, e.g. ``{"model":
  {"num_hidden_layers": 2}, "eval": {"eval_every": 25}}``; unknown keys raise.
* ``icl_fraction`` > 0 makes the model able to read worked examples in its prompt (the
  warm start's in-context prefixes); at 0 the recipe has no ``icl`` section, so the default
  model's cache key is what it was before the option existed.
* ``boxed_fraction`` < 1 makes a *format-weak* warm start (:data:`ANSWER_FORMAT`): each time
  a worked solution is drawn it ends in ``\\boxed{N}`` with that probability and in
  ``Answer: N`` otherwise, so the model computes as well as the default one but boxes about
  that share of its answers, and the verifier (reward only for a boxed, correct answer)
  rewards about ``boxed_fraction`` x its accuracy. The build's stop then reads accuracy in
  either format (``target_pass1`` as usual); the report adds the boxed share.
* ``continue_steps`` > 0 makes a *continued* warm start: the build loads the model of the
  same recipe without ``icl`` and ``continue`` (built or copied first; its key is
  ``recipe["continue"]["from"]``), keeps its tokenizer, and trains exactly that many more
  steps of this recipe, the learning rate warming up again and decaying over those steps,
  with no early stop. What it is for: teaching a built model to read in-context examples
  (``icl``) costs a few hundred steps, where a from-scratch build with them pays for the
  longer rows on all of its steps.

An option left at its default adds nothing to the recipe, so every existing key stays.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional, Sequence

from rllib_exgrpo.models.tiny_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS
from rllib_exgrpo.envs import arithmetic, operators
from rllib_exgrpo.envs.operators import MAX_FAMILIES
from rllib_exgrpo.envs.prompting import DEFAULT_INSTRUCTION

#: Bump when the build procedure changes in a way the recipe does not capture. Version 2:
#: the build runs with pinned kernels (``pinned_build``) and evaluates through the env's
#: own sampling and verifier (version-1 folders were built by earlier code under the same
#: key). Version 3: MKL on its vendor-neutral COMPATIBLE branch and a fused AdamW, so that
#: an AMD CPU builds the same bits as an Intel one (version 2 held across Intel CPUs only).
RECIPE_VERSION = 3

#: Worked examples in an ICL-trained prompt (XRPO's icl_num_examples default).
ICL_NUM_EXAMPLES = 2
#: The in-context examples' format: XRPO's (``xrpo.icl.DEFAULT_TEMPLATE``, what its seeding
#: prepends at training time). An ``icl`` recipe records it, so a change rebuilds the model;
#: it is spelt here because models sits below xrpo, and tests/test_models.py checks that the
#: two are the same.
ICL_TEMPLATE = "Question: {question}\nSolution: {completion}\n\n"


#: The families a tiny model can be warm-started on.
TASKS = ("arithmetic", "operators")

#: The hidden-operator warm start (``task="operators"``): every worked solution shows
#: meanings drawn afresh each time the example is drawn (not once per question, which a
#: small model would memorise per question), so the model learns the format and the
#: arithmetic and guesses each meaning uniformly. The build stops when a share
#: ``target_consistency`` of its sampled held-out answers read back as well-formed solutions
#: whose arithmetic is right under the meanings they chose (``operators.read_worked_solution``):
#: its pass@1 then sits at the guessing level by chain length, which the report records next
#: to the exact guessing rates. ``target_pass1`` and ``eval.band`` do not apply.
OPERATORS_TASK: dict[str, Any] = {
    "name": "operators",
    "families": 24,
    "target_consistency": 0.95,
}
#: Recipe values that differ for the operators task (longer answers, a larger eval set
#: because the stop reads a rate near 1; each check costs ~7 s, every 50 steps).
OPERATORS_TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "eval": {"n_eval": 512, "eval_every": 50, "eval_start": 300, "max_new_tokens": 96},
}

#: The format-weak warm start (``boxed_fraction`` < 1): the answer ending a worked solution
#: is written ``\\boxed{N}`` with probability ``boxed_fraction`` and ``other`` otherwise,
#: drawn afresh each time an example is drawn (a format fixed per question could be learnt
#: per question). The ``Answer: N`` line is what a base LLM that was never asked for a box
#: tends to write: the verifier gives it 0, so rewarded answers are rare although the
#: arithmetic is right, and what a success teaches (box the answer) holds for every question.
ANSWER_FORMAT: dict[str, Any] = {"other": "Answer: {answer}"}


#: Everything that shapes the result besides the public arguments.
_DEFAULTS: dict[str, Any] = {
    "tokenizer": {"vocab_size": 512, "min_frequency": 2},
    "model": {
        "hidden_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "intermediate_size": 512,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    },
    "train": {
        "n_train": 20000,
        "batch_size": 64,
        "lr": 3e-3,
        "min_lr_ratio": 0.1,
        "warmup_steps": 50,
        "weight_decay": 0.01,
        "betas": (0.9, 0.98),
        "grad_clip": 1.0,
        # Torch intra-op threads, fixed (results are bitwise reproducible only for a fixed
        # thread count). Measured here on idle cores, 3 layers, batch 64: 1 thread 0.35
        # s/step, 2 threads 0.20 s/step. But when anything else keeps the cores busy, two
        # spin-waiting OpenMP threads collapse (3.7-5 s/step at load ~6, 1 thread 0.7
        # s/step): on a shared box use {"train": {"num_threads": 1}} / "tiny:threads=1".
        "num_threads": 2,
        "level_balanced": True,
    },
    "eval": {
        "n_eval": 256,
        "eval_seed": 0,
        # Every 10 steps: pass@1 rises fast once the model gets carries (0.25 -> 0.39 in 50
        # steps, measured), and a coarser check overshoots the target band's lower edge by
        # that much, leaving RL a stronger start (held-out greedy 0.455 instead of ~0.35)
        # and less room. Each check costs ~2 s.
        "eval_every": 10,
        "eval_start": 300,
        "band": 0.05,
        "max_new_tokens": 40,
        "temperature": 1.0,
        "batch_size": 256,
    },
}


def tiny_recipe(
    *,
    seed: int = 0,
    target_pass1: float = 0.35,
    levels: Sequence[int] = (1, 2, 3, 4),
    max_steps: int = 1500,
    overrides: Optional[dict] = None,
    icl_fraction: float = 0.0,
    task: str = "arithmetic",
    known_families: int = 0,
    tag_tokens: bool = False,
    boxed_fraction: float = 1.0,
    continue_steps: int = 0,
) -> dict:
    """The full, JSON-serialisable recipe of a tiny model (what the cache key hashes).

    ``seed`` seeds the data, initialisation, batch order and evaluation sampling; the warm
    start stops at the first held-out pass@1 >= ``target_pass1 - eval.band`` or at
    ``max_steps``; ``levels`` are the arithmetic levels trained and evaluated on. The other
    options are described in this module's docstring.
    """
    _check_options(
        target_pass1=target_pass1,
        max_steps=max_steps,
        icl_fraction=icl_fraction,
        task=task,
        boxed_fraction=boxed_fraction,
        continue_steps=continue_steps,
        known_families=known_families,
        tag_tokens=tag_tokens,
    )
    if task == "operators" and tuple(levels) == (1, 2, 3, 4):
        levels = (1, 2, 3)  # the arithmetic default: chain lengths 1-3 instead
    levels = tuple(int(lv) for lv in levels)
    recipe = _base_recipe(seed, target_pass1, levels, max_steps, overrides)
    if icl_fraction > 0:
        recipe["icl"] = {"fraction": float(icl_fraction), "num_examples": ICL_NUM_EXAMPLES, "template": ICL_TEMPLATE}
    if task == "operators":
        _add_operators_task(recipe, known_families, tag_tokens, overrides)
    if boxed_fraction < 1.0:  # absent unless used, so every other model's key is unchanged
        recipe["answer_format"] = {**ANSWER_FORMAT, "boxed_fraction": float(boxed_fraction)}
    if continue_steps:  # absent unless used
        base = tiny_recipe(
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
        recipe["continue"] = {"from": f"tiny-{recipe_key(base)}", "steps": int(continue_steps)}
    recipe["data_fingerprint"] = _data_fingerprint(recipe)
    return recipe


def _check_options(*, target_pass1, max_steps, icl_fraction, task, boxed_fraction, continue_steps, known_families, tag_tokens) -> None:
    """Raise ``ValueError`` naming the first option of :func:`tiny_recipe` out of range."""
    if not 0.0 < target_pass1 <= 1.0:
        raise ValueError(f"target_pass1 must be in (0, 1], got {target_pass1}")
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    if not 0.0 <= icl_fraction < 1.0:
        raise ValueError(f"icl_fraction must be in [0, 1), got {icl_fraction}")
    if task not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
    if not 0.0 < boxed_fraction <= 1.0:
        raise ValueError(f"boxed_fraction must be in (0, 1], got {boxed_fraction}")
    if continue_steps < 0:
        raise ValueError(f"continue_steps must be >= 0, got {continue_steps}")
    if known_families and task != "operators":
        raise ValueError(f"known_families applies to task='operators' only, got task={task!r}")
    if tag_tokens and task != "operators":
        raise ValueError(f"tag_tokens applies to task='operators' only, got task={task!r}")
    most_known = MAX_FAMILIES - OPERATORS_TASK["families"]  # the tags F00-F99 shared with the task's
    if not 0 <= known_families <= most_known:
        raise ValueError(f"known_families must be in [0, {most_known}], got {known_families}")


def _base_recipe(seed: int, target_pass1: float, levels: tuple, max_steps: int, overrides: Optional[dict]) -> dict:
    """The recipe's sections every tiny model has: the defaults with ``overrides`` merged in."""
    recipe: dict[str, Any] = {
        "kind": "tiny-qwen2-arithmetic",
        "version": RECIPE_VERSION,
        "seed": int(seed),
        "target_pass1": float(target_pass1),
        "levels": list(levels),
        "max_steps": int(max_steps),
        "instruction": DEFAULT_INSTRUCTION,
        "chat_template": CHAT_TEMPLATE,
        "special_tokens": list(SPECIAL_TOKENS),
    }
    for section, values in _DEFAULTS.items():
        recipe[section] = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    for section, values in (overrides or {}).items():
        if section not in _DEFAULTS or not isinstance(values, dict):
            raise ValueError(f"unknown recipe section {section!r}; known: {sorted(_DEFAULTS)}")
        unknown = set(values) - set(_DEFAULTS[section])
        if unknown:
            raise ValueError(f"unknown {section} options {sorted(unknown)}; known: {sorted(_DEFAULTS[section])}")
        recipe[section].update(values)
    return recipe


def _add_operators_task(recipe: dict, known_families: int, tag_tokens: bool, overrides: Optional[dict]) -> None:
    """The operators task's section and its recipe values (an explicit override wins).
    Only a non-default task adds a section, so the default model's key is unchanged."""
    recipe["task"] = dict(OPERATORS_TASK)
    if known_families:  # only when used, so the first operators model's key is unchanged
        recipe["task"]["known_families"] = int(known_families)
    if tag_tokens:  # the same: absent unless used
        recipe["task"]["tag_tokens"] = True
    for section, values in OPERATORS_TASK_DEFAULTS.items():
        recipe[section].update({k: v for k, v in values.items() if k not in (overrides or {}).get(section, {})})


def _data_fingerprint(recipe: dict) -> str:
    """Fingerprint of the data the build would see: a change in the generator rebuilds."""
    sample = task_problems(recipe, "train", 16) + task_problems(recipe, "test", 4)
    return hashlib.sha256("\n".join(f"{p.question}|{p.solution}|{p.ground_truth}" for p in sample).encode()).hexdigest()[:16]


def task_problems(recipe: dict, split: str, n: int) -> list:
    """``n`` problems of the recipe's task: warm-start questions (``"train"``, drawn with the
    recipe's seed) or held-out ones (``"test"``, the eval seed; true meanings)."""
    seed = recipe["seed"] if split == "train" else recipe["eval"]["eval_seed"]
    task = recipe.get("task")
    if task is None:
        return arithmetic.generate(n, split=split, seed=seed, levels=tuple(recipe["levels"]))

    families = task["families"] + (task.get("known_families", 0) if split == "train" else 0)
    return operators.generate(n, split=split, seed=seed, families=families, lengths=tuple(recipe["levels"]))


def recipe_key(recipe: dict) -> str:
    """A short stable hash of a recipe."""
    blob = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]
