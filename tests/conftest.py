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


#: A small, quickly built variant of the embedded tiny model: enough for plumbing tests
#: (shapes, checkpoints, runners); learning is measured by the benchmarks, not here.
QUICK_TINY = "tiny:max_steps=30,target_pass1=0.99"


#: Whether the session's private Ray (``ray_local``) was started and is still wanted.
_SHARED_RAY = {"wanted": False}


def _start_private_ray():
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if not ray.is_initialized():
        repo = str(Path(__file__).resolve().parents[1])
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": repo}},
        )
    return ray


@pytest.fixture(scope="session")
def ray_local():
    """A private local Ray for the session (never joins another cluster on the machine).

    A test that needs no cluster may shut Ray down (a preflight check, a dry run): the next
    test that asks for ``ray_local`` gets it started again (``pytest_runtest_setup``), once,
    rather than every ``rllib train`` that test runs starting and stopping a Ray of its own."""
    ray = _start_private_ray()
    _SHARED_RAY["wanted"] = True
    yield ray
    _SHARED_RAY["wanted"] = False
    ray.shutdown()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before any fixture of the test (module-scoped ones included) is set up.
    if _SHARED_RAY["wanted"] and "ray_local" in getattr(item, "fixturenames", ()):
        _start_private_ray()


@pytest.fixture(scope="session")
def quick_tiny_model() -> str:
    """Model spec of the quick tiny model, built (and cached) once per machine."""
    from rllib_exgrpo.models import resolve_model_path

    resolve_model_path(QUICK_TINY)
    return QUICK_TINY


# --- fault-injection suite (tests marked `faults`) -------------------------------------
#: One record per injected fault: (test id, survived, items lost), gathered in pytest's own
#: process, which under pytest-xdist is the controller that receives every worker's reports.
FAULTS: list = []


@pytest.fixture
def fault_log(request):
    """``fault_log(survived: bool, lost: int = 0)`` records one injected fault of this test.

    The record travels as a user property of the test's reports, so that the summary line
    counts the faults of every xdist worker."""

    def record(survived: bool, lost: int = 0) -> None:
        request.node.user_properties.append(("fault", [bool(survived), int(lost)]))

    return record


def pytest_runtest_logreport(report):
    if report.when == "teardown":  # the last report of a test: every property is on it
        FAULTS.extend((report.nodeid, bool(v[0]), int(v[1])) for k, v in report.user_properties if k == "fault")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if FAULTS:
        survived = sum(s for _, s, _ in FAULTS)
        lost = sum(n for _, _, n in FAULTS)
        terminalreporter.write_line(f"faults injected: {len(FAULTS)}, survived: {survived}, data lost: {lost}")
