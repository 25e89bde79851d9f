"""Experience testbed: GRPO vs ExGRPO where experience can matter.

    python experiments/experience_testbed.py --phase diag   [--seeds 0]
    python experiments/experience_testbed.py --phase search [--seeds 0]
    python experiments/experience_testbed.py --phase final  [--seeds 0 1 2 3 4] --best '{...}'
    python experiments/experience_testbed.py --phase ablate [--seeds 0] --best '{...}'
    python experiments/experience_testbed.py --phase weak   [--seeds 0 1 2] --model "tiny:target_pass1=0.12,threads=1"
    python experiments/experience_testbed.py --phase weak_format [--seeds 0 1 2] --model "tiny:boxed=0.02,threads=1" --weak-lr 1e-4
    python experiments/experience_testbed.py --variants '{"name": ["grpo_finite", {"lr": 1e-4}], ...}'

Testbed (tuned_examples/grpo_finite_tiny.yaml and exgrpo_finite_tiny.yaml, twins): the
embedded tiny Qwen2 on a FINITE training set of 600 arithmetic questions (levels 1-4, the
held-out distribution; the warm start solves levels 1/2/3/4 at about 55/52/7/19%), 32
questions x 8 completions per step, 80 steps = 2560 question draws = 4.3 epochs of the set.

Two evaluators (three with ``--final-set on``, the final phase's default), all greedy, all
on the arithmetic *test* split (never trained on: the train and test splits are disjoint
by construction, envs/arithmetic.py):

* ``test``: the first 200 test questions, exactly ``_runs.heldout_accuracy`` (the final
  figures, the same set as compare.py);
* ``val``: test questions 200-400 (``validation_accuracy`` below), the only numbers that
  tuning looks at;
* ``final``: the large final set (FINAL_SET_DATASET below, 2200 questions outside
  validation, the mean of the four level accuracies), declared before its
  runs.

Every run goes through ``_runs`` (its ``build``, cache naming and reading helpers); runs are
cached as JSON under ``--out`` (default benchmarks/out/testbed/runs), so a killed phase
resumes. Equal budget as in compare.py: for each seed the budget is the completion tokens
the phase's reference GRPO variant has sampled after ``--iterations`` steps; every variant
trains until it has done ``--iterations`` steps and spent that budget, and is read at the
first evaluation whose tokens reach the budget (evaluations every ``--eval-interval`` steps
and at the crossing step).

Selection metric (decided before looking): ``val_tail``, the mean validation accuracy of the
evaluations at or after 70% of the budget, up to the crossing (4 to 5 evaluations: less
noise than one point). The final figure is ``test@budget`` (one point, as compare.py), with
``test_tail`` next to it; mean and 95% t-interval over seeds, and the paired difference.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

import _paths  # noqa: F401  (benchmarks/ on sys.path: _common, _runs)
import _common
from _common import ROOT
import _runs

_common.RECIPES.setdefault("grpo_finite", ("grpo_finite_tiny.yaml", {}))
_common.RECIPES.setdefault("exgrpo_finite", ("exgrpo_finite_tiny.yaml", {}))
# RLlib's stock PPO on the same finite set (ppo_tiny.yaml's settings otherwise).
_common.RECIPES.setdefault("ppo_finite", ("ppo_tiny.yaml", {"env_config": {"dataset": "arithmetic:levels=1-4,n=600"}}))

VAL_SLICE = (200, 400)
TESTBED_FORMAT = 1
#: The large final set (declared, with its score, before any run read it): every
#: question of ``arithmetic:n_test=2400`` outside the validation slice, 2200 questions. The
#: test split holds only 30 level-1 and 82 level-3 questions (small problem spaces; the
#: generator dedupes), so the set has all of them there are outside validation (29 and 59)
#: next to 699 of level 2 and 1413 of level 4. Its score, ``final``, is the mean of the four
#: level accuracies: the training set's uniform level mix, whatever the held-out counts.
#: The pooled accuracy and each level's are recorded too, and every question's outcome
#: (``final_bits``, in set order) for paired bootstraps over questions. The first 200
#: questions (``test``) are part of it; validation (200-400) never is. Runs that use it
#: are their own cache entries (``--final-set``; the default of the final phase).
FINAL_SET_DATASET = "arithmetic:n_test=2400"
FINAL_SET_SIZE = 2400
FINAL_FORMAT = 2
LEARNER_KEYS = (
    "policy_loss",
    "entropy",
    "clip_fraction",
    "ratio_mean",
    "ratio_max",
    "replay_ratio_mean",
    "replay_shaping_mean",
    "grad_norm_preclip",
    "update_skipped",
)
TOP_KEYS = ("reward_mean", "solve_rate", "zero_variance_group_fraction", "all_correct_group_fraction")

G, E, P = "grpo_finite", "exgrpo_finite", "ppo_finite"
#: XRPO's keys (xrpo_tiny.yaml): planner, in-context seeding, novelty sharpening, on top of
#: the GRPO twin (XRPO) or the ExGRPO twin (ExGRPO+XRPO).
XRPO_KEYS = {
    "xrpo_planner": True,
    "planner_n0": 4,
    "planner_rounds": 2,
    "icl_seeding": True,
    "icl_num_examples": 2,
    "icl_samples": 4,
    "novelty_sharpening": True,
}
#: Every method of the protocol: (recipe, its base overrides, short name, its own key
#: switch as (config key, values) or None). The search gives each one the same learning
#: rates x its key switch.
METHODS = {
    "grpo": (G, {}, "grpo", None),
    "exgrpo": (E, {}, "ex", ("experience_ratio", (0.25, 0.5))),
    "xrpo": (G, XRPO_KEYS, "xrpo", ("icl_seeding", (True, False))),
    # rho fixed at ExGRPO's selected 0.25 (machine time): lr x 3 only, less search than the others
    "exgrpo_xrpo": (E, XRPO_KEYS, "exx", ("experience_ratio", (0.25,))),
    "ppo": (P, {}, "ppo", None),
}
SWITCH_LABEL = {"experience_ratio": "rho", "icl_seeding": "icl"}
#: Phase 2: one switch at a time on top of the official ExGRPO defaults (lr 3e-4).
DIAG = {
    # (the lr / experience_ratio variants spell their overrides as the search does, so the
    # cached runs are shared with it)
    "grpo": [G, {"lr": 3e-4}],
    "exgrpo": [E, {"lr": 3e-4, "experience_ratio": 0.5}],
    "ex_keepclip": [E, {"remove_clip_in_mixed_mode": False}],
    "ex_rho0.25": [E, {"lr": 3e-4, "experience_ratio": 0.25}],
    "grpo_lr1e-4": [G, {"lr": 1e-4}],
    "ex_lr1e-4": [E, {"lr": 1e-4, "experience_ratio": 0.5}],
    "ex_noshaping": [E, {"policy_shaping": False}],
    "ex_random_traj": [E, {"trajectory_selection": "random"}],
    "ex_delay0.6": [E, {"delayed_start_solve_rate": 0.6}],
    "ex_noretire": [E, {"retire_solved": False}],
    # not an official default: draw pooled questions uniformly instead of by the Gaussian
    # bucket weight (on this pool the mid buckets hold 2-8 questions, replayed every step)
    "ex_lr1e-4_uniform": [E, {"lr": 1e-4, "experience_ratio": 0.5, "bucket_weighting": "uniform"}],
}
#: Phase 3: equal-effort validation search: the same three learning rates for each method
#: (around the 1e-4 at which GRPO was stable over 80 steps in the diag phase; 3e-4 broke it
#: at step ~75), plus ExGRPO's own key switch, the experience ratio. The first lr's GRPO
#: run is the budget reference.
SEARCH_LRS = (1e-4, 5e-5, 2e-4)


#: Phase "search2": a second round, the same effort ratio as the first (two
#: ExGRPO arms per GRPO arm). ExGRPO gets the small-pool switches its first round pointed
#: at -- a replay cooldown (not in the papers) and a lower bucket mean, on the selected
#: lr 1e-4 / rho 0.25, and the official rho 0.5 with a cooldown; GRPO gets its own two
#: levers on the same data: a higher lr and a second epoch over each batch (its form of
#: reusing samples). The first entry (cached from the first round) sets the budget.
SEARCH2 = {
    "grpo_lr1e-04": [G, {"lr": 1e-4}],
    "grpo_lr3e-04": [G, {"lr": 3e-4}],
    "grpo_lr2e-04_ep2": [G, {"lr": 2e-4, "num_epochs": 2}],
    "ex_cd1": [E, {"lr": 1e-4, "experience_ratio": 0.25, "replay_cooldown_steps": 1}],
    "ex_cd4": [E, {"lr": 1e-4, "experience_ratio": 0.25, "replay_cooldown_steps": 4}],
    "ex_mu0.25": [E, {"lr": 1e-4, "experience_ratio": 0.25, "bucket_mu": 0.25}],
    "ex_rho0.5_cd4": [E, {"lr": 1e-4, "experience_ratio": 0.5, "replay_cooldown_steps": 4}],
}

#: Phase "ablate": the paper's ablations (bucket weights, trajectory choice, policy shaping,
#: experience ratio), each one switch on top of the chosen ExGRPO setting.
ABLATIONS = {
    "abl_uniform_buckets": {"bucket_weighting": "uniform"},
    "abl_highest_entropy": {"trajectory_selection": "highest_entropy"},
    "abl_random_traj": {"trajectory_selection": "random"},
    "abl_no_shaping": {"policy_shaping": False},
    "abl_rho0.5": {"experience_ratio": 0.5},
    "abl_rho0.75": {"experience_ratio": 0.75},
}


def validation_accuracy(algo, max_new_tokens: int) -> float:
    """Greedy accuracy on held-out (test-split) questions 200-400: the tuning set, disjoint
    from both the training set and the 200 questions of the final figures."""
    problems = algo.env_runner.heldout_env.problems
    ids = [p.id for p in problems][VAL_SLICE[0] : VAL_SLICE[1]]
    if len(ids) < VAL_SLICE[1] - VAL_SLICE[0]:
        raise ValueError(f"held-out set has {len(problems)} questions; need {VAL_SLICE[1]}")
    return float(np.mean(list(_runs.greedy_rewards(algo, ids, max_new_tokens).values())))


def final_set_questions(problems) -> list:
    """The final set's problems (in order): the held-out problems outside VAL_SLICE."""
    if len(problems) < FINAL_SET_SIZE:
        raise ValueError(f"held-out set has {len(problems)} questions; the final set needs {FINAL_SET_SIZE}")
    return [p for i, p in enumerate(problems[:FINAL_SET_SIZE]) if not VAL_SLICE[0] <= i < VAL_SLICE[1]]


