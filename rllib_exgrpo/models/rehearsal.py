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

The model keeps the recipe model's **vocabulary size and embedding tying**
(``"rehearsal:qwen2:vocab=152064,untied"``), so every vocabulary-sized buffer (logits,
log-prob chunks, the embedding and LM head, their gradients, optimizer state and weight
syncs) and the tied-weight paths run at their real width. The tokenizer is made to match:
its trained byte-level BPE keeps its ids, and the vocabulary is filled up to the model's
size with tokens ``<r{id}>`` that no merge produces (encoding never yields them; a random
model samples them, and they decode to their text).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from rllib_exgrpo.envs import arithmetic
from rllib_exgrpo.models.cache import build_cached, cache_root
from rllib_exgrpo.models.recipe import tiny_recipe
from rllib_exgrpo.models.tiny_tokenizer import check_tokenizer_stable, corpus_texts, merges_of, train_tokenizer, wrap_tokenizer

#: Prefix of a rehearsal model spec: ``"rehearsal:qwen2"``.
PREFIX = "rehearsal:"
#: Written last into a built folder: its presence marks a complete build.
MARKER = "rehearsal.json"
#: Bump when the build changes (the cache folder name carries it).
VERSION = 2

#: The tiny width of every rehearsal model. head_dim 32: vLLM's CPU attention needs a head
#: size in {32, 64, ...}; 2 key/value heads for 4 query heads keep grouped-query attention,
#: which every shipped recipe's model uses.
TINY_WIDTH: Dict[str, Any] = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    max_position_embeddings=2048,
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


def rehearsal_spec(family: str, vocab_size: Optional[int] = None, tied: Optional[bool] = None) -> str:
    """``"rehearsal:<family>"`` plus the vocabulary and tying to keep, where known."""
    options = ([f"vocab={int(vocab_size)}"] if vocab_size else []) + (["tied" if tied else "untied"] if tied is not None else [])
    return PREFIX + family + (":" + ",".join(options) if options else "")


def parse_rehearsal_spec(spec: str) -> Tuple[str, Optional[int], Optional[bool]]:
    """``(family, vocab_size or None, tied or None)`` of a rehearsal spec (None: the tiny
    tokenizer's vocabulary, untied)."""
    family, _, options = spec[len(PREFIX) :].strip().partition(":")
    vocab, tied = None, None
    for option in filter(None, (o.strip() for o in options.split(","))):
        if option in ("tied", "untied"):
            tied = option == "tied"
        elif option.startswith("vocab=") and option[6:].isdigit() and int(option[6:]) > 0:
            vocab = int(option[6:])
        else:
            raise ValueError(f"bad rehearsal model spec {spec!r}: unknown option {option!r} (expected vocab=<n>, tied or untied)")
    if not family:
        raise ValueError(f"bad rehearsal model spec {spec!r}: expected 'rehearsal:<model_type>', e.g. rehearsal:qwen2")
    return family, vocab, tied


def cache_name(spec: str) -> str:
    """The cache folder of a rehearsal spec."""
    family, vocab, tied = parse_rehearsal_spec(spec)
    parts = [family] + ([f"vocab{vocab}"] if vocab else []) + (["tied" if tied else "untied"] if tied is not None else [])
    return f"rehearsal-{'-'.join(parts)}-v{VERSION}"


def build_rehearsal_model(spec: str, cache_dir: Optional[str] = None) -> str:
    """The folder of ``"rehearsal:<model_type>[:vocab=<n>,tied|untied]"``, built on first use."""
    model_type, vocab, tied = parse_rehearsal_spec(spec)

    def builder(folder: Path) -> None:
        _build_into(folder, model_type, vocab, bool(tied))

    builder.marker = MARKER
    return str(build_cached(cache_root(cache_dir), cache_name(spec), builder))


def _filled_tokenizer(tokenizer, vocab_size: int):
    """``tokenizer`` with its vocabulary filled up to ``vocab_size`` ids by tokens no merge
    produces (``<r{id}>``), so a model of that vocabulary samples only ids it can decode;
    the ids of every text it encodes stay as they were."""
    vocab = dict(tokenizer.get_vocab())
    if vocab_size <= len(vocab):  # a recipe on the tiny model: its own tokenizer's size
        return tokenizer
    next_id = len(vocab)
    while next_id < vocab_size:
        filler = f"<r{next_id}>"
        if filler not in vocab:
            vocab[filler] = next_id
        next_id += 1
    return wrap_tokenizer(vocab, [tuple(m) for m in merges_of(tokenizer)])


def _build_into(folder: Path, model_type: str, vocab_size: Optional[int] = None, tied: bool = False) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    recipe = tiny_recipe()
    texts = corpus_texts(arithmetic.generate(2000, split="train", seed=0), recipe["instruction"])
    tokenizer = train_tokenizer(texts, **recipe["tokenizer"])
    if vocab_size:
        tokenizer = _filled_tokenizer(tokenizer, vocab_size)
    tokenizer.save_pretrained(str(folder))
    try:
        config = AutoConfig.for_model(
            model_type,
            vocab_size=max(vocab_size or 0, len(tokenizer)),
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=tied,
            use_cache=True,
            **TINY_WIDTH,
        )
    except ValueError as e:
        raise ValueError(f"rehearsal model: transformers knows no architecture {model_type!r} ({e})") from None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model.save_pretrained(str(folder), safe_serialization=True)
    # The folder's config decides how AutoTokenizer rebuilds the tokenizer: check the ids.
    check_tokenizer_stable(tokenizer, str(folder), texts[:100])
    report = {
        "model_type": model_type,
        "width": TINY_WIDTH,
        "n_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": tied,
        "tokenizer": f"the tiny model's BPE ({len(tokenizer)} ids, filled with <r{{id}}> tokens no merge makes)"
        if vocab_size
        else f"the tiny model's BPE ({len(tokenizer)} ids)",
        "weights": "random (torch.manual_seed(0)), never trained",
    }
    with open(folder / MARKER, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2)
