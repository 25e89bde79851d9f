"""BM25 retrieval for XRPO's in-context seeding corpus (rllib_exgrpo/xrpo/icl.py): cost and agreement.

Compares, on arithmetic-like questions ("What is 37 * 12 + 5?", plus a few word problems),

* ``postings``: the hand-written incremental BM25 (inverted index updated on every
  add/evict, a query walks only the postings of its tokens; a verbatim copy of the index
  code ``SolvedCorpus`` had before it moved to a library, kept here as the reference),
* ``bm25s``: ``bm25s.BM25(method="atire", idf_method="lucene", dtype="float64")``, which is
  exactly our formula (see below); no incremental update, so the index is rebuilt once per
  training step (lazily, on the first query after a change),
* ``rank_bm25``: ``rank_bm25.BM25Okapi`` (idf ``log((N - df + 0.5) / (df + 0.5))`` with
  negative idfs floored at ``epsilon * mean idf``, ``epsilon = 0.25``) and, for the
  agreement only, the same class with our (Lucene) idf swapped in; also rebuilt per step,
* ``SolvedCorpus``: the class as it is now in icl.py (end to end: add, retrieve).

Figures, per corpus size (256 / 2048 / 10000 by default):

* update: microseconds per ``add`` of a new question into a full corpus (evicts the
  oldest); for the libraries (SolvedCorpus included) the index rebuild (ms) that the
  first query after a change does is given separately,
* query: milliseconds per ``retrieve(q, k=2, exclude_ids=[qid])`` on a built index
  (the library rows rank through the same Python dict/sort as ``postings``;
  ``SolvedCorpus`` ranks the score array with numpy),
* step: the BM25 work of one training step at the defaults (``questions_per_step=128``,
  ``group_size=8``): ``--adds-per-step`` add calls (half new ids, half re-solves) then
  ``--queries-per-step`` retrievals, in ms,
* agreement: fraction of ``--queries`` random queries (half fresh questions, half stored
  questions with their own id excluded) whose ordered top-k ids equal the reference's
  (same ranking rule for all: score > 0, best first, ties to the most recent insertion).

Usage: ``python experiments/icl_retrieval.py [--sizes 256 2048 10000] [--queries 300]``
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections import Counter, OrderedDict
from typing import Callable, Dict, Hashable, List, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rllib_exgrpo.xrpo.icl import SolvedCorpus, tokenize  # noqa: E402

K1, B = 1.5, 0.75
NAMES = ["Alice", "Bob", "Carol", "Dan", "Eve", "Frank"]
ITEMS = ["apples", "pens", "books", "coins", "marbles", "cards"]
OPS = ["+", "-", "*", "/"]


def make_question(rng: np.random.Generator) -> str:
    r = rng.random()
    n = lambda hi=1000: int(rng.integers(1, hi))  # noqa: E731
    op = lambda: OPS[int(rng.integers(len(OPS)))]  # noqa: E731
    if r < 0.4:
        return f"What is {n(100)} {op()} {n(100)} {op()} {n(100)}?"
    if r < 0.65:
        return f"What is {n()} {op()} {n()}?"
    if r < 0.8:
        return f"Compute ({n(100)} {op()} {n(100)}) {op()} {n(50)}."
    if r < 0.9:
        return f"Find x if x {op()} {n(100)} = {n(1000)}."
    name, item = NAMES[int(rng.integers(len(NAMES)))], ITEMS[int(rng.integers(len(ITEMS)))]
    return f"{name} has {n(100)} {item} and buys {n(100)} more {item}. How many {item} does {name} have?"


# -- candidate indexes ---------------------------------------------------------------
# Each keeps (seq, question) per id in insertion order and ranks with the same rule;
# they differ only in how scores are computed and kept up to date.


class _Base:
    name = "?"
    #: rank on scores rounded to this many decimals (None: raw floats)
    tie_decimals = None

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: "OrderedDict[Hashable, Tuple[int, str]]" = OrderedDict()
        self.next_seq = 0

    def add(self, qid: Hashable, question: str) -> None:
        if qid in self.entries:
            self._remove(qid)
        while len(self.entries) >= self.capacity:
            self._remove(next(iter(self.entries)))
        self.entries[qid] = (self.next_seq, question)
        self.next_seq += 1
        self._on_insert(qid, question)

    def _remove(self, qid: Hashable) -> None:
        del self.entries[qid]
        self._on_remove(qid)

    def _on_insert(self, qid, question) -> None:
        pass

    def _on_remove(self, qid) -> None:
        pass

    def scores(self, query: str) -> Dict[Hashable, float]:
        raise NotImplementedError

    def retrieve(self, query: str, k: int, exclude: Sequence[Hashable] = ()) -> List[Hashable]:
        excluded, qn = set(exclude), " ".join(query.split())
        scored = [
            (s, qid)
            for qid, s in self.scores(query).items()
            if s > 0 and qid not in excluded and " ".join(self.entries[qid][1].split()) != qn
        ]
        if self.tie_decimals is not None:
            scored = [(round(sc, self.tie_decimals), qid) for sc, qid in scored]
        scored.sort(key=lambda x: (-x[0], -self.entries[x[1]][0]))
        return [qid for _, qid in scored[:k]]


class Postings(_Base):
    """The hand-written incremental BM25 (Lucene idf, distinct query tokens)."""

    name = "postings"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.doc_tf: Dict[Hashable, Counter] = {}
        self.doc_len: Dict[Hashable, int] = {}
        self.postings: Dict[str, Dict[Hashable, int]] = {}
        self.total_len = 0

    def _on_insert(self, qid, question) -> None:
        tf = Counter(tokenize(question))
        self.doc_tf[qid] = tf
        length = sum(tf.values())
        self.doc_len[qid] = length
        self.total_len += length
        for tok, c in tf.items():
            self.postings.setdefault(tok, {})[qid] = c

    def _on_remove(self, qid) -> None:
        tf = self.doc_tf.pop(qid)
        self.total_len -= self.doc_len.pop(qid)
        for tok in tf:
            post = self.postings[tok]
            del post[qid]
            if not post:
                del self.postings[tok]

    def scores(self, query: str) -> Dict[Hashable, float]:
        n_docs = len(self.entries)
        if n_docs == 0:
            return {}
        avgdl = self.total_len / n_docs if self.total_len > 0 else 1.0
        out: Dict[Hashable, float] = {}
        for tok in set(tokenize(query)):
            post = self.postings.get(tok)
            if not post:
                continue
            df = len(post)
            idf = math.log(1.0 + (n_docs - df + 0.5) / (df + 0.5))
            for qid, tf in post.items():
                norm = K1 * (1.0 - B + B * self.doc_len[qid] / avgdl)
                out[qid] = out.get(qid, 0.0) + idf * tf * (K1 + 1.0) / (tf + norm)
        return out


class PostingsRoundedTies(Postings):
    """The same, ranking on scores rounded to 1e-9 (the rule SolvedCorpus now documents)."""

    name = "postings, 1e-9 ties"
    tie_decimals = 9


class _Rebuilt(_Base):
    """A library index rebuilt (lazily, on the next query) after any change."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.dirty = True
        self.ids: List[Hashable] = []
        self.index = None

    def _on_insert(self, qid, question) -> None:
        self.dirty = True

    def _on_remove(self, qid) -> None:
        self.dirty = True

    def rebuild(self) -> None:
        self.ids = list(self.entries)
        docs = [tokenize(q) for _, q in self.entries.values()]
        self.index = self._build(docs) if any(docs) else None
        self.dirty = False

    def scores(self, query: str) -> Dict[Hashable, float]:
        if self.dirty:
            self.rebuild()
        toks = list(dict.fromkeys(tokenize(query)))  # distinct tokens, first-seen order
        if self.index is None or not toks:
            return {}
        s = self._scores(toks)
        return {self.ids[i]: float(s[i]) for i in np.flatnonzero(s)}


