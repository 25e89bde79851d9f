"""The package as a wheel: what it holds, and that it trains when installed from it.

* The wheel is built from a copy of the checkout (``pip wheel --no-deps
  --no-build-isolation``), so that setuptools' ``build/`` and ``*.egg-info`` land in the
  copy, never in the checkout.
* Its file list: every module of every sub-package of ``rllib_exgrpo`` (each with its
  ``__init__.py``: ``find_packages`` leaves out a folder without one), every data file of
  the package (``py.typed``, the shipped tiny models), and nothing at the top but
  ``rllib_exgrpo`` (no stray ``envs`` package).
* Installed (not editable) into a fresh virtual environment, it imports and trains from a
  folder outside the checkout with no ``PYTHONPATH``: one iteration of
  ``tuned_examples/grpo_tiny.yaml`` through the installed ``rllib`` command, with an empty
  model cache, so the tiny model comes from the wheel's shipped build. The fresh
  environment reaches torch, Ray and the other dependencies through a ``.pth`` file that
  lists this environment's ``site-packages`` folder: a plain path line, so the ``.pth``
  files in that folder (the editable install's import hook among them) are not run there,
  and the checkout stays out of reach.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "rllib_exgrpo"
RECIPE = REPO / "tuned_examples" / "grpo_tiny.yaml"
#: What the copy of the checkout leaves out: version control, environments, build and run
#: outputs (none of it is part of a build).
_NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", ".venv-*", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache", "results", "mlruns", "*.db"
)


def _package_files() -> set:
    """The checkout's files of the package, as paths relative to the repository root
    (compiled files and dot-files such as ``.gitattributes`` aside)."""
    return {
        p.relative_to(REPO).as_posix()
        for p in PKG.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc" and not p.name.startswith(".")
    }


def _build_wheel(src: Path, out: Path) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(src)],
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    wheels = list(out.glob("rllib_exgrpo-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _wheel_files(wheel: Path) -> set:
    """The wheel's files outside its ``.dist-info`` folder."""
    return {n for n in zipfile.ZipFile(wheel).namelist() if not n.endswith("/") and not n.split("/")[0].endswith(".dist-info")}


@pytest.fixture(scope="module")
def build_root(tmp_path_factory) -> Path:
    """A folder with ``src/``, a copy of the checkout as it is now, to build from."""
    root = tmp_path_factory.mktemp("wheel")
    shutil.copytree(REPO, root / "src", ignore=_NOT_COPIED)
    return root


@pytest.fixture(scope="module")
def wheel(build_root) -> Path:
    """The wheel of the checkout (built from the copy)."""
    before = {name: (REPO / name).exists() for name in ("build", "dist", "rllib_exgrpo.egg-info")}
    built = _build_wheel(build_root / "src", build_root / "dist")
    assert {name: (REPO / name).exists() for name in before} == before, "the build wrote into the checkout"
    return built


def test_wheel_holds_every_module_and_data_file_and_nothing_else(wheel):
    names = [n for n in zipfile.ZipFile(wheel).namelist() if not n.endswith("/")]
    dist_info = {n for n in names if n.split("/")[0].endswith(".dist-info")}
    files = _wheel_files(wheel)

    # Every folder of the package with Python modules is a package (``__init__.py``).
    for folder in sorted({Path(f).parent for f in _package_files() if f.endswith(".py")}):
        assert (REPO / folder / "__init__.py").is_file(), (
            f"{folder} has modules but no __init__.py: find_packages leaves it out of the wheel"
        )
    # The wheel's package files are the checkout's: every module and data file, no other.
    expected = _package_files()
    assert sorted(expected - files) == [], "in the checkout, missing from the wheel"
    assert sorted(files - expected) == [], "in the wheel, not in the checkout"
    assert "rllib_exgrpo/py.typed" in files

    from rllib_exgrpo.models.shipped import SHIPPED

    for name, record in SHIPPED.items():
        for file in record:
            assert f"rllib_exgrpo/models/prebuilt/{name}/{file}" in files, (name, file)
    # One top-level package: no `envs` (it lives at rllib_exgrpo.envs) and no tests/benchmarks.
    assert {f.split("/")[0] for f in files} == {"rllib_exgrpo"}
    top_level = next(n for n in dist_info if n.endswith("/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["rllib_exgrpo"]
    entry_points = next(n for n in dist_info if n.endswith("/entry_points.txt"))
    assert "rllib = rllib_exgrpo.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_source_distribution_builds_the_same_wheel(build_root, wheel):
    """The sdist (setuptools' PEP 517 hook, MANIFEST.in) carries what the wheel needs, the
    README, license and recipes, and no tests; the wheel built from it is the same."""
    import tarfile

    out = build_root / "sdist"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))", str(out)],
        cwd=build_root / "src",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    sdist = out / proc.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        tar.extractall(out, filter="data")
    for needed in ("setup.py", "README.md", "LICENSE", "tuned_examples/grpo_tiny.yaml", "rllib_exgrpo/py.typed"):
        assert needed in names, needed
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names), sorted(names)
    again = _build_wheel(out / top, build_root / "dist-from-sdist")
    assert _wheel_files(again) == _wheel_files(wheel)


