"""Pure-torch advantage estimators and policy losses for GRPO / ExGRPO / XRPO.

Nothing here imports RLlib: every function takes tensors and returns tensors, so the
learner (and the tests) can call them directly. The formulas follow
``docs/ALGORITHMS.md``; the conventions (names of the aggregation modes,
clamps, unbiased std, one registry per kind, a shape line per docstring) follow verl's
``verl/trainer/ppo/core_algos.py``. The code is our own.

Shape letters used in the docstrings:

* ``N``: number of completions (rows) in the batch, over all groups together;
* ``T``: padded response length (token positions per row);
* ``V``: vocabulary size;
* ``K``: number of distinct groups (questions) in ``group_index``.

A ``mask`` is ``[N, T]``, bool or float (1 = a real response token, 0 = padding). Per-row
quantities (advantages, rewards) are ``[N]`` and are broadcast over the row's tokens.

Registries (name -> function, :class:`rllib_exgrpo.core.registry.Registry`), each with a
decorator a user package can register more with (docs/ALGORITHMS.md, "Adding your own"):

* :data:`ADVANTAGE_ESTIMATORS` (:func:`register_advantage_estimator`):
  ``"mean_centered"``, ``"std_normalized"``;
* :data:`LOSS_AGG_MODES` (:func:`register_loss_agg_mode`): ``"token-mean"``,
  ``"seq-mean-token-mean"``, ``"seq-mean-token-sum-norm"``,
  ``"seq-mean-token-sum-norm-official"``;
* :data:`RATIO_MODES` (:func:`register_ratio_mode`): ``"token"``, ``"sequence"`` (GSPO).
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from rllib_exgrpo.core.registry import Registry

__all__ = [
    "LOSS_METRICS",
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGG_MODES",
    "RATIO_MODES",
    "register_advantage_estimator",
    "register_loss_agg_mode",
    "register_ratio_mode",
    "LOG_RATIO_CLAMP",
    "group_advantages",
    "zero_variance_group_mask",
    "masked_mean",
    "log_ratio",
    "clipped_surrogate",
    "policy_shaping",
    "shaped_surrogate",
    "agg_loss",
    "AggTotals",
    "agg_totals",
    "entropy_from_logits",
    "streamed_entropy",
    "token_logprobs_from_logits",
    "k3_kl",
    "mixed_policy_loss",
    "STAT_TOKEN_SHARE",
    "novelty_sharpened_advantages",
]


# --------------------------------------------------------------------------------------
# Registries
# --------------------------------------------------------------------------------------

#: name -> ``fn(rewards [N], group_index [N], eps: float) -> advantages [N]``; read by
#: :func:`group_advantages` (config field ``advantage_estimator``).
ADVANTAGE_ESTIMATORS: Registry[Callable[..., Tensor]] = Registry("advantage estimator")

#: name -> ``fn(per_token_loss [N, T], mask [N, T], *, max_len, micro_batch_rows, totals)
#: -> scalar``; read by :func:`agg_loss` (config field ``loss_agg_mode``).
LOSS_AGG_MODES: Registry[Callable[..., Tensor]] = Registry("loss aggregation mode")

#: name -> ``fn(logp [N, T], old_logp [N, T], mask [N, T] or None, log_ratio_clamp: float)
#: -> ratio [N, T]`` (value and gradient of the importance weight of every token); read by
#: :func:`clipped_surrogate` (config field ``ratio_mode``).
RATIO_MODES: Registry[Callable[..., Tensor]] = Registry("ratio mode")

#: ``@register_advantage_estimator("name")``: add an estimator to :data:`ADVANTAGE_ESTIMATORS`.
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
#: ``@register_loss_agg_mode("name")``: add an aggregation to :data:`LOSS_AGG_MODES`.
register_loss_agg_mode = LOSS_AGG_MODES.register
#: ``@register_ratio_mode("name")``: add an importance-ratio form to :data:`RATIO_MODES`.
register_ratio_mode = RATIO_MODES.register


# --------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------


def _dense_groups(group_index: Tensor) -> Tuple[Tensor, int]:
    """Map arbitrary group ids to dense ids ``0..K-1``.

    Shapes: ``group_index [N]`` (any integer ids, need not be contiguous or sorted)
    -> ``(inverse [N] long, K)``. Dense id ``k`` is the ``k``-th smallest original id
    (``torch.unique`` sorts), which fixes the order of every per-group output here.
    """
    if group_index.dim() != 1:
        raise ValueError(f"group_index must be 1-D [N], got shape {tuple(group_index.shape)}")
    uniq, inverse = torch.unique(group_index, sorted=True, return_inverse=True)
    return inverse, int(uniq.numel())


def _group_sum(x: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """Scatter-sum ``x [N]`` into ``[K]`` by dense group id ``inverse [N]``."""
    out = torch.zeros(num_groups, dtype=x.dtype, device=x.device)
    return out.index_add(0, inverse, x)


def _float_mask(mask: Tensor, like: Tensor) -> Tensor:
    """Return ``mask`` as a float tensor of ``like``'s dtype (bool/int/float accepted)."""
    return mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def _broadcast_adv(advantages: Tensor, like: Tensor) -> Tensor:
    """Broadcast per-row advantages ``[N]`` to ``[N, T]``; ``[N, T]`` passes through."""
    if advantages.dim() == like.dim() - 1:
        return advantages.unsqueeze(-1)
    if advantages.shape != like.shape:
        raise ValueError(f"advantages must be [N] or [N, T] matching {tuple(like.shape)}, got {tuple(advantages.shape)}")
    return advantages


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is non-zero.

    Shapes: ``x`` and ``mask`` broadcastable to each other (typically both ``[N, T]``);
    ``dim=None`` -> scalar, ``dim=d`` -> ``x`` reduced over ``d``.

    Formula: ``sum(x * m) / sum(m)`` with ``m`` the (float) mask, so a float mask acts as
    weights. Where ``sum(m) == 0`` the result is ``0`` (not NaN); the zero still carries
    ``x``'s autograd graph. Masked-out entries of ``x`` are replaced by 0 before the
    product, so a NaN/inf in padding cannot leak into the value.
    (verl: ``verl.utils.torch_functional.masked_mean``, which adds 1e-8 instead.)
    """
    m = _float_mask(mask, x)
    xm = torch.where(m != 0, x, torch.zeros((), dtype=x.dtype, device=x.device)) * m
    if dim is None:
        num = xm.sum()
        den = m.sum()
    else:
        num = xm.sum(dim=dim)
        den = m.sum(dim=dim)
        num, den = torch.broadcast_tensors(num, den)
    safe_den = torch.where(den != 0, den, torch.ones_like(den))
    return torch.where(den != 0, num / safe_den, num * 0)


# --------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------


@register_advantage_estimator("mean_centered")
def _adv_mean_centered(rewards: Tensor, group_index: Tensor, eps: float = 1e-6) -> Tensor:
    """Dr.GRPO / official ExGRPO advantage: ``A_i = r_i - mean_{j in g(i)} r_j``.

    Shapes: ``rewards [N]``, ``group_index [N]`` -> ``[N]``. ``eps`` is unused (kept
    for a uniform registry signature). Ref: Dr.GRPO (Liu et al. 2025, arXiv 2503.20783);
    official ExGRPO (ElliottYan/LUFFY, ExGRPO/, ``use_std=False``).
    """
    del eps
    r = rewards.to(torch.float32) if not rewards.is_floating_point() else rewards
    inverse, k = _dense_groups(group_index)
    counts = _group_sum(torch.ones_like(r), inverse, k)
    mean = _group_sum(r, inverse, k) / counts
    adv = r - mean[inverse]
    return _zero_where_no_variance(adv, r, inverse, k)


@register_advantage_estimator("std_normalized")
def _adv_std_normalized(rewards: Tensor, group_index: Tensor, eps: float = 1e-6) -> Tensor:
    """Classic GRPO advantage: ``A_i = (r_i - mean_g) / (std_g + eps)``.

    Shapes: ``rewards [N]``, ``group_index [N]`` -> ``[N]``. ``std_g`` is the *unbiased*
    sample std (denominator ``n_g - 1``) as in verl ``compute_grpo_outcome_advantage``
    (``torch.std``). A group whose rewards are all equal (all-correct, all-wrong, or of
    size 1) has no std: its advantage is exactly 0, never ``0 / eps`` noise or ``0 / 0``
    (also with ``eps = 0``). Ref: DeepSeekMath GRPO (arXiv 2402.03300), verl core_algos.
    """
    r = rewards.to(torch.float32) if not rewards.is_floating_point() else rewards
    inverse, k = _dense_groups(group_index)
    counts = _group_sum(torch.ones_like(r), inverse, k)
    mean = _group_sum(r, inverse, k) / counts
    centered = r - mean[inverse]
    sq = _group_sum(centered * centered, inverse, k)
    var = sq / (counts - 1).clamp_min(1)
    std = var.sqrt()
    adv = centered / (std[inverse] + eps)
    return _zero_where_no_variance(adv, r, inverse, k)


def _zero_where_no_variance(adv: Tensor, r: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """``adv [N]`` with every row of a zero-variance group (all rewards equal, exactly as
    :func:`zero_variance_group_mask`; size-1 groups included) set to exactly 0.

    Binary rewards already give 0 there; this also covers continuous rewards (whose group
    mean is off by an ulp, which ``std_normalized`` would blow up to ``~1e-7 / eps``) and
    ``eps = 0`` (``0 / 0``). Other groups keep their value bit for bit.
    """
    flat = _group_flat(r, inverse, num_groups)[inverse]
    return torch.where(flat, torch.zeros_like(adv), adv)


def group_advantages(
    rewards: Tensor,
    group_index: Tensor,
    *,
    mode: str = "mean_centered",
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative outcome advantage, one scalar per completion.

    Shapes: ``rewards [N]`` (float, or int/bool cast to float32), ``group_index [N]``
    (integer question/group id per completion; arbitrary ids, groups may have *different
    sizes*) -> ``advantages [N]``.

    Modes (:data:`ADVANTAGE_ESTIMATORS`; an unknown one raises a ``ValueError`` naming
    the registered ones):

    * ``"mean_centered"`` (default; Dr.GRPO and official ExGRPO):
      ``A_i = r_i - mean_{g(i)}(r)``.
    * ``"std_normalized"`` (classic GRPO): ``A_i = (r_i - mean) / (std + eps)``, unbiased
      std like verl (``eps`` = 1e-6 as verl; TRL uses 1e-4). A group of size 1 gets 0.

    Groups of different sizes are what XRPO's planner produces; an ExGRPO replayed group is
    1 replayed + (G-1) fresh completions, all sharing one group id, so the replayed
    trajectory takes part in the group mean. Vectorised with ``index_add`` (no Python loop
    over groups). The result is not detached from ``rewards`` (rewards normally carry no
    graph anyway).
    """
    fn = ADVANTAGE_ESTIMATORS.get(mode)
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ValueError(f"rewards and group_index must both be [N]; got {tuple(rewards.shape)} and {tuple(group_index.shape)}")
    return fn(rewards, group_index, eps=eps)