def final_set_scores(problems, correct: Dict[str, float]) -> dict:
    """``final`` (mean of the level accuracies), ``final_pooled``, ``final_L<k>`` and
    ``final_bits`` from each question's reward (``correct``: question id -> 0/1)."""
    levels = sorted({p.difficulty for p in problems})
    by_level = {k: float(np.mean([correct[p.id] for p in problems if p.difficulty == k])) for k in levels}
    return {
        "final": float(np.mean(list(by_level.values()))),
        "final_pooled": float(np.mean([correct[p.id] for p in problems])),
        **{f"final_L{k}": v for k, v in by_level.items()},
        "final_bits": "".join("1" if correct[p.id] > 0.5 else "0" for p in problems),
    }


def final_set_accuracy(algo, max_new_tokens: int) -> dict:
    """Greedy scores on the final set (see FINAL_SET_DATASET), the same runner call as the
    other evaluators."""
    problems = final_set_questions(list(algo.env_runner.heldout_env.problems))
    return final_set_scores(problems, _runs.greedy_rewards(algo, [p.id for p in problems], max_new_tokens))


def train_run(
    name: str,
    seed: int,
    *,
    iterations: int,
    token_budget: Optional[float],
    eval_interval: int,
    overrides: dict,
    out: Path,
    model: Optional[str] = None,
    log=print,
    final_set: bool = False,
) -> dict:
    """_runs.train_run with both evaluators (plus the final set when ``final_set``) and the
    learner / experience metrics per step."""

    def step_fields(result) -> dict:
        learner = (result.get("learners") or {}).get("default_policy", {})
        return {
            "top": {k: float(result[k]) for k in TOP_KEYS if isinstance(result.get(k), (int, float))},
            "learner": {k: float(learner[k]) for k in LEARNER_KEYS if isinstance(learner.get(k), (int, float))},
        }

    def on_eval(e: dict, elapsed: float) -> None:
        log(
            f"  {name} seed {seed} step {e['step']}: tokens {int(e['tokens']):,}, test {e['accuracy']:.3f}"
            f" val {e['val']:.3f}" + (f" final {e['final']:.3f}" if "final" in e else "") + f", {elapsed:.0f} s",
            flush=True,
        )

    def extra_eval(algo, max_tokens):
        return {"val": validation_accuracy(algo, max_tokens), **(final_set_accuracy(algo, max_tokens) if final_set else {})}

    return _runs.train_run(
        name,
        seed,
        iterations=iterations,
        token_budget=token_budget,
        eval_interval=eval_interval,
        overrides=overrides,
        out=out,
        model=model,
        key_extra={"testbed": FINAL_FORMAT if final_set else TESTBED_FORMAT},
        extra_eval=extra_eval,
        step_fields=step_fields,
        on_eval=on_eval,
        heldout_dataset=FINAL_SET_DATASET if final_set else _runs.HELDOUT_DATASET,
    )


