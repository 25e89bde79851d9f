"""The LLM policy as an RLlib ``TorchRLModule``: any Hugging Face causal LM.

The module owns the network weights, so RLlib's learners optimise it and RLlib's weight
sync ships it to the env runners. Generation itself is done by a generation backend
(``rllib_exgrpo.generation``) that reads this module's model; the module's job is the
*scoring* pass every algorithm needs: per-token log-probs and entropies of completion
tokens given prompt + completion.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.losses import streamed_entropy, token_logprobs_from_logits

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def load_causal_lm(model_config: Dict[str, Any]):
    """Load the HF causal LM described by a module ``model_config`` dict.

    Keys: ``model`` (hub name, local path, or ``"tiny"`` / ``"smollm2"`` for the embedded
    models), ``dtype``, ``gradient_checkpointing``, ``attn_implementation``.
    """
    from transformers import AutoModelForCausalLM

    from rllib_exgrpo.models import resolve_model_path

    path = resolve_model_path(model_config["model"])
    kwargs = {"dtype": resolve_dtype(model_config.get("dtype", "float32"))}
    if model_config.get("attn_implementation"):
        kwargs["attn_implementation"] = model_config["attn_implementation"]
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if model_config.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logprobs_and_entropy(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Score the last ``response_len`` tokens of every row.

    Shapes: input_ids, attention_mask [N, P + R] -> logp [N, R], entropy [N, R] or None.
    Only the ``R`` positions that predict completion tokens are turned into full-vocabulary
    logits (``logits_to_keep``), so prompts cost no vocabulary-sized memory.
    """
    logp, entropy, _ = score_completions(
        model, input_ids, attention_mask, response_len, temperature=temperature, with_entropy=with_entropy
    )
    return logp, entropy


def score_completions(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    with_hidden: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`completion_logprobs_and_entropy`, plus (``with_hidden``) the final hidden
    state of every position, ``[N, P + R, H]`` (the last entry of HF's ``hidden_states``:
    what the LM head reads; a value head can read it too)."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=response_len + 1,
        use_cache=False,
        output_hidden_states=with_hidden,
    )
    # Position t predicts token t + 1: drop the last position's logits.
    logits = out.logits[:, :-1, :]
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, -response_len:]
    logp = token_logprobs_from_logits(logits, targets)
    entropy = streamed_entropy(logits) if with_entropy else None
    hidden = out.hidden_states[-1] if with_hidden else None
    return logp, entropy, hidden


class LLMTorchRLModule(TorchRLModule):
    """RLModule wrapping a Hugging Face causal LM.

    ``model_config`` keys (all from ``ExGRPOConfig.model_config`` via the module spec):
        model: model name/path (``"tiny"`` builds the embedded warm-started model).
        dtype: ``"float32"`` | ``"bfloat16"`` | ``"float16"``.
        gradient_checkpointing: trade compute for activation memory in the learner.
        temperature: sampling temperature; log-probs are computed at this temperature
            so that importance ratios compare like with like.
    """

    def setup(self):
        self.model = load_causal_lm(self.model_config)
        self.temperature = float(self.model_config.get("temperature", 1.0))

    def _forward(self, batch: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        """Next-token logits at the end of each (left-padded) prompt.

        Generation goes through a generation backend; this plain forward exists so that
        RLlib's generic inference path yields the policy's next-token distribution.
        """
        input_ids = batch[C.INPUT_IDS]
        attention_mask = batch.get(C.ATTENTION_MASK, torch.ones_like(input_ids))
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            logits_to_keep=1,
            use_cache=False,
        )
        return {Columns.ACTION_DIST_INPUTS: out.logits[:, -1, :] / self.temperature}

    def _forward_train(self, batch: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        response_len = batch[C.RESPONSE_MASK].shape[1]
        logp, entropy = completion_logprobs_and_entropy(
            self.model,
            batch[C.INPUT_IDS],
            batch[C.ATTENTION_MASK],
            response_len,
            temperature=self.temperature,
        )
        return {C.LOGP: logp, C.ENTROPY: entropy}
