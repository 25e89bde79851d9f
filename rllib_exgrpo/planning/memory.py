"""What each actor holds on its GPU: the memory plan printed before a run starts.

Three layers, each usable alone (``docs/memory_plan.md`` has the formulas, where each number
comes from and the measured check, ``benchmarks/memory_plan.py``):

* :func:`model_state_bytes`: weights, gradients, optimiser state (fp32 master weights and
  AdamW moments), communication buckets and what the optimiser step adds, by learner backend
  and ZeRO stage;
* :func:`learner_activation_bytes` / :func:`learner_activation_breakdown`: the peak of one
  forward + backward pass of the learner (``core/scoring.py`` + ``core/losses.py``) on
  ``rows x tokens`` (or one packed sequence): the activations autograd saves per layer (or
  the layer inputs with gradient checkpointing), one chunk of log-prob logits at the
  vocabulary size (``core/chunked_logprobs.py``), and the backward's temporaries;
  :func:`scoring_activation_bytes`: the same pass without gradients
  (an env runner's behaviour log-probs and lowest-entropy scoring, the KL reference);
* :func:`plan_memory`: both for an ``ExGRPOConfig``, per actor kind, against the GPU's
  memory (``gpu_memory_gb``, else detected with ``torch.cuda``), with one line per actor
  that does not fit, naming the config key to change.

Activations are counted for Hugging Face's Qwen2 / Llama modelling code. A padded pass
gives SDPA a boolean mask, which it turns into a float mask of the query's dtype in every
layer and keeps for the backward; a packed pass under a variable-length kernel
(``core/attention.py``) has no mask. Exact per-tensor counts were read off
autograd's saved tensors (``torch.autograd.graph.saved_tensors_hooks``) and the peaks off
the allocator's own records (``torch.profiler`` memory events); see the doc.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from rllib_exgrpo.core.minibatches import optimizer_steps_per_iteration
from rllib_exgrpo.planning.shapes import ModelShape, model_shape
from rllib_exgrpo.planning.timing import TimeEstimate, card_for_estimate, estimate_iteration
from rllib_exgrpo.core.attention import packs_rows
from rllib_exgrpo.core.chunked_logprobs import DEFAULT_CHUNK_TOKENS
from rllib_exgrpo.planning.cards import card_by_name, describe, usable_bytes

GIB = float(1 << 30)

#: DeepSpeed's defaults this project does not change (``deepspeed.runtime.zero.config``).
DS_DEFAULT_BUCKET = 500_000_000  # reduce_bucket_size / allgather_bucket_size, elements
DS_SUB_GROUP_SIZE = 1_000_000_000  # ZeRO-3 sub_group_size, elements
#: vLLM's own default when ``vllm_kwargs`` has no ``gpu_memory_utilization``.
VLLM_DEFAULT_UTILIZATION = 0.9
#: Per GPU process, not counted by torch's allocator: CUDA context, cuBLAS / NCCL workspaces.
#: An assumption (typically 0.5-1 GiB), printed as such.
PROCESS_OVERHEAD_BYTES = 1 << 30


def usable_memory(total: int) -> int:
    """What the plan lets one GPU's actors use of a card of ``total`` bytes (its nominal size,
    ``gpu_memory_gb``, or as detected): the card table's usable memory
    (:func:`rllib_exgrpo.planning.cards.usable_bytes`: 79.2 GiB of an A100 / H100 80 GB, 22.5
    GiB of a 24 GB card, 139.8 GiB of an H200; 97% of a size the table does not know)."""
    return usable_bytes(total)


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(name: str) -> int:
    return _DTYPE_BYTES.get(str(name), 4)


def _default_chunk() -> int:
    """``logit_chunk_tokens``' default (``core/chunked_logprobs.py``)."""
    return int(DEFAULT_CHUNK_TOKENS)


# ------------------------------------------------------------------ model states


def model_state_bytes(
    shape: ModelShape,
    *,
    backend: str,
    zero_stage: int = 2,
    num_learners: int = 1,
    model_dtype: str = "bfloat16",
    ddp_bucket_view: bool = False,
    reduce_bucket_elements: Optional[int] = None,
    lora_parameters: int = 0,
) -> Dict[str, int]:
    """Model states of one learner GPU, in bytes.

    ``backend="ddp"`` (this project's DDP learner): fp32 weights (a ``bfloat16`` /
    ``float16`` model keeps fp32 master weights and computes under autocast), fp32
    gradients, AdamW's two fp32 moments, and with ``num_learners >= 2`` DDP's gradient
    buckets (a second fp32 copy of the gradients unless ``gradient_as_bucket_view``), plus
    the bf16 weight copies autocast makes during a pass. ``backend="deepspeed"``: bf16
    weights and gradients, fp32 master weights and moments partitioned over the learners
    (ZeRO-1: optimiser state; ZeRO-2: and gradients; ZeRO-3: and weights), the reduce
    bucket, and with ZeRO-3 the gathered largest module (weights and gradient).

    Keys: ``weights``, ``gradients``, ``optimizer`` (fp32 master weights + AdamW moments),
    ``buckets``, ``gathered`` (ZeRO-3), ``autocast_copies`` (DDP mixed precision),
    ``total`` (resident during a forward/backward pass), ``step_extra`` (only during the
    optimiser step: DeepSpeed's fp32 gradient partition and AdamW's fp32 temporary),
    ``step_total``, and ``deepspeed_comparable`` (what DeepSpeed's own estimators count:
    weights, gradients, optimiser state, fp32 gradients, gathered module).

    ``lora_parameters`` > 0 (LoRA learners): the frozen base in ``model_dtype`` (nothing
    updates it, so no fp32 master copy and no autocast copies), and the adapters with their
    gradients, AdamW moments, DDP buckets and the step's temporary (DeepSpeed: bf16 adapters
    with fp32 master copies, partitioned as the stage says; the base sliced under ZeRO-3).
    """
    if lora_parameters:
        return _lora_state_bytes(shape, int(lora_parameters), num_learners, model_dtype, ddp_bucket_view, backend, zero_stage)
    p = int(shape.num_parameters)
    n = max(1, int(num_learners or 1))
    out = dict(weights=0, gradients=0, optimizer=0, buckets=0, gathered=0, autocast_copies=0, step_extra=0)
    if backend == "ddp":
        comparable_fp32_grads = _ddp_states(out, shape, p, n, model_dtype, ddp_bucket_view)
    elif backend == "deepspeed":
        comparable_fp32_grads = _deepspeed_states(out, shape, p, n, zero_stage, reduce_bucket_elements)
    else:
        raise ValueError(f"backend must be 'ddp' or 'deepspeed', got {backend!r}")
    resident = ("weights", "gradients", "optimizer", "buckets", "gathered", "autocast_copies")
    out["total"] = sum(out[k] for k in resident)
    out["step_total"] = out["total"] - out["autocast_copies"] + out["step_extra"]
    out["deepspeed_comparable"] = out["weights"] + out["gradients"] + out["optimizer"] + comparable_fp32_grads + out["gathered"]
    return {k: int(v) for k, v in out.items()}


def _ddp_states(out: Dict[str, int], shape: ModelShape, p: int, n: int, model_dtype: str, ddp_bucket_view: bool) -> int:
    """:func:`model_state_bytes` of a full (not LoRA) DDP learner of ``p`` parameters among ``n``,
    filled into ``out``; returns the fp32 gradients DeepSpeed's estimators would count (none)."""
    out["weights"] = 4 * p
    out["gradients"] = 4 * p
    out["optimizer"] = 8 * p
    out["buckets"] = 4 * p if (n >= 2 and not ddp_bucket_view) else 0
    if dtype_bytes(model_dtype) == 2:
        out["autocast_copies"] = 2 * (shape.num_hidden_layers * shape.layer_linear_parameters + shape.embedding_parameters)
    out["step_extra"] = 4 * p  # foreach AdamW: one fp32 temporary of every moment
    return 0


def _deepspeed_states(
    out: Dict[str, int], shape: ModelShape, p: int, n: int, zero_stage: int, reduce_bucket_elements: Optional[int]
) -> int:
    """:func:`model_state_bytes` of a full (not LoRA) DeepSpeed learner of ``p`` parameters among
    ``n``, filled into ``out``; returns the fp32 gradient partition DeepSpeed's estimators count."""
    stage = int(zero_stage)
    if stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage!r}")
    bucket = int(reduce_bucket_elements if reduce_bucket_elements is not None else min(DS_DEFAULT_BUCKET, max(p, 1_000_000)))
    local = p / n
    out["weights"] = int(2 * local) if stage == 3 else 2 * p
    out["gradients"] = 2 * p if stage == 1 else int(2 * local)
    out["optimizer"] = int(12 * local)  # fp32 master 4 + AdamW moments 8, partitioned
    out["buckets"] = 2 * bucket
    if stage == 3:
        out["gathered"] = 4 * shape.largest_module_parameters  # bf16 weight + gradient
    step_elems = min(local, DS_SUB_GROUP_SIZE) if stage == 3 else local
    out["step_extra"] = int(8 * step_elems)  # fp32 gradient partition + AdamW temporary
    return int(4 * step_elems)


def _lora_state_bytes(
    shape: ModelShape, adapters: int, num_learners: int, model_dtype: str, ddp_bucket_view: bool, backend: str, zero_stage: int = 2
) -> Dict[str, int]:
    """:func:`model_state_bytes` of a LoRA learner (see there)."""
    n = max(1, int(num_learners or 1))
    base = dtype_bytes(model_dtype) * int(shape.num_parameters)
    if backend == "deepspeed":  # colocated only (config validation)
        sliced = n if zero_stage == 3 else 1
        out = dict(
            weights=(base + 2 * adapters) // sliced,
            gradients=2 * adapters // (n if zero_stage >= 2 else 1),
            optimizer=12 * adapters // n,
            buckets=0,
            gathered=2 * shape.vocab_size * shape.hidden_size if zero_stage == 3 else 0,
            autocast_copies=0,
            step_extra=4 * adapters // n,
        )
        out["total"] = sum(out[k] for k in ("weights", "gradients", "optimizer", "gathered"))
        out["step_total"] = out["total"] + out["step_extra"]
        out["deepspeed_comparable"] = out["total"]
        return {k: int(v) for k, v in out.items()}
    out = dict(
        weights=base + 4 * adapters,
        gradients=4 * adapters,
        optimizer=8 * adapters,
        buckets=4 * adapters if (n >= 2 and not ddp_bucket_view) else 0,
        gathered=0,
        autocast_copies=0,
        step_extra=4 * adapters,
    )
    out["total"] = sum(out[k] for k in ("weights", "gradients", "optimizer", "buckets"))
    out["step_total"] = out["total"] + out["step_extra"]
    out["deepspeed_comparable"] = out["weights"] + out["gradients"] + out["optimizer"]
    return {k: int(v) for k, v in out.items()}


