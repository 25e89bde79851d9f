"""Attention kernels and which of them can run packed learner passes.

A packed pass (``core/packing.py``) lays several rows end to end in one sequence. Only a
*variable-length* kernel attends within each row without a dense ``[T, T]`` mask: with
transformers' plain ``"sdpa"`` or ``"eager"``, a packed sequence gets a block-diagonal mask
of ``T x T`` entries and every one of the ``T^2`` scores is computed (1 GiB of mask and
about twice the learner's compute at 32k tokens). The learner therefore packs only under a
kernel of :data:`PACKED_KERNELS`; under any other it uses sorted-and-trimmed padded passes
(``rllib/learner.py``).

This module also registers one kernel of its own with transformers, ``"sdpa_varlen"``:
PyTorch's scaled-dot-product attention called once per packed row (``is_causal``, no
mask), so a packed pass costs each row's own ``L^2`` and never ``T^2``. It is the
variable-length kernel wherever flash-attention is not installed (CPUs, where
flash-attention and flex attention's backward do not run, and GPUs without the
``flash-attn`` wheel). Padded inputs (a 2-D padding mask, generation with a cache) get the
same boolean causal-and-padding mask transformers' ``"sdpa"`` would use, in a call with as
many key/value heads as query heads (:func:`masked_sdpa`): a masked call with grouped-query
heads would leave CUDA only SDPA's math kernel, and its ``[B, H, L, L]`` float scores.
"""

from __future__ import annotations

from typing import Optional

import torch

#: The project's own variable-length kernel (registered by :func:`register_kernels`).
SDPA_VARLEN = "sdpa_varlen"
#: ``attn_implementation`` values whose kernels attend within each packed row without a
#: dense mask. ``flex_attention`` is one on CUDA only (its CPU backward does not exist).
PACKED_KERNELS = ("flash_attention_2", "flash_attention_3", SDPA_VARLEN)
#: What the ``attn_implementation`` field accepts ("auto" resolves to one of the others).
ATTN_IMPLEMENTATIONS = ("auto", SDPA_VARLEN, "flash_attention_2", "flash_attention_3", "flex_attention", "sdpa", "eager")


def resolve_attn_implementation(name: str, device_type: str) -> str:
    """The kernel ``"auto"`` means on ``device_type``: flash-attention 2 on CUDA where the
    ``flash_attn`` package imports, else :data:`SDPA_VARLEN`; other names pass through."""
    if name != "auto":
        return name
    if device_type == "cuda":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return SDPA_VARLEN
        return "flash_attention_2"
    return SDPA_VARLEN


def packs_rows(name: Optional[str], device_type: str = "cpu") -> bool:
    """Whether the kernel ``name`` runs packed passes without a dense ``[T, T]`` mask."""
    if name == "flex_attention":
        return device_type == "cuda"
    return name in PACKED_KERNELS


