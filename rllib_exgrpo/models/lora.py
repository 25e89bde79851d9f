"""LoRA adapters on a learner's policy (peft), and the merged weights the samplers get.

A learner's model with ``lora_rank > 0`` is wrapped by peft's ``get_peft_model``: every
targeted linear layer keeps its weight ``W`` frozen (``<layer>.base_layer.weight``) and
gains two trainable matrices ``A`` (``r x in``) and ``B`` (``out x r``, zero at the start),
its output ``W x + (alpha / r) B A x``. The HF model object itself is changed in place
(the LoRA layers replace the targeted ``nn.Linear``\\ s), so the decoder / LM-head split of
the scoring pass works on it unchanged.

The samplers (env runners, vLLM) run the plain model. What they get is the merged weight
``W + (alpha / r) B A`` of each targeted layer under the plain layer's name, computed into a
new tensor (peft's ``get_delta_weight``): the learner's ``W`` is never merged and unmerged in
place, so it does not drift by rounding over many syncs.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Union

import torch

#: What ``lora_target_modules`` may name besides a list of module names: peft's shorthand
#: for every linear layer but the output head.
ALL_LINEAR = "all-linear"
#: The one adapter this project trains (peft's default name).
ADAPTER = "default"
_BASE = ".base_layer."


def settings(model_config: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The ``lora`` entry of a module's ``model_config`` when it asks for adapters (rank > 0)."""
    lora = model_config.get("lora") or {}
    return dict(lora) if int(lora.get("rank") or 0) > 0 else None


def wrap(model: torch.nn.Module, lora: Mapping[str, Any], checkpointing: bool = False):
    """``model`` with LoRA adapters injected in place (only the adapters require grad);
    returns peft's wrapper, whose ``disable_adapter()`` runs the base model.
    ``checkpointing``: the model recomputes activations in backward."""
    from peft import LoraConfig, get_peft_model

    target = lora.get("target_modules", ALL_LINEAR)
    config = LoraConfig(
        r=int(lora["rank"]),
        lora_alpha=float(lora.get("alpha", 32)),
        lora_dropout=float(lora.get("dropout", 0.0)),
        target_modules=target if isinstance(target, str) else list(target),
        bias="none",
        task_type="CAUSAL_LM",
    )
    if checkpointing:
        # Frozen embeddings give the checkpointed blocks inputs without grad: the adapters
        # inside would get none.
        model.enable_input_require_grads()
    return get_peft_model(model, config)


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict key is an adapter tensor (absent from the plain model)."""
    return ".lora_" in name


def plain_name(name: str) -> str:
    """The plain model's name of a wrapped model's state-dict key."""
    return name.replace(_BASE, ".")


class MergedWeight:
    """The merged weight of one LoRA layer, computed when called (a new tensor; the layer's
    base weight is left as it is). ``shape`` / ``dtype`` are the base weight's."""

    def __init__(self, layer):
        self.layer = layer
        base = layer.get_base_layer().weight
        self.shape, self.dtype = base.shape, base.dtype

    def is_floating_point(self) -> bool:
        return True

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        base = self.layer.get_base_layer().weight.detach()
        merged = base.clone()
        for adapter in self.layer.active_adapters:
            if adapter in self.layer.lora_A and not self.layer.disable_adapters:
                merged += self.layer.get_delta_weight(adapter).to(base.dtype)
        return merged


Value = Union[torch.Tensor, MergedWeight]


def plain_tensors(model: torch.nn.Module, prefix: str = "") -> Dict[str, Value]:
    """The plain model's state of a wrapped ``model`` (no adapter keys, plain names): the
    live tensors, and a :class:`MergedWeight` for each targeted layer's weight."""
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    out: Dict[str, Value] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if is_adapter_key(name):
            continue
        owner, _, rest = name.partition(_BASE)
        if rest == "weight" and owner in layers:
            out[prefix + plain_name(name)] = MergedWeight(layers[owner])
        else:
            out[prefix + plain_name(name)] = tensor
    return out


def resolve(value: Value) -> torch.Tensor:
    """A tensor of :func:`plain_tensors` (merged where it is a :class:`MergedWeight`)."""
    return value() if isinstance(value, MergedWeight) else value
