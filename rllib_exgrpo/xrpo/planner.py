"""XRPO's hierarchical rollout planner: how many completions each question gets.

Pure numpy/scipy (no torch, no RLlib), so the algorithm, the tests and the benchmark use
it directly. The rules follow ``docs/ALGORITHMS.md`` section 3.1 (XRPO,
arXiv 2510.06672; the official code was not reachable, so every choice not fixed by the
paper's formulas is ours and is documented here). The code is our own.

Budget and phases
-----------------
One training step draws ``B`` questions and spends the same total number of completions
as GRPO, ``B * G``: here ``total = num_questions * budget_per_question``. The step is
spent in phases:

1. :meth:`RolloutPlanner.initial`: ``n0`` completions for every question (e.g. ``G/2``).
2. ``rounds`` priority rounds, :meth:`RolloutPlanner.next_round`: round ``r`` (0-based)
   hands out ``ceil(R / (rounds - r))`` completions, ``R`` being what is left of the
   budget, so the budget is spread evenly over the rounds still to come and **the last
   round spends whatever is left**. Once the budget is spent every count is 0.

Uncertainty and priority
------------------------
:func:`student_t_halfwidth`: the Student-t half-width of the 95% (``alpha = 0.05``)
confidence interval of a question's mean reward after ``n`` completions,
``h_q(n) = t_{1-alpha/2, n-1} * s_q / sqrt(n)``, ``s_q`` the sample std (``ddof=1``).
**For n < 2 there is no t quantile (0 degrees of freedom) and no sample std: the
function returns +inf** (no finite interval exists); :func:`priority` never lets that
infinity through (below).

:func:`priority`::

    Pi_q = (h_q(n_q) - h_q(n_q + 1)) + lam * sqrt(log(1 + T) / n_q)

* ``h_q(n_q + 1)`` uses the **same** ``s_q``: the expected reduction of the half-width
  from one more completion, assuming the std stays. A question with ``s_q = 0`` (all 0 or
  all 1) gets only the exploration bonus.
* **T = completions drawn so far in this step** (all questions, scored or not), counted
  at the start of the round (our choice; the paper leaves "completions so far" vs
  "training steps so far" open). ``log(1 + T)`` grows within the step, so later rounds
  weigh exploration a little more; the planner stays stateless across steps.
* **Fewer than 2 scored rewards** (``n0 = 1``, or completions the verifier could not
  score): the reduction term is that of a question with 2 rewards of the largest spread
  a {0,1} reward can have (one 0 and one 1, ``s = 1/sqrt(2)``, :data:`UNKNOWN_STD`):
  ``h(2; s*) - h(3; s*)`` (about 4.60 for ``alpha = 0.05``). Such a question therefore
  ranks with the most uncertain two-sample questions: high, but finite, so the
  proportional split does not give it the whole round.
* In the planner, ``n_q`` in the half-width terms is the number of **scored** rewards
  (the sample size of ``s_q``); ``n_q`` in the exploration bonus is the number of
  completions **drawn** for the question (scored or not, at least ``n0 >= 1``), so the
  bonus is always finite and a question whose completions keep failing verification is
  not pulled in by an ever-growing bonus.

Allocation (``allocation``)
---------------------------
* ``"proportional"`` (default): the round's completions are split in proportion to
  ``Pi_q`` (:func:`allocate_proportional`): quotas ``share * Pi_q / sum Pi``; a question
  whose quota exceeds its room under ``max_per_question`` gets its room and the rest is
  re-split among the others (water-filling); the fractional quotas are rounded by the
  **largest-remainder method** (floors first, then one extra each in decreasing order of
  the fractional part; ties: larger ``Pi_q``, then lower index), so the counts sum to
  the share exactly. If every ``Pi_q`` is 0 (``lam = 0`` and all ``s_q = 0``) the split is
  uniform.
* ``"top"``: greedy: the round's completions go one at a time to the question with the
  highest priority, whose priority is then recomputed with ``n_q + 1`` (same ``s_q``,
  same ``T``); ties go to the lower index. This concentrates the round on the top
  questions while the diminishing reduction term (and bonus) spreads it once a question
  has had enough.

``max_per_question`` (default ``None``: no cap) caps the completions one question gets in
the step, initial ones included. It must be ``>= budget_per_question`` so that the whole
budget can always be placed.

Rewards reported to the planner
-------------------------------
``rewards_so_far[q]`` lists the rewards of every completion drawn so far for question
``q``, in any order. An entry ``None`` or NaN means "drawn but unscored" (a verifier
error): it counts toward the budget, ``T`` and the cap, but not toward ``s_q``.

The planner is **stateless** and deterministic: every call derives everything from
``rewards_so_far`` and the configuration, so the algorithm can drive it across several
generation rounds of one training step::

    planner = RolloutPlanner(n0=4, budget_per_question=8, rounds=2)
    counts = planner.initial(B)                    # [4, 4, ..., 4]
    rewards = generate_and_score(counts)           # list of B lists of rewards
    for r in range(planner.rounds):
        extra = planner.next_round(rewards, r)     # extra completions per question
        if sum(extra) == 0:
            break
        rewards = [old + new for old, new in zip(rewards, generate_and_score(extra))]
    assert planner.remaining(rewards) == 0         # the whole B * G budget is spent
"""

