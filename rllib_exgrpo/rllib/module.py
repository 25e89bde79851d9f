"""The LLM policy as an RLlib ``TorchRLModule``: any Hugging Face causal LM.

The module owns the network weights, so RLlib's learners optimise it and RLlib's weight
sync ships it to the env runners. Generation itself is done by a generation backend
(``rllib_exgrpo.generation``) that reads this module's model; the module's job is the
*scoring* pass every algorithm needs: per-token log-probs and entropies of completion
tokens given prompt + completion.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy
from rllib_exgrpo.core.tokens import position_ids_from_mask
from rllib_exgrpo.models.loading import load_causal_lm

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
