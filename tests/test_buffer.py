"""Tests of ExGRPO's experience buffer (rllib_exgrpo/exgrpo/buffer.py): pure numpy, fast."""

import pickle
import random
from collections import Counter

import numpy as np
import pytest

from rllib_exgrpo.exgrpo.buffer import (
    BUCKET_WEIGHTING,
    TRAJECTORY_SELECTION,
    UNIMPLEMENTED_BUCKET_WEIGHTINGS,
    ExperienceBuffer,
    StoredTrajectory,
    bucket_index,
    choose_trajectory,
    decode_logp,
    encode_logp,
    mean_over_tokens,
)

G = 8


def traj(*ids, logp=None):
    ids = np.asarray(ids, dtype=np.int64)
    if logp is None:
        logp = -0.1 * np.arange(1, len(ids) + 1)
    return ids, np.asarray(logp, dtype=np.float32)


def fill(buf, bucket_sizes, prefix="q", step=0):
    """Pool ``bucket_sizes[k]`` questions in bucket k, one distinct trajectory each."""
    for k, size in bucket_sizes.items():
        for i in range(size):
            qid = f"{prefix}{k}_{i}"
            assert buf.update_group(qid, [1, 2, 3], k, G, [traj(k, i, 7)], step) == "added"


def gaussian_probs(nonempty, mu=0.5, sigma=0.125):
    w = {k: np.exp(-0.5 * ((k / G - mu) / sigma) ** 2) for k in nonempty}
    s = sum(w.values())
    return {k: v / s for k, v in w.items()}


# ------------------------------------------------------------------------- rules


def test_bucket_membership_and_rules():
    buf = ExperienceBuffer(G)
    assert buf.update_group("a", [5, 6], 3, G, [traj(1, 2), traj(1, 3), traj(1, 4)], 0) == "added"
    assert "a" in buf and len(buf) == 1 and buf.bucket_of("a") == 3
    assert buf.num_trajectories == 3
    assert buf.prompt_ids("a").dtype == np.int32 and list(buf.prompt_ids("a")) == [5, 6]

    # 0/G: not added when new; a pooled question keeps its bucket (official).
    assert buf.update_group("b", [5], 0, G, [], 0) == "skipped"
    assert "b" not in buf
    assert buf.update_group("a", [5, 6], 0, G, [], 1) == "unchanged"
    assert buf.bucket_of("a") == 3 and buf.num_trajectories == 3

    # latest correctness moves the bucket; distinct new trajectories appended.
    assert buf.update_group("a", [5, 6], 6, G, [traj(1, 2), traj(9, 9, 9)], 2) == "updated"
    assert buf.bucket_of("a") == 6
    assert [list(t.completion_ids) for t in buf.trajectories("a")] == [[1, 2], [1, 3], [1, 4], [9, 9, 9]]
    assert buf.trajectories("a")[-1].step_added == 2
    assert buf.bucket_histogram() == {1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 6: 1, 7: 0}

    # G/G retires: removed from the pool, in the retired set.
    assert buf.update_group("a", [5, 6], G, G, [], 3) == "retired"
    assert "a" not in buf and buf.is_retired("a") and "a" in buf.retired
    assert buf.num_retired == 1 and len(buf) == 0 and buf.num_trajectories == 0
    assert buf.nbytes() == 0
    # a retired question is never re-added.
    assert buf.update_group("a", [5, 6], 4, G, [traj(3, 3)], 4) == "retired"
    assert "a" not in buf
    # a question solved G/G the first time it is seen is retired too.
    assert buf.update_group("c", [1], G, G, [traj(1)] * G, 4) == "retired"
    assert buf.is_retired("c") and "c" not in buf
    with pytest.raises(KeyError):
        buf.bucket_of("a")
    with pytest.raises(ValueError):
        buf.update_group("d", [1], 9, G, [], 0)


