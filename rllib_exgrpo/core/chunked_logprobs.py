"""Per-token log-probs and entropies from hidden states, a chunk of tokens at a time.

At a real vocabulary the ``[tokens x V]`` logits are the largest tensors of a learner pass:
one float32 copy of a 28.7k-token pass at V = 152,064 is ~16 GiB, more than a 7B model's
ZeRO-3 state per GPU, and autograd of ``log_softmax`` + entropy keeps several of them. Here
the final projection (the LM head), the log-softmax, the picked token's log-prob and the
entropy run on ``chunk_tokens`` positions at a time; each chunk's forward is recomputed in
the backward pass (``torch.utils.checkpoint``), so neither pass ever holds more than one
chunk's logits. This is the pattern of Liger-Kernel's fused linear cross-entropy and of
verl's chunked entropy (entropy checkpointing); the code is this project's own.

Per chunk, :class:`_PickedLogpEntropy` turns ``logits [C, V]`` into ``logp [C]`` and
``entropy [C]`` (float32) with a hand-written backward that recomputes the softmax from the
saved logits and the two ``[C]`` results::

    d logp_i / d z_j = 1[j = target_i] - p_j
    d H_i / d z_j    = -p_j (log p_j + H_i)

so autograd keeps no float32 ``[C, V]`` intermediate. The head is called as a module, so
DeepSpeed ZeRO-3's parameter hooks, autocast, tied embeddings and data-parallel gradient
hooks see an ordinary call.

Shape letters: ``M`` scored positions (flattened), ``H`` hidden size, ``V`` vocabulary,
``C`` positions of one chunk.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

#: Positions per chunk by default. At V = 152,064 one float32 chunk of logits is 297 MiB;
#: a pass's peak is about 4.5 of them, 1.3 GiB whatever the pass's length
#: (benchmarks/logprob_memory.py). 512 rows of a [512 x H] @ [H x V] product keep a GPU's
#: matrix units busy (H >= 896 for every shipped recipe).
DEFAULT_CHUNK_TOKENS = 512


class _PickedLogpEntropy(torch.autograd.Function):
    """``(logp [C], entropy [C])`` float32 of ``logits [C, V]`` (any float dtype) at
    ``1 / inv_temperature``; saves the logits (which the head's output is anyway) and the
    ``[C]`` results only."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, inv_temperature: float, with_entropy: bool):
        z = logits.float()
        if inv_temperature != 1.0:
            z = z * inv_temperature
        lse = torch.logsumexp(z, dim=-1)
        logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        if with_entropy:
            log_q = z.sub_(lse.unsqueeze(-1)) if z is not logits else z - lse.unsqueeze(-1)
            # q log q in q's memory; 0 log 0 (a -inf logit: masked vocabulary) is NaN there
            # and counts 0. Peak: the logits, log q and q (three float32 [C, V] for float32
            # logits; for bf16 ones, a half plus two).
            q_log_q = torch.exp(log_q).mul_(log_q).nan_to_num_(nan=0.0)
            entropy = -q_log_q.sum(-1)
            del log_q, q_log_q
        else:
            entropy = torch.zeros_like(lse)
        ctx.inv_temperature = inv_temperature
        ctx.with_entropy = with_entropy
        ctx.save_for_backward(logits, targets, lse, entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor]):
        logits, targets, lse, entropy = ctx.saved_tensors
        z = logits.float()
        if ctx.inv_temperature != 1.0:
            z = z * ctx.inv_temperature
        log_q = z.sub_(lse.unsqueeze(-1)) if z is not logits else z - lse.unsqueeze(-1)
        q = torch.exp(log_q)
        # The gradient is built in the memory of log q (or of q): the backward holds the
        # logits, log q and q, as the forward.
        if ctx.with_entropy and grad_entropy is not None:
            # -g_H * q * (log q + H); 0 where q = 0 (NaN there).
            grad = log_q.add_(entropy.unsqueeze(-1)).mul_(q).mul_(-grad_entropy.unsqueeze(-1))
            grad.nan_to_num_(nan=0.0)
            if grad_logp is not None:
                grad.sub_(q.mul_(grad_logp.unsqueeze(-1)))
        elif grad_logp is not None:
            del log_q
            grad = q.mul_(-grad_logp.unsqueeze(-1))
        else:
            grad = torch.zeros_like(q)
        del q
        if grad_logp is not None:
            grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
        if ctx.inv_temperature != 1.0:
            grad.mul_(ctx.inv_temperature)
        return grad.to(logits.dtype), None, None, None


