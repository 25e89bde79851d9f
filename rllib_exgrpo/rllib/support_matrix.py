"""The supported combinations of the switches that shape a run, read off the validation rules.

``docs/support_matrix.md`` is generated here (``python -m rllib_exgrpo.rllib.support_matrix``)
by validating every combination of :data:`SWITCHES` with ``ExGRPOConfig.validate`` -- the same
rules a run meets before anything starts -- so the table cannot disagree with the code
(``tests/test_support_matrix.py`` regenerates it and compares). A refused combination shows
the first line a user gets; a supported one names the test that runs the path its most
specific switch decides (:data:`RUN_BY`), and, for the pairwise set
(:func:`pairwise_combinations`), the test that trains it one iteration as a whole (:data:`RUN_WHOLE`).
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Iterator, List, Optional, Tuple

from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

#: Switch -> the values combined. The learner value sets ``learner_backend`` and
#: ``deepspeed_zero_stage``; ``colocate`` sets ``num_env_runners`` 0 (else 1 remote runner);
#: every combination has 2 learners, each actor one GPU (the layout the rules are written for).
SWITCHES: Dict[str, Tuple[Any, ...]] = {
    "generation_backend": ("hf", "vllm"),
    "colocate": (False, True),
    "learner": ("ddp", "zero1", "zero2", "zero3"),
    "lora_rank": (0, 16),
    "scoring_on": ("runners", "learners"),
    "async_rollouts": (False, True),
}

#: Combinations a test runs end to end (one iteration or more), by the switches that decide
#: the path: ``(switch values as a dict) -> test``. The first matching entry is named.
RUN_BY: Tuple[Tuple[Dict[str, Any], str], ...] = (
    ({"colocate": True, "generation_backend": "vllm", "learner": "ddp"}, "tests/test_vllm_colocate_ranks.py, tests/test_colocate_sync.py"),
    ({"colocate": True, "generation_backend": "vllm", "learner": "zero3"}, "tests/test_colocate_sync.py"),
    ({"colocate": True, "learner": "zero3"}, "tests/test_rehearsal.py (exgrpo_qwen_colocate)"),
    ({"colocate": True, "generation_backend": "hf"}, "tests/test_colocate.py"),
    ({"async_rollouts": True}, "tests/test_rollout_coordination.py"),
    ({"scoring_on": "learners"}, "tests/test_scoring_on_learners.py"),
    ({"lora_rank": 16, "learner": "ddp"}, "tests/test_lora.py"),
    ({"learner": "zero1"}, "tests/test_deepspeed.py"),
    ({"learner": "zero2"}, "tests/test_deepspeed.py"),
    ({"learner": "zero3"}, "tests/test_deepspeed.py"),
    ({"generation_backend": "vllm"}, "tests/test_vllm_backend.py"),
    ({"learner": "ddp"}, "tests/test_ddp.py"),
)


def combinations() -> Iterator[Dict[str, Any]]:
    names = list(SWITCHES)
    for values in itertools.product(*(SWITCHES[n] for n in names)):
        yield dict(zip(names, values))


def training_kwargs(combo: Dict[str, Any]) -> Dict[str, Any]:
    """The ``ExGRPOConfig.training`` / ``env_runners`` / ``learners`` settings of a combination."""
    learner = combo["learner"]
    kwargs = {k: v for k, v in combo.items() if k != "learner"}
    kwargs["learner_backend"] = "ddp" if learner == "ddp" else "deepspeed"
    if learner != "ddp":
        kwargs["deepspeed_zero_stage"] = int(learner[-1])
    return kwargs


def refusal(combo: Dict[str, Any]) -> Optional[str]:
    """The first validation error of a combination, or None when it is accepted."""
    config = (
        ExGRPOConfig()
        .env_runners(num_env_runners=0 if combo["colocate"] else 1, num_gpus_per_env_runner=1)
        .learners(num_learners=2, num_gpus_per_learner=1)
    )
    try:
        config.training(**training_kwargs(combo)).validate()
    except ValueError as e:
        lines = [line.strip().lstrip("- ").strip() for line in str(e).splitlines()]
        lines = [line for line in lines if line and not line.startswith(("Invalid ExGRPOConfig", "To suppress"))]
        return lines[0] if lines else str(e)
    return None


#: Trains each combination of :func:`pairwise_combinations` for one iteration, as laid out here.
RUN_WHOLE = "tests/test_support_matrix_cells.py"


def _pairs(combo: Dict[str, Any]) -> set:
    return {((a, combo[a]), (b, combo[b])) for a, b in itertools.combinations(SWITCHES, 2)}


def pairwise_combinations() -> List[Dict[str, Any]]:
    """Supported combinations in which every pair of switch values that some supported
    combination holds occurs together at least once (pairwise, or 2-way, coverage: a defect
    that needs two switches set a certain way shows up in one of them). Chosen greedily, in
    table order: each next one adds the most pairs not yet covered."""
    supported = [combo for combo, why in rows() if why is None]
    missing = set().union(*(_pairs(c) for c in supported))
    chosen: List[Dict[str, Any]] = []
    while missing:
        best = max(supported, key=lambda c: len(_pairs(c) & missing))
        chosen.append(best)
        missing -= _pairs(best)
    return chosen


def run_by(combo: Dict[str, Any], whole: Optional[List[Dict[str, Any]]] = None) -> str:
    specific = next((test for pattern, test in RUN_BY if all(combo[k] == v for k, v in pattern.items())), "")
    if combo in (pairwise_combinations() if whole is None else whole):
        return ", ".join(t for t in (f"**{RUN_WHOLE}**", specific) if t)
    return specific


def rows() -> List[Tuple[Dict[str, Any], Optional[str]]]:
    return [(combo, refusal(combo)) for combo in combinations()]


def markdown() -> str:
    """``docs/support_matrix.md``."""
    table = rows()
    whole = pairwise_combinations()
    refused = sum(1 for _, r in table if r)
    out = [
        "# Supported combinations",
        "",
        "Generated from the validation rules (`python -m rllib_exgrpo.rllib.support_matrix`): every",
        "combination of the switches below validated with `ExGRPOConfig.validate`, which every run",
        "meets before any actor starts (`rllib train` prints the same line and stops). 2 learners and",
        "1 env runner with a GPU each (`colocate: true`: no env runner); `weight_sync` collective.",
        f"{len(table)} combinations: {len(table) - refused} accepted, {refused} refused.",
        "",
        "The last column names the tests that run a combination, end to end on the tiny model (HF or",
        f"vLLM's CPU build). **`{RUN_WHOLE}`**: the combination as a whole, one iteration at this",
        f"layout; {len(whole)} of them are run so, chosen so that every pair of switch values the table",
        "accepts together runs together at least once (pairwise coverage; each costs 15-45 s of a",
        "2-core machine, all 60 about 15 minutes of the CI run). Beside it, the test that runs in",
        "depth the path the combination's most specific switch decides: colocated vLLM with DDP or",
        "ZeRO-3, colocated HF, async rollouts, scoring on learners, LoRA, each ZeRO stage, vLLM env",
        "runners, DDP. Where only that test is named, it covers the combination's distinguishing",
        "part; this exact set of switches did not run as a whole.",
        "",
        "| " + " | ".join(SWITCHES) + " | status | run by |",
        "|" + "---|" * (len(SWITCHES) + 2),
    ]
    for combo, why in table:
        cells = [str(combo[k]) for k in SWITCHES]
        status = "supported" if why is None else f"refused: {why}"
        out.append("| " + " | ".join(cells) + f" | {status} | {run_by(combo, whole) if why is None else ''} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "support_matrix.md"
    path.write_text(markdown(), encoding="utf-8")
    print(f"wrote {path}")
