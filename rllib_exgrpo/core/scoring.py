"""The scoring pass: per-token log-probs (and entropies) of completions under a causal LM.

One function for every consumer (learner loss, behaviour log-probs on the env runners,
PPO's module, the HF backend's checks), so they cannot disagree on temperature,
positions or the shift by one.

The model runs up to its final hidden states; the vocabulary-sized part (LM head,
log-softmax, picked log-prob, entropy) runs in chunks of positions
(``core/chunked_logprobs.py``), so no pass ever holds its whole ``[tokens x V]`` logits.
A model that does not expose its decoder and head in the standard way is scored through
its full forward, its logits then reduced chunk by chunk.
"""

from __future__ import annotations

from typing import Optional

import torch

from rllib_exgrpo.core.chunked_logprobs import logprobs_entropy_from_hidden, split_causal_lm
from rllib_exgrpo.core.tokens import position_ids_from_mask
from rllib_exgrpo.core.chunked_logprobs import DEFAULT_CHUNK_TOKENS
from rllib_exgrpo.core.columns import MIN_LOGIT_CHUNKS, PACKED_LOGIT_INDEX
from rllib_exgrpo.core.packing import is_packed, score_packed


def completion_logprobs_and_entropy(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_tokens: Optional[int] = None,
    min_chunks: int = 0,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Score the last ``response_len`` tokens of every row.

    Shapes: input_ids, attention_mask [N, P + R] -> logp [N, R], entropy [N, R] or None
    (float32). Only the ``R`` positions that predict completion tokens go through the LM
    head, ``chunk_tokens`` of them at a time (None: the module default).
    """
    logp, entropy, _ = score_completions(
        model,
        input_ids,
        attention_mask,
        response_len,
        temperature=temperature,
        with_entropy=with_entropy,
        chunk_tokens=chunk_tokens,
        min_chunks=min_chunks,
    )
    return logp, entropy


def final_hidden_states(model, **inputs) -> Optional[torch.Tensor]:
    """The final (normed) hidden states ``[B, L, H]`` that ``model``'s LM head reads, from
    its decoder alone; None where the model does not expose one (:func:`split_causal_lm`)."""
    parts = split_causal_lm(model)
    if parts is None:
        return None
    return parts[0](**inputs, use_cache=False).last_hidden_state


def score_completions(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    with_hidden: bool = False,
    chunk_tokens: Optional[int] = None,
    min_chunks: int = 0,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`completion_logprobs_and_entropy`, plus (``with_hidden``) the final hidden
    state of every position, ``[N, P + R, H]`` (what the LM head reads; a value head can
    read it too)."""
    n, r = input_ids.shape[0], int(response_len)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask))
    targets = input_ids[:, -r:].reshape(-1)
    parts = split_causal_lm(model)
    if parts is not None:
        decoder, head = parts
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        # Position t predicts token t + 1: the R positions before the last one.
        scored = hidden[:, -(r + 1) : -1, :].reshape(n * r, hidden.shape[-1])
        logp, entropy = logprobs_entropy_from_hidden(
            scored, head, targets, temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens, min_chunks=min_chunks
        )
    else:
        out = model(**inputs, logits_to_keep=r + 1, use_cache=False, output_hidden_states=with_hidden)
        logits = out.logits[:, :-1, :].reshape(n * r, -1)
        # The logits exist whole here; their float32 reductions still go chunk by chunk.
        logp, entropy = logprobs_entropy_from_hidden(
            logits, torch.nn.Identity(), targets, temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens
        )
        hidden = out.hidden_states[-1] if with_hidden else None
    logp = logp.view(n, r)
    entropy = entropy.view(n, r) if entropy is not None else None
    return logp, entropy, (hidden if with_hidden else None)


def score_learner_batch(
    model,
    batch: dict,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_tokens: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(logp [N, R], entropy [N, R] or None)`` of a learner pass, padded (``columns.py``)
    or packed without padding (``packing.py``, when the pass carries packed columns); at
    least ``batch[MIN_LOGIT_CHUNKS]`` LM-head calls where the learner set it."""
    min_chunks = int(batch.get(MIN_LOGIT_CHUNKS, 0) or 0)
    if is_packed(batch):
        return score_packed(
            model, batch, temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens, min_chunks=min_chunks
        )
    return completion_logprobs_and_entropy(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        batch["response_mask"].shape[1],
        temperature=temperature,
        with_entropy=with_entropy,
        chunk_tokens=chunk_tokens,
        min_chunks=min_chunks,
    )


def logit_chunks(batch: dict, chunk_tokens: Optional[int] = None) -> int:
    """LM-head calls a learner pass makes: its scored positions (the packed logit index,
    or rows x completion width) in chunks of ``chunk_tokens``."""
    step = int(chunk_tokens or DEFAULT_CHUNK_TOKENS)
    if PACKED_LOGIT_INDEX in batch:
        scored = int(batch[PACKED_LOGIT_INDEX].numel())
    else:
        rows, width = batch["response_mask"].shape
        scored = int(rows) * int(width)
    return -(-scored // step)