from __future__ import annotations

import heapq
import math
import operator
import warnings
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = [
    "ALLOCATIONS",
    "UNKNOWN_STD",
    "RolloutPlanner",
    "student_t_halfwidth",
    "priority",
    "allocate_proportional",
    "reward_stats",
]

#: Allocation modes of :class:`RolloutPlanner`.
ALLOCATIONS: Tuple[str, ...] = ("proportional", "top")
#: Std assumed for a question with fewer than 2 scored rewards: the sample std of one 0
#: and one 1 (the largest a {0,1} reward can show with two samples).
UNKNOWN_STD: float = math.sqrt(0.5)

ArrayLike = Union[float, int, Sequence[float], np.ndarray]


def _check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not (0.0 < alpha < 1.0):
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    return alpha


def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


# --------------------------------------------------------------------------------------
# Half-width and priority
# --------------------------------------------------------------------------------------


def reward_stats(rewards: Sequence[Optional[float]]) -> Tuple[int, float]:
    """``(n, s)`` of one question's rewards: ``n`` scored rewards, ``s`` their std.

    ``None`` and NaN entries (unscored completions) are skipped. ``s`` is the sample std
    (``ddof=1``) for ``n >= 2`` and NaN otherwise.
    """
    vals = np.array([np.nan if r is None else float(r) for r in rewards], dtype=np.float64)
    vals = vals[~np.isnan(vals)]
    if np.isinf(vals).any():
        raise ValueError("rewards must be finite (None/NaN mark unscored completions)")
    n = int(vals.size)
    return n, (float(np.std(vals, ddof=1)) if n >= 2 else float("nan"))


def student_t_halfwidth(s_or_rewards: ArrayLike, n: Optional[ArrayLike] = None, alpha: float = 0.05) -> Union[float, np.ndarray]:
    """Student-t half-width ``h(n) = t_{1-alpha/2, n-1} * s / sqrt(n)``.

    Two call forms:

    * ``student_t_halfwidth(rewards)`` (``n`` omitted): ``rewards`` is one question's
      1-D reward sequence; ``n`` = number of scored rewards (None/NaN skipped), ``s`` =
      their sample std (``ddof=1``). Returns a float.
    * ``student_t_halfwidth(s, n)``: ``s`` (std, ``>= 0``) and ``n`` (counts) are scalars
      or arrays, broadcast together. Returns a float for scalar inputs, else an array.

    ``n < 2``: there is no t quantile (0 degrees of freedom) nor sample std, so the result
    is ``+inf`` whatever ``s`` is (see :func:`priority` for how the planner keeps its
    priority finite). ``s = 0`` with ``n >= 2`` gives 0.
    """
    alpha = _check_alpha(alpha)
    if n is None:
        n_val, s_val = reward_stats(np.atleast_1d(np.asarray(s_or_rewards, dtype=object)).tolist())
        return float(student_t_halfwidth(0.0 if n_val < 2 else s_val, n_val, alpha))
    s_arr = np.asarray(s_or_rewards, dtype=np.float64)
    n_arr = np.asarray(n, dtype=np.float64)
    scalar = s_arr.ndim == 0 and n_arr.ndim == 0
    s_arr, n_arr = np.broadcast_arrays(s_arr, n_arr)
    ok = n_arr >= 2
    if np.any(ok & ~(s_arr >= 0)):
        raise ValueError("s (the sample std) must be >= 0 and not NaN where n >= 2")
    if np.any(n_arr != np.floor(n_arr)):
        raise ValueError("n must hold whole counts")
    out = np.full(s_arr.shape, np.inf, dtype=np.float64)
    if np.any(ok):
        df = n_arr[ok] - 1.0
        from scipy import stats  # here, not at import: ~0.5 s off every process that imports the algorithm

        out[ok] = stats.t.ppf(1.0 - alpha / 2.0, df) * s_arr[ok] / np.sqrt(n_arr[ok])
    return float(out) if scalar else out


