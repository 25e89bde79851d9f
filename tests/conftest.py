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


def _ensure_ray_auth_token() -> None:
    """Token authentication stays on, as Ray 2.60 sets it up: every private Ray of the tests
    and every ``rllib train`` they run uses ``~/.ray/auth_token``. Ray writes that file on
    the first ``ray.init()`` that finds none, but not atomically: two pytest-xdist workers
    starting Ray at the same moment both write it, each its own token, and a cluster may
    keep the one that the file no longer holds. Written here once, before the workers
    start (``pytest_configure`` runs in the controller first), without ever replacing a
    token: a new file is linked into place only if none is there. Nothing to do where the
    token comes from ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH``, or where the run opts
    out with ``RAY_AUTH_MODE=disabled``."""
    import os
    import secrets
    import tempfile

    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    path = Path.home() / ".ray" / "auth_token"
    if path.is_file() and path.stat().st_size:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".auth_token.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))  # Ray's own format: 256 random bits, hex
        os.chmod(tmp, 0o600)
        try:
            os.link(tmp, path)  # fails if another process got there first: keep that one
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def pytest_configure(config):
    _ensure_ray_auth_token()


def pytest_addoption(parser):
    parser.addoption(
        "--rehearsals-first",
        action="store_true",
        help="run the recipe rehearsals first, then the other slow tests, then the rest (tests/run.sh vllm)",
    )


def pytest_collection_modifyitems(config, items):
    """``--rehearsals-first``: the longest tests at the head of the queue. pytest-xdist's
    worksteal gives each worker half of the queue and lets a worker that runs dry take from
    the tail of the other's: with the long tests first, the tails are short tests, so both
    workers finish within a short test of each other instead of one waiting out a 4-minute
    rehearsal alone (the vLLM suite: 2 minutes of one idle core)."""
    if not config.getoption("--rehearsals-first"):
        return

    def rank(item) -> int:
        if "rehears" in item.name:
            return 0
        return 1 if item.get_closest_marker("slow") else 2

    items.sort(key=rank)  # stable: file order within each rank


#: Whether the session's private Ray (``ray_local``) was started and is still wanted.
_SHARED_RAY = {"wanted": False}


def _start_private_ray():
    import ray

    if not ray.is_initialized():
        repo = str(Path(__file__).resolve().parents[1])
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
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
