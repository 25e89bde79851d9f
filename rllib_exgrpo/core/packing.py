"""Learner passes without padding: rows packed end to end in one sequence.

A padded pass computes ``rows x (longest prompt + longest completion)`` token positions,
whatever the rows' own lengths (``columns.py``: prompts left-padded, completions right-
padded); with long-tailed completion lengths most of them are padding. A packed pass lays
the rows' real tokens end to end, ``[p0 c0 | p1 c1 | ...]``, with positions restarting at 0
for each row. A variable-length attention kernel (``core/attention.py``: flash-attention's
on GPUs, or this project's ``sdpa_varlen``) gets the row boundaries and attends within a
row only, so each row is scored exactly as in its padded layout, and the pass computes
only real tokens. This is verl's "remove padding" and OpenRLHF's packed samples. Under
any other kernel transformers would build a dense block-diagonal ``[T, T]`` mask; the
learner then does not pack (``ExGRPOTorchLearner._kernel_packs_rows``).

Only the positions that predict a completion token go through the LM head, a chunk of them
at a time (``chunked_logprobs.py``), and the per-token results are scattered back into
the ``[N, R]`` layout the loss reads (zeros where the response mask is 0).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.chunked_logprobs import logprobs_entropy_from_hidden, split_causal_lm
from rllib_exgrpo.core.attention import cu_seq_lens, model_kernel, packs_rows


def pack_rows(columns: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The packed columns (``columns.PACKED_*``) of a padded pass.

    ``columns``: ``input_ids`` / ``attention_mask [N, P + R]`` and ``response_mask [N, R]``
    as torch tensors. A row's real tokens are those its attention mask marks; completion
    token ``j`` of a row whose prompt has ``p`` real tokens sits at ``p + j`` in the row's
    packed span and is predicted by position ``p + j - 1`` (every prompt has a token).
    """
    ids, mask = columns[C.INPUT_IDS], columns[C.ATTENTION_MASK] > 0
    width_r = columns[C.RESPONSE_MASK].shape[1]
    width_p = ids.shape[1] - width_r
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: each row's real tokens in order
    lengths = mask.sum(dim=1)
    starts = torch.cumsum(lengths, 0) - lengths  # each row's offset in the packed sequence
    offsets = torch.arange(len(rows), device=ids.device)
    positions = offsets - starts[rows]
    completion = cols >= width_p
    prompt_len = (mask[:, :width_p]).sum(dim=1)
    return {
        C.PACKED_INPUT_IDS: ids[rows, cols].unsqueeze(0),
        C.PACKED_POSITION_IDS: positions.unsqueeze(0),
        C.PACKED_LOGIT_INDEX: offsets[completion] - 1,
        C.PACKED_TARGET_ROW: rows[completion],
        C.PACKED_TARGET_COL: positions[completion] - prompt_len[rows[completion]],
    }


def is_packed(batch: Dict[str, Any]) -> bool:
    return C.PACKED_INPUT_IDS in batch


def score_packed(
    model,
    batch: Dict[str, Any],
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_tokens: Optional[int] = None,
    min_chunks: int = 0,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(logp [N, R], entropy [N, R] or None)`` of a packed pass (``pack_rows``' columns
    plus ``response_mask [N, R]``); the same values as the padded scoring of the rows.

    The decoder runs over the packed sequence; the ``K`` positions that predict completion
    tokens go through the LM head ``chunk_tokens`` at a time (``chunked_logprobs.py``), so
    the pass never holds a whole ``[K, V]`` logits tensor."""
    inputs = dict(input_ids=batch[C.PACKED_INPUT_IDS], position_ids=batch[C.PACKED_POSITION_IDS])
    if packs_rows(model_kernel(model), batch[C.PACKED_INPUT_IDS].device.type):
        # The row boundaries, for flash-attention's variable-length kernel (and ours): it
        # reads them as given instead of finding them in the positions at every layer.
        bounds = cu_seq_lens(batch[C.PACKED_POSITION_IDS])
        longest = int((bounds[1:] - bounds[:-1]).max())
        inputs.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=longest, max_length_k=longest)
    index = batch[C.PACKED_LOGIT_INDEX]
    targets = batch[C.PACKED_INPUT_IDS][0, index + 1]
    parts = split_causal_lm(model)
    if parts is not None:
        decoder, head = parts
        hidden = decoder(**inputs, use_cache=False).last_hidden_state[0]  # [T, H]
        scored, head_fn = hidden.index_select(0, index), head  # [K, H]
    else:
        scored = model(**inputs, logits_to_keep=index, use_cache=False).logits[0]  # [K, V]
        head_fn = torch.nn.Identity()
    token_logp, token_entropy = logprobs_entropy_from_hidden(
        scored, head_fn, targets, temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens, min_chunks=min_chunks
    )
    shape = batch[C.RESPONSE_MASK].shape
    where = (batch[C.PACKED_TARGET_ROW], batch[C.PACKED_TARGET_COL])
    logp = torch.zeros(shape, dtype=token_logp.dtype, device=token_logp.device).index_put(where, token_logp)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(shape, dtype=token_entropy.dtype, device=token_entropy.device).index_put(where, token_entropy)
    return logp, entropy
