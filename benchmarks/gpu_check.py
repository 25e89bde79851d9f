"""GPU check of the learner, the colocated turn and the engines' weight paths on one device.

The stages live in the ``gpucheck`` package next to this file (one module per stage;
``python benchmarks/gpu_check.py --help`` lists them). This file is the entry point::

    python benchmarks/gpu_check.py [--cpu] [--stages ...] [--budget-s 420] [--wheels DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent)):  # gpucheck, and rllib_exgrpo without installing
    if path not in sys.path:
        sys.path.insert(0, path)

# The stages' functions, for tests and notebooks.
from gpucheck.colocate import ColocateCycle, colocate_plan, colocate_predicted_s, run_colocate  # noqa: E402,F401
from gpucheck.common import *  # noqa: E402,F401,F403
from gpucheck.drift import logp_drift, run_drift  # noqa: E402,F401
from gpucheck.driver import STAGES, main  # noqa: E402,F401
from gpucheck.generation import run_generation  # noqa: E402,F401
from gpucheck.learner import run_learner  # noqa: E402,F401
from gpucheck.packed import flash_attn_status, packed_pass_spec, packed_plan, run_packed  # noqa: E402,F401
from gpucheck.slice import extrapolate_slice, plan_comparison, run_slice  # noqa: E402,F401
from gpucheck.transfer import CPU_TRANSFER_CAP_GB, run_transfer  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
