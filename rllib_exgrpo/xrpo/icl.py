"""XRPO's in-context seeding corpus: the model's own verified solutions, retrieved by BM25.

Pure Python/numpy (no torch, no RLlib). The rules follow
``docs/ALGORITHMS.md`` section 3.2 (XRPO, arXiv 2510.06672; the official
code was not reachable, so every choice below is ours and documented). The code is our
own.

What it is for
--------------
For a question whose completions all failed, the algorithm retrieves a few (default 2)
solved questions similar to it (:meth:`SolvedCorpus.retrieve`), renders them with
:func:`format_examples` and prepends that text to the chat prompt text, then samples
extra completions from the seeded prompt.

**Off-policy treatment (our documented choice).** Those completions are trained against
the ORIGINAL prompt (without the examples), so they are off-policy tokens: their recorded
log-probs are those of the behaviour policy under the *seeded* prompt,
``pi_old(y_t | examples + prompt, y_<t)``. They are treated exactly like ExGRPO's replayed
tokens: the importance ratio ``w_t = pi_theta(y_t | prompt, y_<t) / pi_old(y_t | examples +
prompt, y_<t)`` against those recorded log-probs, with policy shaping ``f(w) = w / (w +
beta)`` and no clipping (``losses.shaped_surrogate``, the ``off_policy`` rows of
``losses.mixed_policy_loss``). They join their question's group for the advantage.

Corpus rules (:class:`SolvedCorpus`)
------------------------------------
* Entries are verified correct ``(question_id, question, completion)`` triples of the
  model's own; the corpus starts empty and grows as training goes.
* **At most one solution per question id.** ``keep="shortest"`` (default): a new solution
  replaces the stored one only if it is strictly shorter (in characters; ties keep the
  stored one): short solutions make compact examples and keep the seeded prompt short.
  ``keep="latest"``: the newest solution always replaces the stored one (closest to the
  current policy). A replacement counts as a new insertion (it becomes the newest entry
  for eviction); an add that changes nothing returns ``False`` and leaves the order alone.
  A replacement also stores the new question text for that id.
* **Bounded**: at most ``capacity`` entries; adding a new question to a full corpus evicts
  the **oldest** entry (insertion order, FIFO) first.
* Empty (whitespace-only) questions or completions are not stored (``add`` returns
  ``False``).

Retrieval (:meth:`SolvedCorpus.retrieve`)
-----------------------------------------
* Lexical similarity: **Okapi BM25** over the stored *question* texts (not the
  completions), ``k1 = 1.5``, ``b = 0.75``, Lucene's always-positive idf
  ``log(1 + (N - df + 0.5) / (df + 0.5))``; each distinct query token counts once.
* Tokens (:func:`tokenize`): lower-cased words (``[a-z]+``), numbers (``\\d+(\\.\\d+)?``,
  so ``12`` matches ``12`` only) and the single math symbols ``+ - * / ^ = < > %`` (so
  "What is 12 + 7?" is closer to "What is 3 + 5?" than to "What is 3 times 5?").
* An inverted index (token -> {entry: term frequency}) makes a query cost only the
  postings of its tokens.
* **Never returns the query's own question**: entries whose id is in ``exclude_ids``
  (pass the query's id there) and entries whose question text equals the query's (after
  whitespace normalisation) are skipped, so a question cannot be seeded with its own
  solution even under another id.
* Only entries sharing at least one token with the query (score > 0) are returned, best
  first; ties go to the most recently inserted. With ``fill_random=True`` the remaining
  slots (up to ``k``) are filled with other entries drawn uniformly at random from the
  corpus's seeded RNG (examples still show the expected answer format).
* An empty corpus returns ``[]``.

State
-----
:meth:`SolvedCorpus.get_state` returns plain Python (picklable): configuration, entries in
insertion order, counters and the RNG state; :meth:`SolvedCorpus.set_state` rebuilds the
index, so retrievals, later adds/evictions and random fills are identical.
"""

from __future__ import annotations

import math
import re
from collections import Counter, OrderedDict
from collections.abc import Iterable as _IterableABC
from dataclasses import dataclass
from typing import Any, Dict, Hashable, Iterable, List, Optional, Tuple

import numpy as np

__all__ = [
    "KEEP_POLICIES",
    "DEFAULT_TEMPLATE",
    "Example",
    "SolvedCorpus",
    "tokenize",
    "format_examples",
]

#: Which solution :meth:`SolvedCorpus.add` keeps when a question is solved again.
KEEP_POLICIES: Tuple[str, ...] = ("shortest", "latest")
#: Default rendering of one example in :func:`format_examples`.
DEFAULT_TEMPLATE = "Question: {question}\nSolution: {completion}\n\n"

_STATE_VERSION = 1
_TOKEN_RE = re.compile(r"[a-z]+|\d+(?:\.\d+)?|[+\-*/^=<>%]")