def test_dedupe_identical_trajectories():
    buf = ExperienceBuffer(G)
    same = [traj(4, 5, 6), traj(4, 5, 6), traj(4, 5, 6, 7), traj(4, 5, 6)]
    assert buf.update_group("q", [1], 4, G, same, 0) == "added"
    assert buf.num_trajectories == 2
    # later groups: duplicates of stored ones (e.g. the replayed trajectory) are dropped,
    # regardless of their log-probs.
    buf.update_group("q", [1], 5, G, [traj(4, 5, 6, logp=[-1, -1, -1]), traj(8)], 1)
    assert [list(t.completion_ids) for t in buf.trajectories("q")] == [[4, 5, 6], [4, 5, 6, 7], [8]]
    # a StoredTrajectory given back is recognised too and keeps its step.
    stored = buf.trajectories("q")[0]
    buf.update_group("q", [1], 5, G, [stored], 2)
    assert buf.num_trajectories == 3
    assert buf.stats()["num_duplicates_dropped"] == 4


def test_new_question_without_trajectories_is_skipped():
    buf = ExperienceBuffer(G)
    assert buf.update_group("q", [1], 3, G, [], 0) == "skipped"
    assert "q" not in buf and len(buf) == 0


def test_xrpo_group_sizes_map_by_rate():
    # rate * G rounded half up, clipped to 1..G-1
    assert bucket_index(3, 8, 8) == 3
    assert bucket_index(1, 16, 8) == 1  # 0.5 -> 1
    assert bucket_index(3, 16, 8) == 2  # 1.5 -> 2
    assert bucket_index(5, 16, 8) == 3  # 2.5 -> 3
    assert bucket_index(1, 32, 8) == 1  # 0.25 -> 0 -> clipped to 1
    assert bucket_index(31, 32, 8) == 7  # 7.75 -> 8 -> clipped to 7
    assert bucket_index(8, 16, 8) == 4
    assert bucket_index(1, 2, 8) == 4
    buf = ExperienceBuffer(G)
    assert buf.update_group("x", [1], 15, 16, [traj(1)], 0) == "added"
    assert buf.bucket_of("x") == 7  # 7.5 -> 8 -> clipped
    assert buf.update_group("x", [1], 16, 16, [], 1) == "retired"
    assert buf.update_group("y", [1], 0, 24, [], 1) == "skipped"
    assert buf.update_group("z", [1], 6, 24, [traj(2)], 1) == "added"
    assert buf.bucket_of("z") == 2


def test_unimplemented_and_unknown_modes_raise():
    for mode in UNIMPLEMENTED_BUCKET_WEIGHTINGS:
        with pytest.raises(ValueError, match="not implemented"):
            ExperienceBuffer(G, bucket_weighting=mode)
    with pytest.raises(ValueError, match="unknown"):
        ExperienceBuffer(G, bucket_weighting="bogus")
    assert set(BUCKET_WEIGHTING.names()) >= {"gaussian", "uniform"}


# ------------------------------------------------------------------------- sampling


def test_gaussian_bucket_frequencies_single_draws():
    buf = ExperienceBuffer(G, seed=1)
    fill(buf, {2: 50, 3: 50, 4: 50, 5: 50, 6: 50})
    expected = gaussian_probs([2, 3, 4, 5, 6])
    assert buf.bucket_probabilities() == pytest.approx({**{1: 0.0, 7: 0.0}, **expected})
    counts = Counter()
    for _ in range(100_000):
        (qid,) = buf.sample_questions(1)
        counts[buf.bucket_of(qid)] += 1
    for k, p in expected.items():
        assert abs(counts[k] / 100_000 - p) < 0.01, (k, counts[k] / 100_000, p)


def test_gaussian_bucket_frequencies_batched_draws():
    # Ample buckets (no overflow): count every sampled question's bucket.
    buf = ExperienceBuffer(G, seed=2)
    fill(buf, {1: 400, 3: 400, 4: 400, 7: 400})
    expected = gaussian_probs([1, 3, 4, 7])
    counts = Counter()
    draws = 0
    for _ in range(1_600):
        ids = buf.sample_questions(64)
        assert len(set(ids)) == 64
        draws += len(ids)
        counts.update(buf.bucket_of(q) for q in ids)
    assert draws == 102_400
    for k, p in expected.items():
        assert abs(counts[k] / draws - p) < 0.01, (k, counts[k] / draws, p)


