"""Colocated placement (``colocate: true``): generation inside the learner process.

Each learner samples its share of a step's questions itself, with a
:class:`ColocatedSampler`: an :class:`~rllib_exgrpo.rllib.env_runner.LLMEnvRunner` built in
the learner process (as RLlib's local env runner is built in the main process) whose module
is the learner's own. It renders prompts, generates, verifies and returns the same
single-step episodes a remote env runner returns, so the algorithm's step (replay, groups,
advantages, metrics) does not change.

* **HF backend**: the runner samples from the learner's model itself, one copy of the
  weights, nothing synced. On a LoRA learner that model has its adapters injected and
  active, so generation comes from the adapted weights (the merged view, never merged in
  place). The model is put in eval mode for the turn and under the module's autocast (the
  compute dtype of a master-weight learner), so behaviour log-probs are the learner's.
* **vLLM backend**: the engine is built in the learner process (``enable_sleep_mode`` on
  CUDA) and the learner and engine take turns (:meth:`ColocatedSampler.turn`)::

      offload optimizer state -> wake engine -> push weights -> generate
          -> engine sleeps (level 2: weights and KV cache dropped) -> reload optimizer state

  After a level-2 sleep the engine holds no weights, so every weight is pushed again on
  every wake, in process, one layer at a time (``models/weight_buckets.py``; a LoRA layer
  merged as it goes). vLLM's CPU build has no sleep mode: the sleep and wake calls are
  skipped, said once.
* **DeepSpeed learners**: ZeRO-1/2 keep the full compute-dtype weights on every rank, so
  they sample as above. Under ZeRO-3 each rank holds 1/N of every weight: every rank
  gathers one layer at a time (a collective, the same order everywhere, ranks with no
  questions included) and pushes it into its own engine, or, with the HF backend, into a
  plain copy of the model the sampler keeps for generation (on the host between turns
  where the learner is on a GPU). Optimizer state goes to host memory and back
  (``rllib/optimizer_offload.py``: DeepSpeed's ``offload_states`` / ``reload_states`` for
  what they move with the learners' torch AdamW, the rest moved by that module).

:class:`TurnRecord` keeps the order of the protocol's calls and, after each, whether the
engine was awake and whether the optimizer state was on the device, so a test can check
that no phase has both.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import sys
from typing import Callable, Deque, List, Optional, Sequence

import torch

from rllib_exgrpo.rllib.optimizer_offload import OptimizerOffload, optimizer_state_tensors  # noqa: F401
from rllib_exgrpo.models.weight_buckets import plain_weight_buckets

logger = logging.getLogger(__name__)

#: The protocol's calls, in the order one turn makes them (vLLM; the HF backend only generates).
PHASES = ("offload_optimizer", "wake_weights", "push_weights", "wake_kv_cache", "generate", "sleep", "reload_optimizer")
#: vLLM's sleep level: 2 drops the weights too (they are pushed again on wake).
SLEEP_LEVEL = 2
#: What a colocated turn logs on the learner's env runner (``env_runners/``).
COLOCATION_METRICS = ("optimizer_offload_bytes",)


@dataclasses.dataclass
class TurnEvent:
    phase: str
    engine_awake: bool
    optimizer_on_device: bool


class TurnRecord:
    """The protocol's calls in order, with the state after each (see the module doc); the
    last ``keep`` of them."""

    def __init__(self, keep: int = 10_000):
        self.events: Deque[TurnEvent] = collections.deque(maxlen=keep)

    def note(self, phase: str, *, engine_awake: bool, optimizer_on_device: bool) -> None:
        self.events.append(TurnEvent(phase, engine_awake, optimizer_on_device))

    @property
    def phases(self) -> List[str]:
        return [e.phase for e in self.events]

    def overlaps(self) -> List[str]:
        """Phases after which the engine was awake while the optimizer state was on the device."""
        return [e.phase for e in self.events if e.engine_awake and e.optimizer_on_device]


def engine_build_is_collective() -> bool:
    """Whether building a vLLM engine in this process is a collective of the learners.

    vLLM 0.32 takes torch's default process group as its world when one exists
    (``vllm.distributed.parallel_state.init_distributed_environment`` skips
    ``init_process_group`` and makes its world group of ``range(get_world_size())``;
    ``initialize_model_parallel`` then calls ``new_group`` for every tensor/pipeline/data
    parallel group of that world), on the CPU build as on a GPU (``CPUWorker.init_device``
    calls the same ``init_worker_distributed_environment``). So with DDP or DeepSpeed
    learners every learner must build its engine in the same step; each engine still has a
    tensor-parallel group of one (its own rank) and, built with the uni-process executor, no
    collective after its build."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# ---- the sampler inside the learner -------------------------------------------------------