def priority(
    s: ArrayLike,
    n: ArrayLike,
    T: float,
    lam: float = 1.0,
    alpha: float = 0.05,
    *,
    n_bonus: Optional[ArrayLike] = None,
    unknown_std: float = UNKNOWN_STD,
) -> Union[float, np.ndarray]:
    """XRPO priority ``Pi = (h(n) - h(n + 1)) + lam * sqrt(log(1 + T) / n_bonus)``.

    Shapes: ``s``, ``n`` (and ``n_bonus``) scalars or arrays broadcast together; ``T`` a
    scalar. Returns a float for scalar inputs, else an array. Always finite.

    * ``h`` is :func:`student_t_halfwidth` with the **same** ``s`` at ``n`` and ``n + 1``
      (expected reduction assuming the std stays); ``s = 0`` leaves only the bonus.
    * ``n < 2`` (no finite half-width): the reduction term is ``h(2) - h(3)`` computed
      with ``s = unknown_std`` (default :data:`UNKNOWN_STD` = ``1/sqrt(2)``, one 0 and one
      1); ``s`` is ignored there (it may be NaN).
    * ``T``: completions drawn so far in the step (the planner's choice), ``T >= 0``.
    * ``n_bonus`` (default ``n``): the count in the exploration bonus; must be ``>= 1``.
      The planner passes the completions *drawn* (scored or not).
    """
    alpha = _check_alpha(alpha)
    lam = float(lam)
    if not (lam >= 0.0 and math.isfinite(lam)):
        raise ValueError(f"lam must be finite and >= 0, got {lam}")
    T = float(T)
    if not (T >= 0.0 and math.isfinite(T)):
        raise ValueError(f"T must be finite and >= 0, got {T}")
    unknown_std = float(unknown_std)
    if not (unknown_std >= 0.0 and math.isfinite(unknown_std)):
        raise ValueError(f"unknown_std must be finite and >= 0, got {unknown_std}")
    s_arr = np.asarray(s, dtype=np.float64)
    n_arr = np.asarray(n, dtype=np.float64)
    nb_arr = n_arr if n_bonus is None else np.asarray(n_bonus, dtype=np.float64)
    scalar = s_arr.ndim == 0 and n_arr.ndim == 0 and nb_arr.ndim == 0
    s_arr, n_arr, nb_arr = np.broadcast_arrays(s_arr, n_arr, nb_arr)
    if np.any(n_arr < 0):
        raise ValueError("n must be >= 0")
    if np.any(nb_arr < 1):
        raise ValueError("the exploration bonus needs n_bonus >= 1 (a question never sampled has no priority)")
    known = n_arr >= 2
    s_used = np.where(known, s_arr, unknown_std)
    n_used = np.where(known, n_arr, 2.0)
    h_now = student_t_halfwidth(s_used, n_used, alpha)
    reduction = h_now - student_t_halfwidth(s_used, n_used + 1.0, alpha)
    bonus = lam * np.sqrt(math.log1p(T) / nb_arr)
    out = np.asarray(reduction + bonus, dtype=np.float64)
    return float(out) if scalar else out


# --------------------------------------------------------------------------------------
# Allocation
# --------------------------------------------------------------------------------------


def allocate_proportional(total: int, weights: Sequence[float], caps: Optional[Sequence[int]] = None) -> np.ndarray:
    """Split ``total`` integer units in proportion to ``weights``, exactly.

    Shapes: ``weights [Q]`` (finite, ``>= 0``), ``caps [Q]`` (ints ``>= 0``, default no
    cap) -> ``int64 [Q]`` summing to ``min(total, sum(caps))``, each ``<= cap``.

    Water-filling for the caps (a question whose quota exceeds its cap gets the cap, the
    rest is re-split among the others), then the largest-remainder method: floors first,
    then one extra each by decreasing fractional part (ties: larger weight, then lower
    index). Zero total weight among the questions with room: uniform split.
    """
    total = _as_int(total, "total")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("weights must be finite and >= 0")
    q = w.size
    if caps is None:
        cap = np.full(q, total, dtype=np.int64)
    else:
        cap = np.asarray(caps, dtype=np.int64).reshape(-1)
        if cap.size != q:
            raise ValueError(f"caps has {cap.size} entries, weights {q}")
        if np.any(cap < 0):
            raise ValueError("caps must be >= 0")
    out = np.zeros(q, dtype=np.int64)
    share = int(min(total, int(cap.sum()) if q else 0))
    if share == 0:
        return out
    quota = np.zeros(q, dtype=np.float64)
    free = np.flatnonzero(cap > 0)
    left = float(share)
    while free.size and left > 0:
        wf = w[free]
        if wf.sum() <= 0:
            wf = np.ones_like(wf)
        qf = left * wf / wf.sum()
        over = qf >= cap[free]
        if not over.any():
            quota[free] = qf
            break
        quota[free[over]] = cap[free[over]]
        left -= float(cap[free[over]].sum())
        free = free[~over]
    base = np.minimum(np.floor(quota).astype(np.int64), cap)
    leftover = share - int(base.sum())
    rem = quota - base
    order = sorted(range(q), key=lambda i: (-rem[i], -w[i], i))
    while leftover > 0:  # one pass suffices unless float error; share <= sum(caps) ends it
        for i in order:
            if leftover == 0:
                break
            if base[i] < cap[i]:
                base[i] += 1
                leftover -= 1
    return base


