"""``rllib train file X.yaml --rehearse``: a recipe run as written, on a CPU machine.

A GPU recipe can break in ways that have nothing to do with GPUs: its dtype, learner
backend and ZeRO stage, runner and learner counts, micro-batches, behaviour log-prob mode,
replay, checkpoint and resume, the evaluator. A rehearsal keeps all of those and swaps only
what a CPU cannot hold, one printed line per swap (``rehearsal: <key>: <was> -> <now>
(<why>)``):

* the model -> ``rehearsal:<family>``: a randomly initialised model of the same
  transformers architecture family at tiny width, no download
  (:mod:`rllib_exgrpo.models.rehearsal`);
* GPUs -> CPU shares (``num_gpus_per_*`` -> 0; the CPUs are then shared out as for any run
  that asks for more CPUs than the machine has: ``rllib_exgrpo.rllib.resources``);
* token limits -> at most :data:`TOKEN_CAPS`; completions per iteration -> at most
  :data:`ROWS_PER_ITERATION` with ``minibatch_size`` scaled by the same factor, so the
  number of optimiser steps per iteration and of micro-batch passes per step stays as
  written (at least two passes where the recipe micro-batches);
* vLLM -> vLLM's CPU build where it is installed (its KV cache sized in bytes, since a CPU
  has no GPU memory to take a fraction of), else the HF backend;
* a data file that does not exist here -> the built-in ``arithmetic`` set;
* the reward -> the built-in reward ``rehearsal`` (:func:`rllib_exgrpo.envs.rewards.rehearsal_reward`,
  varied per question and completion), selected as any reward is: ``env_config.reward_fns``
  is the recipe's rewards (``math`` when it sets none) at weight 0 followed by ``rehearsal``
  at weight 1, so the verifier still runs on every completion while a random model, which
  never answers correctly, still gets groups with variance, buckets, the delayed start and
  replay;
* the evaluator -> at most :data:`HELDOUT_QUESTIONS` questions, every
  :data:`HELDOUT_INTERVAL` iterations;
* bookkeeping: the experiment (and its MLflow experiment) is named ``<name>-rehearsal`` so a
  rehearsal never mixes with real results, ``checkpoint_at_end`` is on (resume needs a
  checkpoint), and without ``--stop`` it stops after :data:`DEFAULT_ITERATIONS` iterations.

Nothing is special-cased per recipe: the same rules apply to any experiment file.
``docs/rehearsal.md`` has the table of what is kept and what is swapped.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from rllib_exgrpo.cli.experiment_file import SEARCH_SPACES, deep_merge
from rllib_exgrpo.models.recipe import tiny_recipe
from rllib_exgrpo.models.rehearsal import architecture_family, is_rehearsal_spec, rehearsal_spec
from rllib_exgrpo.planning.shapes import model_shape
from rllib_exgrpo.cli.registry import resolve_algorithm
from rllib_exgrpo.rllib.algorithm import ExGRPO

#: Token limits a CPU rehearsal runs at (prompts are left-truncated, as in any run).
TOKEN_CAPS = {"max_prompt_tokens": 128, "max_response_tokens": 16, "heldout_max_response_tokens": 16}
#: Completions sampled per iteration at most (ExGRPO/GRPO), or learner rows (RLlib's PPO).
ROWS_PER_ITERATION = 128
HELDOUT_QUESTIONS = 8
HELDOUT_INTERVAL = 2
DEFAULT_ITERATIONS = 2
SUFFIX = "-rehearsal"
#: vLLM's CPU build: a KV cache of a fixed size instead of a share of GPU memory.
#: No graph compilation: the CPU build's compile says nothing about a GPU's, and it is most
#: of an engine's start-up on a CPU.
VLLM_CPU_KWARGS = {"kv_cache_memory_bytes": 64 << 20, "block_size": 32, "enforce_eager": True}
#: Data sets that come with the project (anything else is a file).
BUILTIN_DATASETS = ("arithmetic", "operators")
REHEARSAL_DATASET = "arithmetic"


@dataclass(frozen=True)
class Swap:
    """One thing a rehearsal changed, and why."""

    key: str
    was: Any
    now: Any
    why: str

    def line(self) -> str:
        return f"{self.key}: {self.was!r} -> {self.now!r} ({self.why})"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def rehearse_experiments(
    data: Mapping[str, Any],
    *,
    config_overrides: Optional[Mapping[str, Any]] = None,
    stop_given: bool = False,
    vllm: Optional[bool] = None,
) -> Tuple[Dict[str, Any], Dict[str, List[Swap]]]:
    """The experiment file's ``data`` as a rehearsal runs it, and each experiment's swaps.

    ``config_overrides`` (``--config``) are merged in first, so that the rules see the
    values that would run; ``stop_given``: the command line sets ``--stop`` (else the
    rehearsal stops after :data:`DEFAULT_ITERATIONS` iterations)."""
    vllm = vllm_installed() if vllm is None else vllm
    out: Dict[str, Any] = {}
    swaps: Dict[str, List[Swap]] = {}
    for name, spec in data.items():
        if not isinstance(spec, dict):
            out[name] = spec  # the experiment check reports it
            continue
        spec = copy.deepcopy(spec)
        found: List[Swap] = []
        config = spec.get("config") if isinstance(spec.get("config"), dict) else {}
        config = deep_merge(config, config_overrides) if config_overrides else config
        spec["config"] = config
        _rehearse_search(spec, found)  # first: the rules below then see the values that run
        spec["config"] = _rehearse_config(spec["config"], spec.get("run"), vllm, found)
        _rehearse_run_settings(spec, stop_given, found)
        out[f"{name}{SUFFIX}"] = spec
        swaps[f"{name}{SUFFIX}"] = found
    return out, swaps


def _rehearse_run_settings(spec: Dict[str, Any], stop_given: bool, found: List[Swap]) -> None:
    ckpt = spec.get("checkpoint_config")
    ckpt = dict(ckpt) if isinstance(ckpt, dict) else {}
    if not ckpt.get("checkpoint_at_end"):
        found.append(
            Swap(
                "checkpoint_config.checkpoint_at_end",
                ckpt.get("checkpoint_at_end"),
                True,
                "a rehearsal checkpoints at its end, so that --resume can continue it",
            )
        )
        ckpt["checkpoint_at_end"] = True
        spec["checkpoint_config"] = ckpt
    if not stop_given:
        was = spec.get("stop")
        spec["stop"] = {"training_iteration": DEFAULT_ITERATIONS}
        found.append(Swap("stop", was, spec["stop"], "no --stop given"))
    mlflow = spec.get("mlflow")
    if isinstance(mlflow, dict) and isinstance(mlflow.get("experiment_name"), str):
        now = mlflow["experiment_name"] + SUFFIX
        found.append(Swap("mlflow.experiment_name", mlflow["experiment_name"], now, "kept apart from real runs"))
        spec["mlflow"] = {**mlflow, "experiment_name": now}


def _rehearse_search(spec: Dict[str, Any], found: List[Swap]) -> None:
    """A search rehearses as one trial: each grid or choice at its first value, other search
    spaces sampled once (``num_samples: 1``). The rehearsal checks the recipe's path on this
    machine; the search itself is Tune's (one trial of a GPU search is minutes on a CPU)."""

    def first(settings: Dict[str, Any], where: str) -> None:
        for key, value in list(settings.items()):
            if _is_space(value) and next(iter(value)) in ("grid_search", "choice"):
                options = next(iter(value.values()))
                if isinstance(options, list) and options:
                    _set(settings, where, key, options[0], "a search rehearses as one trial: its first value", found)
            elif isinstance(value, dict) and not _is_space(value):
                first(value, f"{where}{key}.")

    config = spec.get("config")
    if isinstance(config, dict):
        first(config, "")
    if int(spec.get("num_samples", 1) or 1) > 1:
        found.append(Swap("num_samples", spec["num_samples"], 1, "a search rehearses as one trial"))
        spec["num_samples"] = 1


