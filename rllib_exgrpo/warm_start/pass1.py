"""The warm start's held-out checks: sampled pass@1 on the project's sample-and-score path,
and the figures the operators and format-weak recipes stop on."""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from rllib_exgrpo.envs import operators
from rllib_exgrpo.envs.prompting import DEFAULT_INSTRUCTION
from rllib_exgrpo.envs.reasoning_env import ReasoningEnv
from rllib_exgrpo.envs.rewards import last_boxed
from rllib_exgrpo.generation.base import SamplingParams
from rllib_exgrpo.generation.hf import HFGenerationBackend
from rllib_exgrpo.generation.sample_and_score import encode_prompt, sample_and_score, stop_token_ids


def evaluate_pass1(
    model,
    tokenizer,
    problems: Sequence[Any],
    *,
    instruction: Optional[str] = None,
    max_new_tokens: int = 40,
    temperature: float = 1.0,
    batch_size: int = 256,
    seed: int = 0,
    return_texts: bool = False,
) -> dict:
    """Sampled pass@1 (one sample per problem) with per-level rates, on the project's one
    sample-and-score path (``generation.sample_and_score``: the HF backend's sampling at
    ``temperature`` with no top-k / top-p, the verifier of ``ReasoningEnv``).

    Also returns the mean per-token surprisal -log p of the sampled tokens (eos included),
    an unbiased estimate of the sampling distribution's per-token entropy in nats
    (``mean_token_entropy``), and the mean prompt / completion lengths in tokens; with
    ``return_texts`` every completion text, in the order of ``problems``. Does not disturb
    the global torch RNG.
    """
    instruction = DEFAULT_INSTRUCTION if instruction is None else instruction
    env = ReasoningEnv({"problems": list(problems), "tokenizer": tokenizer, "instruction": instruction, "max_prompt_chars": 10**9})
    try:
        items, prompt_tokens = _sample_all(
            model, tokenizer, env, max_new_tokens=max_new_tokens, temperature=temperature, batch_size=batch_size, seed=seed
        )
    finally:
        env.close()
    out = _summary(items, prompt_tokens)
    if return_texts:
        out["texts"] = _texts_in_order(env.problems, items)
    return out


def _sample_all(model, tokenizer, env, *, max_new_tokens: int, temperature: float, batch_size: int, seed: int) -> tuple[list, int]:
    """One completion per problem of ``env``, scored by its verifier, in batches, under a
    forked torch RNG seeded with ``seed``: ``([(problem, item), ...], prompt tokens)``."""
    import torch

    backend = HFGenerationBackend(model, pad_token_id=tokenizer.pad_token_id, batch_size=batch_size, logprobs_from_generation=True)
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop_token_ids(model, tokenizer), return_logprobs=True
    )
    was_training = model.training
    model.eval()
    items = []
    prompt_tokens = 0
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            for start in range(0, len(env.problems), batch_size):
                chunk = env.problems[start : start + batch_size]
                prompts = [encode_prompt(tokenizer, env.prompt_for(p.id)) for p in chunk]
                prompt_tokens += sum(len(x) for x in prompts)
                batch = sample_and_score(backend, tokenizer, prompts, [1] * len(chunk), params, [p.id for p in chunk], env.score)
                items += [(chunk[i.prompt_index], i) for i in batch.items]
    finally:
        model.train(was_training)
    return items, prompt_tokens


def _summary(items: list, prompt_tokens: int) -> dict:
    """pass@1 overall and per level, mean token surprisal, mean lengths, a few samples."""
    correct = [i.result.score >= 1.0 for _, i in items]
    surprisal = sum(-float(i.completion.logp.sum()) for _, i in items)
    completion_tokens = sum(len(i.completion.token_ids) for _, i in items)
    per_level: dict[str, list[int]] = {}
    for (p, _), ok in zip(items, correct):
        per_level.setdefault(str(p.difficulty), []).append(int(ok))
    n = max(len(correct), 1)
    return {
        "pass1": sum(correct) / n,
        "per_level": {k: sum(v) / len(v) for k, v in sorted(per_level.items())},
        "per_level_n": {k: len(v) for k, v in sorted(per_level.items())},
        "mean_token_entropy": surprisal / max(completion_tokens, 1),
        "mean_prompt_tokens": prompt_tokens / n,
        "mean_completion_tokens": completion_tokens / n,
        "n": len(correct),
        "samples": [i.text for _, i in items[:8]],
    }