def is_partitioned(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are ZeRO-3 partitions (DeepSpeed's ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


@contextlib.contextmanager
def gathered(params: Sequence[torch.nn.Parameter]):
    """The full tensors of ``params`` inside the block where they are ZeRO-3 partitions
    (``GatheredParameters``: a collective, read-only); nothing to do otherwise."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


class ColocatedSampler:
    """An ``LLMEnvRunner`` in the learner's process, sampling from the learner's weights.

    Args:
        config: the algorithm config (the learner's ``self.config``).
        module: the learner's ``LLMTorchRLModule`` (unwrapped from DDP).
        index: the learner's rank (seeds its env and a vLLM engine apart from the others').
        optimizers: returns the learner's torch optimizers (offloaded around vLLM's turn).
        engines: returns the learner's DeepSpeed engines (their own state offload).
        runner: an already built runner (tests); by default one is built over ``module``.
    """

    def __init__(
        self,
        config,
        module,
        *,
        index: int = 0,
        optimizers: Callable[[], Sequence[torch.optim.Optimizer]] = lambda: (),
        engines: Callable[[], Sequence] = lambda: (),
        runner=None,
    ):
        self.module = module
        self.index = index
        #: Lines for the user not yet handed to the driver (:meth:`pop_notes`), said once.
        self.notes: List[str] = []
        #: ZeRO-3: the learner's weights are partitions, gathered layer by layer for each turn.
        self.partitioned = is_partitioned(module)
        if runner is None:
            # lazy: the GPU check imports this module (OptimizerOffload) where Ray is not installed
            from rllib_exgrpo.rllib.env_runner import LLMEnvRunner

            runner = LLMEnvRunner(config=config, worker_index=index)
            if self.partitioned and config.generation_backend != "vllm":
                # The HF backend cannot generate from partitions: a plain copy of the model,
                # filled from the gathered layers on every turn.
                runner.make_module()
            else:
                runner.attach_module(module)
        #: The env runner that renders, generates, verifies and makes the episodes.
        self.runner = runner
        if self.uses_engine:
            # The engine's first weights come from the pushes of :meth:`push_weights`, which
            # gather partitions and merge LoRA layers; the module's state dict would do neither.
            self.backend.push_on_build = False
        self.offload = OptimizerOffload(optimizers, engines)
        self.record = TurnRecord()
        self._said_no_sleep = False

    @property
    def backend(self):
        return self.runner.backend

    @property
    def uses_engine(self) -> bool:
        """Whether a separate engine (vLLM) holds its own weights and takes turns."""
        return self.runner.settings.generation_backend == "vllm"

    @property
    def own_copy(self) -> bool:
        """Whether the sampler generates from a copy of the weights (vLLM's, or the HF copy
        under ZeRO-3) that each turn refills, rather than from the learner's model itself."""
        return self.uses_engine or self.runner.module is not self.module

    def pop_notes(self) -> List[str]:
        """The lines noted since the last call (the driver prints them: a learner actor's
        own output may not reach the user)."""
        notes, self.notes = self.notes, []
        return notes

    def sample(self, **kwargs) -> list:
        """``LLMEnvRunner.sample`` in one turn (see :meth:`turn`)."""
        with self.turn():
            return self.runner.sample(**kwargs)

    def take_part(self) -> None:
        """A turn without sampling, for a rank with no questions this step, where the turn
        holds collectives every rank must enter: under ZeRO-3 the weight gathers; and a vLLM
        engine's build while the learners' process group exists (DDP or DeepSpeed
        learners), since vLLM 0.32 then builds its own groups over the learners' world
        (``torch.distributed.new_group`` on every rank: :func:`engine_build_is_collective`)."""
        if self.partitioned or (self.uses_engine and getattr(self.backend, "llm", None) is None and engine_build_is_collective()):
            with self.turn():
                pass

    def score_trajectories(self, prompts, completions):
        with self._model_for_inference():
            return self.runner.score_trajectories(prompts, completions)

    def get_metrics(self):
        return self.runner.get_metrics()

    @contextlib.contextmanager
    def _model_for_inference(self):
        """Eval mode (no dropout) and the learner's autocast around sampling and scoring."""
        model = self.module.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self.module.autocast():
                yield
        finally:
            model.train(was_training)

    @contextlib.contextmanager
    def turn(self):
        """One generation turn. HF: the learner's model, in eval mode under its autocast (or,
        under ZeRO-3, its plain copy refilled first). vLLM: optimizer state off the device,
        engine awake with the current weights, and after the body the engine asleep and the
        optimizer state back (module doc)."""
        self._free_gradients()
        if not self.own_copy:
            with self._model_for_inference():
                yield
            self._note("generate")
            return
        moved = self.offload.offload()
        # The bytes a turn moved off the device (env_runners/optimizer_offload_bytes).
        self.runner.metrics.log_value("optimizer_offload_bytes", moved, window=1)
        if not self.offload.said and moved:  # once, by the first learner: what a turn moves
            if self.index == 0:
                self.notes.append(self.offload.describe())
            self.offload.said = True
        self._note("offload_optimizer")
        try:
            self._wake_with_weights()
            with self._model_for_inference():
                yield
            self._note("generate")
        finally:
            self._sleep()
            self.offload.reload()
            self._note("reload_optimizer")

    def _free_gradients(self) -> None:
        """The last update's gradients are not needed again (the next update zeroes them,
        set to None): drop them, so the turn has their memory."""
        for p in self.module.parameters():
            p.grad = None

    # ---- the weights the sampler generates from ------------------------------------------
    def push_weights(self) -> int:
        """The learner's current weights into the sampler's copy, one layer at a time
        (gathered under ZeRO-3, LoRA layers merged); returns the tensors pushed. Every rank
        of a ZeRO-3 group calls it at the same point.

        Into a vLLM engine this is one load per turn: the layers go as one stream of buckets
        that the engine's single reload consumes, each layer gathered only while the
        engine reads it (``VLLMGenerationBackend.push_weight_buckets``; under ZeRO-3 each
        tensor is cloned as it goes in, since vLLM may keep a tensor of an unfinished layer
        after its bucket is released)."""
        buckets = plain_weight_buckets(self.module.model)
        if self.uses_engine:

            def stream():
                for params, read in buckets:
                    with gathered(params):
                        yield read()

            pushed = self.backend.push_weight_buckets(stream(), copy=self.partitioned)
            self.backend.weights_changed()
            return pushed
        target = self.runner.module.model.state_dict()
        pushed = 0
        for params, read in buckets:
            with gathered(params):
                tensors = read()
                for name, value in tensors.items():
                    target[name].copy_(value)
                pushed += len(tensors)
        return pushed

    # ---- the engine's side (vLLM) -----------------------------------------------------------
    def _sleep_mode(self) -> bool:
        llm = getattr(self.backend, "llm", None)
        on = bool(
            llm is not None
            and getattr(getattr(llm.llm_engine, "vllm_config", None), "model_config", None)
            and getattr(llm.llm_engine.vllm_config.model_config, "enable_sleep_mode", False)
        )
        if not on and not self._said_no_sleep:
            print("colocate: this vLLM engine has no sleep mode (vLLM's CPU build): skipping its sleep and wake calls", flush=True)
            self._said_no_sleep = True
        return on

    @property
    def engine_awake(self) -> bool:
        return bool(getattr(self.backend, "awake", False))

    def _wake_with_weights(self) -> None:
        if not self.uses_engine:  # the HF copy (ZeRO-3): on the learner's device, refilled
            self.runner.module.to(self._learners_device())
            self.backend.awake = True
            self._note("wake_weights")
            self.push_weights()
            self._note("push_weights")
            self._note("wake_kv_cache")
            return
        backend = self.backend
        built = getattr(backend, "llm", None) is None
        if built:
            backend.build_engine()  # built awake (KV cache included), with the checkpoint's weights
        elif self._sleep_mode():
            backend.llm.wake_up(tags=["weights"])
        backend.awake = True
        self._note("wake_weights")
        self.push_weights()  # a level-2 sleep dropped every weight; a new engine has the checkpoint's
        self._note("push_weights")
        if not built and self._sleep_mode():
            backend.llm.wake_up(tags=["kv_cache"])
        self._note("wake_kv_cache")

    def _sleep(self) -> None:
        backend = self.backend
        if not self.uses_engine:
            self.runner.module.to("cpu")  # the copy waits on the host while the learner trains
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        elif getattr(backend, "llm", None) is not None and self._sleep_mode():
            backend.llm.sleep(level=SLEEP_LEVEL)
        backend.awake = False
        self._note("sleep")

    def _learners_device(self) -> torch.device:
        return next(self.module.parameters()).device

    def _note(self, phase: str) -> None:
        self.record.note(phase, engine_awake=self.engine_awake, optimizer_on_device=self.offload.on_device)


# ---- the algorithm's side ---------------------------------------------------------------------
def learner_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def sample_on_learners(
    learner_group,
    question_ids: Sequence[str],
    num_samples: Sequence[int],
    prompt_prefixes: Optional[Sequence[Optional[str]]] = None,
    **sample_kwargs,
):
    """``(episodes, runner metrics)`` as ``RolloutCoordinator.sample`` returns them, sampled
    by the learners (``colocate``): the questions cut into one contiguous share per learner
    (a question's group stays on one learner), each learner sampling its own share with its
    :class:`ColocatedSampler`. Episodes come back in question order."""
    # lazy: the GPU check imports this module (OptimizerOffload) where Ray is not installed
    from rllib_exgrpo.rllib.rollouts import learner_error, split_evenly

    prefixes = list(prompt_prefixes) if prompt_prefixes is not None else [None] * len(question_ids)
    parts = 1 if learner_group.is_local else max(1, len(learner_group))
    items = list(zip(question_ids, num_samples, prefixes))
    shards = [[list(x) for x in zip(*shard)] if shard else None for shard in split_evenly(items, parts)]
    results = learner_group.foreach_learner(lambda learner, _s=shards, _k=sample_kwargs: learner.colocated_sample(_s, _k))
    by_rank = {}
    for result in results:
        if not getattr(result, "ok", True):
            raise learner_error(result.get(), getattr(result, "actor_id", None), "colocated sampling")
        rank, episodes, metrics, notes = result.get()
        by_rank[rank] = (episodes, metrics)
        for line in notes:
            print(line, file=sys.stderr, flush=True)
    episodes, metrics = [], []
    for rank in sorted(by_rank):
        episodes += by_rank[rank][0]
        if by_rank[rank][1] is not None:
            metrics.append(by_rank[rank][1])
    if len(by_rank) != parts:
        raise RuntimeError(f"colocated sampling: {parts - len(by_rank)} learner(s) returned nothing")
    return episodes, metrics
