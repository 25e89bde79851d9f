"""The studies' machinery (benchmarks/_runs.py, experiments/compare.py, learning_curves.py)
on a two-step budget: every method is evaluated the same way, runs stop at GRPO's token
budget, and finished runs are cached and reused."""

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the studies, and the helpers (_common, _runs) they share with the benchmarks
sys.path[:0] = [str(REPO / "experiments"), str(REPO / "benchmarks")]

pytestmark = pytest.mark.slow


def test_compare_runs_share_budget_and_cache(ray_local, quick_tiny_model, tmp_path):
    import _runs
    import compare
    import learning_curves

    runs = _runs.collect(
        ["ppo", "grpo", "exgrpo"],
        [0],
        iterations=2,
        eval_interval=1,
        overrides={},
        out=tmp_path,
        model=quick_tiny_model,
        log=lambda *_: None,
    )
    by_algo = {r["algo"]: r for r in runs}
    budget = _runs.budget_of(runs, 0, 2)
    assert budget == by_algo["grpo"]["steps"][1]["tokens"] > 0
    for name, run in by_algo.items():
        tokens = [s["tokens"] for s in run["steps"]]
        assert tokens == sorted(tokens) and tokens[0] > 0, name
        assert len(run["steps"]) >= 2 and tokens[-1] >= budget, name  # ran to both stops
        assert [e["step"] for e in run["evals"]][:3] == [0, 1, 2], name
        # accuracies of the same fixed question set: multiples of 1 / questions
        assert all(
            abs(e["accuracy"] * _runs.HELDOUT_QUESTIONS - round(e["accuracy"] * _runs.HELDOUT_QUESTIONS)) < 1e-6 for e in run["evals"]
        ), name
        assert not math.isnan(_runs.accuracy_at_tokens(run, budget)), name
    # The same model and evaluation for everyone: identical starting accuracy.
    assert len({r["evals"][0]["accuracy"] for r in runs}) == 1
    assert len(list((tmp_path / "runs").glob("*.json"))) == 3

    again = _runs.collect(
        ["ppo", "grpo", "exgrpo"],
        [0],
        iterations=2,
        eval_interval=1,
        overrides={},
        out=tmp_path,
        model=quick_tiny_model,
        log=lambda *_: None,
    )
    assert json.dumps(again) == json.dumps(runs)  # read back from the cache, nothing retrained

    budgets, table = compare.budget_table(runs, [0], 2)
    assert budgets == {0: budget} and any(line.startswith("PPO (RLlib)") for line in table)
    lines = learning_curves.summary_lines(runs, 2)
    assert any(line.startswith("ExGRPO") and "x" in line for line in lines)


def _synthetic_run(seed: int, acc: list, reward: float) -> dict:
    """A testbed run record as _runs.train_run writes it, 20 steps, evaluations every 10."""
    steps = [
        {
            "step": k,
            "tokens": 1000.0 * k,
            "wall_s": 1.0,
            "solve_rate": reward,
            "episodes": 8.0,
            "experience": {"pool_size": 3.0, "retired": 1.0},
            "xrpo": {},
            "stage_s": {},
            "top": {"zero_variance_group_fraction": 0.5},
            "learner": {"entropy": 0.1},
        }
        for k in range(1, 21)
    ]
    evals = [{"step": s, "tokens": 1000.0 * s, "accuracy": a, "val": a - 0.01} for s, a in zip((0, 10, 20), acc)]
    return {"seed": seed, "steps": steps, "evals": evals, "budget_step": 20}