def _texts_in_order(problems, items) -> list[str]:
    by_id = {p.id: i.text for p, i in items}
    return [by_id[p.id] for p in problems]


def read_final_answer(text: str) -> tuple[Optional[str], bool]:
    """``(answer, boxed)`` of a completion in either format of the format-weak warm start:
    the last ``\\boxed{N}``, else the number after the last ``Answer:``; ``(None, False)``
    when neither is there."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip(), True
    match = re.findall(r"Answer:\s*(-?\d+)", text)
    return (match[-1], False) if match else (None, False)


def evaluate_at_step(model, tokenizer, problems, recipe, step):
    """The build's held-out check at ``step``: pass@1 with the recipe's sampling, plus the
    operators or format-weak figures when the recipe has them."""
    ev = recipe["eval"]
    out = evaluate_pass1(
        model,
        tokenizer,
        problems,
        instruction=recipe["instruction"],
        max_new_tokens=ev["max_new_tokens"],
        temperature=ev["temperature"],
        batch_size=ev["batch_size"],
        seed=recipe["seed"] * 100_003 + step,
        return_texts="task" in recipe or "answer_format" in recipe,
    )
    texts = out.pop("texts", None)
    if "task" in recipe:
        out["operators"] = operators_warm_start_figures(problems, texts)
    if "answer_format" in recipe:
        out["answer_format"] = answer_format_figures(problems, texts)
    return out


def answer_format_figures(problems: Sequence[Any], completions: Sequence[str]) -> dict:
    """A format-weak warm start's two halves, from one sampled completion per held-out
    problem: ``pass1_any_format`` (the final answer right, boxed or not: its arithmetic,
    what the build's stop reads) and ``boxed_share`` (answers boxed: what the verifier
    needs), with ``pass1_any_format`` by level."""
    right, boxed, per_level = 0, 0, {}
    for p, text in zip(problems, completions):
        answer, is_boxed = read_final_answer(text)
        ok = answer is not None and answer == str(p.ground_truth).strip()
        right += ok
        boxed += is_boxed
        per_level.setdefault(str(p.difficulty), []).append(int(ok))
    n = max(len(completions), 1)
    return {
        "pass1_any_format": right / n,
        "boxed_share": boxed / n,
        "per_level_any_format": {k: sum(v) / len(v) for k, v in sorted(per_level.items())},
    }


def operators_warm_start_figures(problems: Sequence[Any], completions: Sequence[str]) -> dict:
    """What an operators warm start must and must not know, from one sampled completion per
    held-out problem: ``self_consistency`` (share of well-formed solutions with right
    arithmetic under their own meanings), ``meaning_shares`` (how often each meaning was
    chosen among them: uniform guessing gives 1/3 each), and the exact uniform-guessing
    pass@1 by chain length (``guessing_pass1``), the level pass@1 should sit at."""
    consistent, chosen = 0, {m: 0 for m in operators.MEANINGS}
    guess: dict[str, list[float]] = {}
    for p, text in zip(problems, completions):
        used = operators.read_worked_solution(p, text)
        if used is not None:
            consistent += 1
            for m in used:
                chosen[m] += 1
        guess.setdefault(str(p.difficulty), []).append(operators.guessing_rate(p, int(p.ground_truth)))
    total = max(sum(chosen.values()), 1)
    return {
        "self_consistency": consistent / max(len(completions), 1),
        "meaning_shares": {m: round(c / total, 4) for m, c in chosen.items()},
        "guessing_pass1": {k: round(sum(v) / len(v), 4) for k, v in sorted(guess.items())},
    }
