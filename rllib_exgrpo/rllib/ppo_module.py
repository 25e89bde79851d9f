"""RLlib's built-in PPO on the LLM: the module, distribution and connector piece it needs.

RLlib's ``PPO`` class and its ``PPOTorchLearner`` run **unmodified**; what this file adds
plugs this project's LLM policy into them:

* :class:`LLMPPOTorchRLModule`: the HF causal LM of :class:`LLMTorchRLModule` plus
  RLlib's ``ValueFunctionAPI`` (a linear value head on the LM's final hidden state at
  the prompt's last token) and an action distribution over whole completions.
* :class:`CompletionDistribution`: a ``TorchDistribution`` whose ``logp(actions)`` is the
  sum of the completion's token log-probs (padding masked), so PPO's ratio
  ``exp(logp - ACTION_LOGP)`` is the sequence-level importance ratio.
* :class:`PadLLMEpisodes`: a learner connector piece (``config.learners(
  learner_connector=PadLLMEpisodes)``) that turns :class:`LLMEnvRunner` episodes --
  ragged prompt / completion token arrays, per-token behaviour log-probs -- into
  fixed-width columns that RLlib's default learner pipeline can stack; ExGRPO's own
  (ragged) path does not use it.

How the pieces meet inside stock PPO (single-step episodes: obs = prompt, action =
completion, reward = verifier score, terminated)::

    LLMEnvRunner.sample()  ->  episodes
    learner pipeline:  AddOneTsToEpisodesAndTruncate (PPO)     -> +1 phantom row per episode
                       PadLLMEpisodes (ours)                     -> OBS, ACTIONS, lengths,
                                                                    ACTION_LOGP (sum),
                                                                    ACTION_DIST_INPUTS (behaviour)
                       RLlib defaults (rewards, terminateds, batching, to tensors)
                       GeneralAdvantageEstimation (PPO)          -> A = r - V(prompt),
                                                                    standardised over the batch;
                                                                    value target = r
    PPOTorchLearner.compute_loss_for_module (stock): clipped surrogate on the sequence ratio,
        vf loss on module.compute_values(embeddings), entropy, optional KL.

Counting: PPO's batch holds two rows per completion (the real step and the phantom
bootstrap row), so ``minibatch_size`` counts rows = 2 x completions, and the results'
``num_module_steps_trained`` too. Losses are means over the real rows (``LOSS_MASK``);
the ``vf_explained_var`` metric is not masked by PPO and includes the phantom rows.

Column layout of a learner batch row (one completion; the phantom rows PPO appends for
bootstrapping are excluded from the loss by its ``LOSS_MASK``)::

    obs                 int64 [P_max]  prompt ids, LEFT-padded with 0      obs_len      int64
    actions             int64 [R_max]  completion ids, RIGHT-padded with 0 actions_len  int64
    action_logp         float32        sum of the behaviour token log-probs
    action_dist_inputs  float32 [R_max, 4]  per token: log-prob, entropy, mask, token id
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from ray.rllib.utils.annotations import override
from ray.rllib.core.distribution.distribution import Distribution
from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.core.columns import Columns
from ray.rllib.core.distribution.torch.torch_distribution import TorchDistribution
from ray.rllib.core.rl_module.apis import InferenceOnlyAPI, ValueFunctionAPI

from rllib_exgrpo.core.scoring import score_completions
from rllib_exgrpo.core.tokens import position_ids_from_mask, prompt_completion_from_padded
from rllib_exgrpo.rllib.module import LLMTorchRLModule
from ray.rllib.callbacks.callbacks import RLlibCallback

from rllib_exgrpo.core.chunked_logprobs import DEFAULT_CHUNK_TOKENS
from rllib_exgrpo.rllib.config_fields import FIELDS_BY_NAME, field_defaults
from rllib_exgrpo.rllib.env_runner import module_model_config
from rllib_exgrpo.rllib.heldout import HeldoutEvaluator

#: Extra batch columns written by :class:`PadLLMEpisodes`.
OBS_LEN = "obs_len"  # int64 [N]: real prompt tokens of each (left-padded) obs row
ACTIONS_LEN = "actions_len"  # int64 [N]: real completion tokens of each (right-padded) action row

#: Channels of the packed per-token distribution inputs ``[N, R, 4]``.
CH_LOGP, CH_ENTROPY, CH_MASK, CH_TOKEN = 0, 1, 2, 3
NUM_CHANNELS = 4


def pack_dist_inputs(
    token_logp: torch.Tensor,
    token_entropy: Optional[torch.Tensor],
    mask: torch.Tensor,
    token_ids: torch.Tensor,
) -> torch.Tensor:
    """``[N, R]`` x 4 -> the ``[N, R, 4]`` input of :class:`CompletionDistribution`.

    ``token_entropy`` None (unknown, e.g. the behaviour policy's) is stored as 0. Token
    ids travel as float32, exact below 2**24 (any real vocabulary).
    """
    logp = token_logp.float()
    ent = torch.zeros_like(logp) if token_entropy is None else token_entropy.float()
    mask = mask.to(logp.dtype)
    return torch.stack([logp * mask, ent * mask, mask, token_ids.to(logp.dtype) * mask], dim=-1)


class CompletionDistribution(TorchDistribution):
    """A policy's distribution over whole completions, seen through one completion per row.

    An LLM's distribution over completions is autoregressive and has no closed form to
    hand around; what the learner needs is its value *at the completion in the batch*.
    So the inputs (``from_logits``) are per-token statistics of that completion, packed
    ``[N, R, 4]`` (:func:`pack_dist_inputs`): token log-prob (at the sampling
    temperature), token entropy of the full next-token distribution, mask (1 on
    completion tokens, 0 on padding), token id.

    * ``logp(actions)``: sum of the masked token log-probs = log pi(completion | prompt).
      ``actions`` must be the completions the inputs were computed for (checked against
      the stored token ids); any other completion raises ``ValueError``.
    * ``entropy()``: **sum** of the token entropies along the completion -- the
      sequence-level counterpart of the summed ``logp`` (on-policy, its expectation is
      the entropy of the completion distribution). Longer completions have more.
    * ``kl(other)``: KL(self || other) per completion as the sum over tokens of the k3
      estimator ``exp(d) - 1 - d``, ``d = other.logp_t - self.logp_t`` (non-negative,
      unbiased per token for completions sampled from ``self``; PPO calls it as
      ``behaviour.kl(current)``). Both must describe the same completions.
    * ``sample()``: not available -- completions come from the env runner's generation
      backend, not from this object.
    """

    def __init__(self, logits: torch.Tensor):
        if logits.dim() < 2 or logits.shape[-1] != NUM_CHANNELS:
            raise ValueError(
                f"CompletionDistribution inputs must be [..., R, {NUM_CHANNELS}] (token logp, "
                f"entropy, mask, token id), got shape {tuple(logits.shape)}"
            )
        self.inputs = logits
        super().__init__()

    @override(TorchDistribution)
    def _get_torch_distribution(self, *args, **kwargs):
        return None  # no torch.distributions object: everything is computed from inputs

    @classmethod
    @override(TorchDistribution)
    def from_logits(cls, logits: torch.Tensor, **kwargs) -> "CompletionDistribution":
        return cls(logits)

    @property
    def token_logp(self) -> torch.Tensor:
        return self.inputs[..., CH_LOGP]

    @property
    def token_entropy(self) -> torch.Tensor:
        return self.inputs[..., CH_ENTROPY]

    @property
    def mask(self) -> torch.Tensor:
        return self.inputs[..., CH_MASK]

    @property
    def token_ids(self) -> torch.Tensor:
        return self.inputs[..., CH_TOKEN]

    def _check_same_completions(self, actions: torch.Tensor, what: str) -> None:
        ids = self.token_ids.detach()
        if tuple(actions.shape) != tuple(ids.shape):
            raise ValueError(
                f"{what}: completions of shape {tuple(actions.shape)} do not match the distribution's inputs ({tuple(ids.shape)} tokens)"
            )
        expected = actions.to(ids.dtype) * self.mask.detach()
        if not torch.equal(expected, ids):
            raise ValueError(
                f"{what}: a CompletionDistribution only knows the log-probs of the completions it was computed for; these differ"
            )

    @override(TorchDistribution)
    def logp(self, value: torch.Tensor, **kwargs) -> torch.Tensor:
        self._check_same_completions(value, "logp")
        return (self.token_logp * self.mask).sum(-1)

    @override(TorchDistribution)
    def entropy(self, **kwargs) -> torch.Tensor:
        return (self.token_entropy * self.mask).sum(-1)

    @override(TorchDistribution)
    def kl(self, other: "CompletionDistribution", **kwargs) -> torch.Tensor:
        if not isinstance(other, CompletionDistribution):
            raise TypeError(f"kl needs another CompletionDistribution, got {type(other).__name__}")
        if other.inputs.shape != self.inputs.shape or not torch.equal(other.token_ids.detach(), self.token_ids.detach()):
            raise ValueError("kl: both distributions must describe the same completions")
        d = (other.token_logp - self.token_logp) * self.mask
        return ((torch.exp(d) - 1.0 - d) * self.mask).sum(-1)

    @override(TorchDistribution)
    def sample(self, *, sample_shape=None, **kwargs):
        raise NotImplementedError(
            "CompletionDistribution cannot sample: completions are generated by the env runner's generation backend (LLMEnvRunner)."
        )

    @override(TorchDistribution)
    def rsample(self, *, sample_shape=None, **kwargs):
        raise NotImplementedError("completions are discrete token sequences: no reparameterised sampling")

    @override(Distribution)
    def to_deterministic(self):
        raise NotImplementedError("greedy decoding is LLMEnvRunner.sample(explore=False)")

    @staticmethod
    @override(Distribution)
    def required_input_dim(space: gym.Space, **kwargs) -> int:
        return NUM_CHANNELS * int(space.shape[0])


class LLMPPOTorchRLModule(LLMTorchRLModule, ValueFunctionAPI, InferenceOnlyAPI):
    """:class:`LLMTorchRLModule` for RLlib's PPO: value function + completion distribution.

    ``model_config`` keys besides those of :class:`LLMTorchRLModule`:
        vf_share_layers: False (PPO's default, which ``PPOConfig`` puts into every
            ``model_config``): the value loss trains the value head only -- the head reads
            the LM's hidden state detached, so the policy trunk gets policy-loss gradients
            only. True: value-loss gradients flow into the LM as well.
        value_batch_size: rows per prompt-only forward pass of :meth:`compute_values`
            without embeddings (the GAE pass over the whole train batch; default 64).
        value_scale: V = value_scale * value_head(h) (default 1). RLlib's learner has one
            Adam optimiser and one ``lr`` per module; under Adam this factor multiplies
            the value head's effective learning rate, so a head can learn at an LLM's small
            ``lr`` (e.g. 100 at lr 1e-6). It multiplies the head's gradients too: keep
            ``vf_loss_coeff * value_scale`` small (~0.01) so the value loss does not take
            over global-norm gradient clipping.

    The value head (``value_head``: ``Linear(hidden_size, 1)`` in float32, zero-initialised
    so V starts at 0) exists in the learner's module only: inference-only modules (env
    runners) skip it, and ``get_state(inference_only=True)`` leaves it out of weight syncs.

    Forward passes:
        ``_forward_train``: one LM pass over prompt + completion for the rows in
            ``LOSS_MASK`` (PPO's phantom bootstrap rows are skipped: they get the behaviour
            inputs back, i.e. ratio 1, and zero embeddings; the loss masks them anyway)
            -> ``ACTION_DIST_INPUTS`` ``[N, R, 4]`` (current token log-probs and
            entropies, see :class:`CompletionDistribution`) and ``EMBEDDINGS`` ``[N, H]``
            (final hidden state at each prompt's last token).
        ``compute_values(batch, embeddings)``: ``value_head(embeddings)`` -> ``[N]``;
            without embeddings, a prompt-only pass over ``obs`` (all rows) computes them
            (under ``no_grad`` unless ``vf_share_layers``).
    """

    def setup(self):
        # The GPU path's keys (docs/ppo.md): flat LoRA keys as ExGRPO spells them, and a
        # half-precision learner keeps fp32 master weights (as ExGRPO's DDP learner does).
        self.model_config = ppo_model_config(self.model_config)
        super().setup()
        self.vf_share_layers = bool(self.model_config.get("vf_share_layers", False))
        self.value_batch_size = int(self.model_config.get("value_batch_size", 64))
        self.value_scale = float(self.model_config.get("value_scale", 1.0))
        if not self.inference_only:
            hidden = self.model.config.get_text_config().hidden_size
            self.value_head = nn.Linear(hidden, 1)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    # ---- RLlib APIs ----------------------------------------------------------------
    @override(InferenceOnlyAPI)
    def get_non_inference_attributes(self) -> List[str]:
        return ["value_head"]

    @override(TorchRLModule)
    def get_train_action_dist_cls(self):
        return CompletionDistribution

    @override(TorchRLModule)
    def get_exploration_action_dist_cls(self):
        return CompletionDistribution

    # ---- forward passes ------------------------------------------------------------
    def _forward_train(self, batch: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        actions = batch[Columns.ACTIONS]
        n, width = actions.shape
        device = actions.device
        loss_mask = batch.get(Columns.LOSS_MASK)
        if loss_mask is not None:
            rows = torch.nonzero(loss_mask.bool(), as_tuple=False).squeeze(-1)
        else:
            rows = torch.arange(n, device=device)

        behaviour = batch.get(Columns.ACTION_DIST_INPUTS)
        if behaviour is not None and tuple(behaviour.shape) == (n, width, NUM_CHANNELS):
            dist_inputs = behaviour.detach().float().clone()
        else:
            dist_inputs = torch.zeros((n, width, NUM_CHANNELS), dtype=torch.float32, device=device)
        hidden_size = self.model.config.get_text_config().hidden_size
        embeddings = torch.zeros((n, hidden_size), dtype=torch.float32, device=device)
        if rows.numel() == 0:
            return {Columns.ACTION_DIST_INPUTS: dist_inputs, Columns.EMBEDDINGS: embeddings}

        obs, obs_len = batch[Columns.OBS][rows], batch[OBS_LEN][rows].long()
        act, act_len = actions[rows], batch[ACTIONS_LEN][rows].long()
        p = max(1, int(obs_len.max()))
        r = max(1, int(act_len.max()))
        input_ids, attention_mask, token_mask = prompt_completion_from_padded(obs, obs_len, act, act_len, p, r)
        # The decoder, then the LM head over the R scored positions in chunks of
        # logit_chunk_tokens (core/chunked_logprobs.py): never [tokens x vocabulary] logits.
        with self.autocast():
            logp, entropy, hidden = score_completions(
                self.model,
                input_ids,
                attention_mask,
                r,
                temperature=self.temperature,
                with_entropy=True,
                with_hidden=True,
                chunk_tokens=self.logit_chunk_tokens,
            )
        packed = pack_dist_inputs(logp, entropy, token_mask, input_ids[:, -r:])
        if r < width:
            packed = nn.functional.pad(packed, (0, 0, 0, width - r))
        dist_inputs[rows] = packed
        embeddings[rows] = hidden[:, p - 1].float()
        return {Columns.ACTION_DIST_INPUTS: dist_inputs, Columns.EMBEDDINGS: embeddings}

    @override(ValueFunctionAPI)
    def compute_values(self, batch: Dict[str, Any], embeddings: Optional[Any] = None) -> torch.Tensor:
        if getattr(self, "value_head", None) is None:
            raise RuntimeError(
                "this LLMPPOTorchRLModule was built inference_only: it has no value head (compute_values runs on the learner's module)"
            )
        if embeddings is None:
            grad = contextlib.nullcontext() if self.vf_share_layers else torch.no_grad()
            with grad:
                embeddings = self.prompt_embeddings(batch[Columns.OBS], batch[OBS_LEN])
        if not self.vf_share_layers:
            embeddings = embeddings.detach()
        return self.value_scale * self.value_head(embeddings.float()).squeeze(-1)

    def prompt_embeddings(self, obs: torch.Tensor, obs_len: torch.Tensor) -> torch.Tensor:
        """Final hidden state at the last prompt token of left-padded ``obs`` rows, ``[N, H]``,
        from the LM's decoder alone (no vocabulary projection), ``value_batch_size`` rows
        at a time."""
        decoder = self.model.get_decoder()
        out = []
        for start in range(0, obs.shape[0], self.value_batch_size):
            o, ln = obs[start : start + self.value_batch_size], obs_len[start : start + self.value_batch_size].long()
            p = max(1, int(ln.max()))
            ids = o[:, -p:].long()
            mask = (torch.arange(p, device=o.device)[None, :] >= (p - ln)[:, None]).long()
            with self.autocast():
                h = decoder(
                    input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False
                ).last_hidden_state
            out.append(h[:, -1].float())
        return torch.cat(out, 0) if out else torch.zeros((0, self.value_head.in_features), device=obs.device)


class PadLLMEpisodes(ConnectorV2):
    """Learner connector piece: :class:`LLMEnvRunner` episodes -> stackable columns.

    Set with ``config.learners(learner_connector=PadLLMEpisodes)`` (YAML:
    ``learner_connector: rllib_exgrpo.rllib.ppo_module:PadLLMEpisodes``). RLlib puts custom
    pieces after PPO's ``AddOneTsToEpisodesAndTruncate`` and before its default pieces,
    which then skip the columns written here. For every timestep of every episode it adds
    (widths: the longest prompt / completion among this call's episodes):

    * ``obs``: prompt ids left-padded with 0, and ``obs_len``;
    * ``actions``: completion ids right-padded with 0, and ``actions_len``;
    * ``action_logp``: the **sum** of the per-token behaviour log-probs the runner
      recorded (PPO's ratio is ``exp(logp - action_logp)``);
    * ``action_dist_inputs``: the behaviour policy's :class:`CompletionDistribution`
      inputs (token log-probs, entropy unknown = 0, mask, token ids), which PPO's loss
      turns into the "previous" distribution for its KL term.
    """

    @override(ConnectorV2)
    def __call__(
        self,
        *,
        rl_module,
        batch: Dict[str, Any],
        episodes: List[Any],
        explore: Optional[bool] = None,
        shared_data: Optional[dict] = None,
        **kwargs,
    ) -> Any:
        episodes = list(self.single_agent_episode_iterator(episodes, agents_that_stepped_only=False))
        if not episodes:
            return batch
        data = []
        for e in episodes:
            n = len(e)
            obs = [np.asarray(o).reshape(-1) for o in e.get_observations(slice(0, n))]
            acts = [np.asarray(a).reshape(-1) for a in e.get_actions(slice(0, n))]
            if Columns.ACTION_LOGP not in e.extra_model_outputs:
                raise ValueError(
                    "PadLLMEpisodes: episode without per-token behaviour log-probs "
                    f"(extra model output {Columns.ACTION_LOGP!r}); sample with return_logprobs=True"
                )
            lps = [np.asarray(x, dtype=np.float32).reshape(-1) for x in e.get_extra_model_outputs(Columns.ACTION_LOGP, slice(0, n))]
            for a, lp in zip(acts, lps):
                if len(a) != len(lp):
                    raise ValueError(f"PadLLMEpisodes: completion of {len(a)} tokens has {len(lp)} behaviour log-probs")
            data.append((e, n, obs, acts, lps))
        p = max(1, max(len(o) for _, _, obs, _, _ in data for o in obs))
        r = max(1, max(len(a) for _, _, _, acts, _ in data for a in acts))

        for e, n, obs, acts, lps in data:
            obs_rows, act_rows, dist_rows = [], [], []
            for o, a, lp in zip(obs, acts, lps):
                row = np.zeros(p, dtype=np.int64)
                if len(o):
                    row[p - len(o) :] = o
                obs_rows.append(row)
                arow = np.zeros(r, dtype=np.int64)
                arow[: len(a)] = a
                act_rows.append(arow)
                d = np.zeros((r, NUM_CHANNELS), dtype=np.float32)
                d[: len(a), CH_LOGP] = lp
                d[: len(a), CH_MASK] = 1.0
                d[: len(a), CH_TOKEN] = a
                dist_rows.append(d)
            self.add_n_batch_items(batch, Columns.OBS, obs_rows, n, e)
            self.add_n_batch_items(batch, OBS_LEN, [np.int64(len(o)) for o in obs], n, e)
            self.add_n_batch_items(batch, Columns.ACTIONS, act_rows, n, e)
            self.add_n_batch_items(batch, ACTIONS_LEN, [np.int64(len(a)) for a in acts], n, e)
            self.add_n_batch_items(batch, Columns.ACTION_LOGP, [np.float32(lp.sum(dtype=np.float64)) for lp in lps], n, e)
            self.add_n_batch_items(batch, Columns.ACTION_DIST_INPUTS, dist_rows, n, e)
        return batch


# ---------------------------------------------------------------- the model_config keys

#: Every ``model_config`` key that RLlib's PPO on this project's LLM reads: name ->
#: (default, who reads it, meaning). ``None`` defaults of the runner's and held-out keys are
#: ExGRPOConfig's field defaults (``rllib/config_fields.py``), filled in by
#: :func:`ppo_model_config_keys`. docs/ppo.md has the same table (a test checks).
_MODULE_KEYS: Dict[str, tuple] = {
    "model": ("tiny", "module, env runner", "model name, folder or hub id (the env runner loads its tokenizer too)"),
    "dtype": ("float32", "module, env runner", "compute dtype: float32 | bfloat16 | float16 (vLLM samples in it)"),
    "master_dtype": (
        "float32 when dtype is half and no LoRA",
        "learner module",
        "the learner keeps its weights in this dtype and computes under autocast in dtype "
        "(mixed precision); env runners build the model in dtype",
    ),
    "gradient_checkpointing": (False, "learner module", "recompute activations in the backward pass"),
    "attn_implementation": ("auto", "module", "attention kernel (core/attention.py)"),
    "logit_chunk_tokens": (
        "core.chunked_logprobs.DEFAULT_CHUNK_TOKENS",
        "module",
        "positions per chunk of the LM head and log-softmax (no [tokens x vocabulary] logits)",
    ),
    "temperature": (1.0, "module, env runner", "sampling temperature; log-probs are computed at it"),
    "lora_rank": (0, "learner module", "LoRA adapters of this rank on the learner (0: full fine-tuning)"),
    "lora_alpha": (32.0, "learner module", "LoRA alpha (scale alpha / rank)"),
    "lora_dropout": (0.0, "learner module", "LoRA dropout"),
    "lora_target_modules": ("all-linear", "learner module", "LoRA targets: all-linear or a list of module names"),
    "lora": (None, "learner module", "the nested form {rank, alpha, dropout, target_modules} (lora_* are its flat keys)"),
    "vf_share_layers": (False, "learner module", "True: value-loss gradients reach the LM too"),
    "value_batch_size": (64, "learner module", "rows per prompt-only pass of compute_values (PPO's GAE pass)"),
    "value_scale": (1.0, "learner module", "V = value_scale x value_head(h): the value head's effective lr under Adam"),
}
#: The env runner's keys (``RunnerSettings``), besides model / dtype / temperature above.
_RUNNER_KEYS = (
    "group_size",
    "top_p",
    "max_prompt_tokens",
    "max_response_tokens",
    "generation_backend",
    "generation_batch_size",
    "hf_decoder",
    "vllm_kwargs",
    "behaviour_logprobs",
    "scoring_on",
    "heldout_dataset",
    "heldout_split",
)
#: :class:`LLMHeldoutCallback`'s keys.
_HELDOUT_KEYS = ("heldout_num_questions", "heldout_interval", "heldout_samples", "heldout_temperature", "heldout_max_response_tokens")
#: Read by the memory plan only (``rllib/ppo_memory_plan.py``).
_PLAN_KEYS = ("gpu_memory_gb",)

#: What the PPO path cannot do: model_config key -> why (one line each; docs/ppo.md).
PPO_REFUSED = {
    "colocate": "RLlib's PPO cannot colocate: its learners never hand the GPU to a sampler between "
    "updates; give the env runners GPUs of their own (num_gpus_per_env_runner, a fraction of "
    "one GPU included) instead",
    "learner_backend": "RLlib's PPO trains on its own PPOTorchLearner (torch DDP over num_learners); DeepSpeed "
    "ZeRO is ExGRPO / GRPO's learner only: use LoRA (lora_rank) where the model states do not "
    "fit a GPU",
    "deepspeed_zero_stage": "RLlib's PPO has no DeepSpeed learner (see learner_backend)",
    "deepspeed": "RLlib's PPO has no DeepSpeed learner (see learner_backend)",
    "learner_micro_batch_tokens": "RLlib's PPO makes one forward/backward pass per minibatch: set minibatch_size "
    "(learner rows, 2 per completion) to what fits",
    "learner_micro_batch_rows": "RLlib's PPO makes one forward/backward pass per minibatch: set minibatch_size "
    "(learner rows, 2 per completion) to what fits",
    "model_name_or_path": "the model is model_config's `model` under RLlib's PPO",
    "model_dtype": "the dtype is model_config's `dtype` under RLlib's PPO",
}


def ppo_model_config_keys() -> Dict[str, tuple]:
    """Every ``model_config`` key PPO reads: name -> (default, reader, meaning)."""

    defaults = field_defaults()
    out = dict(_MODULE_KEYS)
    out["logit_chunk_tokens"] = (DEFAULT_CHUNK_TOKENS,) + out["logit_chunk_tokens"][1:]
    for name in _RUNNER_KEYS:
        out[name] = (defaults[name], "env runner", FIELDS_BY_NAME[name].doc)
    for name in _HELDOUT_KEYS:
        out[name] = (defaults[name], "held-out callback (LLMHeldoutCallback)", FIELDS_BY_NAME[name].doc)
    for name in _PLAN_KEYS:
        out[name] = (defaults[name], "memory plan (--dry-run)", FIELDS_BY_NAME[name].doc)
    return out


def ppo_model_config(model_config: Dict[str, Any]) -> Dict[str, Any]:
    """``model_config`` as :class:`LLMPPOTorchRLModule` builds from it: the flat ``lora_*``
    keys gathered into the module's ``lora`` entry, and ``master_dtype: float32`` for a
    half-precision learner without LoRA where it is not given (an AdamW step at an LLM's lr
    rounds away on bf16 weights; ExGRPO's DDP learner keeps the same fp32 master copy)."""
    mc = dict(model_config or {})
    rank = int(mc.get("lora_rank") or 0)
    if rank > 0 and not mc.get("lora"):
        mc["lora"] = {
            "rank": rank,
            "alpha": float(mc.get("lora_alpha", 32.0)),
            "dropout": float(mc.get("lora_dropout", 0.0)),
            "target_modules": mc.get("lora_target_modules", "all-linear"),
        }
    half = str(mc.get("dtype", "float32")) in ("bfloat16", "float16")
    if half and "master_dtype" not in mc and not (mc.get("lora") or {}).get("rank"):
        mc["master_dtype"] = "float32"
    return mc


def model_config_problems(model_config: Any, where: str = "config.model_config") -> List[str]:
    """One line per ``model_config`` key that RLlib's PPO on this project's LLM would not
    read as meant: unknown keys ("did you mean"), what the PPO path cannot do
    (:data:`PPO_REFUSED`), and a learner scoring that leaves PPO without behaviour log-probs."""
    import difflib

    if not isinstance(model_config, dict):
        return [f"{where}: must be a mapping, got {model_config!r}."]
    known = ppo_model_config_keys()
    out = []
    for key, value in model_config.items():
        if key in PPO_REFUSED:
            if (key == "colocate" and not value) or (key == "learner_backend" and value == "ddp"):
                continue  # what PPO does anyway
            out.append(f"{where}.{key}: {PPO_REFUSED[key]} (docs/ppo.md).")
        elif key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=3, cutoff=0.6)
            hint = f" Did you mean: {', '.join(repr(c) for c in close)}?" if close else ""
            out.append(
                f"{where}.{key}: not a key RLlib's PPO on the LLM reads (LLMPPOTorchRLModule, LLMEnvRunner).{hint} Known keys: docs/ppo.md."
            )
    if model_config.get("scoring_on") == "learners" and model_config.get("behaviour_logprobs", "recompute") == "recompute":
        out.append(
            f"{where}.scoring_on: 'learners' with behaviour_logprobs 'recompute' leaves PPO's episodes "
            "without behaviour log-probs (its learners take them from the env runners): scoring_on: "
            "runners, or behaviour_logprobs: engine (vLLM's own) (docs/ppo.md)."
        )
    return out


# ---------------------------------------------------------------- held-out evaluation


class LLMHeldoutCallback(RLlibCallback):
    """ExGRPO's held-out evaluation under RLlib's PPO (``callbacks:
    rllib_exgrpo.rllib.ppo_module:LLMHeldoutCallback``): the same questions (the first
    ``heldout_num_questions`` of ``heldout_dataset`` / ``heldout_split``), samples, temperature
    and token limit, before training and after every ``heldout_interval`` iterations, through
    the first env runner; reported as ``heldout/accuracy``, ``heldout/after_iteration`` and
    ``heldout/initial_accuracy``. Settings from the module's ``model_config`` (field defaults
    where missing); without ``heldout_dataset`` it does nothing."""

    def __init__(self):
        super().__init__()
        self._evaluator = None
        self._settings = None

    def _setup(self, algorithm):
        if self._settings is not None:
            return self._evaluator
        from types import SimpleNamespace

        mc = module_model_config(algorithm.config)
        defaults = field_defaults()
        names = ("heldout_dataset", "heldout_split", "max_response_tokens") + _HELDOUT_KEYS
        values = {n: (mc[n] if mc.get(n) is not None else defaults[n]) for n in names}
        self._settings = SimpleNamespace(env_config=dict(algorithm.config.env_config or {}), **values)
        if self._settings.heldout_dataset:
            self._evaluator = HeldoutEvaluator(self._settings, lambda q, n, **kw: (self._sample(algorithm, q, n, **kw), None))
        return self._evaluator

    @staticmethod
    def _sample(algorithm, question_ids, num_samples, **kwargs):
        group = algorithm.env_runner_group
        if group.num_remote_env_runners() > 0:
            return group.foreach_env_runner(
                lambda r: r.sample(question_ids=question_ids, num_samples=num_samples, **kwargs),
                remote_worker_ids=[group.healthy_worker_ids()[0]],
                local_env_runner=False,
            )[0]
        return group.local_env_runner.sample(question_ids=question_ids, num_samples=num_samples, **kwargs)

    @override(RLlibCallback)
    def on_algorithm_init(self, *, algorithm, metrics_logger=None, **kwargs) -> None:
        ev = self._setup(algorithm)
        if ev is not None and algorithm.iteration == 0:
            ev.initial_accuracy = ev.evaluate()["accuracy"]

    @override(RLlibCallback)
    def on_train_result(self, *, algorithm, metrics_logger=None, result, **kwargs) -> None:
        ev = self._setup(algorithm)
        if ev is None:
            return
        done = int(result.get("training_iteration", algorithm.iteration))
        if not ev.due(done) or done == 0:
            if ev.initial_accuracy is not None:
                result.setdefault("heldout", {})["initial_accuracy"] = ev.initial_accuracy
            return
        accuracy = ev.evaluate()["accuracy"]
        heldout = result.setdefault("heldout", {})
        heldout.update(accuracy=accuracy, after_iteration=done)
        if ev.initial_accuracy is not None:
            heldout["initial_accuracy"] = ev.initial_accuracy