# ---- reading -----------------------------------------------------------------------------
def at_budget(run: dict, budget: Optional[float], field: str) -> float:
    """The first evaluation at or past ``budget`` tokens; the last one when ``budget`` is
    None (equal steps)."""
    if budget is None:
        return run["evals"][-1][field]
    for e in run["evals"]:
        if e["tokens"] >= budget:
            return e[field]
    return math.nan


def tail(run: dict, budget: Optional[float], field: str, frac: float = 0.7) -> float:
    if budget is None:  # equal steps: the evaluations from frac of the run's steps on
        last = run["evals"][-1]["step"]
        return float(np.mean([e[field] for e in run["evals"] if e["step"] >= frac * last]))
    vals = []
    for e in run["evals"]:
        if e["tokens"] >= frac * budget:
            vals.append(e[field])
        if e["tokens"] >= budget:
            break
    return float(np.mean(vals)) if vals else math.nan


def ci95(values) -> tuple:
    """(mean, half-width of the 95% t-interval, n)."""
    from scipy import stats

    a = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if a.size < 2:
        return (float(a.mean()) if a.size else math.nan, math.nan, int(a.size))
    return float(a.mean()), float(stats.t.ppf(0.975, a.size - 1) * a.std(ddof=1) / math.sqrt(a.size)), int(a.size)


