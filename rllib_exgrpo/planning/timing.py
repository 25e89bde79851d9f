"""Seconds per iteration of a GPU recipe: an ESTIMATE, printed with the memory plan.

No figure here was measured on a GPU. The estimate is the arithmetic of ``docs/scaling.md``
(which derives the 7B recipe stage by stage) turned into a function of the config, so every
GPU recipe gets one from the same inputs:

* **tokens**: each iteration's completions follow the declared length mix of
  ``benchmarks/learner_padding.py`` (completions log-normal with median 700 and sigma 0.8,
  3% at the cap; prompts ~157 tokens), cut at the plan's completion cap (the model's context
  included, :func:`~rllib_exgrpo.planning.memory.sequence_lengths`);
* **generation**: decoding is memory-bound: tokens/s per GPU = :data:`DECODE_STREAMS` x
  HBM bandwidth / weight bytes, calibrated on the public vLLM figure for a 7B model on an H100
  (~3,300 tokens/s at a few hundred concurrent sequences, ``docs/scaling.md``, "Public
  figures"), and never less than the longest completion decoded alone (:data:`SINGLE_STREAM_EFFICIENCY`
  of the bandwidth);
* **learner update and scoring**: 2 FLOPs per parameter and token forward, 4 backward (2 with
  LoRA: no weight gradients of the frozen base), 2 more with gradient checkpointing, at
  :data:`TRAINING_MFU` of the card's bf16 peak (published 7B FSDP runs: 54-57%; this recipe's
  packed variable-length passes with ZeRO-3 gathers are taken at 0.335, which reproduces the
  62 s learner update of ``docs/scaling.md``);
* **weight sync**: 2 bytes per parameter at :data:`BROADCAST_BYTES_PER_S` between GPUs
  (the 3.5 s of a 7B broadcast), or in one process at :data:`RELOAD_BYTES_PER_S`
  (colocated); a colocated turn also moves the optimiser state to the host and back at
  :data:`HOST_BYTES_PER_S`;
* **other**: :data:`OTHER_SECONDS` for verification, the driver, and the checkpoint and
  held-out evaluation amortised (``docs/scaling.md``: 6.5 s for the 7B recipe).

Stages run one after another (the recipes alternate strictly). Each card's bf16 dense peak
and HBM bandwidth are their data-sheet values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

from rllib_exgrpo.planning.cards import card_for_size

#: bf16 dense peak (FLOP/s) and HBM bandwidth (bytes/s) per card, from the data sheets; a
#: card class of the table in ``planning/cards.py`` is estimated on its first card here.
CARD_SPEEDS: Dict[str, tuple] = {
    "H100 80 GB": (989e12, 3.35e12),
    "A10 24 GB": (125e12, 0.60e12),
    "H200 141 GB": (989e12, 4.8e12),
}
#: The card each nominal size of the card table is estimated on.
CARD_BY_NOMINAL_GB = {24: "A10 24 GB", 80: "H100 80 GB", 141: "H200 141 GB"}

#: Concurrent sequences' worth of bandwidth-bound decoding (3,270 tokens/s for 7.6 B bf16
#: parameters on an H100's 3.35 TB/s).
DECODE_STREAMS = 14.8
#: Share of the bandwidth one sequence decoding alone gets (the longest completion's floor).
SINGLE_STREAM_EFFICIENCY = 0.6
#: Model FLOPs utilisation of the learner's passes and of scoring passes.
TRAINING_MFU = 0.335
#: A weight broadcast between GPUs (bytes/s): 15.2 GB of a 7B model in 3.5 s.
BROADCAST_BYTES_PER_S = 4.35e9
#: Weights reloaded into a vLLM engine in the same process (bytes/s).
RELOAD_BYTES_PER_S = 20e9
#: Host <-> GPU copies of the optimiser state in a colocated turn (bytes/s, pinned PCIe).
HOST_BYTES_PER_S = 20e9
#: Verification, driver, checkpoint and held-out evaluation, amortised (seconds).
OTHER_SECONDS = 6.5

#: The declared length mix (``benchmarks/learner_padding.py``).
COMPLETION_MEDIAN, COMPLETION_SIGMA, SHARE_AT_CAP, PROMPT_MEAN = 700.0, 0.8, 0.03, 157.0


def mean_completion_tokens(cap: int) -> float:
    """Mean completion of the length mix cut at ``cap``: E[min(X, cap)] of the log-normal
    part, and :data:`SHARE_AT_CAP` of the completions at the cap."""
    mu, s = math.log(COMPLETION_MEDIAN), COMPLETION_SIGMA
    z = (math.log(cap) - mu) / s

    def phi(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    below = math.exp(mu + s * s / 2) * phi(z - s) + cap * (1.0 - phi(z))
    return (1.0 - SHARE_AT_CAP) * below + SHARE_AT_CAP * cap


@dataclass
class TimeEstimate:
    """Seconds per iteration by stage on ``card``; ``iterations`` (the run's stop) gives the run."""

    card: str
    stages: Dict[str, float] = field(default_factory=dict)
    iterations: Optional[int] = None

    @property
    def seconds(self) -> float:
        return sum(self.stages.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {_seconds(value)}" for name, value in self.stages.items())
        line = f"time per iteration (ESTIMATE, {self.card}, no GPU measurement): ~{_seconds(self.seconds)} s ({parts})"
        if self.iterations:
            line += f"; {self.iterations} iterations: ~{run_hours(self.seconds, self.iterations)}"
        return line


def _seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def run_hours(seconds_per_iteration: float, iterations: int) -> str:
    hours = seconds_per_iteration * iterations / 3600.0
    return f"{hours:.0f} h" if hours >= 10 else f"{hours:.1f} h"


def estimate_iteration(
    *,
    parameters: int,
    completions: int,
    prompt_cap: int,
    completion_cap: int,
    generating_gpus: int,
    learner_gpus: int,
    card: str,
    lora: bool,
    gradient_checkpointing: bool,
    colocate: bool,
    optimizer_state_bytes: float = 0.0,
    value_trunk: bool = False,
) -> TimeEstimate:
    """The stages of one iteration (see the module doc). ``completions`` per iteration;
    ``value_trunk``: a second network of the policy's size (RLlib's PPO without shared layers)."""
    peak, bandwidth = CARD_SPEEDS[card]
    weight_bytes = 2.0 * parameters
    completion = mean_completion_tokens(completion_cap)
    row_tokens = min(PROMPT_MEAN, prompt_cap) + completion
    per_gpu = DECODE_STREAMS * bandwidth / weight_bytes
    alone = SINGLE_STREAM_EFFICIENCY * bandwidth / weight_bytes
    generation = max(completions * completion / (max(1, generating_gpus) * per_gpu), completion_cap / alone)
    tokens_per_learner = completions * row_tokens / max(1, learner_gpus)
    flops_per_token = 2 + (2 if lora else 4) + (2 if gradient_checkpointing else 0)
    trunks = 2 if value_trunk else 1
    rate = peak * TRAINING_MFU
    stages = {
        "generation": generation,
        "scoring": trunks * 2 * parameters * tokens_per_learner / rate,
        "update": trunks * flops_per_token * parameters * tokens_per_learner / rate,
        "weight sync": weight_bytes / (RELOAD_BYTES_PER_S if colocate else BROADCAST_BYTES_PER_S),
    }
    if colocate and optimizer_state_bytes:
        stages["optimiser offload"] = 2 * optimizer_state_bytes / HOST_BYTES_PER_S
    stages["other"] = OTHER_SECONDS
    return TimeEstimate(card, stages)


def card_for_estimate(gpu_memory_bytes: Optional[float]) -> Optional[str]:
    """The card an estimate is made on for the plan's GPU size (a card class of the card
    table: its first card in :data:`CARD_SPEEDS`), or None for a size the table lacks."""
    card = card_for_size(gpu_memory_bytes) if gpu_memory_bytes else None
    return CARD_BY_NOMINAL_GB.get(int(card.nominal_gb)) if card else None