def model_kernel(model) -> Optional[str]:
    """The attention implementation a loaded transformers model runs."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def cu_seq_lens(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative row boundaries ``[rows + 1]`` (int32) of a packed sequence whose
    positions restart at 0 for each row: ``position_ids [1, T]``."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0, as_tuple=True)[0]
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    end = torch.tensor([pos.numel()], dtype=starts.dtype, device=starts.device)
    return torch.cat([starts, end]).to(torch.int32)


def _padding_mask_4d(mask_2d: torch.Tensor, q_len: int) -> torch.Tensor:
    """``[B, 1, q, kv]`` bool: causal (queries are the last ``q`` keys) and not padding.
    A query with no key to attend (a left-padding position) attends all keys instead: its
    output is never read, and a row of -inf scores would give NaN in both passes."""
    kv_len = mask_2d.shape[-1]
    keys = mask_2d[:, -kv_len:].bool()
    q_idx = torch.arange(kv_len - q_len, kv_len, device=keys.device).view(-1, 1)
    causal = torch.arange(kv_len, device=keys.device).view(1, -1) <= q_idx
    mask = causal.unsqueeze(0) & keys.unsqueeze(1)
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    return mask.unsqueeze(1)


def sdpa_varlen_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    position_ids: Optional[torch.Tensor] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    **kwargs,
):
    """A transformers attention function: ``query [B, Hq, q, D]``, ``key``/``value
    [B, Hkv, kv, D]`` -> ``([B, q, Hq, D], None)``.

    * a packed sequence (batch 1, no padding mask, ``cu_seq_lens_q`` given or positions
      restarting at 0): one causal SDPA call per row;
    * otherwise: one SDPA call over the batch, with the causal-and-padding mask of a 2-D
      padding mask (:func:`masked_sdpa`: key/value heads matched to the query's), or
      ``is_causal`` and grouped-query heads without one."""
    if sliding_window is not None:
        raise NotImplementedError(
            f"{SDPA_VARLEN} has no sliding-window attention; set attn_implementation to flash_attention_2 or sdpa for this model"
        )
    gqa = query.shape[1] != key.shape[1]
    dropout_p = dropout if module.training else 0.0
    q_len, kv_len = query.shape[2], key.shape[2]
    bounds = None
    if attention_mask is None and query.shape[0] == 1 and q_len == kv_len:
        if cu_seq_lens_q is not None:
            bounds = cu_seq_lens_q
        elif position_ids is not None and bool((position_ids.reshape(-1)[1:] == 0).any()):
            bounds = cu_seq_lens(position_ids)
    if bounds is not None:
        edges = [int(b) for b in bounds.tolist()]
        outs = [
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout_p, is_causal=True, scale=scaling, enable_gqa=gqa
            )
            for s, e in zip(edges[:-1], edges[1:])
            if e > s
        ]
        out = torch.cat(outs, dim=2)
    elif attention_mask is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout_p, is_causal=q_len == kv_len and q_len > 1, scale=scaling, enable_gqa=gqa
        )
    else:
        mask = attention_mask if attention_mask.dim() == 4 else _padding_mask_4d(attention_mask, q_len)
        out = masked_sdpa(query, key, value, mask, dropout_p=dropout_p, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def masked_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """SDPA with a mask, in a call a fused CUDA kernel accepts: ``query [B, Hq, q, D]``,
    ``key``/``value [B, Hkv, kv, D]``, ``mask [B, 1 or Hq, q, kv]`` -> ``[B, Hq, q, D]``.

    On CUDA, flash attention refuses any mask (``check_for_attn_mask`` in aten's SDPA
    dispatch) and the memory-efficient kernel takes grouped-query attention nowhere that
    torch documents it ("GQA ... works only for Flash_attention and math kernel on CUDA",
    ``scaled_dot_product_attention``'s docstring, torch 2.13): a masked call with
    ``enable_gqa=True`` falls to the math kernel, which materialises the ``[B, Hq, q, kv]``
    float scores (and their softmax) in every layer. So the call gets as many key/value heads
    as query heads and no ``enable_gqa``:

    * ``q > 1`` (a padded pass, a prompt's prefill): k and v repeated to the query's heads
      (``repeat_interleave`` on the head dimension, what transformers' own ``sdpa`` does
      under a mask): ``2 x B x Hq x kv x D`` elements more per layer, while it runs (and saved
      for the backward);
    * ``q == 1`` (a decoding step with a cache): the query's heads folded onto their key/value
      head instead, ``[B, Hkv, Hq / Hkv, D]``, the group's heads taking the place of query
      positions (transformers' ``pack_gqa``), so the cache is not copied at every step.

    The memory-efficient kernel gets SDPA's conversion of the boolean mask to an additive one
    in the query's dtype (``B x q x kv`` elements, the last dimension padded to a multiple of
    16). ``planning.memory.masked_attention_bytes`` counts these tensors."""
    hq, hkv = query.shape[1], key.shape[1]
    groups = hq // hkv
    if groups > 1 and query.shape[2] == 1 and mask.shape[1] == 1:
        b, _, _, d = query.shape
        packed = query.reshape(b, hkv, groups, d)
        out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        return out.reshape(b, hq, 1, d)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def register_kernels() -> None:
    """Make :data:`SDPA_VARLEN` a name transformers knows (idempotent; every process that
    loads a model calls it). Its mask function is flash-attention's: the 2-D padding mask,
    or None where there is no padding, so no ``[T, T]`` mask is ever built for it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(SDPA_VARLEN, sdpa_varlen_forward)
    AttentionMaskInterface.register(SDPA_VARLEN, flash_attention_mask)