def run_metrics(run: dict, upto: Optional[int] = None, last: int = 30) -> Dict[str, float]:
    """Mean of the diagnostic metrics over the last ``last`` steps (up to ``upto``)."""
    steps = run["steps"][:upto] if upto else run["steps"]
    window = steps[-last:]

    def m(section, k):
        # NaN: a step with no such tokens (replay ratios on a step that replayed nothing)
        v = [x for x in (s[section].get(k) for s in window) if x is not None and not math.isnan(x)]
        return float(np.mean(v)) if v else math.nan

    last_exp = steps[-1]["experience"]
    return {
        "solve": float(np.mean([s["solve_rate"] for s in window])),
        "zero_var": m("top", "zero_variance_group_fraction"),
        "all_ok": m("top", "all_correct_group_fraction"),
        "loss": m("learner", "policy_loss"),
        "clip": m("learner", "clip_fraction"),
        "shaping": m("learner", "replay_shaping_mean"),
        "entropy": m("learner", "entropy"),
        "gnorm": m("learner", "grad_norm_preclip"),
        "replayed": m("experience", "replayed_fraction"),
        "pool": last_exp.get("pool_size", math.nan),
        "retired": last_exp.get("retired", math.nan),
        "switch": last_exp.get("switch_iteration", math.nan),
    }


def _reach(run: dict, budget: Optional[float]) -> int:
    return len(run["steps"]) if budget is None else _runs.steps_to_budget(run, budget)


def report(runs: Dict[str, List[dict]], budgets: Dict[int, float], ref: str) -> List[str]:
    lines = [
        f"budget per seed (tokens of '{ref}' after its iterations): "
        + ", ".join(f"seed {s}: {int(b):,}" if b is not None else f"seed {s}: none (equal steps)" for s, b in budgets.items()),
        "",
        f"{'variant':<18}{'n':>2} {'test@budget':>16} {'test_tail':>14} {'val@budget':>14} {'val_tail':>14}"
        f" {'steps':>5} | solve zero_var all_ok  clip  shaping entropy replayed pool retired switch",
    ]

    def cell(mine, field, fn=at_budget):
        """Mean ± 95% half-width over seeds of ``fn(run, budget, field)``."""
        m, h, n = ci95([fn(r, budgets[r["seed"]], field) for r in mine])
        return f"{m:.3f}" + (f"±{h:.3f}" if not math.isnan(h) else "      ")

    for name, mine in runs.items():
        steps = np.mean([_reach(r, budgets[r["seed"]]) for r in mine])
        ms = [run_metrics(r, _reach(r, budgets[r["seed"]])) for r in mine]
        avg = {k: float(np.nanmean([x[k] for x in ms])) if not all(math.isnan(x[k]) for x in ms) else math.nan for k in ms[0]}
        lines.append(
            f"{name:<18}{len(mine):>2} {cell(mine, 'accuracy'):>16} {cell(mine, 'accuracy', tail):>14}"
            f" {cell(mine, 'val'):>14} {cell(mine, 'val', tail):>14} {steps:>5.0f} |"
            f" {avg['solve']:.3f} {avg['zero_var']:.3f}  {avg['all_ok']:.3f} {avg['clip']:.3f} {avg['shaping']:.3f}"
            f"   {avg['entropy']:.3f}   {avg['replayed']:.3f} {avg['pool']:>4.0f} {avg['retired']:>6.0f} {avg['switch']:>4.0f}"
        )
    if all("final" in r["evals"][0] for mine in runs.values() for r in mine):
        lines += [
            "",
            f"final set ({FINAL_SET_DATASET} outside validation; score = mean of the level accuracies):",
            f"{'variant':<18}{'n':>2} {'final@budget':>16} {'final_tail':>14} {'pooled@budget':>14}"
            + "".join(f" {f'L{k}@budget':>14}" for k in (1, 2, 3, 4)),
        ]
        for name, mine in runs.items():
            lines.append(
                f"{name:<18}{len(mine):>2} {cell(mine, 'final'):>16} {cell(mine, 'final', tail):>14}"
                f" {cell(mine, 'final_pooled'):>14}" + "".join(f" {cell(mine, f'final_L{k}'):>14}" for k in (1, 2, 3, 4))
            )
    lines += ["", "per run: variant seed | test@budget val@budget | test/val at each evaluation step"]
    for name, mine in runs.items():
        for r in mine:
            b = budgets[r["seed"]]
            curve = " ".join(f"{e['step']}:{e['accuracy']:.2f}/{e['val']:.2f}" for e in r["evals"])
            fin = f" final {at_budget(r, b, 'final'):.3f}" if "final" in r["evals"][0] else ""
            lines.append(f"{name:<18} {r['seed']} | {at_budget(r, b, 'accuracy'):.3f} {at_budget(r, b, 'val'):.3f}{fin} | {curve}")
    return lines


