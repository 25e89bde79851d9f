"""Where a training step's time goes, on the embedded default (tiny model, arithmetic).

    python benchmarks/step_profile.py [--iterations 6] [--warmup 2] [--algos grpo exgrpo] [--overrides JSON]
    python benchmarks/step_profile.py --iterations 1 --warmup 0 --algos exgrpo \
        --overrides '{"questions_per_step": 2, "minibatch_size": 16, "max_response_tokens": 16}'   # seconds

``--algos`` takes the names of ``_common.RECIPES`` (``grpo_ops`` / ``exgrpo_ops``:
the hidden-operator twins).

Prints, per algorithm, the mean seconds and share of each stage of a step: generation,
scoring (verifier), the learner update, weight sync, ExGRPO's replay choice (entropy
re-scoring) and buffer update, and the rest (planning, advantages, batching, RLlib's
own bookkeeping). Then the ExGRPO / GRPO step-time ratio at the same batch.

ExGRPO runs with its delayed start at 0 so that replay (and the entropy re-scoring of the
replayed questions' trajectories) is active in every measured step. Held-out evaluation
is off: it is not part of a training step.

The last line is ``<algo>_step_s=S ...`` per algorithm, then ``exgrpo_over_grpo=R`` when
both ran.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from _common import recipe_config, start_ray
from _runs import timed_steps

STAGES = ("generation", "scoring", "learner", "sync", "replay_choice", "buffer_update", "rest")


def profile(name: str, iterations: int, warmup: int, overrides: dict) -> dict:
    extra = {"heldout_dataset": None, **overrides}
    if name.startswith("exgrpo"):
        extra.update(delayed_start_solve_rate=0.0)
    algo = recipe_config(name, **extra).build_algo()
    rows = []
    try:
        for wall, result in timed_steps(algo, warmup, iterations):
            st = result["step_time_s"]
            runners = result["env_runners"]
            gen = float(runners["generation_time_s"])
            score = float(runners["scoring_time_s"])
            row = {
                "wall": wall,
                "generation": gen,
                "scoring": score,
                "learner": float(st["learner_update_timer"]),
                "sync": float(st["synch_weights"]),
                "replay_choice": float(st.get("replay_choice", 0.0)),
                "buffer_update": float(st.get("buffer_update", 0.0)),
            }
            row["rest"] = wall - sum(row[k] for k in STAGES if k != "rest")
            row["replayed_fraction"] = float(result.get("experience", {}).get("replayed_fraction", 0.0))
            rows.append(row)
    finally:
        algo.stop()
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--algos", nargs="+", default=["grpo", "exgrpo"])
    parser.add_argument("--questions", type=int, default=None, help="override questions_per_step")
    parser.add_argument(
        "--overrides", default="{}", help="JSON config overrides of every algorithm, e.g. '{\"learner_micro_batch_tokens\": null}'"
    )
    args = parser.parse_args()
    start_ray()
    overrides = json.loads(args.overrides)
    if args.questions:
        overrides["questions_per_step"] = args.questions
    profiles = {a: profile(a, args.iterations, args.warmup, overrides) for a in args.algos}
    for name, p in profiles.items():
        print(f"\n{name}: {p['wall']:.2f} s per step (mean of {args.iterations}), replayed rows {p['replayed_fraction']:.0%}")
        for stage in STAGES:
            print(f"  {stage:<14} {p[stage]:7.3f} s  {p[stage] / p['wall']:6.1%}")
        outside = p["wall"] - p["generation"] - p["scoring"] - p["learner"]
        print(f"  outside generation+scoring+learner: {outside / p['wall']:.1%}")
    if "grpo" in profiles and "exgrpo" in profiles:
        print(f"\nExGRPO / GRPO step time: {profiles['exgrpo']['wall'] / profiles['grpo']['wall']:.3f}x")
    figures = [f"{name}_step_s={p['wall']:.3f}" for name, p in profiles.items()]
    if "grpo" in profiles and "exgrpo" in profiles:
        figures.append(f"exgrpo_over_grpo={profiles['exgrpo']['wall'] / profiles['grpo']['wall']:.3f}")
    print(" ".join(figures))


if __name__ == "__main__":
    main()
