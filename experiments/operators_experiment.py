"""The hidden-operator experiment: GRPO against ExGRPO where replayed successes should carry
over (docs/experience/operators_task.md, where the protocol is declared).

    python experiments/operators_experiment.py --phase search  [--task-seed 0]
    python experiments/operators_experiment.py --phase final   [--task-seed 0] --seeds 0 1 2 3 4 --best '{...}'
    python experiments/operators_experiment.py --phase ablate  [--task-seed 0] --seeds 0 1 2 --best '{...}'
    python experiments/operators_experiment.py --phase xrpo    [--task-seed 0] --seeds 0 1 2 3 4 --best '{...}'
    python experiments/operators_experiment.py --phase positive [--task-seed 0] [--shuffled] --seeds 5 6 7 --best '{...}'
    python experiments/operators_experiment.py --variants '{"name": ["grpo", {"lr": 1e-4}], ...}'

``--workers 2`` trains the runs two at a time, each in a child process pinned to one core
(``_parallel_runs``: every seed's GRPO reference first, the runs that spend its tokens after
it), then reports from the cache as a one-process run does, with the whole phase's wall time.

Recipes: ``tuned_examples/grpo_operators_tiny.yaml`` and ``exgrpo_operators_tiny.yaml``
(twins), the operators warm start ``tiny:task=operators,...`` (format and arithmetic, every
meaning guessed). ``--task-seed`` draws the family tables (and questions): the search runs
on task seed 0, and the whole comparison is repeated on task seed 1, which the search
never saw.

Evaluators, greedy, on the held-out splits of the same task (same families, questions never
trained on; envs/operators.py splits by a hash of the question text):

* ``val``: the 300 questions of the ``validation`` split, the only numbers the search reads
  (selection metric ``val_tail``: the mean of the evaluations from 70% of the budget to the
  crossing, fixed before any run);
* ``test``: the 500 questions of the ``test`` split, the reported figure, with its per-length
  accuracies and every question's outcome (for a paired bootstrap over questions).

Equal budget: for each seed, the completion tokens the phase's reference GRPO run samples in
``--iterations`` steps; every run trains until it has done the steps and spent the budget, and
is read at the first evaluation at or past it. Runs are cached as JSON under ``--out``
(``_runs``), so a killed phase resumes.

Arms (``--best`` gives the selected ``{"grpo": {...}, "exgrpo": {...}}`` overrides):
``grpo``, ``exgrpo``, ``exgrpo_prompt`` (the same ExGRPO with ``replay_content: prompt``:
pooled questions come back alone, with fresh samples), ``grpo_shuffled`` / ``exgrpo_shuffled``
(the task with ``shuffled=1``: meanings per question, nothing shared between questions; the
test split's meanings are shuffled too, so nothing learned transfers), and in the ``xrpo``
phase ``xrpo`` / ``exgrpo_xrpo``.

The ``positive`` phase is the replay positive control on this task (``_replay_control``):
GRPO and ExGRPO (``--best``) at equal tokens, each answering every one of its 3000 training
questions greedily at the end; their accuracies are compared on the questions the warm start
solves 1-3 times in 8 (counted once per task, before training) and on ExGRPO's end-pool hard
questions. With ``--shuffled`` it runs on the task with meanings drawn per question, where
nothing is shared: a gain on the training questions there is replay's own, with no transfer.

The last line is ``exgrpo_minus_grpo=<paired mean difference of test@budget>`` for the final
phase, ``warm_start_hard_gain=<paired mean difference on the warm-start hard training
questions>`` for the positive phase.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import yaml

import _paths  # noqa: F401  (benchmarks/ on sys.path: _common, _runs)
import _common
import _parallel_runs
from _common import ROOT
import _replay_control as rc
import _runs
import experience_testbed as tb


#: Bumped when what a run records changes.
OPS_FORMAT = 1
G, E = "grpo_ops", "exgrpo_ops"
SEARCH_LRS = (1e-4, 5e-5, 2e-4)
SEARCH_RHOS = (0.25, 0.5)
XRPO_KEYS = tb.XRPO_KEYS
#: One switch at a time on top of the selected ExGRPO (the declared ablations).
ABLATIONS = {
    "rho0": {"experience_ratio": 0.0},
    "rho0.25": {"experience_ratio": 0.25},
    "rho0.5": {"experience_ratio": 0.5},
    "rho0.75": {"experience_ratio": 0.75},
    "uniform_buckets": {"bucket_weighting": "uniform"},
    "random_traj": {"trajectory_selection": "random"},
    "no_shaping": {"policy_shaping": False},
}


#: Extra dataset options of every run (``--task-options``, e.g. ``families=4``), "" = the defaults.
TASK_OPTIONS = ""


def task_spec(task_seed: int, shuffled: bool = False) -> str:
    extra = f",{TASK_OPTIONS}" if TASK_OPTIONS else ""
    return f"operators:seed={task_seed}{extra}" + (",shuffled=1" if shuffled else "")


def split_eval(algo, split: str, max_new_tokens: int) -> dict:
    """Greedy accuracy on one held-out split, per chain length, and each question's outcome."""
    env = algo.env_runner.heldout_split_env(split)
    problems = env.problems
    rewards = _runs.greedy_rewards(algo, [p.id for p in problems], max_new_tokens, split=split)
    bits = [int(rewards[p.id] >= 1.0) for p in problems]
    out = {split: float(np.mean(bits))}
    for length in (1, 2, 3):
        sel = [b for b, p in zip(bits, problems) if p.difficulty == length]
        out[f"{split}_L{length}"] = float(np.mean(sel)) if sel else math.nan
    if split == "test":
        out["test_bits"] = "".join(map(str, bits))
    return out


