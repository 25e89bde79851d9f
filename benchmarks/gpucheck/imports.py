"""What the project's imports pull in, and which optional dependencies are here."""

from __future__ import annotations

import sys

from gpucheck.common import (
    HEAVY,
)


# --------------------------------------------------------------------------------------
# Imports: the project's functions must not pull in Ray (the GPU machine has none)
# --------------------------------------------------------------------------------------


def import_project() -> dict:
    """Import the learner's and the HF backend's functions; say what each pulled in."""
    report = {}
    before = set(sys.modules)
    from rllib_exgrpo.core.losses import mixed_policy_loss  # noqa: F401
    from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy, score_learner_batch  # noqa: F401

    new = set(sys.modules) - before
    report["rllib_exgrpo.core.scoring+losses"] = sorted({m.split(".")[0] for m in new if m.split(".")[0] in HEAVY})
    before = set(sys.modules)
    from rllib_exgrpo.core.attention import register_kernels, resolve_attn_implementation  # noqa: F401
    from rllib_exgrpo.core.packing import pack_rows, score_packed  # noqa: F401

    new = set(sys.modules) - before
    report["rllib_exgrpo.core.packing+attention"] = sorted({m.split(".")[0] for m in new if m.split(".")[0] in HEAVY})
    before = set(sys.modules)
    try:
        from rllib_exgrpo.rllib.colocation import OptimizerOffload  # noqa: F401
    except Exception as e:  # the colocate stage needs it; the others do not
        report["rllib_exgrpo.rllib.colocation"] = f"import failed: {type(e).__name__}: {e}"
    else:
        new = set(sys.modules) - before
        report["rllib_exgrpo.rllib.colocation"] = sorted({m.split(".")[0] for m in new if m.split(".")[0] in HEAVY})
    before = set(sys.modules)
    try:
        from rllib_exgrpo.generation.hf import HFGenerationBackend, pruned_decode  # noqa: F401
    except Exception as e:  # generation is optional here: generate still runs without it
        report["rllib_exgrpo.generation.hf"] = f"import failed: {type(e).__name__}: {e}"
    else:
        new = set(sys.modules) - before
        report["rllib_exgrpo.generation.hf"] = sorted({m.split(".")[0] for m in new if m.split(".")[0] in HEAVY})
    return report