def _is_space(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and next(iter(value)) in SEARCH_SPACES


def _llm_family_defaults(run: Any) -> Optional[Any]:
    """The default config of ``run`` when it is this project's algorithm family (whose
    LLM settings are top-level config fields), else None."""
    try:
        cls = resolve_algorithm(run)
    except Exception:  # noqa: BLE001 - a bad `run:` is reported by the experiment check
        return None
    return cls.get_default_config() if isinstance(cls, type) and issubclass(cls, ExGRPO) else None


def _rehearse_config(config: Dict[str, Any], run: Any, vllm: bool, found: List[Swap]) -> Dict[str, Any]:
    config = copy.deepcopy(config)
    defaults = _llm_family_defaults(run)
    _to_cpu(config, found)
    if defaults is None and "LLMEnvRunner" not in str(config.get("env_runner_cls", "")):
        return config  # not an LLM run (e.g. RLlib's PPO on CartPole): only the GPUs change
    # LLM settings live as top-level fields (ExGRPO / GRPO) or in the module's model_config
    # (RLlib's PPO on this project's runner), the model under "model" there.
    places: List[Tuple[Dict[str, Any], str, str]] = [(config, "", "model_name_or_path")]
    if isinstance(config.get("model_config"), dict):
        places.append((config["model_config"], "model_config.", "model"))
    for settings, where, model_key in places:
        model = settings.get(model_key)
        if model is None and defaults is not None and not where:
            model = defaults.model_name_or_path  # the field's default runs: swap that
        if model is not None:
            _swap_model(settings, where, model_key, model, found)
        _cap_tokens(settings, where, found)
        _swap_backend(settings, where, vllm, found)
    _scale_batch(config, defaults, found)
    _rehearse_data(config, found)
    _rehearse_heldout(config, defaults, found)
    return config


def _set(settings: Dict[str, Any], where: str, key: str, now: Any, why: str, found: List[Swap]) -> None:
    found.append(Swap(f"{where}{key}", settings.get(key), now, why))
    settings[key] = now


def _swap_model(settings, where, key, model, found) -> None:

    if _is_space(model) or is_rehearsal_spec(model):
        return
    family, source = architecture_family(str(model))
    # The recipe model's vocabulary and tying are kept, so every vocabulary-sized buffer
    # runs at its real width; the shape comes from its config.json or the published table.
    name = str(model)
    tiny = name == "tiny" or name.startswith("tiny:")
    if tiny:
        shape = None  # the rehearsal tokenizer is the tiny model's own: its vocabulary already
    else:
        try:
            shape = model_shape(name)
        except Exception:  # noqa: BLE001 - an unknown model keeps the tiny tokenizer's vocabulary
            shape = None
    if shape is not None:
        spec = rehearsal_spec(family, shape.vocab_size, shape.tie_word_embeddings)
        vocab = f"its vocabulary of {shape.vocab_size:,} and {'tied' if shape.tie_word_embeddings else 'untied'} embeddings kept"
    elif tiny:
        tied = bool(tiny_recipe()["model"]["tie_word_embeddings"])
        spec = rehearsal_spec(family, None, tied)
        vocab = f"its own tokenizer's vocabulary and {'tied' if tied else 'untied'} embeddings"
    else:
        spec, vocab = rehearsal_spec(family), "its vocabulary unknown here: the tiny tokenizer's"
    _set(settings, where, key, spec, f"a random {family} at tiny width (family from {source}), {vocab}; no download", found)


def _cap_tokens(settings, where, found) -> None:
    budget = settings.get("learner_micro_batch_tokens")
    widths = [settings.get(k) for k in ("max_prompt_tokens", "max_response_tokens")]
    if isinstance(budget, int) and not isinstance(budget, bool) and all(isinstance(w, int) and not isinstance(w, bool) for w in widths):
        # The same rows per pass at full width: the budget scales with the token limits.
        full, capped = sum(widths), sum(min(w, TOKEN_CAPS[k]) for w, k in zip(widths, ("max_prompt_tokens", "max_response_tokens")))
        if capped < full:
            _set(
                settings,
                where,
                "learner_micro_batch_tokens",
                max(1, round(budget * capped / full)),
                "scaled with the token limits: the same rows per pass at full width",
                found,
            )
    for key, cap in TOKEN_CAPS.items():
        value = settings.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            _set(settings, where, key, cap, "token limits scaled down for a CPU", found)


#: The most vLLM engines a rehearsal starts on one CPU machine: a colocated recipe has one per
#: learner, each a process importing vLLM and its CPU kernels (~1.5 GB resident); eight of them
#: next to their learners overrun a 2-core, 24 GB machine.
MAX_CPU_ENGINES = 4


def _swap_backend(settings, where, vllm: bool, found) -> None:
    if settings.get("generation_backend") != "vllm":
        return
    learners = settings.get("num_learners")
    if vllm and settings.get("colocate") and isinstance(learners, int) and learners > MAX_CPU_ENGINES:
        _set(
            settings,
            where,
            "generation_backend",
            "hf",
            f"colocate with {learners} learners would start "
            f"{learners} vLLM engines of the CPU build on this machine (at most {MAX_CPU_ENGINES}): the HF backend "
            "samples in each learner instead; the weight push, ZeRO-3 gathers and turn order run as with vLLM",
            found,
        )
        settings.pop("vllm_kwargs", None)
        return
    if not vllm:
        _set(
            settings,
            where,
            "generation_backend",
            "hf",
            "vLLM is not installed here: the HF backend samples instead (install vLLM's CPU build to rehearse the engine)",
            found,
        )
        settings.pop("vllm_kwargs", None)
        return
    kwargs = settings.get("vllm_kwargs") if isinstance(settings.get("vllm_kwargs"), dict) else {}
    now = {k: v for k, v in kwargs.items() if k not in ("gpu_memory_utilization", "max_model_len")}
    now.update(VLLM_CPU_KWARGS)
    why = (
        "vLLM's CPU build: a KV cache of fixed bytes, not a share of GPU memory; max_model_len follows the "
        "scaled token limits; no graph compilation"
    )
    if settings.get("colocate"):
        why += (
            "; colocate: the CPU build has no sleep mode, so each learner's engine skips its sleep and wake "
            "calls (the turn's other calls, the weight push included, run as on a GPU)"
        )
    _set(settings, where, "vllm_kwargs", now, why, found)


def _to_cpu(config, found) -> None:
    for key in ("num_gpus_per_env_runner", "num_gpus_per_learner", "num_gpus"):
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            _set(config, "", key, 0, "GPUs -> CPU shares", found)


def _value(config, defaults, key, fallback=None):
    value = config.get(key)
    if value is None and defaults is not None:
        value = getattr(defaults, key, None)
    return fallback if value is None or _is_space(value) else value


def _scale_batch(config, defaults, found) -> None:
    """Fewer completions per iteration, the same optimiser steps and micro-batch passes."""
    minibatch = _value(config, defaults, "minibatch_size")
    if defaults is not None:
        questions = _value(config, defaults, "questions_per_step")
        group = _value(config, defaults, "group_size")
        if not (isinstance(questions, int) and isinstance(group, int)) or questions * group <= ROWS_PER_ITERATION:
            return
        keep = max(1, ROWS_PER_ITERATION // group)
        micro = _value(config, defaults, "learner_micro_batch_rows")
        budget = _value(config, defaults, "learner_micro_batch_tokens")
        if isinstance(budget, int) and not isinstance(budget, bool):  # rows of a pass at full width
            width = sum(_value(config, defaults, k, 1) for k in ("max_prompt_tokens", "max_response_tokens"))
            micro = min(micro, max(1, budget // width)) if isinstance(micro, int) else max(1, budget // width)
        if isinstance(micro, int) and isinstance(minibatch, int):
            # At least two micro-batch passes per learner and step, as in the recipe.
            keep = max(keep, math.ceil(2 * micro * questions / minibatch))
        keep = min(questions, keep)
        if keep == questions:
            return
        factor = keep / questions
        _set(config, "", "questions_per_step", keep, f"{keep * group} completions per iteration on a CPU", found)
    else:
        rows = config.get("train_batch_size_per_learner")
        if not isinstance(rows, int) or rows <= ROWS_PER_ITERATION:
            return
        factor = ROWS_PER_ITERATION / rows
        _set(config, "", "train_batch_size_per_learner", ROWS_PER_ITERATION, "learner rows scaled down for a CPU", found)
    if isinstance(minibatch, int) and not _is_space(config.get("minibatch_size")):
        _set(
            config,
            "",
            "minibatch_size",
            max(1, round(minibatch * factor)),
            "scaled with the batch: the same optimiser steps per iteration",
            found,
        )


def _is_missing_file(value: Any) -> bool:
    if not isinstance(value, (str, os.PathLike)) or _is_space(value):
        return False
    text = os.fspath(value)
    if text.split(":", 1)[0] in BUILTIN_DATASETS:
        return False
    return not os.path.exists(os.path.expanduser(text))


def _rehearse_data(config, found) -> None:
    env_config = config.get("env_config")
    env_config = dict(env_config) if isinstance(env_config, dict) else {}
    if _is_missing_file(env_config.get("dataset")):
        _set(env_config, "env_config.", "dataset", REHEARSAL_DATASET, "no such file here: the built-in set", found)
    _rehearse_reward(env_config, found)
    config["env_config"] = env_config
    if _is_missing_file(config.get("heldout_dataset")):
        _set(config, "", "heldout_dataset", REHEARSAL_DATASET, "no such file here: the built-in set", found)


def _recipe_rewards(env_config: Dict[str, Any]) -> List[str]:
    """The reward specs the recipe selects (``math`` when it selects none here)."""
    one, many = env_config.get("reward_fn"), env_config.get("reward_fns")
    if isinstance(one, str):
        return [one]
    if isinstance(many, (list, tuple)) and many and all(isinstance(x, str) for x in many):
        return list(many)
    return ["math"]


def _rehearse_reward(env_config: Dict[str, Any], found: List[Swap]) -> None:
    """The recipe's rewards keep running at weight 0; the built-in ``rehearsal`` reward scores."""
    kept = _recipe_rewards(env_config)
    if "rehearsal" in kept:
        return
    if env_config.get("reward_fn") is not None:
        found.append(Swap("env_config.reward_fn", env_config.pop("reward_fn"), None, "moved into reward_fns, at weight 0"))
    _set(
        env_config,
        "env_config.",
        "reward_fns",
        kept + ["rehearsal"],
        "a random model never answers correctly: "
        "the built-in reward 'rehearsal' draws rewards per question and completion, so that groups vary, "
        "buckets fill, the delayed start fires and replay runs",
        found,
    )
    _set(
        env_config,
        "env_config.",
        "reward_weights",
        [0.0] * len(kept) + [1.0],
        "the recipe's rewards still run on every completion (weight 0); the score is the stand-in",
        found,
    )


def _rehearse_heldout(config, defaults, found) -> None:
    if defaults is None or not _value(config, defaults, "heldout_dataset"):
        return
    questions = _value(config, defaults, "heldout_num_questions")
    if isinstance(questions, int) and questions > HELDOUT_QUESTIONS:
        _set(config, "", "heldout_num_questions", HELDOUT_QUESTIONS, "a smaller held-out set", found)
    interval = _value(config, defaults, "heldout_interval")
    if isinstance(interval, int) and interval > HELDOUT_INTERVAL:
        _set(config, "", "heldout_interval", HELDOUT_INTERVAL, "the evaluator runs within the rehearsal", found)
