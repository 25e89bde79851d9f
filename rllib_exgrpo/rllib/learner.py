"""``ExGRPOTorchLearner``: the (mixed-policy) GRPO loss on RLlib's TorchLearner.

All the maths lives in ``losses.py``; this class only wires the module's forward
outputs and the batch columns into it, adds the official "skip the update when the
gradient norm explodes" guard, and logs the metrics.
"""
from __future__ import annotations

import copy
from typing import Any, Dict

import torch

from ray.rllib.core.learner.torch.torch_learner import TorchLearner

from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.losses import mixed_policy_loss
from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy


class ExGRPOTorchLearner(TorchLearner):
    def build(self) -> None:
        from rllib_exgrpo.rllib.resources import apply_threads_for

        # A remote learner holds num_cpus_per_learner; the local one lives in the main process.
        apply_threads_for(self.config, "learner")
        super().build()
        self._skip_step = False
        self.mixed_mode = False
        self._reference_models: Dict[str, torch.nn.Module] = {}
        if self.config.kl_coeff > 0:
            # The frozen reference is the policy as it was when training started.
            for mid, module in self.module.items():
                ref = copy.deepcopy(module.model).eval()
                for p in ref.parameters():
                    p.requires_grad_(False)
                self._reference_models[mid] = ref

    def configure_optimizers_for_module(self, module_id, config=None) -> None:
        """AdamW with ``weight_decay`` (official ExGRPO: 0.01) instead of RLlib's plain Adam;
        the learning rate stays RLlib's (``lr``, a number or a schedule)."""
        params = self.get_parameters(self._module[module_id])
        optimizer = torch.optim.AdamW(params, lr=0.0, weight_decay=config.weight_decay)
        self.register_optimizer(
            module_id=module_id, optimizer=optimizer, params=params, lr_or_lr_schedule=config.lr
        )

    def set_mixed_mode(self, on: bool) -> None:
        """Called by the algorithm when ExGRPO's delayed start fires (and on restore)."""
        self.mixed_mode = bool(on)

    def use_clip_for_fresh_tokens(self, config) -> bool:
        """Whether fresh tokens are clipped; ExGRPO's mixed mode may remove the clip."""
        return not (self.mixed_mode and config.remove_clip_in_mixed_mode)

    def compute_loss_for_module(self, *, module_id, config, batch: Dict[str, Any], fwd_out) -> torch.Tensor:
        ref_logp = None
        if config.kl_coeff > 0:
            with torch.no_grad():
                ref_logp, _ = completion_logprobs_and_entropy(
                    self._reference_models[module_id],
                    batch[C.INPUT_IDS],
                    batch[C.ATTENTION_MASK],
                    batch[C.RESPONSE_MASK].shape[1],
                    temperature=config.temperature,
                    with_entropy=False,
                )
        loss, metrics = mixed_policy_loss(
            fwd_out[C.LOGP],
            batch[C.OLD_LOGP],
            batch[C.ADVANTAGES],
            batch[C.RESPONSE_MASK],
            # Without policy shaping (ablation) replayed tokens get the fresh-token loss.
            (batch[C.OFF_POLICY] > 0.5) & bool(config.policy_shaping),
            eps_low=config.clip_eps_low,
            eps_high=config.clip_eps_high,
            clip_fresh=self.use_clip_for_fresh_tokens(config),
            beta=config.policy_shaping_beta,
            agg_mode=config.loss_agg_mode,
            max_len=config.max_response_tokens,
            micro_batch_rows=config.official_micro_batch_rows,
            entropy=fwd_out[C.ENTROPY],
            entropy_coeff=config.entropy_coeff,
            ref_logp=ref_logp,
            kl_coeff=config.kl_coeff,
            ratio_mode=config.ratio_mode,
            # vLLM's own behaviour log-probs: truncated importance sampling of the unclipped
            # ratio (the HF backend's read-off log-probs are the learner's, within 1e-5).
            ratio_cap=(
                config.behaviour_ratio_cap
                if config.behaviour_logprobs == "engine" and config.generation_backend == "vllm"
                else None
            ),
        )
        for key, value in metrics.items():
            self.metrics.log_value((module_id, key), float(value), window=1)
        self.metrics.log_value((module_id, "total_loss"), float(loss.detach()), window=1)
        self.metrics.log_value((module_id, "clip_on_fresh_tokens"), float(self.use_clip_for_fresh_tokens(config)), window=1)
        return loss

    def postprocess_gradients_for_module(self, *, module_id, config=None, module_gradients_dict):
        threshold = getattr(config, "skip_update_grad_norm", None)
        grads = [g for g in module_gradients_dict.values() if g is not None]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            self.metrics.log_value((module_id, "grad_norm_preclip"), float(norm), window=1)
            explode = not torch.isfinite(norm) or (threshold is not None and float(norm) > threshold)
            self._skip_step = self._skip_step or explode
            self.metrics.log_value((module_id, "update_skipped"), float(explode), reduce="sum")
        return super().postprocess_gradients_for_module(
            module_id=module_id, config=config, module_gradients_dict=module_gradients_dict
        )

    def apply_gradients(self, gradients_dict) -> None:
        if self._skip_step:
            # Official ExGRPO: an update whose gradient norm explodes is dropped whole.
            self._skip_step = False
            for p in self._params.values():
                p.grad = None
            return
        super().apply_gradients(gradients_dict)
