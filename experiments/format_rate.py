"""How rarely a format-weak warm start writes the rewarded answer format, at a sampling temperature.

    python experiments/format_rate.py --model "tiny:boxed=0.005,threads=1" [--temperatures 1.0 0.9] \
        [--questions 1280] [--seed 0]

A format-weak warm start (``tiny:boxed=F``, ``models/tiny.py``) ends a worked solution in
``\\boxed{N}`` with a small probability and in ``Answer: N`` otherwise; only the boxed form is
rewarded. How rare a success is when the policy samples decides whether on-policy GRPO can
learn the format by itself, so this script measures it before any training run.

Per temperature, through the project's own env runner (the recipe ``grpo_finite``'s prompts,
group size and response length, on ``--dataset``):

1. G completions of each of ``--questions`` training questions at that temperature;
2. **sampled**: the share of completions whose final answer is boxed, and boxed and correct
   (what the verifier rewards);
3. **expected** (far less noisy at these rates): at the token where each completion chose
   its answer format (right after the worked steps' final ``.``), the policy's probability
   p, at the same temperature, of the boxed form's first token. Its mean over completions is
   the boxed share the sampler produces (a Rao-Blackwell estimate of 2.). A warm start that
   saw few boxed answers may not finish a box it starts, so each completion is also
   continued from that token (one sample, the project's generation backend, the same
   temperature) and verified: the mean of p x "the forced box is rewarded" estimates the
   reward per answer without bias, and "box finished right" is the share of forced boxes
   the verifier accepts;
4. from 3.: successes per training step of ``completions_per_step`` answers, and the share
   of groups of G holding at least one success.

Last line: ``expected_reward_per_answer_T<T>=<value>`` for the last temperature.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import numpy as np

import _paths  # noqa: F401  (benchmarks/ on sys.path: _common, _runs)
import _common
import _runs
from _common import ROOT, start_ray
from rllib_exgrpo.generation.base import SamplingParams

_common.RECIPES.setdefault("grpo_finite", ("grpo_finite_tiny.yaml", {}))

#: A completion's final answer in either format, after the worked steps' last "." (the
#: format the arithmetic warm start writes: "... = 7. \\boxed{7}" or "... = 7. Answer: 7").
#: Tokens a forced box may take to close (``boxed{123}`` and the stop token need 7).
FORCED_TOKENS = 24
FINAL_ANSWER = re.compile(r"^\s*(\\boxed\{(?P<boxed>[^{}]*)\}|Answer: (?P<plain>-?\d+))\s*$")


def decision_index(tokenizer, completion: list) -> tuple:
    """``(k, boxed, number)``: the index of the first token of ``completion`` after the
    worked steps' final ``.`` (where the answer format is chosen), whether the answer is
    boxed, and the number written; ``None`` when the completion does not end in either
    format (truncated or malformed)."""
    text_of = lambda a, b: tokenizer.decode(completion[a:b], skip_special_tokens=True)
    for k in range(len(completion) - 1, 0, -1):
        head = text_of(0, k)
        if not head.rstrip().endswith("."):
            continue
        match = FINAL_ANSWER.match(text_of(k, None))
        if match:
            boxed = match.group("boxed") is not None
            return k, boxed, match.group("boxed") if boxed else match.group("plain")
    return None


def boxed_first_token(tokenizer) -> int:
    """The token the boxed form starts with right after a ``.`` (how the warm start's
    tokenizer splits ``". \\boxed{7}"``)."""
    dot = tokenizer(". ", add_special_tokens=False)["input_ids"]
    ids = tokenizer(". \\boxed{7}", add_special_tokens=False)["input_ids"]
    first = ids[1] if tokenizer.decode(ids[:1]) == "." else ids[len(dot)]
    if "\\" not in tokenizer.decode([first]):
        raise SystemExit(f"cannot find the boxed form's first token: {[tokenizer.decode([i]) for i in ids]}")
    return first


def box_probabilities(backend, prompts: list, heads: list, token: int, temperature: float) -> np.ndarray:
    """P(``token`` | prompt + head) at ``temperature`` for each row (token ids): the log-prob
    the generation backend's own scoring pass gives ``token`` appended to each head."""
    logps, _ = backend.score(prompts, [h + [token] for h in heads], temperature=temperature, with_entropy=False)
    return np.exp(np.asarray([float(lp[-1]) for lp in logps], dtype=np.float64))


