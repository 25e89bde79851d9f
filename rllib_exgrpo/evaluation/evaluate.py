"""Benchmark evaluation of a policy: avg@k, pass@k and maj@k per data source.

Settings follow the ExGRPO / LUFFY papers (docs/ALGORITHMS.md, section 2): sampling
at temperature 0.6, top_p 1.0; AIME and AMC are scored as avg@32 (32 samples per
question), every other benchmark as avg@1. A data source gets 32 samples when its name
contains ``aime`` or ``amc`` (case-insensitive), 1 otherwise; ``k=`` overrides this.

What is evaluated (``model=``):

- a model name or path understood by :func:`rllib_exgrpo.models.resolve_model_path`
  (``"tiny"``, ``"smollm2"``, an HF folder or hub name);
- an RLlib checkpoint folder of this project's algorithms (ExGRPO / GRPO): the folder
  ``algo.save_to_path`` or Tune wrote, or a Tune trial folder (its latest
  ``checkpoint_*``), or the module folder itself. See :func:`load_policy_from_checkpoint`;
- an already loaded ``(model, tokenizer)`` pair.

Prompts are rendered by :class:`rllib_exgrpo.envs.ReasoningEnv` (the renderer the policy was trained
with) and completions scored by its verifier (``ReasoningEnv.score`` ->
``rllib_exgrpo.envs.rewards.score_batch``); generation uses :class:`HFGenerationBackend`, the
backend of the training env runners.

Metrics and the report: ``metrics.py``; checkpoints: ``checkpoints.py``; data: ``data.py``.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

logger = logging.getLogger(__name__)

from rllib_exgrpo.envs.prompting import DEFAULT_INSTRUCTION
from rllib_exgrpo.evaluation.checkpoints import (
    CheckpointInfo,
    is_checkpoint,
    load_policy_from_checkpoint,
    read_checkpoint,
)
from rllib_exgrpo.evaluation.data import load_eval_problems
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
    k: Union[None, int, Mapping[str, int]] = None, temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P, max_new_tokens: Optional[int] = None, limit: Optional[int] = None,
    batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0, instruction: Optional[str] = _UNSET,
    system_prompt: Optional[str] = _UNSET, think_format: bool = _UNSET,
    pass_ks: Sequence[Union[int, str]] = DEFAULT_PASS_KS, split: str = "test",
    max_prompt_tokens: Optional[int] = None, reward_timeout_s: float = 5.0, keep_completions: bool = False,
    device: Optional[str] = None, progress: Union[bool, Callable[[str], None]] = False,
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
        temperature, top_p: Sampling (papers: 0.6, 1.0). 0 means greedy.
        max_new_tokens: Completion budget; default the checkpoint's ``max_response_tokens``,
            else 1024.
        limit: Evaluate at most the first ``limit`` questions of each source.
        batch_size: Sequences per ``generate`` call.
        seed: Seeds sampling (the global torch RNG is left as it was).
        instruction, system_prompt, think_format: Prompt settings passed to the env
            config; default: the checkpoint's ``env_config``, else the env's defaults.
        pass_ks: pass@j to report; ``"k"`` stands for each source's k. Entries larger than
            a source's k are left out for it.
        split: Split of ``arithmetic`` specs (held-out ``"test"``).
        max_prompt_tokens: Left-truncate prompts to this many tokens (default: no limit).
        reward_timeout_s: Verifier wall-clock limit per completion.
        keep_completions: Keep the completion texts in the report (and its JSON).
        device: Torch device for generation; default CUDA when available, else CPU.
        progress: True prints progress lines to stderr; a callable receives them.
    """
    t_start = time.perf_counter()
    say = _progress_printer(progress)
    _check_settings(temperature, top_p, batch_size, pass_ks)
    loaded = load_eval_problems(sources, limit=limit, split=split)  # 1. data first: a bad file fails early
    policy, tokenizer, label, ckpt = _load_policy(model, say)  # 2. the policy
    device = _place(policy, device)
    run = _SourceRun(policy, tokenizer, _prompt_settings(ckpt, instruction, system_prompt, think_format),
                     _max_new_tokens(max_new_tokens, ckpt), temperature, top_p, batch_size, seed,
                     reward_timeout_s, max_prompt_tokens, keep_completions, say)
    questions, seconds, k_used = _run_sources(run, loaded, k)  # 3. generate + verify, source by source
    run.warn_over_positions(progress)
    per_source, overall = _aggregate_sources(questions, seconds, pass_ks)  # 4. aggregate
    settings = _settings_record(run, ckpt, loaded, k=k, k_used=k_used, pass_ks=pass_ks, limit=limit,
                                split=split, device=device)
    return EvalReport(model=label, settings=settings, sources=per_source, overall=overall,
                      wall_time_s=round(time.perf_counter() - t_start, 3), questions=questions)


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