def test_testbed_reading_report_and_plot_on_hand_made_runs(tmp_path):
    """The testbed's reading side on hand-made runs: the figure at the budget, the tail
    mean, the 95% interval, the paired difference, the table and the PNG."""
    import experience_testbed as tb

    runs = {
        "grpo": [_synthetic_run(0, [0.3, 0.4, 0.5], 0.4), _synthetic_run(1, [0.3, 0.45, 0.55], 0.4)],
        "exgrpo": [_synthetic_run(0, [0.3, 0.5, 0.6], 0.5), _synthetic_run(1, [0.3, 0.5, 0.62], 0.5)],
    }
    budgets = {0: 20000.0, 1: 20000.0}
    assert tb.at_budget(runs["grpo"][0], 20000.0, "accuracy") == 0.5
    assert tb.tail(runs["grpo"][0], 20000.0, "accuracy", frac=0.5) == pytest.approx(0.45)  # steps 10 and 20
    mean, half, n = tb.ci95([0.5, 0.55])
    assert (mean, n) == (pytest.approx(0.525), 2) and half == pytest.approx(12.706 * 0.05 / math.sqrt(2) / math.sqrt(2), rel=1e-3)
    line = tb.paired(runs, budgets, "exgrpo", "grpo")
    assert "+0.085" in line and "n=2" in line  # (0.6 - 0.5 + 0.62 - 0.55) / 2
    table = tb.report(runs, budgets, "grpo")
    assert any(row.startswith("exgrpo") and "0.610" in row for row in table)
    # the first common evaluation whose seed-mean reaches a target, in mean tokens
    assert tb.tokens_to_reach(runs["exgrpo"], 0.5) == 10000.0 and tb.tokens_to_reach(runs["grpo"], 0.9) is None
    reach = tb.reach_lines(runs, budgets, "grpo")  # GRPO's final: (0.5 + 0.55) / 2
    assert "0.525" in reach[0] and "20,000 tokens = 1.00 x budget" in reach[1] and "1.00 x" in reach[2]
    # the weak-start reading: start, the first evaluation at or past half the budget
    # (10,000 tokens: step 10), the change from the start and the paired difference
    half = tb.half_budget_lines(runs, budgets, "grpo")
    assert "seed 0: 10,000" in half[0]
    assert "start 0.300  test 0.425" in half[1] and "change from start +0.125" in half[1]  # (0.4 + 0.45) / 2
    assert "start 0.300  test 0.500" in half[2]
    assert "exgrpo - grpo (test at half the budget" in half[3] and "+0.075" in half[3] and "n=2" in half[3]
    # when each run found its first success and left its start (test >= 0.1)
    late = _synthetic_run(2, [0.0, 0.0, 0.3], 0.0)
    for s in late["steps"]:
        s["solve_rate"] = 0.05 if s["step"] >= 7 else 0.0
    never = _synthetic_run(3, [0.0, 0.0, 0.05], 0.0)
    takeoff = tb.takeoff_lines({"grpo": [late, never]})
    assert "seed 2   first success step 7, test >= 0.1 at step 20" in takeoff[1]
    assert "seed 3   first success never, test >= 0.1 never" in takeoff[2]
    png = tmp_path / "plot.png"
    tb.plot(runs, budgets, png, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_icl_rescue_counts_add_up(ray_local, quick_tiny_model):
    """experiments/icl_rescue.py end to end on the quick model (which solves little): the
    counts it reports are consistent, whatever the rates."""
    import icl_rescue

    r = icl_rescue.measure(quick_tiny_model, 0, questions=24, extra=2, num_examples=2)
    assert r["questions"] == 24 and r["solved"] + r["all_failing"] == 24
    assert 0 <= r["seeded_questions"] <= r["all_failing"]
    assert r["seeded_questions"] == 0 or r["corpus"] > 0
    for k in ("rescued_seeded", "rescued_plain"):
        assert 0 <= r[k] <= r["seeded_questions"]
    assert r["only_seeded"] - r["only_plain"] == r["rescued_seeded"] - r["rescued_plain"]
    assert sum(v["n"] for v in r["by_level"].values()) == r["seeded_questions"]
    lo, hi = icl_rescue.wilson(3, 10)
    assert lo < 0.3 < hi and abs(lo - 0.1078) < 1e-3 and abs(hi - 0.6032) < 1e-3


def test_icl_rescue_measures_operators_with_the_operators_recipe_and_names_an_unknown_dataset():
    import icl_rescue

    assert icl_rescue.RECIPE_FOR["operators"] == "grpo_ops"  # its group size and response length
    with pytest.raises(SystemExit, match="--dataset"):
        icl_rescue.measure("tiny", 0, questions=4, extra=2, num_examples=2, dataset="gsm8k:n={n}")


def test_main_job_heldout_summary_skips_rows_without_a_new_measurement():
    """Rows between evaluations carry NaN accuracy (and NaN iteration); the summary reads
    the measured ones only: start, end, peak and the curve by iteration."""
    from main_job_seeds import heldout_summary

    nan = float("nan")

    def row(it, acc, after):
        return {"training_iteration": it, "heldout": {"accuracy": acc, "after_iteration": after, "initial_accuracy": 0.30}}

    rows = [row(1, 0.30, 0.0), row(2, nan, nan), row(10, 0.42, 10.0), row(11, nan, nan), row(20, 0.38, 20.0)]
    summary = heldout_summary(rows)
    assert summary["curve"] == {0: 0.30, 10: 0.42, 20: 0.38}
    assert (summary["start"], summary["end"], summary["peak"], summary["iterations"]) == (0.30, 0.38, 0.42, 20)


def test_main_job_levels_scores_the_final_set_by_level_without_validation():
    """first200 is the first 200 questions; the level scores leave out questions 200-400
    (validation) and the final score is the mean of the level accuracies."""
    from types import SimpleNamespace

    from main_job_levels import level_scores

    def qs(levels_and_oks):
        return [SimpleNamespace(id=f"q{i}", difficulty=level, correct=[ok]) for i, (level, ok) in enumerate(levels_and_oks)]

    # 0-199: level 1 all right; 200-399 (validation): level 2 all wrong, ignored below;
    # 400-449: level 2 half right; 450-499: level 1 all wrong.
    questions = qs([(1, True)] * 200 + [(2, False)] * 200 + [(2, i % 2 == 0) for i in range(50)] + [(1, False)] * 50)
    s = level_scores(questions)
    assert s["first200"] == 1.0
    assert s["L1"] == 200 / 250 and s["L2"] == 0.5
    assert s["final"] == (200 / 250 + 0.5) / 2


def test_operators_run_key_follows_the_recipes_settings_not_its_text(tmp_path, monkeypatch):
    """An operators run's cache key carries a digest of its recipe's parsed settings: a
    changed value gives a new key (never reusing a run of the old recipe), while an edited
    comment or reordered keys keep the key, so cached runs stay valid."""
    import _common
    import operators_experiment as oe

    keys = {recipe: oe.recipe_key(recipe) for recipe in ("grpo_ops", "exgrpo_ops")}
    assert all(set(k) == {"recipe_settings"} and len(k["recipe_settings"]) == 12 for k in keys.values())
    assert keys["grpo_ops"] != keys["exgrpo_ops"]

    original = (oe.ROOT / "tuned_examples" / _common.RECIPES["grpo_ops"][0]).read_text()
    assert "lr: 0.0001\n" in original
    (tmp_path / "tuned_examples").mkdir()
    copy = tmp_path / "tuned_examples" / _common.RECIPES["grpo_ops"][0]
    monkeypatch.setattr(oe, "ROOT", tmp_path)

    copy.write_text("# a new comment line\n" + original.replace("lr: 0.0001\n", "lr: 0.0001  # same value\n"))
    assert oe.recipe_key("grpo_ops") == keys["grpo_ops"]
    copy.write_text(original.replace("lr: 0.0001\n", "lr: 0.0002\n"))
    assert oe.recipe_key("grpo_ops") != keys["grpo_ops"]


def test_replay_control_sets_and_accuracies_on_hand_made_records():
    """The positive control's sets (``_replay_control``): end-pool hard = pooled with last
    bucket <= 3 of 8, warm-start hard = 1-3 correct of 8 at the start (0 and 4+ excluded),
    split by ExGRPO's end pool, and a run's accuracy on each is its mean greedy reward there."""
    import _replay_control as rc

    exgrpo_end = {
        "pool_buckets": {"a": 1, "b": 3, "c": 4, "d": 7},
        "train_greedy": {"a": 1.0, "b": 0.0, "c": 1.0, "d": 1.0, "e": 0.0, "f": 0.0},
    }
    counts = {"a": 0, "b": 1, "c": 3, "d": 4, "e": 2, "f": 8}
    sets = rc.control_sets(exgrpo_end, counts)
    assert sets == {
        "pool_hard": ["a", "b"],
        "warm_start_hard": ["b", "c", "e"],
        "warm_start_hard_pooled": ["b", "c"],
        "warm_start_hard_unpooled": ["e"],
        "pooled": ["a", "b", "c", "d"],
        "all": ["a", "b", "c", "d", "e", "f"],
    }
    grpo_end = {"train_greedy": {"a": 0.0, "b": 1.0, "c": 1.0, "d": 0.0, "e": 1.0, "f": 1.0}}
    assert rc.accuracy_on(exgrpo_end, sets["warm_start_hard"]) == pytest.approx(1 / 3)
    assert rc.accuracy_on(grpo_end, sets["warm_start_hard"]) == pytest.approx(1.0)
    assert rc.accuracy_on(exgrpo_end, sets["pool_hard"]) == pytest.approx(0.5)
    assert math.isnan(rc.accuracy_on(grpo_end, []))


def test_format_rate_finds_the_format_decision_and_scores_it_in_a_padded_batch(quick_tiny_model):
    """experiments/format_rate.py: the decision index is the token after the worked steps'
    last "." in either answer format (none when the answer is cut off), and the batched
    probability of the boxed form's first token (the backend's scoring pass, padded rows of
    different lengths) equals a one-row forward's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import format_rate
    from rllib_exgrpo.generation.hf import HFGenerationBackend
    from rllib_exgrpo.models import resolve_model_path

    path = resolve_model_path(quick_tiny_model, progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    token = format_rate.boxed_first_token(tok)
    assert tok.decode([token]).strip() == "\\"
    for text, boxed, number in [
        ("3 + 4 = 7, 7 - 2 = 5. \\boxed{5}", True, "5"),
        ("3 + 4 = 7. Answer: 7", False, "7"),
        ("1.5 + 1 = 2.5. \\boxed{2.5}", True, "2.5"),
    ]:
        ids = enc(text)
        k, got_boxed, got_number = format_rate.decision_index(tok, ids)
        assert (got_boxed, got_number) == (boxed, number)
        assert tok.decode(ids[:k]).rstrip().endswith(".") and tok.decode(ids[k:]).strip()[0] in "\\A"
    assert format_rate.decision_index(tok, enc("3 + 4 = 7. \\boxed{")) is None
    assert format_rate.decision_index(tok, enc("3 + 4 = 7, 7 -")) is None

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    backend = HFGenerationBackend(model, pad_token_id=tok.pad_token_id or 0)
    prompts, heads = [enc("What is 3 + 4?"), enc("What is 12 - 5 + 6?")], [enc(" 3 + 4 = 7."), enc(" 12 - 5 = 7, 7 + 6 = 13.")]
    batched = format_rate.box_probabilities(backend, prompts, heads, token, temperature=0.7)
    with torch.no_grad():
        for row, p in zip([a + b for a, b in zip(prompts, heads)], batched):
            logits = model(input_ids=torch.tensor([row])).logits[0, -1]
            assert abs(float(torch.softmax(logits / 0.7, -1)[token]) - p) < 1e-5


def test_format_rate_measure_end_to_end_counts_are_consistent(ray_local, quick_tiny_model):
    """experiments/format_rate.py's measurement through the env runner, the generation
    backend (the forced boxes) and the verifier, on the quick model: whatever its rates,
    the expected shares are bounded by what they are shares of."""
    import _common
    import format_rate

    r = format_rate.measure(quick_tiny_model, 1.0, questions=8, seed=0, dataset="arithmetic:levels=1-4,n={n}")
    assert r["answers"] == 8 * 8 and 0 <= r["parsed"] <= r["answers"]
    assert r["sampled_boxed"] * r["answers"] <= r["parsed"]  # a boxed answer is a parsed one
    assert 0.0 <= r["expected_reward_per_answer"] <= r["expected_boxed"] <= r["parsed"] / r["answers"] + 1e-9
    assert 0.0 <= r["groups_with_success"] <= 1.0
    per_step = _common.recipe_config("grpo_finite").completions_per_step
    assert abs(r["successes_per_step"] - r["expected_reward_per_answer"] * per_step) < 1e-9


def test_parallel_runs_take_references_first_and_dependents_once_their_reference_is_done():
    """The scheduler's rule (``_parallel_runs.pick_next``): the first queued job whose
    reference has finished; with two cores and runs of equal length, five seeds take five
    run lengths (references 0+1, 2+3, then 4 beside the first dependent, ...)."""
    import _parallel_runs as pr

    queue = [pr.Job(f"g:{s}", []) for s in range(5)] + [pr.Job(f"e:{s}", [], after=f"g:{s}") for s in range(5)]
    assert pr.pick_next(queue, set()).name == "g:0"
    assert pr.pick_next(queue[5:], set()) is None
    assert pr.pick_next(queue[5:], {"g:3"}).name == "e:3"
    # simulate two cores, every run one unit long
    pending, finished, rounds = list(queue), set(), []
    while pending:
        now = []
        for _ in range(2):
            job = pr.pick_next(pending, finished)
            if job is None:
                break
            pending.remove(job)
            now.append(job.name)
        finished |= set(now)
        rounds.append(now)
    assert rounds == [["g:0", "g:1"], ["g:2", "g:3"], ["g:4", "e:0"], ["e:1", "e:2"], ["e:3", "e:4"]]


def test_parallel_runs_pin_each_child_to_one_core_and_wait_for_the_reference(tmp_path):
    """Real child processes: each sees one core and one thread; a dependent starts only
    after its reference wrote its result; a failing child stops the schedule, named."""
    import os

    import _parallel_runs as pr

    workers = min(2, len(os.sched_getaffinity(0)))
    child = (
        "import os, sys, time, json, pathlib\n"
        "out = pathlib.Path(sys.argv[1]); name = sys.argv[2]; after = sys.argv[3]\n"
        "if after != '-': assert (out / (after + '.json')).exists(), 'reference not done'\n"
        "t0 = time.time(); time.sleep(0.3)\n"
        "(out / (name + '.json')).write_text(json.dumps({'cores': sorted(os.sched_getaffinity(0)),"
        " 'omp': os.environ.get('OMP_NUM_THREADS'), 'start': t0, 'end': time.time()}))\n"
    )
    script = tmp_path / "child.py"
    script.write_text(child)

    def job(name, after=None):
        return pr.Job(name, pr.python_argv(script, [str(tmp_path), name, after or "-"]), after=after, log=tmp_path / f"{name}.log")

    jobs = [job("g0"), job("g1"), job("e0", "g0"), job("e1", "g1")]
    seconds = pr.run_jobs(jobs, workers, log=lambda *_: None)
    assert set(seconds) == {"g0", "g1", "e0", "e1"}
    rec = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in seconds}
    for name, r in rec.items():
        assert len(r["cores"]) == 1 and r["omp"] == "1", name
    assert rec["e0"]["start"] >= rec["g0"]["end"] and rec["e1"]["start"] >= rec["g1"]["end"]
    if workers == 2:  # the two references ran at once, on different cores
        assert rec["g0"]["cores"] != rec["g1"]["cores"]
        assert rec["g1"]["start"] < rec["g0"]["end"]

    failing = pr.Job("bad", pr.python_argv(script, [str(tmp_path / "missing"), "bad", "-"]), log=tmp_path / "bad.log")
    with pytest.raises(SystemExit, match="run bad failed; its log: .*bad.log"):
        pr.run_jobs([failing, job("after_bad", "bad")], workers, log=lambda *_: None)
    with pytest.raises(ValueError, match="unknown jobs: \\['nope'\\]"):
        pr.run_jobs([job("x", "nope")], workers, log=lambda *_: None)


def test_operators_parallel_jobs_run_one_run_each_after_its_seeds_reference(tmp_path):
    """``--workers``: one child per (variant, seed), the reference's first, every other
    variant after its own seed's reference, each with the phase's own arguments."""
    import argparse

    import operators_experiment as oe

    args = argparse.Namespace(
        task_seed=1,
        iterations=160,
        eval_interval=160,
        out=tmp_path,
        phase="final",
        variants=None,
        best='{"grpo": {}, "exgrpo": {}}',
        task_options="",
        shuffled=False,
        seeds=[15, 16],
    )
    variants = {"grpo": (oe.G, {}, False), "exgrpo": (oe.E, {}, False)}
    jobs = oe.parallel_jobs(args, variants, "grpo")
    assert [(j.name, j.after) for j in jobs] == [("grpo:15", None), ("grpo:16", None), ("exgrpo:15", "grpo:15"), ("exgrpo:16", "grpo:16")]
    argv = jobs[2].argv
    assert argv[1].endswith("operators_experiment.py")
    flags = dict(zip(argv[2::2], argv[3::2]))
    assert flags["--seeds"] == "15" and flags["--only"] == "exgrpo" and flags["--task-seed"] == "1"
    assert flags["--phase"] == "final" and flags["--best"] == args.best and flags["--out"] == str(tmp_path)
    assert jobs[2].log.parent == tmp_path / "_logs"


def test_lora_compare_picks_each_arms_lr_on_validation_and_reads_the_criterion():
    import lora_compare

    # the highest mean over seeds; a NaN run left out; ties go to the grid's first lr
    assert lora_compare.pick_lr({3e-4: [0.40, 0.42], 1e-3: [0.45, float("nan")], 3e-3: [0.30, 0.50]}) == 1e-3
    assert lora_compare.pick_lr({3e-5: [0.4], 1e-4: [0.4]}) == 3e-5
    assert lora_compare.meets_criterion(0.05, 0.10) and not lora_compare.meets_criterion(0.049, 0.10)
    assert lora_compare.meets_criterion(-0.01, -0.02) and not lora_compare.meets_criterion(-0.03, -0.02)
    assert lora_compare.within_noise(0.01, 0.02) == "within noise"
    assert lora_compare.within_noise(0.03, 0.02) == "outside noise"
    assert lora_compare.within_noise(0.0, 0.0) == "within noise"  # identical runs
    assert lora_compare.within_noise(0.01, float("nan")).startswith("no interval")
    assert lora_compare.arm_overrides("lora", 1e-3)["lora_rank"] == 16
    assert lora_compare.arm_overrides("colocated", 1e-4) == {"colocate": True, "num_env_runners": 0, "num_learners": 0, "lr": 1e-4}
