"""ExGRPO's experience buffer: correctness buckets, Gaussian bucket sampling, retired set.

Pure Python/numpy (no torch, no RLlib), so the algorithm, the tests and the benchmark use
it directly. The rules follow ``docs/ALGORITHMS.md`` section 2 (ExGRPO,
arXiv 2510.02245; official code: github ElliottYan/LUFFY, folder ``ExGRPO/``). The code
is our own.

Experience management (:meth:`ExperienceBuffer.update_group`)
--------------------------------------------------------------
After each step the algorithm reports every question's group: ``num_correct`` (k) of
``group_size`` completions were verified correct, plus the correct trajectories (response
token ids and the behaviour log-probs recorded when they were sampled).

* ``k == group_size`` (all correct; for a replayed question the replayed trajectory counts
  in the group): the question is **retired**: removed from the pool (its trajectories are
  dropped) and added to the retired set, which the fresh-question sampler excludes.
  Returns ``"retired"``.
* The retired set is final: a later ``update_group`` for a retired question changes
  nothing and returns ``"retired"`` again (official: retired questions are dropped from
  the data set, so they never come back).
* ``k == 0``: nothing to store. A pooled question keeps its old bucket and trajectories
  (official behaviour) -> ``"unchanged"``; a question not in the pool stays out ->
  ``"skipped"``.
* ``0 < k < group_size``: bucket = the latest correctness (see :func:`bucket_index`);
  the distinct correct trajectories are stored (duplicates by token ids, against the
  stored ones and within the group, are dropped). A new question -> ``"added"``; a pooled
  one -> ``"updated"`` (bucket moved to the latest correctness, new distinct trajectories
  appended). A new question with no trajectory to store -> ``"skipped"``.

``group_size`` may differ from the buffer's ``G`` (XRPO gives some questions more
completions): the bucket is chosen by *rate*, ``floor(k / group_size * G + 0.5)`` (round
half up) clipped to ``1..G-1``, so a partly solved question never lands in the 0 or G
bucket. With ``group_size == G`` this is just ``k``.

Bounded memory
--------------
``capacity`` bounds the number of stored trajectories. When a new trajectory would exceed
it, **one trajectory is evicted first: the oldest trajectory of the question holding the
most trajectories**; among questions tied on that count, the one that reached that count
first (FIFO). A question whose last trajectory is evicted leaves the pool (it is *not*
retired; a later group can add it again). The question being updated is never dropped by
its own update (its new trajectory replaces the evicted one). Optionally,
``max_trajectories_per_question`` caps one question's trajectories (oldest dropped first);
the official code has no such cap, default ``None``.

Storage is compact: token ids ``int32``; log-probs ``float16`` by default (``"bfloat16"``
is stored as the upper 16 bits of the float32, ``uint16``, rounded to nearest even;
``"float32"`` is exact). float16 keeps ~3 significant digits (a log-prob of -10 is stored
to within ~0.004) and saturates at -65504. Prompt ids are stored once per question (int32)
so that the stored trajectories can be re-scored later. Stored arrays are read-only.

Sampling questions (:meth:`ExperienceBuffer.sample_questions`)
--------------------------------------------------------------
``bucket_weighting``:

* ``"gaussian"`` (official default): bucket ``k`` (1..G-1) has weight
  ``w_k = NormalPdf(k / G; mu, sigma)`` (mu = 0.5, sigma = 0.125; the official code writes
  it on the count scale, mu = G/2, sigma = 1 for G = 8, which is the same distribution),
  normalised over the *non-empty* buckets. Per-bucket counts are drawn multinomially.
  **Overflow rule**: when a bucket's count exceeds its number of questions, the bucket
  gives all its questions and the excess is re-drawn multinomially among the buckets that
  still have spare questions, with their Gaussian weights renormalised over those buckets;
  repeated until nothing overflows (a deterministic fill in decreasing weight order is the
  fallback after 64 rounds, never reached in practice).
* ``"uniform"`` (the paper's "w/o bucket weighting" ablation): **uniform over pooled
  questions**, i.e. a simple random sample without replacement of the whole pool (bucket
  counts are drawn from the multivariate hypergeometric distribution, so no overflow
  can happen).
* ``"uniform_buckets"`` (extra, not official): every non-empty bucket has equal weight,
  with the Gaussian mode's multinomial + overflow rule.
* ``"linear"``, ``"sqrt"``, ``"linear_clip"``: named by the official code, but their exact
  definitions were not available to us, so they raise ``ValueError`` rather than guess
  (:data:`UNIMPLEMENTED_BUCKET_WEIGHTINGS`).

Inside a bucket, questions are drawn uniformly without replacement (Floyd's algorithm,
O(count) time). Each bucket keeps a list of its questions plus a position map (O(1)
add/remove by swap-remove), so the cost per sampled question does not grow with the pool.
The returned ids are distinct, ``min(n, len(buffer))`` of them, in random order.
``exclude`` (not official; the manager's ``replay_cooldown_steps``) takes questions out of
their buckets for one draw; with nothing excluded the draw is exactly the one above.

Choosing the trajectory (:func:`choose_trajectory`)
---------------------------------------------------
The algorithm re-scores every stored trajectory of a selected question under the current
policy and passes per-trajectory means; :data:`TRAJECTORY_SELECTION`:
``"lowest_entropy"`` (official: argmin of the mean token entropy over the response tokens;
the intended mean, not the official code's pad-masking slip), ``"highest_entropy"`` (the
paper's ablation), ``"highest_logp"`` /
``"lowest_logp"`` (mean token log-prob), ``"random"``. Ties go to the lowest index.

State
-----
:meth:`ExperienceBuffer.get_state` returns plain Python/numpy (picklable): configuration,
questions, per-bucket member order, eviction order, retired set, counters and the RNG
state, so that :meth:`ExperienceBuffer.set_state` / :meth:`ExperienceBuffer.from_state`
rebuild a buffer whose subsequent samples and evictions are identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Dict, Iterator, KeysView, List, Optional, Sequence, Tuple, Union

import numpy as np

from rllib_exgrpo.core.registry import Registry

__all__ = [
    "BUCKET_WEIGHTING",
    "UNIMPLEMENTED_BUCKET_WEIGHTINGS",
    "TRAJECTORY_SELECTION",
    "register_bucket_weighting",
    "register_trajectory_selection",
    "REPLAY_CONTENTS",
    "LOGP_DTYPES",
    "UPDATE_RESULTS",
    "StoredTrajectory",
    "ExperienceBuffer",
    "bucket_index",
    "bucket_weights",
    "choose_trajectory",
    "mean_over_tokens",
    "encode_logp",
    "decode_logp",
]

#: Bucket weighting modes (``bucket_weighting``), by name: a function ``(G, mu, sigma)``
#: returning the unnormalised log-weights ``[G - 1]`` of buckets 1..G-1, or None for a mode
#: that draws uniformly over questions instead (``"uniform"``). A user package adds one with
#: ``@register_bucket_weighting("name")`` (docs/ARCHITECTURE.md, "Extending").
BUCKET_WEIGHTING: Registry = Registry("bucket_weighting")
register_bucket_weighting = BUCKET_WEIGHTING.register
#: Official mode names whose definitions we do not have: selecting one raises ValueError.
UNIMPLEMENTED_BUCKET_WEIGHTINGS: Tuple[str, ...] = ("linear", "sqrt", "linear_clip")
#: Trajectory selection modes of :func:`choose_trajectory`, by name: a function
#: ``(trajectory_stats, rng) -> index`` (``@register_trajectory_selection("name")``).
TRAJECTORY_SELECTION: Registry = Registry("trajectory_selection")
register_trajectory_selection = TRAJECTORY_SELECTION.register
#: What a replayed question brings back: its stored trajectory plus G - 1 fresh samples
#: (ExGRPO), or the question alone with G fresh samples (the prompt-replay control).
REPLAY_CONTENTS: Tuple[str, ...] = ("trajectory", "prompt")
#: Storage formats of the recorded log-probs.
LOGP_DTYPES: Tuple[str, ...] = ("float16", "bfloat16", "float32")
#: Return values of :meth:`ExperienceBuffer.update_group`.
UPDATE_RESULTS: Tuple[str, ...] = ("added", "updated", "unchanged", "skipped", "retired")

_STATE_VERSION = 1
_FLOAT16_MAX = float(np.finfo(np.float16).max)
_MAX_REDRAW_ROUNDS = 64


# --------------------------------------------------------------------------------------
# Log-prob encoding
# --------------------------------------------------------------------------------------


def _storage_dtype(logp_dtype: str) -> np.dtype:
    if logp_dtype == "float16":
        return np.dtype(np.float16)
    if logp_dtype == "bfloat16":
        return np.dtype(np.uint16)
    if logp_dtype == "float32":
        return np.dtype(np.float32)
    raise ValueError(f"unknown logp_dtype {logp_dtype!r}; expected one of {LOGP_DTYPES}")


def encode_logp(logp: Any, logp_dtype: str = "float16") -> np.ndarray:
    """Encode log-probs ``[R]`` for storage in ``logp_dtype`` (see :data:`LOGP_DTYPES`).

    ``float16`` clips to the finite float16 range; ``bfloat16`` returns ``uint16`` bits
    (round to nearest even). A ``uint16`` input is taken as bfloat16 bits already.
    """
    arr = np.asarray(logp)
    target = _storage_dtype(logp_dtype)
    if arr.dtype == np.uint16:
        if logp_dtype == "bfloat16":
            return arr.copy()
        arr = decode_logp(arr)
    if logp_dtype == "float16":
        if arr.dtype == np.float16:
            return arr.copy()
        return np.clip(arr.astype(np.float32), -_FLOAT16_MAX, _FLOAT16_MAX).astype(np.float16)
    if logp_dtype == "float32":
        return arr.astype(np.float32, copy=True)
    # bfloat16: keep the upper 16 bits of the float32, rounding to nearest even.
    x = np.ascontiguousarray(arr, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out.astype(target, copy=False)


def decode_logp(stored: np.ndarray) -> np.ndarray:
    """Stored log-probs -> float32 ``[R]`` (``uint16`` is read as bfloat16 bits)."""
    stored = np.asarray(stored)
    if stored.dtype == np.uint16:
        return (stored.astype(np.uint32) << 16).view(np.float32)
    return stored.astype(np.float32)


# --------------------------------------------------------------------------------------
# Stored trajectory
# --------------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class StoredTrajectory:
    """One stored correct trajectory of a pooled question.

    ``completion_ids``: int32 ``[R]`` response token ids (no padding);
    ``logp``: ``[R]`` behaviour log-probs recorded at sampling time, in the buffer's
    storage format (float16 by default; ``uint16`` = bfloat16 bits; float32);
    ``step_added``: training step at which it was stored.
    Both arrays are read-only.
    """

    completion_ids: np.ndarray
    logp: np.ndarray
    step_added: int

    @property
    def num_tokens(self) -> int:
        return int(self.completion_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.completion_ids.nbytes + self.logp.nbytes)

    def logp_float32(self) -> np.ndarray:
        """The recorded log-probs decoded to float32 ``[R]``."""
        return decode_logp(self.logp)


class _Question:
    """Internal per-question record."""

    __slots__ = ("bucket", "prompt_ids", "trajs", "step_added", "step_updated")

    def __init__(self, bucket: int, prompt_ids: np.ndarray, step: int):
        self.bucket = bucket
        self.prompt_ids = prompt_ids
        self.trajs: List[StoredTrajectory] = []  # oldest first
        self.step_added = step
        self.step_updated = step


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


# --------------------------------------------------------------------------------------
# Bucket rules
# --------------------------------------------------------------------------------------


def bucket_index(num_correct: int, group_size: int, G: int) -> int:
    """Bucket (1..G-1) of a partly solved group: ``floor(k / group_size * G + 0.5)``
    clipped to ``1..G-1``. Requires ``0 < num_correct < group_size``."""
    if not 0 < num_correct < group_size:
        raise ValueError(f"bucket_index needs 0 < num_correct < group_size, got {num_correct}/{group_size}")
    if group_size == G:
        return int(num_correct)
    # Exact rational arithmetic: floor((2*k*G + group_size) / (2*group_size)).
    k = (2 * num_correct * G + group_size) // (2 * group_size)
    return int(min(max(k, 1), G - 1))


@register_bucket_weighting("gaussian")
def gaussian_bucket_weights(G: int, mu: float, sigma: float) -> np.ndarray:
    """``log NormalPdf(k/G; mu, sigma)`` up to a constant, for k = 1..G-1 (official)."""
    k = np.arange(1, G)
    return -0.5 * ((k / G - mu) / sigma) ** 2


@register_bucket_weighting("uniform")
def uniform_over_questions(G: int, mu: float, sigma: float) -> None:
    """No per-bucket weight: every stored question is equally likely."""
    return None


@register_bucket_weighting("uniform_buckets")
def uniform_bucket_weights(G: int, mu: float, sigma: float) -> np.ndarray:
    """Every bucket 1..G-1 equally likely, whatever its size."""
    return np.zeros(G - 1)


def bucket_weighting_fn(mode: str):
    """The registered function of ``mode``; ValueError naming the choices otherwise."""
    if mode in UNIMPLEMENTED_BUCKET_WEIGHTINGS and mode not in BUCKET_WEIGHTING:
        raise ValueError(
            f"bucket_weighting {mode!r} is an official ExGRPO mode name, but its exact "
            f"definition was not available to this implementation, so it is not implemented "
            f"(implemented: {list(BUCKET_WEIGHTING.names())})"
        )
    return BUCKET_WEIGHTING.get(mode)


def bucket_weights(G: int, mode: str = "gaussian", mu: float = 0.5, sigma: float = 0.125) -> Optional[np.ndarray]:
    """Unnormalised log-weights ``[G+1]`` of buckets 0..G (0 and G are ``-inf``), or None
    for a mode that draws uniformly over questions (``"uniform"``)."""
    inner = bucket_weighting_fn(mode)(int(G), float(mu), float(sigma))
    if inner is None:
        return None
    inner = np.asarray(inner, dtype=np.float64)
    if inner.shape != (G - 1,):
        raise ValueError(f"bucket_weighting {mode!r} returned shape {inner.shape}, expected ({G - 1},)")
    logw = np.full(G + 1, -np.inf)
    logw[1:G] = inner
    return logw


# --------------------------------------------------------------------------------------
# The buffer
# --------------------------------------------------------------------------------------

TrajectoryLike = Union[Tuple[Any, Any], StoredTrajectory]


class ExperienceBuffer:
    """Prioritised experience pool of ExGRPO (see the module docstring for the rules).

    Args:
        group_size: G, the number of completions of a regular group; buckets are 1..G-1.
        capacity: maximum number of stored trajectories (eviction rule in the module doc).
        bucket_weighting: a name registered in :data:`BUCKET_WEIGHTING`.
        mu, sigma: Gaussian bucket weighting on the rate scale k/G.
        logp_dtype: one of :data:`LOGP_DTYPES`.
        seed: seed of the buffer's own numpy Generator (part of the state).
        max_trajectories_per_question: optional per-question cap (``None``: no cap).
    """

    def __init__(
        self,
        group_size: int,
        *,
        capacity: int = 100_000,
        bucket_weighting: str = "gaussian",
        mu: float = 0.5,
        sigma: float = 0.125,
        logp_dtype: str = "float16",
        seed: int = 0,
        max_trajectories_per_question: Optional[int] = None,
    ):
        if int(group_size) < 2:
            raise ValueError(f"group_size must be >= 2 (buckets are 1..G-1), got {group_size}")
        if int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not sigma > 0:
            raise ValueError(f"sigma must be > 0, got {sigma}")
        if max_trajectories_per_question is not None and int(max_trajectories_per_question) < 1:
            raise ValueError("max_trajectories_per_question must be >= 1 or None")
        bucket_weighting_fn(bucket_weighting)  # an unknown name fails here, naming the choices
        _storage_dtype(logp_dtype)
        self.group_size = int(group_size)
        self.capacity = int(capacity)
        self.bucket_weighting = bucket_weighting
        self.mu = float(mu)
        self.sigma = float(sigma)
        self.logp_dtype = logp_dtype
        self.seed = seed
        self.max_trajectories_per_question = None if max_trajectories_per_question is None else int(max_trajectories_per_question)
        #: None: draws are uniform over questions (see BUCKET_WEIGHTING).
        self._logw = bucket_weights(self.group_size, bucket_weighting, self.mu, self.sigma)
        self._rng = np.random.default_rng(seed)
        self._reset_storage()

    def _reset_storage(self) -> None:
        G = self.group_size
        self._questions: Dict[str, _Question] = {}
        self._members: List[List[str]] = [[] for _ in range(G + 1)]  # bucket -> question ids
        self._pos: Dict[str, int] = {}  # question id -> index in its bucket's list
        # count -> question ids holding exactly that many trajectories, in the order they
        # reached it (dict as an ordered set). Index 0 is unused.
        self._by_count: List[Dict[str, None]] = [{}]
        self._max_count = 0
        self._retired: Dict[str, int] = {}  # question id -> step retired
        self._num_trajectories = 0
        self._num_tokens = 0
        self._traj_nbytes = 0
        self._prompt_nbytes = 0
        self._counters = {
            "num_evicted_trajectories": 0,
            "num_evicted_questions": 0,
            "num_duplicates_dropped": 0,
        }

    # ---------------------------------------------------------------- read-only views

    def __len__(self) -> int:
        return len(self._questions)

    def __contains__(self, question_id: object) -> bool:
        return question_id in self._questions

    def __iter__(self) -> Iterator[str]:
        return iter(self._questions)

    @property
    def num_trajectories(self) -> int:
        return self._num_trajectories

    @property
    def num_tokens(self) -> int:
        """Response tokens held by the stored trajectories."""
        return self._num_tokens

    @property
    def retired(self) -> KeysView:
        """Read-only set-like view of the retired question ids (supports ``in``, ``len``)."""
        return self._retired.keys()

    @property
    def num_retired(self) -> int:
        return len(self._retired)

    def is_retired(self, question_id: str) -> bool:
        return question_id in self._retired

    def bucket_of(self, question_id: str) -> int:
        """Bucket (1..G-1) of a pooled question; KeyError if it is not pooled."""
        return self._questions[question_id].bucket

    def trajectories(self, question_id: str) -> List[StoredTrajectory]:
        """Stored trajectories of a pooled question, oldest first; KeyError if not pooled."""
        return list(self._questions[question_id].trajs)

    def prompt_ids(self, question_id: str) -> np.ndarray:
        """int32 prompt token ids of a pooled question (read-only); KeyError if not pooled."""
        return self._questions[question_id].prompt_ids

    def bucket_histogram(self) -> Dict[int, int]:
        """``{k: number of pooled questions in bucket k}`` for k = 1..G-1."""
        return {k: len(self._members[k]) for k in range(1, self.group_size)}

    def nbytes(self) -> int:
        """Bytes held by the stored arrays: completion ids + log-probs + prompt ids."""
        return self._traj_nbytes + self._prompt_nbytes

    def bucket_probabilities(self) -> Dict[int, float]:
        """Probability that one draw (``sample_questions(1)``) lands in bucket k."""
        sizes = self._sizes()
        if sizes.sum() == 0:
            return {k: 0.0 for k in range(1, self.group_size)}
        if self._logw is None:
            p = sizes / sizes.sum()
        else:
            p = self._probs(sizes > 0)
        return {k: float(p[k - 1]) for k in range(1, self.group_size)}

    def stats(self) -> Dict[str, Any]:
        """Metrics for logging (pool size, histogram, retired count, memory...)."""
        n_tok = self._num_tokens
        return {
            "pool_size": len(self._questions),
            "num_trajectories": self._num_trajectories,
            "num_retired": len(self._retired),
            "bucket_histogram": self.bucket_histogram(),
            "num_tokens": n_tok,
            "nbytes": self.nbytes(),
            "trajectory_nbytes": self._traj_nbytes,
            "prompt_nbytes": self._prompt_nbytes,
            "bytes_per_token": (self._traj_nbytes / n_tok) if n_tok else float("nan"),
            "capacity": self.capacity,
            "capacity_used": self._num_trajectories / self.capacity,
            "mean_trajectories_per_question": (self._num_trajectories / len(self._questions) if self._questions else 0.0),
            **self._counters,
        }

    # ---------------------------------------------------------------- update rules

    def update_group(
        self,
        question_id: str,
        prompt_ids: Any,
        num_correct: int,
        group_size: int,
        correct_trajectories: Sequence[TrajectoryLike],
        step: int,
    ) -> str:
        """Apply ExGRPO's experience-management rules to one question's latest group.

        ``correct_trajectories``: ``(completion_ids [R], logp [R])`` pairs (or
        :class:`StoredTrajectory`) of the group's correct completions, response tokens only.
        Returns one of :data:`UPDATE_RESULTS` (rules in the module docstring).
        """
        num_correct = int(num_correct)
        group_size = int(group_size)
        if group_size < 1 or not 0 <= num_correct <= group_size:
            raise ValueError(f"need 0 <= num_correct <= group_size >= 1, got {num_correct}/{group_size}")
        if question_id in self._retired:
            return "retired"
        entry = self._questions.get(question_id)
        if num_correct == group_size:
            if entry is not None:
                self._remove_question(question_id)
            self._retired[question_id] = int(step)
            return "retired"
        if num_correct == 0:
            return "unchanged" if entry is not None else "skipped"

        bucket = bucket_index(num_correct, group_size, self.group_size)
        trajs = [self._normalise(t, step) for t in correct_trajectories]
        if entry is None:
            if not trajs:
                return "skipped"
            prompt = _readonly(np.array(np.asarray(prompt_ids).reshape(-1), dtype=np.int32))
            entry = _Question(bucket, prompt, int(step))
            self._questions[question_id] = entry
            self._bucket_insert(question_id, bucket)
            self._prompt_nbytes += prompt.nbytes
            for traj in trajs:
                self._append(question_id, entry, traj)
            if not entry.trajs:  # cannot happen with capacity >= 1; defensive
                self._remove_question(question_id)
                return "skipped"
            return "added"

        if entry.bucket != bucket:
            self._bucket_remove(question_id, entry.bucket)
            entry.bucket = bucket
            self._bucket_insert(question_id, bucket)
        entry.step_updated = int(step)
        for traj in trajs:
            self._append(question_id, entry, traj)
        return "updated"

    def discard(self, question_id: str) -> bool:
        """Remove a question from the pool without retiring it; False if it was not pooled."""
        if question_id not in self._questions:
            return False
        self._remove_question(question_id)
        return True

    def _normalise(self, traj: TrajectoryLike, step: int) -> StoredTrajectory:
        if isinstance(traj, StoredTrajectory):
            ids, logp, step_added = traj.completion_ids, traj.logp, traj.step_added
        else:
            ids, logp = traj
            step_added = step
        ids = np.asarray(ids).reshape(-1)
        logp = np.asarray(logp).reshape(-1)
        if ids.shape != logp.shape:
            raise ValueError(f"completion_ids and logp lengths differ: {ids.shape[0]} vs {logp.shape[0]}")
        ids32 = np.array(ids, dtype=np.int32)
        stored_logp = encode_logp(logp, self.logp_dtype)
        return StoredTrajectory(_readonly(ids32), _readonly(stored_logp), int(step_added))

    def _append(self, qid: str, entry: _Question, traj: StoredTrajectory) -> None:
        # Dedupe by token ids. A question holds few trajectories, so a scan comparing the
        # lengths first is cheaper overall than a per-question hash table (memory).
        ids = traj.completion_ids
        n_ids = ids.shape[0]
        if any(t.completion_ids.shape[0] == n_ids and np.array_equal(t.completion_ids, ids) for t in entry.trajs):
            self._counters["num_duplicates_dropped"] += 1
            return
        cap = self.max_trajectories_per_question
        if cap is not None and len(entry.trajs) >= cap:
            self._evict_oldest(qid, entry, drop_empty=False)
        if self._num_trajectories >= self.capacity:
            self._evict_one(protect=qid)
        old = len(entry.trajs)
        entry.trajs.append(traj)
        self._num_trajectories += 1
        self._num_tokens += traj.num_tokens
        self._traj_nbytes += traj.nbytes
        self._count_move(qid, old, old + 1)

    def _evict_one(self, protect: str) -> None:
        while self._max_count > 0 and not self._by_count[self._max_count]:
            self._max_count -= 1
        victim = next(iter(self._by_count[self._max_count]))
        self._evict_oldest(victim, self._questions[victim], drop_empty=(victim != protect))

    def _evict_oldest(self, qid: str, entry: _Question, *, drop_empty: bool) -> None:
        traj = entry.trajs.pop(0)
        self._num_trajectories -= 1
        self._num_tokens -= traj.num_tokens
        self._traj_nbytes -= traj.nbytes
        self._counters["num_evicted_trajectories"] += 1
        n = len(entry.trajs)
        self._count_move(qid, n + 1, n)
        if n == 0 and drop_empty:
            self._counters["num_evicted_questions"] += 1
            self._remove_question(qid)

    def _remove_question(self, qid: str) -> None:
        entry = self._questions.pop(qid)
        self._bucket_remove(qid, entry.bucket)
        n = len(entry.trajs)
        if n:
            self._count_move(qid, n, 0)
        for traj in entry.trajs:
            self._num_tokens -= traj.num_tokens
            self._traj_nbytes -= traj.nbytes
        self._num_trajectories -= n
        self._prompt_nbytes -= entry.prompt_ids.nbytes

    def _count_move(self, qid: str, old: int, new: int) -> None:
        if old > 0:
            del self._by_count[old][qid]
        if new > 0:
            while len(self._by_count) <= new:
                self._by_count.append({})
            self._by_count[new][qid] = None
            if new > self._max_count:
                self._max_count = new

    def _bucket_insert(self, qid: str, bucket: int) -> None:
        members = self._members[bucket]
        self._pos[qid] = len(members)
        members.append(qid)

    def _bucket_remove(self, qid: str, bucket: int) -> None:
        members = self._members[bucket]
        i = self._pos.pop(qid)
        last = members.pop()
        if last != qid:
            members[i] = last
            self._pos[last] = i

    # ---------------------------------------------------------------- sampling

    def _sizes(self, members: Optional[List[List[str]]] = None) -> np.ndarray:
        """Questions per bucket 1..G-1 (of ``members``, default the pool's bucket lists)."""
        members = self._members if members is None else members
        return np.fromiter(
            (len(members[k]) for k in range(1, self.group_size)),
            dtype=np.int64,
            count=self.group_size - 1,
        )

    def _probs(self, allowed: np.ndarray) -> np.ndarray:
        """Bucket weights (buckets 1..G-1) normalised over ``allowed`` buckets."""
        logw = self._logw[1 : self.group_size]
        masked = np.where(allowed, logw, -np.inf)
        w = np.exp(masked - masked.max())
        return w / w.sum()

    def sample_questions(self, n: int, exclude: Optional[Collection[str]] = None) -> List[str]:
        """Draw ``min(n, eligible)`` distinct pooled question ids (rules in the module doc).

        ``exclude``: pooled questions that may not be drawn this time (the manager's replay
        cooldown); the draw runs over the other questions as if the excluded ones were not
        in their buckets. With nothing excluded, the draw (and its random stream) is exactly
        the official one.
        """
        members = self._members
        if exclude:
            members = [[q for q in m if q not in exclude] for m in self._members]
        sizes = self._sizes(members)
        n = min(int(n), int(sizes.sum()))
        if n <= 0:
            return []
        rng = self._rng
        if self._logw is None:
            counts = rng.multivariate_hypergeometric(sizes, n)
        else:
            counts = rng.multinomial(n, self._probs(sizes > 0))
            if np.any(counts > sizes):
                counts = self._redistribute(counts, sizes)
        out: List[str] = []
        for i in np.flatnonzero(counts):
            out.extend(self._draw_from_bucket(members[int(i) + 1], int(counts[i])))
        if len(out) > 1:
            order = rng.permutation(len(out))
            out = [out[j] for j in order]
        return out

    def _redistribute(self, counts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        counts = counts.copy()
        for _ in range(_MAX_REDRAW_ROUNDS):
            excess = int(np.maximum(counts - sizes, 0).sum())
            if excess == 0:
                return counts
            np.minimum(counts, sizes, out=counts)
            counts += self._rng.multinomial(excess, self._probs(sizes > counts))
        # Fallback (practically unreachable): fill the excess deterministically, heaviest
        # bucket with spare questions first.
        excess = int(np.maximum(counts - sizes, 0).sum())
        np.minimum(counts, sizes, out=counts)
        logw = self._logw[1 : self.group_size]
        for i in np.argsort(-logw, kind="stable"):
            take = min(excess, int(sizes[i] - counts[i]))
            counts[i] += take
            excess -= take
        return counts

    def _draw_from_bucket(self, members: List[str], k: int) -> List[str]:
        """A uniform ``k``-subset of one bucket's (eligible) ``members``."""
        m = len(members)
        if k >= m:
            return list(members)
        # Floyd's algorithm: a uniform k-subset of range(m) in O(k).
        u = self._rng.random(k)
        chosen: Dict[int, None] = {}
        for i, j in enumerate(range(m - k, m)):
            t = int(u[i] * (j + 1))
            if t > j:
                t = j
            chosen[j if t in chosen else t] = None
        return [members[t] for t in chosen]

    # ---------------------------------------------------------------- state

    def _config(self) -> Dict[str, Any]:
        return {
            "group_size": self.group_size,
            "capacity": self.capacity,
            "bucket_weighting": self.bucket_weighting,
            "mu": self.mu,
            "sigma": self.sigma,
            "logp_dtype": self.logp_dtype,
            "seed": self.seed,
            "max_trajectories_per_question": self.max_trajectories_per_question,
        }

    def get_state(self) -> Dict[str, Any]:
        """Plain Python/numpy snapshot (picklable). Arrays are shared read-only views."""
        questions = {
            qid: {
                "bucket": e.bucket,
                "prompt_ids": e.prompt_ids,
                "step_added": e.step_added,
                "step_updated": e.step_updated,
                "trajectories": [(t.completion_ids, t.logp, t.step_added) for t in e.trajs],
            }
            for qid, e in self._questions.items()
        }
        return {
            "version": _STATE_VERSION,
            "config": self._config(),
            "questions": questions,
            "bucket_members": [list(m) for m in self._members],
            "count_order": [list(d) for d in self._by_count],
            "retired": dict(self._retired),
            "counters": dict(self._counters),
            "rng_state": self._rng.bit_generator.state,
        }

    def set_state(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`get_state` snapshot exactly (configuration included)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported buffer state version {state.get('version')!r}")
        cfg = state["config"]
        self.__init__(
            cfg["group_size"],
            capacity=cfg["capacity"],
            bucket_weighting=cfg["bucket_weighting"],
            mu=cfg["mu"],
            sigma=cfg["sigma"],
            logp_dtype=cfg["logp_dtype"],
            seed=cfg["seed"],
            max_trajectories_per_question=cfg.get("max_trajectories_per_question"),
        )
        store = _storage_dtype(self.logp_dtype)
        for qid, q in state["questions"].items():
            prompt = _readonly(np.array(q["prompt_ids"], dtype=np.int32).reshape(-1))
            entry = _Question(int(q["bucket"]), prompt, int(q["step_added"]))
            entry.step_updated = int(q["step_updated"])
            for ids, logp, step_added in q["trajectories"]:
                traj = StoredTrajectory(
                    _readonly(np.array(ids, dtype=np.int32).reshape(-1)),
                    _readonly(np.array(logp, dtype=store).reshape(-1)),
                    int(step_added),
                )
                entry.trajs.append(traj)
                self._num_trajectories += 1
                self._num_tokens += traj.num_tokens
                self._traj_nbytes += traj.nbytes
            if not entry.trajs:
                raise ValueError(f"buffer state: pooled question {qid!r} has no trajectory")
            self._questions[qid] = entry
            self._prompt_nbytes += prompt.nbytes
        members = state["bucket_members"]
        if len(members) != self.group_size + 1:
            raise ValueError("buffer state: bucket_members does not match group_size")
        for k, ids in enumerate(members):
            for qid in ids:
                if self._questions[qid].bucket != k:
                    raise ValueError(f"buffer state: {qid!r} listed in bucket {k}")
                self._bucket_insert(qid, k)
        if len(self._pos) != len(self._questions):
            raise ValueError("buffer state: bucket lists do not cover the pooled questions")
        self._by_count = [dict.fromkeys(ids) for ids in state["count_order"]] or [{}]
        listed = 0
        for c, d in enumerate(self._by_count):
            for qid in d:
                if c == 0 or len(self._questions[qid].trajs) != c:
                    raise ValueError(f"buffer state: count_order inconsistent for {qid!r}")
            listed += len(d)
        if listed != len(self._questions):
            raise ValueError("buffer state: count_order does not cover the pooled questions")
        self._max_count = len(self._by_count) - 1
        self._retired = {qid: int(s) for qid, s in dict(state["retired"]).items()}
        self._counters.update(state.get("counters", {}))
        self._rng.bit_generator.state = state["rng_state"]

    @classmethod
    def from_state(cls, state: Dict[str, Any]) -> "ExperienceBuffer":
        cfg = state["config"]
        buf = cls(cfg["group_size"])
        buf.set_state(state)
        return buf

    def __repr__(self) -> str:
        return (
            f"ExperienceBuffer(G={self.group_size}, pooled={len(self)}, "
            f"trajectories={self._num_trajectories}/{self.capacity}, retired={self.num_retired}, "
            f"weighting={self.bucket_weighting!r})"
        )


# --------------------------------------------------------------------------------------
# Trajectory selection
# --------------------------------------------------------------------------------------


def mean_over_tokens(values_per_traj: Any, mask: Any = None) -> np.ndarray:
    """Per-trajectory mean of per-token values over the response tokens -> float64 ``[N]``.

    ``values_per_traj``: a sequence of 1-D arrays (one per trajectory, response tokens
    only), or a padded 2-D array ``[N, T]`` together with ``mask`` ``[N, T]`` (1 = response
    token). A trajectory with no token gets NaN. Torch tensors must be converted first.
    """
    if mask is not None:
        vals = np.asarray(values_per_traj, dtype=np.float64)
        m = np.asarray(mask).astype(np.float64)
        if vals.shape != m.shape or vals.ndim != 2:
            raise ValueError(f"values and mask must both be [N, T], got {vals.shape} and {m.shape}")
        counts = m.sum(axis=1)
        sums = np.where(m > 0, vals, 0.0).sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    out = np.empty(len(values_per_traj), dtype=np.float64)
    for i, v in enumerate(values_per_traj):
        v = np.asarray(v, dtype=np.float64).reshape(-1)
        out[i] = v.mean() if v.size else np.nan
    return out


def _stat(entry: Any, key: str, pos: int) -> float:
    if isinstance(entry, dict):
        return float(entry[key])
    return float(entry[pos])


def choose_trajectory(trajectory_stats: Sequence[Any], mode: str, rng: Any = None) -> int:
    """Index of the trajectory to replay among a question's stored ones.

    ``trajectory_stats[i]``: a dict with ``"mean_entropy"`` / ``"mean_logp"`` or a tuple
    ``(mean_entropy, mean_logp)``, the per-token means over trajectory i's response tokens
    under the current policy (see :func:`mean_over_tokens`); only the key the mode needs is
    read. Modes (:data:`TRAJECTORY_SELECTION`): ``"lowest_entropy"`` (official),
    ``"highest_entropy"`` (the paper's ablation), ``"highest_logp"``, ``"lowest_logp"``, ``"random"`` (uniform, needs ``rng``: a numpy
    Generator or ``random.Random``). Ties go to the lowest index; NaN values are never
    chosen unless every value is NaN (then index 0).
    """
    if len(trajectory_stats) == 0:
        raise ValueError("choose_trajectory needs at least one trajectory")
    return int(TRAJECTORY_SELECTION.get(mode)(trajectory_stats, rng))


def _argmin_of(trajectory_stats: Sequence[Any], key: str, pos: int, sign: float) -> int:
    """Index of the smallest ``sign * stat`` (ties: lowest index; NaN never chosen unless all)."""
    arr = sign * np.asarray([_stat(s, key, pos) for s in trajectory_stats], dtype=np.float64)
    arr = np.where(np.isnan(arr), np.inf, arr)
    return int(np.argmin(arr))  # argmin returns the first (lowest) index on ties


@register_trajectory_selection("lowest_entropy")
def lowest_entropy(trajectory_stats, rng=None) -> int:
    """The official choice: the trajectory the current policy is most certain of."""
    return _argmin_of(trajectory_stats, "mean_entropy", 0, 1.0)


@register_trajectory_selection("highest_entropy")
def highest_entropy(trajectory_stats, rng=None) -> int:
    """The paper's ablation."""
    return _argmin_of(trajectory_stats, "mean_entropy", 0, -1.0)


@register_trajectory_selection("highest_logp")
def highest_logp(trajectory_stats, rng=None) -> int:
    return _argmin_of(trajectory_stats, "mean_logp", 1, -1.0)


@register_trajectory_selection("lowest_logp")
def lowest_logp(trajectory_stats, rng=None) -> int:
    return _argmin_of(trajectory_stats, "mean_logp", 1, 1.0)


@register_trajectory_selection("random")
def random_trajectory(trajectory_stats, rng=None) -> int:
    """Uniform; needs ``rng`` (a numpy Generator or ``random.Random``)."""
    if rng is None:
        raise ValueError("mode 'random' needs an rng (numpy Generator or random.Random)")
    n = len(trajectory_stats)
    return int(rng.integers(n)) if hasattr(rng, "integers") else int(rng.randrange(n))