class Bm25s(_Rebuilt):
    name = "bm25s"

    def _build(self, docs):
        import bm25s

        index = bm25s.BM25(k1=K1, b=B, method="atire", idf_method="lucene", dtype="float64")
        index.index(docs, show_progress=False)
        return index

    def _scores(self, toks):
        tids = self.index.get_tokens_ids(toks)
        if not tids:
            return np.zeros(0)
        return self.index.get_scores_from_ids(tids)


class RankBM25(_Rebuilt):
    """rank_bm25.BM25Okapi as shipped (epsilon floor on negative idfs)."""

    name = "rank_bm25"

    def _build(self, docs):
        from rank_bm25 import BM25Okapi

        return BM25Okapi(docs, k1=K1, b=B)

    def _scores(self, toks):
        return self.index.get_scores(toks)


class RankBM25Lucene(RankBM25):
    """rank_bm25.BM25Okapi with our (Lucene) idf put in place of its own."""

    name = "rank_bm25+lucene-idf"

    def _build(self, docs):
        from rank_bm25 import BM25Okapi

        class _Lucene(BM25Okapi):
            def _calc_idf(self, nd):
                n = self.corpus_size
                self.idf = {w: math.log(1.0 + (n - df + 0.5) / (df + 0.5)) for w, df in nd.items()}

        return _Lucene(docs, k1=K1, b=B)


