"""A causal LM's shape, and where it comes from, without loading (or downloading) weights.

:func:`model_shape` looks, in this order, at

1. a local model folder (``config.json``);
2. the embedded models (``tiny`` / ``tiny:...``, ``smollm2``, ``rehearsal:<type>``): their
   cached folder, **only if already built** (nothing is built here);
3. the local Hugging Face hub cache (``config.json`` of a hub id, no network);
4. :data:`PUBLISHED_SHAPES`: the published ``config.json`` values of the shipped recipes'
   models;

and returns ``None`` when none knows the model. ``ModelShape.source`` says which one
answered, and the memory plan prints it.

Parameter count (:attr:`ModelShape.num_parameters`) of the Qwen2 / Llama family, exactly::

    per layer  = h*a*d + 2*h*k*d + a*d*h            q, k, v, o projections
               + (a*d + 2*k*d) if q/k/v have biases (Qwen2 does; Llama has attention_bias)
               + 3*h*i                              gate, up, down
               + 2*h                                two RMSNorms
    total      = L * per layer + V*h (embedding) + h (final norm) + V*h if not tied (lm_head)

(h hidden size, a attention heads, k key/value heads, d head dim, i intermediate size,
L layers, V vocabulary). Qwen/Qwen2.5-Math-7B: 7,615,616,512; Qwen/Qwen2.5-Math-1.5B:
1,543,714,304 (tests/test_memory_plan.py checks both against a model built from the
shape).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from rllib_exgrpo.models import parse_tiny_spec, tiny_recipe
from rllib_exgrpo.models.cache import WARM_START_FILE
from rllib_exgrpo.models.recipe import recipe_key
from rllib_exgrpo.models.rehearsal import MARKER, cache_name
from rllib_exgrpo.models.smollm2 import EXPORT_MARKER

#: ``model_type`` values whose q/k/v projections carry a bias when the config does not say.
QKV_BIAS_BY_DEFAULT = ("qwen2",)


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on: the sizes of a Qwen2 / Llama-family causal LM."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    model_type: str = "qwen2"
    #: q/k/v biases; None: by ``model_type`` (Qwen2 has them, Llama not).
    attention_bias: Optional[bool] = None
    #: Where the shape came from (printed by the plan; not part of equality).
    source: str = field(default="", compare=False)

    @property
    def qkv_bias(self) -> bool:
        if self.attention_bias is not None:
            return bool(self.attention_bias)
        return self.model_type in QKV_BIAS_BY_DEFAULT

    @property
    def attention_width(self) -> int:
        """a * d: the width of q (and of k, v after repeating them to every head)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """k * d: the width of the k and v projections (and of the KV cache per layer)."""
        return self.num_key_value_heads * self.head_dim

    @property
    def layer_linear_parameters(self) -> int:
        """The weight matrices of one decoder layer (what autocast casts), without biases."""
        h, ad, kd, i = self.hidden_size, self.attention_width, self.kv_width, self.intermediate_size
        return h * ad + 2 * h * kd + ad * h + 3 * h * i

    @property
    def layer_parameters(self) -> int:
        h, ad, kd = self.hidden_size, self.attention_width, self.kv_width
        bias = (ad + 2 * kd) if self.qkv_bias else 0
        return self.layer_linear_parameters + bias + 2 * h

    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_parameters(self) -> int:
        """Exact for the Qwen2 / Llama family (see the module doc)."""
        head = 0 if self.tie_word_embeddings else self.embedding_parameters
        return self.num_hidden_layers * self.layer_parameters + self.embedding_parameters + self.hidden_size + head

    def lora_parameters(self, rank: int, target_modules: Any = "all-linear") -> int:
        """The adapter parameters of LoRA at ``rank`` on the decoder layers' linear layers:
        ``rank x (in + out)`` per targeted layer. ``target_modules``: "all-linear" (every
        linear layer but the output head) or a list of module names (q_proj, k_proj, v_proj,
        o_proj, gate_proj, up_proj, down_proj); names outside that list count nothing."""
        h, ad, kd, i = self.hidden_size, self.attention_width, self.kv_width, self.intermediate_size
        sizes = {
            "q_proj": h + ad,
            "k_proj": h + kd,
            "v_proj": h + kd,
            "o_proj": ad + h,
            "gate_proj": h + i,
            "up_proj": h + i,
            "down_proj": i + h,
        }
        names = list(sizes) if target_modules == "all-linear" else [str(n) for n in target_modules]
        per_layer = sum(sizes.get(n, 0) for n in names)
        return int(rank) * per_layer * self.num_hidden_layers

    @property
    def largest_module_parameters(self) -> int:
        """The parameters of the largest single module (DeepSpeed's ``largest_layer_params``
        of ZeRO-3: the embedding or lm_head for these models)."""
        h = self.hidden_size
        return max(self.embedding_parameters, h * self.intermediate_size, h * self.attention_width)

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token: 2 x layers x kv heads x head dim x bytes."""
        return 2 * self.num_hidden_layers * self.kv_width * dtype_bytes

    def with_source(self, source: str) -> "ModelShape":
        return dataclasses.replace(self, source=source)

    def describe(self) -> str:
        tied = "tied" if self.tie_word_embeddings else "untied"
        return (
            f"{self.model_type}: {self.num_parameters / 1e9:.2f} B parameters, hidden {self.hidden_size}, "
            f"{self.num_hidden_layers} layers, {self.num_attention_heads} heads / {self.num_key_value_heads} kv "
            f"x {self.head_dim}, intermediate {self.intermediate_size}, vocab {self.vocab_size} ({tied}), "
            f"max_position_embeddings {self.max_position_embeddings}"
        )

    @classmethod
    def from_hf_config(cls, cfg_or_dict: Any, source: str = "") -> "ModelShape":
        """From a transformers ``PretrainedConfig`` or a ``config.json`` dict (a nested
        ``text_config`` is used when the top level has no ``hidden_size``)."""
        if isinstance(cfg_or_dict, Mapping):
            get = cfg_or_dict.get
            text = cfg_or_dict.get("text_config")
        else:

            def get(key, default=None):
                return getattr(cfg_or_dict, key, default)

            text = getattr(cfg_or_dict, "text_config", None)
        if get("hidden_size") is None and text is not None:
            inner = cls.from_hf_config(text, source)
            model_type = get("model_type") or inner.model_type
            return dataclasses.replace(inner, model_type=str(model_type))
        h = int(get("hidden_size"))
        a = int(get("num_attention_heads"))
        kv = get("num_key_value_heads")
        head_dim = get("head_dim")
        bias = get("attention_bias")
        return cls(
            hidden_size=h,
            num_hidden_layers=int(get("num_hidden_layers")),
            num_attention_heads=a,
            num_key_value_heads=int(kv) if kv is not None else a,
            head_dim=int(head_dim) if head_dim else h // a,
            intermediate_size=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size")),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("max_position_embeddings") or 0),
            model_type=str(get("model_type") or "qwen2"),
            attention_bias=None if bias is None else bool(bias),
            source=source,
        )


def _published(source: str, **kw: Any) -> ModelShape:
    return ModelShape(**kw, source=source)


_QWEN25_MATH_7B = dict(
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=18944,
    vocab_size=152064,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    model_type="qwen2",
)

#: The published ``config.json`` values of the shipped recipes' models (used when the
#: model is neither a local folder nor in the local Hugging Face cache).
PUBLISHED_SHAPES: Dict[str, ModelShape] = {
    "Qwen/Qwen2.5-Math-7B": _published(
        "published config.json of Qwen/Qwen2.5-Math-7B (table in rllib_exgrpo/planning/shapes.py)", **_QWEN25_MATH_7B
    ),
    "Qwen/Qwen2.5-Math-1.5B": _published(
        "published config.json of Qwen/Qwen2.5-Math-1.5B (table in rllib_exgrpo/planning/shapes.py)",
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        model_type="qwen2",
    ),
    # Qwen2.5-Math-7B with its context extended to 16k (LUFFY / ExGRPO README: rope theta
    # raised and the window extended to 16k): the same layers, a longer context.
    "Elliott/Qwen2.5-Math-7B-16k-think": _published(
        "published shape of Elliott/Qwen2.5-Math-7B-16k-think: Qwen2.5-Math-7B's with a 16k context "
        "(table in rllib_exgrpo/planning/shapes.py)",
        **dict(_QWEN25_MATH_7B, max_position_embeddings=16384),
    ),
    "HuggingFaceTB/SmolLM2-135M-Instruct": _published(
        "published config.json of HuggingFaceTB/SmolLM2-135M-Instruct (table in rllib_exgrpo/planning/shapes.py)",
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        model_type="llama",
    ),
}

_SMOLLM2_NAMES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")


def read_config_json(folder: os.PathLike) -> Optional[Dict[str, Any]]:
    try:
        with open(Path(folder) / "config.json", encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _from_folder(folder: os.PathLike, source: str) -> Optional[ModelShape]:
    data = read_config_json(folder)
    if data is None:
        return None
    try:
        return ModelShape.from_hf_config(data, source)
    except (TypeError, ValueError):
        return None


def embedded_model_folder(name: str, cache_dir: Optional[str] = None) -> Optional[Path]:
    """The cached folder of an embedded model name if it is already built, else None
    (never builds). ``None`` too for names that are not embedded models."""
    name = name.strip()
    try:
        # lazy: the models package needs torch; the plan runs without it
        from rllib_exgrpo.models import cache_root
    except Exception:  # noqa: BLE001 - the models package needs torch
        return None
    root = cache_root(cache_dir)
    if name == "tiny" or name.startswith("tiny:"):
        try:
            folder = root / f"tiny-{recipe_key(tiny_recipe(**parse_tiny_spec(name)))}"
        except (TypeError, ValueError):
            return None
        return folder if (folder / WARM_START_FILE).is_file() else None
    if name.lower() in _SMOLLM2_NAMES:
        built = sorted(p.parent for p in root.glob(f"smollm2-135m-instruct-*/{EXPORT_MARKER}"))
        return built[0] if built else None
    if name.startswith("rehearsal:"):
        try:
            folder = root / cache_name(name)
        except ValueError:
            return None
        return folder if (folder / MARKER).is_file() else None
    return None


def _is_embedded(name: str) -> bool:
    return name == "tiny" or name.startswith(("tiny:", "rehearsal:")) or name.lower() in _SMOLLM2_NAMES


def _hub_cache_folder(name: str) -> Optional[str]:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - not a hub id, or no hub library
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


def model_shape(name_or_path: str, *, cache_dir: Optional[str] = None) -> Optional[ModelShape]:
    """The shape of a policy model, or None (see the module doc for the order)."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        return None
    name = name_or_path.strip()
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        return _from_folder(path, f"config.json in {path}")
    if _is_embedded(name):
        folder = embedded_model_folder(name, cache_dir)
        if folder is not None:
            return _from_folder(folder, f"config.json of the built {name!r} in {folder}")
        if name.lower() in _SMOLLM2_NAMES:
            shape = PUBLISHED_SHAPES["HuggingFaceTB/SmolLM2-135M-Instruct"]
            return shape.with_source(shape.source + f"; {name!r} is not exported yet")
        return None
    cached = _hub_cache_folder(name)
    if cached:
        shape = _from_folder(cached, f"config.json of {name} in the local Hugging Face cache")
        if shape is not None:
            return shape
    return PUBLISHED_SHAPES.get(name)