def test_count_scale_weights_equal_rate_scale():
    # official count scale (mu = G/2, sigma = 1 for G = 8) == rate scale (0.5, 0.125)
    k = np.arange(1, G)
    count_scale = np.exp(-0.5 * ((k - G / 2) / 1.0) ** 2)
    buf = ExperienceBuffer(G)
    fill(buf, {kk: 1 for kk in range(1, G)})
    probs = np.array([buf.bucket_probabilities()[kk] for kk in range(1, G)])
    np.testing.assert_allclose(probs, count_scale / count_scale.sum(), rtol=1e-12)


def test_uniform_mode_is_uniform_over_questions():
    buf = ExperienceBuffer(G, bucket_weighting="uniform", seed=3)
    fill(buf, {1: 10, 4: 30, 7: 60})
    counts = Counter()
    per_question = Counter()
    for _ in range(5_000):
        ids = buf.sample_questions(20)
        assert len(set(ids)) == 20
        counts.update(buf.bucket_of(q) for q in ids)
        per_question.update(ids)
    total = 100_000
    for k, size in {1: 10, 4: 30, 7: 60}.items():
        assert abs(counts[k] / total - size / 100) < 0.01
    # every question: 20/100 inclusion probability per call
    freqs = np.array([per_question[q] / 5_000 for q in per_question])
    assert len(per_question) == 100
    assert np.all(np.abs(freqs - 0.2) < 0.03)


def test_uniform_buckets_mode():
    buf = ExperienceBuffer(G, bucket_weighting="uniform_buckets", seed=4)
    fill(buf, {1: 100, 4: 100, 6: 100})
    counts = Counter(buf.bucket_of(buf.sample_questions(1)[0]) for _ in range(30_000))
    for k in (1, 4, 6):
        assert abs(counts[k] / 30_000 - 1 / 3) < 0.01


def test_overflow_redistribution():
    # Bucket 4 carries ~all the weight but holds only 3 questions; the excess goes to the
    # other buckets in proportion to their weights (renormalised over buckets with spare).
    buf = ExperienceBuffer(G, seed=5)
    fill(buf, {4: 3, 2: 200, 6: 200, 1: 200})
    w = gaussian_probs([1, 2, 6])
    counts = Counter()
    calls = 3_000
    for _ in range(calls):
        ids = buf.sample_questions(40)
        assert len(ids) == 40 and len(set(ids)) == 40
        c = Counter(buf.bucket_of(q) for q in ids)
        assert c[4] == 3  # P(bucket 4 gets < 3 of 40 draws) is negligible
        counts.update(c)
    # excess 37 per call redistributed by the weights of buckets 1, 2, 6
    for k in (1, 2, 6):
        assert abs(counts[k] / (37 * calls) - w[k]) < 0.01, (k, counts[k] / (37 * calls), w[k])


def test_overflow_cascade_and_n_larger_than_pool():
    buf = ExperienceBuffer(G, seed=6)
    fill(buf, {1: 2, 3: 2, 4: 2, 5: 3, 7: 1})
    ids = buf.sample_questions(9)
    assert len(ids) == 9 and len(set(ids)) == 9
    everything = buf.sample_questions(1000)
    assert sorted(everything) == sorted(buf)
    assert buf.sample_questions(0) == []
    assert ExperienceBuffer(G).sample_questions(5) == []


def test_sampling_without_replacement_within_bucket():
    buf = ExperienceBuffer(G, seed=7)
    fill(buf, {4: 50})
    seen = Counter()
    for _ in range(2_000):
        ids = buf.sample_questions(30)
        assert len(ids) == 30 and len(set(ids)) == 30
        seen.update(ids)
    freqs = np.array([seen[q] / 2_000 for q in buf])
    assert np.all(np.abs(freqs - 0.6) < 0.06)  # uniform inclusion probability 30/50