class Corpus(_Base):
    """SolvedCorpus as it is now in icl.py, end to end."""

    name = "SolvedCorpus"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.c = SolvedCorpus(capacity=capacity, keep="latest")
        self.n_add = 0

    def add(self, qid, question) -> None:
        self.n_add += 1
        self.c.add(qid, question, f"solution {self.n_add}")  # always a change under keep="latest"

    def retrieve(self, query, k, exclude=()):
        return [e.question_id for e in self.c.retrieve(query, k=k, exclude_ids=list(exclude))]

    def rebuild(self) -> None:
        """Force the lazy bm25s index rebuild that the first query after a change does."""
        self.c._bm25_stale = True
        self.c._refresh()


try:
    import rank_bm25  # noqa: F401  (benchmark only: pip install rank_bm25)

    HAVE_RANK_BM25 = True
except ImportError:
    HAVE_RANK_BM25 = False
CANDIDATES = [Postings, Bm25s] + ([RankBM25] if HAVE_RANK_BM25 else []) + [Corpus]


# -- measurements --------------------------------------------------------------------


def filled(cls, n: int, questions: Sequence[str]):
    idx = cls(n)
    for i in range(n):
        idx.add(i, questions[i])
    return idx


def per_call(fn: Callable[[], None], calls: int, repeats: int = 3) -> float:
    """Median over ``repeats`` of the seconds per call of ``calls`` calls."""
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls)
    return statistics.median(out)