# --------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------


class RolloutPlanner:
    """XRPO's hierarchical rollout planner (stateless; see the module docstring).

    Args:
        n0: completions every question gets first (``>= 1``; ``>= 2`` recommended so the
            std is defined after the first phase; e.g. ``G // 2``).
        budget_per_question: average completions per question in the step (GRPO's ``G``);
            the step's budget is ``num_questions * budget_per_question``.
        rounds: priority rounds after the first phase (``>= 1``).
        lam: exploration weight ``lambda`` (``>= 0``).
        alpha: confidence level of the Student-t half-width (``0 < alpha < 1``).
        max_per_question: cap on one question's completions in the step (``None``: no
            cap; else ``>= budget_per_question``).
        allocation: ``"proportional"`` or ``"top"`` (:data:`ALLOCATIONS`).
        unknown_std: std assumed for questions with fewer than 2 scored rewards.
    """

    def __init__(
        self,
        n0: int,
        budget_per_question: int,
        rounds: int,
        lam: float = 1.0,
        alpha: float = 0.05,
        max_per_question: Optional[int] = None,
        allocation: str = "proportional",
        unknown_std: float = UNKNOWN_STD,
    ) -> None:
        n0 = _as_int(n0, "n0")
        budget_per_question = _as_int(budget_per_question, "budget_per_question")
        rounds = _as_int(rounds, "rounds")
        if budget_per_question < 1:
            raise ValueError(f"budget_per_question must be >= 1, got {budget_per_question}")
        if n0 < 1:
            raise ValueError(f"n0 must be >= 1 (every question needs a first completion), got {n0}")
        if n0 > budget_per_question:
            raise ValueError(
                f"n0 ({n0}) must be <= budget_per_question ({budget_per_question}): the first phase alone would exceed the step's budget"
            )
        if n0 < 2:
            warnings.warn(
                "n0 = 1: a question's reward std is undefined after the first phase; its "
                "priority falls back to unknown_std until it has 2 scored rewards (n0 >= 2 "
                "is recommended)",
                UserWarning,
                stacklevel=2,
            )
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        lam = float(lam)
        if not (lam >= 0.0 and math.isfinite(lam)):
            raise ValueError(f"lam must be finite and >= 0, got {lam}")
        alpha = _check_alpha(alpha)
        if max_per_question is not None:
            max_per_question = _as_int(max_per_question, "max_per_question")
            if max_per_question < budget_per_question:
                raise ValueError(
                    f"max_per_question ({max_per_question}) must be >= budget_per_question "
                    f"({budget_per_question}), else the budget could not be spent"
                )
        if allocation not in ALLOCATIONS:
            raise ValueError(f"unknown allocation {allocation!r}; expected one of {ALLOCATIONS}")
        unknown_std = float(unknown_std)
        if not (unknown_std >= 0.0 and math.isfinite(unknown_std)):
            raise ValueError(f"unknown_std must be finite and >= 0, got {unknown_std}")
        self.n0 = n0
        self.budget_per_question = budget_per_question
        self.rounds = rounds
        self.lam = lam
        self.alpha = alpha
        self.max_per_question = max_per_question
        self.allocation = allocation
        self.unknown_std = unknown_std

    def __repr__(self) -> str:
        return (
            f"RolloutPlanner(n0={self.n0}, budget_per_question={self.budget_per_question}, "
            f"rounds={self.rounds}, lam={self.lam}, alpha={self.alpha}, "
            f"max_per_question={self.max_per_question}, allocation={self.allocation!r})"
        )

    # -- budget ---------------------------------------------------------------------

    def total_budget(self, num_questions: int) -> int:
        """``num_questions * budget_per_question`` (GRPO's ``B * G``)."""
        num_questions = _as_int(num_questions, "num_questions")
        if num_questions < 0:
            raise ValueError(f"num_questions must be >= 0, got {num_questions}")
        return num_questions * self.budget_per_question

    def initial(self, num_questions: int) -> List[int]:
        """First phase: ``n0`` completions for each of ``num_questions`` questions."""
        self.total_budget(num_questions)  # validates
        return [self.n0] * num_questions

    @staticmethod
    def _drawn(rewards_so_far: Sequence[Sequence[Optional[float]]]) -> np.ndarray:
        return np.array([len(r) for r in rewards_so_far], dtype=np.int64)

    def remaining(self, rewards_so_far: Sequence[Sequence[Optional[float]]]) -> int:
        """Completions left in the step's budget (``>= 0``)."""
        drawn = self._drawn(rewards_so_far)
        return max(0, self.total_budget(len(rewards_so_far)) - int(drawn.sum()))

    # -- priorities -----------------------------------------------------------------

    def _stats(self, rewards_so_far) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        ns, ss = [], []
        for q, r in enumerate(rewards_so_far):
            try:
                n, s = reward_stats(list(r))
            except (TypeError, ValueError) as err:
                raise ValueError(f"rewards_so_far[{q}]: {err}") from None
            ns.append(n)
            ss.append(s)
        s_arr = np.array(ss, dtype=np.float64)
        return s_arr, np.array(ns, dtype=np.int64), self._drawn(rewards_so_far)

    def _priority(self, s, n, drawn, T) -> np.ndarray:
        return priority(
            s,
            n,
            T,
            self.lam,
            self.alpha,
            n_bonus=np.maximum(drawn, 1),
            unknown_std=self.unknown_std,
        )

    def priorities(self, rewards_so_far: Sequence[Sequence[Optional[float]]]) -> np.ndarray:
        """``Pi_q`` of every question given the rewards so far (``float64 [Q]``), for
        metrics; ``T`` = completions drawn so far. A question never sampled gets NaN."""
        s, n, drawn = self._stats(rewards_so_far)
        out = np.full(len(drawn), np.nan)
        seen = drawn > 0
        if seen.any():
            out[seen] = self._priority(s[seen], n[seen], drawn[seen], float(drawn.sum()))
        return out

    # -- rounds ---------------------------------------------------------------------

    def next_round(self, rewards_so_far: Sequence[Sequence[Optional[float]]], round_index: int) -> List[int]:
        """Extra completions per question for priority round ``round_index``.

        ``rewards_so_far[q]``: rewards of every completion drawn so far for question ``q``
        (``None``/NaN: unscored). Round ``r`` hands out ``ceil(R / (rounds - r))`` of the
        ``R`` completions left (the last round: all of them), split by ``allocation``,
        within ``max_per_question``. All zeros once the budget is spent.
        """
        round_index = _as_int(round_index, "round_index")
        if not (0 <= round_index < self.rounds):
            raise ValueError(f"round_index must be in [0, {self.rounds}), got {round_index}")
        num_q = len(rewards_so_far)
        s, n, drawn = self._stats(rewards_so_far)
        left = self.remaining(rewards_so_far)
        if left == 0 or num_q == 0:
            return [0] * num_q
        if np.any(drawn == 0):
            missing = np.flatnonzero(drawn == 0).tolist()
            raise ValueError(
                f"questions {missing[:10]} have no completion yet: call initial() and report "
                "the first phase's rewards before the priority rounds"
            )
        rounds_left = self.rounds - round_index
        share = -(-left // rounds_left)  # ceil
        if self.max_per_question is None:
            room = np.full(num_q, share, dtype=np.int64)
        else:
            room = np.maximum(self.max_per_question - drawn, 0)
        T = float(drawn.sum())
        pi = self._priority(s, n, drawn, T)
        if self.allocation == "proportional":
            alloc = allocate_proportional(share, pi, room)
        else:
            alloc = self._allocate_top(share, s, n, drawn, T, pi, room)
        return [int(a) for a in alloc]

    def _allocate_top(self, share, s, n, drawn, T, pi, room) -> np.ndarray:
        alloc = np.zeros(len(pi), dtype=np.int64)
        # Virtual completions reveal no std: a question with no std yet keeps unknown_std.
        s = np.where(np.isnan(s), self.unknown_std, s)
        heap = [(-float(pi[i]), i) for i in range(len(pi)) if room[i] > 0]
        heapq.heapify(heap)
        while share > 0 and heap:
            _, i = heapq.heappop(heap)
            alloc[i] += 1
            share -= 1
            if alloc[i] < room[i]:
                p = self._priority(s[i], n[i] + alloc[i], drawn[i] + alloc[i], T)
                heapq.heappush(heap, (-float(p), i))
        return alloc