def _import_deepspeed_quietly() -> None:
    """Import DeepSpeed without its accelerator line on stdout (its logger's handler is
    pointed back at stdout afterwards)."""
    import contextlib
    import io
    import logging
    import sys

    if "deepspeed" in sys.modules:
        return
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        import deepspeed  # noqa: F401
    for name in ("DeepSpeed", "deepspeed"):
        for handler in logging.getLogger(name).handlers:
            if getattr(handler, "stream", None) is buf:
                handler.setStream(sys.stdout)


def deepspeed_estimate_bytes(shape: ModelShape, *, zero_stage: int, num_learners: int) -> Optional[int]:
    """DeepSpeed's own estimate of the model states per GPU (no offload), or None (stage 1
    has no estimator; DeepSpeed not installed). Calls the functions that DeepSpeed's
    ``estimate_zero2_model_states_mem_needs_all_cold`` /
    ``estimate_zero3_model_states_mem_needs_all_cold`` print."""
    import importlib.util

    if int(zero_stage) not in (2, 3) or importlib.util.find_spec("deepspeed") is None:
        return None
    _import_deepspeed_quietly()
    if int(zero_stage) == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as estimate
    else:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as estimate
    if int(zero_stage) == 2:
        _, gpu = estimate(shape.num_parameters, num_gpus_per_node=int(num_learners), num_nodes=1, cpu_offload=False)
    else:
        _, gpu, _ = estimate(
            shape.num_parameters,
            shape.largest_module_parameters,
            num_gpus_per_node=int(num_learners),
            num_nodes=1,
            cpu_offload=False,
            cpu_offload_params=False,
            zero_init=True,
        )
    return int(gpu)


# ------------------------------------------------------------------ activations


def _mode(dtype_bytes: int, autocast: bool) -> str:
    if autocast:
        return "autocast"
    return "fp32" if int(dtype_bytes) >= 4 else "half"


#: torch's SDPA pads an additive mask's last dimension to a multiple of this for CUDA's
#: memory-efficient kernel (``preprocess_mask`` in aten/src/ATen/native/transformers/attention.cpp,
#: ``mem_eff_alignment``), a copy of the mask when the length is not one.
MASK_ALIGN = 8