def recipe_key(recipe: str) -> dict:
    """What a run's cache key adds for its recipe file: the digest of its parsed settings, so
    that a changed value never reuses a run of the old recipe while an edited comment (or
    reordered keys) keeps every cached run."""
    settings = yaml.safe_load((ROOT / "tuned_examples" / _common.RECIPES[recipe][0]).read_text())
    for exp in settings.values():  # the benchmark evaluates on its own schedule (_runs sets 0)
        (exp.get("config") or {})["heldout_interval"] = 0
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()
    return {"recipe_settings": hashlib.sha1(canonical).hexdigest()[:12]}


def train_run(
    variant: str,
    recipe: str,
    overrides: dict,
    seed: int,
    *,
    task_seed: int,
    shuffled: bool,
    iterations: int,
    token_budget: Optional[float],
    eval_interval: int,
    out: Path,
    log=print,
    train_end_eval: bool = False,
) -> dict:
    """One cached run; ``train_end_eval`` adds the positive control's end record (every
    training question answered greedily, ExGRPO's pool), under its own cache key."""
    spec = task_spec(task_seed, shuffled)
    overrides = {**overrides, "env_config": {"dataset": spec}}

    def step_fields(result) -> dict:
        learner = (result.get("learners") or {}).get("default_policy", {})
        return {
            "top": {k: float(result[k]) for k in tb.TOP_KEYS if isinstance(result.get(k), (int, float))},
            "learner": {k: float(learner[k]) for k in tb.LEARNER_KEYS if isinstance(learner.get(k), (int, float))},
        }

    def extra_eval(algo, max_tokens):
        return {**split_eval(algo, "validation", max_tokens), **split_eval(algo, "test", max_tokens)}

    def on_eval(e: dict, elapsed: float) -> None:
        log(
            f"  {variant} seed {seed} step {e['step']}: tokens {int(e['tokens']):,}, val {e['validation']:.3f}"
            f" test {e['test']:.3f} (L1 {e['test_L1']:.2f} L2 {e['test_L2']:.2f} L3 {e['test_L3']:.2f}),"
            f" {elapsed:.0f} s",
            flush=True,
        )

    run = _runs.train_run(
        recipe,
        seed,
        iterations=iterations,
        token_budget=token_budget,
        eval_interval=eval_interval,
        overrides=overrides,
        out=out,
        extra_eval=extra_eval,
        step_fields=step_fields,
        on_eval=on_eval,
        key_extra={"operators": OPS_FORMAT, **recipe_key(recipe), **(rc.CONTROL_KEY if train_end_eval else {})},
        heldout_dataset=spec,
        end_eval=rc.end_eval if train_end_eval else None,
    )
    for e in run["evals"]:  # the benchmark's names for the two evaluators
        e["val"] = e["validation"]
    return run


