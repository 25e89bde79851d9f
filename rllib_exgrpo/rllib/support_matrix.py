"""The supported combinations of the switches that shape a run, read off the validation rules.

``docs/support_matrix.md`` is generated here (``python -m rllib_exgrpo.rllib.support_matrix``)
by validating every combination of :data:`SWITCHES` with ``ExGRPOConfig.validate`` -- the same
rules a run meets before anything starts -- so the table cannot disagree with the code
(``tests/test_support_matrix.py`` regenerates it and compares). A refused combination shows
the first line a user gets; a supported one names the test that runs the path its most
specific switch decides (:data:`RUN_BY`).
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


def run_by(combo: Dict[str, Any]) -> str:
    for pattern, test in RUN_BY:
        if all(combo[k] == v for k, v in pattern.items()):
            return test
    return ""


def rows() -> List[Tuple[Dict[str, Any], Optional[str]]]:
    return [(combo, refusal(combo)) for combo in combinations()]


def markdown() -> str:
    """``docs/support_matrix.md``."""
    table = rows()
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
        "The last column names the test that runs the path the combination's most specific switch",
        "decides, end to end on the tiny model (HF or vLLM's CPU build): colocated vLLM with DDP or",
        "ZeRO-3, colocated HF, async rollouts, scoring on learners, LoRA, each ZeRO stage, vLLM env",
        "runners, DDP. Not every accepted combination is run as a whole: the column says which",
        "test covers its distinguishing part, not that this exact set of switches ran.",
        "",
        "| " + " | ".join(SWITCHES) + " | status | run by |",
        "|" + "---|" * (len(SWITCHES) + 2),
    ]
    for combo, why in table:
        cells = [str(combo[k]) for k in SWITCHES]
        status = "supported" if why is None else f"refused: {why}"
        out.append("| " + " | ".join(cells) + f" | {status} | {run_by(combo) if why is None else ''} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "support_matrix.md"
    path.write_text(markdown(), encoding="utf-8")
    print(f"wrote {path}")