def masked_attention_bytes(shape: ModelShape, rows: int, q_len: int, kv_len: int, *, dtype_bytes: int = 2) -> Dict[str, int]:
    """What one decoder layer's masked attention call makes, in bytes (``core/attention.py``:
    ``sdpa_varlen`` on padded rows, :func:`~rllib_exgrpo.core.attention.masked_sdpa`;
    transformers' ``sdpa`` makes the same tensors, its boolean mask once per forward):

    * ``boolean_mask``: the causal-and-padding mask ``[B, 1, q, kv]``, 1 byte an entry;
      ``building``: what its construction holds at once (two ``[B, q, kv]`` boolean
      temporaries and the ``[q, kv]`` causal one);
    * ``float_mask``: SDPA's additive copy of it in the query's dtype (``dtype_bytes``), the
      last dimension padded to a multiple of :data:`MASK_ALIGN`; CUDA's memory-efficient
      kernel keeps it for the backward;
    * ``repeated_kv``: k and v repeated to the query's heads, ``2 x B x Hq x kv x D`` elements
      (the kernel keeps both for the backward). None when key/value heads equal the query's,
      and none for a decoding step (``q_len == 1``), whose query heads fold onto their
      key/value head instead;
    * ``in_flight``: the three together, what the call holds beyond q, k, v and the output.

    Before this call matched the heads it passed ``enable_gqa=True`` with the mask, which on
    CUDA only SDPA's math kernel takes: ``[B, Hq, q, kv]`` float scores and their softmax, the
    tensors this plan never counted (at 7B, 7 rows of 5120 tokens: 2 x 19.1 GiB a layer)."""
    rows, q_len, kv_len = int(rows), int(q_len), int(kv_len)
    b = 4 if int(dtype_bytes) >= 4 else 2
    entries = rows * q_len * kv_len
    padded = rows * q_len * (-(-kv_len // MASK_ALIGN) * MASK_ALIGN)
    grouped = shape.num_attention_heads != shape.num_key_value_heads
    repeated = 2 * rows * kv_len * shape.attention_width * b if grouped and q_len > 1 else 0
    out = dict(boolean_mask=entries, building=2 * entries + q_len * kv_len, float_mask=padded * b, repeated_kv=repeated)
    out["in_flight"] = out["boolean_mask"] + out["float_mask"] + out["repeated_kv"]
    return {k: int(v) for k, v in out.items()}


def layer_saved_bytes(shape: ModelShape, rows: int, tokens: int, mode: str, *, dense_mask: bool = True) -> int:
    """What autograd keeps of one decoder layer for the backward (no checkpointing).

    Per token: the RMSNorms' fp32 inputs and outputs, the projections' inputs, q, the
    attention output and its log-sum-exp, the MLP's gate, up, activation and product; and
    the attention's keys and values: in a padded pass (``dense_mask``) k and v repeated to
    every head and SDPA's float mask ``[S, S]`` per row (:func:`masked_attention_bytes`); a
    packed pass under a variable-length kernel has no mask, and its keys and values are
    counted as large as the repeated pair (its kernel takes grouped heads, but the CPU
    measurement of a packed step, ``benchmarks/memory_plan.py``, matches this count, and
    not the smaller one). Counted tensor by tensor with ``saved_tensors_hooks`` (bytes per
    token, h hidden, ad = heads x head dim, i intermediate, a heads; S a multiple of 8)::

        bf16 (DeepSpeed)        16h +  8ad +  8i + 4a + 8,   mask 2 S^2 per row
        fp32                    24h + 16ad + 16i + 4a + 8,   mask 4 S^2 per row
        autocast (DDP, bf16)    26h +  8ad +  8i + 4a + 8,   mask 2 S^2 per row
    """
    h, ad, kd, i, a = (shape.hidden_size, shape.attention_width, shape.kv_width, shape.intermediate_size, shape.num_attention_heads)
    t = rows * tokens
    coef = {"half": (16, 4, 8, 2), "fp32": (24, 8, 16, 4), "autocast": (26, 4, 8, 2)}[mode]
    b = coef[3]
    if dense_mask:
        masked = masked_attention_bytes(shape, rows, tokens, tokens, dtype_bytes=b)
        attention = masked["float_mask"] + (masked["repeated_kv"] or 2 * t * kd * b)
    else:
        # A packed pass's kernel takes grouped heads, yet on CPU it was measured keeping as
        # much as the repeated pair (benchmarks/memory_plan.py, packed step): counted so.
        attention = 2 * t * ad * b
    return t * (coef[0] * h + coef[1] * ad + coef[2] * i + 4 * a + 8) + attention


def logit_chunk_bytes(vocab: int, chunk: int, *, half: bool) -> int:
    """Peak of one chunk of the vocabulary-sized scoring (``core/chunked_logprobs.py``),
    forward or backward: the chunk's logits, log q and q. Float32 logits: three float32
    ``[C, V]``; bf16 logits (bf16 weights, or autocast): the bf16 logits, their float32
    copy (turned into log q in place) and q; in the backward the gradient is built in
    log q's memory and cast to bf16 (a half more) after q is freed."""
    c, v = int(chunk), int(vocab)
    return (2 + 4 + 4) * c * v if half else 3 * 4 * c * v


def learner_activation_breakdown(
    shape: ModelShape,
    rows: int,
    tokens: int,
    *,
    gradient_checkpointing: bool,
    dtype_bytes: int = 2,
    response_tokens: Optional[int] = None,
    autocast: bool = False,
    dense_mask: bool = True,
    chunk_tokens: Optional[int] = None,
) -> Dict[str, int]:
    """The parts of :func:`learner_activation_bytes` (bytes): ``layers`` (saved by the
    decoder layers, or their inputs with checkpointing), ``outside`` (embedding ids, rotary
    tables, final norm, the scored positions' hidden states), ``logits`` (0: no logits
    outlive their chunk), ``logit_chunks`` (the chunk phase beyond what is saved: one
    chunk's logits and softmax, the LM head's weight gradients, the scored hidden states'
    gradient), ``layer_backward`` (recomputing / differentiating one layer),
    ``embedding_backward`` (the ``[V, h]`` weight gradients at the end), ``forward_end``,
    and ``peak`` with ``peak_phase``, the largest of the phases (all beyond the model
    states). ``dense_mask``: the pass is padded (SDPA's ``[S, S]`` mask per row); a packed
    pass under a variable-length kernel is ``rows=1, tokens=`` its length, without.
    ``chunk_tokens``: ``logit_chunk_tokens`` (None: its default)."""
    chunk_tokens = _default_chunk() if chunk_tokens is None else int(chunk_tokens)
    rows, tokens = int(rows), int(tokens)
    r = int(tokens if response_tokens is None else min(int(response_tokens), tokens))
    mode = _mode(dtype_bytes, autocast)
    t = rows * tokens
    layers, outside, per_layer = _saved_activation_bytes(
        shape, rows, tokens, r, mode, gradient_checkpointing=gradient_checkpointing, dense_mask=dense_mask
    )
    layer_bwd = _layer_backward_bytes(shape, t, mode, per_layer if gradient_checkpointing else 0)
    scored = rows * r  # positions whose logits are computed, a chunk at a time
    c = min(int(chunk_tokens), max(1, scored))
    logits_bwd = _logit_chunk_phase_bytes(shape, scored, c, mode)
    tied_extra, embedding_bwd = _embedding_gradients(shape, mode)
    layer_bwd += tied_extra
    logits = 0  # nothing vocabulary-sized outlives its chunk
    saved = layers + outside
    peaks = {
        "forward_end": saved,
        "logit_chunks": saved + logits_bwd,
        "layer_backward": layers + outside + layer_bwd,
        "embedding_backward": embedding_bwd + 8 * t,
    }
    peak = max(peaks.values())
    return dict(
        layers=int(layers),
        outside=int(outside),
        logits=int(logits),
        logit_chunks=int(logits_bwd),
        chunk_tokens=int(c),
        layer_backward=int(layer_bwd),
        embedding_backward=int(embedding_bwd),
        forward_end=int(saved),
        peak=int(peak),
        peak_phase=max(peaks, key=peaks.get),
    )


def _embedding_gradients(shape: ModelShape, mode: str) -> Tuple[int, int]:
    """``(added to the layer-backward phase, the embedding-backward phase)``: the ``[V, h]``
    weight gradients. With tied word embeddings one is live through the layers' backward and
    the embedding backward holds three; untied, the embedding backward holds one."""
    vh = shape.vocab_size * shape.hidden_size
    grad_bytes = 2 if mode == "half" else 4
    if shape.tie_word_embeddings:
        return vh * grad_bytes, 3 * vh * grad_bytes
    return 0, vh * grad_bytes


def _saved_activation_bytes(
    shape: ModelShape, rows: int, tokens: int, r: int, mode: str, *, gradient_checkpointing: bool, dense_mask: bool
) -> Tuple[int, int, int]:
    """``(layers, outside, per_layer)``: what the forward pass of ``rows x tokens`` (``r``
    scored positions per row) keeps for the backward, in the decoder layers and outside
    them, and what one layer saves (:func:`layer_saved_bytes`)."""
    h, d, n_layers = shape.hidden_size, shape.head_dim, shape.num_hidden_layers
    t = rows * tokens
    compute = 2 if mode in ("half", "autocast") else 4  # logits, lm_head input
    residual = 2 if mode == "half" else 4  # the residual stream (a layer's checkpointed input)
    per_layer = layer_saved_bytes(shape, rows, tokens, mode, dense_mask=dense_mask)
    # Outside the layers: ids, the rotary tables, the final RMSNorm (fp32 input + output),
    # the scored positions' hidden states (the head's input, gathered). With checkpointing
    # the layers keep only their inputs, and the boolean mask and rotary tables live on in
    # the checkpoints' closures.
    final_norm = 6 * t * h if mode == "half" else 8 * t * h
    rope = 2 * t * d * (2 if mode == "half" else 4)
    outside = 8 * t + final_norm + 4 * t + rows * r * h * compute + rope
    if gradient_checkpointing:
        layers = n_layers * t * h * residual
        # transformers' sdpa hands every layer one boolean mask (sdpa_varlen builds it per layer)
        outside += masked_attention_bytes(shape, rows, tokens, tokens)["boolean_mask"] if dense_mask else 0
    else:
        layers = n_layers * per_layer
    return layers, outside, per_layer


def _layer_backward_bytes(shape: ModelShape, t: int, mode: str, recomputed: int) -> int:
    """Backward through one layer of ``t`` positions: the MLP's two ``[T, i]`` input
    gradients and the hidden state's gradient on top of what is saved, plus ``recomputed``
    (with checkpointing, the recomputed layer's saved activations; else 0)."""
    compute = 2 if mode in ("half", "autocast") else 4
    return 2 * t * shape.intermediate_size * compute + 4 * t * shape.hidden_size + recomputed


def _logit_chunk_phase_bytes(shape: ModelShape, scored: int, c: int, mode: str) -> int:
    """The chunk phase of ``scored`` positions in chunks of ``c``, beyond what is saved.

    The LM head's weight gradient (``[V, h]`` in the parameters' dtype): every chunk's
    backward makes one, added into the running sum autograd keeps; with tied embeddings
    that sum waits for the embedding's own ``[V, h]`` gradient at the very end. The phase
    holds a chunk's recomputed logits and their softmax (beside, after the first chunk,
    that running sum); then, those freed, the chunk's logit gradient, the head's new weight
    gradient and that sum; and the scored hidden states' gradient (``[K, h]``) throughout.
    """
    h, v = shape.hidden_size, shape.vocab_size
    half = mode in ("half", "autocast")
    compute = 2 if half else 4
    vh = v * h
    grad_bytes = 2 if mode == "half" else 4
    head_grad = vh * grad_bytes + (2 * vh if mode == "autocast" else 0)  # autocast: bf16, then fp32
    chunk_peak = logit_chunk_bytes(v, c, half=half)
    chunks = -(-scored // c)
    running = head_grad if chunks > 1 else 0
    logit_grad = (2 if half else 4) * c * v
    return max(chunk_peak + running, logit_grad + head_grad + running) + scored * h * compute


def learner_activation_bytes(
    shape: ModelShape,
    rows: int,
    tokens: int,
    *,
    gradient_checkpointing: bool,
    dtype_bytes: int = 2,
    response_tokens: Optional[int] = None,
    autocast: bool = False,
    dense_mask: bool = True,
    chunk_tokens: Optional[int] = None,
) -> int:
    """Peak activation + logits / log-prob buffers of one forward + backward pass of
    ``rows x tokens`` in this project's learner (``completion_logprobs_and_entropy`` with
    the entropy, then ``mixed_policy_loss``), beyond the model states.

    ``tokens``: prompt + response per row; ``response_tokens``: the scored completion
    positions (the logits are made for those only; None: all ``tokens``, an upper bound).
    ``dtype_bytes`` 2: bf16 weights and compute (DeepSpeed, gpu_check); 4: fp32;
    ``autocast=True``: fp32 weights computing in bf16 (the DDP learner with
    ``model_dtype: bfloat16``; autocast's bf16 weight copies are a model state, see
    :func:`model_state_bytes`).
    """
    return learner_activation_breakdown(
        shape,
        rows,
        tokens,
        gradient_checkpointing=gradient_checkpointing,
        dtype_bytes=dtype_bytes,
        response_tokens=response_tokens,
        autocast=autocast,
        dense_mask=dense_mask,
        chunk_tokens=chunk_tokens,
    )["peak"]


def scoring_activation_bytes(
    shape: ModelShape,
    rows: int,
    tokens: int,
    *,
    response_tokens: Optional[int] = None,
    dtype_bytes: int = 2,
    with_entropy: bool = True,
    dense_mask: bool = True,
    chunk_tokens: Optional[int] = None,
) -> int:
    """Peak of one scoring pass without gradients (``torch.no_grad``) over ``rows x
    tokens``: an env runner's behaviour log-probs / lowest-entropy scoring of one
    ``generation_batch_size`` chunk, or the learner's frozen KL reference.

    The larger of the layer phase (the boolean mask and the input embeddings for the whole
    forward; in the attention q, k and v, k and v repeated to every head and the float mask
    of the masked call (:func:`masked_attention_bytes`), and the output; in the MLP the activation, up and their
    product) and the logit phase (the
    final hidden states and the scored positions' copy, one chunk's logits and softmax:
    :func:`logit_chunk_bytes`). ``dense_mask`` False: a packed pass, no ``[S, S]`` mask.
    """
    rows, tokens = int(rows), int(tokens)
    r = int(tokens if response_tokens is None else min(int(response_tokens), tokens))
    b = 2 if int(dtype_bytes) < 4 else 4
    h, ad, kd, i, v, d = (
        shape.hidden_size,
        shape.attention_width,
        shape.kv_width,
        shape.intermediate_size,
        shape.vocab_size,
        shape.head_dim,
    )
    t = rows * tokens
    masked = masked_attention_bytes(shape, rows, tokens, tokens, dtype_bytes=b) if dense_mask else None
    masks = masked["boolean_mask"] if masked else 0
    base = 8 * t + 2 * t * d * b + masks + t * h * b
    # q, k, v, the output; a padded pass's masked call: k and v repeated, SDPA's float mask
    attention = base + 2 * t * h * b + t * b * (2 * ad + 2 * kd) + (masked["repeated_kv"] + masked["float_mask"] if masked else 0)
    mlp = base + 3 * t * h * b + 3 * t * i * b
    norm = base + 2 * t * h * b + (2 * 4 * t * h if b == 2 else 0)
    chunk = min(_default_chunk() if chunk_tokens is None else int(chunk_tokens), max(1, rows * r))
    logits = t * h * b + rows * r * h * b + logit_chunk_bytes(v, chunk, half=b == 2)
    return int(max(attention, mlp, norm, logits))


# ------------------------------------------------------------------ weight sync and push

#: NCCL's own buffers for one member of a communicator, counted for the weight-sync group
#: (``rllib/weight_broadcast.py``) on each GPU member: a broadcast runs over a ring, so each
#: rank connects to 2 peers (the one it receives from, the one it sends to), on up to 32
#: channels (NCCL opens 32 per GPU pair between H100s: NVIDIA/nccl issue 1685), each
#: connection with a buffer per protocol: SIMPLE ``NCCL_BUFFSIZE`` (4 MiB by default), LL128
#: (4.69 MiB) and LL (0.5 MiB) (``DEFAULT_*BUFFSIZE`` in NCCL's src/init.cc): 9.2 MiB, 10 MiB
#: in the allocation granularity NCCL's allocations show in that issue. 32 x 2 x 10 MiB =
#: 640 MiB per member: an upper figure (NCCL connects only the protocols it runs, and
#: fewer channels on slower links), outside torch's allocator and vLLM's share.
NCCL_CHANNELS = 32
NCCL_RING_PEERS = 2
NCCL_BYTES_PER_CONNECTION = 10 << 20
NCCL_BUFFER_BYTES = NCCL_CHANNELS * NCCL_RING_PEERS * NCCL_BYTES_PER_CONNECTION
#: ``weight_sync_bucket_mb``'s default (``rllib/config_fields.py``).
DEFAULT_SYNC_BUCKET_MB = 512

_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_target_sizes(shape: ModelShape, target_modules: Any = "all-linear") -> List[int]:
    """Elements of each LoRA-targeted weight of one decoder layer."""
    h, ad, kd, i = shape.hidden_size, shape.attention_width, shape.kv_width, shape.intermediate_size
    sizes = {
        "q_proj": h * ad,
        "k_proj": h * kd,
        "v_proj": h * kd,
        "o_proj": ad * h,
        "gate_proj": h * i,
        "up_proj": h * i,
        "down_proj": i * h,
    }
    names = _LORA_TARGETS if target_modules in (None, "all-linear") else [str(n) for n in target_modules]
    return [sizes[n] for n in names if n in sizes]


def lora_merge_bytes(
    shape: ModelShape, *, target_modules: Any = "all-linear", base_bytes: int = 2, adapter_bytes: int = 4
) -> Dict[str, int]:
    """What computing LoRA's merged weights ``W + (alpha / r) B A`` for a push holds
    (``models/lora.py``, ``MergedWeight``: the base weight cloned, peft's
    ``get_delta_weight``: ``B @ A``, then that times the scaling, both in the adapters'
    dtype, the sum cast to the base's dtype and added). One weight at a time, so:

    * ``temporaries``: the float32 (the DDP learner's adapters; bf16 under DeepSpeed) ``B @ A``
      and its scaled copy of the largest targeted weight, ``2 x adapter_bytes`` an element
      (the cast to the base dtype comes after ``B @ A`` is freed, within that);
    * ``merged_layer``: a decoder layer's merged weights in the base's dtype, all held until
      the layer is pushed (``models/weight_buckets.py``: a colocated push goes a decoder layer
      at a time, the clone of the weight being merged among them);
    * ``one_weight``: the clone of the largest weight (a collective sync,
      ``rllib/weight_broadcast.py``, merges each tensor as it copies it into the bucket).
    """
    sizes = _lora_target_sizes(shape, target_modules) or [0]
    largest = max(sizes)
    return dict(
        temporaries=int(2 * adapter_bytes * largest), merged_layer=int(base_bytes * sum(sizes)), one_weight=int(base_bytes * largest)
    )


def weight_sync_bytes(shape: ModelShape, *, bucket_mb: float = DEFAULT_SYNC_BUCKET_MB, dtype_bytes: int = 2) -> int:
    """The flat buffer one bucket of a collective weight sync lands in
    (``rllib/weight_broadcast.py``: ``plan_buckets`` cuts the shipped tensors, in order, into
    buckets of at most ``weight_sync_bucket_mb``, a larger tensor alone in its own; ``_Scratch``
    makes one buffer per dtype as large as the largest bucket). At most the larger of the
    bucket size and the largest tensor (the embedding, or the untied LM head: ``V x h``; 1.09
    GB at 7B in bf16, more than the 512 MiB default), and at most the whole model. The first
    learner (the broadcast's root) flattens each bucket into it and every env runner receives
    into it, on the GPU over NCCL (in host memory over gloo); under ZeRO-3 every learner also
    holds a bucket's parameters gathered while it is sent, the same size."""
    b = int(dtype_bytes)
    model = int(shape.num_parameters) * b
    bucket = max(1, int(float(bucket_mb) * 2**20))
    return int(min(model, max(min(bucket, model), int(shape.largest_module_parameters) * b)))


def _collective_sync(config: Any) -> Optional[str]:
    """The weight sync's backend when the config syncs over the collective to remote env
    runners ("nccl" when the learners and the runners both hold GPUs, else "gloo"), or None
    (the object store, colocated learners, no remote runners)."""
    if config.colocate or int(_get(config, "num_env_runners", 0)) <= 0:
        return None
    if str(config.weight_sync) != "collective":
        return None
    on_gpus = float(_get(config, "num_gpus_per_learner", 0)) > 0 and float(_get(config, "num_gpus_per_env_runner", 0)) > 0
    return "nccl" if on_gpus else "gloo"


def _sync_bucket_mb(config: Any) -> float:
    return float(config.weight_sync_bucket_mb)


def _lora_adapter_bytes(config: Any) -> int:
    """The adapters' dtype: fp32 on a DDP learner, bf16 under DeepSpeed."""
    return 2 if config.learner_backend == "deepspeed" else 4


def _learner_sync_items(plan: ActorPlan, config: Any, shape: ModelShape, b: int, after: int) -> None:
    """The collective weight sync on a learner (the root, learner 0, holds the most): NCCL's
    buffers for the whole run; after the update (its activations freed: ``after`` is the
    largest of what the update and the optimiser step held beyond the model states) the
    bucket buffer (on the GPU over NCCL), the gathered bucket (ZeRO-3) and, with LoRA, the
    merge of the largest weight; only what exceeds ``after`` is an item."""
    backend = _collective_sync(config)
    if backend is None:
        return
    bucket_mb = _sync_bucket_mb(config)
    bucket = weight_sync_bytes(shape, bucket_mb=bucket_mb, dtype_bytes=b)
    parts = []
    if backend == "nccl":
        plan.items.insert(
            len(plan.items) - 1,
            Item(
                "weight-sync NCCL buffers",
                NCCL_BUFFER_BYTES,
                f"learner 0's NCCL buffers in the weight-sync group: {NCCL_CHANNELS} channels x {NCCL_RING_PEERS} ring "
                f"peers x {NCCL_BYTES_PER_CONNECTION >> 20} MiB (assumed, NCCL's defaults)",
            ),
        )
        parts.append(("bucket buffer", bucket))
    if _zero3(config):
        parts.append(("gathered bucket (ZeRO-3)", bucket))
    if config.lora_rank:
        merge = lora_merge_bytes(shape, target_modules=config.lora_target_modules, base_bytes=b, adapter_bytes=_lora_adapter_bytes(config))
        parts.append(("LoRA merge of the largest weight", merge["one_weight"] + merge["temporaries"]))
    if not parts:
        return
    during = sum(n for _, n in parts)
    what = ", ".join(f"{w} {_gib(n)}" for w, n in parts)
    if during > after:
        plan.items.insert(
            len(plan.items) - 1,
            Item(
                "weight sync buffers",
                during - after,
                f"after the update, beyond its freed activations: {what} (buckets of {bucket_mb:g} MiB)",
            ),
        )
    else:
        plan.notes.append(
            f"weight sync ({backend}, buckets of {bucket_mb:g} MiB): {what}, after the update, below the activations it frees"
        )


def _runner_sync_items(plan: ActorPlan, config: Any, shape: ModelShape, b: int) -> None:
    """The collective weight sync on a GPU env runner: over NCCL its bucket buffer on the GPU
    (kept by torch's allocator beside vLLM's share) and NCCL's buffers."""
    if _collective_sync(config) != "nccl":
        return
    bucket_mb = _sync_bucket_mb(config)
    it = plan.items.insert
    at = len(plan.items) - 1
    it(
        at,
        Item(
            "weight-sync NCCL buffers",
            NCCL_BUFFER_BYTES,
            f"{NCCL_CHANNELS} channels x {NCCL_RING_PEERS} ring peers x {NCCL_BYTES_PER_CONNECTION >> 20} MiB (assumed, NCCL's defaults)",
        ),
    )
    largest = shape.largest_module_parameters * b
    alone = f"; the largest tensor, {_gib(largest)}, alone in one" if largest > bucket_mb * 2**20 else ""
    it(
        at,
        Item(
            "weight sync receive buffer",
            weight_sync_bytes(shape, bucket_mb=bucket_mb, dtype_bytes=b),
            f"the largest bucket of a sync, received on the GPU (buckets of {bucket_mb:g} MiB{alone})",
        ),
    )


# ------------------------------------------------------------------ the plan


@dataclass
class Item:
    """One line of an actor's plan."""

    what: str
    bytes: int
    source: str = ""


@dataclass
class ActorPlan:
    kind: str  # "learner" | "env runner"
    count: int
    gpus_per_actor: float
    items: List[Item] = field(default_factory=list)
    budget: Optional[int] = None  # bytes this actor may use on its GPU
    notes: List[str] = field(default_factory=list)
    #: The config key to change when it does not fit, and the line that says so.
    key: Optional[str] = None
    advice: str = ""
    #: A failure the total does not show (vLLM's share cannot hold one sequence).
    failed: bool = False

    @property
    def total(self) -> int:
        return sum(it.bytes for it in self.items)

    @property
    def fits(self) -> Optional[bool]:
        if self.failed:
            return False
        return None if self.budget is None else self.total <= self.budget


@dataclass
class MemoryPlan:
    """The plan of one config: a shape, the GPU memory, one :class:`ActorPlan` per kind."""

    model: str
    shape: Optional[ModelShape]
    gpu_memory: Optional[int]
    gpu_memory_source: str
    actors: List[ActorPlan] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    #: How one iteration's rows become optimiser steps (:func:`optimizer_steps_line`).
    optimizer_steps: str = ""
    #: Seconds per iteration, an estimate (:func:`time_estimate`); None off the card table.
    time: Optional[TimeEstimate] = None

    @property
    def fits(self) -> Optional[bool]:
        verdicts = [a.fits for a in self.actors]
        if any(v is False for v in verdicts):
            return False
        return None if any(v is None for v in verdicts) or not verdicts else True

    def problems(self) -> List[str]:
        """One line per actor that does not fit: ``config.<key>: <what and how much>``."""
        out = []
        for a in self.actors:
            if a.fits is False:
                out.append(
                    f"config.{a.key}: the {a.kind} needs {_gib(a.total)} per GPU, the GPU has {_gib(a.budget)} ({_biggest(a)}); {a.advice}"
                )
        return out

    def render(self, indent: str = "  ") -> str:
        lines = [f"memory plan: {self.model}"]
        if self.shape is None:
            lines.append(f"{indent}shape: unknown ({self.notes[0] if self.notes else 'no config.json found'})")
            return "\n".join(lines)
        lines.append(f"{indent}shape: {self.shape.describe()}")
        lines.append(f"{indent}       from {self.shape.source}")
        if self.gpu_memory is None:
            lines.append(f"{indent}GPU memory: unknown ({self.gpu_memory_source})")
        else:
            lines.append(
                f"{indent}GPU memory: {_gib(self.gpu_memory)} ({self.gpu_memory_source}); the plan uses "
                f"{_gib(usable_memory(self.gpu_memory))} ({describe(self.gpu_memory)}: what CUDA gives "
                f"torch on it)"
            )
        if self.optimizer_steps:
            lines.append(f"{indent}{self.optimizer_steps}")
        if self.time is not None:
            lines.append(f"{indent}{self.time.describe()}")
        for note in self.notes:
            lines.append(f"{indent}note: {note}")
        for a in self.actors:
            per = f"{a.gpus_per_actor:g} GPU each" if a.gpus_per_actor != 1 else "1 GPU each"
            verdict = {True: "fits", False: "DOES NOT FIT", None: "fit not checked"}[a.fits]
            budget = f" of {_gib(a.budget)}" if a.budget is not None else ""
            lines.append(f"{indent}{a.kind} x{a.count} ({per}): {_gib(a.total)}{budget}: {verdict}")
            width = max(len(it.what) for it in a.items) if a.items else 0
            for it in a.items:
                lines.append(f"{indent}  {it.what:<{width}}  {_gib(it.bytes):>10}  {it.source}")
            for note in a.notes:
                lines.append(f"{indent}  note: {note}")
            if a.fits is False:
                lines.append(f"{indent}  -> config.{a.key}: {a.advice}")
        return "\n".join(lines)


def _gib(n: Optional[float]) -> str:
    if n is None:
        return "?"
    return f"{n / GIB:.2f} GiB" if abs(n) < GIB else f"{n / GIB:.1f} GiB"


def _biggest(a: ActorPlan) -> str:
    top = sorted(a.items, key=lambda it: -it.bytes)[:3]
    return ", ".join(f"{it.what} {_gib(it.bytes)}" for it in top)


@functools.lru_cache(maxsize=1)
def detect_gpu_memory() -> Tuple[Optional[int], str]:
    """The smallest visible GPU's memory, or None: NVML (``pynvml``) or ``nvidia-smi`` when
    there, so that the process running ``rllib train`` holds no CUDA context on a GPU its
    actors will use; else ``torch.cuda.get_device_properties``."""
    try:
        import torch

        count = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - detection must never stop a run
        count = 0
    if not count:
        return None, "no GPU visible here (torch.cuda); set gpu_memory_gb to check the fit"
    for how in (_nvml_memory, _nvidia_smi_memory, _torch_memory):
        try:
            found = how(count)
        except Exception:  # noqa: BLE001 - try the next way
            found = None
        if found:
            return found
    return None, "GPU memory could not be read here; set gpu_memory_gb"


def _visible(count: int) -> List[int]:
    ids = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    picked = [int(x) for x in ids.split(",") if x.strip().isdigit()]
    return picked[:count] if picked else list(range(count))


def _nvml_memory(count: int) -> Optional[Tuple[int, str]]:
    import pynvml

    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in _visible(count)]
        sizes = [int(pynvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles]
        name = pynvml.nvmlDeviceGetName(handles[0])
    finally:
        pynvml.nvmlShutdown()
    name = name.decode() if isinstance(name, bytes) else str(name)
    return min(sizes), f"detected: {name}, NVML"


def _nvidia_smi_memory(count: int) -> Optional[Tuple[int, str]]:
    import subprocess

    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    ).stdout
    rows = [ln.split(", ") for ln in out.strip().splitlines()]
    rows = [r for r in rows if len(r) == 3 and int(r[0]) in _visible(count)]
    if not rows:
        return None
    return min(int(float(r[2])) for r in rows) << 20, f"detected: {rows[0][1]}, nvidia-smi"


def _torch_memory(count: int) -> Optional[Tuple[int, str]]:
    import torch

    sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(count)]
    return int(min(sizes)), f"detected: {torch.cuda.get_device_name(0)}, torch.cuda"


def gpu_memory_for(config: Any) -> Tuple[Optional[int], str]:
    """``gpu_memory_gb`` (GiB; or a card's name, "H100", from the card table) when set, else
    :func:`detect_gpu_memory`."""
    given = config.gpu_memory_gb
    if given is not None:
        if isinstance(given, str) and not given.replace(".", "", 1).isdigit():
            card = card_by_name(given)
            if card is None:
                raise ValueError(f"gpu_memory_gb: {given!r} is neither a size in GiB nor a card of the card table")
            return int(card.nominal_gb * GIB), f"gpu_memory_gb: {given}"
        return int(float(given) * GIB), "gpu_memory_gb"
    return detect_gpu_memory()


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, default)
    return default if value is None else value