# ---- reading -----------------------------------------------------------------------------
def report(runs: Dict[str, List[dict]], budgets: Dict[int, float]) -> List[str]:
    def cell(mine, field, fn=tb.at_budget):
        m, h, n = tb.ci95([fn(r, budgets[r["seed"]], field) for r in mine])
        return f"{m:.3f}" + (f"±{h:.3f}" if not math.isnan(h) else "      ")

    lines = [
        "budget per seed: " + ", ".join(f"seed {s}: {int(b):,}" for s, b in budgets.items()),
        "",
        f"{'variant':<22}{'n':>2} {'test@budget':>14} {'L1':>6} {'L2':>6} {'L3':>6} {'test_tail':>14}"
        f" {'val@budget':>14} {'val_tail':>14} {'steps':>5} | solve zero_var all_ok replayed pool retired",
    ]
    for name, mine in runs.items():
        steps = np.mean([tb._reach(r, budgets[r["seed"]]) for r in mine])
        ms = [tb.run_metrics(r, tb._reach(r, budgets[r["seed"]])) for r in mine]
        avg = {k: float(np.nanmean([x[k] for x in ms])) if not all(math.isnan(x[k]) for x in ms) else math.nan for k in ms[0]}
        lv = [np.mean([tb.at_budget(r, budgets[r["seed"]], f"test_L{k}") for r in mine]) for k in (1, 2, 3)]
        lines.append(
            f"{name:<22}{len(mine):>2} {cell(mine, 'test'):>14} {lv[0]:>6.3f} {lv[1]:>6.3f} {lv[2]:>6.3f}"
            f" {cell(mine, 'test', tb.tail):>14} {cell(mine, 'val'):>14} {cell(mine, 'val', tb.tail):>14}"
            f" {steps:>5.0f} | {avg['solve']:.3f} {avg['zero_var']:.3f}  {avg['all_ok']:.3f}  {avg['replayed']:.3f}"
            f" {avg['pool']:>5.0f} {avg['retired']:>6.0f}"
        )
    lines += ["", "per run: variant seed | test@budget val@budget | test/val at each evaluation step"]
    for name, mine in runs.items():
        for r in mine:
            b = budgets[r["seed"]]
            curve = " ".join(f"{e['step']}:{e['test']:.2f}/{e['val']:.2f}" for e in r["evals"])
            lines.append(f"{name:<22} {r['seed']} | {tb.at_budget(r, b, 'test'):.3f} {tb.at_budget(r, b, 'val'):.3f} | {curve}")
    return lines


def bits_at_budget(run: dict, budget: float) -> np.ndarray:
    for e in run["evals"]:
        if e["tokens"] >= budget:
            return np.array([int(c) for c in e["test_bits"]])
    return np.array([int(c) for c in run["evals"][-1]["test_bits"]])


def paired_lines(runs: Dict[str, List[dict]], budgets, a: str, b: str, rng_seed: int = 0) -> tuple:
    """The paired difference a - b of test@budget: t-interval over seeds, and a two-way
    bootstrap (seeds resampled, questions resampled) that carries the test sample's error."""
    ra = {r["seed"]: r for r in runs[a]}
    rb = {r["seed"]: r for r in runs[b]}
    seeds = sorted(set(ra) & set(rb))
    diffs = [tb.at_budget(ra[s], budgets[s], "test") - tb.at_budget(rb[s], budgets[s], "test") for s in seeds]
    m, h, n = tb.ci95(diffs)
    d = np.stack([bits_at_budget(ra[s], budgets[s]) - bits_at_budget(rb[s], budgets[s]) for s in seeds])
    rng = np.random.default_rng(rng_seed)
    boot = []
    for _ in range(2000):
        rows = rng.integers(0, d.shape[0], d.shape[0])
        cols = rng.integers(0, d.shape[1], d.shape[1])
        boot.append(d[np.ix_(rows, cols)].mean())
    lo, hi = np.percentile(boot, [2.5, 97.5])
    line = (
        f"{a} - {b} (test@budget, paired over seeds {seeds}): {m:+.3f} ± {h:.3f} (95% t, n={n});"
        f" bootstrap over seeds and questions [{lo:+.3f}, {hi:+.3f}]"
    )
    return line, m


