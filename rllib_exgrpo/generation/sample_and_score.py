"""One path from prompt texts to verified completions: encode, generate, decode, score.

The env runner (training samples and held-out evaluation), ``rllib evaluate`` and the
embedded model's warm-start evaluation all call :func:`sample_and_score`, so they share
the prompt truncation rule, the stop-token rule (:func:`stop_token_ids`), the decoding of
completions and the verifier.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from rllib_exgrpo.generation.base import Completion, SamplingParams

#: ``score(question_ids, completion_texts) -> [RewardResult]`` (``ReasoningEnv.score``).
ScoreFn = Callable[[Sequence[str], Sequence[str]], List[Any]]


def stop_token_ids(model: Any, tokenizer: Any) -> tuple:
    """Generation stops at the tokenizer's eos and at every eos id of the model's
    generation config (chat models often list their end-of-turn token there)."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return tuple(sorted(i for i in ids if i is not None))


def encode_prompt(tokenizer: Any, text: str, max_prompt_tokens: Optional[int] = None) -> List[int]:
    """Token ids of a rendered prompt, left-truncated to ``max_prompt_tokens`` (the end of
    a prompt -- the question and the generation cue -- is what must survive)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
        ids = ids[-max_prompt_tokens:]
    return ids


@dataclass
class ScoredCompletion:
    """One completion of prompt ``prompt_index`` with its decoded text and verdict."""

    prompt_index: int
    completion: Completion
    text: str
    result: Any  # rllib_exgrpo.envs.rewards.RewardResult


@dataclass
class ScoredBatch:
    items: List[ScoredCompletion]  # prompt by prompt, in order
    generation_s: float
    scoring_s: float


def sample_and_score(
    backend: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    counts: Sequence[int],
    params: SamplingParams,
    question_ids: Sequence[str],
    score: ScoreFn,
) -> ScoredBatch:
    """Generate ``counts[i]`` completions of ``prompts[i]`` and verify each against
    question ``question_ids[i]``; completions are decoded without special tokens."""
    t0 = time.perf_counter()
    groups = backend.generate(list(prompts), list(counts), params)
    t1 = time.perf_counter()
    flat = [(qi, c) for qi, group in enumerate(groups) for c in group]
    texts = tokenizer.batch_decode([c.token_ids for _, c in flat], skip_special_tokens=True)
    results = score([question_ids[qi] for qi, _ in flat], texts)
    t2 = time.perf_counter()
    items = [ScoredCompletion(qi, c, text, r) for (qi, c), text, r in zip(flat, texts, results)]
    return ScoredBatch(items=items, generation_s=t1 - t0, scoring_s=t2 - t1)