def _max_new_tokens(asked: Optional[int], ckpt: Optional[CheckpointInfo]) -> int:
    """The completion budget: as asked, else the checkpoint's ``max_response_tokens``, else
    the default."""
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


def _run_sources(run: "_SourceRun", loaded, k) -> Tuple[List[QuestionResult], Dict[str, float], Dict[str, int]]:
    """(question results, seconds per data source, k per data source) of every source,
    sampled under ``run.seed`` (the global torch RNG is restored afterwards)."""
    import torch

    questions: List[QuestionResult] = []
    source_seconds: Dict[str, float] = {}
    k_used: Dict[str, int] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run.seed)
        for src in loaded:
            t0 = time.perf_counter()
            data_sources = run.evaluate_source(src, k, k_used, questions)
            for ds in data_sources:
                source_seconds[ds] = source_seconds.get(ds, 0.0) + time.perf_counter() - t0
    return questions, source_seconds, k_used


def _aggregate_sources(questions: List[QuestionResult], source_seconds: Dict[str, float], pass_ks):
    """(metrics per data source, overall metrics with the macro average over sources)."""
    by_source: "OrderedDict[str, List[QuestionResult]]" = OrderedDict()
    for q in questions:
        by_source.setdefault(q.data_source, []).append(q)
    per_source = {name: {**aggregate(qs, pass_ks), "wall_time_s": round(source_seconds.get(name, 0.0), 3)}
                  for name, qs in by_source.items()}
    overall = aggregate(questions, pass_ks)
    overall["macro_avg_at_k"] = float(sum(m["avg_at_k"] for m in per_source.values()) / len(per_source))
    overall["n_sources"] = len(per_source)
    return per_source, overall


def _settings_record(run: "_SourceRun", ckpt: Optional[CheckpointInfo], loaded, *, k, k_used, pass_ks, limit,
                     split, device) -> dict:
    """The report's ``settings``: what was evaluated, and how."""
    env_config = run.env_config
    return {
        "temperature": run.temperature, "top_p": run.top_p, "max_new_tokens": run.max_new_tokens,
        "seed": run.seed, "k": k if not isinstance(k, Mapping) else dict(k), "k_used": k_used,
        "pass_ks": list(pass_ks), "limit": limit, "split": split, "data": [src.spec for src in loaded],
        "instruction": env_config.get("instruction", DEFAULT_INSTRUCTION),
        "system_prompt": env_config.get("system_prompt"),
        "think_format": bool(env_config.get("think_format", False)),
        "max_prompt_tokens": run.max_prompt_tokens, "batch_size": run.batch_size, "device": str(device),
        "over_max_positions": run.over_positions,
        "checkpoint": None if ckpt is None else {
            "path": ckpt.path, "module_path": ckpt.module_path, "algorithm": ckpt.algorithm,
            "model_name_or_path": ckpt.model_name_or_path,
        },
    }


def _load_policy(model, say) -> Tuple[Any, Any, str, Optional[CheckpointInfo]]:
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
            say(f"loading {ckpt.algorithm or 'RLlib'} checkpoint {ckpt.path or ckpt.module_path} "
                f"(model {ckpt.model_name_or_path})")
            policy, tokenizer = load_policy_from_checkpoint(source, info=ckpt)
        else:
            policy, tokenizer = _load_hf_model(source, say)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return policy, tokenizer, label, ckpt


def _load_hf_model(source: str, say) -> Tuple[Any, Any]:
    """(model, tokenizer) of a model name or folder; a model transformers cannot find is a
    :class:`PolicyPathError` (one line)."""
    from rllib_exgrpo.models.loading import load_causal_lm, load_tokenizer

    say(f"loading model {source}")
    try:
        return load_causal_lm({"model": source}), load_tokenizer(source)
    except OSError as e:  # transformers: not on the hub / no such folder / missing files
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise PolicyPathError(f"{source}: cannot load the model: {first}") from e