def plot(runs: Dict[str, List[dict]], budgets: Dict[int, float], path: Path, title: str, field: str = "accuracy") -> None:
    """Two panels: held-out accuracy (``field``: the 200 test questions, or the final set's
    score) against sampled tokens, mean over seeds with
    its 95% t-band (evaluations aligned by step), and the training reward (solve rate)
    per step, mean over seeds (thin lines: each seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scipy import stats

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for i, (name, mine) in enumerate(runs.items()):
        color = f"C{i}"
        steps = sorted(set.intersection(*[{e["step"] for e in r["evals"]} for r in mine]))
        by_step = [[next(e for e in r["evals"] if e["step"] == s) for r in mine] for s in steps]
        x = np.array([np.mean([e["tokens"] for e in es]) for es in by_step]) / 1e3
        y = np.array([[e[field] for e in es] for es in by_step])
        mean = y.mean(axis=1)
        ax.plot(x, mean, color=color, marker="o", ms=3, label=f"{name} (n={len(mine)})")
        if len(mine) > 1:
            half = stats.t.ppf(0.975, len(mine) - 1) * y.std(axis=1, ddof=1) / math.sqrt(len(mine))
            ax.fill_between(x, mean - half, mean + half, color=color, alpha=0.18)
        n = min(len(r["steps"]) for r in mine)
        reward = np.array([[r["steps"][k]["solve_rate"] for k in range(n)] for r in mine])
        ax2.plot(np.arange(1, n + 1), reward.mean(axis=0), color=color, label=name)
        for row in reward:
            ax2.plot(np.arange(1, n + 1), row, color=color, lw=0.5, alpha=0.35)
    if budgets and all(b is not None for b in budgets.values()):
        ax.axvline(np.mean(list(budgets.values())) / 1e3, color="grey", ls=":", lw=1, label="budget")
    ax.set_xlabel("sampled completion tokens (thousands)")
    ax.set_ylabel(
        "held-out accuracy (greedy, 200 test questions)"
        if field == "accuracy"
        else "final-set score (greedy, 2200 questions, level mean)"
        if field == "final"
        else field
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax2.set_xlabel("training step")
    ax2.set_ylabel("training reward (solve rate of the step)")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def tokens_to_reach(mine: List[dict], target: float, field: str = "accuracy") -> Optional[float]:
    """Mean sampled tokens at the first evaluation step (common to all seeds) at which the
    seeds' mean ``field`` reaches ``target``; None if it never does."""
    steps = sorted(set.intersection(*[{e["step"] for e in r["evals"]} for r in mine]))
    for s in steps:
        es = [next(e for e in r["evals"] if e["step"] == s) for r in mine]
        if np.mean([e[field] for e in es]) >= target - 1e-9:
            return float(np.mean([e["tokens"] for e in es]))
    return None


def reach_lines(runs: Dict[str, List[dict]], budgets, ref: str, field: str = "accuracy") -> List[str]:
    """How soon each method reaches the reference's final (mean ``field``@budget over
    seeds): the issue's "in at most half of GRPO's sampled tokens" reading."""
    target = float(np.mean([at_budget(r, budgets[r["seed"]], field) for r in runs[ref]]))
    budget = float(np.mean(list(budgets.values())))
    what = "test accuracy" if field == "accuracy" else f"'{field}' score"
    lines = [
        f"tokens to reach {ref}'s final {what} {target:.3f} (mean over seeds, evaluation steps common to all seeds; budget {budget:,.0f}):"
    ]
    for name, mine in runs.items():
        t = tokens_to_reach(mine, target, field)
        lines.append(f"  {name:<18} " + ("never within the run" if t is None else f"{t:,.0f} tokens = {t / budget:.2f} x budget"))
    return lines


def paired(runs: Dict[str, List[dict]], budgets, a: str, b: str, field: str = "accuracy") -> str:
    ra = {r["seed"]: at_budget(r, budgets[r["seed"]], field) for r in runs[a]}
    rb = {r["seed"]: at_budget(r, budgets[r["seed"]], field) for r in runs[b]}
    seeds = sorted(set(ra) & set(rb))
    m, h, n = ci95([ra[s] - rb[s] for s in seeds])
    return f"{a} - {b} ({field}@budget, paired over seeds {seeds}): {m:+.3f} ± {h:.3f} (95% t, n={n})"


def half_budget_lines(runs: Dict[str, List[dict]], budgets, ref: str) -> List[str]:
    """The weak-start reading: test accuracy at the start and at half the budget (the first
    evaluation at or past half of each seed's budget), each method's change from its start,
    and each method minus ``ref`` paired over seeds."""
    half = {s: b / 2 for s, b in budgets.items()}
    lines = [f"at half the budget ({', '.join(f'seed {s}: {int(h):,}' for s, h in half.items())} tokens):"]
    for name, mine in runs.items():
        start = ci95([r["evals"][0]["accuracy"] for r in mine])
        now = ci95([at_budget(r, half[r["seed"]], "accuracy") for r in mine])
        gain = ci95([at_budget(r, half[r["seed"]], "accuracy") - r["evals"][0]["accuracy"] for r in mine])
        lines.append(
            f"  {name:<18} start {start[0]:.3f}  test {now[0]:.3f} ± {now[1]:.3f}  "
            f"change from start {gain[0]:+.3f} ± {gain[1]:.3f} (95% t, n={now[2]})"
        )
    for name in runs:
        if name == ref:
            continue
        ra = {r["seed"]: at_budget(r, half[r["seed"]], "accuracy") for r in runs[name]}
        rb = {r["seed"]: at_budget(r, half[r["seed"]], "accuracy") for r in runs[ref]}
        seeds = sorted(set(ra) & set(rb))
        m, h, n = ci95([ra[s] - rb[s] for s in seeds])
        lines.append(f"  {name} - {ref} (test at half the budget, paired over seeds {seeds}): {m:+.3f} ± {h:.3f} (95% t, n={n})")
    return lines


