"""The token layout of every prompt + completion batch, in one place.

A row is its prompt **left**-padded to the batch's longest prompt P, followed by its
completion **right**-padded to the longest completion R::

    [pad pad p1 p2 p3 | c1 c2 c3 pad]      attention_mask [0 0 1 1 1 | 1 1 1 0]

so the completions of all rows start at the same column P (the learner slices
``[:, P:]``), and the prompt's last token sits right before them (what generation needs).
Positions ignore the left padding (:func:`position_ids_from_mask`). Generation, the
learner's scoring pass, RLlib's PPO glue and evaluation all build batches here; the warm
start's supervised sequences use :func:`right_pad` (whole sequences, no split column).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[list of id lists] -> input_ids, attention_mask  [N, max_len], padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r) :] = torch.as_tensor(np.array(r, dtype=np.int64))
            mask[i, width - len(r) :] = 1
    return ids, mask


def right_pad(rows: Sequence[Sequence[int]], pad_id: int, *, min_width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[list of id lists] -> ids, mask  [N, max(max_len, min_width)], padded on the right."""
    width = max([min_width] + [len(r) for r in rows])
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            # np.array copies: stored trajectories are read-only views (torch warns on those).
            ids[i, : len(r)] = torch.from_numpy(np.array(r, dtype=np.int64))
            mask[i, : len(r)] = 1
    return ids, mask


def prompt_completion_batch(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts followed by right-padded completions (see ``columns.py``).

    Returns input_ids, attention_mask [N, P + R] and response_mask [N, R].
    """
    p_ids, p_mask = left_pad(prompts, pad_id)
    c_ids, c_mask = right_pad(completions, pad_id, min_width=1)
    return torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1), c_mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def prompt_completion_from_padded(obs, obs_len, act, act_len, p: int, r: int):
    """Left-padded prompts (last ``p`` columns of ``obs``) + right-padded completions (first
    ``r`` columns of ``act``) -> input_ids, attention_mask ``[N, p + r]``, token mask ``[N, r]``."""
    device = obs.device
    prompt_mask = torch.arange(p, device=device)[None, :] >= (p - obs_len)[:, None]
    token_mask = torch.arange(r, device=device)[None, :] < act_len[:, None]
    input_ids = torch.cat([obs[:, -p:].long(), act[:, :r].long()], 1)
    attention_mask = torch.cat([prompt_mask, token_mask], 1).long()
    return input_ids, attention_mask, token_mask
