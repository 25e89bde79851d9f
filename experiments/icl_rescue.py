"""XRPO's in-context seeding: how often it rescues an all-failing question, against resampling.

    python experiments/icl_rescue.py [--models tiny "tiny:icl=0.3,threads=1"] [--questions 2000]
    python experiments/icl_rescue.py --dataset "operators:seed=0" --models "tiny:task=operators,..."

XRPO gives a question whose G completions all failed a few extra completions from a prompt
that starts with worked examples of similar questions the model has solved (BM25 over the
question texts, ``rllib_exgrpo/xrpo/icl.py``). That only helps if the model reads them. The
embedded tiny model's default warm start never saw such a prompt; ``tiny:icl=0.3`` trains
30% of its warm-start prompts with exactly that prefix (``models/tiny.py:icl_prefixes``).

Per model, through the project's own env runner (``LLMEnvRunner.sample``, the path the
algorithm's seeder uses, ``prompt_prefixes`` included):

1. G = 8 completions at temperature 1 for each of ``--questions`` training questions
   (levels 1-4, the testbed's distribution);
2. the corpus: the model's own correct completions of the questions it solved
   (``SolvedCorpus``, as the seeder builds it; shortest solution kept);
3. every all-failing question gets ``--extra`` (4, ``icl_samples``) more completions twice:
   **seeded** (``icl_num_examples`` = 2 retrieved examples before the prompt, exactly as the
   seeder renders them) and **plain** (the same prompt again: what the same compute buys
   without seeding);
4. rescue rate = share of the all-failing questions with at least one correct completion
   among the extra ones, seeded and plain, with 95% Wilson intervals; and the paired
   difference (McNemar counts).

Repeated over ``--seeds`` (sampling seeds); prints one table and writes
``benchmarks/out/icl_rescue.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

import _paths  # noqa: F401  (benchmarks/ on sys.path: _common, _runs)
import _common
from _common import ROOT, start_ray
import _runs

_common.RECIPES.setdefault("grpo_finite", ("grpo_finite_tiny.yaml", {}))
#: The GRPO recipe whose sampling settings (group size, response length) a dataset is
#: measured with, by the dataset's kind.
RECIPE_FOR = {"arithmetic": "grpo_finite", "operators": "grpo_ops"}
#: The training questions measured: the testbed's distribution, ``--questions`` of them.
DEFAULT_DATASET = "arithmetic:levels=1-4,n={n}"


def wilson(k: int, n: int, z: float = 1.96) -> tuple:
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def _rescued(episodes, question_ids) -> dict:
    """Per question of ``question_ids``: whether any of its ``episodes`` was correct."""
    out = dict.fromkeys(question_ids, False)
    for e in episodes:
        q = e.get_infos()[-1]["question_id"]
        out[q] = out[q] or e.get_return() >= 1.0
    return out


def _by_level(question_ids, problems: dict, seeded: dict, plain: dict) -> dict:
    """Per difficulty level: the questions (``n``) and how many were rescued seeded and plain."""
    by_level: dict = {}
    for q in question_ids:
        lv = by_level.setdefault(int(problems[q].difficulty), {"n": 0, "seeded": 0, "plain": 0})
        lv["n"] += 1
        lv["seeded"] += seeded[q]
        lv["plain"] += plain[q]
    return by_level


def measure(model: str, seed: int, questions: int, extra: int, num_examples: int, dataset: str = DEFAULT_DATASET) -> dict:
    from rllib_exgrpo.xrpo.icl import SolvedCorpus, format_examples

    # "{n}" in the dataset string takes --questions; a spec without it is used whole
    overrides = {"env_config": {"dataset": dataset.format(n=questions)}}
    recipe = RECIPE_FOR.get(dataset.split(":", 1)[0])
    if recipe is None:
        raise SystemExit(f"--dataset: no recipe for {dataset!r}; known kinds: {sorted(RECIPE_FOR)}")
    config, algo = _runs.build(recipe, seed, overrides, model)
    try:
        runner = algo.env_runner
        problems = {p.id: p for p in runner.env.problems}
        ids = list(problems)
        t0 = time.perf_counter()
        first = runner.sample(question_ids=ids, num_samples=config.group_size, return_logprobs=False)
        outcome: dict = {}
        corpus = SolvedCorpus(capacity=max(2048, questions), seed=seed)
        for e in first:
            qid = e.get_infos()[-1]["question_id"]
            ok = e.get_return() >= 1.0
            outcome[qid] = outcome.get(qid, False) or ok
            if ok:
                corpus.add(qid, problems[qid].question, e.get_infos()[-1]["completion_text"])
        failing = [q for q in ids if not outcome[q]]
        prefixes, seeded_ids = [], []
        for q in failing:
            examples = corpus.retrieve(problems[q].question, k=num_examples, exclude_ids=[q])
            if examples:
                seeded_ids.append(q)
                prefixes.append(format_examples(examples))
        seeded = _rescued(
            runner.sample(question_ids=seeded_ids, num_samples=extra, prompt_prefixes=prefixes, return_logprobs=False), seeded_ids
        )
        plain = _rescued(runner.sample(question_ids=seeded_ids, num_samples=extra, return_logprobs=False), seeded_ids)
        by_level = _by_level(seeded_ids, problems, seeded, plain)
        return {
            "model": model,
            "seed": seed,
            "questions": len(ids),
            "solved": len(ids) - len(failing),
            "all_failing": len(failing),
            "seeded_questions": len(seeded_ids),
            "corpus": len(corpus),
            "rescued_seeded": int(sum(seeded.values())),
            "rescued_plain": int(sum(plain.values())),
            "only_seeded": int(sum(seeded[q] and not plain[q] for q in seeded_ids)),
            "only_plain": int(sum(plain[q] and not seeded[q] for q in seeded_ids)),
            "by_level": by_level,
            "wall_s": round(time.perf_counter() - t0, 1),
            "example_prefix": prefixes[0] if prefixes else "",
        }
    finally:
        algo.stop()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny", "tiny:icl=0.3,threads=1"])
    p.add_argument("--questions", type=int, default=2000)
    p.add_argument("--extra", type=int, default=4, help="extra completions per all-failing question (icl_samples)")
    p.add_argument("--num-examples", type=int, default=2, help="worked examples per seeded prompt (icl_num_examples)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument(
        "--dataset", default=DEFAULT_DATASET, help='training questions (a dataset spec; "{n}" takes --questions), e.g. "operators:seed=0"'
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "icl_rescue.json"))
    args = p.parse_args()
    start_ray()
    rows = [measure(m, s, args.questions, args.extra, args.num_examples, args.dataset) for m in args.models for s in args.seeds]
    print(
        f"\n{'model':<26}{'seed':>5}{'solved':>8}{'failing':>8}{'seeded':>7} | {'rescued seeded':>22} {'rescued plain':>22}"
        f" | only-seeded only-plain"
    )
    for r in rows:
        n = r["seeded_questions"]
        cells = []
        for k in (r["rescued_seeded"], r["rescued_plain"]):
            lo, hi = wilson(k, n)
            cells.append(f"{k / max(n, 1):.3f} [{lo:.3f}, {hi:.3f}]")
        print(
            f"{r['model']:<26}{r['seed']:>5}{r['solved']:>8}{r['all_failing']:>8}{n:>7} | {cells[0]:>22} {cells[1]:>22}"
            f" | {r['only_seeded']:>11} {r['only_plain']:>10}"
        )
    for m in args.models:
        mine = [r for r in rows if r["model"] == m]
        n = sum(r["seeded_questions"] for r in mine)
        ks, kp = sum(r["rescued_seeded"] for r in mine), sum(r["rescued_plain"] for r in mine)
        print(
            f"{m:<26} pooled over seeds: seeded {ks}/{n} = {ks / max(n, 1):.3f}, plain {kp}/{n} = {kp / max(n, 1):.3f},"
            f" difference {(ks - kp) / max(n, 1):+.3f}; per level (seeded/plain/n): "
            + ", ".join(
                f"L{lv}: {sum(r['by_level'].get(lv, {}).get('seeded', 0) for r in mine)}/"
                f"{sum(r['by_level'].get(lv, {}).get('plain', 0) for r in mine)}/"
                f"{sum(r['by_level'].get(lv, {}).get('n', 0) for r in mine)}"
                for lv in sorted({int(k) for r in mine for k in r["by_level"]})
            )
        )
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    print(f"written: {args.out}")
    print("example seeded prompt prefix:\n" + rows[-1]["example_prefix"])


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
