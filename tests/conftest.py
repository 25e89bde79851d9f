"""Shared fixtures. Keep this file small: module-specific fixtures live in their test files."""
from __future__ import annotations

from pathlib import Path

import pytest

#: ../shared/data relative to the repository root: developer / CI data, not shipped.
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared data folder, or skip the test when this checkout has none."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data absent (developer/CI-only data)")
    return SHARED_DATA
