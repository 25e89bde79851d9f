"""In-context prefixes of the warm start: what makes a tiny model able to use XRPO's seeding.

XRPO seeds a question whose completions all failed by putting a few solved questions similar
to it before its prompt (``xrpo/icl.py``); a share of the warm-start examples get exactly that
prefix, chosen by the same retrieval and rendered by the same ``format_examples``.
"""

from __future__ import annotations

import random
from typing import Any, Optional, Sequence

from rllib_exgrpo.models.tiny_tokenizer import IM_END
from rllib_exgrpo.warm_start.examples import shows_true_meanings, with_answer_format
from rllib_exgrpo.envs import operators
from rllib_exgrpo.envs.prompting import render_prompt
from rllib_exgrpo.xrpo.icl import Example, SolvedCorpus, format_examples


def icl_prefixes(problems, recipe: dict, chosen: Optional[dict[int, list[int]]] = None) -> list[str]:
    """The in-context prefix of each warm-start example ("" for most): what makes the
    model able to use XRPO's in-context seeding.

    XRPO seeds a question whose completions all failed by putting a few solved questions
    similar to it before its prompt (BM25 over the question texts, ``xrpo/icl.py``). A model
    never trained on such prompts has no reason to use them (a pretrained LLM has). So a
    ``recipe["icl"]["fraction"]`` share of the warm-start examples get exactly that prefix:
    the ``num_examples`` training questions most similar to it by the same retrieval, with
    their worked solutions, rendered by the same ``format_examples``. Similar arithmetic
    questions share numbers and sub-expressions ("94 - 76 + 73" retrieves "94 - 76 + 12",
    whose solution holds "94 - 76 = 18"), so the examples carry usable information and the
    model can learn to copy it. The choice of examples is seeded by the recipe's seed.

    For the operators task the examples' solutions share the question's guessed table
    (:func:`operators_icl_draw`): the prefixes here are one such draw, and the warm start
    draws them anew each time an example is used (:func:`operators_icl_resampler`).
    """
    icl = recipe.get("icl")
    if not icl:
        return [""] * len(problems)

    chosen = icl_examples(problems, recipe) if chosen is None else chosen
    if "task" in recipe:
        rng = random.Random(f"tiny-operators-icl-prefixes:{recipe['seed']}")
        return [operators_icl_draw(problems, i, chosen[i], recipe, rng)[0] if i in chosen else "" for i in range(len(problems))]
    return [
        format_examples([Example(j, problems[j].question, problems[j].solution) for j in chosen[i]], icl["template"]) if i in chosen else ""
        for i in range(len(problems))
    ]


def icl_examples(problems, recipe: dict) -> dict[int, list[int]]:
    """Which warm-start examples get an in-context prefix, and the indices of the training
    questions it shows (XRPO's retrieval; the example itself excluded), chosen once."""
    icl = recipe["icl"]
    corpus = SolvedCorpus(capacity=len(problems), seed=recipe["seed"])
    for i, p in enumerate(problems):
        corpus.add(i, p.question, p.solution)
    rng = random.Random(f"tiny-icl:{recipe['seed']}")
    chosen: dict[int, list[int]] = {}
    for i, p in enumerate(problems):
        if rng.random() >= icl["fraction"]:
            continue
        examples = corpus.retrieve(p.question, k=icl["num_examples"], exclude_ids=[i])
        chosen[i] = [ex.question_id for ex in examples]
    return chosen


def operators_icl_draw(problems, i: int, shown: Sequence[int], recipe: dict, rng: random.Random) -> tuple[str, str]:
    """One draw of an operators warm-start example with an in-context prefix: the prefix
    text (the ``shown`` questions with worked solutions) and the example's own solution.

    In a family the RL task uses, every meaning the warm start shows is guessed, but within
    one draw the guesses come from *one* table per family, ``meaning[symbol][position]``,
    shared by the prefix and the solution. A prefix example of the same family then shows
    the meanings the solution uses wherever it holds the same symbol at the same position,
    and is worth copying; the next draw has another table, so no family's meanings are
    learned, only the reading of them off the examples: what XRPO's seeding with a solved
    example of the family needs. Known families (``known=N``) show their true meanings, as
    everywhere in the warm start.
    """
    tables: dict[int, dict[tuple[str, int], str]] = {}

    def solution(p) -> str:
        if shows_true_meanings(p, recipe):
            return p.solution
        question = operators.parse_question(p.question)
        table = tables.setdefault(p.extra["family"], {})
        meanings = tuple(table.setdefault((symbol, k), rng.choice(operators.MEANINGS)) for k, symbol in enumerate(question.symbols))
        return operators.worked_solution(question, meanings)

    own = solution(problems[i])
    prefix = format_examples([Example(j, problems[j].question, solution(problems[j])) for j in shown], recipe["icl"]["template"])
    return prefix, own


def operators_icl_resampler(problems: Sequence[Any], tokenizer, recipe: dict, chosen: Optional[dict[int, list[int]]] = None):
    """For an operators recipe with ``icl``: a function giving, for the in-context examples
    among a batch's indices, fresh ``(prompt ids, solution ids)`` drawn together
    (:func:`operators_icl_draw`); ``None`` for any other recipe."""
    if "task" not in recipe or not recipe.get("icl"):
        return None

    chosen = icl_examples(problems, recipe) if chosen is None else chosen
    rng = random.Random(f"tiny-operators-icl:{recipe['seed']}")
    format_rng = random.Random(f"tiny-operators-icl-format:{recipe['seed']}")

    def resample(idx) -> dict[int, tuple[list[int], list[int]]]:
        mine = [i for i in idx if i in chosen]
        prompts, solutions = [], []
        for i in mine:
            prefix, own = operators_icl_draw(problems, i, chosen[i], recipe, rng)
            if "answer_format" in recipe:
                own = with_answer_format(own, format_rng.random() < recipe["answer_format"]["boxed_fraction"], recipe)
            prompts.append(prefix + render_prompt(problems[i].question, tokenizer=tokenizer, instruction=recipe["instruction"]))
            solutions.append(own + IM_END)
        if not mine:
            return {}
        p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(solutions, add_special_tokens=False)["input_ids"]
        return {i: (p, c) for i, p, c in zip(mine, p_ids, c_ids)}

    return resample
