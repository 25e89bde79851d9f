"""Training runs shared by learning_curves.py and compare.py: one run per (method, seed),
evaluated the same way for every method, cached as JSON so that a killed benchmark
resumes where it stopped and the two scripts reuse each other's runs.

A run trains until it has done ``iterations`` steps *and* sampled ``token_budget``
completion tokens (GRPO's own count after ``iterations`` steps of the same seed), so one
run answers both questions: accuracy at the same number of steps (learning_curves.py) and
at the same sampled-token budget (compare.py). The held-out set (first 200 arithmetic test
questions, greedy, ``max_response_tokens`` of the recipe) is evaluated at step 0, every
``eval_interval`` steps, at ``iterations``, at the step that crosses the budget and at the
end, always outside ``train()`` and through the same env-runner call, so that PPO (which has
no held-out hook of its own) is measured exactly like the others and step times stay clean.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from _common import RECIPES, recipe_config
from rllib_exgrpo.core.columns import QUESTION_ID

HELDOUT_QUESTIONS = 200
#: Bumped when what a run records changes, so stale cache files are not reused.
RUN_FORMAT = 1


def is_ppo(name: str) -> bool:
    """Whether a recipe runs RLlib's stock PPO (its runner settings live in model_config)."""
    return RECIPES[name][0].startswith("ppo")


#: The held-out dataset spec of every run (its first 200 test questions are the figure).
HELDOUT_DATASET = "arithmetic"


def _heldout_overrides(name: str, config, heldout_dataset: str = HELDOUT_DATASET) -> dict:
    """Point the runner at the held-out set; keep the algorithm's own evaluation out.
    ``heldout_dataset`` may ask for more test questions (``arithmetic:n_test=N``): the
    first ones are the same whatever N (the generator is one stream)."""
    if is_ppo(name):
        # RLlib's PPO reads runner settings from the module's model_config.
        return {"model_config": {**(config.model_config or {}), "heldout_dataset": heldout_dataset, "heldout_split": "test"}}
    return {"heldout_dataset": heldout_dataset, "heldout_split": "test", "heldout_num_questions": HELDOUT_QUESTIONS, "heldout_interval": 0}


def build(name: str, seed: int, overrides: dict, model: Optional[str] = None, heldout_dataset: str = HELDOUT_DATASET):
    """The algorithm of a recipe; ``model`` replaces the policy model (``model_name_or_path``
    for this project's algorithms, the module's ``model_config["model"]`` for RLlib's PPO)."""
    config = recipe_config(name, seed=seed, **overrides)
    extra = _heldout_overrides(name, config, heldout_dataset)
    if model:
        if is_ppo(name):
            extra["model_config"]["model"] = model
        else:
            extra["model_name_or_path"] = model
    config = recipe_config(name, seed=seed, **overrides, **extra)
    return config, config.build_algo()


def timed_steps(algo, warmup: int, steps: int):
    """``(wall seconds, result)`` of each of ``steps`` training steps after ``warmup``
    untimed ones (the first steps include lazy model loads)."""
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        result = algo.train()
        wall = time.perf_counter() - t0
        if i >= warmup:
            yield wall, result


def greedy_rewards(algo, ids: List[str], max_new_tokens: int, split: Optional[str] = None) -> Dict[str, float]:
    """Each held-out question's greedy reward (question id -> 0/1) under the runner's
    weights, in one runner call: every evaluator of the benchmarks goes through it.
    ``split`` takes the questions from that split of the held-out dataset (default: the
    configured ``heldout_split``)."""
    episodes = algo.env_runner.sample(
        question_ids=ids, num_samples=1, heldout=split or True, temperature=0.0, max_new_tokens=max_new_tokens, return_logprobs=False
    )
    return {e.get_infos(-1)[QUESTION_ID]: e.get_return() for e in episodes}


def heldout_accuracy(algo, max_new_tokens: int) -> float:
    """Greedy accuracy on the first 200 held-out questions under the runner's weights."""
    ids = [p.id for p in algo.env_runner.heldout_env.problems][:HELDOUT_QUESTIONS]
    return float(np.mean(list(greedy_rewards(algo, ids, max_new_tokens).values())))


def _scalars(d) -> dict:
    return {k: float(v) for k, v in (d or {}).items() if isinstance(v, (int, float, np.floating, np.integer))}


def model_build(name: str, model: Optional[str] = None) -> str:
    """The cache folder name of the policy model a run of recipe ``name`` uses (``model``
    or the recipe's own), built first when missing; the spec itself for a non-tiny model."""
    from rllib_exgrpo.models import resolve_model_path

    if model is None:
        config = recipe_config(name, seed=0)
        model = config.model_config.get("model") if is_ppo(name) else config.model_name_or_path
    spec = str(model)
    if spec != "tiny" and not spec.startswith("tiny:"):
        return spec
    return Path(resolve_model_path(spec, progress=False)).name


