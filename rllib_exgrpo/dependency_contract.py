"""What this package relies on in DeepSpeed, vLLM and transformers, read from their source.

Each :class:`DependencyCall` names one function, method, attribute or value of a pinned
dependency that the package calls or reads, the keyword names it passes (or the
parameters it relies on), and the precondition read from the dependency's source that
the package's code depends on. :func:`problems` checks one entry against the installed
version: the name resolves, every listed parameter is accepted, an instance attribute is
still assigned in the owner's source, and the source still says what the precondition
quotes (``source_has``). ``tests/test_dependency_contract.py`` checks every entry of an
installed dependency (vLLM's in the vLLM venv), so an upgrade that renames, reshapes or
changes the precondition of a call fails in CI, naming the call, instead of on a GPU.

Private names (a leading underscore) of these and of torch and llvmlite are allowed only
when listed here (Ray's in ``rllib/rllib_contract.py``); the test scans the package for
``from <dependency> import`` and ``<dependency>.<name>`` references, and for private
attribute names that a third-party package defines and this package does not.

RLlib's private names live in ``rllib/rllib_contract.py`` (the same idea, for Ray).
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple


@dataclass(frozen=True)
class DependencyCall:
    """One call or read into a dependency.

    ``target``: ``"module:Qualified.name"``; ``kind``: ``"callable"`` (``params`` are
    keyword names it must accept), ``"attribute"`` (an instance attribute that
    ``Qualified`` assigns: ``self.<name> =`` in its source or a base class's),
    ``"value"`` (a module attribute or enum member that must exist; ``values`` lists
    members that must be there); ``source_has``: strings the target's source must contain
    (the precondition as the dependency writes it); ``used_in``: where the package uses it.
    """

    package: str
    target: str
    kind: str = "callable"
    params: Tuple[str, ...] = ()
    values: Tuple[str, ...] = ()
    source_has: Tuple[str, ...] = ()
    precondition: str = ""
    used_in: str = ""
    #: ``"module:function"`` returning False where the dependency's build lacks the target
    #: (torch's NCCL classes in a CPU build): there the entry is not checked.
    present_if: str = ""

    def present(self) -> bool:
        if not self.present_if:
            return True
        return bool(_resolve(self.present_if)[1]())

    @property
    def name(self) -> str:
        return self.target.rpartition(":")[2].rpartition(".")[2]

    @property
    def private(self) -> bool:
        return self.name.startswith("_") and not self.name.startswith("__")


_DS_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
_DS_Z3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
_DS_Z12 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"


def _ds(target: str, kind: str = "callable", **kw) -> DependencyCall:
    return DependencyCall("deepspeed", target, kind, **kw)


def _tf(target: str, kind: str = "callable", **kw) -> DependencyCall:
    return DependencyCall("transformers", target, kind, **kw)


def _vllm(target: str, kind: str = "callable", **kw) -> DependencyCall:
    return DependencyCall("vllm", target, kind, **kw)


DEEPSPEED = (
    _ds(
        "deepspeed:initialize",
        params=("model", "optimizer", "config", "dist_init_required"),
        used_in="rllib/deepspeed_learner.py: one engine per module over the learner's torch AdamW",
    ),
    _ds(
        "deepspeed:init_distributed", params=("dist_backend", "verbose"), used_in="rllib/deepspeed_learner.py: reuses RLlib's process group"
    ),
    _ds(
        "deepspeed.ops:__compatible_ops__",
        "value",
        used_in="rllib/deepspeed_learner.py: the shared-memory comm op marked incompatible (gloo does the work)",
    ),
    _ds(
        "deepspeed:zero.GatheredParameters",
        params=("params", "modifier_rank"),
        precondition="a collective: every rank enters it for the same parameters in the same order",
        used_in="rllib/colocation.py, rllib/weight_broadcast.py, rllib/deepspeed_learner.py (ZeRO-3 gathers)",
    ),
    _ds("deepspeed.runtime.utils:combine_grad_norm_groups", used_in="rllib/deepspeed_learner.py: pre-clip norm"),
    _ds(f"{_DS_ENGINE}.backward", params=("loss",), used_in="rllib/deepspeed_learner.py"),
    _ds(f"{_DS_ENGINE}.step", used_in="rllib/deepspeed_learner.py"),
    _ds(
        f"{_DS_ENGINE}.set_gradient_accumulation_boundary",
        params=("is_boundary",),
        used_in="rllib/deepspeed_learner.py: micro-batches of one minibatch",
    ),
    _ds(f"{_DS_ENGINE}.zero_optimization_stage", used_in="rllib/optimizer_offload.py, deepspeed_checkpoint.py"),
    _ds(
        f"{_DS_ENGINE}.zero_use_cpu_optimizer",
        used_in="rllib/optimizer_offload.py: an optimizer DeepSpeed keeps on the host is not moved again",
    ),
    _ds(
        f"{_DS_ENGINE}.offload_states",
        params=("include", "pin_memory"),
        source_has=("_refine_include_states",),
        used_in="rllib/optimizer_offload.py: a colocated turn, with an explicit list",
    ),
    _ds(f"{_DS_ENGINE}.reload_states", used_in="rllib/optimizer_offload.py"),
    _ds(
        f"{_DS_Z3}.offload_states",
        params=("include", "device", "pin_memory"),
        source_has=("FusedAdam", "OffloadStateTypeEnum.lp_grads", "OffloadStateTypeEnum.contiguous_grad_buffer"),
        precondition="asserts DeepSpeed's FusedAdam when optim_states or hp_params are to move: the "
        "learners' torch AdamW state and fp32 partitions are moved by rllib/optimizer_offload.py",
        used_in="rllib/optimizer_offload.py (ZeRO-3: lp_grads, contiguous_grad_buffer only)",
    ),
    _ds(
        f"{_DS_Z12}.offload_states",
        params=("include", "device", "pin_memory"),
        source_has=("OffloadStateTypeEnum.hp_params", "OffloadStateTypeEnum.optim_states"),
        precondition="no optimizer class check: any torch optimizer's state moves",
        used_in="rllib/optimizer_offload.py (ZeRO-1/2)",
    ),
    _ds(
        "deepspeed.runtime.zero.offload_config:OffloadStateTypeEnum",
        "value",
        values=("hp_params", "lp_params", "lp_grads", "optim_states", "contiguous_grad_buffer"),
        used_in="rllib/optimizer_offload.py: the explicit include lists",
    ),
    _ds(
        "deepspeed.runtime.zero.offload_states:offload_optimizer_states",
        params=("optimizer", "device", "pin_memory"),
        precondition="moves every tensor of optimizer.state (torch AdamW's layout included)",
        used_in="rllib/optimizer_offload.py (ZeRO-3 optimizer state)",
    ),
    _ds(
        "deepspeed.runtime.zero.offload_states:reload_optimizer_states",
        params=("optimizer", "device"),
        used_in="rllib/optimizer_offload.py (ZeRO-3 optimizer state)",
    ),
    _ds(
        f"{_DS_Z3}.fp32_partitioned_groups_flat",
        "attribute",
        used_in="rllib/optimizer_offload.py: ZeRO-3 fp32 master partitions moved to the host",
    ),
    _ds(f"{_DS_Z3}.grad_partitions_flat_buffer", "attribute", used_in="rllib/optimizer_offload.py: bytes moved"),
    _ds(f"{_DS_Z3}.ipg_buckets", "attribute", used_in="rllib/optimizer_offload.py: bytes moved"),
    _ds(f"{_DS_Z3}.offloaded_states", "attribute", used_in="tests: what DeepSpeed's call moved"),
    _ds(f"{_DS_Z12}.single_partition_of_fp32_groups", "attribute", used_in="rllib/optimizer_offload.py: bytes moved"),
    _ds(f"{_DS_Z12}.averaged_gradients", "attribute", used_in="rllib/optimizer_offload.py: bytes moved"),
    _ds(f"{_DS_Z3}.refresh_fp32_params", used_in="rllib/deepspeed_learner.py: weights set from a checkpoint"),
    _ds(f"{_DS_Z3}._get_norm_groups", used_in="rllib/deepspeed_learner.py: the pre-clip gradient norm (ZeRO-3)"),
    _ds(
        f"{_DS_Z3}._loss_scale_update_and_overflow_cleanup",
        used_in="rllib/deepspeed_learner.py: a skipped step takes DeepSpeed's overflow path (ZeRO-3)",
    ),
    _ds(
        f"{_DS_Z3}._overflow_check_and_loss_scale_update",
        params=("update_scale",),
        used_in="rllib/deepspeed_learner.py: patched for one step to force the overflow path (ZeRO-3)",
    ),
    _ds(f"{_DS_Z12}.scaled_global_norm", used_in="rllib/deepspeed_learner.py: the pre-clip norm (ZeRO-1/2)"),
    _ds(
        f"{_DS_Z12}.check_overflow",
        params=("partition_gradients",),
        used_in="rllib/deepspeed_learner.py: patched for one step to force the overflow path (ZeRO-1/2)",
    ),
    _ds(
        "deepspeed.runtime.zero.stage_1_and_2:estimate_zero2_model_states_mem_needs",
        params=("total_params", "num_gpus_per_node", "num_nodes", "cpu_offload"),
        used_in="planning/memory.py: DeepSpeed's own estimate beside the plan",
    ),
    _ds(
        "deepspeed.runtime.zero.stage3:estimate_zero3_model_states_mem_needs",
        params=("total_params", "largest_layer_params", "num_gpus_per_node", "num_nodes", "cpu_offload", "cpu_offload_params", "zero_init"),
        used_in="planning/memory.py",
    ),
)

TRANSFORMERS = (
    _tf(
        "transformers:AutoModelForCausalLM.from_pretrained",
        params=("pretrained_model_name_or_path",),
        used_in="models/loading.py (dtype, attn_implementation go through **kwargs)",
    ),
    _tf(
        "transformers:AutoTokenizer.from_pretrained",
        params=("pretrained_model_name_or_path",),
        used_in="models/loading.py, models/tiny.py, models/smollm2.py, envs/reasoning_env.py, evaluation/export.py",
    ),
    _tf(
        "transformers:AutoConfig.from_pretrained",
        params=("pretrained_model_name_or_path",),
        used_in="models/loading.py: a model's shape without its weights (memory plan, vLLM's names)",
    ),
    _tf("transformers:AutoConfig.for_model", params=("model_type",), used_in="models/rehearsal.py"),
    _tf("transformers:GenerationConfig.from_pretrained", params=("pretrained_model_name",), used_in="models/loading.py: stop tokens"),
    _tf("transformers:GenerationConfig.from_model_config", params=("model_config",), used_in="models/loading.py"),
    _tf("transformers:GenerationConfig", params=("eos_token_id",), used_in="generation/hf.py, models/rehearsal.py, warm_start/build.py"),
    _tf(
        "transformers:Qwen2Config",
        params=("vocab_size", "hidden_size", "num_hidden_layers"),
        used_in="warm_start/build.py: the embedded tiny model's architecture",
    ),
    _tf("transformers:Qwen2ForCausalLM", "value", used_in="warm_start/build.py"),
    _tf("transformers.utils:logging.is_progress_bar_enabled", used_in="models/loading.py: no bar per actor"),
    _tf("transformers.utils:logging.disable_progress_bar", used_in="models/loading.py"),
    _tf("transformers.utils:logging.enable_progress_bar", used_in="models/loading.py"),
    _tf(
        "transformers:AttentionInterface.register",
        params=("key", "value"),
        used_in="core/attention.py: the sdpa_varlen kernel registered by name",
    ),
    _tf("transformers.masking_utils:AttentionMaskInterface.register", params=("key", "value"), used_in="core/attention.py"),
    _tf(
        "transformers.masking_utils:flash_attention_mask",
        params=("batch_size", "q_length", "kv_length", "attention_mask"),
        precondition="returns the 2-D padding mask or None: no [T, T] mask is built for sdpa_varlen",
        used_in="core/attention.py: sdpa_varlen's mask function",
    ),
    _tf(
        "transformers.modeling_flash_attention_utils:_flash_attention_forward",
        params=("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"),
        precondition="the varlen keyword names a packed pass hands the model (core/packing.py) reach the kernel",
        used_in="core/packing.py: packed passes under flash_attention_2",
    ),
    _tf(
        "transformers.generation.logits_process:TopPLogitsWarper", params=("top_p",), used_in="generation/hf.py: the nucleus of HF sampling"
    ),
    _tf("transformers:GgufConfig", params=("gguf_file", "dequantize"), used_in="models/smollm2.py"),
    _tf("transformers.models.qwen2.tokenization_qwen2:PRETOKENIZE_REGEX", "value", used_in="models/tiny_tokenizer.py"),
    _tf("transformers.models.qwen2.tokenization_qwen2:Qwen2Tokenizer", "value", used_in="models/tiny_tokenizer.py"),
)

VLLM = (
    _vllm(
        "vllm.engine.arg_utils:EngineArgs",
        params=(
            "model",
            "dtype",
            "seed",
            "max_model_len",
            "enable_prefix_caching",
            "max_num_seqs",
            "logprobs_mode",
            "worker_extension_cls",
            "generation_config",
            "enable_sleep_mode",
            "gpu_memory_utilization",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "kv_cache_memory_bytes",
            "distributed_executor_backend",
        ),
        used_in="generation/vllm.py engine_kwargs: vllm.LLM(**kwargs) passes them to EngineArgs; evaluation/engines.py engine_kwargs",
    ),
    _vllm("vllm:LLM.generate", params=("prompts", "sampling_params", "use_tqdm"), used_in="generation/vllm.py"),
    _vllm("vllm:LLM.collective_rpc", params=("method", "args", "kwargs"), used_in="generation/vllm.py: weights into the workers by name"),
    _vllm("vllm:LLM.reset_prefix_cache", used_in="generation/vllm.py: cached blocks dropped after a push"),
    _vllm(
        "vllm:LLM.sleep",
        params=("level",),
        precondition="level 2 drops weights and KV cache",
        used_in="rllib/colocation.py: the engine sleeps while the learner trains (CUDA)",
    ),
    _vllm(
        "vllm:LLM.wake_up",
        params=("tags",),
        precondition='tags "weights" then "kv_cache"',
        used_in="rllib/colocation.py: weights woken before the push, KV cache after it (CUDA)",
    ),
    _vllm(
        "vllm.v1.worker.gpu_worker:Worker.reload_weights",
        used_in="generation/vllm.py WeightSyncWorkerExtension: the worker's in-place reload (the CPU "
        "worker subclasses it); generation/vllm.py vllm_api_problems checks each runner class at "
        "engine start",
    ),
    _vllm(
        "vllm.model_executor.model_loader.reload.inplace:reload_weights",
        params=("vllm_config", "model", "weights_iterator"),
        precondition="every model runner (V1 and V2, CPU and GPU) loads through this function",
        used_in="generation/vllm.py: one reload per push with a generator over the layer buckets",
    ),
    _vllm(
        "vllm.model_executor.model_loader.reload.layerwise",
        "value",
        source_has=("Failed to load weights",),
        precondition="a layer that got no tensor is reported at WARNING with this message",
        used_in="generation/vllm.py quiet_rotary_reload: the message dropped for rotary layers only",
    ),
    _vllm(
        "vllm.distributed.parallel_state:init_distributed_environment",
        source_has=("torch.distributed.is_initialized()",),
        precondition="with torch.distributed already initialised (the learners' group) the engine's world "
        "is built over the learners: colocated engines are built by every learner together",
        used_in="rllib/colocation.py ColocatedSampler.take_part / engine_build_is_collective",
    ),
    _vllm(
        "vllm:SamplingParams",
        params=(
            "n",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "max_tokens",
            "stop_token_ids",
            "logprobs",
            "detokenize",
        ),
        used_in="generation/vllm.py vllm_sampling_kwargs",
    ),
)

#: Private names of torch and llvmlite the package touches (no public route exists).
OTHER_PRIVATE = (
    DependencyCall(
        "torch",
        "torch.distributed:ProcessGroupGloo._Options",
        "value",
        values=("_timeout", "_devices"),
        used_in="rllib/weight_broadcast.py: a gloo group of the learners and runners, its "
        "timeout and the device bound to this node's address (no public constructor)",
    ),
    DependencyCall(
        "torch",
        "torch.distributed:ProcessGroupNCCL.Options",
        "value",
        values=("_timeout",),
        used_in="rllib/weight_broadcast.py: the NCCL group's timeout",
        present_if="torch.distributed:is_nccl_available",
    ),
    DependencyCall(
        "llvmlite",
        "llvmlite.binding.ffi:_lib_wrapper",
        "value",
        used_in="generation/vllm.py: dunder lookups on llvmlite's library wrapper raise "
        "AttributeError, so vLLM's CPU kernel scan can start an engine",
    ),
)

CALLS = DEEPSPEED + TRANSFORMERS + VLLM + OTHER_PRIVATE


# ---- checking an entry -------------------------------------------------------------------------
def _resolve(target: str) -> Tuple[Any, Any]:
    """``(owner, obj)``: the class (or module) that holds the last name, and the object."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    owner = obj
    for part in qualname.split(".") if qualname else ():
        owner, obj = obj, getattr(obj, part)
    return owner, obj


def _assigned(owner: type, name: str) -> bool:
    pattern = re.compile(rf"self\.{re.escape(name)}\s*(:[^=\n]*)?=")
    for cls in inspect.getmro(owner):
        try:
            if pattern.search(inspect.getsource(cls)):
                return True
        except (OSError, TypeError):
            continue
    return False


def problems(call: DependencyCall) -> List[str]:
    """What no longer holds of ``call`` in the installed dependency (empty: all of it)."""
    where = f"{call.package} {call.target}"
    if call.kind == "attribute":
        module_name, _, qualname = call.target.partition(":")
        cls_path, _, attr = qualname.rpartition(".")
        try:
            owner = _resolve(f"{module_name}:{cls_path}")[1]
        except (ImportError, AttributeError) as e:
            return [f"{where}: {type(e).__name__}: {e}"]
        return [] if _assigned(owner, attr) else [f"{where}: no longer assigned in {cls_path}'s source"]
    try:
        _, obj = _resolve(call.target)
    except (ImportError, AttributeError) as e:
        return [f"{where}: {type(e).__name__}: {e}"]
    out = []
    if call.kind == "callable":
        out += _parameter_problems(where, obj, call.params)
    for value in call.values:
        if not hasattr(obj, value):
            out.append(f"{where}: has no member {value!r}")
    if call.source_has:
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError) as e:
            return out + [f"{where}: source unreadable ({e})"]
        out += [
            f"{where}: its source no longer says {s!r} ({call.precondition or 'precondition'})" for s in call.source_has if s not in source
        ]
    return out


def _parameter_problems(where: str, obj: Any, params: Tuple[str, ...]) -> List[str]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError) as e:
        return [f"{where}: no signature ({e})"]
    names = set(sig.parameters)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return [f"{where}: takes no parameter {p!r} (signature {sig})" for p in params if p not in names and not var_kw]


def calls_of(package: str) -> Tuple[DependencyCall, ...]:
    return tuple(c for c in CALLS if c.package == package)


def private_names(package: Optional[str] = None) -> List[str]:
    """The private names listed (of one package, or all)."""
    names = set()
    for c in CALLS:
        if package is None or c.package == package:
            names.update(n for n in (c.name, *c.values) if n.startswith("_") and not n.startswith("__"))
    return sorted(names)