def measure(model_name: str, temperature: float, questions: int, seed: int, dataset: str) -> dict:
    config, algo = _runs.build("grpo_finite", seed, {"env_config": {"dataset": dataset.format(n=questions)}}, model_name)
    try:
        runner = algo.env_runner
        ids = [p.id for p in runner.env.problems]
        truth = {p.id: str(p.ground_truth) for p in runner.env.problems}
        t0 = time.perf_counter()
        episodes = runner.sample(question_ids=ids, num_samples=config.group_size, temperature=temperature, return_logprobs=False)
        sample_s = time.perf_counter() - t0
        tokenizer = runner.tokenizer
        token = boxed_first_token(tokenizer)
        prompts, heads, right, boxed_count, reward_count, per_question = [], [], [], 0, 0, []
        for e in episodes:
            info = e.get_infos()[-1]
            reward_count += e.get_return() >= 1.0
            completion = [int(t) for t in e.get_actions()[-1]]
            found = decision_index(tokenizer, completion)
            if found is None:
                continue
            k, boxed, number = found
            boxed_count += boxed
            prompts.append([int(t) for t in e.get_observations()[0]])
            heads.append(completion[:k])
            right.append(number == truth[info["question_id"]])
            per_question.append(info["question_id"])
        p_box = box_probabilities(runner.backend, prompts, heads, token, temperature)
        right = np.asarray(right, dtype=float)
        # the boxed branch continued from its first token and verified
        params = SamplingParams(
            max_new_tokens=FORCED_TOKENS, temperature=temperature, stop_token_ids=tuple(runner.stop_token_ids), return_logprobs=False
        )
        forced = runner.backend.generate([p + h + [token] for p, h in zip(prompts, heads)], [1] * len(heads), params)
        texts = [tokenizer.decode(h + [token] + [int(t) for t in c[0].token_ids], skip_special_tokens=True) for h, c in zip(heads, forced)]
        box_rewarded = np.asarray([r.score >= 1.0 for r in runner.env.score(per_question, texts)], dtype=float)
        n = len(episodes)
        # each question's expected reward per answer -> the chance a group of G holds a success
        by_q: dict = {}
        for q, p, r in zip(per_question, p_box, box_rewarded):
            by_q.setdefault(q, []).append(p * r)
        group_hit = np.mean([1.0 - np.prod(1.0 - np.asarray(v)) for v in by_q.values()])
        reward = float((p_box * box_rewarded).sum() / n)  # unparsed completions count as failures
        return {
            "model": model_name,
            "temperature": temperature,
            "seed": seed,
            "answers": n,
            "parsed": len(heads),
            "sampled_boxed": boxed_count / n,
            "sampled_reward": reward_count / n,
            "expected_boxed": float(p_box.sum() / n),
            "expected_reward_per_answer": reward,
            "number_right": float(right.mean()) if len(right) else float("nan"),
            "box_finished_right": float(box_rewarded.mean()) if len(heads) else float("nan"),
            "successes_per_step": reward * config.completions_per_step,
            "groups_with_success": float(group_hit),
            "sample_s": round(sample_s, 1),
        }
    finally:
        algo.stop()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help='a format-weak warm start, e.g. "tiny:boxed=0.005,threads=1"')
    p.add_argument("--temperatures", nargs="+", type=float, default=[1.0])
    p.add_argument("--questions", type=int, default=1280)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", default="arithmetic:levels=1-4,n={n}", help='training questions ("{n}" takes --questions)')
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "format_rate.json"))
    args = p.parse_args()
    for t in args.temperatures:
        if t <= 0:
            raise SystemExit(f"--temperatures: must be > 0 (a sampling temperature), got {t}")
    start_ray()
    rows = [measure(args.model, t, args.questions, args.seed, args.dataset) for t in args.temperatures]
    print(f"\n{args.model}, {args.questions} questions x G, seed {args.seed}")
    print(
        f"{'T':>5} {'answers':>8} {'boxed (sampled)':>16} {'boxed (expected)':>17} {'reward (sampled)':>17}"
        f" {'number right':>13} {'box finished right':>19} {'reward (expected)':>18} {'successes/step':>15}"
        f" {'groups w/ success':>18}"
    )
    for r in rows:
        print(
            f"{r['temperature']:>5} {r['answers']:>8} {r['sampled_boxed']:>16.5f} {r['expected_boxed']:>17.5f}"
            f" {r['sampled_reward']:>17.5f} {r['number_right']:>13.3f} {r['box_finished_right']:>19.3f}"
            f" {r['expected_reward_per_answer']:>18.5f}"
            f" {r['successes_per_step']:>15.2f} {r['groups_with_success']:>18.4f}"
        )
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    last = rows[-1]
    print(f"expected_reward_per_answer_T{last['temperature']:g}={last['expected_reward_per_answer']:.6f}")


if __name__ == "__main__":
    main()
