"""The held-out accuracy plot of ``rllib train`` (rllib_exgrpo/cli/plots.py)."""

import math

from rllib_exgrpo.cli.plots import PLOT_FILE, heldout_points, write_heldout_plot


def test_points_are_one_per_evaluation_in_iteration_order():
    rows = [
        {"heldout/accuracy": 0.35, "heldout/after_iteration": 0},
        {"heldout/accuracy": 0.35, "heldout/after_iteration": 0},  # repeated between evaluations
        {"training_iteration": 3},  # no evaluation logged yet
        {"heldout/accuracy": 0.5, "heldout/after_iteration": 10},
        {"heldout/accuracy": math.nan, "heldout/after_iteration": 12},
        {"heldout/accuracy": 0.45, "heldout/after_iteration": 5},
    ]
    assert heldout_points(rows) == [(0, 0.35), (5, 0.45), (10, 0.5)]


def test_plot_is_a_png_in_the_trial_folder_and_nothing_without_evaluations(tmp_path):
    rows = [{"heldout/accuracy": a, "heldout/after_iteration": i} for i, a in [(0, 0.3), (10, 0.4), (20, 0.45)]]
    path = write_heldout_plot(tmp_path, rows, "exgrpo-tiny")
    assert path == tmp_path / PLOT_FILE
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert write_heldout_plot(tmp_path / "none", [{"training_iteration": 1}], "x") is None


def test_grid_plots_one_per_trial_with_evaluations(tmp_path):
    """write_grid_plots on Tune-like results: a plot per trial that evaluated, none for one
    that did not (no heldout column), titled with the trial id."""
    from types import SimpleNamespace

    import pandas as pd

    from rllib_exgrpo.cli.plots import write_grid_plots

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    evaluated = pd.DataFrame({"heldout/accuracy": [0.3, 0.3, 0.4], "heldout/after_iteration": [0, 0, 2], "training_iteration": [1, 2, 3]})
    grid = [
        SimpleNamespace(metrics_dataframe=evaluated, path=str(tmp_path / "a"), metrics={"trial_id": "x1"}),
        SimpleNamespace(metrics_dataframe=pd.DataFrame({"training_iteration": [1]}), path=str(tmp_path / "b"), metrics={}),
    ]
    assert write_grid_plots(grid, "exp") == [tmp_path / "a" / PLOT_FILE]