# ---- phases ------------------------------------------------------------------------------
def positive_lines(grpo_runs: List[dict], exgrpo_runs: List[dict], budgets: Dict[int, float], best: dict, spec: str, out: Path) -> tuple:
    """The positive control's table (per seed: each set's size and both accuracies) and the
    paired mean difference on the warm-start hard set."""
    model = best["grpo"].get("model_name_or_path")
    counts_path = out / f"warm_start_counts-{spec.replace(':', '_').replace(',', '_')}-{_runs.model_build(G, model)}.json"
    overrides = {**best["grpo"], "env_config": {"dataset": spec}}
    counts = rc.warm_start_solve_counts(counts_path, lambda: _runs.build(G, 0, overrides, heldout_dataset=spec)[1])
    names = ("warm_start_hard", "pool_hard", "pooled", "all")
    lines = [f"positive control on {spec}: greedy accuracy at the end on training questions, GRPO / ExGRPO"]
    diffs: Dict[str, List[float]] = {k: [] for k in names}
    for g, e in zip(grpo_runs, exgrpo_runs):
        cells = rc.compare_at_end(g["end"], e["end"], rc.control_sets(e["end"], counts), names, diffs)
        test = (tb.at_budget(g, None, "test"), tb.at_budget(e, budgets[e["seed"]], "test"))
        lines.append(f"  seed {e['seed']}: " + cells + f" | held-out test {test[0]:.3f} / {test[1]:.3f}")
    lines += ["  " + line for line in rc.difference_lines(diffs)]
    return lines, tb.ci95(diffs["warm_start_hard"])[0]


def search_variants() -> Dict[str, tuple]:
    out = {f"grpo_lr{lr:g}": (G, {"lr": lr}) for lr in SEARCH_LRS}
    for lr in SEARCH_LRS:
        for rho in SEARCH_RHOS:
            out[f"exgrpo_lr{lr:g}_rho{rho:g}"] = (E, {"lr": lr, "experience_ratio": rho})
    return out


def final_variants(best: dict) -> Dict[str, tuple]:
    g, e = best["grpo"], best["exgrpo"]
    return {
        "grpo": (G, g, False),
        "exgrpo": (E, e, False),
        "exgrpo_prompt": (E, {**e, "replay_content": "prompt"}, False),
        "grpo_shuffled": (G, g, True),
        "exgrpo_shuffled": (E, e, True),
    }


