"""Docs that restate what the code decides stay in step with it: the weight-sync default in
docs/cluster.md, and the 7B recipe's planned memory in docs/scaling.md (the README's row,
which tests/test_memory_plan.py checks against the dry run)."""

from __future__ import annotations

import re
from pathlib import Path

from rllib_exgrpo.rllib.config_fields import FIELDS_BY_NAME

REPO = Path(__file__).resolve().parents[1]


def test_cluster_doc_names_the_weight_sync_default():
    default = FIELDS_BY_NAME["weight_sync"].default
    text = (REPO / "docs" / "cluster.md").read_text()
    assert f"`weight_sync: {default}`, the default" in text
    other = [v for v in ("collective", "object_store") if v != default]
    assert all(f"`weight_sync: {v}`" in text for v in other), "the doc names the alternative"


def test_scaling_doc_quotes_the_plan_of_the_7b_recipe():
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `exgrpo_qwen.yaml` |"))
    learner, runner = re.search(r"([\d.]+) GiB on a learner GPU, ([\d.]+) GiB on a runner GPU", row).groups()
    scaling = (REPO / "docs" / "scaling.md").read_text()
    assert f"learner {learner} GiB, runner {runner} GiB" in scaling