def _cache_path(out: Path, key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return out / "runs" / f"{key['algo']}-seed{key['seed']}-{digest}.json"


def train_run(
    name: str,
    seed: int,
    *,
    iterations: int,
    token_budget: Optional[float] = None,
    eval_interval: int = 10,
    overrides: Optional[dict] = None,
    out: Path,
    max_iterations: Optional[int] = None,
    model: Optional[str] = None,
    key_extra: Optional[dict] = None,
    extra_eval=None,
    step_fields=None,
    on_eval=None,
    heldout_dataset: str = HELDOUT_DATASET,
    end_eval=None,
) -> dict:
    """One run (cached). Returns ``{"algo", "seed", "steps": [...], "evals": [...], ...}``:
    per step its sampled tokens so far, wall time and scalar metrics; per evaluation the
    step, tokens so far and held-out accuracy. ``end_eval(algo)``, when given, is recorded
    as ``"end"`` after the last step (measurements that need the trained algorithm's state,
    such as its replay pool)."""
    overrides = dict(overrides or {})
    key = _run_key(
        name,
        seed,
        iterations=iterations,
        token_budget=token_budget,
        eval_interval=eval_interval,
        overrides=overrides,
        model=model,
        key_extra=key_extra,
        heldout_dataset=heldout_dataset,
    )
    path = _cache_path(out, key)
    if path.exists():
        return json.loads(path.read_text())
    from _common import start_ray

    start_ray()  # only for a run to train: reading cached runs needs no Ray instance
    max_iterations = max_iterations or 3 * iterations
    config, algo = build(name, seed, overrides, model, heldout_dataset)
    max_tokens = int(config.model_config.get("max_response_tokens", 0)) if is_ppo(name) else int(config.max_response_tokens)
    record = _train(
        algo,
        max_tokens,
        iterations,
        token_budget,
        eval_interval,
        max_iterations,
        extra_eval=extra_eval,
        step_fields=step_fields,
        on_eval=on_eval,
        end_eval=end_eval,
    )
    return _write_run(path, {**key, **record})


def _train(
    algo,
    max_tokens: int,
    iterations: int,
    token_budget: Optional[float],
    eval_interval: int,
    max_iterations: int,
    *,
    extra_eval=None,
    step_fields=None,
    on_eval=None,
    end_eval=None,
) -> dict:
    """Train ``algo`` until it has done ``iterations`` steps and sampled ``token_budget``
    tokens (or ``max_iterations`` steps), evaluating it on the way, then stop it. Returns the
    run's ``steps``, ``evals``, ``budget_step``, ``wall_s`` (and ``end`` with ``end_eval``)."""
    steps: List[dict] = []
    evals: List[dict] = []
    tokens, crossed_at = 0.0, None
    t_run = time.perf_counter()

    def evaluate(step: int):
        if evals and evals[-1]["step"] == step:
            return
        evals.append(_evaluation(algo, step, tokens, max_tokens, extra_eval))
        if on_eval:
            on_eval(evals[-1], time.perf_counter() - t_run)

    try:
        evaluate(0)
        while True:
            t0 = time.perf_counter()
            result = algo.train()
            wall = time.perf_counter() - t0
            runners = result.get("env_runners", {})
            tokens = float(runners.get("num_response_tokens_lifetime", tokens))
            step = len(steps) + 1
            steps.append(_step_record(step, tokens, wall, result, step_fields))
            budget_met = token_budget is None or tokens >= token_budget
            if token_budget is not None and budget_met and crossed_at is None:
                crossed_at = step
            if step % eval_interval == 0 or step == iterations or step == crossed_at:
                evaluate(step)
            if (step >= iterations and budget_met) or step >= max_iterations:
                break
        evaluate(len(steps))
        end = end_eval(algo) if end_eval else None
    finally:
        algo.stop()
    return {
        "steps": steps,
        "evals": evals,
        "budget_step": crossed_at,
        "wall_s": time.perf_counter() - t_run,
        **({"end": end} if end_eval else {}),
    }


def _run_key(
    name: str,
    seed: int,
    *,
    iterations: int,
    token_budget: Optional[float],
    eval_interval: int,
    overrides: dict,
    model: Optional[str],
    key_extra: Optional[dict],
    heldout_dataset: str,
) -> dict:
    """The cache key of a run: its settings, the run format and the model build it trains."""
    key = {
        "algo": name,
        "seed": seed,
        "iterations": iterations,
        "token_budget": token_budget,
        "eval_interval": eval_interval,
        "overrides": overrides,
        "model": model,
        "format": RUN_FORMAT,
        **(key_extra or {}),
    }
    if heldout_dataset != HELDOUT_DATASET:  # (absent by default: older cache files stay valid)
        key["heldout_dataset"] = heldout_dataset
    # The built model behind a tiny spec (its folder name carries the build recipe's hash):
    # a new build of "tiny" must not reuse the runs of an older one.
    key["model_build"] = model_build(name, model)
    return key


def _step_record(step: int, tokens: float, wall: float, result: dict, step_fields=None) -> dict:
    """One training step of a run: its sampled tokens so far, wall time and scalar metrics
    (plus ``step_fields(result)`` when given)."""
    runners = result.get("env_runners", {})
    return {
        "step": step,
        "tokens": tokens,
        "wall_s": wall,
        "solve_rate": float(runners.get("episode_return_mean", math.nan)),
        "episodes": float(runners.get("num_episodes", 0)),
        "experience": _scalars(result.get("experience")),
        "xrpo": _scalars(result.get("xrpo")),
        "stage_s": _scalars(result.get("step_time_s")),
        **(step_fields(result) if step_fields else {}),
    }


def _evaluation(algo, step: int, tokens: float, max_tokens: int, extra_eval=None) -> dict:
    """One evaluation of a run at ``step``: the greedy held-out accuracy (plus
    ``extra_eval(algo, max_tokens)``'s figures) and the seconds it took."""
    t0 = time.perf_counter()
    record = {"step": step, "tokens": tokens, "accuracy": heldout_accuracy(algo, max_tokens)}
    record.update(extra_eval(algo, max_tokens) if extra_eval else {})
    return {**record, "eval_s": time.perf_counter() - t0}


def _write_run(path: Path, record: dict) -> dict:
    """Cache ``record`` at ``path``; returns it as read back from there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return json.loads(path.read_text())  # the same form whether fresh or cached


def collect_from_command_line(description: str, default_algos: Sequence[str]):
    """Parse the options shared by compare.py and learning_curves.py and collect
    the runs. Returns ``(args, out_dir, runs)``."""
    import argparse

    from _common import ROOT

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=list(default_algos))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    parser.add_argument("--config", default="{}", help="JSON config overrides for every run")
    parser.add_argument("--model", default=None, help="policy model for every method (default: the recipes')")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = collect(
        args.algos,
        args.seeds,
        iterations=args.iterations,
        eval_interval=args.eval_interval,
        overrides=json.loads(args.config),
        out=out,
        model=args.model,
    )
    return args, out, runs


def collect(
    algos: Sequence[str],
    seeds: Sequence[int],
    *,
    iterations: int,
    eval_interval: int,
    overrides: dict,
    out: Path,
    model: Optional[str] = None,
    log=print,
) -> List[dict]:
    """GRPO first for each seed (its sampled tokens after ``iterations`` steps set that
    seed's budget), then every other method to the same steps and budget."""
    unknown = [a for a in algos if a not in RECIPES]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {sorted(RECIPES)}")
    runs = []
    for seed in seeds:
        grpo = train_run("grpo", seed, iterations=iterations, eval_interval=eval_interval, overrides=overrides, out=out, model=model)
        budget = grpo["steps"][iterations - 1]["tokens"]
        for name in algos:
            run = (
                grpo
                if name == "grpo"
                else train_run(
                    name,
                    seed,
                    iterations=iterations,
                    token_budget=budget,
                    eval_interval=eval_interval,
                    overrides=overrides,
                    out=out,
                    model=model,
                )
            )
            runs.append(run)
            log(
                f"{name:<12} seed {seed}: acc@{iterations} steps {accuracy_at_step(run, iterations):.3f}, "
                f"acc@budget {accuracy_at_tokens(run, budget):.3f} "
                f"({median_step_s(run):.2f} s/step, {run['wall_s'] / 60:.1f} min)"
            )
    return runs


# ---- reading runs ------------------------------------------------------------------------
def accuracy_at_step(run: dict, step: int) -> float:
    for e in run["evals"]:
        if e["step"] == step:
            return e["accuracy"]
    return math.nan


def accuracy_at_tokens(run: dict, budget: float) -> float:
    """Accuracy at the first evaluation whose sampled tokens reach the budget."""
    for e in run["evals"]:
        if e["tokens"] >= budget:
            return e["accuracy"]
    return math.nan


def budget_of(runs: Sequence[dict], seed: int, iterations: int) -> float:
    grpo = next(r for r in runs if r["algo"] == "grpo" and r["seed"] == seed)
    return grpo["steps"][iterations - 1]["tokens"]


def steps_to_budget(run: dict, budget: float) -> int:
    """The first step at which the run's sampled tokens reach the budget."""
    return next((s["step"] for s in run["steps"] if s["tokens"] >= budget), len(run["steps"]))


def median_step_s(run: dict, upto: Optional[int] = None) -> float:
    """Median wall time of a training step (step 1 left out: it includes lazy model loads and,
    for this project's algorithms, their own step-0 held-out evaluation)."""
    walls = [s["wall_s"] for s in run["steps"][1:upto]]
    return float(np.median(walls)) if walls else math.nan


def wall_to(run: dict, step: int) -> float:
    """Training wall time (evaluations excluded) of the first ``step`` steps."""
    return float(sum(s["wall_s"] for s in run["steps"][:step]))


def mean_std(values) -> Dict[str, float]:
    a = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    return {"mean": float(a.mean()) if a.size else math.nan, "std": float(a.std()) if a.size else math.nan, "n": int(a.size)}
