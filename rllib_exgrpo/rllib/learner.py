"""``ExGRPOTorchLearner``: the (mixed-policy) GRPO loss on RLlib's TorchLearner.

All the maths lives in ``losses.py``; this class only wires the module's forward
outputs and the batch columns into it, adds the update guards, and logs the metrics.

Update guards (one decision per optimiser step, i.e. per ``_update`` call):

* a NaN/inf loss or a NaN/inf gradient norm drops the step (``skipped_nonfinite``);
* a gradient norm above ``skip_update_grad_norm`` drops it too (official ExGRPO: 500);
* a dropped step changes neither the parameters nor the optimiser state (no
  ``optimizer.step()``: AdamW's moments, step count and weight decay are untouched), and
  ``update_skipped`` counts every dropped step, whatever the reason.

Counts are logged with ``reduce="sum"``, so RLlib adds them over the minibatches of an
``update`` call, over the calls of an iteration and over learners. With data-parallel
learners the decision is the same on every learner (DDP averages the gradients in
``backward``, and a learner whose own loss is not finite turns its gradients into NaN
before that average), so only the first learner logs a 1 for a dropped step: the sums
count optimiser steps, comparable with the algorithm's ``optimizer_steps``.
``zero_advantage_updates`` counts learner updates (one learner's shard of a step) whose
every advantage is 0 (all groups all-correct or all-wrong): no policy gradient, a finite
loss; the step is still taken, as verl and the official code do.

Micro-batches (``learner_micro_batch_rows``): RLlib runs one forward and one backward per
minibatch, which for an LLM holds the activations (and logits) of every row at once. With
the field set, ``_uncompiled_update`` cuts the learner's minibatch into row slices, runs
forward + backward per slice and accumulates the gradients, each slice's loss divided by
the *minibatch's* counts (``losses.agg_totals``), so the slices' gradients add up to the
one-pass gradient; data-parallel learners all-reduce once, on the last slice
(``no_sync`` before it). The guards, the gradient norm and the optimiser step then run
once, as without micro-batches. Metrics of the slices are combined: losses summed, ``*_max``
/ ``*_min`` as max / min, the rest weighted by each slice's valid tokens; the ratio statistics
of fresh and of replayed tokens by the slice's tokens of that kind, leaving out a slice with
none (``losses.STAT_TOKEN_SHARE``). An update with no replayed
token does not log the replayed ones at all: the algorithm averages its minibatch updates,
and a 0 there would stand for "none" and halve the mean.

Token-budget passes (``learner_micro_batch_tokens``, as verl's ``ppo_max_token_len_per_gpu``):
the learner's rows are packed into passes of at most that many tokens, laid end to end
without padding (``core/packing.py``, ``learner_sequence_packing``: verl's remove-padding);
or, with packing off, sorted by length into passes whose padded size (rows x longest row)
stays under the budget, each trimmed to its own longest row. Either way one long completion
no longer widens every row. The same accumulation makes the update equal to one
pass. Data-parallel learners agree on the number of passes (a learner with fewer runs empty
ones) because a forward is a collective under ZeRO-3 and DDP. Logged per update:
``learner_passes`` and ``learner_padded_over_real`` (token positions computed / real tokens).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ray.rllib.utils.annotations import override
from ray.rllib.core.learner.learner import Learner
from ray.rllib.core.learner.torch.torch_learner import TorchLearner

from rllib_exgrpo.rllib import rllib_contract as rc
from rllib_exgrpo.rllib.config_fields import field_value
from rllib_exgrpo.core import columns as C
from rllib_exgrpo.core.losses import LOSS_METRICS, STAT_TOKEN_SHARE, agg_totals, mixed_policy_loss
from rllib_exgrpo.core.minibatches import trim_padding
from rllib_exgrpo.core.scoring import score_learner_batch
from rllib_exgrpo.core.attention import model_kernel, packs_rows
from rllib_exgrpo.core.minibatches import padded_positions, plan_micro_batches, real_lengths, shard_by_tokens
from rllib_exgrpo.core.packing import pack_rows
from rllib_exgrpo.core.scoring import logit_chunks
from rllib_exgrpo.core.tokens import prompt_completion_batch
from rllib_exgrpo.rllib.colocation import ColocatedSampler, learner_rank
from rllib_exgrpo.rllib.resources import apply_threads_for

logger = logging.getLogger(__name__)

#: What the learner logs per module (``learners/<module>/``): the loss's metrics, the total
#: loss and clip switch (``_log_loss_metrics``), the pre-clip norm and skipped updates
#: (``apply_gradients``) and the pass plan (``_plan_passes``).
LEARNER_METRICS = LOSS_METRICS + (
    "total_loss",
    "clip_on_fresh_tokens",
    "zero_advantage_updates",
    "grad_norm_preclip",
    "update_skipped",
    "skipped_nonfinite",
    "learner_passes",
    "learner_padded_over_real",
)


class ExGRPOTorchLearner(TorchLearner):
    @override(TorchLearner)
    def build(self) -> None:

        # A remote learner holds num_cpus_per_learner; the local one lives in the main process.
        apply_threads_for(self.config, "learner")
        super().build()
        self._reset_update_guards()
        self._loss_totals: Dict[str, Any] = {}
        self._metric_parts: Optional[List[Tuple[str, Dict[str, float]]]] = None
        self.mixed_mode = False
        self._reference_models: Dict[str, torch.nn.Module] = {}
        if self.config.kl_coeff > 0:
            # The frozen reference is the policy as it was when training started. With LoRA
            # that is the same model with its adapters disabled (_reference_logp): no copy.
            for mid, module in self.module.items():
                if getattr(module.unwrapped(), "lora_model", None) is not None:
                    continue
                ref = copy.deepcopy(module.model).eval()
                for p in ref.parameters():
                    p.requires_grad_(False)
                self._reference_models[mid] = ref
        self._say_attention()

    def _say_attention(self) -> None:
        """Print, once per learner group (the first learner), the attention kernel the
        policy runs here and whether the learner packs its passes: ``attn_implementation:
        auto`` resolves per process, so this is where the choice is known."""
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        kernels = sorted({str(model_kernel(getattr(self.module[mid], "model", None))) for mid in self.module.keys()})
        budget = self.config.learner_micro_batch_tokens
        if budget and self.config.learner_sequence_packing:
            packing = "packed passes" if self._kernel_packs_rows() else "padded passes (no variable-length kernel)"
        else:
            packing = "padded passes"
        print(
            f"learner: attention {', '.join(kernels)} (attn_implementation: {self.config.attn_implementation}); "
            f"{packing}; log-probs in chunks of {self.config.logit_chunk_tokens} positions",
            flush=True,
        )

    @override(TorchLearner)
    def get_parameters(self, module):
        """The parameters the optimiser steps: all of the module's, or with LoRA only the
        adapters (the frozen base weights get neither gradients nor optimiser state)."""
        params = super().get_parameters(module)
        if field_value(self.config, "lora_rank") > 0:
            params = [p for p in params if p.requires_grad]
        return params

    def _reference_logp(self, module_id, batch: Dict[str, Any], config) -> torch.Tensor:
        """Log-probs of ``batch``'s completions under the frozen reference policy: the
        initial model's copy, or a LoRA module's base model (its adapters disabled)."""
        module = self.module[module_id].unwrapped()
        lora_model = getattr(module, "lora_model", None)
        reference = self._reference_models.get(module_id, module.model)
        adapters_off = lora_model.disable_adapter() if lora_model is not None else contextlib.nullcontext()
        with torch.no_grad(), module.autocast(), adapters_off:
            ref_logp, _ = score_learner_batch(
                reference,
                batch,
                temperature=config.temperature,
                with_entropy=False,
                chunk_tokens=config.logit_chunk_tokens,
            )
        return ref_logp

    @override(TorchLearner)
    def configure_optimizers_for_module(self, module_id, config=None) -> None:
        """AdamW with ``weight_decay`` (official ExGRPO: 0.01) instead of RLlib's plain Adam;
        the learning rate stays RLlib's (``lr``, a number or a schedule)."""
        params = self.get_parameters(self.module[module_id])
        optimizer = torch.optim.AdamW(params, lr=0.0, weight_decay=config.weight_decay)
        self.register_optimizer(module_id=module_id, optimizer=optimizer, params=params, lr_or_lr_schedule=config.lr)

    def _reset_update_guards(self) -> None:
        """Forget the previous step's guard flags (start and end of every ``_update``)."""
        self._skip_step = False
        self._nonfinite_step = False
        self._guarded_modules: list = []

    def _counts_here(self) -> float:
        """1.0 on the learner that logs step counts (the only one, or rank 0 of the
        data-parallel group), else 0.0: the guards' decisions are the same on all learners."""
        if dist.is_available() and dist.is_initialized():
            return 1.0 if dist.get_rank() == 0 else 0.0
        return 1.0

    @override(Learner)
    def compute_losses(self, *, fwd_out, batch):
        self._reset_update_guards()
        return super().compute_losses(fwd_out=fwd_out, batch=batch)

    def set_mixed_mode(self, on: bool) -> None:
        """Called by the algorithm when ExGRPO's delayed start fires (and on restore)."""
        self.mixed_mode = bool(on)

    def use_clip_for_fresh_tokens(self, config) -> bool:
        """Whether fresh tokens are clipped; ExGRPO's mixed mode may remove the clip."""
        return not (self.mixed_mode and config.remove_clip_in_mixed_mode)

    @override(Learner)
    def compute_loss_for_module(self, *, module_id, config, batch: Dict[str, Any], fwd_out) -> torch.Tensor:
        ref_logp = None
        if config.kl_coeff > 0:
            ref_logp = self._reference_logp(module_id, batch, config)
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
                config.behaviour_ratio_cap if config.behaviour_logprobs == "engine" and config.generation_backend == "vllm" else None
            ),
            totals=self._loss_totals.get(module_id),
        )
        loss_value = float(loss.detach())
        values = {key: float(value) for key, value in metrics.items()}
        values["total_loss"] = loss_value
        values["clip_on_fresh_tokens"] = float(self.use_clip_for_fresh_tokens(config))
        if self._metric_parts is not None:  # a micro-batch: logged once, combined
            values["_tokens"] = float(batch[C.RESPONSE_MASK].sum())
            self._metric_parts.append((module_id, values))
        else:
            self._log_loss_metrics(module_id, values)
        self._guarded_modules.append(module_id)
        if not math.isfinite(loss_value):
            # The step is dropped (apply_gradients). NaN gradients everywhere make every
            # data-parallel learner drop it too: DDP averages them in backward.
            self._skip_step = self._nonfinite_step = True
            loss = loss * float("nan")
        return loss

    def _log_loss_metrics(self, module_id, values: Dict[str, float]) -> None:
        # A ratio statistic of an update without such tokens is not logged: RLlib averages
        # the values of an iteration's minibatch updates, and a 0 standing for "no replayed
        # token in this minibatch" would halve the replayed tokens' mean ratio. An iteration
        # with none at all reports NaN for it.
        absent = {key for key, share in STAT_TOKEN_SHARE.items() if values.get(share, 1.0) == 0.0}
        for key, value in values.items():
            if not key.startswith("_") and key not in absent:
                self.metrics.log_value((module_id, key), value, window=1)
        self.metrics.log_value((module_id, "zero_advantage_updates"), float(values["zero_advantage_fraction"] == 1.0), reduce="sum")

    # ---- generation in the learner (colocate; rllib/colocation.py) ------------------------------
    def colocated_sampler(self):
        """This learner's :class:`~rllib_exgrpo.rllib.colocation.ColocatedSampler`, built on
        first use over its own module."""
        sampler = getattr(self, "_colocated_sampler", None)
        if sampler is None:
            from ray.rllib.core import DEFAULT_MODULE_ID

            sampler = ColocatedSampler(
                self.config,
                self.module[DEFAULT_MODULE_ID].unwrapped(),
                index=learner_rank(),
                # The module's own optimizers (RLlib's default, ALL_MODULES, names none here).
                optimizers=lambda: [opt for _, opt in self.get_optimizers_for_module(DEFAULT_MODULE_ID)],
                engines=self.colocation_engines,
            )
            apply_threads_for(self.config, "learner")  # the runner sized them for itself
            self._colocated_sampler = sampler
        return sampler

    def colocation_engines(self) -> list:
        """The DeepSpeed engines whose state a colocated turn offloads (none here)."""
        return []

    def colocated_sample(self, shards, sample_kwargs):
        """``colocate``: sample this learner's share (``shards[rank]``: question ids,
        completions per question, prompt prefixes) with its colocated sampler. Returns
        ``(rank, episodes, runner metrics or None, lines for the user)``."""
        rank = learner_rank()
        mine = shards[rank] if rank < len(shards) else None
        sampler = self.colocated_sampler()
        if not mine:
            sampler.take_part()  # ZeRO-3: the weight gathers need every rank
            return rank, [], None, sampler.pop_notes()
        question_ids, num_samples, prefixes = mine
        episodes = sampler.sample(question_ids=question_ids, num_samples=num_samples, prompt_prefixes=prefixes, **sample_kwargs)
        return rank, episodes, sampler.get_metrics(), sampler.pop_notes()

    # ---- scoring where the training weights are (scoring_on: learners) ------------------------
    @torch.no_grad()
    def score_rows(self, prompts, completions, pad_id: int, module_id: Optional[str] = None):
        """Per-token log-probs and entropies of this learner's share of the rows
        ``(prompts[i], completions[i])`` under its current weights (``scoring_on:
        learners``: behaviour log-probs and ExGRPO's replay entropies computed where the
        training weights already are, as verl's actor computes ``old_log_prob``).

        Every learner gets all rows and scores the contiguous share of its rank
        (``shard_by_tokens``: rows sorted by length, about equal tokens per learner). Its
        rows go in passes under ``learner_micro_batch_tokens`` / ``_rows`` (sorted by
        length, each pass padded to its own longest row; not packed, so each row's
        numbers come back in place); data-parallel learners agree on the number of passes
        (a forward is a collective under ZeRO-3). Returns ``(row indices, logps,
        entropies)``, float32 arrays of each completion's length.
        """
        from ray.rllib.core import DEFAULT_MODULE_ID

        module_id = module_id or DEFAULT_MODULE_ID
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
        shards = shard_by_tokens(lengths, world)  # non-empty shards only: fewer rows than learners
        mine = (shards[rank] if rank < len(shards) else []) if world > 1 else list(range(len(lengths)))
        p_len = np.asarray([len(prompts[i]) for i in mine], dtype=np.int64)
        c_len = np.asarray([len(completions[i]) for i in mine], dtype=np.int64)
        max_rows = field_value(self.config, "learner_micro_batch_rows")
        max_tokens = field_value(self.config, "learner_micro_batch_tokens")
        if len(mine) and (max_rows or max_tokens):
            plan = plan_micro_batches(p_len, c_len, max_rows=max_rows, max_tokens=max_tokens, packed=False)
        else:
            plan = [np.arange(len(mine))] if len(mine) else []
        count = self._agreed_pass_count(len(plan))
        device = next(iter(rc.learner_params(self).values())).device if rc.learner_params(self) else torch.device("cpu")
        logps: List[Any] = [None] * len(mine)
        entropies: List[Any] = [None] * len(mine)
        for k in range(count):
            rows = list(plan[k]) if k < len(plan) else []
            ps = [prompts[mine[j]] for j in rows] or [[pad_id]]  # an empty pass: one dummy row
            cs = [completions[mine[j]] for j in rows] or [[pad_id]]
            ids, mask, resp = prompt_completion_batch(ps, cs, pad_id)
            chunk = {
                C.INPUT_IDS: ids.to(device),
                C.ATTENTION_MASK: mask.to(device),
                C.RESPONSE_MASK: resp.to(device=device, dtype=torch.float32),
            }
            out = self._score_forward(module_id, self._agree_logit_chunks({module_id: chunk})[module_id])
            lp = out[C.LOGP].float().cpu().numpy()
            en = out[C.ENTROPY].float().cpu().numpy()
            for r, j in enumerate(rows):
                n = int(c_len[j])
                logps[j], entropies[j] = lp[r, :n].copy(), en[r, :n].copy()
        return list(mine), logps, entropies

    def _score_forward(self, module_id, chunk: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The module's training forward on one scoring pass, outside DDP's wrapper (a
        no-grad forward needs no collective)."""
        module = self.module[module_id]
        module = module.unwrapped() if hasattr(module, "unwrapped") else module
        return module.forward_train(chunk)

    # ---- micro-batches (gradient accumulation) --------------------------------------------
    def _micro_batches(self, batch: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
        """The passes of ``batch`` (module id -> columns), or None when one pass holds it all.

        ``learner_micro_batch_rows`` caps the rows and ``learner_micro_batch_tokens`` the
        padded token positions of a pass (``minibatches.plan_micro_batches``: rows sorted by
        length and packed under the budget); each pass is trimmed to its own longest prompt
        and completion. Data-parallel learners agree on the number of passes (the largest
        of any learner): every pass is a collective for DeepSpeed ZeRO-3 (parameters are
        gathered in each forward) and for DDP (buffers are broadcast in each forward), so a
        learner with fewer passes runs empty ones (:meth:`_empty_pass`, no gradient)."""

        max_rows = field_value(self.config, "learner_micro_batch_rows")
        max_tokens = field_value(self.config, "learner_micro_batch_tokens")
        packed = bool(max_tokens) and bool(self.config.learner_sequence_packing) and self._kernel_packs_rows()
        rows = {mid: int(b[C.RESPONSE_MASK].shape[0]) for mid, b in batch.items() if C.RESPONSE_MASK in b}
        if not (max_rows or max_tokens) or not rows:
            return None
        plans = {}
        for mid in rows:
            prompt, completion = real_lengths(batch[mid])
            plans[mid] = plan_micro_batches(prompt, completion, max_rows=max_rows, max_tokens=max_tokens, packed=packed)
            real = float(prompt.sum() + completion.sum()) or 1.0
            self.metrics.log_value((mid, "learner_passes"), float(len(plans[mid])), window=1)
            self.metrics.log_value(
                (mid, "learner_padded_over_real"), padded_positions(prompt, completion, plans[mid], packed) / real, window=1
            )
        count = self._agreed_pass_count(max(len(p) for p in plans.values()))
        if count <= 1 and not packed:
            return None

        def take(columns, n: int, index: np.ndarray) -> Dict[str, Any]:
            picked = {}
            for k, v in columns.items():
                if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n:
                    v = v[torch.as_tensor(index, device=v.device)]
                picked[k] = v
            picked = trim_padding(picked)
            return {**picked, **pack_rows(picked)} if packed else picked

        passes = []
        for i in range(count):
            chunk = {mid: take(batch[mid], rows[mid], plans[mid][i]) for mid in rows if i < len(plans[mid])}
            passes.append(chunk or self._empty_pass(batch, rows))
        return passes

    def _kernel_packs_rows(self) -> bool:
        """Whether every module's attention kernel runs packed passes without a dense
        ``[T, T]`` mask (``core/attention.py``). Where one does not, packing is off for
        this learner, said once: padded passes of length-sorted rows cost padding, a dense
        mask over a packed pass costs ``T^2``."""
        cached = getattr(self, "_packs_rows", None)
        if cached is not None:
            return cached
        kernels = {}
        for mid in self.module.keys():
            module = self.module[mid]
            module = module.unwrapped() if hasattr(module, "unwrapped") else module
            model = getattr(module, "model", None)
            device = next(model.parameters()).device.type if model is not None else "cpu"
            kernels[mid] = (model_kernel(model), device)
        self._packs_rows = all(packs_rows(kernel, device) for kernel, device in kernels.values())
        if not self._packs_rows:
            logger.warning(
                "learner_sequence_packing: attention kernel %s has no variable-length path (a packed pass "
                "would build a dense [T, T] mask); using sorted-and-trimmed padded passes. Set "
                "attn_implementation to 'auto', 'sdpa_varlen' or 'flash_attention_2' to pack.",
                sorted({k for k, _ in kernels.values()}, key=str),
            )
        return self._packs_rows

    def _empty_pass(self, batch: Dict[str, Any], rows: Dict[str, int]) -> Dict[str, Any]:
        """One row of ``batch`` with its completion mask zeroed: a forward and backward whose
        loss and gradient are exactly 0 (every loss term is a masked sum)."""
        out = {}
        for mid, n in rows.items():
            one = {k: (v[:1].clone() if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v) for k, v in batch[mid].items()}
            one[C.RESPONSE_MASK] = torch.zeros_like(one[C.RESPONSE_MASK])
            out[mid] = trim_padding(one)
        return out

    def _head_calls_are_collective(self) -> bool:
        """Whether every call of the LM head is a collective across the data-parallel
        learners (DeepSpeed ZeRO-3 gathers its parameters; overridden there)."""
        return False

    def _agree_logit_chunks(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        """``batch`` (module id -> a pass's columns) with ``MIN_LOGIT_CHUNKS`` set to the
        most LM-head calls any learner's pass makes, where head calls are collectives:
        log-probs go in chunks of ``logit_chunk_tokens`` positions, and learners whose
        passes score different numbers of positions would otherwise call the head a
        different number of times and wait for each other forever."""
        if not self._head_calls_are_collective():
            return batch

        out = {}
        for mid, columns in batch.items():
            if isinstance(columns, dict) and C.RESPONSE_MASK in columns:
                count = self._agreed_pass_count(logit_chunks(columns, self.config.logit_chunk_tokens))
                columns = {**columns, C.MIN_LOGIT_CHUNKS: count}
            out[mid] = columns
        return out

    def _agreed_pass_count(self, count: int) -> int:
        """The most passes any data-parallel learner needs (``count`` alone)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return count
        device = next(iter(rc.learner_params(self).values())).device if rc.learner_params(self) else "cpu"
        value = torch.tensor([float(count)], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def _combined_metrics(self) -> None:
        """Log the micro-batches' loss metrics as one update's (see the module doc)."""
        by_module: Dict[str, List[Dict[str, float]]] = {}
        for module_id, values in self._metric_parts or []:
            by_module.setdefault(module_id, []).append(values)
        for module_id, parts in by_module.items():
            # Empty passes (_empty_pass: no completion token) carry no statistic.
            parts = [p for p in parts if p["_tokens"] > 0] or parts
            combined: Dict[str, float] = {}
            for key in parts[0]:
                # Each statistic weighted by the tokens it is taken over: the fresh ratios by
                # the passes' fresh tokens, the replayed ones by their replayed tokens (a pass
                # without any leaves it out), the rest by all of each pass's tokens.
                share = STAT_TOKEN_SHARE.get(key)
                tokens = [p["_tokens"] * (p[share] if share else 1.0) for p in parts]
                mine = [(p[key], t) for p, t in zip(parts, tokens) if t > 0 or share is None]
                if key in ("policy_loss", "total_loss"):
                    combined[key] = sum(p[key] for p in parts)
                elif not mine:  # no pass holds such a token: left out by _log_loss_metrics
                    combined[key] = 0.0
                elif key.endswith("_max"):
                    combined[key] = max(v for v, _ in mine)
                elif key.endswith("_min"):
                    combined[key] = min(v for v, _ in mine)
                else:
                    combined[key] = sum(v * t for v, t in mine) / (sum(t for _, t in mine) or 1.0)
            self._log_loss_metrics(module_id, combined)

    def _no_sync(self, on: bool) -> contextlib.ExitStack:
        """DDP's ``no_sync`` on every module when ``on`` (data-parallel learners only)."""
        stack = contextlib.ExitStack()
        if on and self.config.num_learners > 1:
            for mod in self.module.values():
                if isinstance(mod, torch.nn.Module) and hasattr(mod, "no_sync"):
                    stack.enter_context(mod.no_sync())
        return stack

    def _run_passes(self, batch: Dict[str, Any], *, forward, backward, pass_context, chunks: Any = "plan"):
        """Forward, loss and backward per micro-batch of ``batch`` (one pass without
        ``learner_micro_batch_rows``): the one loop of both learners. ``forward(chunk)``
        gives the forward outputs, ``backward(loss_per_module)`` accumulates gradients,
        ``pass_context(last)`` wraps each pass (DDP's no_sync, DeepSpeed's boundary).
        Returns the last pass's forward outputs and the summed (detached) losses; the
        guard flags of all passes are kept for the one optimiser step. ``chunks``: the
        passes when already planned (``_micro_batches`` is a collective: plan once)."""
        if isinstance(chunks, str):
            chunks = self._micro_batches(batch)
        if chunks is not None:
            self._loss_totals = {mid: agg_totals(b[C.RESPONSE_MASK]) for mid, b in batch.items() if C.RESPONSE_MASK in b}
            self._metric_parts = []
        skip = nonfinite = False
        guarded: list = []
        losses: Dict[str, torch.Tensor] = {}
        fwd_out: Dict[str, Any] = {}
        passes = chunks or [batch]
        try:
            for i, chunk in enumerate(passes):
                chunk = self._agree_logit_chunks(chunk)
                with pass_context(i == len(passes) - 1):
                    fwd_out = forward(chunk)
                    loss_per_module = self.compute_losses(fwd_out=fwd_out, batch=chunk)
                    skip, nonfinite = skip or self._skip_step, nonfinite or self._nonfinite_step
                    guarded += self._guarded_modules
                    backward(loss_per_module)
                for mid, value in loss_per_module.items():
                    losses[mid] = losses[mid] + value.detach() if mid in losses else value
            if chunks is not None:
                self._combined_metrics()
        finally:
            self._loss_totals, self._metric_parts = {}, None
        self._skip_step, self._nonfinite_step, self._guarded_modules = skip, nonfinite, guarded
        return fwd_out, losses

    def _torch_backward(self, loss_per_module) -> None:
        total = sum(loss_per_module.values())
        if torch.is_tensor(total) and total.grad_fn is not None:
            if rc.grad_scalers(self) is not None:
                total = sum(rc.grad_scalers(self)[m].scale(v) for m, v in loss_per_module.items())
            total.backward()

    @override(TorchLearner)
    def _uncompiled_update(self, batch: Dict, **kwargs):
        chunks = self._micro_batches(batch)
        if chunks is None:
            return rc.base_uncompiled_update(super(), batch, **kwargs)
        rc.compute_off_policyness(self, batch)
        for optim in rc.optimizer_parameters(self):
            optim.zero_grad(set_to_none=True)
        fwd_out, loss_per_module = self._run_passes(
            batch,
            forward=self.module.forward_train,
            backward=self._torch_backward,
            pass_context=lambda last: self._no_sync(not last),  # all-reduce once, in the last backward
            chunks=chunks,
        )
        gradients = {pid: p.grad for pid, p in rc.learner_params(self).items()}
        with self._no_sync(True):
            postprocessed = self.postprocess_gradients(gradients)
            self.apply_gradients(postprocessed)
        return fwd_out, loss_per_module, {}

    def _agreed(self, skip: bool, nonfinite: bool):
        """The skip decision of every data-parallel learner at once (a max over them):
        one learner's NaN shard must not leave the others stepping. NaN gradients alone do
        not carry it there: the log-ratio clamp passes no gradient to NaN inputs."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return skip, nonfinite
        device = next(iter(rc.learner_params(self).values())).device if rc.learner_params(self) else "cpu"
        flags = torch.tensor([float(skip), float(nonfinite)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item()), bool(flags[1].item())

    @override(Learner)
    def postprocess_gradients_for_module(self, *, module_id, config=None, module_gradients_dict):
        threshold = field_value(config, "skip_update_grad_norm")
        grads = [g for g in module_gradients_dict.values() if g is not None]
        if grads:
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
            self.metrics.log_value((module_id, "grad_norm_preclip"), norm, window=1)
            nonfinite = not math.isfinite(norm)
            explode = nonfinite or (threshold is not None and norm > threshold)
            self._nonfinite_step = self._nonfinite_step or nonfinite
            self._skip_step = self._skip_step or explode
        return super().postprocess_gradients_for_module(module_id=module_id, config=config, module_gradients_dict=module_gradients_dict)

    @override(TorchLearner)
    def apply_gradients(self, gradients_dict) -> None:
        skip, nonfinite = self._agreed(self._skip_step, self._nonfinite_step)
        once = self._counts_here()
        for module_id in dict.fromkeys(self._guarded_modules):
            self.metrics.log_value((module_id, "update_skipped"), once * float(skip), reduce="sum")
            self.metrics.log_value((module_id, "skipped_nonfinite"), once * float(nonfinite), reduce="sum")
        self._reset_update_guards()
        if skip:
            # Official ExGRPO: an update whose gradient norm explodes is dropped whole; so is
            # one with a NaN/inf loss or gradient. No optimizer.step(): parameters and
            # optimiser state stay as they are (RLlib would zero NaN gradients and step).
            for p in rc.learner_params(self).values():
                p.grad = None
            return
        super().apply_gradients(gradients_dict)
