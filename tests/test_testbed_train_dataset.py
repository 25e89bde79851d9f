"""The experience testbed's ``--train-dataset`` (experiments/experience_testbed.py): every
variant of a phase trains on the named set, through the real recipe configs, and the
held-out questions stay outside it."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the studies, and the helpers (_common, _runs) they share with the benchmarks
sys.path[:0] = [str(REPO / "experiments"), str(REPO / "benchmarks")]

import _common  # noqa: E402
import _runs  # noqa: E402
import experience_testbed as tb  # noqa: E402
from rllib_exgrpo.envs.datasets import load_problems  # noqa: E402

LARGE = "arithmetic:levels=1-4,n=5000"


def test_every_variant_trains_on_the_named_set_and_keeps_its_other_keys():
    variants = {
        "grpo": [tb.G, {"lr": 4e-4}],
        "exgrpo": [tb.E, {"lr": 4e-4, "delayed_start_solve_rate": 0.0}],
        "ppo": [tb.P, {"env_config": {"dataset": "arithmetic:levels=1-4,n=600", "seed": 3}}],
    }
    moved = tb.with_train_dataset(variants, LARGE)
    assert list(moved) == list(variants)
    assert moved["exgrpo"] == [tb.E, {"lr": 4e-4, "delayed_start_solve_rate": 0.0, "env_config": {"dataset": LARGE}}]
    assert moved["ppo"][1]["env_config"] == {"dataset": LARGE, "seed": 3}
    assert variants["grpo"] == [tb.G, {"lr": 4e-4}]  # the input is not changed
    # the real recipe configs take it (validated as the runs build them)
    for name in ("grpo", "exgrpo"):
        recipe, ov = moved[name]
        config = _common.recipe_config(recipe, seed=0, **ov)
        assert config.env_config["dataset"] == LARGE
        assert config.lr == 4e-4


def test_the_large_training_set_shares_no_question_with_the_evaluators():
    train = {p.question for p in load_problems(LARGE, split="train")}
    assert len(train) == 5000
    for held_out_dataset in (_runs.HELDOUT_DATASET, tb.FINAL_SET_DATASET):
        held_out = {p.question for p in load_problems(held_out_dataset, split="test")}
        assert held_out and not train & held_out
