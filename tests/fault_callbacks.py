"""Callbacks the fault tests load by name from an experiment file (not a test module).

They live apart from ``test_faults.py`` so that a Ray worker can import them without
pytest, through the ``tests`` folder the fault tests put on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import time

from ray.rllib.callbacks.callbacks import RLlibCallback

#: Environment variable naming the marker file; unset, the callback does nothing.
PAUSE_MARKER_ENV = "EXGRPO_FAULT_PAUSE_MARKER"
#: The training iteration after which the run is held still for the kill.
PAUSE_AFTER_ITERATION = 3


class PauseForKill(RLlibCallback):
    """Holds the trial still after iteration 3 so that a SIGKILL lands at a fixed point
    of the run whatever the machine's speed: it writes the marker file the test waits
    for, then sleeps (the kill arrives during the sleep). Results are unaffected: the
    callback reads nothing and changes nothing."""

    def on_train_result(self, *, algorithm, result, **kwargs) -> None:
        marker = os.environ.get(PAUSE_MARKER_ENV)
        if marker and result.get("training_iteration") == PAUSE_AFTER_ITERATION:
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
