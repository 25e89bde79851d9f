"""The LLM policy as an RLlib ``TorchRLModule``: any Hugging Face causal LM.

The module owns the network weights, so RLlib's learners optimise it and RLlib's weight
sync ships it to the env runners. Generation itself is done by a generation backend
(``rllib_exgrpo.generation``) that reads this module's model; the module's job is the
*scoring* pass every algorithm needs: per-token log-probs and entropies of completion
tokens given prompt + completion.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional

import torch

from ray.rllib.utils.annotations import override
from ray.rllib.core.rl_module.rl_module import RLModule
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis import InferenceOnlyAPI
from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.scoring import score_learner_batch
from rllib_exgrpo.core.tokens import position_ids_from_mask
from rllib_exgrpo.models import lora
from rllib_exgrpo.models.loading import load_causal_lm, resolve_dtype
from rllib_exgrpo.rllib import zero3_weights


def _as_tensor(value) -> torch.Tensor:
    """A module-state value as a tensor of its own dtype, without a copy where possible."""
    if torch.is_tensor(value):
        return value.detach()
    import warnings

    import numpy as np

    arr = np.asarray(value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only (object store) arrays
        return torch.from_numpy(arr) if arr.dtype.kind in "biufc" else torch.as_tensor(arr)


def _bf16_from_bits(bits) -> torch.Tensor:
    """A bfloat16 tensor over the 16-bit integers ``bits`` (numpy), without a copy: what a
    :class:`ShippedBF16` becomes when unpickled. Out of Ray's object store ``bits`` is a
    read-only view of shared memory, so the tensor is too: it is read (``load_state_dict``,
    the engine's loader), never written in place."""
    import warnings

    with warnings.catch_warnings():
        # torch.from_numpy warns once about non-writable arrays (Ray's zero-copy buffers).
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(bits)
    return t.view(torch.bfloat16).as_subclass(ShippedBF16)


class ShippedBF16(torch.Tensor):
    """A bfloat16 CPU tensor of a module state that pickles as a numpy ``int16`` array of
    the same bits (2 bytes a parameter).

    numpy arrays travel through Ray's object store out of band: the receiver's tensor is a
    view of the object store's shared memory, not a copy, and re-putting it (the driver
    forwards a learner's state to the env runners) stays zero-copy. A plain torch tensor
    pickles through a ``bytes`` copy of its storage instead, twice (``bytes``, then a new
    storage) on the way in. Everything else about it is a plain bfloat16 tensor
    (``load_state_dict``, ``set_state``, checkpoints written with pickle read it back as
    one). Operations on it return plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __reduce_ex__(self, protocol):
        plain = self.as_subclass(torch.Tensor)
        if plain.dtype != torch.bfloat16 or plain.device.type != "cpu" or not plain.is_contiguous():
            return plain.__reduce_ex__(protocol)
        return _bf16_from_bits, (plain.view(torch.int16).numpy(),)

    def __deepcopy__(self, memo):
        return self.as_subclass(torch.Tensor).clone().as_subclass(ShippedBF16)


def shippable(tensor: torch.Tensor, dtype: Optional[torch.dtype] = None):
    """One module-state value as it leaves a process (weight sync, checkpoint): a CPU numpy
    array where numpy has the dtype, else (bfloat16) a :class:`ShippedBF16` CPU tensor.

    RLlib's ``TorchRLModule.get_state`` calls ``.numpy()`` on every tensor, which raises on
    bfloat16; converting to float32 instead would double the bytes of every sync and
    checkpoint. ``TorchRLModule.set_state`` (``convert_to_torch_tensor``) and
    ``load_state_dict`` take both forms. ``dtype`` casts first (a fp32 master copy shipped
    in the compute dtype)."""
    # A copy, never a view of live parameters: a state is a snapshot (RLlib's own
    # conversion copies too), and a CPU tensor's .numpy() would share its memory.
    t = tensor.detach().to("cpu", dtype=dtype or tensor.dtype, copy=True)
    return t.as_subclass(ShippedBF16) if t.dtype == torch.bfloat16 else t.numpy()


class LLMTorchRLModule(TorchRLModule):
    """RLModule wrapping a Hugging Face causal LM.

    ``model_config`` keys (all from ``ExGRPOConfig.model_config`` via the module spec):
        model: model name/path (``"tiny"`` builds the embedded warm-started model).
        dtype: ``"float32"`` | ``"bfloat16"`` | ``"float16"``: the dtype the model computes in.
        master_dtype: where set (``"float32"``) and this is a learner's module (not
            ``inference_only``), the weights are kept in this dtype and the forward runs under
            ``torch.autocast`` in ``dtype``: mixed precision, as the DDP learner needs it (an
            AdamW step at lr 1e-6 rounds away on most bf16 weights). Env runners, which only
            sample, build the model in ``dtype``.
        gradient_checkpointing: trade compute for activation memory in the learner.
        attn_implementation: the attention kernel (``core/attention.py``; "auto" resolves
            per process: flash-attention 2 on CUDA where installed, else "sdpa_varlen").
        logit_chunk_tokens: positions per chunk of the vocabulary-sized scoring.
        temperature: sampling temperature; log-probs are computed at this temperature
            so that importance ratios compare like with like.
    """

    @override(RLModule)
    def setup(self):
        model_config = dict(self.model_config)
        #: The autocast dtype when the weights are a higher-precision master copy, else None.
        self.compute_dtype: Optional[torch.dtype] = None
        master = model_config.get("master_dtype")
        lora_settings = lora.settings(model_config)
        if master and not self.inference_only and master != model_config.get("dtype", "float32"):
            self.compute_dtype = resolve_dtype(model_config.get("dtype", "float32"))
            if not lora_settings:
                model_config["dtype"] = master
            # A LoRA learner's base is frozen: a master copy would only double its bytes, so
            # it stays in the compute dtype; the adapters are fp32 (peft casts bf16/fp16
            # adapters up) and autocast mixes the two.
        self.model = load_causal_lm(model_config)
        #: peft's wrapper of ``self.model`` on a LoRA learner (``models/lora.py``), else None.
        #: Kept out of the module's registry: ``self.model`` is the same network (its LoRA
        #: layers injected in place), so the state keeps the HF model's names.
        self.__dict__["lora_model"] = None
        if lora_settings and not self.inference_only:
            self.__dict__["lora_model"] = lora.wrap(self.model, lora_settings, bool(model_config.get("gradient_checkpointing")))
        self.temperature = float(self.model_config.get("temperature", 1.0))
        #: Positions per chunk of the vocabulary-sized scoring (core/chunked_logprobs.py).
        self.logit_chunk_tokens = self.model_config.get("logit_chunk_tokens")

    def autocast(self):
        """Mixed precision around a forward (a no-op without a master copy)."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        device = next(self.model.parameters()).device
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    @override(TorchRLModule)
    def get_state(self, components=None, *, not_components=None, inference_only: bool = False, **kwargs):
        """The weights, bf16 kept as bf16 (:func:`shippable`). For the env runners
        (``inference_only``) a master copy is cast to the compute dtype: they sample in it,
        and it halves the bytes of every weight sync; checkpoints keep the master copy."""
        state = self.inference_tensors() if inference_only else self.state_dict()
        if inference_only and not self.inference_only and isinstance(self, InferenceOnlyAPI):
            # As RLlib's TorchRLModule.get_state: what only training needs (PPO's value head)
            # stays out of what the inference-only copies get.
            skip = tuple(self.get_non_inference_attributes())
            state = {k: v for k, v in state.items() if not any(k == a or k.startswith(a + ".") for a in skip)}
        cast = self.compute_dtype if inference_only else None
        return {key: shippable(lora.resolve(value), cast) for key, value in state.items()}

    def inference_tensors(self) -> Dict[str, Any]:
        """The state the env runners' plain model takes, as live tensors: the state dict, or
        on a LoRA learner its base weights under the plain names with each targeted
        layer's weight a :class:`~rllib_exgrpo.models.lora.MergedWeight` (``W + delta``,
        computed when resolved, the base weight unchanged); no adapter tensors."""
        if self.lora_model is None:
            return self.state_dict(keep_vars=True)
        return lora.plain_tensors(self.model, prefix="model.")

    def plain_model(self) -> torch.nn.Module:
        """The HF model as the env runners hold it: ``self.model``, or on a LoRA module the
        plain model with the merged weights (the adapters unloaded from this module: for a
        module restored to be exported or evaluated, not one that trains on)."""
        if self.lora_model is None:
            return self.model
        merged = {key[len("model.") :]: lora.resolve(value).detach().clone() for key, value in self.inference_tensors().items()}
        plain = self.lora_model.unload()
        plain.load_state_dict(merged)
        self.model = plain
        self.__dict__["lora_model"] = None
        return plain

    @override(TorchRLModule)
    def set_state(self, state) -> None:
        """Load weights in place, each value as it comes (RLlib's ``set_state`` first
        converts every floating tensor to float32: a bf16 state would be copied, at twice
        its size, before ``load_state_dict`` copies it into the parameters). numpy arrays
        are wrapped without a copy; ``load_state_dict`` casts to the parameters' dtype.
        As RLlib's: extra keys are ignored, and an inference-only module must get all of
        its own."""
        if zero3_weights.is_manifest(state):
            raise zero3_weights.not_weights_error("the state given to this module")
        tensors = {key: _as_tensor(value) for key, value in state.items()}
        missing, _ = self.load_state_dict(tensors, strict=False)
        if self.inference_only and missing:
            raise ValueError(
                f"Updating the module's state is missing keys: {list(missing)} (the state comes "
                f"from a different architecture?); its keys are {list(state)[:5]}..."
            )

    @override(RLModule)
    def _forward(self, batch: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        """Next-token logits at the end of each (left-padded) prompt.

        Generation goes through a generation backend; this plain forward exists so that
        RLlib's generic inference path yields the policy's next-token distribution.
        """
        input_ids = batch[C.INPUT_IDS]
        attention_mask = batch.get(C.ATTENTION_MASK, torch.ones_like(input_ids))
        with self.autocast():
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask),
                logits_to_keep=1,
                use_cache=False,
            )
        return {Columns.ACTION_DIST_INPUTS: out.logits[:, -1, :] / self.temperature}

    @override(RLModule)
    def _forward_train(self, batch: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        with self.autocast():  # a padded or a packed pass (core/packing.py)
            logp, entropy = score_learner_batch(self.model, batch, temperature=self.temperature, chunk_tokens=self.logit_chunk_tokens)
        return {C.LOGP: logp, C.ENTROPY: entropy}
