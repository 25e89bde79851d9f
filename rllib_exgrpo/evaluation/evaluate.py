"""Benchmark evaluation of a policy: avg@k, pass@k and maj@k per data source.

Settings follow the ExGRPO / LUFFY papers (docs/ALGORITHMS.md, section 2): sampling
at temperature 0.6, top_p 1.0; AIME and AMC are scored as avg@32 (32 samples per
question), every other benchmark as avg@1. A data source gets 32 samples when its name
contains ``aime`` or ``amc`` (case-insensitive), 1 otherwise; ``k=`` overrides this.
``protocol="exgrpo"`` runs the paper's whole protocol (prompt, think format, budget, the
in- and out-of-distribution averages): :mod:`rllib_exgrpo.evaluation.protocol`.

What is evaluated (``model=``):

- a model name or path understood by :func:`rllib_exgrpo.models.resolve_model_path`
  (``"tiny"``, ``"smollm2"``, an HF folder or hub name);
- an RLlib checkpoint folder of this project's algorithms (ExGRPO / GRPO): the folder
  ``algo.save_to_path`` or Tune wrote, or a Tune trial folder (its latest
  ``checkpoint_*``), or the module folder itself. See :func:`load_policy_from_checkpoint`;
- an already loaded ``(model, tokenizer)`` pair (HF backend only).

Prompts are rendered by :class:`rllib_exgrpo.envs.ReasoningEnv` (the renderer the policy was trained
with) and completions scored by its verifier (``ReasoningEnv.score`` ->
``rllib_exgrpo.envs.rewards.score_batch``). Generation (``backend=``): the HF backend of the
training env runners in this process, or vLLM engines on every GPU, questions split
across them (:mod:`rllib_exgrpo.evaluation.engines`); ``"auto"`` picks vLLM where vLLM and a
GPU are present. Each question's completion budget is ``min(max_new_tokens, context -
prompt tokens)``, ``context`` being the model's ``max_position_embeddings`` (said in one line
when it binds); a prompt that leaves no room gets no completion and counts as wrong.

Repeated rows of a question are one question (:mod:`rllib_exgrpo.evaluation.data`).
Metrics and the report: ``metrics.py``; checkpoints: ``checkpoints.py``.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from rllib_exgrpo.envs.prompting import DEFAULT_INSTRUCTION
from rllib_exgrpo.evaluation.checkpoints import (
    CheckpointInfo,
    is_checkpoint,
    load_policy_from_checkpoint,
    read_checkpoint,
)
from rllib_exgrpo.evaluation.data import load_eval_problems
from rllib_exgrpo.evaluation.engines import (
    BackendError,
    completion_budgets,
    choose_backend,
)
from rllib_exgrpo.evaluation.paths import PolicyPathError, policy_source
from rllib_exgrpo.evaluation.metrics import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_PASS_KS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    EvalReport,
    QuestionResult,
    aggregate,
    pass_ks_for,
    resolve_k,
)
from rllib_exgrpo.envs.prompting import render_prompt
from rllib_exgrpo.envs.reasoning_env import ReasoningEnv
from rllib_exgrpo.envs.rewards import RewardResult
from rllib_exgrpo.evaluation.engines import (
    HFGenerator,
    VLLMGenerator,
    cluster_gpu_count,
    local_gpu_count,
    plan_engines,
    ray_address as pick_address,
)
from rllib_exgrpo.evaluation.export import export_checkpoint
from rllib_exgrpo.evaluation.protocol import get_protocol, group_averages, official_answer_text, rows_and_distinct
from rllib_exgrpo.generation.base import SamplingParams
from rllib_exgrpo.generation.sample_and_score import encode_prompt, stop_token_ids
from rllib_exgrpo.models import resolve_model_path
from rllib_exgrpo.models.loading import generation_config_holder, load_causal_lm, load_tokenizer, model_config_of, resolve_dtype


logger = logging.getLogger(__name__)
_UNSET: Any = object()


def _chunks(items: list, sizes: List[int], budget: int):
    """Consecutive slices of ``items`` whose ``sizes`` sum to about ``budget``."""
    start, total = 0, 0
    for i, s in enumerate(sizes):
        if total and total + s > budget:
            yield items[start:i], sizes[start:i]
            start, total = i, 0
        total += s
    if start < len(items):
        yield items[start:], sizes[start:]


def evaluate(
    model: Union[str, os.PathLike, Tuple[Any, Any]],
    sources: Sequence[Union[str, os.PathLike]],
    *,
    k: Union[None, int, Mapping[str, int]] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    max_new_tokens: Optional[int] = None,
    limit: Optional[int] = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    instruction: Optional[str] = _UNSET,
    system_prompt: Optional[str] = _UNSET,
    think_format: bool = _UNSET,
    pass_ks: Sequence[Union[int, str]] = DEFAULT_PASS_KS,
    split: str = "test",
    max_prompt_tokens: Optional[int] = None,
    reward_timeout_s: float = 5.0,
    keep_completions: bool = False,
    device: Optional[str] = None,
    progress: Union[bool, Callable[[str], None]] = False,
    backend: str = "auto",
    tensor_parallel_size: int = 1,
    num_engines: Optional[int] = None,
    ray_address: Optional[str] = None,
    dtype: Optional[str] = None,
    vllm_kwargs: Optional[dict] = None,
    protocol: Optional[str] = None,
) -> EvalReport:
    """Evaluate a policy on benchmark sources; see the module docstring for the metrics.

    Args:
        model: Model name/path (:func:`resolve_model_path`), RLlib checkpoint folder, or a
            ``(model, tokenizer)`` pair. Paths are relative to the working directory; one that
            is neither a checkpoint nor a model folder raises :class:`PolicyPathError`.
        sources: Benchmark files and/or ``"arithmetic[:opts]"`` specs.
        k: Samples per question: an int for every source, a {data_source: k} mapping
            (see :func:`resolve_k`), or None for the papers' defaults (:func:`default_k`).
            Greedy decoding (``temperature == 0``) always uses k = 1.
        temperature, top_p: Sampling (default, as the papers: 0.6, 1.0). 0 means greedy.
        max_new_tokens: Completion budget; default the protocol's (8192), else the
            checkpoint's ``max_response_tokens``, else 1024. Capped per question by the
            model's context.
        limit: Evaluate at most the first ``limit`` distinct questions of each data source.
        batch_size: Sequences per ``generate`` call (HF backend).
        seed: Seeds sampling (the global torch RNG is left as it was; vLLM engine ``e`` is
            seeded with ``seed + e``).
        instruction, system_prompt, think_format: Prompt settings passed to the env
            config; default: the checkpoint's ``env_config``, else the env's defaults.
            Not with ``protocol`` (it sets them).
        pass_ks: pass@j to report; ``"k"`` stands for each source's k. Entries larger than
            a source's k are left out for it.
        split: Split of ``arithmetic`` specs (held-out ``"test"``).
        max_prompt_tokens: Left-truncate prompts to this many tokens (default: no limit).
        reward_timeout_s: Verifier wall-clock limit per completion.
        keep_completions: Keep the completion texts in the report (and its JSON).
        device: Torch device of the HF backend; default CUDA when available, else CPU.
        progress: True prints progress lines to stderr; a callable receives them.
        backend: ``"auto"``, ``"vllm"`` or ``"hf"`` (:func:`choose_backend`).
        tensor_parallel_size: GPUs per vLLM engine.
        num_engines: vLLM engines (default: every GPU, ``gpus // tensor_parallel_size``).
        ray_address: Ray cluster whose GPUs the vLLM engines use (default ``RAY_ADDRESS``,
            else this machine's GPUs).
        dtype: Weights' dtype (``float32``, ``bfloat16``, ``float16``); default: float32 for
            HF, the model config's dtype for vLLM.
        vllm_kwargs: Extra ``vllm.LLM`` keyword arguments (``gpu_memory_utilization``, ...).
        protocol: ``"exgrpo"``: the paper's protocol (:mod:`rllib_exgrpo.evaluation.protocol`).
    """
    t_start = time.perf_counter()
    say = _progress_printer(progress)
    proto = get_protocol(protocol) if protocol else None
    temperature, top_p = _sampling(proto, temperature, top_p, instruction, system_prompt, think_format)
    _check_settings(temperature, top_p, batch_size, pass_ks)
    loaded = load_eval_problems(sources, limit=limit, split=split, keep_system=proto is not None)  # 1. data first
    _say_merged_rows(loaded, say)
    target = _Target.load(model, backend, device, dtype, ray_address, say)  # 2. the policy
    run = None
    try:
        env_config = _protocol_env() if proto else _prompt_settings(target.ckpt, instruction, system_prompt, think_format)
        budget = _max_new_tokens(max_new_tokens, target.ckpt, proto)
        run = _SourceRun(
            target,
            env_config,
            proto,
            budget,
            temperature,
            top_p,
            batch_size,
            seed,
            reward_timeout_s,
            max_prompt_tokens,
            keep_completions,
            say,
        )
        prepared = [run.prepare(src, k) for src in loaded]  # 3. prompts and budgets
        run.say_budget(progress)
        run.start(prepared, tensor_parallel_size=tensor_parallel_size, num_engines=num_engines, vllm_kwargs=vllm_kwargs)
        questions, seconds = _run_sources(run, prepared)  # 4. generate + verify, source by source
    finally:
        if run is not None:
            run.close()
        target.close()
    per_source, overall = _aggregate_sources(questions, seconds, pass_ks)  # 5. aggregate
    settings = _settings_record(run, target, loaded, k=k, k_used=run.k_used, pass_ks=pass_ks, limit=limit, split=split)
    groups = _protocol_groups(per_source, loaded) if proto is not None else None
    return EvalReport(
        model=target.label,
        settings=settings,
        sources=per_source,
        overall=overall,
        wall_time_s=round(time.perf_counter() - t_start, 3),
        questions=questions,
        groups=groups,
    )


def _sampling(proto, temperature, top_p, instruction, system_prompt, think_format) -> Tuple[float, float]:
    """``(temperature, top_p)``: given, else the protocol's, else the papers' defaults. A
    protocol sets the prompt: passing prompt settings with one raises."""
    if proto is not None:
        given = [
            n
            for n, v in (("instruction", instruction), ("system_prompt", system_prompt), ("think_format", think_format))
            if v is not _UNSET
        ]
        if given:
            raise ValueError(f"protocol {proto.name!r} sets the prompt; do not pass {', '.join(given)}")
    temperature = float((proto.temperature if proto else DEFAULT_TEMPERATURE) if temperature is None else temperature)
    top_p = float((proto.top_p if proto else DEFAULT_TOP_P) if top_p is None else top_p)
    return temperature, top_p


def _say_merged_rows(loaded, say) -> None:
    """One line per file whose repeated rows of a question were counted once."""
    for src in loaded:
        if src.merged:
            say(
                f"{src.spec}: {sum(src.rows.values())} rows, {sum(src.distinct_by_source.values())} distinct "
                f"questions (repeated rows counted once: "
                + ", ".join(f"{n} {src.rows[n]} -> {d}" for n, d in src.distinct_by_source.items() if src.rows[n] != d)
                + ")"
            )


def _protocol_groups(per_source: dict, loaded) -> dict:
    """The protocol's in- and out-of-distribution averages; each source's rows and distinct
    questions recorded beside its scores."""
    groups = group_averages(per_source)
    for name, (rows, distinct) in rows_and_distinct(loaded).items():
        if name in per_source:
            per_source[name]["rows"] = rows
            per_source[name]["distinct_questions"] = distinct
    return groups


_PROMPT_KEYS = ("instruction", "system_prompt", "think_format")


def _progress_printer(progress) -> Callable[[str], None]:
    """Where progress lines go: the callable given, stderr (True), or nowhere."""
    if callable(progress):
        return progress
    if progress:
        return lambda m: print(m, file=sys.stderr, flush=True)
    return lambda m: None


def _check_settings(temperature: float, top_p: float, batch_size: int, pass_ks) -> None:
    """ValueError for a sampling setting out of range (before anything loads)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    pass_ks_for(pass_ks, 1)  # checks the entries


def _place(policy, device: Optional[str]) -> str:
    """Move the policy to ``device`` (default CUDA when available, else CPU), eval mode."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    policy.to(device)
    policy.eval()
    return device


def _max_new_tokens(asked: Optional[int], ckpt: Optional[CheckpointInfo], proto=None) -> int:
    """The completion budget: as asked, else the protocol's, else the checkpoint's
    ``max_response_tokens``, else the default."""
    if asked is None and proto is not None:
        asked = proto.max_new_tokens
    if asked is None and ckpt is not None and ckpt.config.get("max_response_tokens"):
        asked = int(ckpt.config["max_response_tokens"])
    return int(asked or DEFAULT_MAX_NEW_TOKENS)


def _prompt_settings(ckpt: Optional[CheckpointInfo], instruction, system_prompt, think_format) -> dict:
    """The env config's prompt keys: the checkpoint's, with the arguments given over them."""
    env_config = {key: ckpt.env_config[key] for key in _PROMPT_KEYS if key in ckpt.env_config} if ckpt else {}
    for key, value in zip(_PROMPT_KEYS, (instruction, system_prompt, think_format)):
        if value is not _UNSET:
            env_config[key] = value
    return env_config


def _protocol_env() -> dict:
    """The env config under a protocol: the question verbatim (no instruction added); the
    system message and the think format are the protocol's, per row."""
    return {"instruction": None, "system_prompt": None, "think_format": False}


def _run_sources(run: "_SourceRun", prepared) -> Tuple[List[QuestionResult], Dict[str, float]]:
    """(question results, seconds per data source) of every source, sampled under
    ``run.seed`` (the global torch RNG is restored afterwards)."""
    import torch

    questions: List[QuestionResult] = []
    source_seconds: Dict[str, float] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run.seed)
        for prep in prepared:
            t0 = time.perf_counter()
            data_sources = run.evaluate_source(prep, questions)
            for ds in data_sources:
                source_seconds[ds] = source_seconds.get(ds, 0.0) + time.perf_counter() - t0
    return questions, source_seconds


def _aggregate_sources(questions: List[QuestionResult], source_seconds: Dict[str, float], pass_ks):
    """(metrics per data source, overall metrics with the macro average over sources)."""
    by_source: "OrderedDict[str, List[QuestionResult]]" = OrderedDict()
    for q in questions:
        by_source.setdefault(q.data_source, []).append(q)
    per_source = {
        name: {**aggregate(qs, pass_ks), "wall_time_s": round(source_seconds.get(name, 0.0), 3)} for name, qs in by_source.items()
    }
    overall = aggregate(questions, pass_ks)
    overall["macro_avg_at_k"] = float(sum(m["avg_at_k"] for m in per_source.values()) / len(per_source))
    overall["n_sources"] = len(per_source)
    return per_source, overall


def _settings_record(run: "_SourceRun", target: "_Target", loaded, *, k, k_used, pass_ks, limit, split) -> dict:
    """The report's ``settings``: what was evaluated, and how."""
    env_config = run.env_config
    ckpt = target.ckpt
    return {
        "protocol": run.proto.name if run.proto else None,
        "temperature": run.temperature,
        "top_p": run.top_p,
        "max_new_tokens": run.max_new_tokens,
        "context": run.context,
        "seed": run.seed,
        "k": k if not isinstance(k, Mapping) else dict(k),
        "k_used": k_used,
        "pass_ks": list(pass_ks),
        "limit": limit,
        "split": split,
        "data": [src.spec for src in loaded],
        "instruction": env_config.get("instruction", DEFAULT_INSTRUCTION),
        "system_prompt": run.proto.system_prompt if run.proto else env_config.get("system_prompt"),
        "think_format": "official" if run.proto else bool(env_config.get("think_format", False)),
        "max_prompt_tokens": run.max_prompt_tokens,
        "batch_size": run.batch_size,
        "backend": target.backend,
        "device": target.device,
        "dtype": target.dtype,
        "engines": run.engines_description,
        "budget_capped": run.capped,
        "no_room": run.no_room,
        "over_max_positions": run.capped,
        "checkpoint": None
        if ckpt is None
        else {
            "path": ckpt.path,
            "module_path": ckpt.module_path,
            "algorithm": ckpt.algorithm,
            "model_name_or_path": ckpt.model_name_or_path,
        },
    }


# =========================================================================== the policy


@dataclass
class _Target:
    """What is evaluated, loaded for its backend: the torch policy (HF) or an HF model
    folder for the vLLM engines; the tokenizer, the context, the stop tokens."""

    label: str
    backend: str
    tokenizer: Any
    ckpt: Optional[CheckpointInfo] = None
    policy: Any = None  # HF
    folder: Optional[str] = None  # vLLM
    device: str = "cpu"
    dtype: str = "float32"
    context: Optional[int] = None
    stop_ids: tuple = ()
    ray_address: Optional[str] = None
    gpus: int = 0
    _tmp: Optional[tempfile.TemporaryDirectory] = field(default=None, repr=False)

    @classmethod
    def load(cls, model, backend: str, device, dtype, ray_address, say) -> "_Target":

        address = pick_address(ray_address)
        pair = isinstance(model, (tuple, list))
        if pair and backend == "vllm":
            raise BackendError("backend 'vllm' needs a model name, folder or checkpoint, not a loaded (model, tokenizer)")
        gpus = 0
        if not pair and backend != "hf":
            gpus = cluster_gpu_count(address) if address else local_gpu_count()
        chosen = "hf" if pair else choose_backend(backend, device=device, gpus=gpus)
        if chosen == "hf":
            policy, tokenizer, label, ckpt = _load_policy(model, say, dtype)
            placed = _place(policy, device)
            config = getattr(policy, "config", None)
            return cls(
                label=label,
                backend="hf",
                tokenizer=tokenizer,
                ckpt=ckpt,
                policy=policy,
                device=placed,
                dtype=str(next(policy.parameters()).dtype).replace("torch.", ""),
                context=getattr(config, "max_position_embeddings", None),
                stop_ids=stop_token_ids(policy, tokenizer),
            )
        return cls._load_for_vllm(model, dtype, address, gpus, say)

    @classmethod
    def _load_for_vllm(cls, model, dtype, address, gpus, say) -> "_Target":

        label = os.fspath(model)
        source = policy_source(label)
        ckpt, tmp = None, None
        if os.path.isdir(source) and is_checkpoint(source):
            ckpt = read_checkpoint(source)
            tmp = tempfile.TemporaryDirectory(prefix="rllib-evaluate-")
            folder = os.path.join(tmp.name, "model")
            say(
                f"writing {ckpt.algorithm or 'RLlib'} checkpoint {ckpt.path or ckpt.module_path} as a model "
                f"folder for vLLM (model {ckpt.model_name_or_path})"
            )
            export_checkpoint(source, folder)
        else:
            say(f"loading model {source}")
            folder = resolve_model_path(source)
        try:
            config = model_config_of(folder)
            tokenizer = load_tokenizer(folder)
            stops = stop_token_ids(generation_config_holder(folder), tokenizer)
        except OSError as e:
            if tmp is not None:
                tmp.cleanup()
            first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
            raise PolicyPathError(f"{source}: cannot load the model: {first}") from e
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if dtype is None:
            own = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
            dtype = str(own).replace("torch.", "") if own is not None else "auto"
        return cls(
            label=label,
            backend="vllm",
            tokenizer=tokenizer,
            ckpt=ckpt,
            folder=folder,
            device="cuda" if gpus else "cpu",
            dtype=dtype,
            context=getattr(config, "max_position_embeddings", None),
            stop_ids=stops,
            ray_address=address,
            gpus=gpus,
            _tmp=tmp,
        )

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _load_policy(model, say, dtype: Optional[str] = None) -> Tuple[Any, Any, str, Optional[CheckpointInfo]]:
    """(policy, tokenizer, label, checkpoint info or None) from a name, path, checkpoint
    folder or ``(model, tokenizer)`` pair; the tokenizer gets a pad token if it has none.
    The label is the model as given; a path is resolved against the working directory."""
    ckpt: Optional[CheckpointInfo] = None
    if isinstance(model, (tuple, list)):
        policy, tokenizer = model
        label = type(policy).__name__
    else:
        label = os.fspath(model)
        source = policy_source(label)
        if os.path.isdir(source) and is_checkpoint(source):
            ckpt = read_checkpoint(source)
            say(f"loading {ckpt.algorithm or 'RLlib'} checkpoint {ckpt.path or ckpt.module_path} (model {ckpt.model_name_or_path})")
            policy, tokenizer = load_policy_from_checkpoint(source, info=ckpt)
        else:
            policy, tokenizer = _load_hf_model(source, say, dtype)
    if dtype is not None:
        policy.to(resolve_dtype(dtype))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return policy, tokenizer, label, ckpt


def _load_hf_model(source: str, say, dtype: Optional[str] = None) -> Tuple[Any, Any]:
    """(model, tokenizer) of a model name or folder; a model transformers cannot find is a
    :class:`PolicyPathError` (one line)."""
    say(f"loading model {source}")
    try:
        return load_causal_lm({"model": source, "dtype": dtype or "float32"}), load_tokenizer(source)
    except OSError as e:  # transformers: not on the hub / no such folder / missing files
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise PolicyPathError(f"{source}: cannot load the model: {first}") from e


# =========================================================================== running


@dataclass
class _Prepared:
    """One source, ready to generate: its env, prompts (texts and ids), k and budgets."""

    spec: str
    env: Any
    problems: list
    texts: List[str]
    ids: List[List[int]]
    ks: List[int]
    budgets: List[int]


class _SourceRun:
    """Generates and verifies the questions of one source after another with one policy."""

    def __init__(
        self,
        target: _Target,
        env_config,
        proto,
        max_new_tokens,
        temperature,
        top_p,
        batch_size,
        seed,
        reward_timeout_s,
        max_prompt_tokens,
        keep_completions,
        say,
    ):

        self.target, self.tokenizer, self.env_config, self.proto, self.say = (target, target.tokenizer, env_config, proto, say)
        self.max_new_tokens, self.batch_size, self.seed = max_new_tokens, batch_size, seed
        self.reward_timeout_s, self.max_prompt_tokens, self.keep = reward_timeout_s, max_prompt_tokens, keep_completions
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.greedy = temperature == 0
        self.params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            stop_token_ids=tuple(target.stop_ids),
            return_logprobs=False,
        )
        self.context = target.context
        self.capped = 0
        self.no_room = 0
        self.questions = 0
        self.k_used: Dict[str, int] = {}
        self.generator = None
        self.engines_description = None

    # ---- before generating ----------------------------------------------------------
    def prepare(self, src, k) -> _Prepared:

        env = ReasoningEnv(
            {
                **self.env_config,
                "problems": src.problems,
                "tokenizer": self.tokenizer,
                "seed": self.seed,
                "reward_timeout_s": self.reward_timeout_s,
                "max_prompt_chars": 10**9,
            }
        )
        problems = list(env.problems)
        texts = [self._prompt_text(env, src, p) for p in problems]
        ids = [encode_prompt(self.tokenizer, t, self.max_prompt_tokens) for t in texts]
        ks = [self._k_for(p.data_source, k) for p in problems]
        budgets, capped = completion_budgets([len(i) for i in ids], self.max_new_tokens, self.context)
        self.capped += capped
        self.no_room += sum(b == 0 for b in budgets)
        self.questions += len(problems)
        return _Prepared(src.spec, env, problems, texts, ids, ks, budgets)

    def _prompt_text(self, env, src, p) -> str:
        if self.proto is None:
            return env.prompt_for(p.id)

        return render_prompt(
            p.question,
            tokenizer=self.tokenizer,
            instruction=None,
            think_format=False,
            system_prompt=src.systems.get(p.id, self.proto.system_prompt),
        )

    def _k_for(self, data_source: str, k) -> int:
        wanted = resolve_k(data_source, k)
        if self.greedy and wanted > 1 and data_source not in self.k_used:
            logger.warning("greedy decoding: k = 1 for %s (its samples would all be the same)", data_source)
        used = 1 if self.greedy else wanted
        self.k_used.setdefault(data_source, used)
        return used

    def say_budget(self, progress) -> None:
        """The one line on the context cap, when it binds."""
        if not self.capped:
            return
        msg = (
            f"completion budget {self.max_new_tokens} tokens capped to max_position_embeddings "
            f"({self.context}) - prompt length for {self.capped} of {self.questions} question(s)"
        )
        if self.no_room:
            msg += f"; {self.no_room} prompt(s) fill the context and are scored wrong without a completion"
        if progress:
            self.say(msg)
        else:
            logger.warning(msg)

    def start(
        self,
        prepared: List[_Prepared],
        *,
        tensor_parallel_size: int = 1,
        num_engines: Optional[int] = None,
        vllm_kwargs: Optional[dict] = None,
    ) -> None:
        """Build the generator: the HF backend, or the vLLM engines."""
        t = self.target
        if t.backend == "hf":
            self.generator = HFGenerator(t.policy, self.tokenizer, self.batch_size)
            self.engines_description = f"transformers on {t.device}"
            return
        layout = plan_engines(t.gpus, tensor_parallel_size, num_engines, t.ray_address)
        longest = max((len(i) + b for p in prepared for i, b in zip(p.ids, p.budgets)), default=1)
        max_len = min(longest, t.context) if t.context else longest
        total = sum(k for p in prepared for k, b in zip(p.ks, p.budgets) if b > 0)
        self.generator = VLLMGenerator(
            t.folder,
            layout,
            dtype=t.dtype,
            seed=self.seed,
            max_model_len=max(max_len, 1),
            max_num_seqs=None if layout.gpus_per_engine else max(1, min(256, total)),
            extra_kwargs=vllm_kwargs,
            say=self.say,
        )
        self.engines_description = layout.describe

    # ---- generating -----------------------------------------------------------------
    def evaluate_source(self, prep: _Prepared, out: List[QuestionResult]) -> set:
        """Append one :class:`QuestionResult` per question of ``prep`` to ``out``; returns
        the data sources it held."""
        n = len(prep.problems)
        self.say(f"{prep.spec}: {n} questions, {sum(prep.ks)} samples")
        # HF: batch_size samples a call; vLLM: the whole source (the engines batch it).
        size = self.batch_size if self.target.backend == "hf" else max(1, sum(prep.ks))
        done = 0
        order = list(range(n))
        try:
            for chunk, sizes in _chunks(order, [prep.ks[i] for i in order], size):
                groups = self.generator.generate([prep.ids[i] for i in chunk], sizes, [prep.budgets[i] for i in chunk], self.params)
                results = self._score(prep, chunk, groups)
                out += [self._question_result(prep, i, group, res) for i, group, res in zip(chunk, groups, results)]
                done += len(chunk)
                self.say(f"  {prep.spec}: {done}/{n} questions")
        finally:
            prep.env.close()
        return {p.data_source for p in prep.problems}

    def _score(self, prep: _Prepared, chunk: List[int], groups) -> List[list]:
        """The verifier's results, per question of ``chunk`` one per completion."""
        flat = [(pos, c) for pos, group in enumerate(groups) for c in group]
        texts = self.tokenizer.batch_decode([c.token_ids for _, c in flat], skip_special_tokens=True) if flat else []
        answers: List[Optional[str]] = list(texts)
        if self.proto is not None:
            answers = [official_answer_text(prep.texts[chunk[pos]], t) for (pos, _), t in zip(flat, texts)]
        todo = [j for j, a in enumerate(answers) if a is not None]
        scored = prep.env.score([prep.problems[chunk[flat[j][0]]].id for j in todo], [answers[j] for j in todo])
        results: List[Any] = [RewardResult(score=0.0, parsed=None, timed_out=False, format_ok=False)] * len(flat)
        for j, r in zip(todo, scored):
            results[j] = r
        per_q: List[list] = [[] for _ in chunk]
        for (pos, c), text, r in zip(flat, texts, results):
            per_q[pos].append((c, text, r))
        return per_q

    def _question_result(self, prep: _Prepared, i: int, group, items: list) -> QuestionResult:
        p = prep.problems[i]
        k = prep.ks[i]
        if not items and prep.budgets[i] == 0:  # no room for an answer: k wrong, empty samples
            return QuestionResult(
                id=p.id,
                data_source=p.data_source,
                source=prep.spec,
                correct=[False] * k,
                answers=[None] * k,
                response_tokens=[0] * k,
                truncated=[True] * k,
                prompt_tokens=len(prep.ids[i]),
                difficulty=p.difficulty,
                completions=[""] * k if self.keep else None,
            )
        return QuestionResult(
            id=p.id,
            data_source=p.data_source,
            source=prep.spec,
            correct=[r.score >= 1.0 for _, _, r in items],
            answers=[r.parsed for _, _, r in items],
            response_tokens=[int(len(c.token_ids)) for c, _, _ in items],
            truncated=[c.finish_reason == "length" for c, _, _ in items],
            unscored=sum(r.error is not None for _, _, r in items),
            timed_out=sum(bool(r.timed_out) for _, _, r in items),
            prompt_tokens=len(prep.ids[i]),
            difficulty=p.difficulty,
            completions=[t for _, t, _ in items] if self.keep else None,
        )

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()