def sequence_lengths(config: Any, shape: ModelShape) -> Tuple[int, int, int, str]:
    """(prompt, response, max_model_len, why): the longest padded row the learner can get.
    With vLLM a completion ends at ``max_model_len`` (``vllm_kwargs.max_model_len``, else
    prompt + response capped at the model's ``max_position_embeddings``)."""
    p = int(config.max_prompt_tokens)
    r = int(config.max_response_tokens)
    why = ""
    max_len = p + r
    if config.generation_backend == "vllm":
        vk = dict(config.vllm_kwargs or {})
        if vk.get("max_model_len"):
            max_len = int(vk["max_model_len"])
            why = f"vllm_kwargs.max_model_len {max_len}"
        elif shape.max_position_embeddings and max_len > shape.max_position_embeddings:
            max_len = int(shape.max_position_embeddings)
            why = f"vLLM's max_model_len = the model's max_position_embeddings {max_len}"
        if r > max_len:
            r = max_len
            why = f"completions end at {why}" if why else ""
    return p, r, max_len, why


def learner_count(config: Any) -> int:
    """Learners that split each minibatch: ``num_learners``, 0 meaning RLlib's one local learner."""
    return max(1, int(_get(config, "num_learners", 0)))


def optimizer_steps(config: Any, num_learners: Optional[int] = None, minibatch_size: Optional[int] = None) -> Tuple[int, int]:
    """``(rows per iteration, optimiser steps per iteration)`` of an ExGRPO/GRPO config
    (``questions_per_step x group_size`` rows; the arguments override the config's fields)."""
    rows = int(config.questions_per_step) * int(config.group_size)
    learners = learner_count(config) if num_learners is None else max(1, int(num_learners))
    minibatch = int(minibatch_size or config.minibatch_size or rows)
    return rows, optimizer_steps_per_iteration(rows, minibatch, learners, int(_get(config, "num_epochs", 1)))