def tokenize(text: str) -> List[str]:
    """Lower-cased word, number and math-symbol tokens of ``text`` (see module docs)."""
    return _TOKEN_RE.findall(text.lower())


def _norm_text(text: str) -> str:
    return " ".join(text.split())


@dataclass(frozen=True)
class Example:
    """One verified solution: the question's id and text, and the model's completion."""

    question_id: Hashable
    question: str
    completion: str


class SolvedCorpus:
    """Bounded corpus of the model's own verified solutions with BM25 retrieval.

    Args:
        capacity: maximum number of entries (``>= 1``); the oldest is evicted first.
        seed: seed of the RNG used only by ``retrieve(..., fill_random=True)``.
        keep: ``"shortest"`` (default) or ``"latest"`` (:data:`KEEP_POLICIES`).
        k1, b: BM25 parameters.
    """

    def __init__(
        self,
        capacity: int = 2048,
        seed: Optional[int] = 0,
        keep: str = "shortest",
        k1: float = 1.5,
        b: float = 0.75,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if keep not in KEEP_POLICIES:
            raise ValueError(f"unknown keep policy {keep!r}; expected one of {KEEP_POLICIES}")
        k1, b = float(k1), float(b)
        if not (k1 >= 0 and math.isfinite(k1)):
            raise ValueError(f"k1 must be finite and >= 0, got {k1}")
        if not (0.0 <= b <= 1.0):
            raise ValueError(f"b must be in [0, 1], got {b}")
        self.capacity = int(capacity)
        self.seed = seed
        self.keep = keep
        self.k1 = k1
        self.b = b
        self._rng = np.random.default_rng(seed)
        # question_id -> (seq, Example); OrderedDict order = insertion order (oldest first)
        self._entries: "OrderedDict[Hashable, Tuple[int, Example]]" = OrderedDict()
        self._doc_tf: Dict[Hashable, Counter] = {}
        self._doc_len: Dict[Hashable, int] = {}
        self._postings: Dict[str, Dict[Hashable, int]] = {}
        self._total_len = 0
        self._next_seq = 0
        self._counters = {"added": 0, "replaced": 0, "rejected": 0, "evicted": 0}

    # -- size -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, question_id: Hashable) -> bool:
        return question_id in self._entries

    def get(self, question_id: Hashable) -> Optional[Example]:
        """The stored solution of ``question_id``, or ``None``."""
        item = self._entries.get(question_id)
        return None if item is None else item[1]

    def examples(self) -> List[Example]:
        """All entries, oldest first."""
        return [ex for _, ex in self._entries.values()]

    @property
    def counters(self) -> Dict[str, int]:
        """Totals since creation: ``added`` (new ids), ``replaced``, ``rejected``, ``evicted``."""
        return dict(self._counters)

    # -- index ----------------------------------------------------------------------

    def _index(self, qid: Hashable, question: str) -> None:
        tf = Counter(tokenize(question))
        self._doc_tf[qid] = tf
        length = sum(tf.values())
        self._doc_len[qid] = length
        self._total_len += length
        for tok, c in tf.items():
            self._postings.setdefault(tok, {})[qid] = c

    def _unindex(self, qid: Hashable) -> None:
        tf = self._doc_tf.pop(qid)
        self._total_len -= self._doc_len.pop(qid)
        for tok in tf:
            post = self._postings[tok]
            del post[qid]
            if not post:
                del self._postings[tok]

    def _insert(self, example: Example) -> None:
        self._entries[example.question_id] = (self._next_seq, example)
        self._next_seq += 1
        self._index(example.question_id, example.question)

    def _remove(self, qid: Hashable) -> None:
        del self._entries[qid]
        self._unindex(qid)

    # -- add ------------------------------------------------------------------------

    def add(self, question_id: Hashable, question: str, completion: str) -> bool:
        """Store a verified correct solution; ``True`` iff the corpus changed.

        At most one solution per id (``keep`` decides which); a new id in a full corpus
        evicts the oldest entry first. Empty question or completion: not stored.
        """
        if not isinstance(question, str) or not isinstance(completion, str):
            raise TypeError("question and completion must be str")
        hash(question_id)  # must be hashable
        if not question.strip() or not completion.strip():
            self._counters["rejected"] += 1
            return False
        new = Example(question_id, question, completion)
        old = self._entries.get(question_id)
        if old is not None:
            if self.keep == "shortest" and len(completion) >= len(old[1].completion):
                self._counters["rejected"] += 1
                return False
            if self.keep == "latest" and old[1] == new:
                self._counters["rejected"] += 1
                return False
            self._remove(question_id)
            self._insert(new)
            self._counters["replaced"] += 1
            return True
        while len(self._entries) >= self.capacity:
            oldest = next(iter(self._entries))
            self._remove(oldest)
            self._counters["evicted"] += 1
        self._insert(new)
        self._counters["added"] += 1
        return True

    # -- retrieve -------------------------------------------------------------------

    def scores(self, query_question: str) -> Dict[Hashable, float]:
        """BM25 score of every entry sharing a token with ``query_question`` (id -> score)."""
        n_docs = len(self._entries)
        if n_docs == 0:
            return {}
        avgdl = self._total_len / n_docs if self._total_len > 0 else 1.0
        out: Dict[Hashable, float] = {}
        for tok in set(tokenize(query_question)):
            post = self._postings.get(tok)
            if not post:
                continue
            df = len(post)
            idf = math.log(1.0 + (n_docs - df + 0.5) / (df + 0.5))
            for qid, tf in post.items():
                norm = self.k1 * (1.0 - self.b + self.b * self._doc_len[qid] / avgdl)
                out[qid] = out.get(qid, 0.0) + idf * tf * (self.k1 + 1.0) / (tf + norm)
        return out

    def retrieve(
        self,
        query_question: str,
        k: int = 2,
        exclude_ids: Iterable[Hashable] = (),
        *,
        fill_random: bool = False,
    ) -> List[Example]:
        """Up to ``k`` stored solutions of the questions most similar to ``query_question``.

        BM25 over the stored question texts, best first (ties: most recent first); only
        entries with a positive score, unless ``fill_random`` fills the remaining slots
        with random other entries. Entries whose id is in ``exclude_ids`` (a single id
        such as a str is accepted too) or whose question text equals the query's are
        never returned. Empty corpus or ``k <= 0``: ``[]``.
        """
        if not isinstance(query_question, str):
            raise TypeError("query_question must be str")
        k = int(k)
        if k <= 0 or not self._entries:
            return []
        if isinstance(exclude_ids, (str, bytes)) or not isinstance(exclude_ids, _IterableABC):
            excluded = {exclude_ids}
        else:
            excluded = set(exclude_ids)
        query_norm = _norm_text(query_question)

        def allowed(qid: Hashable) -> bool:
            return qid not in excluded and _norm_text(self._entries[qid][1].question) != query_norm

        scored = [
            (s, qid) for qid, s in self.scores(query_question).items() if s > 0 and allowed(qid)
        ]
        scored.sort(key=lambda x: (-x[0], -self._entries[x[1]][0]))
        chosen = [qid for _, qid in scored[:k]]
        if fill_random and len(chosen) < k:
            taken = set(chosen)
            rest = [qid for qid in self._entries if qid not in taken and allowed(qid)]
            n_fill = min(k - len(chosen), len(rest))
            if n_fill > 0:
                picks = self._rng.choice(len(rest), size=n_fill, replace=False)
                chosen.extend(rest[int(i)] for i in picks)
        return [self._entries[qid][1] for qid in chosen]

    # -- state ----------------------------------------------------------------------

    def get_state(self) -> Dict[str, Any]:
        """Plain Python snapshot (picklable)."""
        return {
            "version": _STATE_VERSION,
            "config": {
                "capacity": self.capacity,
                "seed": self.seed,
                "keep": self.keep,
                "k1": self.k1,
                "b": self.b,
            },
            "entries": [
                (seq, ex.question_id, ex.question, ex.completion)
                for seq, ex in self._entries.values()
            ],
            "next_seq": self._next_seq,
            "counters": dict(self._counters),
            "rng_state": self._rng.bit_generator.state,
        }

    def set_state(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`get_state` snapshot exactly (configuration included)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported corpus state version {state.get('version')!r}")
        cfg = state["config"]
        self.__init__(cfg["capacity"], seed=cfg["seed"], keep=cfg["keep"], k1=cfg["k1"], b=cfg["b"])
        for seq, qid, question, completion in state["entries"]:
            if qid in self._entries:
                raise ValueError(f"corpus state: duplicate question id {qid!r}")
            ex = Example(qid, question, completion)
            self._entries[qid] = (int(seq), ex)
            self._index(qid, question)
        if len(self._entries) > self.capacity:
            raise ValueError("corpus state: more entries than capacity")
        self._next_seq = int(state["next_seq"])
        self._counters = dict(state["counters"])
        self._rng.bit_generator.state = state["rng_state"]

    @classmethod
    def from_state(cls, state: Dict[str, Any]) -> "SolvedCorpus":
        """A new corpus restored from :meth:`get_state`."""
        corpus = cls()
        corpus.set_state(state)
        return corpus


def format_examples(examples: Iterable[Example], template: str = DEFAULT_TEMPLATE) -> str:
    """Render ``examples`` as the prefix text prepended before the rendered prompt.

    Each example is ``template.format(question=..., completion=...)`` (``question_id`` is
    available too), concatenated in order; no examples give ``""``. The sampled
    completions are trained against the original prompt as off-policy tokens (see the
    module docstring).
    """
    return "".join(
        template.format(question=ex.question, completion=ex.completion, question_id=ex.question_id)
        for ex in examples
    )