def zero_variance_group_mask(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Which groups have all-equal rewards (no learning signal).

    Shapes: ``rewards [N]``, ``group_index [N]`` -> ``BoolTensor [K]``, one entry per
    distinct group id **in increasing order of the id** (``torch.unique`` order). A group
    of size 1 counts as zero-variance. Compares each group's max and min exactly, so it is
    right for binary and for continuous rewards. For the metric "fraction of zero-variance
    groups" use ``mask.float().mean()``.
    """
    r = rewards.to(torch.float32) if not rewards.is_floating_point() else rewards
    inverse, k = _dense_groups(group_index)
    return _group_flat(r, inverse, k)


def _group_flat(r: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """``[K]`` bool: group max == group min (all rewards of the group equal)."""
    big = torch.full((num_groups,), float("inf"), dtype=r.dtype, device=r.device)
    gmax = (-big).scatter_reduce(0, inverse, r, reduce="amax", include_self=True)
    gmin = big.scatter_reduce(0, inverse, r, reduce="amin", include_self=True)
    return gmax == gmin


# --------------------------------------------------------------------------------------
# Ratios and surrogates
# --------------------------------------------------------------------------------------


#: Bound ``c`` of every importance log-ratio before ``exp``: ``log w`` is clamped to
#: ``[-c, c]``, so ``e^-20 ~ 2e-9 <= w <= e^20 ~ 4.9e8``: ``exp`` never overflows to inf
#: (the learner's log-probs are float32, max 3.4e38) nor underflows to 0. The value is
#: verl's: ``compute_policy_loss`` (vanilla / dual-clip PPO) clamps
#: ``negative_approx_kl = log_prob - old_log_prob`` to ``[-20, 20]`` before ``exp``, as
#: does TRL's VESPO loss per token (TRL's plain GRPO loss does not clamp). verl's GSPO
#: loss clamps its sequence log-ratio at ``max=10``; we keep one bound, 20, for both
#: ratio modes (docs/ALGORITHMS.md section 1). Outside the clamp the gradient is 0.
LOG_RATIO_CLAMP = 20.0


def log_ratio(logp: Tensor, old_logp: Tensor, clamp: float = LOG_RATIO_CLAMP) -> Tensor:
    """Per-token log importance ratio ``log w_t = clamp(logp_t - old_logp_t, -c, c)``.

    Shapes: ``logp [N, T]``, ``old_logp [N, T]`` -> ``[N, T]``. ``old_logp`` is the
    behaviour policy's log-prob recorded at sampling time (for replayed ExGRPO
    trajectories: the one stored in the pool). The clamp (``c`` =
    :data:`LOG_RATIO_CLAMP` = 20, as verl ``compute_policy_loss``) keeps ``exp`` finite
    (also for ``old_logp = -inf``); outside it the gradient is 0. A NaN stays NaN (the
    learner then drops the step).
    """
    return torch.clamp(logp - old_logp, min=-clamp, max=clamp)


def _sequence_log_ratio(lw: Tensor, mask: Tensor, clamp: float) -> Tuple[Tensor, Tensor]:
    """GSPO sequence log-ratio ``log s_i = clamp(mean_{valid t} log w_t, -c, c)``:
    ``[N, T] -> ([N], inside [N] bool)``, ``inside`` = the clamp did not act (strictly
    inside ``(-c, c)``; a row whose every token was clamped to the bound is outside).

    Rows with no valid token get ``log s_i = 0`` (s_i = 1).
    """
    raw = masked_mean(lw, mask, dim=-1)
    return torch.clamp(raw, min=-clamp, max=clamp), (raw.abs() < clamp).detach()


@register_ratio_mode("token")
def _token_ratio(logp: Tensor, old_logp: Tensor, mask: Optional[Tensor], log_ratio_clamp: float) -> Tensor:
    """Token importance ratio (GRPO): ``w_t = exp(log_ratio(logp, old_logp))``.

    Shapes: ``logp, old_logp [N, T]`` -> ``[N, T]``; ``mask`` is unused. The log ratio is
    clamped to +-``log_ratio_clamp`` (20, as verl).
    """
    del mask
    return torch.exp(log_ratio(logp, old_logp, clamp=log_ratio_clamp))


@register_ratio_mode("sequence")
def _sequence_ratio(logp: Tensor, old_logp: Tensor, mask: Optional[Tensor], log_ratio_clamp: float) -> Tensor:
    """GSPO sequence ratio in its "GSPO-token" form (Zheng et al. 2025, arXiv 2507.18071;
    verl ``gspo`` loss).

    Shapes: ``logp, old_logp [N, T]``, ``mask [N, T]`` (``None`` = all tokens valid) ->
    ``[N, T]``. ``s_i = exp(mean_{valid t} log w_t)`` over the row's *valid* tokens,
    applied to every token as ``w_{i,t} = sg[s_i] * pi(t) / sg[pi(t)]``. Its *value* is
    ``s_i`` on every token (so all tokens of a row are clipped together), and its gradient
    is ``s_i * grad log pi(t)``; with a per-row advantage and ``seq-mean-token-mean``
    aggregation this equals the GSPO sequence gradient ``s_i * A_i * mean_t grad log
    pi(t)``. GSPO uses much smaller clip ranges (paper: 3e-4 / 4e-4); pass them via
    ``eps_low`` / ``eps_high``. The sequence log-ratio is clamped to +-``log_ratio_clamp``
    like the token one, and a row where the clamp acts gets no gradient (as the token ratio
    outside its clamp, and verl's GSPO clamp of the whole straight-through log-ratio).
    """
    lw = log_ratio(logp, old_logp, clamp=log_ratio_clamp)
    m = torch.ones_like(logp) if mask is None else mask
    seq_lw, inside = _sequence_log_ratio(lw, m, log_ratio_clamp)  # [N], [N]
    # value: sg[log s_i]; gradient: d logp_t (pi / sg[pi] in log space), none where
    # the clamp acted. The where() leaves values (and inside rows' gradients) bit for bit.
    logp_grad = torch.where(inside.unsqueeze(-1), logp, logp.detach())
    log_w = seq_lw.detach().unsqueeze(-1) + logp_grad - logp.detach()
    return torch.exp(log_w)


def clipped_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Optional[Tensor] = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip: bool = True,
    ratio_mode: str = "token",
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    ratio_cap: Optional[float] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate, per token (no aggregation).

    Shapes: ``logp [N, T]`` (current policy, with grad), ``old_logp [N, T]`` (behaviour),
    ``advantages [N]`` (broadcast over tokens) or ``[N, T]``, ``mask [N, T]`` (needed for
    ``ratio_mode="sequence"``; ``None`` = all tokens valid) ->
    ``(per_token_loss [N, T], stats)``.

    Formula (GRPO, DeepSeekMath; DAPO clip-higher for ``eps_high != eps_low``)::

        l_t = -min(w_t * A, clip(w_t, 1 - eps_low, 1 + eps_high) * A)      (clip=True)
        l_t = -w_t * A                                                     (clip=False)
        l_t = -sg[min(w_t, C)] * A * pi(t) / sg[pi(t)]      (clip=False, ratio_cap=C)

    ``clip=False`` is the official ExGRPO mixed-mode ``loss_remove_clip`` for fresh tokens;
    ``ratio_cap`` is truncated importance sampling of the unclipped ratio (as verl and TRL
    weight tokens sampled by an engine whose log-probs differ from the trainer's): the
    value is ``-min(w, C) * A`` and the gradient ``min(w, C) * A * grad log pi``, so a
    token above C keeps a gradient of bounded weight. With the clip on it does nothing.

    ``w_t`` comes from the ratio mode (:data:`RATIO_MODES`): ``"token"``
    (:func:`_token_ratio`, ``exp`` of the clamped per-token log ratio) or ``"sequence"``
    (:func:`_sequence_ratio`, GSPO: ``exp(mean log w)`` of the row on every token), or one a
    user registered with :func:`register_ratio_mode`.

    Stats (all detached, ``[N, T]`` float, not masked: mask them when reducing):

    * ``"ratio"``: the ratio value ``w_t`` (``s_i`` broadcast in sequence mode);
    * ``"clipped"``: 1 where the clip is *active* (the clipped branch is strictly the
      larger loss, i.e. ``A > 0 and w > 1 + eps_high`` or ``A < 0 and w < 1 - eps_low``;
      verl's ``pg_clipfrac``); all zeros when ``clip=False``;
    * ``"outside_trust_region"``: the same condition regardless of ``clip`` (what *would*
      be clipped) -- a useful off-policyness metric in ExGRPO's no-clip mixed mode.
    """
    ratio_fn = RATIO_MODES.get(ratio_mode)
    adv = _broadcast_adv(advantages, logp).to(logp.dtype)
    ratio = ratio_fn(logp, old_logp, mask, log_ratio_clamp)
    per_token, active, would_clip = _clip_or_cap(ratio, adv, logp, eps_low, eps_high, clip, ratio_cap)
    stats = {
        "ratio": ratio.detach(),
        "clipped": active.to(logp.dtype),
        "outside_trust_region": would_clip.to(logp.dtype),
    }
    return per_token, stats


def _clip_or_cap(
    ratio: Tensor,
    adv: Tensor,
    logp: Tensor,
    eps_low: float,
    eps_high: float,
    clip: bool,
    ratio_cap: Optional[float],
) -> Tuple[Tensor, Tensor, Tensor]:
    """The per-token loss of :func:`clipped_surrogate` from ``ratio, adv, logp [N, T]``:
    ``(per_token_loss, active [N, T] bool, would_clip [N, T] bool)``, the last two detached
    (the clip acting, and where it would act with ``clip=True``)."""
    unclipped = -ratio * adv
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clipped_loss = -clipped_ratio * adv
    would_clip = (clipped_loss > unclipped).detach()
    if clip:
        return torch.maximum(unclipped, clipped_loss), would_clip, would_clip
    if ratio_cap is None:
        per_token = unclipped
    else:
        weight = torch.clamp(ratio, max=ratio_cap).detach()
        per_token = -weight * adv * torch.exp(logp - logp.detach())
    return per_token, torch.zeros_like(would_clip), would_clip


def policy_shaping(w: Tensor, beta: float = 0.1) -> Tensor:
    """ExGRPO / LUFFY policy shaping ``f(w) = w / (w + beta)``.

    Shapes: any -> same. ``f'(w) = beta / (w + beta)^2``: the gradient through a token is
    damped when ``w`` (or the probability) is already large, so replayed low-entropy
    trajectories do not collapse exploration. ``beta = 0.1`` (ExGRPO paper section 3.2;
    LUFFY ``off_policy_reshape="p_div_p_0.1"``).
    """
    return w / (w + beta)


def shaped_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    beta: float = 0.1,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """ExGRPO surrogate for *replayed* tokens: ``l_t = -A * f(w_t)``, no clipping.

    Shapes: ``logp [N, T]``, ``old_logp [N, T]`` (log-probs recorded when the replayed
    trajectory was sampled, stored in the experience pool), ``advantages [N]`` or
    ``[N, T]`` -> ``(per_token_loss [N, T], stats)``.

    Formula (ExGRPO arXiv 2510.02245, section 3.2 / eq. mixed objective)::

        w_t = exp(clamp(logp_t - old_logp_t, +-20)),   f(w) = w / (w + beta)
        l_t = -A * f(w_t)

    (The LUFFY code base this descends from uses ``w_t = pi_theta(t)`` for demonstrations
    with unknown behaviour probabilities; ExGRPO stores the behaviour log-probs, so the
    ratio is used here, as docs/ALGORITHMS.md section 2 specifies.)

    Stats (detached, ``[N, T]``): ``"ratio"`` = ``w_t``, ``"shaping"`` = ``f(w_t)``.
    """
    adv = _broadcast_adv(advantages, logp).to(logp.dtype)
    ratio = torch.exp(log_ratio(logp, old_logp, clamp=log_ratio_clamp))
    shaped = policy_shaping(ratio, beta=beta)
    per_token = -adv * shaped
    return per_token, {"ratio": ratio.detach(), "shaping": shaped.detach()}


# --------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------


def _masked_loss(per_token_loss: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    m = _float_mask(mask, per_token_loss)
    zero = torch.zeros((), dtype=per_token_loss.dtype, device=per_token_loss.device)
    return torch.where(m != 0, per_token_loss, zero) * m, m


class AggTotals(NamedTuple):
    """The counts an aggregation divides by, taken from a whole (mini-)batch so that a
    slice of its rows (a learner micro-batch, gradient accumulation) can be aggregated
    on its own and the slices' losses *sum* to the whole batch's loss exactly.

    ``rows``: all rows; ``tokens``: valid tokens (``sum m``); ``rows_with_tokens``: rows
    with at least one valid token. Floats or 0-d tensors (no host sync needed)."""

    rows: float
    tokens: Tensor
    rows_with_tokens: Tensor


def agg_totals(mask: Tensor) -> AggTotals:
    """:class:`AggTotals` of a ``mask [N, T]`` (the whole batch that will be sliced)."""
    m = mask.to(torch.float32) if mask.dtype == torch.bool else mask
    rows = m.shape[0] if m.dim() > 1 else 1
    return AggTotals(float(rows), m.sum().detach(), (m.sum(dim=-1) > 0).sum().to(m.dtype).detach())


@register_loss_agg_mode("token-mean")
def _agg_token_mean(
    per_token_loss: Tensor,
    mask: Tensor,
    max_len: Optional[int] = None,
    micro_batch_rows: Optional[int] = None,
    totals: Optional[AggTotals] = None,
) -> Tensor:
    """``sum_{i,t} m l / sum_{i,t} m`` (DAPO / verl ``token-mean``)."""
    del max_len, micro_batch_rows
    lm, m = _masked_loss(per_token_loss, mask)
    tokens = m.sum() if totals is None else torch.as_tensor(totals.tokens, dtype=lm.dtype, device=lm.device)
    # An all-zero mask gives 0 / 1e-8 = 0, still attached to the graph (no host sync).
    return lm.sum() / tokens.clamp_min(1e-8)


@register_loss_agg_mode("seq-mean-token-mean")
def _agg_seq_mean_token_mean(
    per_token_loss: Tensor,
    mask: Tensor,
    max_len: Optional[int] = None,
    micro_batch_rows: Optional[int] = None,
    totals: Optional[AggTotals] = None,
) -> Tensor:
    """``mean_{i: n_i>0} (sum_t m l / n_i)``; rows with no valid token are excluded."""
    del max_len, micro_batch_rows
    lm, m = _masked_loss(per_token_loss, mask)
    n_tok = m.sum(dim=-1)
    has = n_tok > 0
    seq = lm.sum(dim=-1) / torch.where(has, n_tok, torch.ones_like(n_tok))
    if totals is None:
        n_seq = has.sum().to(seq.dtype)
    else:
        n_seq = torch.as_tensor(totals.rows_with_tokens, dtype=seq.dtype, device=seq.device)
    # rows without tokens contribute 0 to the sum and are not counted (no host sync).
    return (seq * has.to(seq.dtype)).sum() / n_seq.clamp_min(1.0)


def _rows(lm: Tensor, totals: Optional[AggTotals]) -> float:
    if totals is not None:
        return float(totals.rows)
    return lm.shape[0] if lm.dim() > 1 else 1


@register_loss_agg_mode("seq-mean-token-sum-norm")
def _agg_seq_mean_token_sum_norm(
    per_token_loss: Tensor,
    mask: Tensor,
    max_len: Optional[int] = None,
    micro_batch_rows: Optional[int] = None,
    totals: Optional[AggTotals] = None,
) -> Tensor:
    """Dr.GRPO: ``sum_{i,t} m l / (N * L)``, ``L = max_len or T``, N = all rows."""
    del micro_batch_rows
    lm, _ = _masked_loss(per_token_loss, mask)
    n_rows = _rows(lm, totals)
    L = lm.shape[-1] if max_len is None else max_len
    return lm.sum() / float(max(n_rows, 1) * max(L, 1))


@register_loss_agg_mode("seq-mean-token-sum-norm-official")
def _agg_seq_mean_token_sum_norm_official(
    per_token_loss: Tensor,
    mask: Tensor,
    max_len: Optional[int] = None,
    micro_batch_rows: Optional[int] = None,
    totals: Optional[AggTotals] = None,
) -> Tensor:
    """Official ExGRPO: ``sum_{i,t} m l / ((N / M) * L)``, ``M = micro_batch_rows`` (64).

    The official run sums the token losses of each M-row micro-batch, divides by L and
    averages the micro-batches' gradients (over its GPUs and accumulation steps), i.e. a
    mini-batch of N rows gets ``sum / ((N / M) * L)`` = ``M`` times Dr.GRPO's scale.
    Written per learner, data-parallel averaging over learners keeps it whatever their
    number. ``micro_batch_rows=None`` means one micro-batch (``sum / L``).
    """
    if micro_batch_rows is not None and micro_batch_rows < 1:
        raise ValueError(f"micro_batch_rows must be >= 1 (or None), got {micro_batch_rows}")
    lm, _ = _masked_loss(per_token_loss, mask)
    L = lm.shape[-1] if max_len is None else max_len
    n_rows = _rows(lm, totals)
    micro_batches = 1.0 if micro_batch_rows is None else max(n_rows, 1) / float(micro_batch_rows)
    return lm.sum() / (micro_batches * float(max(L, 1)))


def agg_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    max_len: Optional[int] = None,
    micro_batch_rows: Optional[int] = None,
    totals: Optional[AggTotals] = None,
) -> Tensor:
    """Aggregate a per-token loss to a scalar (names as verl ``agg_loss``).

    Shapes: ``per_token_loss [N, T]``, ``mask [N, T]`` -> scalar. ``m`` = float mask,
    ``n_i = sum_t m_{i,t}``. Modes (:data:`LOSS_AGG_MODES`; more with
    :func:`register_loss_agg_mode`, an unknown one raises a ``ValueError`` naming them):

    * ``"token-mean"``: ``sum_{i,t} m l / sum_{i,t} m`` -- every valid token weighs the
      same (DAPO; verl default).
    * ``"seq-mean-token-mean"``: ``mean_i (sum_t m l / n_i)`` over rows with ``n_i > 0``
      (original GRPO); rows with no valid token are excluded from the mean.
    * ``"seq-mean-token-sum-norm"``: ``sum_{i,t} m l / (N * L)`` with ``N`` = number of rows
      (all of them) and ``L = max_len`` (or ``T`` if ``None``) -- Dr.GRPO's constant
      normaliser (arXiv 2503.20783), verl's mode of the same name.
    * ``"seq-mean-token-sum-norm-official"``: ``sum_{i,t} m l / ((N / M) * L)`` with
      ``M = micro_batch_rows`` -- what the official ExGRPO run computes for one optimiser
      step: each M-row micro-batch's token-loss sum over L, averaged over micro-batches
      (its 8 GPUs x 64 rows for a 512-row mini-batch: ``sum / (8 * 8192)``). That is ``M``
      times Dr.GRPO's scale, whatever the number of learners here.

    Set ``max_len`` to the configured max response length for the sum-norm modes so the
    normaliser does not depend on each batch's padding. An all-zero mask returns 0 that is
    still attached to ``per_token_loss``'s graph (backward gives zero grads).

    ``totals`` (:func:`agg_totals` of a whole batch) replaces the counts this slice of it
    would divide by (``N``, ``sum m``, rows with tokens): the slices' aggregates then add up
    to the whole batch's, which is how the learner accumulates micro-batch gradients.
    """
    fn = LOSS_AGG_MODES.get(mode)
    return fn(per_token_loss, mask, max_len=max_len, micro_batch_rows=micro_batch_rows, totals=totals)


# --------------------------------------------------------------------------------------
# Logits utilities, KL
# --------------------------------------------------------------------------------------


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution ``softmax(logits)`` along the last dim.

    Shapes: ``logits [..., V]`` -> ``[...]`` (float32 for half/bf16 input).

    Formula: ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` (verl
    ``entropy_from_logits``), numerically stable; ``-inf`` logits (masked vocabulary)
    contribute 0 instead of NaN. For a temperature ``tau``, pass ``logits / tau``.
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    pz = torch.where(p > 0, p * z, torch.zeros((), dtype=z.dtype, device=z.device))
    return lse.squeeze(-1) - pz.sum(dim=-1)


#: Rows (positions) of ``[rows, V]`` logits processed at once by :func:`streamed_entropy`:
#: bounds its float32 temporaries to ``ENTROPY_CHUNK_ROWS * V`` values.
ENTROPY_CHUNK_ROWS = 256


def _entropy_rows(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(H, p, log p)`` of float32 rows ``z [n, V]``; ``p * log p`` taken as 0 where p = 0."""
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    logp = z - lse
    p = torch.exp(logp)
    plogp = torch.where(p > 0, p * logp, torch.zeros((), dtype=z.dtype, device=z.device))
    return -plogp.sum(-1), p, logp


def _row_chunks(logits: Tensor):
    """Index tuples covering ``logits [..., V]`` in pieces of at most ENTROPY_CHUNK_ROWS
    positions, without reshaping (a reshape of a sliced view would copy all of it)."""
    lead = logits.shape[:-1]
    if len(lead) == 0:
        yield (Ellipsis,)
        return
    last = lead[-1]
    step = max(1, ENTROPY_CHUNK_ROWS)
    for outer in itertools.product(*(range(n) for n in lead[:-1])):
        for start in range(0, last, step):
            yield (*outer, slice(start, start + step))


class _StreamedEntropy(torch.autograd.Function):
    """Token entropy whose graph keeps only the logits (already kept by the log-prob path)
    and the ``[...]`` result: the softmax is recomputed chunk by chunk in backward, with
    ``dH/dz_j = -p_j (log p_j + H)``."""

    @staticmethod
    def forward(ctx, logits: Tensor) -> Tensor:
        out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        for idx in _row_chunks(logits):
            out[idx] = _entropy_rows(logits[idx].float())[0]
        ctx.save_for_backward(logits, out)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tensor:
        logits, entropy = ctx.saved_tensors
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for idx in _row_chunks(logits):
            _, p, logp = _entropy_rows(logits[idx].float())
            g = -p * (logp + entropy[idx].unsqueeze(-1)) * grad_out[idx].unsqueeze(-1)
            grad_logits[idx] = torch.where(p > 0, g, torch.zeros((), dtype=g.dtype, device=g.device))
        return grad_logits


def streamed_entropy(logits: Tensor) -> Tensor:
    """:func:`entropy_from_logits` with bounded memory, for the learner's big logits.

    Shapes: ``logits [..., V]`` -> ``[...]`` float32. Same values and gradient as
    :func:`entropy_from_logits`, but autograd keeps no ``[..., V]`` intermediate (the plain
    version keeps about four: the softmax, its product with the logits, masks), and the
    forward / backward work in chunks of :data:`ENTROPY_CHUNK_ROWS` positions. On
    SmolLM2's 49k vocabulary and 16 x 256 completion tokens that was ~3 GB less at peak
    (benchmarks/learner_memory.py now measures the learner's chunked scoring pass that uses it).
    """
    # Without a graph (no-grad input or torch.no_grad) apply() records nothing and the
    # saved logits are released with the output.
    return _StreamedEntropy.apply(logits)


def token_logprobs_from_logits(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of the given tokens: ``log softmax(logits / tau)[token_ids]``.

    Shapes: ``logits [N, T, V]`` (any leading dims), ``token_ids [N, T]`` long (must be
    valid vocabulary indices everywhere -- fill padding with any valid id and mask it)
    -> ``[N, T]`` (float32 for half/bf16 input).

    Computed as ``z.gather(token) - logsumexp(z)`` so no full ``[N, T, V]`` log-softmax
    copy is made for float32 logits (verl ``logprobs_from_logits_v2``). Half/bf16 logits
    are upcast row by row (first dim) to limit the float32 copy to one ``[T, V]`` slice.
    ``temperature != 1`` divides the logits first (one copy, needed anyway).
    """
    if temperature != 1.0:
        logits = logits / temperature
    ids = token_ids.long().unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, ids).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    out = []
    for row_logits, row_ids in zip(logits, ids):
        z = row_logits.float()
        out.append(z.gather(-1, row_ids).squeeze(-1) - torch.logsumexp(z, dim=-1))
    return torch.stack(out, dim=0)


def k3_kl(
    logp: Tensor,
    ref_logp: Tensor,
    *,
    log_ratio_clamp: float = 10.0,
    max_kl: float = 10.0,
) -> Tensor:
    """k3 (low-variance, always >= 0) estimator of KL(pi_theta || pi_ref), per token.

    Shapes: ``logp [N, T]``, ``ref_logp [N, T]`` -> ``[N, T]``.

    Formula (Schulman, "Approximating KL divergence", 2020; verl ``low_var_kl``)::

        d = clamp(ref_logp - logp, -10, 10);   k3 = exp(d) - d - 1,  clamped to <= 10

    ``exp(d) - d - 1 >= 0`` for every real ``d``.
    """
    d = torch.clamp(ref_logp - logp, min=-log_ratio_clamp, max=log_ratio_clamp)
    kl = torch.exp(d) - d - 1.0
    return torch.clamp(kl, min=-max_kl, max=max_kl)


# --------------------------------------------------------------------------------------
# ExGRPO mixed-policy objective
# --------------------------------------------------------------------------------------


def _masked_stat(x: Tensor, m: Tensor, how: str) -> Tensor:
    """Detached mean/max/min of ``x`` over ``m != 0``; 0 when ``m`` selects nothing."""
    x = x.detach()
    sel = m != 0
    if not bool(sel.any()):
        return torch.zeros((), dtype=x.dtype, device=x.device)
    vals = x[sel]
    if how == "mean":
        return vals.mean()
    if how == "max":
        return vals.max()
    return vals.min()


def mixed_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    off_policy: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_fresh: bool = True,
    beta: float = 0.1,
    agg_mode: str = "token-mean",
    max_len: Optional[int] = None,
    micro_batch_rows: Optional[int] = None,
    entropy: Optional[Tensor] = None,
    entropy_coeff: float = 0.0,
    ref_logp: Optional[Tensor] = None,
    kl_coeff: float = 0.0,
    ratio_mode: str = "token",
    ratio_cap: Optional[float] = None,
    totals: Optional[AggTotals] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """ExGRPO mixed-policy objective over one (mini/micro-)batch.

    Shapes: ``logp, old_logp, mask [N, T]``; ``advantages [N]`` (or ``[N, T]``);
    ``off_policy [N]`` bool (row is off-policy: a trajectory replayed from the experience
    pool or an XRPO seeded completion, whose ``old_logp`` are the recorded behaviour
    log-probs of another policy or prompt); optional ``entropy [N, T]``
    (per-token entropy of the current policy, *with* grad if ``entropy_coeff > 0``) and
    ``ref_logp [N, T]``. Returns ``(loss scalar, metrics dict of 0-d detached tensors)``.

    Formula (ExGRPO arXiv 2510.02245 section 3.2; docs/ALGORITHMS.md section 2)::

        l_t = clipped_surrogate(...; clip=clip_fresh, ratio_mode)   fresh rows
        l_t = -A * f(w_t),  f(w) = w / (w + beta)                    replayed rows
        loss = agg(l, mask, agg_mode)                 <- ONE aggregation over all tokens
               - entropy_coeff * token_mean(entropy, mask)   (if entropy given; a token
                                                     mean in the official code)
               + kl_coeff * agg(k3_kl(logp, ref_logp), mask, agg_mode)  (if kl_coeff>0)

    Official ExGRPO: ``clip_fresh=False`` in mixed mode (``loss_remove_clip``),
    ``entropy_coeff = 0.001``, no KL. With ``off_policy`` all False this is exactly the
    plain GRPO loss ``agg(clipped_surrogate(...))`` (+ the same entropy/KL terms).
    Replayed rows always use the token-level ratio (``ratio_mode`` only affects fresh rows).

    ``totals``: when these rows are one micro-batch of a larger mini-batch, the
    :func:`agg_totals` of the whole mini-batch; every term (policy, entropy, KL) is then
    divided by the mini-batch's counts, so the micro-batches' losses (and gradients) sum
    to the mini-batch's. The metrics stay this micro-batch's own.

    The metrics are listed at :func:`_mixed_metrics`, the numerical guards at
    :func:`_mixed_per_token_loss`.
    """
    if off_policy.dim() != 1 or off_policy.shape[0] != logp.shape[0]:
        raise ValueError(f"off_policy must be [N]={logp.shape[0]}, got {tuple(off_policy.shape)}")
    m = _float_mask(mask, logp)
    per_token, fresh_stats, rep_stats = _mixed_per_token_loss(
        logp,
        old_logp,
        advantages,
        m,
        off_policy,
        eps_low=eps_low,
        eps_high=eps_high,
        clip_fresh=clip_fresh,
        beta=beta,
        ratio_mode=ratio_mode,
        ratio_cap=ratio_cap,
    )
    pg_loss = agg_loss(per_token, m, agg_mode, max_len=max_len, micro_batch_rows=micro_batch_rows, totals=totals)
    loss = pg_loss
    metrics: Dict[str, Tensor] = {"policy_loss": pg_loss.detach()}
    if entropy is not None:
        loss = _with_entropy_bonus(loss, entropy, entropy_coeff, m, totals, metrics)
    if ref_logp is not None and kl_coeff != 0.0:
        kl = k3_kl(logp, ref_logp)
        loss = loss + kl_coeff * agg_loss(kl, m, agg_mode, max_len=max_len, micro_batch_rows=micro_batch_rows, totals=totals)
        metrics["kl"] = masked_mean(kl.detach(), m)
    metrics.update(_mixed_metrics(fresh_stats, rep_stats, m, off_policy, advantages, logp))
    return loss, metrics


def _mixed_per_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    m: Tensor,
    off_policy: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    clip_fresh: bool,
    beta: float,
    ratio_mode: str,
    ratio_cap: Optional[float],
) -> Tuple[Tensor, Dict[str, Tensor], Optional[Dict[str, Tensor]]]:
    """Per-token loss of :func:`mixed_policy_loss` before aggregation:
    ``(per_token_loss [N, T], fresh stats, replayed stats or None)``.

    ``logp, old_logp, m [N, T]`` (``m`` the float mask), ``advantages [N]`` or ``[N, T]``,
    ``off_policy [N]``. Fresh rows take :func:`clipped_surrogate`, off-policy rows
    :func:`shaped_surrogate` (stats ``None`` when there are none).

    Numerical guards of the whole objective: every importance log-ratio is clamped to
    +-:data:`LOG_RATIO_CLAMP` before ``exp`` (fresh and replayed tokens, both ratio
    modes), every aggregation divides by a count clamped away from 0 or a constant >= 1,
    so all-zero advantages give a finite loss (0 from the surrogate) and a zero policy
    gradient. A NaN/inf in the inputs is not hidden: it reaches the loss, and the learner
    drops the update.
    """
    fresh_loss, fresh_stats = clipped_surrogate(
        logp,
        old_logp,
        advantages,
        m,
        eps_low=eps_low,
        eps_high=eps_high,
        clip=clip_fresh,
        ratio_mode=ratio_mode,
        ratio_cap=ratio_cap,
    )
    if not bool(off_policy.any()):
        return fresh_loss, fresh_stats, None
    rep = off_policy.to(torch.bool).unsqueeze(-1)  # [N, 1]
    rep_loss, rep_stats = shaped_surrogate(logp, old_logp, advantages, beta=beta)
    return torch.where(rep, rep_loss, fresh_loss), fresh_stats, rep_stats


def _with_entropy_bonus(
    loss: Tensor,
    entropy: Tensor,
    entropy_coeff: float,
    m: Tensor,
    totals: Optional[AggTotals],
    metrics: Dict[str, Tensor],
) -> Tensor:
    """``loss - entropy_coeff * token_mean(entropy)`` (a token mean whatever ``agg_mode``,
    as in the official code; over ``totals``' tokens when given); records the ``entropy``
    metric (token mean of ``entropy [N, T]`` over ``m [N, T]``) into ``metrics``."""
    if entropy_coeff != 0.0:
        ent = masked_mean(entropy, m) if totals is None else agg_loss(entropy, m, "token-mean", totals=totals)
        loss = loss - entropy_coeff * ent
    metrics["entropy"] = masked_mean(entropy.detach(), m)
    return loss


#: Metrics of :func:`mixed_policy_loss` taken over the fresh tokens only or the replayed
#: tokens only, each with the metric that gives that token set's share of the batch. Each
#: is 0 where its token set is empty, so whoever combines the metrics of several
#: (micro-/mini-)batches weights them by that set's tokens, not the batch's, and leaves out
#: a batch that has none (rllib/learner.py).
#: What :func:`mixed_policy_loss` reports per update (its ``metrics``; keys starting with
#: ``_`` are internal): logged by the learner under ``learners/<module>/``.
LOSS_METRICS = (
    "policy_loss",
    "entropy",
    "kl",
    "zero_advantage_fraction",
    "clip_fraction",
    "trust_region_violation_fraction",
    "ratio_mean",
    "ratio_max",
    "ratio_min",
    "replay_ratio_mean",
    "replay_shaping_mean",
    "fresh_token_fraction",
    "replayed_token_fraction",
)

STAT_TOKEN_SHARE = {
    **dict.fromkeys(("clip_fraction", "trust_region_violation_fraction", "ratio_mean", "ratio_max", "ratio_min"), "fresh_token_fraction"),
    **dict.fromkeys(("replay_ratio_mean", "replay_shaping_mean"), "replayed_token_fraction"),
}


def _mixed_metrics(
    fresh_stats: Dict[str, Tensor],
    rep_stats: Optional[Dict[str, Tensor]],
    m: Tensor,
    off_policy: Tensor,
    advantages: Tensor,
    logp: Tensor,
) -> Dict[str, Tensor]:
    """The ratio, clip and token-share metrics of :func:`mixed_policy_loss` (0-d, detached).

    ``m [N, T]`` float mask, ``off_policy [N]``, ``advantages [N]`` or ``[N, T]``, ``logp
    [N, T]`` (for the shape). Besides ``policy_loss``, ``entropy`` (token mean, if given)
    and ``kl`` (token mean of k3, if ``kl_coeff > 0``), :func:`mixed_policy_loss` reports:
    ``clip_fraction`` (active clip over fresh valid tokens),
    ``trust_region_violation_fraction`` (would-clip fraction over fresh tokens, meaningful
    when ``clip_fresh=False``); ``ratio_mean/ratio_max/ratio_min`` (fresh tokens);
    ``replay_ratio_mean``, ``replay_shaping_mean`` (mean f(w) on replayed tokens);
    ``fresh_token_fraction`` / ``replayed_token_fraction`` (shares of the valid tokens);
    ``zero_advantage_fraction`` (share of the valid tokens whose advantage is exactly 0:
    1 when every group of the batch is all-correct or all-wrong, a step with no policy
    gradient). A statistic over an empty token set is reported as 0.
    """
    rep = off_policy.to(torch.bool).unsqueeze(-1)  # [N, 1]
    rep_tok = m * rep.to(m.dtype)
    fresh_tok = m * (~rep).to(m.dtype)
    metrics = _token_share_metrics(fresh_stats, rep_stats, m, fresh_tok, rep_tok)
    adv_tok = _broadcast_adv(advantages.detach(), logp).expand_as(m)
    metrics["zero_advantage_fraction"] = masked_mean((adv_tok == 0).to(m.dtype), m)
    return metrics


def _token_share_metrics(fresh_stats, rep_stats, m: Tensor, fresh_tok: Tensor, rep_tok: Tensor) -> Dict[str, Tensor]:
    """The ratio, clip and token-share statistics of :func:`mixed_policy_loss`."""
    metrics: Dict[str, Tensor] = {}
    metrics["clip_fraction"] = masked_mean(fresh_stats["clipped"], fresh_tok)
    metrics["trust_region_violation_fraction"] = masked_mean(fresh_stats["outside_trust_region"], fresh_tok)
    metrics["ratio_mean"] = _masked_stat(fresh_stats["ratio"], fresh_tok, "mean")
    metrics["ratio_max"] = _masked_stat(fresh_stats["ratio"], fresh_tok, "max")
    metrics["ratio_min"] = _masked_stat(fresh_stats["ratio"], fresh_tok, "min")
    if rep_stats is not None:
        metrics["replay_ratio_mean"] = _masked_stat(rep_stats["ratio"], rep_tok, "mean")
        metrics["replay_shaping_mean"] = _masked_stat(rep_stats["shaping"], rep_tok, "mean")
    else:
        zero = torch.zeros((), dtype=m.dtype, device=m.device)
        metrics["replay_ratio_mean"] = zero
        metrics["replay_shaping_mean"] = zero
    n_valid = m.sum()
    if bool(n_valid > 0):
        metrics["fresh_token_fraction"] = (fresh_tok.sum() / n_valid).detach()
        metrics["replayed_token_fraction"] = (rep_tok.sum() / n_valid).detach()
    else:
        zero = torch.zeros((), dtype=m.dtype, device=m.device)
        metrics["fresh_token_fraction"] = zero
        metrics["replayed_token_fraction"] = zero
    return metrics


# --------------------------------------------------------------------------------------
# XRPO novelty-guided advantage sharpening
# --------------------------------------------------------------------------------------


def novelty_sharpened_advantages(
    advantages: Tensor,
    rewards: Tensor,
    seq_logp_mean: Tensor,
    group_index: Tensor,
    *,
    lambda_nov: float = 1.0,
    kappa: float = 1.0,
) -> Tuple[Tensor, Tensor]:
    """XRPO section 3.3: novelty bonus for correct but unlikely completions.

    Shapes: ``advantages [N]``, ``rewards [N]``, ``seq_logp_mean [N]`` (``s_i =
    (1/|y_i|) sum_t log pi(y_t)``, length-normalised log-likelihood of completion ``i``),
    ``group_index [N]`` -> ``(new_advantages [N], bonus [N])``. Inputs are detached.

    Formula (XRPO arXiv 2510.06672, eq. for novelty sharpening)::

        mean_s_g = mean of s over the WHOLE group g(i) (correct and incorrect completions;
                   our documented choice, the paper says "the group average")
        if r_i > 0 and s_i < mean_s_g and A_i > 0:
            bonus_i = min(max(lambda_nov * (1 - exp(s_i - mean_s_g)), 0), kappa * A_i)
        else:
            bonus_i = 0
        A_i <- A_i + bonus_i

    The bonus is never negative and never exceeds ``kappa * A_i``. When ``A_i <= 0`` (a
    correct completion in an all-correct group has ``A_i = 0`` under mean-centring) the
    literal formula's cap ``kappa * A_i <= 0`` would give a bonus ``<= 0``; we set it to 0
    instead, so sharpening can only add credit, never penalise a correct answer. The
    result is also clamped at 0 from below for ``kappa < 0`` or ``lambda_nov < 0``.
    """
    adv = advantages.detach()
    r = rewards.detach()
    s = seq_logp_mean.detach().to(adv.dtype)
    inverse, k = _dense_groups(group_index)
    counts = _group_sum(torch.ones_like(s), inverse, k)
    mean_s = (_group_sum(s, inverse, k) / counts)[inverse]
    raw = torch.clamp(lambda_nov * (1.0 - torch.exp(s - mean_s)), min=0.0)
    capped = torch.minimum(raw, kappa * adv)
    eligible = (r > 0) & (s < mean_s) & (adv > 0)
    bonus = torch.where(eligible, capped.clamp_min(0.0), torch.zeros_like(adv))
    return adv + bonus, bonus
