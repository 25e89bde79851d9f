"""Tests of XRPO's in-context seeding corpus (rllib_exgrpo/xrpo/icl.py): pure Python, fast."""

import math
import pickle

import pytest

from rllib_exgrpo.xrpo.icl import (
    DEFAULT_TEMPLATE,
    KEEP_POLICIES,
    Example,
    SolvedCorpus,
    format_examples,
    tokenize,
)

ARITH = {
    "a1": ("What is 12 + 7?", "12 + 7 = 19. \\boxed{19}"),
    "a2": ("What is 30 + 45?", "30 + 45 = 75. \\boxed{75}"),
    "a3": ("What is 9 * 8?", "9 * 8 = 72. \\boxed{72}"),
}
WORDS = {
    "w1": (
        "Alice has 5 apples and buys 3 more apples at the market. How many apples does she have?",
        "5 + 3 = 8 apples. \\boxed{8}",
    ),
    "w2": (
        "A train travels 60 miles per hour for 2 hours. How far does the train travel?",
        "60 * 2 = 120 miles. \\boxed{120}",
    ),
    "w3": (
        "Bob reads 10 pages of a book every day. How many pages does he read in a week?",
        "10 * 7 = 70 pages. \\boxed{70}",
    ),
}


def corpus(**kw):
    c = SolvedCorpus(**kw)
    for qid, (q, a) in {**ARITH, **WORDS}.items():
        assert c.add(qid, q, a)
    return c


def ids(examples):
    return [e.question_id for e in examples]


def test_tokenize():
    assert tokenize("What is 12 + 7?") == ["what", "is", "12", "+", "7"]
    assert tokenize("x^2 = 3.5, 10%") == ["x", "^", "2", "=", "3.5", "10", "%"]


def test_empty_corpus_returns_empty():
    c = SolvedCorpus()
    assert len(c) == 0
    assert c.retrieve("What is 1 + 1?") == []
    assert c.retrieve("What is 1 + 1?", fill_random=True) == []
    assert c.scores("anything") == {}
    assert format_examples([]) == ""


def test_retrieves_expected_neighbours():
    c = corpus()
    got = c.retrieve("What is 3 + 5?", k=2)
    assert len(got) == 2
    assert got[0].question_id in ("a1", "a2")  # "+" addition questions first
    assert set(ids(got)) == {"a1", "a2"}
    got = c.retrieve("How many apples does Carol have if she buys 4 apples?", k=1)
    assert ids(got) == ["w1"]
    got = c.retrieve("A car travels 50 miles per hour for 3 hours. How far does it travel?", k=1)
    assert ids(got) == ["w2"]
    # identical question text is never returned (its own solution, even under another id)
    got = c.retrieve("What is  9 * 8?", k=6, exclude_ids=("other",))
    assert ids(got) == ["a2", "a1"]  # a3 (same text) skipped; word problems share no token
    got = c.retrieve("What is 9 * 6?", k=1)
    assert ids(got) == ["a3"]


def test_excludes_query_id():
    c = corpus()
    q = "Bob reads 10 pages of a book every day. How many pages in two weeks?"
    assert ids(c.retrieve(q, k=1)) == ["w3"]
    assert "w3" not in ids(c.retrieve(q, k=6, exclude_ids=["w3"]))
    assert "w3" not in ids(c.retrieve(q, k=6, exclude_ids="w3"))  # single str id accepted
    # only entries sharing a token are returned
    assert c.retrieve("zzz qqq", k=3) == []


def test_fill_random_is_seeded_and_excludes():
    c = corpus(seed=7)
    a = c.retrieve("zzz", k=3, exclude_ids=["a1"], fill_random=True)
    assert len(a) == 3 and "a1" not in ids(a)
    b = corpus(seed=7).retrieve("zzz", k=3, exclude_ids=["a1"], fill_random=True)
    assert ids(a) == ids(b)
    # best matches first, random fill after them
    got = c.retrieve("What is 9 * 6?", k=4, fill_random=True)
    assert len(got) == 4 and got[0].question_id == "a3" and len(set(ids(got))) == 4


