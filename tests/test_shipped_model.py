"""The default tiny model shipped with the package (rllib_exgrpo/models/shipped.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rllib_exgrpo.models import build_tiny_model, read_warm_start, shipped, shipped_cli
from rllib_exgrpo.models.cache import WARM_START_FILE
from rllib_exgrpo.models.recipe import recipe_key, tiny_recipe
from rllib_exgrpo.warm_start import build as ws_build

DEFAULT_NAME = f"tiny-{recipe_key(tiny_recipe())}"


@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if anything starts a build (the pinned child or the build itself)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a build was launched")

    monkeypatch.setattr("rllib_exgrpo.models.pinned_build.build_in_pinned_process", refuse)
    monkeypatch.setattr(ws_build, "build_into", refuse)
    monkeypatch.delenv(shipped.REBUILD_ENV_VAR, raising=False)


@pytest.fixture
def fake_build(monkeypatch):
    """Replace the pinned build by one that writes a small complete folder; returns its calls."""
    calls = []

    def build(folder, recipe, progress):
        calls.append(Path(folder))
        (Path(folder) / "model.safetensors").write_bytes(b"built from the recipe")
        (Path(folder) / WARM_START_FILE).write_text("{}")

    monkeypatch.setattr("rllib_exgrpo.models.pinned_build.build_in_pinned_process", build)
    return calls


def test_the_default_recipe_is_shipped_and_its_files_match_the_record():
    """The shipped folder is the default recipe's, and each of its files has its recorded
    sha256 (a recipe change that moves the default key must ship a new build)."""
    folder = shipped.shipped_folder(DEFAULT_NAME)
    assert folder is not None, f"no shipped folder for the default recipe {DEFAULT_NAME}"
    shipped.verify(folder, DEFAULT_NAME)
    assert set(shipped.SHIPPED[DEFAULT_NAME]) >= {"model.safetensors", "tokenizer.json", "config.json", WARM_START_FILE}
    report = read_warm_start(str(folder))
    assert report["recipe"] == tiny_recipe()
    assert report["recipe_key"] == DEFAULT_NAME[len("tiny-") :]
    assert report["reached_target"] and report["cpu_capability"] == "AVX2"
    assert shipped_cli.main(["check"]) == 0


def test_a_fresh_cache_gets_the_shipped_model_without_a_build(tmp_path, no_build, capsys):
    path = Path(build_tiny_model(str(tmp_path / "cache"), progress=False))
    assert path == (tmp_path / "cache" / DEFAULT_NAME).resolve()
    assert shipped.file_digests(path) == shipped.SHIPPED[DEFAULT_NAME]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]
    lines = [line for line in capsys.readouterr().err.splitlines() if "shipped" in line]
    assert len(lines) == 1 and DEFAULT_NAME in lines[0] and "sha256 verified" in lines[0]
    # The second call finds the folder in the cache: nothing copied, nothing printed.
    assert Path(build_tiny_model(str(tmp_path / "cache"), progress=False)) == path
    assert "shipped" not in capsys.readouterr().err
    # It loads as the policy (the main job's model spec) and holds the shipped weights.
    from rllib_exgrpo.models import load_tiny_model

    model, tok = load_tiny_model(str(path))
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tok)


def test_a_tampered_shipped_file_is_detected_and_the_model_built_instead(tmp_path, monkeypatch, fake_build):
    prebuilt = tmp_path / "prebuilt"
    shutil.copytree(shipped.PREBUILT_DIR / DEFAULT_NAME, prebuilt / DEFAULT_NAME)
    weights = prebuilt / DEFAULT_NAME / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(shipped, "PREBUILT_DIR", prebuilt)
    monkeypatch.delenv(shipped.REBUILD_ENV_VAR, raising=False)

    with pytest.raises(shipped.ShippedModelMismatch, match=r"model\.safetensors sha256"):
        shipped.verify(prebuilt / DEFAULT_NAME, DEFAULT_NAME)
    with pytest.warns(RuntimeWarning, match=r"model\.safetensors sha256.*building the model from its recipe"):
        path = Path(build_tiny_model(str(tmp_path / "cache"), progress=False))
    assert len(fake_build) == 1
    # the cache holds the build, nothing of the tampered copy
    assert sorted(os.listdir(path)) == ["model.safetensors", WARM_START_FILE]
    assert (path / "model.safetensors").read_bytes() == b"built from the recipe"


def test_a_missing_or_extra_shipped_file_is_detected(tmp_path):
    copy = tmp_path / DEFAULT_NAME
    shutil.copytree(shipped.PREBUILT_DIR / DEFAULT_NAME, copy)
    (copy / "tokenizer.json").unlink()
    (copy / "extra.bin").write_bytes(b"x")
    with pytest.raises(shipped.ShippedModelMismatch, match="tokenizer.json missing; extra.bin not in the record"):
        shipped.verify(copy, DEFAULT_NAME)


def test_the_rebuild_switch_builds_instead_of_copying(tmp_path, monkeypatch, fake_build, capsys):
    monkeypatch.setenv(shipped.REBUILD_ENV_VAR, "1")
    path = Path(build_tiny_model(str(tmp_path / "cache"), progress=False))
    assert len(fake_build) == 1 and (path / "model.safetensors").read_bytes() == b"built from the recipe"
    assert "shipped" not in capsys.readouterr().err


def test_other_recipes_are_built(tmp_path, fake_build):
    path = Path(build_tiny_model(str(tmp_path / "cache"), seed=1, progress=False))
    assert len(fake_build) == 1 and path.name != DEFAULT_NAME


def test_the_package_data_carries_the_shipped_folder():
    """setup.py installs the shipped files (a wheel without them would build on first use)."""
    import ast

    setup_py = Path(__file__).resolve().parents[1] / "setup.py"
    tree = ast.parse(setup_py.read_text())
    package_data = next(
        kw.value for node in ast.walk(tree) if isinstance(node, ast.Call) for kw in node.keywords if kw.arg == "package_data"
    )
    patterns = ast.literal_eval(package_data)["rllib_exgrpo"]
    root = Path(shipped.__file__).resolve().parents[1]
    matched = {p.relative_to(root) for pattern in patterns for p in root.glob(pattern) if p.is_file()}
    for file in shipped.SHIPPED[DEFAULT_NAME]:
        assert Path("models/prebuilt") / DEFAULT_NAME / file in matched


def test_the_rebuild_command_compares_the_built_weights_with_the_shipped_ones(tmp_path, monkeypatch, capsys):
    """``python -m rllib_exgrpo.models.shipped_cli rebuild`` (here with a stand-in for the build):
    exit status 0 when the built weights are the shipped ones, 1 when they differ."""

    def copy_build(folder, recipe, progress):
        for file in shipped.SHIPPED[DEFAULT_NAME]:
            shutil.copyfile(shipped.PREBUILT_DIR / DEFAULT_NAME / file, Path(folder) / file)

    monkeypatch.setattr("rllib_exgrpo.models.pinned_build.build_in_pinned_process", copy_build)
    monkeypatch.delenv(shipped.REBUILD_ENV_VAR, raising=False)
    assert shipped_cli.main(["rebuild", "--cache", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "model.safetensors: same" in out and "equal the shipped ones" in out

    def other_build(folder, recipe, progress):
        copy_build(folder, recipe, progress)
        (Path(folder) / "model.safetensors").write_bytes(b"other weights")

    monkeypatch.setattr("rllib_exgrpo.models.pinned_build.build_in_pinned_process", other_build)
    assert shipped_cli.main(["rebuild", "--cache", str(tmp_path / "b")]) == 1
    assert "model.safetensors: DIFFERENT" in capsys.readouterr().out
    assert shipped.REBUILD_ENV_VAR not in os.environ  # the switch is the command's own


@pytest.mark.skipif(
    os.environ.get("RLLIB_EXGRPO_TEST_REBUILD") != "1",
    reason="builds the default recipe from scratch (5-25 min on 2 cores): RLLIB_EXGRPO_TEST_REBUILD=1 runs it",
)
def test_a_rebuild_gives_the_shipped_weights(tmp_path):
    """The pinned build of the default recipe equals the shipped weights on an AVX2 machine."""
    assert shipped_cli.main(["rebuild", "--cache", str(tmp_path / "cache")]) == 0


def test_every_tiny_model_a_shipped_recipe_names_is_shipped(tmp_path, no_build):
    """A tuned example that names a tiny model (``tiny``, ``tiny:task=operators,...``) starts
    in seconds on a fresh machine: its build ships with the package, sha256-checked, and
    resolving it copies instead of building."""
    import yaml

    from rllib_exgrpo.models import parse_tiny_spec, resolve_model_path

    root = Path(__file__).resolve().parents[1] / "tuned_examples"
    specs = set()
    for file in sorted(root.glob("*.yaml")):
        for spec in yaml.safe_load(file.read_text()).values():
            model = str(spec.get("config", {}).get("model_name_or_path", ""))
            if model == "tiny" or model.startswith("tiny:"):
                specs.add(model)
    assert "tiny" in specs and any("task=operators" in s for s in specs)
    for spec in sorted(specs):
        kwargs = parse_tiny_spec(spec)
        name = f"tiny-{recipe_key(tiny_recipe(**{k: v for k, v in kwargs.items()}))}"
        assert name in shipped.SHIPPED and shipped.shipped_folder(name) is not None, f"{spec} ({name}) is not shipped"
        path = Path(resolve_model_path(spec, cache_dir=str(tmp_path / "cache"), progress=False))
        assert path.name == name and shipped.file_digests(path) == shipped.SHIPPED[name]
