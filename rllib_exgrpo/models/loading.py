"""Loading a policy network: any Hugging Face causal LM, or the embedded ones by name."""

from __future__ import annotations

import contextlib
from typing import Any, Dict

import torch

from rllib_exgrpo.core.attention import register_kernels, resolve_attn_implementation
from rllib_exgrpo.models import resolve_model_path

#: ``model_dtype`` values and their torch dtypes.
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def load_causal_lm(model_config: Dict[str, Any]):
    """Load the HF causal LM described by a module ``model_config`` dict.

    Keys: ``model`` (hub name, local path, or ``"tiny"`` / ``"smollm2"`` for the embedded
    models), ``dtype``, ``gradient_checkpointing``, ``attn_implementation`` (default and
    ``"auto"``: :func:`rllib_exgrpo.core.attention.resolve_attn_implementation`).
    """
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model_config["model"])
    kwargs = {"dtype": resolve_dtype(model_config.get("dtype", "float32"))}
    # "auto" is resolved here, in the process that runs the model: a learner on a GPU and
    # an env runner on a CPU may get different kernels.
    register_kernels()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    kwargs["attn_implementation"] = resolve_attn_implementation(model_config.get("attn_implementation") or "auto", device_type)
    with no_progress_bars():  # a bar per load would be a log line per actor
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if model_config.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


MODEL_DTYPES = tuple(_DTYPES)


def load_tokenizer(model: str):
    """The tokenizer that belongs to the policy ``model`` (resolved like the module)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(model))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def model_config_of(model: str):
    """The HF config of the policy ``model`` (no weights loaded)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_path(model))


def generation_config_holder(model: str):
    """An object with the ``generation_config`` a loaded model of ``model`` would have
    (its ``generation_config.json``, else derived from its config), for code that reads
    it off a model (stop tokens) where no torch model is built."""
    import types

    from transformers import GenerationConfig

    path = resolve_model_path(model)
    try:
        gen = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json
        gen = GenerationConfig.from_model_config(model_config_of(model))
    return types.SimpleNamespace(generation_config=gen)


def parameter_names(model: str):
    """The state-dict names of the HF model ``model``, from a model built on the meta
    device (no memory, no weights read)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(model_config_of(model))
    return list(built.state_dict().keys())


@contextlib.contextmanager
def no_progress_bars():
    """transformers' progress bars off inside the block (loading and saving print none)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