def parallel_jobs(args, variants: Dict[str, tuple], ref: str) -> List["_parallel_runs.Job"]:
    """One job per (variant, seed) for ``--workers``: this script on that one run (the
    reference of each seed first, every other variant after its seed's reference)."""
    common = [
        "--task-seed",
        str(args.task_seed),
        "--iterations",
        str(args.iterations),
        "--eval-interval",
        str(args.eval_interval),
        "--out",
        str(args.out),
    ]
    for flag, value in (
        ("--phase", args.phase),
        ("--variants", args.variants),
        ("--best", args.best),
        ("--task-options", args.task_options),
    ):
        if value:
            common += [flag, value]
    if args.shuffled:
        common.append("--shuffled")
    logs = args.out / "_logs"
    logs.mkdir(parents=True, exist_ok=True)

    def job(name: str, seed: int, after: Optional[str]) -> _parallel_runs.Job:
        argv = _parallel_runs.python_argv(Path(__file__).resolve(), ["--seeds", str(seed), "--only", name, *common])
        return _parallel_runs.Job(f"{name}:{seed}", argv, after=after, log=logs / f"{name}-seed{seed}.log")

    refs = [job(ref, s, None) for s in args.seeds]
    return refs + [job(name, s, f"{ref}:{s}") for s in args.seeds for name in variants if name != ref]


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=("search", "final", "ablate", "xrpo", "positive"), default=None)
    ap.add_argument("--variants", default=None, help="JSON {name: [recipe 'grpo'|'exgrpo', overrides]}")
    ap.add_argument("--best", default=None, help='JSON {"grpo": {...}, "exgrpo": {...}} (final/ablate/xrpo)')
    ap.add_argument("--task-seed", type=int, default=0)
    ap.add_argument("--shuffled", action="store_true", help="positive phase: the task with meanings per question")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--iterations", type=int, default=80)
    ap.add_argument("--eval-interval", type=int, default=10)
    ap.add_argument("--only", nargs="+", default=None, help="run only these variants of the phase")
    ap.add_argument("--task-options", default="", help='extra options of the operators dataset for every run, e.g. "families=4"')
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "operators")
    ap.add_argument(
        "--workers", type=int, default=1, help="runs at once, one process pinned to each core (_parallel_runs); 1: one after another here"
    )
    args = ap.parse_args()
    if args.workers < 1:
        raise SystemExit(f"--workers {args.workers}: must be at least 1")
    return args


def phase_variants(args) -> tuple:
    """``(variants, ref, best)``: the runs of ``--variants`` or of the phase, as ``{name: (recipe,
    overrides, shuffled)}`` narrowed to ``--only`` (the reference always kept), the name of the
    budget's reference, and the parsed ``--best`` (None where the variants do not come from it)."""
    best = None
    if args.variants:
        raw = json.loads(args.variants)
        variants = {k: ({"grpo": G, "exgrpo": E}[v[0]], v[1], bool(v[2]) if len(v) > 2 else False) for k, v in raw.items()}
        # the budget's reference: the first GRPO variant, else the first variant (which then
        # runs its --iterations steps, and the others match its tokens)
        ref = next((k for k, v in variants.items() if v[0] == G), next(iter(variants)))
    elif args.phase == "search":
        variants = {k: (r, o, False) for k, (r, o) in search_variants().items()}
        ref = f"grpo_lr{SEARCH_LRS[0]:g}"
    else:
        if not args.best:
            raise SystemExit(f'--phase {args.phase} needs --best \'{{"grpo": {{...}}, "exgrpo": {{...}}}}\'')
        best = json.loads(args.best)
        ref = "grpo"
        if args.phase == "final":
            variants = final_variants(best)
        elif args.phase == "positive":
            suffix = "_shuffled" if args.shuffled else ""
            ref = f"grpo{suffix}"
            variants = {ref: (G, best["grpo"], args.shuffled), f"exgrpo{suffix}": (E, best["exgrpo"], args.shuffled)}
        elif args.phase == "ablate":
            variants = {
                "grpo": (G, best["grpo"], False),
                **{f"exgrpo_{k}": (E, {**best["exgrpo"], **v}, False) for k, v in ABLATIONS.items()},
            }
        else:
            variants = {
                "grpo": (G, best["grpo"], False),
                "exgrpo": (E, best["exgrpo"], False),
                "xrpo": (G, {**best["grpo"], **XRPO_KEYS}, False),
                "exgrpo_xrpo": (E, {**best["exgrpo"], **XRPO_KEYS}, False),
            }
    if args.only:
        variants = {k: v for k, v in variants.items() if k in set(args.only) | {ref}}
    return variants, ref, best


