"""The held-out accuracy plot ``rllib train`` writes next to each trial's results.

One PNG per trial, ``heldout_accuracy.png`` in the trial folder (beside ``result.json``),
from the trial's own result rows: the points are the ``(heldout/after_iteration,
heldout/accuracy)`` pairs, one per evaluation (a row between evaluations repeats the last
one and adds no point). Written after the trial ends, also for a resumed trial, whose rows
hold the iterations before the kill too.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, List, Mapping, Optional, Tuple

PLOT_FILE = "heldout_accuracy.png"
ACCURACY, AFTER = "heldout/accuracy", "heldout/after_iteration"


def heldout_points(rows: Iterable[Mapping]) -> List[Tuple[int, float]]:
    """Sorted ``(iteration, accuracy)`` evaluation points of flattened result rows."""
    points = {}
    for row in rows:
        acc, after = row.get(ACCURACY), row.get(AFTER)
        if acc is None or after is None:
            continue
        try:
            acc, after = float(acc), float(after)
        except (TypeError, ValueError):
            continue
        if math.isfinite(acc) and math.isfinite(after):
            points[int(after)] = acc
    return sorted(points.items())


def write_heldout_plot(folder: Path, rows: Iterable[Mapping], title: str) -> Optional[Path]:
    """Write ``folder/heldout_accuracy.png``; None (nothing written) without evaluations."""
    points = heldout_points(rows)
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys = zip(*points)
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    ax.plot(xs, ys, marker="o")
    ax.axhline(ys[0], color="grey", lw=0.8, ls="--", label=f"start {ys[0]:.3f}")
    ax.set_xlabel("training iteration")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(folder) / PLOT_FILE
    fig.savefig(path)
    plt.close(fig)
    return path


def write_grid_plots(grid, experiment_name: str) -> List[Path]:
    """One plot per trial of a Tune ``ResultGrid`` (its ``metrics_dataframe`` rows)."""
    written = []
    for result in grid:
        df = getattr(result, "metrics_dataframe", None)
        if df is None or result.path is None or ACCURACY not in df.columns:
            continue
        trial_id = (result.metrics or {}).get("trial_id", "")
        title = f"{experiment_name}, trial {trial_id}: held-out accuracy" if trial_id else experiment_name
        path = write_heldout_plot(Path(result.path), df.to_dict("records"), title)
        if path is not None:
            written.append(path)
    return written