def bench_size(n: int, args, rng: np.random.Generator) -> List[dict]:
    questions = [make_question(rng) for _ in range(n + 20_000)]
    queries = [make_question(rng) for _ in range(200)]
    rows = []
    for cls in CANDIDATES:
        idx = filled(cls, n, questions)
        nxt = [n]

        def add_new():
            idx.add(nxt[0], questions[nxt[0]])
            nxt[0] += 1

        t_add = per_call(add_new, calls=min(2000, n))
        if hasattr(idx, "rebuild"):
            t_rebuild = per_call(lambda: idx.rebuild(), calls=max(1, 2000 // n))
        else:
            t_rebuild = 0.0
        qi = [0]

        def query():
            idx.retrieve(queries[qi[0] % len(queries)], 2, exclude=[-1])
            qi[0] += 1

        idx.retrieve(queries[0], 2)  # (re)build outside the timing
        t_query = per_call(query, calls=max(5, min(200, 20_000 // n)))

        # one training step: adds (half new ids, half re-solves of stored ids), then queries
        def step():
            if isinstance(idx, Corpus):
                stored = [e.question_id for e in idx.c.examples()]
            else:
                stored = list(idx.entries)
            for j in range(args.adds_per_step):
                if j % 2 == 0:
                    add_new()
                else:
                    qid = stored[int(rng.integers(len(stored)))]
                    idx.add(qid, questions[qid])
            for j in range(args.queries_per_step):
                idx.retrieve(queries[j % len(queries)], 2, exclude=[-1])

        t_step = per_call(step, calls=1, repeats=5)
        rows.append(
            dict(
                n=n,
                impl=cls.name,
                add_us=t_add * 1e6,
                rebuild_ms=t_rebuild * 1e3,
                query_ms=t_query * 1e3,
                step_ms=t_step * 1e3,
            )
        )
    return rows


def agreement(n: int, n_queries: int, ks: Sequence[int], rng: np.random.Generator) -> List[dict]:
    questions = [make_question(rng) for _ in range(n)]
    ref = filled(Postings, n, questions)
    rank = (RankBM25, RankBM25Lucene) if HAVE_RANK_BM25 else ()
    others = [filled(c, n, questions) for c in (Bm25s, *rank, Corpus)]
    qs: List[Tuple[str, List[Hashable]]] = []
    for i in range(n_queries):
        if i % 2 == 0:
            qs.append((make_question(rng), []))
        else:
            qid = int(rng.integers(n))
            qs.append((questions[qid], [qid]))
    ref_rounded = filled(PostingsRoundedTies, n, questions)
    rows = []
    pairs = [(ref, o) for o in others] + [(ref_rounded, others[-1])]
    for r, other in pairs:
        for k in ks:
            got = [(r.retrieve(q, k, ex), other.retrieve(q, k, ex)) for q, ex in qs]
            same = sum(a == b for a, b in got)
            same_set = sum(set(a) == set(b) for a, b in got)
            rows.append(dict(n=n, ref=r.name, impl=other.name, k=k, ordered=same / len(qs), as_set=same_set / len(qs)))
    # score agreement of the exact-formula candidates
    for other in others:
        if other.name in ("bm25s", "SolvedCorpus"):
            worst = 0.0
            for q, _ in qs[:50]:
                a = ref.scores(q)
                b = other.c.scores(q) if isinstance(other, Corpus) else other.scores(q)
                assert set(a) == set(b), (other.name, q)
                worst = max([worst] + [abs(a[i] - b[i]) / max(abs(a[i]), 1e-300) for i in a])
            rows.append(dict(n=n, ref=ref.name, impl=other.name, k="scores", ordered=worst, as_set=float("nan")))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 2048, 10000])
    ap.add_argument("--queries", type=int, default=300, help="random queries for the agreement")
    ap.add_argument("--adds-per-step", type=int, default=512)
    ap.add_argument("--queries-per-step", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)

    print(f"step = {args.adds_per_step} add calls + {args.queries_per_step} retrievals (k=2)")
    print(f"{'size':>6} {'impl':>14} {'add us':>9} {'rebuild ms':>11} {'query ms':>9} {'step ms':>9}")
    for n in args.sizes:
        for r in bench_size(n, args, rng):
            print(f"{r['n']:>6} {r['impl']:>14} {r['add_us']:>9.1f} {r['rebuild_ms']:>11.2f} {r['query_ms']:>9.3f} {r['step_ms']:>9.1f}")
    print()
    print(f"agreement of top-k ids with the hand-written postings BM25 ({args.queries} queries)")
    print(f"{'size':>6} {'reference':>20} {'impl':>22} {'k':>6} {'ordered':>8} {'as set':>8}")
    for n in args.sizes:
        for r in agreement(n, args.queries, (2, 5), rng):
            head = f"{r['n']:>6} {r['ref']:>20} {r['impl']:>22}"
            if r["k"] == "scores":
                print(f"{head} {'scores':>6}  max rel. diff {r['ordered']:.1e}")
            else:
                print(f"{head} {r['k']:>6} {r['ordered']:>8.3f} {r['as_set']:>8.3f}")


if __name__ == "__main__":
    main()