def optimizer_steps_line(config: Any) -> str:
    """The plan's line: how many optimiser steps an iteration makes, and why."""
    rows, steps = optimizer_steps(config)
    minibatch = int(config.minibatch_size or rows)
    return (
        f"optimiser steps per iteration: {steps} = num_epochs {int(_get(config, 'num_epochs', 1))} x "
        f"round({rows} completions / (minibatch_size {minibatch} x {learner_count(config)} learner(s))); "
        f"minibatch_size counts completions per learner"
    )


def _learner_rows(config: Any, tokens: int) -> int:
    """Rows of the largest pass, at full width ``tokens``: the minibatch, capped by
    ``learner_micro_batch_rows`` and by ``learner_micro_batch_tokens`` (a pass holds at most
    the budget's padded positions, or one row; rounded up, so the plan never undercounts)."""
    minibatch = int(_get(config, "minibatch_size", 512) or 512)
    micro = config.learner_micro_batch_rows
    rows = max(1, min(int(micro), minibatch) if micro else minibatch)
    budget = config.learner_micro_batch_tokens
    if budget:
        rows = min(rows, max(1, -(-int(budget) // max(1, int(tokens)))))
    return rows


@dataclass
class LearnerPass:
    """The largest forward/backward pass a learner runs. Packed (``learner_micro_batch_tokens``
    with ``learner_sequence_packing`` under a variable-length kernel): one sequence of the
    budget's tokens (or one row longer than it), every position possibly scored, no
    ``[S, S]`` mask. Padded: ``rows`` rows of the longest row's width, a mask per row."""

    rows: int
    tokens: int
    response: int
    packed: bool
    kernel: str
    #: The longest row (prompt + completion): a pass holds at least one.
    row_tokens: int = 0

    def describe(self) -> str:
        if self.packed:
            return f"one packed pass of {self.tokens} tokens ({self.kernel}, no [T, T] mask)"
        return f"{self.rows} rows x {self.tokens} tokens (padded, {self.kernel})"


def planned_kernel(config: Any) -> str:
    """The attention kernel a GPU learner gets for ``attn_implementation``: "auto" is
    flash_attention_2 where flash-attn is installed, else sdpa_varlen; both are variable-
    length kernels, so the plan is the same for either (named "auto" here)."""
    name = str(config.attn_implementation)
    return "flash_attention_2 or sdpa_varlen" if name == "auto" else name


def learner_pass(config: Any, prompt: int, response: int, *, budget: Optional[int] = None) -> LearnerPass:
    """The largest pass of the config (``budget`` overrides ``learner_micro_batch_tokens``)."""
    tokens = prompt + response
    budget = budget if budget is not None else config.learner_micro_batch_tokens
    name = str(config.attn_implementation)
    kernel = planned_kernel(config)
    packing = bool(config.learner_sequence_packing)
    if budget and packing and (name == "auto" or packs_rows(name, "cuda")):
        length = max(int(budget), tokens)
        return LearnerPass(1, length, length, True, kernel, tokens)
    own_budget = budget is None or budget == config.learner_micro_batch_tokens
    rows = _learner_rows(config, tokens) if own_budget else max(1, -(-int(budget) // tokens))
    return LearnerPass(rows, tokens, response, False, kernel, tokens)


def _pass_activations(
    shape: ModelShape, lp: LearnerPass, *, ckpt: bool, mode_bytes: int, autocast: bool, chunk: Optional[int], rows: Optional[int] = None
) -> Dict[str, int]:
    return learner_activation_breakdown(
        shape,
        rows or lp.rows,
        lp.tokens,
        gradient_checkpointing=ckpt,
        dtype_bytes=mode_bytes,
        response_tokens=lp.response,
        autocast=autocast,
        dense_mask=not lp.packed,
        chunk_tokens=chunk,
    )


def _learner_plan(config: Any, shape: ModelShape, gpu: Optional[int], prompt: int, response: int) -> ActorPlan:
    """What one learner holds: model states, the largest pass's activations, the optimiser
    step, and (when it does not fit ``gpu``) the one key to change."""
    backend = config.learner_backend
    stage = int(config.deepspeed_zero_stage)
    n_learners = int(_get(config, "num_learners", 0))
    per = float(_get(config, "num_gpus_per_learner", 0))
    model_dtype = config.model_dtype
    ckpt = bool(config.gradient_checkpointing)
    adapters = shape.lora_parameters(config.lora_rank, config.lora_target_modules) if config.lora_rank else 0
    states = _learner_model_states(config, shape, adapters, n_learners)
    plan = ActorPlan("learner", max(1, n_learners), per)
    if adapters:
        mode_bytes, autocast = _lora_state_items(
            plan, shape, states, model_dtype, config.lora_rank, adapters, stage if backend == "deepspeed" else 0, max(1, n_learners)
        )
    elif backend == "ddp":
        mode_bytes, autocast = _ddp_state_items(plan, shape, states, model_dtype)
    else:
        mode_bytes, autocast = _deepspeed_state_items(plan, shape, states, stage, max(1, n_learners))
    chunk = config.logit_chunk_tokens
    lp = learner_pass(config, prompt, response)
    act = _pass_activations(shape, lp, ckpt=ckpt, mode_bytes=mode_bytes, autocast=autocast, chunk=chunk)
    how = "checkpointed layer inputs" if ckpt else "saved per layer"
    it = plan.items.append
    it(Item("activations", act["layers"] + act["outside"], f"{lp.describe()}, {how}"))
    it(
        Item(
            "backward working set",
            act["peak"] - act["layers"] - act["outside"],
            f"at the {act['peak_phase'].replace('_', ' ')} peak; log-prob chunks of {act['chunk_tokens']} positions x "
            f"vocab {shape.vocab_size}, recomputed in backward: {_gib(act['logit_chunks'])}",
        )
    )
    if config.scoring_on == "learners":
        _learner_scoring_items(plan, config, shape, prompt + response, response, mode_bytes, chunk, act)
    if float(config.kl_coeff or 0.0) > 0:
        _kl_reference_items(plan, shape, lp, act, mode_bytes, chunk, backend, lora=bool(adapters))
    # The optimiser step runs after the pass: its temporaries need room only beyond the
    # activations (freed by then) and autocast's weight copies.
    step_extra = states["step_extra"] - states["autocast_copies"] - act["peak"]
    if step_extra > 0:
        it(Item("optimizer step extra", step_extra, "fp32 temporaries of the step beyond the pass's activations"))
    it(Item("CUDA context, workspaces", PROCESS_OVERHEAD_BYTES, "assumed"))
    _learner_sync_items(plan, config, shape, dtype_bytes(model_dtype), max(act["peak"], states["step_extra"] - states["autocast_copies"]))
    if not lp.packed:
        _padded_attention_note(plan, shape, lp, mode_bytes, autocast)
    if gpu is not None and per > 0:
        plan.budget = int(min(1.0, per) * usable_memory(gpu))
        if plan.fits is False:
            _learner_advice(plan, config, shape, states, act, lp, mode_bytes, autocast)
    return plan


def _learner_model_states(config: Any, shape: ModelShape, adapters: int, n_learners: int) -> Dict[str, int]:
    """:func:`model_state_bytes` of one of the ``n_learners`` learners' GPUs as ``config`` sets
    them up (``adapters``: the LoRA parameters, 0 without LoRA); the learner's plan and the
    colocated generation turn's."""
    ddp_kwargs = dict(_get(config, "torch_ddp_kwargs", {}) or {})
    return model_state_bytes(
        shape,
        backend=config.learner_backend,
        zero_stage=int(config.deepspeed_zero_stage),
        num_learners=max(1, n_learners),
        model_dtype=config.model_dtype,
        ddp_bucket_view=bool(ddp_kwargs.get("gradient_as_bucket_view", False)),
        lora_parameters=adapters,
    )


def _padded_attention_note(plan: ActorPlan, shape: ModelShape, lp: LearnerPass, mode_bytes: int, autocast: bool) -> None:
    """A padded (not packed) pass: what its masked attention adds per layer (already counted
    in the activations), noted on ``plan``."""
    m = masked_attention_bytes(shape, lp.rows, lp.tokens, lp.tokens, dtype_bytes=2 if autocast else mode_bytes)
    plan.notes.append(
        f"padded passes: masked attention with key/value heads matched to the query's (CUDA's "
        f"memory-efficient kernel, not the math kernel): per layer k and v repeated to "
        f"{shape.num_attention_heads} heads {_gib(m['repeated_kv'])}, SDPA's additive mask "
        f"{_gib(m['float_mask'])}, boolean mask {_gib(m['boolean_mask'])}; in the activations above"
    )


def _ddp_state_items(plan: ActorPlan, shape: ModelShape, states: Dict[str, int], model_dtype: str) -> Tuple[int, bool]:
    """The DDP learner's model states into ``plan``; returns the pass's ``(dtype bytes,
    autocast)``: bf16/fp16 models compute under autocast over fp32 master weights."""
    it = plan.items.append
    p = shape.num_parameters
    dt = "fp32 master weights (autocast computes in " + model_dtype + ")" if dtype_bytes(model_dtype) == 2 else "fp32 weights"
    it(Item("weights", states["weights"], f"{p / 1e9:.2f} B x 4 B, {dt}; DDP: a full copy per learner"))
    it(Item("gradients", states["gradients"], "fp32, full"))
    it(Item("optimizer state", states["optimizer"], "AdamW moments, 2 x fp32, full"))
    if states["buckets"]:
        it(Item("DDP gradient buckets", states["buckets"], "fp32 copy of the gradients (gradient_as_bucket_view off)"))
    if states["autocast_copies"]:
        it(Item("autocast weight copies", states["autocast_copies"], "bf16 copies of the linear layers' weights, held through a pass"))
    return (2, True) if dtype_bytes(model_dtype) == 2 else (4, False)


def _lora_state_items(
    plan: ActorPlan, shape: ModelShape, states: Dict[str, int], model_dtype: str, rank: int, adapters: int, zero_stage: int = 0, nl: int = 1
) -> Tuple[int, bool]:
    """A LoRA learner's model states into ``plan``; returns the pass's ``(dtype bytes,
    autocast)``: the frozen base computes in its own dtype, the fp32 adapters under autocast."""
    it = plan.items.append
    p = shape.num_parameters
    if zero_stage:  # DeepSpeed (colocated LoRA)
        sliced = f" / {nl} learners (ZeRO-3)" if zero_stage == 3 else ""
        it(
            Item(
                "weights",
                states["weights"],
                f"{p / 1e9:.2f} B frozen base x {dtype_bytes(model_dtype)} B "
                f"({model_dtype}) + {adapters / 1e6:.1f} M bf16 LoRA adapters (rank {rank})" + sliced,
            )
        )
        it(Item("gradients", states["gradients"], "bf16, adapters only" + (f" / {nl} learners" if zero_stage >= 2 else "")))
        it(Item("optimizer state", states["optimizer"], f"fp32 master + AdamW moments of the adapters / {nl} learners"))
        if states["gathered"]:
            it(Item("ZeRO-3 gathered module", states["gathered"], "the largest frozen module's weight, gathered for a pass"))
        return 2, False
    it(
        Item(
            "weights",
            states["weights"],
            f"{p / 1e9:.2f} B frozen base x {dtype_bytes(model_dtype)} B ({model_dtype}) "
            f"+ {adapters / 1e6:.1f} M fp32 LoRA adapters (rank {rank})",
        )
    )
    it(Item("gradients", states["gradients"], "fp32, adapters only"))
    it(Item("optimizer state", states["optimizer"], "AdamW moments, 2 x fp32, adapters only"))
    if states["buckets"]:
        it(Item("DDP gradient buckets", states["buckets"], "fp32 copy of the adapters' gradients"))
    return (2, True) if dtype_bytes(model_dtype) == 2 else (4, False)


def _deepspeed_state_items(plan: ActorPlan, shape: ModelShape, states: Dict[str, int], stage: int, nl: int) -> Tuple[int, bool]:
    """The DeepSpeed learner's (ZeRO ``stage``, ``nl`` learners) model states into
    ``plan``, with a cross-check against DeepSpeed's own estimator where it is installed;
    returns the pass's ``(dtype bytes, autocast)``: bf16, no autocast."""
    it = plan.items.append
    p = shape.num_parameters
    shard = f"/ {nl} learners"
    it(Item("weights", states["weights"], f"{p / 1e9:.2f} B x 2 B bf16" + (f" {shard} (ZeRO-3)" if stage == 3 else "")))
    it(Item("gradients", states["gradients"], "bf16" + ("" if stage == 1 else f" {shard} (ZeRO-{stage})")))
    it(Item("optimizer state", states["optimizer"], f"fp32 master + AdamW moments, 12 B {shard} (ZeRO-{stage})"))
    it(Item("reduce bucket", states["buckets"], "bf16 reduce_bucket_size = min(5e8, parameters)"))
    if states["gathered"]:
        it(
            Item(
                "ZeRO-3 gathered module", states["gathered"], "largest module's bf16 weight + gradient (DeepSpeed's ZeRO-3 estimator term)"
            )
        )
    ds = deepspeed_estimate_bytes(shape, zero_stage=stage, num_learners=nl)
    if ds is not None:
        ours = states["deepspeed_comparable"]
        fn = "estimate_zero2_model_states_mem_needs" if stage == 2 else "estimate_zero3_model_states_mem_needs"
        what = "gathered module, " if stage == 3 else ""
        plan.notes.append(
            f"cross-check: DeepSpeed's {fn} (no offload) gives {_gib(ds)} for weights, gradients, "
            f"{what}optimizer state and the step's fp32 gradients; this plan {_gib(ours)} "
            f"({(ours - ds) / ds:+.0%})"
        )
    return 2, False


def _learner_scoring_items(
    plan: ActorPlan, config: Any, shape: ModelShape, tokens: int, response: int, mode_bytes: int, chunk: int, act: Dict[str, int]
) -> None:
    """``scoring_on: learners``: the no-grad scoring passes before the update, padded passes
    of length-sorted rows under the same budget (rows come back in place); nothing of the
    update is held yet, so only what exceeds the update's peak is an item."""
    rows = _learner_rows(config, tokens)
    scoring = scoring_activation_bytes(shape, rows, tokens, response_tokens=response, dtype_bytes=mode_bytes, chunk_tokens=chunk)
    if scoring > act["peak"]:
        plan.items.append(Item("scoring pass", scoring - act["peak"], "scoring_on: learners: no-grad pass beyond the update's"))
    else:
        plan.notes.append(
            f"scoring_on: learners: the no-grad scoring passes ({_gib(scoring)} each, {rows} rows x "
            f"{tokens} tokens) run before the update and peak below its activations"
        )


def _kl_reference_items(
    plan: ActorPlan, shape: ModelShape, lp: LearnerPass, act: Dict[str, int], mode_bytes: int, chunk: int, backend: str, lora: bool = False
) -> None:
    """``kl_coeff > 0``: the frozen reference policy (none with LoRA: the base with the
    adapters disabled is the reference), and its no-grad pass on top of the saved
    activations where that exceeds the update's peak."""
    if lora:
        plan.notes.append("kl_coeff > 0 with LoRA: the reference is the frozen base with the adapters disabled (no second copy)")
    else:
        ref_bytes = shape.num_parameters * (4 if backend == "ddp" else 2)
        plan.items.append(Item("KL reference model", ref_bytes, "frozen copy of the policy (kl_coeff > 0)"))
    ref_pass = scoring_activation_bytes(
        shape,
        lp.rows,
        lp.tokens,
        response_tokens=lp.response,
        dtype_bytes=mode_bytes,
        with_entropy=False,
        dense_mask=not lp.packed,
        chunk_tokens=chunk,
    )
    extra = max(0, act["forward_end"] + ref_pass - act["peak"])
    if extra:
        plan.items.append(Item("KL reference pass", extra, "no-grad scoring of the pass on top of the saved activations"))


def _learner_advice(
    plan: ActorPlan,
    config: Any,
    shape: ModelShape,
    states: Dict[str, int],
    act: Dict[str, int],
    lp: LearnerPass,
    mode_bytes: int,
    autocast: bool,
) -> None:
    """The one key to change, and to what: the model states' layout first, then the pass
    size, then one row."""
    ckpt = bool(config.gradient_checkpointing)
    chunk = config.logit_chunk_tokens
    fixed = plan.total - act["peak"] - max(0, states["step_extra"] - states["autocast_copies"] - act["peak"])
    room = plan.budget - fixed

    def act_of(
        c: bool, rows: Optional[int] = None, pass_: Optional[LearnerPass] = None, half: int = mode_bytes, ac: bool = autocast
    ) -> int:
        return _pass_activations(shape, pass_ or lp, ckpt=c, mode_bytes=half, autocast=ac, chunk=chunk, rows=rows)["peak"]

    if room <= 0 or states["total"] > plan.budget // 2:
        if _model_state_advice(plan, config, shape, states, lambda: act_of(ckpt, half=2, ac=False)):
            return
    if not ckpt and act_of(True) <= room:
        plan.key = "gradient_checkpointing"
        plan.advice = f"activations of {lp.describe()} take {_gib(act['peak'])}; with gradient_checkpointing: true {_gib(act_of(True))}"
        return
    more = "" if ckpt else " (gradient_checkpointing: true allows more)"
    if _pass_size_advice(plan, config, lp, act, room, lambda **kw: act_of(ckpt, **kw), more):
        return
    row = lp.row_tokens
    one_row = LearnerPass(1, row, row if lp.packed else lp.response, lp.packed, lp.kernel, row)
    if not ckpt and act_of(True, pass_=one_row) <= room:
        plan.key = "gradient_checkpointing"
        plan.advice = "even one row does not fit without it: gradient_checkpointing: true and fewer rows per pass"
        return
    plan.key = "max_response_tokens"
    plan.advice = (
        f"one row of {row} tokens needs {_gib(act_of(ckpt, pass_=one_row))} of activations, "
        f"{_gib(max(room, 0))} are left: shorter completions, or more learners to shard the model states"
    )


def _model_state_advice(plan: ActorPlan, config: Any, shape: ModelShape, states: Dict[str, int], bf16_pass_peak: Callable[[], int]) -> bool:
    """When the model states crowd the GPU: DDP -> DeepSpeed (naming the first ZeRO stage
    whose states plus a bf16 pass fit, ``bf16_pass_peak()`` its activations), ZeRO-1/2 ->
    ZeRO-3. Returns whether ``plan`` got its advice."""
    backend = config.learner_backend
    stage = int(config.deepspeed_zero_stage)
    nl = max(1, int(_get(config, "num_learners", 0)))

    def stage_fits(s: int) -> bool:
        st = model_state_bytes(shape, backend="deepspeed", zero_stage=s, num_learners=nl, model_dtype="bfloat16")
        return st["total"] + bf16_pass_peak() + PROCESS_OVERHEAD_BYTES <= plan.budget

    if backend == "ddp":
        ok = [s for s in (2, 3) if stage_fits(s)]
        plan.key = "learner_backend"
        plan.advice = (
            f"the DDP learner keeps {_gib(states['total'])} of fp32 weights, gradients and AdamW "
            "state on every learner; learner_backend: deepspeed shards it ("
            + (f"deepspeed_zero_stage: {ok[0]} fits" if ok else "and fewer rows per pass")
            + ")"
        )
        return True
    if stage < 3:
        plan.key = "deepspeed_zero_stage"
        plan.advice = (
            f"ZeRO-{stage} keeps {_gib(states['total'])} of model states per learner; deepspeed_zero_stage: 3 shards the weights too"
        )
        return True
    return False


def _pass_size_advice(
    plan: ActorPlan, config: Any, lp: LearnerPass, act: Dict[str, int], room: int, peak_of: Callable[..., int], more: str
) -> bool:
    """A smaller pass that fits ``room``: a smaller token budget for packed passes, fewer
    rows (as rows, or as a token budget where one is set) for padded ones; ``peak_of(rows=,
    pass_=)`` gives a pass's activation peak. Returns whether ``plan`` got its advice."""
    row = lp.row_tokens
    if lp.packed:
        budgets = [b for b in range(lp.tokens - 1024, row - 1, -1024) if b > 0]
        fit = [b for b in budgets if peak_of(pass_=LearnerPass(1, b, b, True, lp.kernel, row)) <= room]
        if fit:
            plan.key = "learner_micro_batch_tokens"
            plan.advice = (
                f"a packed pass of {lp.tokens} tokens needs {_gib(act['peak'])} of activations, "
                f"{_gib(max(room, 0))} are left: learner_micro_batch_tokens: {fit[0]} fits{more}"
            )
        return bool(fit)
    fit = [r for r in range(lp.rows - 1, 0, -1) if peak_of(rows=r) <= room]
    if not fit:
        return False
    if config.learner_micro_batch_tokens:
        plan.key = "learner_micro_batch_tokens"
        plan.advice = (
            f"passes of {lp.rows * lp.tokens} tokens need {_gib(act['peak'])} of activations, "
            f"{_gib(max(room, 0))} are left: learner_micro_batch_tokens: {fit[0] * lp.tokens} "
            f"fits{more}"
        )
    else:
        plan.key = "learner_micro_batch_rows"
        plan.advice = (
            f"passes of {lp.describe()} need {_gib(act['peak'])} of activations, "
            f"{_gib(max(room, 0))} are left: learner_micro_batch_rows: {fit[0]} fits{more}"
        )
    return True


def _runner_plan(config: Any, shape: ModelShape, gpu: Optional[int], prompt: int, response: int, max_len: int) -> ActorPlan:
    """What one GPU env runner holds: the vLLM engine or the HF generation KV cache, its
    torch module and scoring pass, and (when it does not fit ``gpu``) the key to change."""
    n = int(_get(config, "num_env_runners", 0))
    per = float(_get(config, "num_gpus_per_env_runner", 0))
    model_dtype = config.model_dtype
    b = dtype_bytes(model_dtype)
    plan = ActorPlan("env runner", max(1, n), per)
    it = plan.items.append
    backend = config.generation_backend
    chunk = int(config.generation_batch_size)
    p = shape.num_parameters
    tokens = prompt + response
    kv_token = shape.kv_cache_bytes_per_token(b)
    vllm_share = None
    if backend == "vllm":
        vllm_share = _vllm_engine_items(plan, config, shape, gpu, b, chunk, max_len)
    engine_only = backend == "vllm" and config.scoring_on == "learners"
    score = 0
    if engine_only:
        plan.notes.append(
            f"scoring_on: learners: no torch copy of the model here (vLLM's weights are the only "
            f"copy; {_gib(p * b)} not held), the learners score the completions"
        )
    else:
        it(Item("policy module (HF copy)", p * b, f"{p / 1e9:.2f} B x {b} B {model_dtype}: the runner's torch module"))
    if backend != "vllm":
        gen_kv = chunk * tokens * kv_token
        it(Item("HF generation KV cache", gen_kv, f"generation_batch_size {chunk} x {tokens} tokens x {kv_token / 1024:.0f} KiB"))
    if not engine_only and config.scoring_on != "learners":
        score = scoring_activation_bytes(shape, chunk, tokens, response_tokens=response, dtype_bytes=b)
        what = "behaviour log-probs and lowest-entropy scoring" if backend == "vllm" else "scoring"
        it(Item("scoring pass", score, f"{what}: generation_batch_size {chunk} rows x {tokens} tokens, no grad"))
    it(Item("CUDA context, workspaces", PROCESS_OVERHEAD_BYTES, "assumed"))
    _runner_sync_items(plan, config, shape, b)
    if gpu is not None and per > 0:
        plan.budget = int(min(1.0, per) * usable_memory(gpu))
        if not plan.failed and plan.fits is False:
            _runner_advice(plan, shape, gpu, chunk, tokens, response, b, score, vllm_share)
    return plan


def _vllm_engine_items(
    plan: ActorPlan, config: Any, shape: ModelShape, gpu: Optional[int], b: int, chunk: int, max_len: int
) -> Optional[int]:
    """The vLLM engine's share of the GPU (``gpu_memory_utilization``; its weights alone
    when ``gpu`` is unknown) and its KV cache into ``plan``; fails the plan when the cache
    cannot hold one sequence of ``max_len``. Returns the share in bytes (None: ``gpu``
    unknown)."""
    it = plan.items.append
    p = shape.num_parameters
    kv_token = shape.kv_cache_bytes_per_token(b)
    vk = dict(config.vllm_kwargs or {})
    util = float(vk.get("gpu_memory_utilization", VLLM_DEFAULT_UTILIZATION))
    weights = p * b
    if gpu is None:
        it(Item("vLLM engine weights", weights, f"{p / 1e9:.2f} B x {b} B; plus its KV cache: gpu_memory_utilization {util:g} x the GPU"))
        plan.notes.append(f"KV cache: {kv_token / 1024:.0f} KiB per token")
        return None
    vllm_share = int(util * usable_memory(gpu))  # vLLM's fraction of the total CUDA reports
    kv = vllm_share - weights
    it(
        Item(
            "vLLM engine",
            vllm_share,
            f"gpu_memory_utilization {util:g} x the GPU's usable memory: weights {_gib(weights)} + "
            f"KV cache and vLLM's activations {_gib(kv)}",
        )
    )
    seqs = int(vk.get("max_num_seqs", chunk))
    tokens_kv = max(0, kv) // kv_token
    plan.notes.append(
        f"KV cache: {kv_token / 1024:.0f} KiB per token (2 x {shape.num_hidden_layers} layers "
        f"x {shape.num_key_value_heads} kv heads x {shape.head_dim} x {b} B): at most "
        f"{tokens_kv:,} tokens, {tokens_kv // max(1, max_len)} sequences of max_model_len "
        f"{max_len} (max_num_seqs {seqs}); less vLLM's own activation reserve"
    )
    if tokens_kv < max_len:
        plan.failed = True
        plan.key = "vllm_kwargs.gpu_memory_utilization"
        plan.advice = (
            f"vLLM's share {_gib(vllm_share)} leaves {_gib(max(kv, 0))} after the weights, less "
            f"than one sequence of max_model_len {max_len} ({_gib(max_len * kv_token)}): raise it"
        )
    return vllm_share


def _runner_advice(
    plan: ActorPlan, shape: ModelShape, gpu: int, chunk: int, tokens: int, response: int, b: int, score: int, vllm_share: Optional[int]
) -> None:
    """The env runner's key to change: vLLM's share when the scoring pass is small beside
    it, else ``generation_batch_size`` (the largest that fits)."""
    others = plan.total - (vllm_share or 0)
    if vllm_share is not None and score < plan.budget // 4:
        most = (plan.budget - others) / usable_memory(gpu)
        plan.key = "vllm_kwargs.gpu_memory_utilization"
        plan.advice = (
            f"vLLM takes {_gib(vllm_share)} and the runner's own module and scoring "
            f"{_gib(others)}: at most {math.floor(most * 100) / 100:.2f} leaves them room"
        )
        return
    fit = [
        c
        for c in range(chunk - 1, 0, -1)
        if plan.total - score + scoring_activation_bytes(shape, c, tokens, response_tokens=response, dtype_bytes=b) <= plan.budget
    ]
    plan.key = "generation_batch_size"
    plan.advice = f"its scoring pass of {chunk} rows x {tokens} tokens takes {_gib(score)}" + (
        f": generation_batch_size: {fit[0]} fits" if fit else (": lower vllm_kwargs.gpu_memory_utilization too" if vllm_share else "")
    )


def uses_gpus(config: Any) -> bool:
    def pos(name):
        try:
            return float(getattr(config, name, 0) or 0) > 0
        except (TypeError, ValueError):
            return False

    return pos("num_gpus_per_learner") or pos("num_gpus_per_env_runner")


def plan_memory(
    config: Any, *, gpu_memory: Optional[int] = None, gpu_memory_source: str = "", shape: Optional[ModelShape] = None
) -> MemoryPlan:
    """The memory plan of an ``ExGRPOConfig`` (or any object with its fields): per actor
    kind that gets a GPU, what it holds, against ``gpu_memory`` (bytes; default
    :func:`gpu_memory_for`)."""
    name = str(config.model_name_or_path)
    if gpu_memory is None:
        gpu_memory, gpu_memory_source = gpu_memory_for(config)
    shape = shape or model_shape(name)
    plan = MemoryPlan(name, shape, gpu_memory, gpu_memory_source, optimizer_steps=optimizer_steps_line(config))
    if shape is None:
        plan.notes.append(
            "not a local folder, not in the local Hugging Face cache, not a built embedded model, not in the table of published shapes"
        )
        return plan
    prompt, response, max_len, why = sequence_lengths(config, shape)
    if why:
        plan.notes.append(
            f"completion tokens per row: {response} ({why}); max_response_tokens "
            f"{int(config.max_response_tokens)} still sets the loss normalisation"
        )
    plan.time = time_estimate(config, shape, gpu_memory, prompt, response)
    if float(_get(config, "num_gpus_per_learner", 0)) > 0:
        plan.actors.append(_learner_plan(config, shape, gpu_memory, prompt, response))
    if float(_get(config, "num_gpus_per_learner", 0)) > 0 and config.colocate:
        _add_sleeping_engine(plan.actors[-1], config, gpu_memory)
        plan.actors.append(_colocated_turn_plan(config, shape, gpu_memory, prompt, response, max_len))
    elif float(_get(config, "num_gpus_per_env_runner", 0)) > 0:
        plan.actors.append(_runner_plan(config, shape, gpu_memory, prompt, response, max_len))
    return plan


def time_estimate(config: Any, shape: ModelShape, gpu_memory: Optional[int], prompt: int, response: int) -> Optional[TimeEstimate]:
    """Seconds per iteration on the plan's card (``planning/timing.py``), for a config whose
    learners have GPUs; None off the card table or without a GPU learner."""
    card = card_for_estimate(gpu_memory)
    if card is None or float(_get(config, "num_gpus_per_learner", 0)) <= 0:
        return None
    learners = learner_count(config)
    colocate = bool(config.colocate)
    runners = learners if colocate else max(1, int(_get(config, "num_env_runners", 0)))
    lora = bool(config.lora_rank)
    optimizer_state = 0.0 if lora else 12.0 * shape.num_parameters  # fp32 master weights + AdamW moments
    if config.learner_backend == "deepspeed":
        optimizer_state /= learners  # ZeRO shards them
    rows, _ = optimizer_steps(config)
    return estimate_iteration(
        parameters=shape.num_parameters,
        completions=rows,
        prompt_cap=prompt,
        completion_cap=response,
        generating_gpus=runners,
        learner_gpus=learners,
        card=card,
        lora=lora,
        gradient_checkpointing=bool(config.gradient_checkpointing),
        colocate=colocate,
        optimizer_state_bytes=optimizer_state,
        value_trunk=bool(_get(config, "ppo_value_trunk", False)),
    )


#: What a vLLM engine asleep at level 2 still holds, as a share of its ``gpu_memory_utilization``
#: share (at least :data:`SLEEPING_ENGINE_MIN_BYTES`): its CUDA graphs' pool and buffers outside
#: the sleep allocator. vLLM documents sleep as freeing "up to 90%+" of the engine's memory
#: (docs.vllm.ai/en/latest/features/sleep_mode/); assumed here, to be measured on a GPU.
SLEEPING_ENGINE_SHARE = 0.10
SLEEPING_ENGINE_MIN_BYTES = 1 << 30


def _add_sleeping_engine(plan: ActorPlan, config: Any, gpu: Optional[int]) -> None:
    """``colocate``: the learner's plan is its GPU's training turn; a vLLM engine asleep next
    to it keeps a residue (:data:`SLEEPING_ENGINE_SHARE`)."""
    plan.kind = "learner, training turn (colocate)"
    if config.generation_backend != "vllm":
        plan.notes.append(
            "the HF backend generates from the learner's own model"
            + (" (ZeRO-3: from a plain copy kept on the host while the learner trains)" if _zero3(config) else "")
        )
        return
    util = float(dict(config.vllm_kwargs or {}).get("gpu_memory_utilization", VLLM_DEFAULT_UTILIZATION))
    share = int(util * usable_memory(gpu)) if gpu is not None else 0
    plan.items.insert(
        len(plan.items) - 1 if plan.items else 0,
        Item(
            "vLLM engine asleep (level 2)",
            max(SLEEPING_ENGINE_MIN_BYTES, int(SLEEPING_ENGINE_SHARE * share)),
            f"no weights, no KV cache; its CUDA graphs and buffers: assumed {SLEEPING_ENGINE_SHARE:.0%} of its "
            f"share, at least {_gib(SLEEPING_ENGINE_MIN_BYTES)}",
        ),
    )


def _zero3(config: Any) -> bool:
    return config.learner_backend == "deepspeed" and int(config.deepspeed_zero_stage) == 3


def _layer_bytes(shape: ModelShape, b: int) -> int:
    """One decoder layer's weights."""
    return shape.layer_parameters * b


def _colocated_turn_plan(config: Any, shape: ModelShape, gpu: Optional[int], prompt: int, response: int, max_len: int) -> ActorPlan:
    """``colocate``: the learner's GPU during a generation turn (rllib/colocation.py). The
    learner's weights stay; its gradients are dropped; with vLLM its optimizer state is on the
    host and the engine is awake (its share, weights and KV cache), with HF the optimizer state
    stays and the learner's own model generates (its KV cache and scoring pass). The training
    phase is the ``learner`` plan (a sleeping engine holds neither weights nor KV cache)."""
    n_learners = int(_get(config, "num_learners", 0))
    per = float(_get(config, "num_gpus_per_learner", 0))
    adapters = shape.lora_parameters(config.lora_rank, config.lora_target_modules) if config.lora_rank else 0
    states = _learner_model_states(config, shape, adapters, n_learners)
    plan = ActorPlan("learner, generation turn (colocate)", max(1, n_learners), per)
    it = plan.items.append
    b = dtype_bytes(config.model_dtype)
    chunk = int(config.generation_batch_size)
    tokens = prompt + response
    it(Item("learner weights", states["weights"], "resident through the turn"))
    if states["buckets"] and config.learner_backend == "ddp":
        it(Item("DDP gradient buckets", states["buckets"], "kept by DDP between updates"))
    vllm_share = None
    zero3 = _zero3(config)
    if config.generation_backend == "vllm" or zero3:
        plan.notes.append(f"optimizer state ({_gib(states['optimizer'])}) and gradients offloaded / dropped while the sampler is awake")
    _weight_push_items(plan, config, shape, b, zero3)
    if config.generation_backend == "vllm":
        vllm_share = _vllm_engine_items(plan, config, shape, gpu, b, chunk, max_len)
    else:
        _hf_generation_items(plan, config, shape, states, b, chunk, prompt, response, zero3)
    if config.scoring_on != "learners" and config.behaviour_logprobs == "recompute":
        it(
            Item(
                "scoring pass",
                scoring_activation_bytes(shape, chunk, tokens, response_tokens=response, dtype_bytes=b),
                f"behaviour log-probs: generation_batch_size {chunk} rows x {tokens} tokens, no grad",
            )
        )
    it(Item("CUDA context, workspaces", PROCESS_OVERHEAD_BYTES, "assumed"))
    _colocated_turn_budget(plan, gpu, per, vllm_share)
    return plan


def _weight_push_items(plan: ActorPlan, config: Any, shape: ModelShape, b: int, zero3: bool) -> None:
    """``colocate``: what pushing the learner's weights to the sampler holds at a time: under
    ZeRO-3 a gathered decoder layer; with LoRA (vLLM or ZeRO-3) a merged decoder layer and the
    merge's temporaries."""
    it = plan.items.append
    if zero3:
        it(
            Item(
                "one decoder layer gathered for the push",
                _layer_bytes(shape, b),
                "the weights reach the sampler a decoder layer at a time, each gathered (ZeRO-3)",
            )
        )
    if config.lora_rank and (config.generation_backend == "vllm" or zero3):
        ab = _lora_adapter_bytes(config)
        merge = lora_merge_bytes(shape, target_modules=config.lora_target_modules, base_bytes=b, adapter_bytes=ab)
        it(
            Item(
                "one decoder layer merged for the push",
                merge["merged_layer"],
                f"the layer's merged weights W + (alpha / r) B A in {config.model_dtype}, held until it is pushed",
            )
        )
        it(
            Item(
                "LoRA merge temporaries",
                merge["temporaries"],
                f"B @ A and its scaled copy, {'fp32' if ab == 4 else 'bf16'}, of the largest targeted weight "
                f"({max(_lora_target_sizes(shape, config.lora_target_modules) or [0]) / 1e6:.1f} M elements), "
                f"one weight at a time",
            )
        )


def _hf_generation_items(
    plan: ActorPlan, config: Any, shape: ModelShape, states: Dict[str, int], b: int, chunk: int, prompt: int, response: int, zero3: bool
) -> None:
    """``colocate`` with the HF backend: the model that generates and its KV cache. Under ZeRO-3
    it is a plain copy of the weights; otherwise the learner's own model, whose optimizer state
    (and autocast's weight copies) stay through the turn."""
    it = plan.items.append
    tokens = prompt + response
    if zero3:
        it(
            Item(
                "HF generation copy (ZeRO-3)",
                shape.num_parameters * b,
                "a plain copy of the weights, refilled each turn (on the host while the learner trains)",
            )
        )
        kv_token = shape.kv_cache_bytes_per_token(b)
        it(
            Item(
                "HF generation KV cache",
                chunk * (prompt + response) * kv_token,
                f"generation_batch_size {chunk} x {prompt + response} tokens x {kv_token / 1024:.0f} KiB",
            )
        )
    else:
        it(Item("optimizer state", states["optimizer"], "stays: the HF backend generates from the learner's model"))
        if states.get("autocast_copies"):
            it(
                Item(
                    "autocast weight copies",
                    states["autocast_copies"],
                    "bf16 copies of the linear layers' weights, cached by autocast through the turn",
                )
            )
        kv_token = shape.kv_cache_bytes_per_token(b)
        it(
            Item(
                "HF generation KV cache",
                chunk * tokens * kv_token,
                f"generation_batch_size {chunk} x {tokens} tokens x {kv_token / 1024:.0f} KiB",
            )
        )


def _colocated_turn_budget(plan: ActorPlan, gpu: Optional[int], per: float, vllm_share: Optional[int]) -> None:
    """The turn's budget (the learner's share of its GPU) and, when the turn does not fit, the
    setting to change: vLLM's memory share, else the HF generation chunk."""
    if gpu is not None and per > 0:
        plan.budget = int(min(1.0, per) * usable_memory(gpu))
        if not plan.failed and plan.fits is False:
            others = plan.total - (vllm_share or 0)
            if vllm_share is not None:
                plan.key = "vllm_kwargs.gpu_memory_utilization"
                plan.advice = (
                    f"the learner keeps {_gib(others)} through the turn: at most "
                    f"{max(0.0, math.floor((plan.budget - others) / usable_memory(gpu) * 100) / 100):.2f} leaves it room"
                )
            else:
                plan.key = "generation_batch_size"
                plan.advice = "the HF KV cache and scoring pass of a generation chunk do not fit beside the learner"


def plan_problems(config: Any) -> List[str]:
    """One line per actor that does not fit (empty when it fits or cannot be checked)."""
    if not uses_gpus(config):
        return []
    return plan_memory(config).problems()


__all__ = [
    "ActorPlan",
    "GIB",
    "Item",
    "MemoryPlan",
    "NCCL_BUFFER_BYTES",
    "deepspeed_estimate_bytes",
    "detect_gpu_memory",
    "dtype_bytes",
    "gpu_memory_for",
    "layer_saved_bytes",
    "learner_activation_breakdown",
    "learner_activation_bytes",
    "lora_merge_bytes",
    "masked_attention_bytes",
    "model_state_bytes",
    "plan_memory",
    "plan_problems",
    "scoring_activation_bytes",
    "sequence_lengths",
    "usable_memory",
    "uses_gpus",
    "weight_sync_bytes",
]