class _SourceRun:
    """Generates and verifies the questions of one source after another with one policy."""

    def __init__(self, policy, tokenizer, env_config, max_new_tokens, temperature, top_p, batch_size, seed,
                 reward_timeout_s, max_prompt_tokens, keep_completions, say):
        from rllib_exgrpo.generation.base import SamplingParams
        from rllib_exgrpo.generation.hf import HFGenerationBackend
        from rllib_exgrpo.generation.sample_and_score import stop_token_ids

        self.tokenizer, self.env_config, self.say = tokenizer, env_config, say
        self.max_new_tokens, self.batch_size, self.seed = max_new_tokens, batch_size, seed
        self.reward_timeout_s, self.max_prompt_tokens, self.keep = reward_timeout_s, max_prompt_tokens, keep_completions
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.greedy = temperature == 0
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p),
                                     stop_token_ids=stop_token_ids(policy, tokenizer), return_logprobs=False)
        self.backend = HFGenerationBackend(policy, pad_token_id=tokenizer.pad_token_id, batch_size=batch_size)
        self.max_positions = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
        self.over_positions = 0

    def evaluate_source(self, src, k, k_used: Dict[str, int], out: List[QuestionResult]) -> set:
        """Append one :class:`QuestionResult` per question of ``src`` to ``out``; returns
        the data sources it held."""
        from rllib_exgrpo.envs.reasoning_env import ReasoningEnv
        from rllib_exgrpo.generation.sample_and_score import encode_prompt, sample_and_score

        env = ReasoningEnv({**self.env_config, "problems": src.problems, "tokenizer": self.tokenizer,
                            "seed": self.seed, "reward_timeout_s": self.reward_timeout_s, "max_prompt_chars": 10**9})
        ks = [self._k_for(p.data_source, k, k_used) for p in env.problems]
        self.say(f"{src.spec}: {len(env.problems)} questions, {sum(ks)} samples")
        done = 0
        for chunk, sizes in _chunks(list(env.problems), ks, self.batch_size):
            prompts = [encode_prompt(self.tokenizer, env.prompt_for(p.id), self.max_prompt_tokens) for p in chunk]
            if self.max_positions:
                self.over_positions += sum(len(ids) + self.max_new_tokens > self.max_positions for ids in prompts)
            batch = sample_and_score(self.backend, self.tokenizer, prompts, sizes, self.params,
                                     [p.id for p in chunk], env.score)
            per_q: Dict[int, list] = {}
            for item in batch.items:
                per_q.setdefault(item.prompt_index, []).append(item)
            out += [self._question_result(p, src.spec, per_q.get(qi, []), len(prompts[qi])) for qi, p in enumerate(chunk)]
            done += len(chunk)
            self.say(f"  {src.spec}: {done}/{len(env.problems)} questions")
        env.close()
        return {p.data_source for p in env.problems}

    def _k_for(self, data_source: str, k, k_used: Dict[str, int]) -> int:
        wanted = resolve_k(data_source, k)
        if self.greedy and wanted > 1 and data_source not in k_used:
            logger.warning("greedy decoding: k = 1 for %s (its samples would all be the same)", data_source)
        used = 1 if self.greedy else wanted
        k_used.setdefault(data_source, used)
        return used

    def _question_result(self, p, spec: str, items: list, prompt_tokens: int) -> QuestionResult:
        return QuestionResult(
            id=p.id,
            data_source=p.data_source,
            source=spec,
            correct=[i.result.score >= 1.0 for i in items],
            answers=[i.result.parsed for i in items],
            response_tokens=[int(len(i.completion.token_ids)) for i in items],
            truncated=[i.completion.finish_reason == "length" for i in items],
            unscored=sum(i.result.error is not None for i in items),
            timed_out=sum(bool(i.result.timed_out) for i in items),
            prompt_tokens=prompt_tokens,
            difficulty=p.difficulty,
            completions=[i.text for i in items] if self.keep else None,
        )

    def warn_over_positions(self, progress) -> None:
        if not self.over_positions:
            return
        msg = (f"{self.over_positions} question(s) have prompt + max_new_tokens > the model's "
               f"max_position_embeddings={self.max_positions}")
        if progress:
            self.say(f"warning: {msg}")
        else:
            logger.warning(msg)