def takeoff_lines(runs: Dict[str, List[dict]], threshold: float = 0.1) -> List[str]:
    """When each weak-start run found its first success and when it left its start.

    Per run: the first training step with a non-zero solve rate (its first rewarded
    answer), and the first evaluation whose test accuracy reaches ``threshold`` ("never"
    when none does). From a format-weak start the first success decides when any arm can
    leave, so the half-budget reading is read next to it."""
    lines = [f"first success (training step) and first evaluation with test >= {threshold:g}, per run:"]
    for name, mine in runs.items():
        for r in sorted(mine, key=lambda r: r["seed"]):
            first = next((s["step"] for s in r["steps"] if s.get("solve_rate", 0.0) > 0), None)
            leave = next((e["step"] for e in r["evals"] if e["accuracy"] >= threshold), None)
            lines.append(
                f"  {name:<18} seed {r['seed']:<3} first success "
                f"{'never' if first is None else f'step {first}'}, test >= {threshold:g} "
                f"{'never' if leave is None else f'at step {leave}'}"
            )
    return lines


def final_set_levels() -> np.ndarray:
    """The level of each final-set question, in ``final_bits`` order."""
    from rllib_exgrpo.envs.datasets import load_problems

    return np.array([p.difficulty for p in final_set_questions(list(load_problems(FINAL_SET_DATASET, split="test")))])


def _bits_at_budget(run: dict, budget: Optional[float]) -> Optional[np.ndarray]:
    """Each final-set question's outcome (0/1) at the budget; None if the run never got there."""
    if budget is None:
        e = run["evals"][-1]
    else:
        e = next((e for e in run["evals"] if e["tokens"] >= budget), None)
        if e is None:
            return None
    return np.frombuffer(e["final_bits"].encode(), dtype=np.uint8) - ord("0")


def paired_bootstrap(runs: Dict[str, List[dict]], budgets, a: str, b: str, levels: np.ndarray, draws: int = 4000, seed: int = 0) -> str:
    """``a - b`` on the final score at the budget, paired over seeds, with a 95% interval
    from a two-way bootstrap: seeds resampled (training noise) and, within each level,
    questions resampled (the held-out sample's own error, which a t-interval over seeds on
    one fixed question set leaves out).

    The interval is approximate, in both directions: drawing seeds and questions
    independently counts each (seed, question) outcome's own noise twice (too wide), while
    a percentile interval over 5 seeds has no small-sample t correction (too narrow). It
    is reported next to the t-interval over seeds, not instead of it. Levels 1 and 3 hold
    nearly every such question the split has (29 and 59), so resampling them overstates
    their part; with equal level weights the question error is about that of ~300 pooled
    questions, not 2200."""
    ra = {r["seed"]: _bits_at_budget(r, budgets[r["seed"]]) for r in runs[a]}
    rb = {r["seed"]: _bits_at_budget(r, budgets[r["seed"]]) for r in runs[b]}
    missing = sorted(s for s in set(ra) | set(rb) if ra.get(s) is None or rb.get(s) is None)
    seeds = sorted(s for s in set(ra) & set(rb) if s not in missing)
    if not seeds:
        return f"{a} - {b} (final@budget): no seed where both reached the budget"
    diff = np.stack([ra[s].astype(float) - rb[s].astype(float) for s in seeds])  # (seeds, questions)
    if diff.shape[1] != len(levels):
        raise ValueError(f"{diff.shape[1]} final-set outcomes per run but {len(levels)} question levels")
    ks = sorted(set(levels.tolist()))
    idx = {k: np.flatnonzero(levels == k) for k in ks}

    def score(d: np.ndarray, cols: Dict[int, np.ndarray]) -> float:  # d: (seeds, questions)
        return float(np.mean([d[:, cols[k]].mean() for k in ks]))

    point = score(diff, idx)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(draws):
        rows = diff[rng.integers(0, len(seeds), len(seeds))]
        cols = {k: v[rng.integers(0, len(v), len(v))] for k, v in idx.items()}
        boots.append(score(rows, cols))
    lo, hi = np.percentile(boots, [2.5, 97.5])
    note = f" (seeds {missing} left out: short of the budget)" if missing else ""
    return (
        f"{a} - {b} (final@budget, paired over seeds {seeds}): {point:+.3f}, 95% bootstrap over seeds and "
        f"questions [{lo:+.3f}, {hi:+.3f}]; {np.mean(np.array(boots) > 0):.0%} of draws above 0{note}"
    )