def run_variants(args, variants: Dict[str, tuple], ref: str, t0: float) -> tuple:
    """Train (or read from the cache) every variant on every seed -> ``(runs, budgets)``: each
    seed's reference first, its tokens after ``--iterations`` steps the seed's budget. With
    ``--workers`` > 1 the runs first train in child processes, and this pass reads them back."""
    positive = args.phase == "positive"
    if args.workers > 1:
        # The runs train in child processes, one per core; the pass below then reads them
        # all from the cache and reports as a one-process run would.
        seconds = _parallel_runs.run_jobs(parallel_jobs(args, variants, ref), args.workers)
        print(
            f"{len(seconds)} runs on {args.workers} workers: {time.time() - t0:.0f} s wall, {sum(seconds.values()):.0f} s of runs",
            flush=True,
        )
    budgets: Dict[int, float] = {}
    runs: Dict[str, List[dict]] = {k: [] for k in variants}
    for seed in args.seeds:
        r, o, sh = variants[ref]
        first = train_run(
            ref,
            r,
            o,
            seed,
            task_seed=args.task_seed,
            shuffled=sh,
            iterations=args.iterations,
            token_budget=None,
            eval_interval=args.eval_interval,
            out=args.out,
            train_end_eval=positive,
        )
        budgets[seed] = first["steps"][args.iterations - 1]["tokens"]  # the reference's tokens
        runs[ref].append(first)
        for name, (r, o, sh) in variants.items():
            if name == ref:
                continue
            # every arm, the shuffled pair included, spends the reference GRPO's tokens
            budget = budgets[seed]
            runs[name].append(
                train_run(
                    name,
                    r,
                    o,
                    seed,
                    task_seed=args.task_seed,
                    shuffled=sh,
                    iterations=args.iterations,
                    token_budget=budget,
                    eval_interval=args.eval_interval,
                    out=args.out,
                    train_end_eval=positive,
                )
            )
    return runs, budgets


def paired_comparison_lines(runs: Dict[str, List[dict]], budgets: Dict[int, float]) -> tuple:
    """``(lines, exgrpo_minus_grpo)``: the paired comparison of each pair of arms present (e.g.
    the shuffled pair run on its own), and ExGRPO's mean difference to GRPO (None without both)."""
    lines, last = [""], None
    for a, b in (
        ("exgrpo", "grpo"),
        ("exgrpo", "exgrpo_prompt"),
        ("exgrpo_shuffled", "grpo_shuffled"),
        ("xrpo", "grpo"),
        ("exgrpo_xrpo", "grpo"),
        ("exgrpo_xrpo", "exgrpo"),
    ):
        if a in runs and b in runs:
            line, m = paired_lines(runs, budgets, a, b)
            lines.append(line)
            if (a, b) == ("exgrpo", "grpo"):
                last = m
    return lines, last


def main():
    args = _parse_args()
    global TASK_OPTIONS
    TASK_OPTIONS = args.task_options

    variants, ref, best = phase_variants(args)
    positive = args.phase == "positive"
    t0 = time.time()
    runs, budgets = run_variants(args, variants, ref, t0)
    from rllib_exgrpo.envs.operators import family_blind_accuracy

    blind = family_blind_accuracy(task_spec(args.task_seed))
    lines = [
        f"operators experiment, phase {args.phase or 'variants'}, task {task_spec(args.task_seed)}, seeds {args.seeds}"
        f" ({time.time() - t0:.0f} s)",
        "family-blind answers on test by chain length: " + " ".join(f"L{k} {v:.3f}" for k, v in blind.items()),
    ]
    lines += report(runs, budgets)
    last = None
    if len(args.seeds) > 1:  # each pair present, e.g. the shuffled pair run on its own
        paired, last = paired_comparison_lines(runs, budgets)
        lines += paired
    if positive:
        last = None
        grpo_runs, exgrpo_runs = runs[ref], runs[next(k for k in variants if k != ref)]
        control, gain = positive_lines(grpo_runs, exgrpo_runs, budgets, best, task_spec(args.task_seed, args.shuffled), args.out)
        lines += [""] + control
    print("\n".join(lines))
    if positive:
        print(f"warm_start_hard_gain={gain:.4f}")
    if last is not None:
        print(f"exgrpo_minus_grpo={last:.4f}")


if __name__ == "__main__":
    main()
