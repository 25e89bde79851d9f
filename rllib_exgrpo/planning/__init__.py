"""GPU memory plans: what each actor (learner, env runner) will hold on its GPU.

* :mod:`rllib_exgrpo.planning.shapes`: a model's shape (``ModelShape``) and where it comes
  from (the model's folder, the local Hugging Face cache, or the published shapes of the
  shipped recipes' models).
* :mod:`rllib_exgrpo.planning.cards`: what a GPU offers (the card table: 22.5 GiB of a
  24 GB card, 79.2 GiB of an A100 / H100 80 GB, 139.8 GiB of an H200).
* :mod:`rllib_exgrpo.planning.memory`: model states by backend and ZeRO stage, activations
  and log-prob buffers of the learner's pass and of the runner's scoring pass (masked
  attention's repeated keys and values and its masks), vLLM's share and its KV cache, the
  weight sync's buffers, a LoRA push's merge temporaries, and
  :func:`~rllib_exgrpo.planning.memory.plan_memory` for an ``ExGRPOConfig``.
  ``docs/memory_plan.md`` has the formulas and the measured check.

Nothing here imports RLlib, transformers or DeepSpeed at module level.
"""

from rllib_exgrpo.planning.memory import (
    MemoryPlan,
    learner_activation_bytes,
    model_state_bytes,
    plan_memory,
    scoring_activation_bytes,
)
from rllib_exgrpo.planning.shapes import PUBLISHED_SHAPES, ModelShape, model_shape

__all__ = [
    "MemoryPlan",
    "ModelShape",
    "PUBLISHED_SHAPES",
    "learner_activation_bytes",
    "model_shape",
    "model_state_bytes",
    "plan_memory",
    "scoring_activation_bytes",
]