def test_scores_bm25_formula():
    c = SolvedCorpus(k1=1.5, b=0.75)
    c.add(1, "apple banana", "x")
    c.add(2, "apple apple cherry dates", "y")
    s = c.scores("apple cherry")
    avgdl = 3.0
    idf_apple = math.log(1 + (2 - 2 + 0.5) / (2 + 0.5))
    idf_cherry = math.log(1 + (2 - 1 + 0.5) / (1 + 0.5))

    def term(idf, tf, dl):
        return idf * tf * 2.5 / (tf + 1.5 * (1 - 0.75 + 0.75 * dl / avgdl))

    assert s[1] == pytest.approx(term(idf_apple, 1, 2))
    assert s[2] == pytest.approx(term(idf_apple, 2, 4) + term(idf_cherry, 1, 4))


def test_dedupe_shortest():
    c = SolvedCorpus()
    assert c.add("q", "What is 2 + 2?", "a long solution: 2 + 2 = 4. \\boxed{4}")
    assert not c.add("q", "What is 2 + 2?", "an even longer solution: 2 + 2 = 4 so \\boxed{4}")
    assert not c.add("q", "What is 2 + 2?", "x" * len(c.get("q").completion))  # tie keeps old
    assert c.add("q", "What is 2 + 2?", "\\boxed{4}")
    assert len(c) == 1
    assert c.get("q").completion == "\\boxed{4}"
    assert c.counters == {"added": 1, "replaced": 1, "rejected": 2, "evicted": 0}


def test_dedupe_latest():
    c = SolvedCorpus(keep="latest")
    assert c.add("q", "What is 2 + 2?", "short")
    assert c.add("q", "What is 2 + 2?", "a longer but newer one")
    assert not c.add("q", "What is 2 + 2?", "a longer but newer one")  # identical
    assert len(c) == 1 and c.get("q").completion == "a longer but newer one"


def test_empty_texts_rejected():
    c = SolvedCorpus()
    assert not c.add("q", "What?", "   ")
    assert not c.add("q", "", "answer")
    assert len(c) == 0
    with pytest.raises(TypeError):
        c.add("q", "What?", None)


def test_capacity_evicts_oldest():
    c = SolvedCorpus(capacity=3)
    for i in range(3):
        c.add(f"q{i}", f"question number {i}", "sol")
    assert c.add("q3", "question number 3", "sol")
    assert len(c) == 3 and "q0" not in c
    assert [e.question_id for e in c.examples()] == ["q1", "q2", "q3"]
    # a replacement moves the entry to the newest position
    assert c.add("q1", "question number 1", "s")
    c.add("q4", "question number 4", "sol")
    assert [e.question_id for e in c.examples()] == ["q3", "q1", "q4"]
    assert c.counters["evicted"] == 2
    # evicted entries leave the index
    assert "q0" not in c.scores("question number 0")
    assert all(qid in ("q1", "q3", "q4") for qid in c.scores("question 0 2"))
    with pytest.raises(ValueError):
        SolvedCorpus(capacity=0)


def test_ties_go_to_most_recent():
    c = SolvedCorpus()
    c.add("old", "same words here", "a")
    c.add("new", "same words here", "b")
    assert ids(c.retrieve("same words", k=2)) == ["new", "old"]


def test_state_round_trip():
    c = corpus(capacity=5, seed=3, keep="latest")
    c.retrieve("zzz", k=2, fill_random=True)  # advance the RNG
    state = pickle.loads(pickle.dumps(c.get_state()))
    d = SolvedCorpus.from_state(state)
    assert d.get_state() == c.get_state()
    assert len(d) == len(c) == 5
    for q in ("What is 3 + 5?", "How many apples?", "travels miles", "zzz"):
        assert d.retrieve(q, k=3, fill_random=True) == c.retrieve(q, k=3, fill_random=True)
    # later adds and evictions identical
    for obj in (c, d):
        obj.add("n1", "What is 100 + 1?", "101")
        obj.add("a2", "What is 30 + 45?", "75")
    assert d.get_state() == c.get_state()
    assert d.scores("What is 100 + 1?") == pytest.approx(c.scores("What is 100 + 1?"))
    e = SolvedCorpus()
    e.set_state(c.get_state())
    assert e.examples() == c.examples()
    with pytest.raises(ValueError):
        e.set_state({**state, "version": 99})