def logprobs_entropy_from_logits(
    logits: Tensor, targets: Tensor, *, temperature: float = 1.0, with_entropy: bool = True
) -> Tuple[Tensor, Optional[Tensor]]:
    """Picked-token log-prob and entropy of ``logits [C, V]`` at ``temperature``.

    Shapes: ``logits [C, V]``, ``targets [C]`` long -> ``(logp [C], entropy [C] or None)``,
    float32. Values as ``log_softmax(z / t)[target]`` and ``-sum p log p``."""
    logp, entropy = _PickedLogpEntropy.apply(logits, targets.long(), 1.0 / float(temperature), bool(with_entropy))
    return logp, (entropy if with_entropy else None)


def _chunk(
    head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> Tuple[Tensor, Tensor]:
    logp, entropy = logprobs_entropy_from_logits(head(hidden), targets, temperature=temperature, with_entropy=with_entropy)
    return logp, (entropy if entropy is not None else torch.zeros_like(logp))


def logprobs_entropy_from_hidden(
    hidden: Tensor,
    head: Callable[[Tensor], Tensor],
    targets: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_tokens: Optional[int] = None,
    min_chunks: int = 0,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Log-probs (and entropies) of ``targets`` under ``head(hidden)``, chunk by chunk.

    Shapes: ``hidden [M, H]``, ``targets [M]`` long -> ``(logp [M], entropy [M] or None)``,
    float32. ``head`` maps ``[C, H]`` to logits ``[C, V]`` (the model's LM head). With
    gradients on, every chunk runs under activation checkpointing: its logits are freed
    after the forward and recomputed in the backward, so the pass's peak beyond the
    hidden states is one chunk's, whatever ``M`` is. ``chunk_tokens`` None:
    :data:`DEFAULT_CHUNK_TOKENS`.

    ``min_chunks``: call the head at least this many times, the extra calls on no positions
    (and recomputed in the backward like the others). Under DeepSpeed ZeRO-3 every head call
    gathers the head's parameters from all ranks, so data-parallel ranks whose passes score
    different numbers of positions must make the same number of calls (the learner agrees
    on it, ``columns.MIN_LOGIT_CHUNKS``).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [M, H] and targets [M]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    step = DEFAULT_CHUNK_TOKENS if chunk_tokens is None else int(chunk_tokens)
    if step < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens!r}")
    targets = targets.long()
    grad = torch.is_grad_enabled() and (hidden.requires_grad or _head_has_trainable(head))
    logps, entropies = [], []
    starts = list(range(0, hidden.shape[0], step))
    starts += [hidden.shape[0]] * max(0, int(min_chunks) - len(starts))  # empty chunks
    for start in starts:
        h, t = hidden[start : start + step], targets[start : start + step]
        if grad:
            logp, entropy = checkpoint(_chunk, head, h, t, temperature, with_entropy, use_reentrant=False)
        else:
            logp, entropy = _chunk(head, h, t, temperature, with_entropy)
        logps.append(logp)
        entropies.append(entropy)
    if not logps:  # no position to score
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    logp = torch.cat(logps) if len(logps) > 1 else logps[0]
    entropy = (torch.cat(entropies) if len(entropies) > 1 else entropies[0]) if with_entropy else None
    return logp, entropy


def _head_has_trainable(head) -> bool:
    params = head.parameters() if isinstance(head, torch.nn.Module) else getattr(head, "trainable", ())
    return any(p.requires_grad for p in params)


class LMHead(torch.nn.Module):
    """A causal LM's final projection as one call ``[C, H] -> [C, V]``: the output
    embedding (tied or not) plus the model family's logit transform where it has one
    (Gemma-2's final soft cap), so chunked scoring computes what ``model(...).logits``
    would. Wraps the model's own module: no parameter is copied."""

    def __init__(self, projection: torch.nn.Module, softcap: Optional[float] = None):
        super().__init__()
        self.projection = projection
        self.softcap = softcap

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.projection(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


#: Config attributes that change logits in ways :class:`LMHead` does not reproduce; a
#: model with any of them set is scored through its own full forward instead.
_UNSUPPORTED_LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "output_multiplier_scale")


def split_causal_lm(model) -> Optional[Tuple[torch.nn.Module, LMHead]]:
    """``(decoder, head)`` of a Hugging Face causal LM: the decoder returns the final
    (normed) hidden states the head reads. None where the model does not expose them in
    the standard way (``get_decoder`` / ``get_output_embeddings``) or transforms its logits
    beyond a soft cap: callers then use the model's full forward."""
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    try:
        decoder, projection = get_decoder(), get_head()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or projection is None or decoder is model:
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _UNSUPPORTED_LOGIT_TRANSFORMS):
        return None
    return decoder, LMHead(projection, getattr(config, "final_logit_softcapping", None))
