"""Stand-in models for rehearsing a recipe on a CPU: random weights, real architecture.

``rllib train file X.yaml --rehearse`` runs a GPU recipe as written on a CPU machine; the
one thing a CPU cannot hold is the recipe's 1.5B-8B model, and the hub it comes from is
not reachable. The model is therefore swapped for ``"rehearsal:<model_type>"``: a randomly
initialised model of the *same transformers architecture family* (``qwen2``, ``llama``,
...) at tiny width, so that every code path that depends on the architecture (module
classes, attention implementation, GQA, tied or untied embeddings, weight names that the
vLLM backend maps, DeepSpeed's partitioning) runs as on the GPU, with the embedded tiny
model's byte-level BPE tokenizer and chat template. Built once per family and cached
(same cache and locking as the tiny model), in about a second.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, Optional

#: Prefix of a rehearsal model spec: ``"rehearsal:qwen2"``.
PREFIX = "rehearsal:"
#: Written last into a built folder: its presence marks a complete build.
MARKER = "rehearsal.json"
#: Bump when the build changes (the cache folder name carries it).
VERSION = 1

#: The tiny width of every rehearsal model. head_dim 32: vLLM's CPU attention needs a head
#: size in {32, 64, ...}; 2 key/value heads for 4 query heads keep grouped-query attention,
#: which every shipped recipe's model uses.
TINY_WIDTH: Dict[str, Any] = dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    intermediate_size=256, max_position_embeddings=2048,
)

#: Architecture family of model names that are known without reading their config:
#: the embedded models and the shipped recipes' hub models (their config.json says so).
KNOWN_FAMILIES = (
    (re.compile(r"^tiny(:|$)"), "qwen2"),
    (re.compile(r"^smollm2", re.I), "llama"),
    (re.compile(r"qwen2(\.5)?", re.I), "qwen2"),
    (re.compile(r"qwen3", re.I), "qwen3"),
    (re.compile(r"llama|smollm", re.I), "llama"),
    (re.compile(r"mistral", re.I), "mistral"),
)


def is_rehearsal_spec(name: str) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def architecture_family(model: str) -> tuple[str, str]:
    """``(model_type, where it came from)`` of a model name or folder, offline.

    A local folder's ``config.json`` wins; else the name is matched against
    :data:`KNOWN_FAMILIES`; else ``qwen2`` (said so in the second element)."""
    config = Path(str(model)) / "config.json"
    if config.is_file():
        with open(config, encoding="utf-8") as fh:
            model_type = json.load(fh).get("model_type")
        if model_type:
            return model_type, f"{config}"
    for pattern, family in KNOWN_FAMILIES:
        if pattern.search(str(model)):
            return family, "its name"
    return "qwen2", "unknown offline; qwen2 assumed"


def build_rehearsal_model(spec: str, cache_dir: Optional[str] = None) -> str:
    """The folder of ``"rehearsal:<model_type>"``, built on first use."""
    from rllib_exgrpo.models.tiny import build_cached, cache_root

    model_type = spec[len(PREFIX):].strip()
    if not model_type:
        raise ValueError(f"bad rehearsal model spec {spec!r}: expected 'rehearsal:<model_type>', e.g. rehearsal:qwen2")

    def builder(folder: Path) -> None:
        _build_into(folder, model_type)

    builder.marker = MARKER
    return str(build_cached(cache_root(cache_dir), f"rehearsal-{model_type}-v{VERSION}", builder))


def _build_into(folder: Path, model_type: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from envs import arithmetic
    from rllib_exgrpo.models.tiny import check_tokenizer_stable, corpus_texts, tiny_recipe, train_tokenizer

    recipe = tiny_recipe()
    texts = corpus_texts(arithmetic.generate(2000, split="train", seed=0), recipe["instruction"])
    tokenizer = train_tokenizer(texts, **recipe["tokenizer"])
    tokenizer.save_pretrained(str(folder))
    try:
        config = AutoConfig.for_model(
            model_type, vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, use_cache=True, **TINY_WIDTH,
        )
    except ValueError as e:
        raise ValueError(f"rehearsal model: transformers knows no architecture {model_type!r} ({e})") from None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    model.save_pretrained(str(folder), safe_serialization=True)
    # The folder's config decides how AutoTokenizer rebuilds the tokenizer: check the ids.
    check_tokenizer_stable(tokenizer, str(folder), texts[:100])
    report = {
        "model_type": model_type,
        "width": TINY_WIDTH,
        "n_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "weights": "random (torch.manual_seed(0)), never trained",
    }
    with open(folder / MARKER, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2)
