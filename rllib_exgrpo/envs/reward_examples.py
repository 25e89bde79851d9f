"""Small, real reward functions to use as they are or to copy (see ``docs/rewards.md``).

Use one with ``env_config.reward_fn: rllib_exgrpo.envs.reward_examples:exact_match``, or several with
``reward_fns`` and ``reward_weights``. Each is called in a verifier worker process with
keyword arguments: ``completion`` (the generated text), ``ground_truth`` (the row's
answer) and the row's other fields; a function receives only the keywords it names
unless it takes ``**kwargs``. It returns a float; a row counts as correct when the
weighted sum of the rewards is >= 1.0.

Keep this module light: every reward worker imports it.
"""

from __future__ import annotations

import re
from typing import Optional

from rllib_exgrpo.envs.rewards import last_boxed

_SPACES = re.compile(r"\s+")
_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _final_answer(completion: str) -> Optional[str]:
    """The last ``\\boxed{...}`` after any think block, else the last number, else None."""
    tail = completion.rsplit("</think>", 1)[-1]
    boxed = last_boxed(tail)
    if boxed is not None:
        return boxed
    numbers = _LAST_NUMBER.findall(tail)
    return numbers[-1] if numbers else None


def _norm(text: str) -> str:
    return _SPACES.sub(" ", text).strip().strip(".").strip().casefold()


def exact_match(completion: str, ground_truth: str) -> float:
    """1.0 when the final answer (the last ``\\boxed{}``, else the last number) equals the
    ground truth as a string, ignoring case, surrounding spaces and a final period;
    else 0.0. No maths: ``\\boxed{0.5}`` does not match ``1/2``."""
    answer = _final_answer(completion)
    return 1.0 if answer is not None and _norm(answer) == _norm(str(ground_truth)) else 0.0


def keyword_match(completion: str, ground_truth: str, keywords: Optional[str] = None) -> float:
    """The fraction of keywords that occur in the completion (whole words, any case).

    The keywords are the row's ``keywords`` column (comma-separated, e.g. ``"photosynthesis,
    chlorophyll"``) when it has one, else the ground truth itself as the one keyword.
    """
    words = [w.strip() for w in (keywords if keywords else str(ground_truth)).split(",") if w.strip()]
    if not words:
        return 0.0
    text = completion.casefold()
    hits = sum(bool(re.search(r"(?<!\w)" + re.escape(w.casefold()) + r"(?!\w)", text)) for w in words)
    return hits / len(words)


def short_answer(completion: str, max_chars: int = 200) -> float:
    """A length bonus: 1.0 for completions of at most ``max_chars`` characters, falling
    linearly to 0.0 at twice that. Pair it with a small weight next to a correctness
    reward."""
    n = len(completion)
    if n <= max_chars:
        return 1.0
    return max(0.0, 1.0 - (n - max_chars) / max_chars)
