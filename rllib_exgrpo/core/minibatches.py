"""Exact minibatches for the learner: every row once per epoch, groups shuffled, per learner.

RLlib's ``Learner.update(minibatch_size=...)`` is wrong for GRPO-style batches in two ways
(measured on RLlib 2.60, see docs/training_step.md):

* it shuffles only when ``num_epochs > 1``; our batch lists fresh groups first and replayed
  groups last, so replayed rows all landed in the last minibatch (trained with stale
  ratios and, in ExGRPO's mixed mode, no clip);
* its ``MiniBatchCyclicIterator`` wraps around to fill the last minibatch: 260 rows with
  minibatch 128 gave 3 optimiser steps, the third repeating rows 0-123; and with several
  learners ``minibatch_size`` counts rows per learner of each learner's shard, so 4 learners
  with ``minibatch_size`` = the whole batch made one step over duplicated rows.

:func:`plan_minibatches` replaces that with a plan the algorithm executes one optimiser
step at a time (``LearnerGroup.update`` with one shard per learner and no further
splitting): per epoch the row order is shuffled by whole groups (seeded), cut into
``round(rows / (minibatch_size x learners))`` minibatches of near-equal size (at least
one), and each minibatch into one near-equal shard per learner. So

    optimiser steps per iteration = num_epochs x round(rows / (minibatch_size x num_learners))

and every row is in exactly one minibatch per epoch.

:func:`take_rows` cuts a minibatch out of the padded learner batch and drops the columns
that are padding for every row of it (less compute for short minibatches).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from rllib_exgrpo.core import columns as C

#: How rows are ordered before cutting minibatches.
MINIBATCH_SHUFFLES = ("groups", "rows", "none")


def row_order(group_index: np.ndarray, shuffle: str, rng: np.random.Generator) -> np.ndarray:
    """Row indices in training order.

    * ``"groups"``: whole groups in a random order (rows of a group stay together), so a
      minibatch holds (nearly) complete groups, fresh and replayed mixed; a cut between
      minibatches or learner shards falls on a group boundary when the sizes allow (G
      divides them) and otherwise splits one group (advantages are computed before);
    * ``"rows"``: every row at a random place (TRL shuffles its generation batch so);
    * ``"none"``: the batch order (for debugging and ablations).
    """
    group_index = np.asarray(group_index)
    n = len(group_index)
    if shuffle == "none":
        return np.arange(n)
    if shuffle == "rows":
        return rng.permutation(n)
    if shuffle != "groups":
        raise ValueError(f"minibatch_shuffle must be one of {list(MINIBATCH_SHUFFLES)}, got {shuffle!r}")
    groups = np.unique(group_index)
    position = {g: i for i, g in enumerate(rng.permutation(groups))}
    # Stable sort by the group's new position keeps each group's rows in batch order.
    keys = np.asarray([position[g] for g in group_index], dtype=np.int64)
    return np.argsort(keys, kind="stable")


def num_minibatches(num_rows: int, minibatch_size: int, num_learners: int = 1) -> int:
    """``round(rows / (minibatch_size x learners))``, at least 1 and at most rows / learners."""
    learners = max(1, int(num_learners))
    # Round half up (Python's round() rounds half to even): a minibatch holds at most
    # 1.5 x minibatch_size rows per learner, never fewer than 0.75 x (unless rows are few).
    steps = max(1, int(math.floor(num_rows / float(minibatch_size * learners) + 0.5)))
    return max(1, min(steps, num_rows // learners))


def optimizer_steps_per_iteration(num_rows: int, minibatch_size: int, num_learners: int = 1, num_epochs: int = 1) -> int:
    """Optimiser steps :func:`plan_minibatches` makes of ``num_rows`` rows: ``num_epochs x
    round(rows / (minibatch_size x learners))``; 0 when there are fewer rows than learners.
    ``minibatch_size`` counts rows per learner, so the same recipe on more learners makes
    fewer, larger steps (the memory plan prints this, ``planning/memory.py``)."""
    learners = max(1, int(num_learners))
    if num_rows < learners:
        return 0
    return max(1, int(num_epochs)) * num_minibatches(num_rows, minibatch_size, learners)


def plan_minibatches(
    group_index: Sequence[int],
    *,
    minibatch_size: int,
    num_learners: int = 1,
    num_epochs: int = 1,
    shuffle: str = "groups",
    rng: np.random.Generator,
) -> List[List[List[np.ndarray]]]:
    """The update plan: ``plan[epoch][step][learner]`` = row indices (int64 arrays).

    ``group_index [N]`` is the group of each row; ``minibatch_size`` counts rows per
    learner per optimiser step (RLlib's meaning). Every row appears exactly once per
    epoch; shards of one step differ in size by at most one row. Fewer rows than learners
    give an empty plan (no learner may be left without rows in a data-parallel step).
    """
    group_index = np.asarray(group_index)
    n = len(group_index)
    learners = max(1, int(num_learners))
    if minibatch_size is None or minibatch_size < 1:
        raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size!r}")
    if n < learners:
        return []
    steps = num_minibatches(n, minibatch_size, learners)
    plan = []
    for _ in range(max(1, int(num_epochs))):
        order = row_order(group_index, shuffle, rng)
        plan.append([np.array_split(chunk, learners) for chunk in np.array_split(order, steps)])
    return plan


def take_rows(columns: Dict[str, np.ndarray], rows: np.ndarray) -> Dict[str, np.ndarray]:
    """The learner columns of ``rows``, without columns that are padding for all of them.

    Layout (``columns.py``): ``input_ids``/``attention_mask`` are ``[N, P + R]`` (prompt
    left-padded, completion right-padded), the per-token columns ``[N, R]``.
    """
    return trim_padding({k: v[rows] for k, v in columns.items()})


def _as_numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def real_lengths(columns: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray]:
    """``(prompt_tokens [N], completion_tokens [N])``: each row's real (unpadded) lengths."""
    mask = _as_numpy(columns[C.ATTENTION_MASK]) > 0
    width_r = columns[C.RESPONSE_MASK].shape[1]
    prompt = mask[:, : mask.shape[1] - width_r].sum(axis=1)
    return prompt.astype(np.int64), mask[:, mask.shape[1] - width_r :].sum(axis=1).astype(np.int64)


def trim_padding(columns: Dict[str, Any]) -> Dict[str, Any]:
    """``columns`` (numpy arrays or torch tensors) without the columns that are padding for
    every row: the prompt's leading ones (left padding) and the completion's trailing ones
    (right padding). What is kept is one contiguous slice ``[first prompt column, last
    completion column]``, so a torch tensor comes back as a view (no copy)."""
    mask = _as_numpy(columns[C.ATTENTION_MASK]) > 0
    width_r = columns[C.RESPONSE_MASK].shape[1]
    width_p = mask.shape[1] - width_r
    prompt_real = mask[:, :width_p].any(axis=0)
    first = int(np.argmax(prompt_real)) if prompt_real.any() else width_p
    resp_real = (_as_numpy(columns[C.RESPONSE_MASK]) > 0).any(axis=0)
    last = int(len(resp_real) - np.argmax(resp_real[::-1])) if resp_real.any() else 1
    out = dict(columns)
    for key, value in columns.items():
        shape = getattr(value, "shape", ())
        if len(shape) == 2 and shape[1] == width_p + width_r:
            out[key] = value[:, first : width_p + last]
        elif len(shape) == 2 and shape[1] == width_r:
            out[key] = value[:, :last]
    return out


def plan_micro_batches(
    prompt_tokens: Sequence[int],
    completion_tokens: Sequence[int],
    *,
    max_rows: Optional[int] = None,
    max_tokens: Optional[int] = None,
    packed: bool = False,
) -> List[np.ndarray]:
    """Row indices of each forward/backward pass of one learner's share of a minibatch.

    Every row is in exactly one pass. A pass is padded to its own longest prompt and
    longest completion (:func:`trim_padding`), so it costs ``rows x (max prompt + max
    completion)`` token positions; that is what ``max_tokens`` bounds.

    * ``max_tokens`` None: consecutive slices of ``max_rows`` rows in batch order (one
      pass when ``max_rows`` is None too);
    * ``max_tokens`` set (verl's ``ppo_max_token_len_per_gpu``, counted as padded
      positions since passes are padded, not packed): rows sorted by length, then packed
      greedily, a pass closed when one more row would take its padded size over
      ``max_tokens`` (or its rows over ``max_rows``). A row longer than the budget alone
      gets a pass of its own. Sorting makes each pass's rows of similar length, so little
      of a pass is padding (``benchmarks/learner_padding.py``);
    * ``packed``: the passes are packed without padding (``packing.py``), so a pass costs
      its rows' real tokens: rows longest first, each into the first pass it fits
      (first-fit decreasing), which fills passes close to the budget.
    """
    prompt = np.asarray(prompt_tokens, dtype=np.int64)
    completion = np.asarray(completion_tokens, dtype=np.int64)
    n = len(prompt)
    if n == 0:
        return []
    if max_tokens is None:
        size = n if max_rows is None else max(1, int(max_rows))
        return [np.arange(start, min(start + size, n)) for start in range(0, n, size)]
    if packed:
        return _first_fit_decreasing(prompt + completion, max_tokens, max_rows)
    # Longest completion first (then longest prompt): a pass's width is set by its first row.
    order = np.lexsort((-prompt, -completion))
    passes: List[np.ndarray] = []
    current: List[int] = []
    wide_p = wide_c = 0
    for i in order:
        p, c = max(wide_p, int(prompt[i])), max(wide_c, int(completion[i]))
        full = max_rows is not None and len(current) >= max_rows
        if current and (full or (len(current) + 1) * (p + c) > max_tokens):
            passes.append(np.asarray(current, dtype=np.int64))
            current, p, c = [], int(prompt[i]), int(completion[i])
        current.append(int(i))
        wide_p, wide_c = p, c
    passes.append(np.asarray(current, dtype=np.int64))
    return passes


def _first_fit_decreasing(lengths: np.ndarray, max_tokens: int, max_rows: Optional[int]) -> List[np.ndarray]:
    passes: List[List[int]] = []
    room: List[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        need = int(lengths[i])
        for k, left in enumerate(room):
            if need <= left and (max_rows is None or len(passes[k]) < max_rows):
                passes[k].append(int(i))
                room[k] -= need
                break
        else:  # a new pass (a row over the budget alone gets one of its own)
            passes.append([int(i)])
            room.append(max_tokens - need)
    return [np.asarray(sorted(p), dtype=np.int64) for p in passes]


def padded_positions(
    prompt_tokens: Sequence[int], completion_tokens: Sequence[int], passes: Sequence[np.ndarray], packed: bool = False
) -> int:
    """Token positions the passes compute: ``sum over passes of rows x (max prompt + max
    completion)`` (the real tokens are ``sum(prompt) + sum(completion)``); packed passes
    compute exactly the real tokens."""
    prompt, completion = np.asarray(prompt_tokens), np.asarray(completion_tokens)
    if packed:
        return int(prompt.sum() + completion.sum())
    return int(sum(len(rows) * (prompt[rows].max() + completion[rows].max()) for rows in passes if len(rows)))


def shard_by_tokens(lengths: Sequence[int], parts: int) -> List[List[int]]:
    """Row indices sorted by length, cut into at most ``parts`` contiguous non-empty shards of
    about equal total length (the cut after the row where the running total passes each
    ``j / parts`` of the whole)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    total = float(sum(lengths)) or 1.0
    shards: List[List[int]] = [[] for _ in range(max(1, parts))]
    running = 0.0
    for i in order:
        shard = min(int(running / total * len(shards)), len(shards) - 1)
        shards[shard].append(i)
        running += lengths[i]
    return [s for s in shards if s]
