"""A learner's optimizer state off the accelerator and back, around a colocated turn.

While a colocated engine generates (``rllib/colocation.py``), the learner's optimizer state
is not needed and its memory is: it goes to host memory before the engine wakes and comes
back after the engine sleeps. What moves, per learner backend:

* **DDP learner** (torch ``AdamW``): every tensor of the optimizer state (moments; step
  counts are CPU tensors already) into a host buffer, and back to the device it came from.
* **DeepSpeed ZeRO-1/2**: the engine's own ``offload_states`` with an explicit list,
  :data:`ZERO12_STATES` (fp32 master partitions, reduced gradient partitions, optimizer
  state), then ``reload_states``.
* **DeepSpeed ZeRO-3**: DeepSpeed 0.19's ZeRO-3 ``offload_states`` asserts that the
  optimizer is DeepSpeed's ``FusedAdam`` whenever the fp32 partitions (``hp_params``) or
  the optimizer state (``optim_states``) are to move; the learners use ``torch.optim.AdamW``
  (the DDP learner's optimizer: the same update to the bit, checkpoints that load in either
  backend, and no CUDA op compiled at the first step of a ``DS_BUILD_OPS=0`` install). So
  the engine's ``offload_states`` moves what it moves for any optimizer,
  :data:`ZERO3_ENGINE_STATES` (the gradient partitions and the contiguous gradient
  buckets), and this module moves the other two itself: the optimizer state with
  DeepSpeed's own helper for it (``offload_optimizer_states`` / ``reload_optimizer_states``,
  what ZeRO-1/2's ``offload_states`` calls), the fp32 partitions
  (``fp32_partitioned_groups_flat``) by swapping each tensor's storage for a host buffer
  (the torch optimizer holds those tensors as its parameters, so their identity stays).

Never moved: the compute-dtype weights (``lp_params``), which the next push into the
engine reads (a ZeRO-3 gather reads the partitions on the device), and a state that
DeepSpeed already keeps on the host (``offload_optimizer`` in the DeepSpeed config).

The same calls run on every device: on a CPU the host buffers are new host tensors (so a
round trip is a real copy, checked bit for bit by the tests); only pinning the host
buffers and ``synchronize`` / ``empty_cache`` need CUDA.
"""

from __future__ import annotations

import gc
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

import torch

#: DeepSpeed's ZeRO-1/2 states a turn offloads (``OffloadStateTypeEnum`` values).
ZERO12_STATES = ("hp_params", "lp_grads", "optim_states")
#: DeepSpeed's ZeRO-3 states its ``offload_states`` moves for a torch optimizer.
ZERO3_ENGINE_STATES = ("lp_grads", "contiguous_grad_buffer")
#: ZeRO-3 states this module moves itself (DeepSpeed asserts FusedAdam for them).
ZERO3_OWN_STATES = ("hp_params", "optim_states")
#: Never offloaded: what the next weight push reads.
KEPT_STATES = ("lp_params",)


def optimizer_state_tensors(optimizers: Iterable[torch.optim.Optimizer]):
    """``(state dict, key, tensor)`` of every tensor in the optimizers' state."""
    for opt in optimizers:
        for state in opt.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    yield state, key, value


def _nbytes(tensors: Iterable) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def _pin() -> bool:
    """Page-locked host buffers (faster copies back): a CUDA feature."""
    return torch.cuda.is_available()


def _host_copy(value: torch.Tensor) -> torch.Tensor:
    host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=_pin())
    host.copy_(value)
    return host


def _offload_enum(names: Sequence[str]) -> list:
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    return [OffloadStateTypeEnum(n) for n in names]


