"""``DeepSpeedExGRPOLearner``: the ExGRPO learner on a DeepSpeed ZeRO engine (stage 1, 2, 3).

Chosen with ``learner_backend="deepspeed"`` (``ExGRPOConfig.get_default_learner_class``).
Each learner actor of RLlib's ``LearnerGroup`` wraps its module in one DeepSpeed engine
instead of RLlib's DDP; everything else is the ExGRPO learner's own code, reached through
its hooks (this file never copies them):

* the loss: ``compute_losses`` / ``compute_loss_for_module`` of ``ExGRPOTorchLearner``
  (the forward pass goes through the engine, so ZeRO-3 gathers the parameters);
* the gradient: ``engine.backward`` (gradients averaged over the learners, as DDP does;
  ZeRO-2/3 keep only this learner's partition), then the pre-clip global norm that the
  ZeRO optimiser computes over all partitions;
* the guards: ExGRPO's ``postprocess_gradients_for_module`` sees that norm (grad-norm skip,
  NaN/inf) and its ``apply_gradients`` logs ``update_skipped`` / ``skipped_nonfinite``;
  a step it keeps is ``engine.step()`` (AdamW with the config's ``lr`` -- RLlib's schedule
  -- and ``weight_decay``, clipped to ``grad_clip`` by global norm as RLlib clips), a step
  it drops goes through DeepSpeed's own overflow path: no parameter, moment or step count
  changes. The learners agree before stepping (a non-finite loss anywhere is an inf norm
  everywhere, and one learner dropping a step drops it on all): ranks never diverge and
  no collective is left waiting.

The engine step sits *below* ExGRPO's hooks in the method order::

    DeepSpeedExGRPOLearner -> ExGRPOTorchLearner -> DeepSpeedCheckpointing -> _DeepSpeedStep -> TorchLearner

so ``super().apply_gradients`` inside ExGRPO's hook marks the step as kept, and
``_uncompiled_update`` then runs ``engine.step()`` (or the dropped step) on every learner.

State. RLlib asks only its first learner for ``get_state`` (weight sync, checkpoints), so
that call must not start a collective (ZeRO-3's gather would wait forever for the other
ranks). The learner that is asked fetches the other ranks' local pieces through Ray
instead (``_ds_local_partitions``, ``_ds_local_optimizer_state``; the actor handles are
exchanged once at build), which needs no collective:

* ``rl_module``: the full weights in the module's own dtype (ZeRO-3 partitions put back
  together; bf16 as bf16 torch tensors, ``module.shippable``), as RLlib's module state: env runners and ``RLModule.from_checkpoint`` read it
  unchanged;
* ``optimizer``: every rank's ZeRO optimiser state (fp32 master partitions, AdamW moments,
  step), restored rank by rank (same number of learners).

Checkpoint I/O (ZeRO optimiser shards, ZeRO-3 weight partitions, RLlib's state API) is
``DeepSpeedCheckpointing`` in ``rllib/deepspeed_checkpoint.py``.

``set_state`` and ``restore_from_path`` run on every learner; each writes its own slice
(ZeRO-3) or the full tensors (ZeRO-1/2) and refreshes the fp32 master copy, no collective
either. Pitfalls of DeepSpeed on this stack (listed in ``docs/deepspeed.md``) are
handled in ``_prepare_distributed`` and ``build_deepspeed_config``; ``docs/deepspeed.md``
has the measurements.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import socket
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ray.rllib.utils.annotations import override
from ray.rllib.core.learner.learner import Learner
from ray.rllib.core.learner.learner import DEFAULT_OPTIMIZER
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.core.rl_module.apis import InferenceOnlyAPI

from rllib_exgrpo.rllib import rllib_contract as rc
from rllib_exgrpo.rllib.config_fields import field_value
from rllib_exgrpo.rllib import zero3_weights
from rllib_exgrpo.rllib.deepspeed_checkpoint import GATHER_TIMEOUT_S, DeepSpeedCheckpointing, zero_stage as _zero_stage
from rllib_exgrpo.rllib.learner import ExGRPOTorchLearner
from rllib_exgrpo.rllib.module import ShippedBF16, shippable

logger = logging.getLogger(__name__)

#: Keys of the generated DeepSpeed config that other fields own: ``deepspeed`` may not set them.
_OWNED_KEYS = {
    "optimizer": "the optimiser is AdamW with lr / weight_decay (the DDP learner's)",
    "scheduler": "the learning rate is RLlib's (lr, a number or a schedule)",
    "gradient_clipping": "use grad_clip (clipped by global norm)",
    "gradient_accumulation_steps": "one engine step per optimiser step; learner_micro_batch_rows cuts its passes",
    "train_batch_size": "the algorithm plans minibatches itself (minibatch_size)",
    "train_micro_batch_size_per_gpu": "use learner_micro_batch_rows (rows per forward/backward pass)",
}


def deepspeed_importable() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails at import
        return False
    return True


def _merged(base: Dict[str, Any], overrides: Dict[str, Any]) -> Dict[str, Any]:
    """``base`` with ``overrides`` merged in, dict by dict (overrides win)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def deepspeed_config_errors(config) -> List[str]:
    """What is wrong with a config that asks for the DeepSpeed learner (empty when fine)."""
    errors = []
    overrides = field_value(config, "deepspeed") or {}
    stage = field_value(config, "deepspeed_zero_stage")
    for key, why in _OWNED_KEYS.items():
        if key in overrides:
            errors.append(f"deepspeed[{key!r}] cannot be set: {why}")
    zero = overrides.get("zero_optimization", {})
    if not isinstance(zero, dict):
        errors.append(f"deepspeed['zero_optimization'] must be a dict, got {zero!r}")
    elif "stage" in zero and zero["stage"] != stage:
        errors.append(
            f"deepspeed['zero_optimization']['stage'] = {zero['stage']!r} disagrees with "
            f"deepspeed_zero_stage = {stage!r}: set the stage with deepspeed_zero_stage"
        )
    data_types = overrides.get("data_types")
    accum = data_types.get("grad_accum_dtype") if isinstance(data_types, dict) else None
    if stage == 1 and accum in ("fp32", "float32", "float"):
        errors.append(
            "deepspeed_zero_stage=1 with data_types.grad_accum_dtype fp32 makes DeepSpeed (bf16) use its "
            "BF16_Optimizer, which this learner does not drive: use stage 2 for fp32 gradient accumulation"
        )
    if config.grad_clip is not None and config.grad_clip_by != "global_norm":
        errors.append(
            f"learner_backend='deepspeed' clips by global norm only: grad_clip_by must be 'global_norm', got {config.grad_clip_by!r}"
        )
    if getattr(config, "torch_compile_learner", False):
        errors.append("learner_backend='deepspeed' does not support torch_compile_learner")
    if rc.torch_grad_scaler_class(config) is not None:
        errors.append("learner_backend='deepspeed' does its own loss scaling: unset _torch_grad_scaler_class")
    if rc.torch_lr_scheduler_classes(config):
        errors.append("learner_backend='deepspeed' takes the learning rate from lr (a number or a schedule)")
    if not deepspeed_importable():
        errors.append("learner_backend='deepspeed' needs DeepSpeed: pip install 'rllib-exgrpo[deepspeed]'")
    return errors


