"""XRPO's per-step cost against GRPO's at the same number of completions per step.

    python benchmarks/planner_overhead.py [--steps 12] [--warmup 2] [--seed 0] [--arms ...] [--overrides JSON]
    python benchmarks/planner_overhead.py --steps 1 --warmup 0 --arms grpo planner \
        --overrides '{"questions_per_step": 2, "minibatch_size": 16, "max_response_tokens": 16}'   # seconds

Four arms on the stream setting (tuned_examples/grpo_stream_tiny.yaml / xrpo_tiny.yaml, 32
questions x 8 completions = 256 completions per step for every arm):

* ``grpo``: on-policy GRPO, one generation call per step;
* ``planner``: XRPO's rollout planner alone (n0 = 4 completions per question, then 2 rounds
  by priority: 3 generation calls, the same 256 completions);
* ``planner_1round``: the planner with one round (2 calls);
* ``xrpo``: the planner + in-context seeding + novelty sharpening (xrpo_tiny.yaml).

Prints the median step time, generation ("sample") time and learner time of each arm over
``--steps`` steps after ``--warmup``, and the ratio to GRPO. Time it on an idle machine
(it is a timing): the paper reports +4.7% per step for XRPO on GPUs with vLLM.
``--overrides`` (JSON) changes every arm's config (smaller steps for a quick check).

The last line is ``grpo_step_s=S <arm>_over_grpo=R ...`` (the median step time of GRPO and
each other arm's ratio to it; without the grpo arm, ``<arm>_step_s=S`` per arm).
"""

from __future__ import annotations

import argparse
import json
import statistics

import _common  # noqa: F401  (sys.path, recipes)
from _common import start_ray
from _runs import build, timed_steps

ARMS = {
    "grpo": ("grpo", {}),
    "planner": ("xrpo", {"icl_seeding": False, "novelty_sharpening": False}),
    "planner_1round": ("xrpo", {"icl_seeding": False, "novelty_sharpening": False, "planner_rounds": 1}),
    "xrpo": ("xrpo", {}),
}


def time_arm(recipe: str, overrides: dict, *, seed: int, warmup: int, steps: int) -> dict:
    _, algo = build(recipe, seed, dict(overrides))  # build turns the in-training evaluation off
    walls, sample, learn, completions = [], [], [], []
    try:
        for wall, result in timed_steps(algo, warmup, steps):
            stages = result.get("step_time_s", {})
            walls.append(wall)
            sample.append(float(stages.get("sample", float("nan"))))
            learn.append(float(stages.get("learner_update_timer", float("nan"))))
            completions.append(float(result.get("env_runners", {}).get("num_episodes", float("nan"))))
    finally:
        algo.stop()
    med = statistics.median
    return {"step_s": med(walls), "sample_s": med(sample), "learner_s": med(learn), "completions": med(completions)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--overrides", type=json.loads, default={}, help="JSON config overrides of every arm")
    args = p.parse_args()
    start_ray()
    rows = {
        name: time_arm(ARMS[name][0], {**ARMS[name][1], **args.overrides}, seed=args.seed, warmup=args.warmup, steps=args.steps)
        for name in args.arms
    }
    base = rows.get("grpo")
    print(f"{'arm':<16}{'completions':>12}{'step s':>9}{'sample s':>10}{'learner s':>11}{'step / GRPO':>13}")
    for name, r in rows.items():
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        print(f"{name:<16}{r['completions']:>12.0f}{r['step_s']:>9.2f}{r['sample_s']:>10.2f}{r['learner_s']:>11.2f}{ratio:>13}")
    if base:
        print(
            " ".join(
                [f"grpo_step_s={base['step_s']:.3f}"]
                + [f"{name}_over_grpo={r['step_s'] / base['step_s']:.3f}" for name, r in rows.items() if name != "grpo"]
            )
        )
    else:
        print(" ".join(f"{name}_step_s={r['step_s']:.3f}" for name, r in rows.items()))


if __name__ == "__main__":
    main()
