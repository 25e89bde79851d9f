"""Puts the repository root and ``benchmarks/`` on ``sys.path`` for the studies, which run
from the repository root as ``python experiments/<name>.py``: they share ``_common.py``
(the tuned-example recipes, a local Ray) and ``_runs.py`` (training runs and the held-out
evaluator every comparison uses) with the product's benchmarks, one copy in ``benchmarks/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

for _path in (ROOT, BENCHMARKS):
    if str(_path) not in sys.path:
        sys.path.insert(1, str(_path))