def test_sampling_after_removals_keeps_index_consistent():
    buf = ExperienceBuffer(G, seed=8)
    fill(buf, {2: 30, 5: 30})
    rng = np.random.default_rng(0)
    for i, qid in enumerate(list(buf)):
        r = rng.random()
        if r < 0.3:
            buf.update_group(qid, [1], G, G, [], 1)  # retire
        elif r < 0.6:
            buf.update_group(qid, [1], 7 - buf.bucket_of(qid), G, [], 1)  # move 2 <-> 5
    pooled = set(buf)
    hist = Counter(buf.bucket_of(q) for q in pooled)
    assert buf.bucket_histogram() == {k: hist.get(k, 0) for k in range(1, G)}
    for _ in range(200):
        ids = buf.sample_questions(10)
        assert set(ids) <= pooled and len(set(ids)) == len(ids) == min(10, len(pooled))


def test_excluded_questions_are_never_drawn_and_the_rest_keep_the_rule():
    buf = ExperienceBuffer(G, seed=9)
    fill(buf, {1: 20, 4: 3, 7: 20})
    mid = {f"q4_{i}" for i in range(3)}
    # without exclusion the 3 mid questions are taken on (nearly) every 4-question draw
    assert all(mid <= set(buf.sample_questions(4)) for _ in range(50))
    seen = Counter()
    for _ in range(2_000):
        ids = buf.sample_questions(4, exclude=mid)
        assert len(ids) == 4 == len(set(ids)) and not (set(ids) & mid)
        seen.update(buf.bucket_of(q) for q in ids)
    # buckets 1 and 7 have equal Gaussian weight: the draw splits between them evenly
    assert abs(seen[1] / (seen[1] + seen[7]) - 0.5) < 0.05
    # excluding everything but two questions returns those two
    rest = set(buf) - {"q1_0", "q7_0"}
    assert sorted(buf.sample_questions(5, exclude=rest)) == ["q1_0", "q7_0"]


def test_empty_exclusion_keeps_the_official_random_stream():
    a, b = ExperienceBuffer(G, seed=3), ExperienceBuffer(G, seed=3)
    fill(a, {2: 5, 4: 4, 6: 7})
    fill(b, {2: 5, 4: 4, 6: 7})
    assert [a.sample_questions(6) for _ in range(20)] == [b.sample_questions(6, exclude=set()) for _ in range(20)]


# ------------------------------------------------------------------------- trajectory choice


def test_choose_trajectory_modes():
    stats = [(0.9, -0.5), (0.2, -1.5), (0.2, -0.1), (0.7, -0.1)]
    assert choose_trajectory(stats, "lowest_entropy", None) == 1  # tie 1/2 -> lowest index
    assert choose_trajectory(stats, "highest_logp", None) == 2  # tie 2/3 -> lowest index
    assert choose_trajectory(stats, "lowest_logp", None) == 1
    dicts = [{"mean_entropy": e, "mean_logp": lp} for e, lp in stats]
    assert choose_trajectory(dicts, "lowest_entropy", None) == 1
    assert choose_trajectory([{"mean_entropy": 3.0}, {"mean_entropy": 1.0}], "lowest_entropy") == 1
    rng = np.random.default_rng(0)
    picks = Counter(choose_trajectory(stats, "random", rng) for _ in range(4_000))
    assert set(picks) == {0, 1, 2, 3} and min(picks.values()) > 850
    assert 0 <= choose_trajectory(stats, "random", random.Random(0)) < 4
    assert choose_trajectory([(np.nan, 0.0), (1.0, 0.0)], "lowest_entropy") == 1
    with pytest.raises(ValueError):
        choose_trajectory(stats, "bogus", rng)
    with pytest.raises(ValueError):
        choose_trajectory([], "lowest_entropy", rng)
    assert set(TRAJECTORY_SELECTION.names()) == {"lowest_entropy", "highest_entropy", "highest_logp", "lowest_logp", "random"}
    assert choose_trajectory([(1.0, 0.0), (3.0, 0.0), (3.0, 0.0), (np.nan, 0.0)], "highest_entropy") == 1


