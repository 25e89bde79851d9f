"""The scoring pass: per-token log-probs (and entropies) of completions under a causal LM.

One function for every consumer (learner loss, behaviour log-probs on the env runners,
PPO's module, the HF backend's checks), so they cannot disagree on temperature,
positions or the shift by one.
"""
from __future__ import annotations

from typing import Optional

import torch

from rllib_exgrpo.core.losses import streamed_entropy, token_logprobs_from_logits
from rllib_exgrpo.core.tokens import position_ids_from_mask


def completion_logprobs_and_entropy(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Score the last ``response_len`` tokens of every row.

    Shapes: input_ids, attention_mask [N, P + R] -> logp [N, R], entropy [N, R] or None.
    Only the ``R`` positions that predict completion tokens are turned into full-vocabulary
    logits (``logits_to_keep``), so prompts cost no vocabulary-sized memory.
    """
    logp, entropy, _ = score_completions(
        model, input_ids, attention_mask, response_len, temperature=temperature, with_entropy=with_entropy
    )
    return logp, entropy


def score_completions(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    with_hidden: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`completion_logprobs_and_entropy`, plus (``with_hidden``) the final hidden
    state of every position, ``[N, P + R, H]`` (the last entry of HF's ``hidden_states``:
    what the LM head reads; a value head can read it too)."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=response_len + 1,
        use_cache=False,
        output_hidden_states=with_hidden,
    )
    # Position t predicts token t + 1: drop the last position's logits.
    logits = out.logits[:, :-1, :]
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, -response_len:]
    logp = token_logprobs_from_logits(logits, targets)
    entropy = streamed_entropy(logits) if with_entropy else None
    hidden = out.hidden_states[-1] if with_hidden else None
    return logp, entropy, hidden


def score_learner_batch(
    model, batch: dict, *, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(logp [N, R], entropy [N, R] or None)`` of a learner pass, padded (``columns.py``)
    or packed without padding (``packing.py``, when the pass carries packed columns)."""
    from rllib_exgrpo.core.packing import is_packed, score_packed

    if is_packed(batch):
        return score_packed(model, batch, temperature=temperature, with_entropy=with_entropy)
    return completion_logprobs_and_entropy(
        model, batch["input_ids"], batch["attention_mask"], batch["response_mask"].shape[1],
        temperature=temperature, with_entropy=with_entropy,
    )
