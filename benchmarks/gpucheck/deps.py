"""Optional dependencies: which are here, and carried wheels installed before the stages."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

#: The stages' optional packages (none is needed by the check itself).
OPTIONAL = ("vllm", "deepspeed", "flash_attn", "ray")


def have(module: str) -> bool:
    """Whether ``module`` can be found here (not imported: vLLM and Ray are slow to import)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def present() -> dict:
    return {m: have(m) for m in OPTIONAL}


def install_wheels(folder: Path) -> dict:
    """``pip install --no-deps --no-index`` every wheel in ``folder`` (built by
    benchmarks/prepare_gpu_wheels.sh), into this interpreter; what it did, in one dict."""
    wheels = sorted(str(p) for p in Path(folder).glob("*.whl"))
    if not wheels:
        return {"status": "failed", "error": f"no wheels in {folder}"}
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--disable-pip-version-check", *wheels]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    importlib.invalidate_caches()
    out = {"wheels": [Path(w).name for w in wheels], "returncode": proc.returncode}
    if proc.returncode != 0:
        out.update(status="failed", error=(proc.stderr or proc.stdout).strip().splitlines()[-1:])
    else:
        out["status"] = "installed"
    return out
