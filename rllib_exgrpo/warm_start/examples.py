"""The warm start's examples: which solutions a recipe shows, and their token ids.

The arithmetic task's worked solutions are fixed. The operators task's show meanings drawn
afresh each time an example is drawn (never the true ones of a family the RL task uses), and
a format-weak recipe's answers are boxed or written ``Answer: N`` afresh each time: a
solution fixed per question could be learnt per question.
"""

from __future__ import annotations

import random
import re
from typing import Any, Optional, Sequence

from rllib_exgrpo.models.tiny_tokenizer import IM_END
from rllib_exgrpo.core.tokens import right_pad
from rllib_exgrpo.envs import operators
from rllib_exgrpo.envs.operators import MAX_FAMILIES, family_tag
from rllib_exgrpo.envs.prompting import render_prompt

_BOXED_END_RE = re.compile(r"\\boxed\{([^{}]*)\}$")


def with_answer_format(solution: str, boxed: bool, recipe: dict) -> str:
    """``solution`` (ending in ``\\boxed{N}``) with its final answer boxed or written in the
    recipe's other format."""
    if boxed:
        return solution
    match = _BOXED_END_RE.search(solution)
    if match is None:
        raise ValueError(f"worked solution does not end in a boxed answer: {solution!r}")
    return solution[: match.start()] + recipe["answer_format"]["other"].format(answer=match.group(1))


def whole_words(recipe: dict) -> list[str]:
    """Strings the recipe's tokenizer keeps as one token each: with ``tag_tokens`` the
    operators task's family tags ``[F00]`` .. ``[F99]``, otherwise none."""
    if not recipe.get("task", {}).get("tag_tokens"):
        return []

    return [family_tag(f) for f in range(MAX_FAMILIES)]


def shows_true_meanings(problem: Any, recipe: dict) -> bool:
    """Whether a warm-start solution keeps its true meanings: only in the extra "known"
    families (tagged after the task's own), never in a family the RL task uses."""
    return problem.extra["family"] >= recipe["task"]["families"]


def tokenizer_corpus(problems: Sequence[Any], recipe: dict) -> list:
    """The problems whose texts train the tokenizer: for the operators task with one set of
    guessed meanings each (the true ones are never in the warm-start data); for a
    format-weak recipe with each answer's format drawn once, so both formats are in it."""
    import dataclasses

    if "task" in recipe:
        rng = random.Random(f"tiny-operators-corpus:{recipe['seed']}")
        problems = [
            p if shows_true_meanings(p, recipe) else dataclasses.replace(p, solution=operators.random_meaning_solution(p, rng))
            for p in problems
        ]
    if "answer_format" in recipe:
        rng = random.Random(f"tiny-answer-format-corpus:{recipe['seed']}")
        fraction = recipe["answer_format"]["boxed_fraction"]
        problems = [dataclasses.replace(p, solution=with_answer_format(p.solution, rng.random() < fraction, recipe)) for p in problems]
    return list(problems)


def solution_resampler(problems: Sequence[Any], tokenizer, recipe: dict):
    """A function giving fresh solution ids for a batch of example indices, drawn anew every
    time so no question gets a fixed answer: for the operators task guessed meanings, for a
    format-weak recipe the answer's format; ``None`` when neither applies (the arithmetic
    task's solutions are fixed)."""
    if "task" not in recipe and "answer_format" not in recipe:
        return None

    rng = random.Random(f"tiny-operators-solutions:{recipe['seed']}")
    format_rng = random.Random(f"tiny-answer-format:{recipe['seed']}")

    def solution(p):
        if "task" in recipe and not shows_true_meanings(p, recipe):
            text = operators.random_meaning_solution(p, rng)
        else:
            text = p.solution
        if "answer_format" in recipe:
            text = with_answer_format(text, format_rng.random() < recipe["answer_format"]["boxed_fraction"], recipe)
        return text

    def resample(idx):
        texts = [solution(problems[i]) + IM_END for i in idx]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return resample


def encode_examples(tokenizer, problems, instruction: str, prefixes: Optional[Sequence[str]] = None):
    """Prompt ids (each after its in-context prefix, if any) and solution ids of ``problems``."""
    prompts = [render_prompt(p.question, tokenizer=tokenizer, instruction=instruction) for p in problems]
    if prefixes is not None:
        prompts = [pre + prompt for pre, prompt in zip(prefixes, prompts)]
    completions = [p.solution + IM_END for p in problems]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    # Prompt and completion tokenised apart must equal the whole text tokenised at once
    # (the prompt ends in "\n", a pre-tokenizer boundary): otherwise training and sampling
    # would see different token sequences.
    for i in range(min(64, len(problems))):
        joint = tokenizer(prompts[i] + completions[i], add_special_tokens=False)["input_ids"]
        if joint != p_ids[i] + c_ids[i]:
            raise RuntimeError(f"prompt/completion tokenisation is not separable on {problems[i].question!r}")
    return p_ids, c_ids


def batch_indices(problems, batch_size: int, level_balanced: bool, seed: int):
    """Endless batches of example indices: epochs of a seeded shuffle, or (level-balanced)
    each example's level drawn uniformly, then the next example of that level's own
    shuffled cycle (small levels repeat, large ones are not exhausted)."""
    rng = random.Random(f"tiny-warm-start:{seed}")
    groups: dict[Any, list[int]] = {}
    for i, p in enumerate(problems):
        groups.setdefault(p.difficulty if level_balanced else None, []).append(i)
    keys = sorted(groups, key=lambda k: (k is None, k))
    queues: dict[Any, list[int]] = {k: [] for k in keys}

    def draw(key):
        if not queues[key]:
            fresh = list(groups[key])
            rng.shuffle(fresh)
            queues[key] = fresh
        return queues[key].pop()

    while True:
        yield [draw(rng.choice(keys)) for _ in range(batch_size)]


def collate(p_ids, c_ids, idx, pad_id):
    """Whole supervised sequences (prompt + completion) right-padded; the loss only on
    completion tokens (labels -100 elsewhere, HF's convention)."""
    import torch

    seqs = [p_ids[i] + c_ids[i] for i in idx]
    input_ids, mask = right_pad(seqs, pad_id)
    labels = torch.full_like(input_ids, -100)
    for row, i in enumerate(idx):
        labels[row, len(p_ids[i]) : len(seqs[row])] = torch.tensor(c_ids[i])
    return input_ids, mask, labels
