"""Learner passes without padding: rows packed end to end in one sequence.

A padded pass computes ``rows x (longest prompt + longest completion)`` token positions,
whatever the rows' own lengths (``columns.py``: prompts left-padded, completions right-
padded); with long-tailed completion lengths most of them are padding. A packed pass lays
the rows' real tokens end to end, ``[p0 c0 | p1 c1 | ...]``, with positions restarting at 0
for each row. Given ``position_ids`` and no attention mask, transformers' masking finds the
row boundaries from the restarts and attends within a row only (a block-diagonal causal
mask; flash-attention's variable-length kernel on GPUs), so each row is scored exactly as
in its padded layout, and the pass computes only real tokens. This is verl's
"remove padding" and OpenRLHF's packed samples.

Only the positions that predict a completion token are turned into vocabulary logits
(``logits_to_keep`` as an index tensor), and the per-token results are scattered back into
the ``[N, R]`` layout the loss reads (zeros where the response mask is 0).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.losses import streamed_entropy, token_logprobs_from_logits


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
    model, batch: Dict[str, Any], *, temperature: float = 1.0, with_entropy: bool = True
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(logp [N, R], entropy [N, R] or None)`` of a packed pass (``pack_rows``' columns
    plus ``response_mask [N, R]``); the same values as the padded scoring of the rows."""
    out = model(
        input_ids=batch[C.PACKED_INPUT_IDS],
        position_ids=batch[C.PACKED_POSITION_IDS],
        logits_to_keep=batch[C.PACKED_LOGIT_INDEX],
        use_cache=False,
    )
    logits = out.logits[0]  # [K, V], in the order of PACKED_LOGIT_INDEX
    if temperature != 1.0:
        logits = logits / temperature
    targets = batch[C.PACKED_INPUT_IDS][0, batch[C.PACKED_LOGIT_INDEX] + 1]
    shape = batch[C.RESPONSE_MASK].shape
    where = (batch[C.PACKED_TARGET_ROW], batch[C.PACKED_TARGET_COL])
    token_logp = token_logprobs_from_logits(logits.unsqueeze(0), targets.unsqueeze(0))[0]
    logp = torch.zeros(shape, dtype=token_logp.dtype, device=token_logp.device).index_put(where, token_logp)
    entropy = None
    if with_entropy:
        token_entropy = streamed_entropy(logits.unsqueeze(0))[0]
        entropy = torch.zeros(shape, dtype=token_entropy.dtype, device=token_entropy.device).index_put(
            where, token_entropy)
    return logp, entropy
