"""A model's plain weights in per-layer buckets, for pushing them into a sampler.

A colocated learner hands its weights to the sampler on the same device (a vLLM engine, or
the HF runner's own copy under ZeRO-3) one decoder layer at a time instead of as one state
dict:

* under ZeRO-3 each parameter is a 1/N partition; a bucket names the parameters to gather
  (DeepSpeed's ``GatheredParameters``, a collective every rank enters in the same order)
  before its tensors are read, so no rank holds more than one layer gathered;
* a LoRA layer's merged weight ``W + (alpha / r) B A`` is computed per layer, so the merged
  copies of a 7B model (~13 GiB in bf16) never exist at once;
* a bucket is a whole decoder layer (``...layers.<i>``): vLLM's in-place reload processes
  each of its own layers (a fused q/k/v projection, say) once every tensor of it has
  arrived, so with whole decoder layers in order it finishes a layer within its bucket and
  holds at most one layer's tensors waiting. Everything outside the decoder layers
  (embeddings, final norm, output head) is one last bucket. The sampler hands all buckets
  to one load per turn (``generation/vllm.py``: ``push_weight_buckets``).

A bucket is ``(params, read)``: ``params`` the parameters to gather first, ``read()`` its
tensors under the plain model's names (a LoRA layer's base weight merged, adapter tensors
left out). The tensors ``read`` returns are only valid while the bucket is gathered: copy
them inside it (or have the engine clone them as they go in: ``push_weight_buckets(copy=True)``).
"""

from __future__ import annotations

import re
from typing import Callable, Dict, Iterator, List, Tuple

import torch

from rllib_exgrpo.models import lora

Bucket = Tuple[List[torch.nn.Parameter], Callable[[], Dict[str, torch.Tensor]]]

#: A decoder layer's prefix in a state-dict key (``model.layers.3.``, peft's
#: ``base_model.model.model.layers.3.``).
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def _lora_layers(model: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft installed: no LoRA layer can exist
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def _lora_owner(key: str, lora_layers: Dict[str, torch.nn.Module]):
    """The LoRA layer whose base weight ``key`` is, else None."""
    if not key.endswith(lora._BASE + "weight"):
        return None
    return lora_layers.get(key[: -len(lora._BASE + "weight")])


def bucket_name(key: str) -> str:
    """The bucket of a state-dict key: its decoder layer's prefix, or ``""`` for the rest."""
    match = _LAYER.match(key)
    return match.group(1) if match else ""


def layer_buckets(named: Dict[str, torch.Tensor]) -> Iterator[Dict[str, torch.Tensor]]:
    """Tensors already at hand (an env runner's state dict) in the same buckets as
    :func:`plain_weight_buckets`: the decoder layers in order, then the rest."""
    groups: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in named.items():
        groups.setdefault(bucket_name(key), {})[key] = value
    rest = groups.pop("", None)
    yield from groups.values()
    if rest:
        yield rest


def plain_weight_buckets(model: torch.nn.Module) -> Iterator[Bucket]:
    """``model``'s state in buckets (module doc): the decoder layers in order, then the rest;
    every plain key once."""
    lora_layers = _lora_layers(model)
    state = model.state_dict(keep_vars=True)
    keys_of: Dict[str, List[str]] = {}
    for key in state:
        if not lora.is_adapter_key(key):
            keys_of.setdefault(bucket_name(key), []).append(key)
    params_of: Dict[str, List[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():  # adapters included: a merge reads them
        params_of.setdefault(bucket_name(name + "."), []).append(param)
    rest = keys_of.pop("", [])
    order = list(keys_of) + ([""] if rest else [])
    keys_of[""] = rest
    for bucket in order:
        keys = keys_of[bucket]

        def read(keys=keys) -> Dict[str, torch.Tensor]:
            out = {}
            for key in keys:
                layer = _lora_owner(key, lora_layers)
                out[lora.plain_name(key)] = lora.MergedWeight(layer)() if layer is not None else state[key].detach()
            return out

        yield params_of.get(bucket, []), read