def with_train_dataset(variants: Dict[str, list], dataset: str) -> Dict[str, list]:
    """``variants`` with every run trained on ``dataset`` (its ``env_config.dataset``; the
    other ``env_config`` keys kept). The evaluators do not change: they read the test
    split, which no training split shares a question with."""
    return {
        name: [recipe, {**ov, "env_config": {**ov.get("env_config", {}), "dataset": dataset}}] for name, (recipe, ov) in variants.items()
    }


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=["diag", "search", "search2", "final", "weak", "weak_format", "ablate", "custom"], default="custom")
    p.add_argument(
        "--variants",
        default=None,
        help='JSON {"name": [recipe, overrides], ...} (custom phase; with another phase: only these names of it)',
    )
    p.add_argument("--only", nargs="+", default=None, help="run only these variant names of the phase")
    p.add_argument("--best", default="{}", help='final phase: JSON {"grpo": {...}, "exgrpo": {...}} overrides')
    p.add_argument(
        "--methods",
        nargs="+",
        choices=sorted(METHODS),
        default=["grpo", "exgrpo"],
        help="search: the methods searched (GRPO's first lr always runs: the budget reference)",
    )
    p.add_argument("--rhos", nargs="+", type=float, default=[0.25, 0.5], help="search: ExGRPO experience_ratio values")
    p.add_argument(
        "--lrs",
        nargs="+",
        type=float,
        default=list(SEARCH_LRS),
        help="search: learning rates, the same for each method (the first GRPO one sets the budget)",
    )
    p.add_argument("--ex-base", default="{}", help="search: JSON overrides of every ExGRPO variant")
    p.add_argument("--ref", default=None, help="variant whose tokens set the budget (default: the first GRPO one)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--model", default=None, help="policy model of every run (default: the recipes' tiny)")
    p.add_argument(
        "--equal-steps",
        action="store_true",
        help="every variant runs --iterations steps, no token budget (the weak phase's default: a "
        "collapsed policy writes max-length completions, which would inflate the budget)",
    )
    p.add_argument(
        "--weak-lr", type=float, default=1e-3, help="weak phase: the learning rate of both methods (one at which on-policy GRPO collapses)"
    )
    p.add_argument(
        "--final-set",
        choices=["on", "off"],
        default=None,
        help="also evaluate the large final set (FINAL_SET_DATASET; default: on in the final phase, "
        "off elsewhere, where cached runs without it are reused)",
    )
    p.add_argument(
        "--train-dataset",
        default=None,
        help='training set of every variant (env_config.dataset), e.g. "arithmetic:levels=1-4,n=5000" '
        "(default: the recipes' finite 600 questions)",
    )
    p.add_argument("--iterations", type=int, default=80)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "testbed"))
    return p.parse_args()


def search_variants(args) -> Dict[str, list]:
    """The search phase: each of ``--methods`` at each of ``--lrs`` x its key switch (ExGRPO's
    experience ratio from ``--rhos``). GRPO is always there: its first lr sets the budget."""
    methods = ["grpo"] + [m for m in args.methods if m != "grpo"]
    variants = {}
    for method in methods:
        recipe, base, short, switch = METHODS[method]
        base = {**base, **(json.loads(args.ex_base) if method == "exgrpo" else {})}
        lrs = args.lrs[:1] if method == "grpo" and "grpo" not in args.methods else args.lrs
        for lr in lrs:
            if switch is None:
                variants[f"{short}_lr{lr:.0e}"] = [recipe, {**base, "lr": lr}]
                continue
            key, values = switch
            values = args.rhos if method == "exgrpo" else values
            for v in values:
                label = f"{SWITCH_LABEL[key]}{int(v) if isinstance(v, bool) else v}"
                variants[f"{short}_lr{lr:.0e}_{label}"] = [recipe, {**base, "lr": lr, key: v}]
    return variants


