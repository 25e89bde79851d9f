"""The embedded hidden-operator family: deterministic, split-disjoint, position-dependent
tables, verifiable answers, and a guessing baseline of about 1/3 per operation."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from rllib_exgrpo.envs import operators as ops
from rllib_exgrpo.envs.datasets import load_problems
from rllib_exgrpo.envs.rewards import last_boxed, math_reward, score_batch

SPEC = "operators:seed=3,families=8"


@pytest.fixture(scope="module")
def train():
    return ops.generate(3000, split="train", seed=0)


def test_deterministic_from_seed():
    a = load_problems("operators:seed=5,n=400")
    b = load_problems("operators:seed=5,n=400")
    assert a == b and [p.extra for p in a] == [p.extra for p in b]
    assert [p.question for p in load_problems("operators:seed=5,n=100")] == [p.question for p in a[:100]]
    assert ops.family_tables(5, 24) != ops.family_tables(6, 24)
    assert ops.family_tables(5, 24)[:8] == ops.family_tables(5, 8)  # a family's table depends on (seed, family)
    c = load_problems("operators:seed=6,n=400")
    assert [p.question for p in a] != [p.question for p in c]


def test_splits_disjoint_hashed_and_ids_unique():
    splits = {s: load_problems(SPEC, split=s) for s in ops.SPLITS}
    assert {s: len(p) for s, p in splits.items()} == {"train": 3000, "validation": 300, "test": 500}
    questions = {s: {p.question for p in problems} for s, problems in splits.items()}
    for s, problems in splits.items():
        assert len(questions[s]) == len(problems)
        assert all(ops.split_of(p.question) == s for p in problems)
        assert [p.id for p in problems] == [f"operators-{s}-{i}" for i in range(len(problems))]
        assert {p.data_source for p in problems} == {"operators"}
        assert {p.extra["family"] for p in problems} == set(range(8))  # same families everywhere
    assert not questions["train"] & questions["validation"]
    assert not questions["train"] & questions["test"]
    assert not questions["validation"] & questions["test"]
    all_ids = [p.id for problems in splits.values() for p in problems]
    assert len(set(all_ids)) == len(all_ids)


def test_answers_follow_the_tables_and_solutions_score(train):
    tables = ops.family_tables(0, 24)
    for p in train:
        q = ops.parse_question(p.question)
        assert q.text == p.question and p.difficulty == q.length
        assert (q.family, "".join(q.symbols)) == (p.extra["family"], p.extra["symbols"])
        meanings = tuple(tables[q.family][s][k] for k, s in enumerate(q.symbols))
        assert "".join(meanings) == p.extra["meanings"]
        running = q.operands[0]
        for m, b in zip(meanings, q.operands[1:]):
            running = running + b if m == "+" else running - b if m == "-" else running * b
        assert p.ground_truth == str(running)
        assert p.solution == ops.worked_solution(q, meanings)
        assert p.solution.endswith(f"\\boxed{{{p.ground_truth}}}")
    assert any(p.ground_truth.startswith("-") for p in train)  # negatives occur and are scored below
    sample = train[:40] + [p for p in train if p.ground_truth.startswith("-")][:20]
    results = score_batch([p.solution for p in sample], [p.ground_truth for p in sample], fast_path=False)
    assert [r.score for r in results] == [1.0] * len(sample)
    for p in sample[:6] + sample[-6:]:
        assert math_reward(p.solution, p.ground_truth).score == 1.0
        wrong = p.solution.replace(f"\\boxed{{{p.ground_truth}}}", f"\\boxed{{{int(p.ground_truth) + 1}}}")
        assert math_reward(wrong, p.ground_truth).score == 0.0


def test_worked_solution_format():
    q = ops.parse_question("[F07] 3 # 5 @ 2 =")
    assert (q.family, q.operands, q.symbols) == (7, (3, 5, 2), ("#", "@"))
    assert ops.worked_solution(q, "+x") == "3 # 5 = 3 + 5 = 8, 8 @ 2 = 8 x 2 = 16. \\boxed{16}"
    assert ops.worked_solution(q, "--") == "3 # 5 = 3 - 5 = -2, -2 @ 2 = -2 - 2 = -4. \\boxed{-4}"
    assert ops.evaluate(q, "-x") == -4
    with pytest.raises(ValueError):
        ops.worked_solution(q, "+")
    with pytest.raises(ValueError, match="not an operators question"):
        ops.parse_question("[F07] 3 # 1 =")


def _guess_rates(pairs):
    hits, totals = defaultdict(int), defaultdict(int)
    for problem, solution in pairs:
        totals[problem.difficulty] += 1
        hits[problem.difficulty] += last_boxed(solution) == problem.ground_truth
    return {n: hits[n] / totals[n] for n in sorted(totals)}, dict(totals)


def test_random_meanings_succeed_about_one_in_three_per_operation(train):
    rng = random.Random(0)
    by_function, totals = _guess_rates((p, ops.random_meaning_solution(p, rng)) for p in train)
    spec_random = load_problems("operators:n=3000,meanings=random")
    assert [p.ground_truth for p in spec_random] == [p.ground_truth for p in train]  # answers stay true
    by_spec, _ = _guess_rates((p, p.solution) for p in spec_random)
    print(
        f"\nrandom-meaning success by length (n per length {totals}): "
        f"random_meaning_solution {by_function}, meanings=random {by_spec}; uniform 1/3, 1/9, 1/27"
    )
    bands = {1: (0.29, 0.40), 2: (0.08, 0.16), 3: (0.02, 0.07)}
    for rates in (by_function, by_spec):
        assert set(rates) == {1, 2, 3}
        for n, (lo, hi) in bands.items():
            assert lo <= rates[n] <= hi, (n, rates)
    # the format is right even when the meanings are wrong
    assert all(p.solution.endswith("}") and last_boxed(p.solution) for p in spec_random)


def test_tables_are_position_dependent_and_short_chains_use_position_one(train):
    tables = ops.family_tables(0, 24)
    dependent = [f for f, row in enumerate(tables) if any(len(set(row[s])) > 1 for s in ops.SYMBOLS)]
    assert dependent, "every family's table is position-independent"
    print(f"\nposition-dependent families: {len(dependent)} of 24")
    one_op = [p for p in train if p.difficulty == 1]
    assert len(one_op) > 500
    for p in one_op:
        q = ops.parse_question(p.question)
        assert p.extra["meanings"] == tables[q.family][q.symbols[0]][0]
    # an entry beyond position 1 changes no one-operation answer
    altered = [{s: (m[0], "x" if m[1] != "x" else "+", m[2]) for s, m in row.items()} for row in tables]
    for p in one_op[:200]:
        q = ops.parse_question(p.question)
        assert str(ops.evaluate(q, ops.question_meanings(q, tables=altered))) == p.ground_truth


def test_shuffled_draws_meanings_per_question():
    shuffled = load_problems("operators:seed=2,families=4,lengths=2,n=1500,shuffled=1")
    tabled = load_problems("operators:seed=2,families=4,lengths=2,n=1500")
    assert [p.question for p in shuffled] == [p.question for p in tabled]  # same prompts, family tags kept
    groups = defaultdict(set)
    for p in shuffled:
        q = ops.parse_question(p.question)
        groups[(q.family, q.symbols)].add(p.extra["meanings"])
        assert p.extra["meanings"] == "".join(ops.question_meanings(q, seed=2, shuffled=True))
        assert p.solution == ops.worked_solution(q, p.extra["meanings"])
        assert p.solution.endswith(f"\\boxed{{{p.ground_truth}}}")
    assert all(len(m) > 1 for m in groups.values())  # nothing shared within a family and symbol sequence
    tabled_groups = defaultdict(set)
    for p in tabled:
        tabled_groups[(p.extra["family"], p.extra["symbols"])].add(p.extra["meanings"])
    assert all(len(m) == 1 for m in tabled_groups.values())


@pytest.mark.parametrize(
    "spec,option",
    [
        ("operators:famlies=3", "famlies"),
        ("operators:families=0", "families"),
        ("operators:families=abc", "families"),
        ("operators:lengths=0-3", "lengths"),
        ("operators:lengths=4", "lengths"),
        ("operators:shuffled=yes", "shuffled"),
        ("operators:n=-1", "n"),
        ("operators:n_test=x", "n_test"),
        ("operators:meanings=some", "meanings"),
        ("operators:seed=1.5", "seed"),
        ("operators:seed", "seed"),
        ("operators:balanced=2", "balanced"),
    ],
)
def test_bad_option_is_one_line_naming_it(spec, option):
    with pytest.raises(ValueError) as info:
        load_problems(spec)
    msg = str(info.value)
    assert "\n" not in msg and (repr(option) in msg or f"{option}=" in msg), msg


def test_parse_spec_defaults_and_values():
    assert ops.parse_spec("operators") == ops.DEFAULTS
    opts = ops.parse_spec("operators:seed=3, families=8,lengths=1+3,n=10,n_validation=2,n_test=4,shuffled=1,meanings=random")
    assert opts == {
        "seed": 3,
        "families": 8,
        "lengths": (1, 3),
        "n": 10,
        "n_validation": 2,
        "n_test": 4,
        "shuffled": True,
        "meanings": "random",
        "balanced": False,
    }
    assert ops.parse_spec("operators:balanced=1")["balanced"] is True


def test_load_problems_validation_limit_skip_and_errors():
    full = load_problems(SPEC, split="validation")
    assert len(full) == 300
    assert [p.id for p in load_problems(SPEC, split="validation", limit=25)] == [p.id for p in full[:25]]
    assert [p.id for p in load_problems(SPEC, split="validation", skip=290)] == [p.id for p in full[290:]]
    assert [p.id for p in load_problems(SPEC, split="validation", skip=5, limit=3)] == [p.id for p in full[5:8]]
    assert {p.data_source for p in load_problems(SPEC, split="test", limit=3, data_source="mine")} == {"mine"}
    assert {p.difficulty for p in load_problems("operators:lengths=2-3,n=60")} == {2, 3}
    with pytest.raises(ValueError, match="split"):
        load_problems(SPEC, split="valid")
    with pytest.raises(ValueError, match="split"):
        load_problems("arithmetic", split="validation")  # arithmetic keeps train / test
    with pytest.raises(ValueError, match="lengths=1"):
        load_problems("operators:families=1,lengths=1,n=500")  # 192 one-operation questions in all


def test_one_operation_questions_run_out_into_longer_chains():
    problems = ops.generate(500, split="test", seed=0, families=2)  # about 38 one-operation test questions
    ones = [p for p in problems if p.difficulty == 1]
    pool = ops._one_op_pool(0, 2, "test")
    assert {p.question for p in ones} == {q.text for q in pool}
    assert len(problems) == 500 and len({p.question for p in problems}) == 500


def test_reasoning_env_and_preflight_accept_the_spec():
    from rllib_exgrpo.envs.reasoning_env import ReasoningEnv
    from rllib_exgrpo.cli.preflight import dataset_problems
    from rllib_exgrpo.evaluation.data import load_eval_problems

    env = ReasoningEnv({"dataset": SPEC, "split": "validation", "limit": 12})
    assert len(env.problems) == 12 and all(p.id.startswith("operators-validation-") for p in env.problems)
    assert dataset_problems(SPEC, "config.heldout_dataset", split="validation") == []
    (line,) = dataset_problems("operators:families=abc", "config.env_config.dataset")
    assert line.startswith("config.env_config.dataset: bad dataset spec") and "families" in line
    (line,) = dataset_problems(SPEC, "config.heldout_dataset", split="valid", split_key="config.heldout_split")
    assert line.startswith("config.heldout_split: the operators source has splits")
    (line,) = dataset_problems("operator", "config.env_config.dataset")
    assert "did you mean 'operators'" in line
    (source,) = load_eval_problems([SPEC], limit=4)
    assert len(source.problems) == 4 and {p.data_source for p in source.problems} == {SPEC}


def test_read_worked_solution_reads_back_the_meanings_of_right_arithmetic(train):
    rng = random.Random(0)
    for p in train[:300]:
        q = ops.parse_question(p.question)
        guess = ops.random_meanings(q.length, rng)
        text = ops.worked_solution(q, guess)
        assert ops.read_worked_solution(p, text + "<|im_end|>") == guess
        assert ops.read_worked_solution(p.question, p.solution) == tuple(p.extra["meanings"])
    q = ops.parse_question("[F03] 7 # 5 @ 2 =")
    good = "7 # 5 = 7 - 5 = 2, 2 @ 2 = 2 x 2 = 4. \\boxed{4}"
    assert ops.read_worked_solution(q, good) == ("-", "x")
    for bad in (
        "7 # 5 = 7 - 5 = 3, 3 @ 2 = 3 x 2 = 6. \\boxed{6}",  # wrong arithmetic
        "7 # 5 = 7 - 5 = 2, 2 @ 2 = 2 x 2 = 4. \\boxed{5}",  # box disagrees with the steps
        "7 @ 5 = 7 - 5 = 2, 2 # 2 = 2 x 2 = 4. \\boxed{4}",  # symbols out of order
        "7 # 5 = 7 - 5 = 2. \\boxed{2}",  # a step missing
        "7 # 5 = 7 - 5 = 2, 9 @ 2 = 9 x 2 = 18. \\boxed{18}",  # chain not carried
        "The answer is 4",
    ):
        assert ops.read_worked_solution(q, bad) is None, bad


def test_guessing_rate_counts_the_meanings_that_give_the_answer():
    assert ops.guessing_rate("[F00] 2 # 2 =", 4) == pytest.approx(2 / 3)  # 2 + 2 = 2 x 2
    assert ops.guessing_rate("[F00] 7 # 5 =", 35) == pytest.approx(1 / 3)
    assert ops.guessing_rate("[F00] 7 # 5 @ 2 =", 4) == pytest.approx(2 / 9)  # 7 - 5 = 2, then 2 + 2 = 2 x 2
    assert ops.guessing_rate("[F00] 7 # 5 @ 3 =", 6) == pytest.approx(1 / 9)  # only 7 - 5 = 2, 2 x 3
    assert ops.guessing_rate("[F00] 7 # 5 =", 1) == 0.0


def test_family_blind_accuracy_is_perfect_with_one_family_and_a_lower_bar_with_many():
    one = ops.family_blind_accuracy("operators:seed=0,families=1,n_test=60")
    assert one == {1: 1.0, 2: 1.0, 3: 1.0}  # one family: its table is the majority
    many = ops.family_blind_accuracy("operators:seed=0,families=24")
    assert round(many[1], 3) == 0.412 and many[1] > many[2] > many[3]


def test_balanced_tables_hold_each_meaning_equally_often_and_leave_no_family_blind_gain():
    """``balanced=1``: every (symbol, position) column holds +, - and x in 8 of 24 families
    each, columns are shuffled independently, answers follow the balanced tables, and no
    family-blind answer beats guessing (1/3 + collisions), where the independent draw of
    seed 0 gives "always -" 0.412 on one-operation questions."""
    tables = ops.family_tables(0, 24, balanced=True)
    columns = {(s, k): [t[s][k] for t in tables] for s in ops.SYMBOLS for k in range(ops.MAX_LENGTH)}
    assert all(sorted(c) == sorted(ops.MEANINGS * 8) for c in columns.values())
    assert len({tuple(c) for c in columns.values()}) == len(columns)  # each column shuffled on its own
    assert ops.family_tables(0, 24) != tables and ops.family_tables(0, 24, balanced=True) == tables
    problems = load_problems("operators:seed=0,balanced=1", split="test")
    for p in problems:
        q = ops.parse_question(p.question)
        assert p.extra["meanings"] == "".join(tables[q.family][s][k] for k, s in enumerate(q.symbols))
        assert str(ops.evaluate(q, p.extra["meanings"])) == p.ground_truth
    assert [p.question for p in problems] == [p.question for p in load_problems("operators:seed=0", split="test")]
    blind = ops.family_blind_accuracy("operators:seed=0,balanced=1")
    assert blind[1] < 0.36 < ops.family_blind_accuracy("operators:seed=0")[1]
    l1 = [p for p in problems if p.difficulty == 1]
    minus = sum(str(ops.evaluate(ops.parse_question(p.question), ["-"])) == p.ground_truth for p in l1) / len(l1)
    assert minus < 0.40
