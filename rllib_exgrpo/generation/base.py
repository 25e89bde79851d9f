"""The small interface every generation backend implements.

Token ids in, token ids and behaviour log-probs out: that is all vLLM and HF have in
common, and all the algorithm needs. Prompts are rendered and tokenised by the env runner,
so a backend never sees text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence

import numpy as np

#: ``hf_decoder`` values: the HF backend's own pruned loop, or transformers' ``generate``.
HF_DECODERS = ("pruned", "generate")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple = ()
    #: Also return the behaviour log-probs of the sampled tokens (at ``temperature``, or
    #: at 1.0 when greedy). Evaluation turns this off to save a scoring pass.
    return_logprobs: bool = True


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int
    token_ids: np.ndarray  # int32 [R], includes the stop token when generation stopped on it
    logp: Optional[np.ndarray]  # float32 [R], behaviour log-prob of each token
    finish_reason: str  # "stop" | "length"
    #: The engine's own log-probs of the tokens when it returned them (vLLM), kept next to
    #: ``logp`` (recomputed by the torch module) to measure their mismatch.
    engine_logp: Optional[np.ndarray] = None


class GenerationBackend(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], num_samples: Sequence[int], params: SamplingParams) -> List[List[Completion]]:
        """Sample ``num_samples[i]`` completions of ``prompts[i]`` (token ids).

        Returns one list of completions per prompt, in prompt order.
        """

    def score(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *, temperature: float
    ) -> tuple[List[np.ndarray], List[np.ndarray]]:
        """Per-token log-probs and entropies of given completions under the current weights."""

    def load_weights(self, state_dict: Dict[str, np.ndarray]) -> None:
        """Take new policy weights (called after every learner update)."""