def phase_variants(args) -> Dict[str, list]:
    """The variants the command line asks for: the phase's, plus ``--variants``, narrowed to
    ``--only``, trained on ``--train-dataset`` when given."""
    if args.phase == "diag":
        variants = dict(DIAG)
    elif args.phase == "search":
        variants = search_variants(args)
    elif args.phase == "search2":
        variants = dict(SEARCH2)
    elif args.phase in ("weak", "weak_format"):
        # The delayed start (solve rate > 0.35) would never fire from a weak start, leaving
        # ExGRPO = GRPO; here mixed mode is on from the first step (stated in the docs).
        # weak_format: a format-weak warm start (--model "tiny:boxed=0.02,...") that computes
        # like the default one but rarely boxes its answers (only boxed, correct answers are
        # rewarded), at a tuned, non-collapsing --weak-lr; unlike "weak" it runs at equal
        # sampled tokens (the answers' length does not change with the format) and is also
        # read at half the budget.
        variants = {"grpo": [G, {"lr": args.weak_lr}], "exgrpo": [E, {"lr": args.weak_lr, "delayed_start_solve_rate": 0.0}]}
    elif args.phase == "ablate":
        # The paper's ablations, one switch at a time on top of --best's ExGRPO setting, next
        # to --best's GRPO (the budget reference).
        best = json.loads(args.best)
        base = best.get("exgrpo", {})
        variants = {"grpo": [G, best.get("grpo", {})], "exgrpo": [E, base]}
        for name, switch in ABLATIONS.items():
            variants[name] = [E, {**base, **switch}]
    elif args.phase == "final":
        # Each method of --best at its selected setting (GRPO first: the budget reference).
        best = json.loads(args.best)
        variants = {
            m: [METHODS[m][0], {**METHODS[m][1], **best.get(m, {})}] for m in ["grpo"] + [m for m in METHODS if m in best and m != "grpo"]
        }
    else:
        variants = {}
    if args.variants:
        variants.update(json.loads(args.variants))
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only}
    if args.train_dataset:
        variants = with_train_dataset(variants, args.train_dataset)
    return variants


def run_seeds(args, variants: Dict[str, list], order: List[str], out: Path, equal_steps: bool, final_set: bool) -> tuple:
    """For each seed: the reference variant ``order[0]`` (its tokens after ``--iterations``
    steps set the seed's budget), then every other variant; the report so far after each
    seed. Returns ``(runs, budgets)``."""
    ref = order[0]
    runs: Dict[str, List[dict]] = {k: [] for k in order}
    budgets: Dict[int, float] = {}
    for seed in args.seeds:
        recipe, ov = variants[ref]
        r = train_run(
            recipe,
            seed,
            iterations=args.iterations,
            token_budget=None,
            eval_interval=args.eval_interval,
            overrides=ov,
            out=out,
            model=args.model,
            final_set=final_set,
        )
        runs[ref].append(r)
        budgets[seed] = None if equal_steps else r["steps"][args.iterations - 1]["tokens"]
        for name in order[1:]:
            recipe, ov = variants[name]
            t0 = time.time()
            runs[name].append(
                train_run(
                    recipe,
                    seed,
                    iterations=args.iterations,
                    token_budget=None if equal_steps else budgets[seed],
                    eval_interval=args.eval_interval,
                    overrides=ov,
                    out=out,
                    model=args.model,
                    final_set=final_set,
                )
            )
            r = runs[name][-1]
            print(
                f"[{time.strftime('%H:%M:%S')}] {name} seed {seed}: test@budget "
                f"{at_budget(r, budgets[seed], 'accuracy'):.3f} val@budget {at_budget(r, budgets[seed], 'val'):.3f}"
                f" ({time.time() - t0:.0f} s)",
                flush=True,
            )
        runs_so_far = {k: v for k, v in runs.items() if v}
        print("\n".join(report(runs_so_far, budgets, ref)), flush=True)
    return runs, budgets


def comparison_lines(args, runs: Dict[str, List[dict]], budgets, order: List[str], final_set: bool) -> List[str]:
    """The paired comparisons of the final and weak phases (over several seeds): each variant
    against the reference ``order[0]``."""
    ref = order[0]
    lines = [""]
    for name in order[1:]:
        lines += [paired(runs, budgets, name, ref), paired(runs, budgets, name, ref, "val")]
    if args.phase == "weak_format":
        lines += [""] + half_budget_lines(runs, budgets, ref) + [""] + takeoff_lines(runs)
    if final_set:
        levels = final_set_levels()
        lines.append("")
        for name in order[1:]:
            lines += [paired(runs, budgets, name, ref, "final"), paired_bootstrap(runs, budgets, name, ref, levels)]
    if all(b is not None for b in budgets.values()):
        lines += [""] + reach_lines(runs, budgets, ref)
        if final_set:
            lines += reach_lines(runs, budgets, ref, "final")
    return lines


def main():
    args = _parse_args()
    variants = phase_variants(args)
    ref = args.ref or next(k for k, (recipe, _) in variants.items() if recipe == G)
    order = [ref] + [k for k in variants if k != ref]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    equal_steps = args.equal_steps or args.phase == "weak"
    final_set = (args.final_set or ("on" if args.phase == "final" else "off")) == "on"
    runs, budgets = run_seeds(args, variants, order, out, equal_steps, final_set)
    lines = report(runs, budgets, ref)
    if args.phase in ("final", "weak", "weak_format") and len(args.seeds) > 1:
        lines += comparison_lines(args, runs, budgets, order, final_set)
    if args.phase in ("final", "weak", "weak_format"):
        png = out / f"plot-{args.phase}{'-final-set' if final_set else ''}.png"
        plot(
            runs,
            budgets,
            png,
            f"experience testbed, phase {args.phase}" + (f", model {args.model}" if args.model else ""),
            field="final" if final_set else "accuracy",
        )
        lines.append(f"plot: {png}")
    text = "\n".join(lines)
    print("\n" + text)
    (out / f"report-{args.phase}.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
