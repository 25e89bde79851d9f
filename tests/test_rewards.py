"""The verifier reward: right answers, bounded time, and the same verdicts in every context."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rllib_exgrpo.envs import rewards, verifier_pool
from rllib_exgrpo.envs.datasets import load_problems
from rllib_exgrpo.envs.rewards import RewardResult, last_boxed, math_reward, score_batch

HANG = "\\boxed{9^{9^{9^{9^9}}}}"
#: Seconds a cut hang may take beyond its timeout: a verifier worker booting on a loaded
#: machine (tests run in parallel). Far below the hang itself, which does not end.
SLACK_S = 8.0
REPO = Path(__file__).resolve().parents[1]

# (completion, ground truth, expected score): exercises math-verify, not just the fast path.
CASES = [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so \\boxed{0.5}", "\\frac12", 1.0),
    ("\\boxed{3}", "0.5", 0.0),
    ("\\boxed{27.0}", "27", 1.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{(3, \\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{3}", "\\left( 3, \\frac{\\pi}{2} \\right)", 0.0),
    ("\\boxed{\\frac{14}{3}}", "\\frac{14}{3}", 1.0),
    ("\\boxed{4.666}", "\\frac{14}{3}", 0.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{1,2}", "\\{1,2\\}", 1.0),
    ("first \\boxed{5} then finally \\boxed{7}", "7", 1.0),
    ("first \\boxed{7} then finally \\boxed{5}", "7", 0.0),
    ("\\boxed{\\sqrt{3}/2}", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
]


@pytest.fixture(scope="module", autouse=True)
def warm_pool():
    rewards.warm_up()


def _scores(results):
    return [r.score for r in results]


def test_last_boxed_handles_nesting_and_truncation():
    assert last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\boxed{1} and \\boxed{2}") == "2"
    assert last_boxed("\\boxed{1} and \\boxed{2") == "1"  # cut off: the last complete one
    assert last_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert last_boxed("\\boxed 5.") == "5"
    assert last_boxed("\\fbox{4}") == "4"
    assert last_boxed("no box") is None


@pytest.mark.parametrize("completion,truth,expected", CASES)
def test_math_reward_through_math_verify(completion, truth, expected):
    result = math_reward(completion, truth, fast_path=False)
    assert isinstance(result, RewardResult)
    assert result.score == expected, result
    assert result.format_ok and not result.timed_out and result.error is None


def test_format_rules():
    missing = math_reward("the answer is 5", "5")
    assert (missing.score, missing.format_ok, missing.parsed) == (0.0, False, None)
    empty = math_reward("\\boxed{}", "5")
    assert (empty.score, empty.format_ok, empty.parsed) == (0.0, True, "")
    # Official ExGRPO reward: the text after </think> is verified, no tag -> 0.
    ok = math_reward("<think>maybe 4</think> so it is \\boxed{5}", "5", think_format=True)
    assert (ok.score, ok.format_ok, ok.parsed) == (1.0, True, "5")
    no_tag = math_reward("<think>so it is \\boxed{5}", "5", think_format=True)
    assert (no_tag.score, no_tag.format_ok) == (0.0, False)
    inside = math_reward("<think>\\boxed{5}</think> I give up", "5", think_format=True)
    assert inside.score == 0.0 and inside.format_ok
    unboxed = math_reward("<think>...</think> The answer is $\\frac{1}{2}$.", "0.5", think_format=True)
    assert unboxed.score == 1.0


def test_errors_are_reported_not_silently_zeroed():
    result = math_reward("\\boxed{1}", "   ")
    assert result.score == 0.0 and result.error
    with pytest.raises(TypeError):
        math_reward(None, "1")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        score_batch(["\\boxed{1}"], ["1", "2"])


def test_hanging_verification_is_cut_and_does_not_block_the_batch():
    completions = [HANG] + [f"\\boxed{{{i}.0}}" for i in range(12)]
    truths = ["5"] + [str(i if i % 3 else i + 1) for i in range(12)]
    rewards.warm_up()  # deadlines count from when a worker takes the item; boot is extra
    kills = rewards.reward_stats().get("worker_kills", 0)
    start = time.monotonic()
    results = score_batch(completions, truths, timeout_s=2.0)
    elapsed = time.monotonic() - start
    print(f"hang in a batch: {elapsed:.2f} s for a 2 s timeout")
    # Cut at the timeout, not when the hang ends (hours): the margin absorbs a verifier
    # worker's boot on a loaded machine (tests run two at a time on 2 cores).
    assert elapsed < 2.0 + SLACK_S, elapsed
    assert results[0].timed_out and results[0].score == 0.0 and results[0].error is None
    assert _scores(results[1:]) == [0.0 if i % 3 == 0 else 1.0 for i in range(12)]
    assert not any(r.timed_out for r in results[1:])
    assert rewards.reward_stats()["worker_kills"] == kills + 1
    # The pool recovered: the next batch is right again.
    assert math_reward("\\boxed{0.5}", "\\frac{1}{2}", fast_path=False).score == 1.0


def test_hang_inside_thread_pool_times_out_and_neighbours_finish():
    jobs = [(HANG, "5")] + [(f"\\boxed{{{i}}}", str(i)) for i in range(6)]
    rewards.warm_up()  # the previous test's replacement worker may still be booting
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda a: math_reward(*a, timeout_s=1.5, fast_path=False), jobs))
    elapsed = time.monotonic() - start
    print(f"hang in a thread pool: {elapsed:.2f} s for a 1.5 s timeout")
    assert elapsed < 1.5 + SLACK_S, elapsed  # cut at the timeout (see SLACK_S)
    assert results[0].timed_out
    assert _scores(results[1:]) == [1.0] * 6


def test_same_scores_from_threads_as_from_main_thread():
    completions = [c for c, _, _ in CASES] * 3
    truths = [t for _, t, _ in CASES] * 3
    main = score_batch(completions, truths, fast_path=False)
    assert _scores(main) == [e for _, _, e in CASES] * 3
    with ThreadPoolExecutor(max_workers=4) as pool:
        single = list(pool.map(lambda a: math_reward(a[0], a[1], fast_path=False), zip(completions, truths)))
        chunks = [(completions[i : i + 7], truths[i : i + 7]) for i in range(0, len(completions), 7)]
        batched = [r for rs in pool.map(lambda ch: score_batch(*ch, fast_path=False), chunks) for r in rs]
    assert single == main
    assert batched == main


def test_worker_killed_from_outside_is_replaced():
    rewards.warm_up()
    pool = verifier_pool._pool()
    with pool._lock:
        victims = [w.proc for w in pool._all]
    for proc in victims:
        proc.kill()
        proc.wait()
    result = score_batch(["\\boxed{0.5}", "\\boxed{2}"], ["\\frac{1}{2}", "3"], fast_path=False)
    assert _scores(result) == [1.0, 0.0]
    assert all(r.error is None for r in result)


def _child_score(queue):
    from rllib_exgrpo.envs.rewards import score_batch as sb

    queue.put([r.score for r in sb(["\\boxed{0.5}", "\\boxed{2}", HANG], ["\\frac{1}{2}", "3", "1"], timeout_s=1.0, fast_path=False)])


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_scores_inside_multiprocessing_children(method):
    """Forked children must not reuse the parent's pipes; daemonic ones cannot use
    multiprocessing themselves (hence subprocess-based workers)."""
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    child = ctx.Process(target=_child_score, args=(queue,), daemon=True)
    child.start()
    try:
        assert queue.get(timeout=60) == [1.0, 0.0, 0.0]
    finally:
        child.join(10)
    # The parent's pool is untouched by the child.
    assert math_reward("\\boxed{0.5}", "\\frac{1}{2}", fast_path=False).score == 1.0


def test_scores_in_a_plain_subprocess():
    code = (
        "from rllib_exgrpo.envs.rewards import score_batch\n"
        "print([r.score for r in score_batch(['\\\\boxed{0.5}', '\\\\boxed{3}'], ['1/2', '4'], fast_path=False)])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.0, 0.0]"


def test_pool_loads_as_a_bare_script_and_rewards_import_the_standard_library_only():
    """Workers load verifier_pool.py by path; rewards.py (which the workers import for the
    built-in reward functions, and the TRL benchmark imports without ray) pulls in no
    third-party package at import."""
    code = (
        "import sys, importlib.util as u\n"
        f"s = u.spec_from_file_location('bare_pool', {str(REPO / 'rllib_exgrpo' / 'envs' / 'verifier_pool.py')!r})\n"
        "m = u.module_from_spec(s); s.loader.exec_module(m)\n"
        "import rllib_exgrpo.envs.rewards\n"
        "names = {n.split('.')[0] for n in sys.modules} - set(sys.stdlib_module_names)\n"
        "print(sorted(n for n in names if not n.startswith('_') and n != 'rllib_exgrpo'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie is dead, merely not yet reaped by whoever adopted it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_hung_worker_dies_with_its_parent():
    """A trainer that crashes must not leave a verifier spinning on 9^9^9^9^9 forever."""
    code = (
        "import threading, time\n"
        "from rllib_exgrpo.envs import rewards, verifier_pool\n"
        "rewards.warm_up(1)\n"
        f"threading.Thread(target=rewards.score_batch, args=([{HANG!r}], ['5']), kwargs={{'timeout_s': 600}},"
        " daemon=True).start()\n"
        "time.sleep(1.0)\n"
        "print(' '.join(str(w.proc.pid) for w in verifier_pool._pool()._all), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
    finally:
        proc.kill()
        proc.wait()
    assert pids and all(pid != proc.pid for pid in pids)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def test_stats_count_work():
    rewards.reset_reward_stats()
    score_batch(["\\boxed{1}", "\\boxed{1}", "\\boxed{2}", "\\boxed{2}", "none"], ["1", "1", "3", "3", "1"])
    stats = rewards.reward_stats()
    assert stats["scored"] == 5
    assert stats["fast_path"] == 2
    assert stats["verified"] == 1  # the two identical wrong pairs are verified once


def test_arithmetic_batch_is_fast():
    """The training loop scores ~256 completions a step; short answers must cost well under 1 s."""
    completions = [f"... so the answer is \\boxed{{{i * 7 + (i % 2)}}}" for i in range(256)]
    truths = [str(i * 7) for i in range(256)]
    score_batch(completions[:8], truths[:8])  # parse caches warm
    start = time.monotonic()
    results = score_batch(completions, truths)
    elapsed = time.monotonic() - start
    print(f"256 arithmetic answers (half wrong, all through math-verify): {elapsed:.3f} s")
    assert _scores(results) == [1.0 if i % 2 == 0 else 0.0 for i in range(256)]
    assert elapsed < 3.0  # generous: shared CI machines


# --------------------------------------------------------------------------- acceptance


def _pairs(problems):
    """Each row's ground truth, and the next row's ground truth that differs as a string."""
    truths = [p.ground_truth for p in problems]
    wrong = []
    for i, truth in enumerate(truths):
        other = next(truths[(i + j) % len(truths)] for j in range(1, len(truths)) if truths[(i + j) % len(truths)].strip() != truth.strip())
        wrong.append(other)
    return truths, wrong


def _acceptance(path: Path, timeout_s: float = 5.0):
    problems = load_problems(path, strict=True)
    truths, wrong = _pairs(problems)
    correct = score_batch([f"The answer is \\boxed{{{t}}}." for t in truths], truths, timeout_s=timeout_s, fast_path=False)
    swapped = score_batch([f"\\boxed{{{w}}}" for w in wrong], truths, timeout_s=timeout_s, fast_path=False)
    pos = sum(r.score for r in correct) / len(correct)
    neg = sum(r.score == 0.0 for r in swapped) / len(swapped)
    errors = sum(r.error is not None for r in correct + swapped)
    print(f"{path.name}: {len(truths)} rows, own ground truth scores 1: {pos:.2%}, another row's scores 0: {neg:.2%}, errors {errors}")
    assert pos >= 0.99
    assert neg >= 0.99
    assert errors == 0


@pytest.mark.parametrize("bench", ["aime24", "amc23", "gsm8k", "math500"])
def test_acceptance_simplerl_eval(shared_data, bench):
    _acceptance(shared_data / "simplerl_eval" / f"{bench}_test.jsonl")


@pytest.mark.slow
def test_acceptance_exgrpo_valid_parquet(shared_data):
    # ~2 min on 2 cores: Minerva's symbolic answers make math-verify slow (seconds per pair).
    _acceptance(shared_data / "luffy_exgrpo" / "ExGRPO_data_valid.parquet")


# --------------------------------------------------------------------------- Ray


# ``ray_local`` (tests/conftest.py): one private local Ray for the whole session, whose
# workers have the repository on their PYTHONPATH.


def test_same_scores_from_ray_actor_with_concurrency(ray_local):
    ray = ray_local

    @ray.remote(max_concurrency=4)
    class Scorer:
        def score(self, completions, truths, timeout_s=5.0):
            from rllib_exgrpo.envs.rewards import score_batch as sb

            return [r.score for r in sb(completions, truths, timeout_s=timeout_s, fast_path=False)]

        def one(self, completion, truth):
            from rllib_exgrpo.envs.rewards import math_reward as mr

            return mr(completion, truth, fast_path=False).score

        def timed(self, completions, truths, timeout_s):
            import time as t

            from rllib_exgrpo.envs.rewards import score_batch as sb

            start = t.monotonic()
            out = sb(completions, truths, timeout_s=timeout_s)
            return t.monotonic() - start, [(r.score, r.timed_out) for r in out]

    completions = [c for c, _, _ in CASES]
    truths = [t for _, t, _ in CASES]
    expected = [e for _, _, e in CASES]
    actor = Scorer.remote()
    # Four concurrent calls run on four actor threads, none of them the main thread.
    batches = ray.get([actor.score.remote(completions, truths) for _ in range(4)], timeout=180)
    assert all(b == expected for b in batches)
    singles = ray.get([actor.one.remote(c, t) for c, t in zip(completions, truths)], timeout=180)
    assert singles == expected
    elapsed, verdicts = ray.get(actor.timed.remote([HANG, "\\boxed{2.0}"], ["5", "2"], 1.5), timeout=60)
    assert verdicts == [(0.0, True), (1.0, False)]
    assert elapsed < 1.5 + SLACK_S, elapsed  # cut at the timeout (see SLACK_S)