def test_format_examples():
    exs = [Example("a", "What is 1 + 1?", "\\boxed{2}"), Example("b", "Q2 {x}", "A2 {y}")]
    text = format_examples(exs)
    assert text == ("Question: What is 1 + 1?\nSolution: \\boxed{2}\n\nQuestion: Q2 {x}\nSolution: A2 {y}\n\n")
    assert format_examples(exs[:1], template="[{question_id}] {question} => {completion}\n") == ("[a] What is 1 + 1? => \\boxed{2}\n")
    assert DEFAULT_TEMPLATE.format(question="q", completion="c") == "Question: q\nSolution: c\n\n"


def test_validation():
    with pytest.raises(ValueError):
        SolvedCorpus(keep="oldest")
    with pytest.raises(ValueError):
        SolvedCorpus(b=2)
    assert KEEP_POLICIES == ("shortest", "latest")
    assert corpus().retrieve("What is 3 + 5?", k=0) == []


def test_retrieval_on_a_full_corpus():
    c = SolvedCorpus(capacity=2048)
    for i in range(2048):
        q = f"What is {i} + {i % 17}? Compute the sum of {i} and {i % 17} apples"
        c.add(i, q, f"\\boxed{{{i}}}")
    for i in range(50):
        got = c.retrieve(f"What is {i} + 3?", k=2, exclude_ids=[i])
        assert len(got) == 2 and i not in ids(got)


def _reference_scores(corpus, query, k1=1.5, b=0.75):
    """Brute-force Okapi BM25 (Lucene idf, distinct query tokens) over the stored questions."""
    docs = {e.question_id: tokenize(e.question) for e in corpus.examples()}
    n = len(docs)
    avgdl = sum(len(d) for d in docs.values()) / n
    out = {}
    for tok in set(tokenize(query)):
        df = sum(tok in d for d in docs.values())
        if df == 0:
            continue
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        for qid, d in docs.items():
            tf = d.count(tok)
            if tf:
                term = idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(d) / avgdl))
                out[qid] = out.get(qid, 0.0) + term
    return out


def test_scores_match_reference_under_adds_and_evictions():
    import random

    rng = random.Random(0)

    def question():
        a, b, c = (rng.randint(1, 30) for _ in range(3))
        op1, op2 = rng.choice("+-*/"), rng.choice("+-*/")
        forms = [f"What is {a} {op1} {b}?", f"What is {a} {op1} {b} {op2} {c}?", f"Compute {a} {op1} {b}."]
        return rng.choice(forms)

    c = SolvedCorpus(capacity=40, keep="latest", k1=1.2, b=0.6)
    for step in range(6):  # interleave changes and queries: the index must follow every change
        for i in range(25):
            c.add(rng.randint(0, 80), question(), f"solution {step}-{i}")
        assert len(c) <= 40
        order = {e.question_id: pos for pos, e in enumerate(c.examples())}
        for _ in range(10):
            q = question()
            ref = _reference_scores(c, q, k1=1.2, b=0.6)
            got = c.scores(q)
            assert set(got) == set(ref)
            assert all(got[i] == pytest.approx(ref[i], rel=1e-12) for i in ref)
            # ranking: best score first, ties (to 1e-9) to the most recent insertion
            qn = " ".join(q.split())
            expected = sorted(
                (i for i in ref if " ".join(c.get(i).question.split()) != qn),
                key=lambda i: (-round(ref[i], 9), -order[i]),
            )
            assert ids(c.retrieve(q, k=5)) == expected[:5]


def test_replacement_reindexes_new_question_text():
    c = SolvedCorpus(keep="latest")
    c.add("q", "apples and pears", "s1")
    c.add("r", "trains and miles", "s2")
    assert ids(c.retrieve("apples", k=2)) == ["q"]
    c.add("q", "oranges and plums", "s3")  # same id, new question text
    assert c.retrieve("apples", k=2) == []
    assert ids(c.retrieve("plums", k=2)) == ["q"]
    assert set(c.scores("and")) == {"q", "r"}


def test_questions_without_tokens():
    c = SolvedCorpus(seed=1)
    assert c.add(1, "???", "x") and c.add(2, "!!", "y")  # stored, but match nothing
    assert c.scores("What is 1 + 1?") == {}
    assert c.retrieve("What is 1 + 1?", k=2) == []
    assert len(c.retrieve("What is 1 + 1?", k=2, fill_random=True)) == 2
    assert c.retrieve("", k=2) == []
    c.add(3, "What is 1 + 1?", "2")
    assert ids(c.retrieve("What is 2 + 2?", k=2)) == [3]