def check_deepspeed_config(config) -> None:
    errors = deepspeed_config_errors(config)
    if errors:
        raise ValueError("Invalid DeepSpeed learner config:\n  - " + "\n  - ".join(errors))


#: DeepSpeed's own default size (elements) of its gradient-reduction and all-gather buckets.
DEFAULT_BUCKET = 500_000_000


def build_deepspeed_config(config, device: torch.device, num_parameters: Optional[int] = None) -> Dict[str, Any]:
    """The DeepSpeed config of one learner: ZeRO stage ``deepspeed_zero_stage``; bf16 on a
    GPU (fp32 master weights in the optimiser), fp32 on CPU (``model_dtype`` bfloat16 /
    float16 ask for bf16 / fp16 anywhere); ``grad_clip``; buckets no larger than the model;
    then ``deepspeed`` merged in."""
    on_gpu = device.type == "cuda"
    dtype = field_value(config, "model_dtype")
    # ZeRO-1/2 allocate a reduce bucket of reduce_bucket_size elements every step (5e8 by
    # default: 2 GB in fp32, seconds per step on CPU for a 1M-parameter model).
    bucket = int(min(DEFAULT_BUCKET, max(num_parameters or DEFAULT_BUCKET, 1_000_000)))
    base = {
        # Bookkeeping only: the algorithm hands each engine step one minibatch of its own.
        "train_micro_batch_size_per_gpu": max(1, int(config.minibatch_size or 1)),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(config.grad_clip) if config.grad_clip else 0.0,
        "zero_optimization": {
            "stage": int(config.deepspeed_zero_stage),
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        },
        "bf16": {"enabled": dtype == "bfloat16" or (on_gpu and dtype == "float32")},
        "fp16": {"enabled": dtype == "float16"},
        # torch.optim.AdamW is on DeepSpeed's ZeRO list; kept for torch versions where the
        # class check differs.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return _merged(base, dict(field_value(config, "deepspeed") or {}))


# --- the process group DeepSpeed needs ------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare_distributed(device: torch.device) -> None:
    """Make ``deepspeed.init_distributed`` reuse RLlib's process group.

    * RLlib's backend (``ray/train/torch/config.py``) creates the gloo / nccl group and
      exports MASTER_ADDR / MASTER_PORT only; DeepSpeed asserts on a missing LOCAL_RANK.
      A learner sees only its own GPU, so its local device is ``device.index``.
    * A local learner (``num_learners=0``) has no group: a one-rank gloo group is made.
    * DeepSpeed would compile its shared-memory comm op (~86 s, or fail without a C++
      compiler) although gloo does all the work: marked incompatible first.
    """
    import deepspeed
    import deepspeed.ops

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            rank=0,
            world_size=1,
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["LOCAL_RANK"] = str(device.index or 0) if device.type == "cuda" else str(rank)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


# --- ZeRO internals used in one step -------------------------------------------------------
def _pre_step_grad_norm(engine) -> torch.Tensor:
    """The global L2 norm of the averaged gradient over all partitions, before clipping:
    the number the ZeRO optimiser's own ``step`` clips with (inf if any is NaN/inf)."""
    from deepspeed.runtime.utils import combine_grad_norm_groups

    opt = engine.optimizer
    if _zero_stage(engine) == 3:
        norm = combine_grad_norm_groups(opt._get_norm_groups())
    else:
        norm = opt.scaled_global_norm()
    norm = torch.as_tensor(norm, dtype=torch.float64).detach().cpu()
    return norm / float(opt.loss_scale)


@contextlib.contextmanager
def _overflow_forced(engine):
    """Make the next ``engine.step()`` take DeepSpeed's overflow path: gradients and
    reduction buffers cleared, no optimiser step (parameters, moments, step count kept)."""
    opt = engine.optimizer
    patched: Dict[str, Any] = {}

    def patch(name, value):
        patched[name] = opt.__dict__.get(name, _MISSING)
        setattr(opt, name, value)

    if _zero_stage(engine) == 3:

        def forced(update_scale=True):
            opt.overflow = True
            return opt._loss_scale_update_and_overflow_cleanup() if update_scale else True

        patch("_overflow_check_and_loss_scale_update", forced)
    else:

        def forced(partition_gradients=True):
            opt.overflow = True

        patch("check_grad_overflow", True)
        patch("check_overflow", forced)
    try:
        yield
    finally:
        for name, old in patched.items():
            if old is _MISSING:
                opt.__dict__.pop(name, None)
            else:
                setattr(opt, name, old)


_MISSING = object()


def _any_rank(flag: bool, device: torch.device) -> bool:
    """``flag`` or'ed over the learners (one scalar all-reduce; the local value alone
    without a process group of several ranks)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _cpu_copy(obj):
    """A CPU copy of a (nested) state: tensors cloned, never views of live buffers."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


class _TrainForward(torch.nn.Module):
    """What the engine wraps: the RLModule, called through ``forward_train``; going through
    ``engine(batch)`` fires the hooks ZeRO-3 gathers parameters with."""

    def __init__(self, rl_module: torch.nn.Module):
        super().__init__()
        self.rl_module = rl_module

    def forward(self, batch):
        return self.rl_module.forward_train(batch)


# --- the engine step, below ExGRPO's hooks -----------------------------------------------
class _DeepSpeedStep(TorchLearner):
    """``compute_gradients`` / ``postprocess_gradients_for_module`` / ``apply_gradients`` on
    DeepSpeed engines (``self._engines``); ExGRPO's versions of the last two call these."""

    _engines: Dict[str, Any]

    @override(TorchLearner)
    def compute_gradients(self, loss_per_module, **kwargs):
        """``engine.backward`` per module; the "gradient" handed on is one tensor per
        module, the global pre-clip norm, under the module's first parameter (so RLlib's
        per-optimizer filter keeps it and ExGRPO's norm of it is that norm).

        A non-finite loss on any learner makes that norm inf on every learner. A NaN loss
        does not always give NaN gradients (``log_ratio``'s clamp passes no gradient to a
        NaN input), so without this the learner with the NaN loss would drop the step
        and the others take it: diverging ranks, and under ZeRO a collective that never
        completes."""
        return self._ds_gradient_norms(self._ds_backward(loss_per_module))

    def _ds_backward(self, loss_per_module) -> bool:
        """``engine.backward`` of each module's loss (one micro-batch's, or the whole
        minibatch's); True if a loss was not finite."""
        bad = False
        for module_id, loss in loss_per_module.items():
            engine = self._engines.get(module_id)
            if engine is None or not torch.is_tensor(loss) or loss.grad_fn is None:
                continue
            bad = bad or not bool(torch.isfinite(loss.detach()).all())
            # No 1/GAS scaling: each micro-batch's loss is already divided by the
            # minibatch's counts (ExGRPOTorchLearner's micro-batches), and GAS is 1.
            engine.backward(loss, scale_wrt_gas=False)
        return bad

    def _ds_gradient_norms(self, bad: bool) -> Dict[Any, torch.Tensor]:
        """After the last backward: the global pre-clip norm per module, inf on every rank
        when any rank's loss was not finite (see ``compute_gradients``)."""
        grads, norms = {}, {}
        for module_id, engine in self._engines.items():
            norms[module_id] = _pre_step_grad_norm(engine)
        if norms and _any_rank(bad, rc.learner_device(self)):
            norms = {mid: torch.full_like(n, float("inf")) for mid, n in norms.items()}
        for module_id, norm in norms.items():
            first = rc.optimizer_parameters(self)[self.get_optimizer(module_id, DEFAULT_OPTIMIZER)][0]
            grads[first] = norm.reshape(1).float()
        return grads

    @override(Learner)
    def postprocess_gradients_for_module(self, *, module_id, config=None, module_gradients_dict):
        """No clipping here: ``engine.step()`` clips to ``grad_clip`` by the same global norm.
        RLlib's norm metric is logged as the DDP learner logs it."""
        if (config.grad_clip and config.grad_clip_by == "global_norm") or config.log_gradients:
            for value in module_gradients_dict.values():
                self.metrics.log_value((module_id, f"gradients_{DEFAULT_OPTIMIZER}_global_norm"), float(value.reshape(-1)[0]), window=1)
        return dict(module_gradients_dict)

    @override(TorchLearner)
    def apply_gradients(self, gradients_dict) -> None:
        """The step is kept: ``_uncompiled_update`` runs ``engine.step()`` once every
        learner has decided (all keep it, or all drop it)."""
        self._ds_keep_step = True


class DeepSpeedExGRPOLearner(ExGRPOTorchLearner, DeepSpeedCheckpointing, _DeepSpeedStep):
    """The ExGRPO learner with one DeepSpeed ZeRO engine per module (see the module doc)."""

    # ---- build ---------------------------------------------------------------------------
    def build(self) -> None:
        check_deepspeed_config(self.config)
        self._engines = {}
        self._ds_peers: Optional[list] = None
        self._ds_dtypes: Dict[str, Dict[str, torch.dtype]] = {}
        self._ds_keep_step = False
        #: get_state gathers every rank's optimiser shard only when the optimiser is asked
        #: for by name (in-memory use); otherwise the state names the shards, which
        #: save_to_path has each rank write itself.
        self._ds_gather_optimizer = False
        self._ds_shards_to_load: Optional[Dict[str, Any]] = None
        # ExGRPO's build: threads, RLlib's module and AdamW, the frozen KL reference (a
        # deep copy of the full model, taken before any partitioning).
        super().build()
        self._init_engines()

    @override(TorchLearner)
    def _make_modules_ddp_if_necessary(self) -> None:
        """No DDP: the engines made at the end of ``build`` replace it."""

    @override(TorchLearner)
    def add_module(self, **kwargs):
        if getattr(self, "_engines", None):
            raise NotImplementedError("learner_backend='deepspeed' does not add modules after the learner is built")
        return super().add_module(**kwargs)

    @override(TorchLearner)
    def remove_module(self, module_id, **kwargs):
        raise NotImplementedError("learner_backend='deepspeed' does not remove modules")

    def _init_engines(self) -> None:
        import deepspeed

        _prepare_distributed(rc.learner_device(self))
        for module_id in self.module.keys():
            rl_module = self.module[module_id]
            names = rc.module_optimizers(self).get(module_id, [])
            if not isinstance(rl_module, torch.nn.Module) or not names:
                continue
            if len(names) != 1:
                raise NotImplementedError(f"module {module_id!r}: one optimiser per module with DeepSpeed, got {names}")
            self._ds_dtypes[module_id] = {k: v.dtype for k, v in rl_module.state_dict().items()}
            num_parameters = sum(p.numel() for p in rl_module.parameters())
            ds_config = build_deepspeed_config(self.config, rc.learner_device(self), num_parameters)
            optimizer = rc.named_optimizers(self)[names[0]]
            engine, _, _, _ = deepspeed.initialize(
                model=_TrainForward(rl_module), optimizer=optimizer, config=ds_config, dist_init_required=False
            )
            zero_cls = type(engine.optimizer).__name__
            if zero_cls not in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"):
                raise NotImplementedError(
                    f"DeepSpeed chose {zero_cls} for this config; the learner drives the ZeRO optimisers "
                    "(stage 1/2: DeepSpeedZeroOptimizer, stage 3: DeepSpeedZeroOptimizer_Stage3) only"
                )
            self._engines[module_id] = engine
        if dist.get_world_size() > 1:
            import ray

            handles: list = [None] * dist.get_world_size()
            dist.all_gather_object(handles, ray.get_runtime_context().current_actor)
            self._ds_peers = handles

    @override(ExGRPOTorchLearner)
    def colocation_engines(self) -> list:
        """``colocate``: the engines offload their own ZeRO state around a generation turn."""
        return list(self._engines.values())

    @property
    def deepspeed_engines(self) -> Dict[str, Any]:
        """The DeepSpeed engine of each module (read-only use: metrics, debugging)."""
        return dict(self._engines)

    # ---- one update ----------------------------------------------------------------------
    def _uncompiled_update(self, batch: Dict, **kwargs):
        """One optimiser step: forward + ``engine.backward`` per micro-batch
        (``learner_micro_batch_rows``; DeepSpeed's own accumulation boundary marks the last
        one, where ZeRO reduces the gradients), then the guards and one ``engine.step()``."""
        rc.compute_off_policyness(self, batch)
        bad = []

        def forward(chunk):
            return {
                mid: (self._engines[mid](chunk[mid]) if mid in self._engines else self.module[mid].forward_train(chunk[mid]))
                for mid in chunk.keys()
                if mid in self.module
            }

        def at_boundary(last: bool):
            for engine in self._engines.values():
                engine.set_gradient_accumulation_boundary(last)
            return contextlib.nullcontext()

        fwd_out, loss_per_module = self._run_passes(
            batch,
            forward=forward,
            backward=lambda losses: bad.append(self._ds_backward(losses)),
            pass_context=at_boundary,
        )
        self._ds_keep_step = False
        gradients = self._ds_gradient_norms(any(bad))
        # ExGRPO's guards: the norm metric and the skip decision, the same on every rank
        # (the norm is the all-reduced one; a NaN loss anywhere makes every norm inf).
        postprocessed = self.postprocess_gradients(gradients)
        self.apply_gradients(postprocessed)  # ExGRPO's: counts; _DeepSpeedStep's if it keeps the step
        keep = not _any_rank(not self._ds_keep_step, rc.learner_device(self))
        if self._ds_keep_step and not keep:
            logger.warning("another learner dropped this step: dropped here too (ranks must step together)")
        for engine in self._engines.values():
            if keep:
                engine.step()
            else:  # dropped: DeepSpeed's overflow path, nothing changes
                with _overflow_forced(engine):
                    engine.step()
        return fwd_out, loss_per_module, {}

    def _head_calls_are_collective(self) -> bool:
        """ZeRO-3 with two or more learners: each LM-head call gathers its parameters."""
        import torch.distributed as dist

        return int(self.config.deepspeed_zero_stage) == 3 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _score_forward(self, module_id, chunk):
        """Through the engine: under ZeRO-3 its hooks gather the parameters (every rank runs
        the same number of scoring passes: ``score_rows`` agrees on it)."""
        if module_id in self._engines:
            return self._engines[module_id](chunk)
        return super()._score_forward(module_id, chunk)

    # ---- pieces each rank holds (called on the other learners through Ray) ---------------
    def _ds_local_partitions(self, module_id) -> Dict[int, torch.Tensor]:
        """ZeRO-3: this rank's partition of every parameter (``ds_tensor``), by ``ds_id``."""
        engine = self._engines[module_id]
        return {p.ds_id: p.ds_tensor.detach().to("cpu", copy=True) for p in engine.module.parameters() if hasattr(p, "ds_id")}

    def _ds_local_optimizer_state(self, module_id) -> Dict[str, Any]:
        """This rank's ZeRO optimiser state (no collective)."""
        return _cpu_copy(self._engines[module_id].optimizer.state_dict())

    def _from_every_rank(self, method: str, *args) -> list:
        """``method(*args)`` on every rank, in rank order: here directly, on the others as
        Ray calls to their actors (idle: RLlib asks one learner at a time)."""
        own = getattr(self, method)(*args)
        if not self._ds_peers:
            return [own]
        import ray
        from ray.exceptions import GetTimeoutError

        rank = dist.get_rank()
        refs = {r: getattr(h, method).remote(*args) for r, h in enumerate(self._ds_peers) if r != rank}
        try:
            got = dict(zip(refs, ray.get(list(refs.values()), timeout=GATHER_TIMEOUT_S)))
        except GetTimeoutError as e:
            raise RuntimeError(
                f"DeepSpeed learner {rank}: the other learners did not hand over their ZeRO shards within "
                f"{GATHER_TIMEOUT_S:g} s. get_state must be called on one learner at a time (as RLlib's "
                "LearnerGroup does); for every learner's own view use full_parameters_collective()"
            ) from e
        got[rank] = own
        return [got[r] for r in range(len(self._ds_peers))]

    # ---- module state ------------------------------------------------------------------
    def _module_tensors(self, module_id, inference_only: bool = False) -> Dict[str, torch.Tensor]:
        rl_module = self.module[module_id]
        tensors = rl_module.state_dict(keep_vars=True)
        if inference_only and not rl_module.inference_only and isinstance(rl_module, InferenceOnlyAPI):
            attrs = rl_module.get_non_inference_attributes()
            tensors = {
                k: v for k, v in tensors.items() if not any(k.startswith(a) and (len(k) == len(a) or k[len(a)] == ".") for a in attrs)
            }
        return tensors

    def _full_module_state(self, module_id, inference_only: bool = False) -> Dict[str, Any]:
        """The module's full weights in the dtype it was built with (bf16 stays bf16:
        ``module.shippable``)."""
        if module_id not in self._engines:
            return self.module[module_id].get_state(inference_only=inference_only)
        tensors = self._module_tensors(module_id, inference_only)
        dtypes = self._ds_dtypes[module_id]
        parts = None
        if any(hasattr(t, "ds_id") for t in tensors.values()):
            parts = self._from_every_rank("_ds_local_partitions", module_id)
        out, built = {}, {}
        for key, t in tensors.items():
            want = dtypes.get(key, t.dtype)
            if not hasattr(t, "ds_id"):
                out[key] = shippable(t, want)
            elif t.ds_id in built:  # a tied parameter under a second name
                out[key] = built[t.ds_id]
            else:
                # Each rank's piece is dropped once used, and the concatenated tensor (fresh,
                # on the CPU) is shipped as it is when its dtype is already the one wanted:
                # about one full copy of the weights at a time, not three.
                pieces = [p.pop(t.ds_id).reshape(-1) for p in parts]
                full = torch.cat(pieces)[: t.ds_numel].view(t.ds_shape)
                del pieces
                if full.dtype == want:
                    value = full.as_subclass(ShippedBF16) if want == torch.bfloat16 else full.numpy()
                else:
                    value = shippable(full, want)
                out[key] = built[t.ds_id] = value
        return out

    def _is_zero3(self, module_id) -> bool:
        return module_id in self._engines and _zero_stage(self._engines[module_id]) == 3

    @torch.no_grad()
    def _set_module_weights(self, module_id, weights: Dict[str, Any]) -> None:
        """Full weights in: ZeRO-3 keeps its own slice of each, ZeRO-1/2 the whole tensor;
        then the optimiser's fp32 master copy follows. Local to this rank (no collective)."""
        if zero3_weights.is_manifest(weights):
            raise zero3_weights.not_weights_error(f"the state given for module {module_id!r}")
        if module_id not in self._engines:
            self.module[module_id].set_state(weights)
            return
        engine = self._engines[module_id]
        tensors = self._module_tensors(module_id)
        rank = dist.get_rank()
        for key, value in weights.items():
            t = tensors.get(key)
            if t is None:
                continue
            full = torch.as_tensor(value)
            if hasattr(t, "ds_id"):
                part = t.ds_tensor
                size = part.numel()
                flat = full.reshape(-1).to(part.dtype)
                piece = flat[rank * size : (rank + 1) * size]
                part.data.reshape(-1)[: piece.numel()].copy_(piece)
                part.data.reshape(-1)[piece.numel() :].zero_()
                if t.data.numel() == t.ds_numel:  # available (persistent or gathered): keep it equal
                    t.data.copy_(full.reshape(t.ds_shape).to(t.dtype))
            else:
                t.data.copy_(full.reshape(t.shape).to(t.dtype))
        engine.optimizer.refresh_fp32_params()

    # ---- checks ----------------------------------------------------------------------------
    def full_parameters_collective(self, module_id=None) -> Dict[str, Any]:
        """This rank's own gathered view of the full parameters (numpy), through DeepSpeed's
        ``GatheredParameters`` -- a collective: call it on every learner at once
        (``learner_group.foreach_learner``). For tests and debugging."""
        import deepspeed

        from ray.rllib.core import DEFAULT_MODULE_ID

        module_id = module_id or DEFAULT_MODULE_ID
        rl_module = self.module[module_id]
        params = list(rl_module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {k: shippable(v) for k, v in rl_module.state_dict().items()}