def _fresh_venv(root: Path, wheel: Path) -> Path:
    """A new virtual environment with ``wheel`` installed in it (not editable) and this
    environment's installed packages on its path (a ``.pth`` path line); its python."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # This pip, run for the new environment's interpreter: the wheel lands in the new
    # environment, whose path does not reach this one yet (nothing there to replace).
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(purelib) / "dev_dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    return python


def _user_env(cache: Path) -> dict:
    """This environment as a user's shell would have it (no ``PYTHONPATH``, no Ray address),
    with the model cache at ``cache``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    if env.get("RAY_AUTH_MODE", "").lower() == "token":
        # Ray sets RAY_AUTH_MODE=token in a process that started a Ray before (this test
        # worker may have): unset, the run decides as a user's shell would, from the token.
        del env["RAY_AUTH_MODE"]
    env["RLLIB_EXGRPO_CACHE"] = str(cache)  # empty: the tiny model comes from the wheel
    return env


def _import_probe() -> str:
    """A script that imports the package and its public names and prints, as JSON, where the
    package and ``rllib_exgrpo.envs`` came from, the public names, whether a top-level
    ``envs`` is importable and ``sys.path``."""
    return f"""
import importlib.util, json, sys
import rllib_exgrpo
from rllib_exgrpo import {", ".join(__import__("rllib_exgrpo").__all__)}
import rllib_exgrpo.envs
print(json.dumps({{
    "file": rllib_exgrpo.__file__, "envs": rllib_exgrpo.envs.__file__,
    "api": sorted(rllib_exgrpo.__all__), "top_level_envs": importlib.util.find_spec("envs") is not None,
    "path": sys.path,
}}))
"""


@pytest.mark.slow
def test_installed_wheel_imports_and_trains_outside_the_checkout(wheel, tmp_path):
    python = _fresh_venv(tmp_path, wheel)
    work = tmp_path / "work"  # outside the checkout: Ray puts the driver's folder on workers' paths
    work.mkdir()
    env = _user_env(tmp_path / "cache")

    probe = _import_probe()
    proc = subprocess.run([str(python), "-c", probe], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    venv = str(tmp_path / "venv")
    assert seen["file"].startswith(venv) and seen["envs"].startswith(venv), seen
    assert seen["api"] == sorted(__import__("rllib_exgrpo").__all__)
    assert not seen["top_level_envs"], "a top-level `envs` module is importable"
    assert str(REPO) not in seen["path"], seen["path"]  # (the dev environment may live in the checkout)

    recipe = work / RECIPE.name
    shutil.copy(RECIPE, recipe)
    small = {"questions_per_step": 4, "group_size": 4, "minibatch_size": 16, "max_response_tokens": 12, "heldout_num_questions": 8}
    storage = tmp_path / "results"
    proc = subprocess.run(
        [
            str(python.with_name("rllib")),
            "train",
            "file",
            str(recipe),
            "--stop",
            json.dumps({"training_iteration": 1}),
            "--config",
            json.dumps(small),
            "--storage-path",
            str(storage),
            "--ray-num-cpus",
            "2",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout[-4000:] + "\n--- stderr ---\n" + proc.stderr[-8000:]
    assert proc.returncode == 0, log
    trials = [p for p in (storage / "grpo-tiny").iterdir() if p.is_dir() and p.name.startswith("GRPO_")]
    assert len(trials) == 1, log
    rows = [json.loads(line) for line in (trials[0] / "result.json").read_text().splitlines() if line.strip()]
    assert rows and rows[-1]["training_iteration"] == 1, log
    # The package's modules ran from the installed copy, and the model came from the wheel.
    assert str(REPO / "rllib_exgrpo") not in proc.stdout + proc.stderr, log
    assert "copied the build shipped with the package" in proc.stdout + proc.stderr, log
    if env.get("RAY_AUTH_MODE", "").lower() != "disabled":
        assert "Token authentication is enabled" in proc.stdout + proc.stderr, log