def test_mean_over_tokens_is_over_response_tokens():
    ents = [np.array([1.0, 3.0]), np.array([0.5, 0.5, 0.5, 2.5]), np.array([])]
    means = mean_over_tokens(ents)
    np.testing.assert_allclose(means[:2], [2.0, 1.0])
    assert np.isnan(means[2])
    # padded form: pads are excluded (the official code's slip would count them)
    padded = np.array([[1.0, 3.0, 0.0, 0.0], [0.5, 0.5, 0.5, 2.5]])
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_allclose(mean_over_tokens(padded, mask), [2.0, 1.0])
    # trajectory 0 has the lower sum but the higher mean entropy
    stats = [(m, 0.0) for m in mean_over_tokens(padded, mask)]
    assert choose_trajectory(stats, "lowest_entropy") == 1


# ------------------------------------------------------------------------- memory


def test_capacity_eviction_rule():
    buf = ExperienceBuffer(G, capacity=6)
    buf.update_group("a", [1], 3, G, [traj(1), traj(2), traj(3)], 0)
    buf.update_group("b", [1], 4, G, [traj(4), traj(5)], 1)
    buf.update_group("c", [1], 5, G, [traj(6)], 2)
    assert buf.num_trajectories == 6
    # full: the oldest trajectory of the question with the most ("a") goes first
    buf.update_group("d", [1], 2, G, [traj(7)], 3)
    assert buf.num_trajectories == 6
    assert [int(t.completion_ids[0]) for t in buf.trajectories("a")] == [2, 3]
    # now a and b tie at 2: "b" reached 2 first (a came down to 2 later) -> b's oldest
    buf.update_group("d", [1], 2, G, [traj(8)], 4)
    assert [int(t.completion_ids[0]) for t in buf.trajectories("b")] == [5]
    assert [int(t.completion_ids[0]) for t in buf.trajectories("a")] == [2, 3]
    # a (2 trajs) and d (2 trajs): a reached 2 first -> a loses 2
    buf.update_group("e", [1], 2, G, [traj(9)], 5)
    assert [int(t.completion_ids[0]) for t in buf.trajectories("a")] == [3]
    st = buf.stats()
    assert st["num_trajectories"] == 6 and st["num_evicted_trajectories"] == 3


def test_eviction_of_last_trajectory_drops_question():
    buf = ExperienceBuffer(G, capacity=3)
    for i, q in enumerate("abc"):
        buf.update_group(q, [1], 3, G, [traj(i)], i)
    buf.update_group("d", [1], 3, G, [traj(10)], 3)  # all at 1: "a" (first) leaves the pool
    assert "a" not in buf and not buf.is_retired("a") and len(buf) == 3
    assert buf.stats()["num_evicted_questions"] == 1
    assert buf.update_group("a", [1], 3, G, [traj(0)], 4) == "added"  # may come back
    assert "b" not in buf
    # the question being updated is never dropped by its own update
    tiny = ExperienceBuffer(G, capacity=1)
    tiny.update_group("x", [1], 3, G, [traj(1)], 0)
    assert tiny.update_group("x", [1], 3, G, [traj(2), traj(3)], 1) == "updated"
    assert [int(t.completion_ids[0]) for t in tiny.trajectories("x")] == [3]
    assert tiny.num_trajectories == 1 and len(tiny) == 1


def test_max_trajectories_per_question():
    buf = ExperienceBuffer(G, max_trajectories_per_question=2)
    buf.update_group("a", [1], 3, G, [traj(1), traj(2), traj(3)], 0)
    assert [int(t.completion_ids[0]) for t in buf.trajectories("a")] == [2, 3]
    assert buf.num_trajectories == 2


def test_nbytes_counts_int32_and_float16():
    buf = ExperienceBuffer(G)
    buf.update_group("a", np.arange(10), 3, G, [traj(*range(100)), traj(*range(50))], 0)
    t = buf.trajectories("a")[0]
    assert t.completion_ids.dtype == np.int32 and t.logp.dtype == np.float16
    assert not t.completion_ids.flags.writeable
    assert buf.nbytes() == 10 * 4 + 150 * (4 + 2)
    assert buf.stats()["bytes_per_token"] == 6.0
    buf.update_group("a", np.arange(10), G, G, [], 1)
    assert buf.nbytes() == 0
    b32 = ExperienceBuffer(G, logp_dtype="float32")
    b32.update_group("a", [1, 2], 3, G, [traj(1, 2, 3)], 0)
    assert b32.nbytes() == 2 * 4 + 3 * 8
    bf = ExperienceBuffer(G, logp_dtype="bfloat16")
    bf.update_group("a", [1, 2], 3, G, [traj(1, 2, 3)], 0)
    assert bf.nbytes() == 2 * 4 + 3 * 6 and bf.trajectories("a")[0].logp.dtype == np.uint16


