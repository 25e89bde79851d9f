"""The memory plan of RLlib's PPO on this project's LLM (``run: PPO`` with ``LLMEnvRunner`` and
``LLMPPOTorchRLModule``; docs/ppo.md).

PPO's settings live in two places: RLlib's own (``num_learners``, ``num_gpus_per_learner``,
``num_env_runners``, ``num_gpus_per_env_runner``, ``minibatch_size``, ``torch_ddp_kwargs``) and
the module's ``model_config`` (model, dtype, LoRA, token limits, generation backend, ...).
:func:`ppo_plan_view` reads both into an object with ExGRPO's field names, so the same plan
(:func:`rllib_exgrpo.planning.memory.plan_memory`) counts the learner and the env runners;
:func:`plan_ppo_memory` then adds what PPO's learner holds beyond it:

* the **value head** (``Linear(hidden, 1)`` in fp32: weights, gradient and Adam's two moments,
  16 bytes a parameter);
* PPO's **GAE pass** (``compute_values`` without embeddings: a no-grad, prompt-only decoder pass
  of ``value_batch_size`` rows before the update), where it peaks above the update;

and reads PPO's pass as it runs: one padded forward/backward pass per minibatch (no micro-
batches), over its real rows only (``minibatch_size`` counts PPO's learner rows, two per
completion: the phantom bootstrap row is skipped by the module), on the DDP learner (fp32
master weights of a half-precision model, or a LoRA learner), weights synced through the object
store (host memory), no KL reference model (PPO's KL term is against the stored behaviour
log-probs).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

from rllib_exgrpo.planning.memory import (
    GIB,
    ActorPlan,
    Item,
    MemoryPlan,
    plan_memory,
    scoring_activation_bytes,
)
from rllib_exgrpo.rllib.config_fields import field_defaults
from rllib_exgrpo.rllib.env_runner import module_model_config
from rllib_exgrpo.rllib.ppo_module import ppo_model_config

#: The module's keys that differ from ExGRPO's field names.
_RENAMED = {"model": "model_name_or_path", "dtype": "model_dtype"}


def is_llm_ppo_config(config: Any) -> bool:
    """Whether ``config`` is an algorithm config that is not this project's but samples with
    ``LLMEnvRunner`` (RLlib's PPO on the LLM)."""
    if hasattr(config, "model_name_or_path"):
        return False
    import sys

    mod = sys.modules.get("rllib_exgrpo.rllib.env_runner")
    runner = getattr(config, "env_runner_cls", None)
    return mod is not None and isinstance(runner, type) and issubclass(runner, mod.LLMEnvRunner)


def ppo_plan_view(config: Any) -> Optional[SimpleNamespace]:
    """The PPO config as the memory plan reads a config (ExGRPO's field names), or None when it
    is not RLlib's PPO on the LLM."""
    if not is_llm_ppo_config(config):
        return None

    mc = ppo_model_config(module_model_config(config))
    values = field_defaults()
    for key, value in mc.items():
        name = _RENAMED.get(key, key)
        if name in values and value is not None:
            values[name] = value
    lora = mc.get("lora") or {}
    if int(lora.get("rank") or 0) > 0:
        values.update(
            lora_rank=int(lora["rank"]),
            lora_alpha=float(lora.get("alpha", 32.0)),
            lora_target_modules=lora.get("target_modules", "all-linear"),
        )
    rows = int(getattr(config, "minibatch_size", None) or getattr(config, "train_batch_size_per_learner", 0) or 1)
    values.update(
        learner_backend="ddp",
        colocate=False,
        kl_coeff=0.0,
        weight_sync="object_store",
        learner_micro_batch_rows=None,
        learner_micro_batch_tokens=None,
        learner_sequence_packing=False,
        # PPO's learner rows: two per completion; the module's pass holds the real ones only.
        minibatch_size=max(1, -(-rows // 2)),
        num_learners=int(getattr(config, "num_learners", 0) or 0),
        num_gpus_per_learner=float(getattr(config, "num_gpus_per_learner", 0) or 0),
        num_env_runners=int(getattr(config, "num_env_runners", 0) or 0),
        num_gpus_per_env_runner=float(getattr(config, "num_gpus_per_env_runner", 0) or 0),
        torch_ddp_kwargs=dict(getattr(config, "torch_ddp_kwargs", None) or {}),
        ppo_minibatch_rows=rows,
        value_batch_size=int(mc.get("value_batch_size", 64) or 64),
        # The plan's steps and time count completions per iteration, questions x group_size:
        # RLlib's train_batch_size_per_learner counts completions (env steps) per learner.
        questions_per_step=max(
            1,
            int(getattr(config, "train_batch_size_per_learner", 0) or 0)
            * max(1, int(getattr(config, "num_learners", 0) or 0))
            // int(values["group_size"]),
        ),
        # vf_share_layers false (PPO's default): the value network is a second trunk.
        ppo_value_trunk=not bool(mc.get("vf_share_layers", False)),
    )
    return SimpleNamespace(**values)


def value_head_bytes(hidden_size: int) -> int:
    """``Linear(hidden, 1)`` in fp32 with its gradient and Adam's two moments."""
    return 16 * (int(hidden_size) + 1)


def plan_ppo_memory(config: Any, *, gpu_memory: Optional[int] = None, gpu_memory_source: str = "") -> MemoryPlan:
    """The memory plan of RLlib's PPO on the LLM (see the module doc)."""
    view = ppo_plan_view(config)
    if view is None:
        raise ValueError("not RLlib's PPO on this project's LLM env runner")
    learner_scores = view.scoring_on == "learners"
    plan = plan_memory(view, gpu_memory=gpu_memory, gpu_memory_source=gpu_memory_source)
    plan.notes.append(
        f"RLlib's PPO: one padded pass per minibatch of {view.ppo_minibatch_rows} learner rows "
        f"({view.minibatch_size} completions; PPO's phantom bootstrap rows are not run), DDP learner"
        + (f", LoRA rank {view.lora_rank}" if view.lora_rank else "")
        + ", weights synced through the object store"
    )
    shape = plan.shape
    learner = next((a for a in plan.actors if a.kind == "learner"), None)
    if shape is None or learner is None:
        return plan
    if learner_scores:  # vLLM's own log-probs: the learners score nothing before the update
        learner.items = [it for it in learner.items if it.what != "scoring pass"]
        learner.notes = [n for n in learner.notes if not n.startswith("scoring_on: learners")]
    at = len(learner.items) - 1  # before the CUDA context line
    while at > 0 and learner.items[at].what != "CUDA context, workspaces":
        at -= 1
    head = value_head_bytes(shape.hidden_size)
    learner.items.insert(
        at, Item("value head", head, f"Linear({shape.hidden_size}, 1) fp32: weights, gradient, Adam's 2 moments ({head:,} bytes)")
    )
    prompt = int(view.max_prompt_tokens)
    gae = scoring_activation_bytes(
        shape, view.value_batch_size, prompt, response_tokens=1, dtype_bytes=2 if str(view.model_dtype) != "float32" else 4
    )
    update = sum(it.bytes for it in learner.items if it.what in ("activations", "backward working set"))
    if gae > update:
        learner.items.insert(
            at + 1,
            Item(
                "GAE value pass",
                gae - update,
                f"no-grad prompt pass, value_batch_size {view.value_batch_size} x {prompt} tokens, beyond the update's peak",
            ),
        )
    else:
        learner.notes.append(
            f"GAE value pass ({gae / GIB:.2f} GiB: value_batch_size {view.value_batch_size} rows x "
            f"{prompt} prompt tokens, no grad) runs before the update and peaks below it"
        )
    _ppo_advice(learner, view)
    return plan


def _ppo_advice(learner: ActorPlan, view: SimpleNamespace) -> None:
    """The learner's advice in RLlib's PPO's terms: a pass there is a whole minibatch (no micro
    batches to shrink), and there is no DeepSpeed learner to switch to."""
    if learner.budget is not None and learner.fits is False and learner.key in ("learner_micro_batch_rows", "learner_micro_batch_tokens"):
        import re

        rows = re.search(r"learner_micro_batch_rows: (\d+) fits", learner.advice)
        tokens = re.search(r"learner_micro_batch_tokens: (\d+) fits", learner.advice)
        width = int(view.max_prompt_tokens) + int(view.max_response_tokens)
        fit = int(rows.group(1)) if rows else (int(tokens.group(1)) // max(1, width) if tokens else 0)
        learner.key = "minibatch_size"
        learner.advice = (
            learner.advice.split(" are left")[0] + " are left: under RLlib's PPO a pass is a whole "
            "minibatch (learner rows, 2 per completion): " + (f"minibatch_size: {2 * fit} fits" if fit else "lower minibatch_size")
        )
    elif learner.fits is False and learner.key in ("learner_backend", "deepspeed_zero_stage"):
        learner.key = "model_config.lora_rank"
        learner.advice = (
            "RLlib's PPO has no DeepSpeed learner: the DDP learner's model states do not fit; train LoRA adapters (model_config.lora_rank)"
        )