class _DeepSpeedEngineOffload:
    """One DeepSpeed engine's turn (module doc); ``offload`` returns bytes per state kind."""

    def __init__(self, engine):
        self.engine = engine
        self.stage = int(engine.zero_optimization_stage())
        #: ZeRO-3 fp32 partitions moved by hand: (tensor, its device before the move).
        self._hp_homes: List[Tuple[torch.Tensor, torch.device]] = []
        #: (id(state dict), key) -> device of each optimizer-state tensor before the move.
        #: DeepSpeed's reload puts every state tensor on the accelerator, torch AdamW's
        #: ``step`` counts included, which torch keeps on the host: they go back home.
        self._state_homes: Dict[tuple, torch.device] = {}

    @property
    def zero_optimizer(self):
        return self.engine.optimizer

    def _host_optimizer_kept(self) -> bool:
        """DeepSpeed keeps the optimizer on the host already (``offload_optimizer``)."""
        return bool(self.engine.zero_use_cpu_optimizer())

    def sizes(self) -> Dict[str, int]:
        """Bytes of each state kind a turn moves, read before the move."""
        zopt = self.zero_optimizer
        sizes: Dict[str, int] = {}
        if not self._host_optimizer_kept():
            inner = zopt.optimizer
            sizes["optim_states"] = _nbytes(v for _, _, v in optimizer_state_tensors([inner]))
            hp = (
                getattr(zopt, "fp32_partitioned_groups_flat", None)
                if self.stage == 3
                else getattr(zopt, "single_partition_of_fp32_groups", None)
            )
            sizes["hp_params"] = _nbytes(hp or [])
        if self.stage == 3:
            flat = getattr(zopt, "grad_partitions_flat_buffer", None)
            sizes["lp_grads"] = _nbytes([flat]) if flat is not None else 0
            sizes["contiguous_grad_buffer"] = _nbytes(b.buffer for b in getattr(zopt, "ipg_buckets", {}).values() if b.buffer is not None)
        else:
            grads = getattr(zopt, "averaged_gradients", {}) or {}
            sizes["lp_grads"] = _nbytes(t for g in grads.values() if g is not None for t in g)
        return sizes

    def offload(self) -> Dict[str, int]:
        sizes = self.sizes()
        # DeepSpeed's pinned-buffer path on every device: its CPU accelerator makes pinning a
        # no-op, so a CPU runs the copies a GPU makes (into buffers it keeps for the next turn).
        pin = True
        self._state_homes = {(id(st), k): v.device for st, k, v in optimizer_state_tensors([self.zero_optimizer.optimizer])}
        if self.stage == 3:
            self.engine.offload_states(include=_offload_enum(ZERO3_ENGINE_STATES), pin_memory=pin)
            if not self._host_optimizer_kept():
                self._offload_zero3_own()
        else:
            self.engine.offload_states(include=_offload_enum(ZERO12_STATES), pin_memory=pin)
        return sizes

    def reload(self) -> None:
        self.engine.reload_states()
        if self.stage == 3 and self._hp_homes:
            self._reload_zero3_own()
        for state, key, value in list(optimizer_state_tensors([self.zero_optimizer.optimizer])):
            home = self._state_homes.get((id(state), key), value.device)
            if home != value.device:
                state[key] = value.to(home)
        self._state_homes = {}

    # ---- ZeRO-3: the two states DeepSpeed moves only for FusedAdam -----------------------
    def _offload_zero3_own(self) -> None:
        from deepspeed.runtime.zero.offload_states import offload_optimizer_states

        zopt = self.zero_optimizer
        for t in zopt.fp32_partitioned_groups_flat:
            self._hp_homes.append((t, t.device))
            t.data = _host_copy(t.data)  # pinned where CUDA is there
        # DeepSpeed's helper copies device tensors into pinned host buffers; a tensor
        # already on the host it leaves in place, so on a CPU the copy is made here first
        # (the same round trip as on a GPU).
        if not torch.cuda.is_available():
            for state, key, value in list(optimizer_state_tensors([zopt.optimizer])):
                state[key] = value.clone()
        offload_optimizer_states(zopt.optimizer, "cpu", pin_memory=True)

    def _reload_zero3_own(self) -> None:
        from deepspeed.runtime.zero.offload_states import reload_optimizer_states

        zopt = self.zero_optimizer
        device = self._hp_homes[0][1]
        for t, home in self._hp_homes:
            t.data = t.data.to(home)
        self._hp_homes.clear()
        reload_optimizer_states(zopt.optimizer, device)


class OptimizerOffload:
    """Moves a learner's optimizer state to host memory and back (module doc).

    Args:
        optimizers: returns the learner's torch optimizers (the DDP learner's).
        engines: returns the learner's DeepSpeed engines; where there are any, their ZeRO
            optimizers' state moves instead (the torch optimizers are wrapped by them).
    """

    def __init__(self, optimizers: Callable[[], Sequence[torch.optim.Optimizer]], engines: Callable[[], Sequence] = lambda: ()):
        self._optimizers = optimizers
        self._engines = engines
        #: id(state dict), key -> the device the tensor came from.
        self._homes: Dict[tuple, torch.device] = {}
        self._engine_moves: List[_DeepSpeedEngineOffload] = []
        self.on_device = True
        #: Bytes per state kind the last :meth:`offload` moved (``optim_states``, ...).
        self.moved: Dict[str, int] = {}
        #: Whether :meth:`describe` has been printed (once per learner).
        self.said = False

    def offload(self) -> int:
        """State to host memory; returns the bytes moved (also per kind in :attr:`moved`)."""
        engines = list(self._engines())
        if engines:
            self._engine_moves = [_DeepSpeedEngineOffload(e) for e in engines]
            self.moved = {}
            for move in self._engine_moves:
                for kind, n in move.offload().items():
                    self.moved[kind] = self.moved.get(kind, 0) + n
        else:
            self.moved = {"optim_states": self._offload_torch()}
        self._settle()
        gc.collect()
        self.on_device = False
        return sum(self.moved.values())

    def reload(self) -> int:
        """State back where it was; returns the bytes moved."""
        if self._engine_moves:
            for move in self._engine_moves:
                move.reload()
            self._engine_moves = []
            moved = sum(self.moved.values())
        else:
            moved = self._reload_torch()
        self._settle()
        self.on_device = True
        return moved

    def describe(self) -> str:
        """One line: what the last offload moved, per state kind, and what stayed."""
        kinds = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in self.moved.items())
        backend = f"DeepSpeed ZeRO-{self._last_stage()}" if self._last_stage() else "torch optimizer"
        return (
            f"colocate: optimizer offload ({backend}) moved to host: {kinds or 'nothing'}; "
            f"kept on the device: the compute-dtype weights the push reads"
        )

    def _last_stage(self):
        stages = sorted({m.stage for m in self._engine_moves})
        return "/".join(map(str, stages)) if stages else None

    # ---- a torch optimizer's state --------------------------------------------------------
    def _offload_torch(self) -> int:
        moved = 0
        for state, key, value in list(optimizer_state_tensors(self._optimizers())):
            self._homes[(id(state), key)] = value.device
            state[key] = _host_copy(value)
            moved += value.numel() * value.element_size()
        return moved

    def _reload_torch(self) -> int:
        moved = 0
        for state, key, value in list(optimizer_state_tensors(self._optimizers())):
            home = self._homes.get((id(state), key), value.device)
            if home != value.device:
                state[key] = value.to(home, non_blocking=_pin())
            moved += value.numel() * value.element_size()
        self._homes.clear()
        return moved

    @staticmethod
    def _settle() -> None:
        """Copies finished and freed device memory handed back (CUDA only)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