def test_logp_encodings_round_trip():
    x = np.array([-0.0, -1e-4, -0.37, -3.14159, -20.5, -1e6, 0.0], dtype=np.float32)
    f16 = decode_logp(encode_logp(x, "float16"))
    assert f16[5] == -65504.0
    np.testing.assert_allclose(f16[:5], x[:5], rtol=1e-3, atol=1e-7)
    bf = decode_logp(encode_logp(x, "bfloat16"))
    np.testing.assert_allclose(bf, x, rtol=4e-3)
    # bfloat16 bits equal the float32 upper half after round-to-nearest-even
    assert encode_logp(np.array([1.0], np.float32), "bfloat16")[0] == 0x3F80
    np.testing.assert_array_equal(decode_logp(encode_logp(x, "float32")), x)
    buf = ExperienceBuffer(G, logp_dtype="bfloat16")
    buf.update_group("a", [1], 3, G, [traj(1, 2, logp=[-0.5, -2.0])], 0)
    np.testing.assert_array_equal(buf.trajectories("a")[0].logp_float32(), [-0.5, -2.0])


# ------------------------------------------------------------------------- state


def _populated(seed=11):
    buf = ExperienceBuffer(G, capacity=300, seed=seed)
    rng = np.random.default_rng(seed)
    for step in range(40):
        for j in range(20):
            qid = f"q{rng.integers(200)}"
            k = int(rng.integers(0, G + 1))
            trajs = [traj(*rng.integers(0, 50, size=rng.integers(1, 6))) for _ in range(k)]
            buf.update_group(qid, rng.integers(0, 100, size=5), k, G, trajs, step)
        buf.sample_questions(7)
    return buf


def test_state_round_trip_exact():
    buf = _populated()
    assert buf.num_retired > 0 and len(buf) > 20 and buf.num_trajectories == 300
    state = pickle.loads(pickle.dumps(buf.get_state()))
    twin = ExperienceBuffer.from_state(state)
    other = ExperienceBuffer(4, seed=99)
    other.set_state(state)
    for b in (twin, other):
        assert list(b) == list(buf)
        assert b.stats() == buf.stats()
        assert set(b.retired) == set(buf.retired)
        for q in buf:
            assert b.bucket_of(q) == buf.bucket_of(q)
            np.testing.assert_array_equal(b.prompt_ids(q), buf.prompt_ids(q))
            for t1, t2 in zip(b.trajectories(q), buf.trajectories(q), strict=True):
                np.testing.assert_array_equal(t1.completion_ids, t2.completion_ids)
                np.testing.assert_array_equal(t1.logp, t2.logp)
                assert t1.logp.dtype == t2.logp.dtype and t1.step_added == t2.step_added
    # identical subsequent behaviour: samples, updates, evictions
    rngs = [np.random.default_rng(5) for _ in range(3)]
    for step in range(40, 60):
        assert twin.sample_questions(16) == buf.sample_questions(16) == other.sample_questions(16)
        for b, rng in zip((buf, twin, other), rngs):
            for j in range(10):
                qid = f"q{rng.integers(300)}"
                k = int(rng.integers(0, G + 1))
                b.update_group(qid, [1, 2], k, G, [traj(*rng.integers(0, 50, size=3)) for _ in range(k)], step)
        assert list(twin) == list(buf) == list(other) and twin.stats() == buf.stats() == other.stats()
        for q in buf:
            assert [t.completion_ids.tolist() for t in twin.trajectories(q)] == [t.completion_ids.tolist() for t in buf.trajectories(q)]


def test_stored_trajectory_type():
    buf = ExperienceBuffer(G)
    buf.update_group("a", [1], 3, G, [traj(1, 2)], 7)
    t = buf.trajectories("a")[0]
    assert isinstance(t, StoredTrajectory) and t.step_added == 7 and t.num_tokens == 2
