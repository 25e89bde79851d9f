"""Weights from the learners to the env runners over a collective (``weight_sync: collective``).

RLlib's weight sync (``EnvRunnerGroup.sync_weights``, kept as ``weight_sync: object_store``)
puts the learner's full state into Ray's object store: the first learner returns it (one
object), the driver puts it again for the runners (a second), and each runner maps and loads
it. At 7B in bf16 that is ~15 GB written into shared memory two or three times a sync. The
peers (OpenRLHF, verl) instead have the inference engines join a "model update" process
group with the learner that holds the weights and broadcast them, bucket by bucket. This
module does the same on this stack:

* **The group** is standalone: the root serves a ``torch.distributed.TCPStore`` on its own
  node (a port the OS picks), and every member builds a gloo (CPU) or NCCL (the root and
  every runner on a GPU) process group from it directly, never through
  ``init_process_group``: the learners' default group (DDP, DeepSpeed) is left alone.
  Members: the **root** (the learner of rank 0 in the learners' group, or the only learner)
  is rank 0, the remote env runners are ranks 1..n in worker-id order. The other learners
  are not members; under ZeRO-3 they take part in the gathers only.
* **A generation** number names each group. The driver (:class:`WeightBroadcaster`) builds a
  new one whenever its members change (a runner died, was restarted, came back), so a
  restarted runner and the others rejoin together; the old group is dropped everywhere.
* **The layout** (:class:`Layout`: names, shapes, dtypes, each tensor's place in its bucket)
  is planned once per generation by every learner (the same plan everywhere: ZeRO-3 gathers
  the same parameters in the same order on every rank) and handed to the runners when they
  join. It is the only thing besides small call arguments that travels through Ray.
* **A check-in before every collective round** (joining, each sync): gloo and NCCL wait for
  a missing member until their timeout (:data:`TIMEOUT_S`, 10 minutes), so each runner first
  counts itself in on the root's store and waits for the root's word; the root gives it
  once all have, and the driver, which watches the runners' calls, calls the round off as
  soon as one fails (its actor died, or was restarted and holds no end of the group). A
  dead runner then costs a rebuild, not a timeout. (A runner dying in the middle of a
  broadcast still leaves the others to the timeout.)
* **A sync**: the driver first launches each runner's receive (it blocks in the broadcast),
  then runs the send on every learner (:func:`learner_send`), then waits for the runners.
  Per bucket the learners gather the parameters (ZeRO-3: ``GatheredParameters``, a
  collective over all learners; ZeRO-1/2 and DDP hold them whole), the root casts them to
  the runners' dtype into one flat buffer per dtype and broadcasts it; each runner copies
  the slices straight into its module's parameters (the HF backend samples from them; a
  vLLM backend is then loaded from the module's tensors), or, without a module (vLLM with
  ``scoring_on: learners``), collects the tensors and pushes them into the engine through
  the backend's ``load_weights``.

The shipped values are what ``get_state(inference_only=True)`` ships: the DDP learner's fp32
master weights cast to the compute dtype (bf16 for a bf16 model), a DeepSpeed module in the
dtype it was built in. Bytes on the wire per sync: the model in that dtype, once to each
runner; nothing in the object store. ``docs/scaling.md`` has the measurements.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rllib_exgrpo.rllib import rllib_contract as rc
from rllib_exgrpo.rllib.config_fields import field_value
from rllib_exgrpo.models.lora import resolve

logger = logging.getLogger(__name__)

#: Seconds a member waits for the others (joining, or inside a broadcast) before giving up.
TIMEOUT_S = float(os.environ.get("RLLIB_EXGRPO_WEIGHT_SYNC_TIMEOUT_S", "600"))
#: The module a sync moves (this project's algorithms have one).
MODULE_ID = "default_policy"
#: The attribute of a learner / env runner that holds its end of the group.
_END = "_weight_broadcast_end"


class WeightSyncFailed(RuntimeError):
    """A collective sync (or building its group) failed; ``failed`` are the runner ids at
    fault (empty: the learners' side failed)."""

    def __init__(self, message: str, failed: Sequence[int] = ()):
        super().__init__(message)
        self.failed = tuple(failed)


# --- which path ----------------------------------------------------------------------------
def chosen_path(config) -> Tuple[str, str]:
    """``(path, line to print)``: ``"collective"`` when asked for and there are remote env
    runners to broadcast to, else ``"object_store"`` (RLlib's sync)."""
    runners = int(getattr(config, "num_env_runners", 0) or 0)
    asked = field_value(config, "weight_sync")
    bucket = field_value(config, "weight_sync_bucket_mb")
    if field_value(config, "colocate"):
        return "none", (
            "weight sync: none (colocate: each learner generates from its own weights; a vLLM engine takes them in process when it wakes)"
        )
    if asked == "collective" and runners > 0:
        return "collective", (
            f"weight sync: collective (broadcast from learner 0 to {runners} env runner(s) in "
            f"buckets of {bucket:g} MiB; gloo on CPU, NCCL between GPUs; nothing in Ray's object store)"
        )
    if asked == "collective":
        return "object_store", (
            "weight sync: object_store (weight_sync: collective asked for, but there are no "
            "remote env runners to broadcast to: the local env runner takes the learner's "
            "weights in this process)"
        )
    return "object_store", "weight sync: object_store (RLlib's sync_weights through Ray's object store)"


# --- the layout (pure) ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Slot:
    """One tensor's place in a bucket: ``buffer[dtype][offset : offset + numel]`` viewed as
    ``shape``."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n


@dataclasses.dataclass(frozen=True)
class Bucket:
    """What one round of broadcasts carries: one flat buffer per dtype (``sizes``: ``(dtype,
    elements)`` in broadcast order) holding the ``slots``."""

    slots: Tuple[Slot, ...]
    sizes: Tuple[Tuple[torch.dtype, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n * _itemsize(d) for d, n in self.sizes)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every bucket of a sync, in order, and the names that share a tensor with an earlier
    one (tied weights: ``(name, first name)``), sent once."""

    buckets: Tuple[Bucket, ...]
    aliases: Tuple[Tuple[str, str], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def names(self) -> List[str]:
        return [s.name for b in self.buckets for s in b.slots] + [a for a, _ in self.aliases]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_buckets(
    specs: Sequence[Tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int, aliases: Sequence[Tuple[str, str]] = ()
) -> Layout:
    """Cut ``(name, shape, dtype)`` tensors, in order, into buckets of at most
    ``bucket_bytes`` (a tensor larger than that gets a bucket of its own); within a bucket
    each dtype's tensors lie end to end in one flat buffer."""
    buckets: List[Bucket] = []
    current: List[Tuple[str, Tuple[int, ...], torch.dtype]] = []
    used = 0

    def close():
        if current:
            buckets.append(_bucket(current))
            current.clear()

    for name, shape, dtype in specs:
        shape = tuple(int(s) for s in shape)
        size = _itemsize(dtype) * Slot(name, shape, dtype, 0).numel
        if current and used + size > bucket_bytes:
            close()
            used = 0
        current.append((name, shape, dtype))
        used += size
    close()
    return Layout(tuple(buckets), tuple(aliases))


def _bucket(entries) -> Bucket:
    offsets: Dict[torch.dtype, int] = {}
    slots = []
    for name, shape, dtype in entries:
        slot = Slot(name, shape, dtype, offsets.get(dtype, 0))
        offsets[dtype] = slot.offset + slot.numel
        slots.append(slot)
    return Bucket(tuple(slots), tuple(offsets.items()))


# --- the group (both ends) --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GroupAddress:
    """Where and how to join a generation's group (sent to every runner when it joins)."""

    host: str
    port: int
    world_size: int
    generation: int
    backend: str  # "gloo" | "nccl"
    layout: Layout


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def serve_store(host: str) -> "torch.distributed.TCPStore":
    """The root's rendezvous store, on a port the OS picks (``store.port``)."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def store_client(host: str, port: int) -> "torch.distributed.TCPStore":
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))


class RoundCalledOff(RuntimeError):
    """A round of the group did not start: a member never checked in."""


def _key(tag: str, what: str) -> str:
    return f"weights/{tag}/{what}"


def check_in(store, tag: str) -> bool:
    """A runner: count itself in for round ``tag``, then wait for the root's word; True: go."""
    store.add(_key(tag, "ready"), 1)
    store.wait([_key(tag, "go")], datetime.timedelta(seconds=TIMEOUT_S))
    return store.get(_key(tag, "go")) == b"1"


def await_members(store, tag: str, members: int, timeout_s: float = TIMEOUT_S) -> None:
    """The root: once ``members`` runners have checked in for ``tag``, tell them to go; if the
    driver calls the round off (:func:`call_off`) or the time runs out first, tell them not
    to and raise :class:`RoundCalledOff`."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while store.add(_key(tag, "ready"), 0) < members:
        if store.check([_key(tag, "off")]) or time.monotonic() > deadline:
            store.set(_key(tag, "go"), b"0")
            raise RoundCalledOff(
                f"round {tag}: {store.add(_key(tag, 'ready'), 0)} of {members} runner(s) checked in before it was called off"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    store.set(_key(tag, "go"), b"1")


def forget(store, tag: str) -> None:
    """The root: drop a finished round's keys (a store lives as long as its generation)."""
    for what in ("ready", "go", "off"):
        store.delete_key(_key(tag, what))


def call_off(store, tag: str) -> None:
    """The driver: a runner of round ``tag`` failed before checking in; the root stops waiting."""
    store.set(_key(tag, "off"), b"1")


def new_group(store, rank: int, world_size: int, backend: str, host: str, device: torch.device):
    """A process group of ``world_size`` members over ``store``, made without
    ``init_process_group`` (the default group, the learners', stays as it is). Blocks until
    every member has called it."""
    import torch.distributed as dist

    store = dist.PrefixStore("group", store)  # its keys apart from the check-ins'
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    if backend == "nccl":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()
    # Bound to this node's address (as Ray knows it), not whatever the host name resolves to
    # (127.0.1.1 on many machines, unreachable from another node); GLOO_SOCKET_IFNAME wins.
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    device_ = (
        dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0])
        if ifname
        else dist.ProcessGroupGloo.create_device(hostname=host)
    )
    options._devices = [device_]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def broadcast(group, tensor: torch.Tensor) -> None:
    """``tensor`` from rank 0 to every member, in place (blocks until done here)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def drop_group(end) -> None:
    """Let go of a group (a dead peer may have left it unusable: NCCL's is aborted)."""
    group = getattr(end, "group", None)
    end.group = None
    if group is not None and hasattr(group, "abort") and type(group).__name__ == "ProcessGroupNCCL":
        try:
            group.abort()
        except Exception as e:  # best effort: the communicator may be gone already
            logger.debug("aborting the weight group: %s", e)


def _buffer_device(backend: str, device: torch.device) -> torch.device:
    """Gloo moves CPU tensors; NCCL the GPU's own."""
    return device if backend == "nccl" else torch.device("cpu")


class _Scratch:
    """One flat buffer per dtype, as large as the largest bucket needs, reused bucket after
    bucket within a sync (so a member holds at most one bucket's worth besides its model)."""

    def __init__(self, layout: Layout, device: torch.device):
        need: Dict[torch.dtype, int] = {}
        for bucket in layout.buckets:
            for dtype, n in bucket.sizes:
                need[dtype] = max(need.get(dtype, 0), n)
        self._buffers = {d: torch.empty(n, dtype=d, device=device) for d, n in need.items()}

    def get(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self._buffers[dtype][:numel]


# --- the learners' end ------------------------------------------------------------------------
@dataclasses.dataclass
class _LearnerEnd:
    """What a learner keeps for the current generation."""

    generation: int
    layout: Layout
    tensors: Dict[str, torch.Tensor]  # name -> live parameter / buffer (ZeRO-3: partitioned)
    root: bool
    zero3: bool
    device: torch.device
    store: Any = None
    group: Any = None
    backend: str = "gloo"
    group_size: int = 1


def _unwrapped(module):
    return module.unwrapped() if hasattr(module, "unwrapped") else module


def _inference_tensors(module) -> Dict[str, torch.Tensor]:
    """The module's state as live tensors, without what only training needs (as
    ``get_state(inference_only=True)`` leaves out: PPO's value head). A LoRA learner's are
    the plain model's, each targeted weight merged when it is sent (``models/lora.py``)."""
    from ray.rllib.core.rl_module.apis import InferenceOnlyAPI

    own = getattr(module, "inference_tensors", None)
    tensors = own() if own is not None else module.state_dict(keep_vars=True)
    if isinstance(module, InferenceOnlyAPI) and not module.inference_only:
        skip = tuple(module.get_non_inference_attributes())
        tensors = {k: v for k, v in tensors.items() if not any(k == a or k.startswith(a + ".") for a in skip)}
    return tensors


def _shipped_dtype(learner, module_id: str, module, name: str, tensor: torch.Tensor) -> torch.dtype:
    """The dtype the runners get, as ``get_state(inference_only=True)`` ships it: a DeepSpeed
    module's built dtype; the DDP learner's fp32 master copy cast to its compute dtype."""
    built = getattr(learner, "_ds_dtypes", {}).get(module_id, {})
    if name in built:
        return built[name]
    cast = getattr(module, "compute_dtype", None)
    return cast if cast is not None and tensor.is_floating_point() else tensor.dtype


def learner_tensors(learner, module_id: str = MODULE_ID):
    """``(specs, tensors, aliases)`` of a learner's module: ``specs`` the ``(name, full shape,
    shipped dtype)`` of each distinct tensor in state-dict order, ``tensors`` the live ones by
    name, ``aliases`` the tied names."""
    module = _unwrapped(learner.module[module_id])
    specs, tensors, aliases, first = [], {}, [], {}
    for name, t in _inference_tensors(module).items():
        if id(t) in first:  # tied weights: sent once
            aliases.append((name, first[id(t)]))
            continue
        first[id(t)] = name
        shape = tuple(t.ds_shape) if hasattr(t, "ds_shape") else tuple(t.shape)
        specs.append((name, shape, _shipped_dtype(learner, module_id, module, name, t)))
        tensors[name] = t
    return specs, tensors, aliases


def _is_root() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def learner_open(learner, *, generation: int, bucket_bytes: int, module_id: str = MODULE_ID) -> Optional[dict]:
    """On every learner: plan this generation's buckets (the same plan on every rank). The
    root also serves the group's store and returns ``{"host", "port", "layout", "device"}``;
    the others return None."""
    learner_close(learner)
    specs, tensors, aliases = learner_tensors(learner, module_id)
    end = _LearnerEnd(
        generation=generation,
        layout=plan_buckets(specs, bucket_bytes, aliases),
        tensors=tensors,
        root=_is_root(),
        zero3=any(hasattr(t, "ds_id") for t in tensors.values()),
        device=torch.device(rc.learner_device(learner) or "cpu"),
    )
    setattr(learner, _END, end)
    if not end.root:
        return None
    host = node_ip()
    end.store = serve_store(host)
    return {"host": host, "port": end.store.port, "layout": end.layout, "device": end.device.type}


def learner_join(learner, *, generation: int, world_size: int, backend: str) -> None:
    """The root joins its group as rank 0, once every runner has checked in (blocks until
    every runner has joined)."""
    end = _learner_end(learner, generation)
    if end.root:
        end.backend, end.group_size = backend, world_size
        await_members(end.store, join_tag(generation), world_size - 1)
        end.group = new_group(end.store, 0, world_size, backend, node_ip(), end.device)


def join_tag(generation: int) -> str:
    return f"g{generation}/join"


def sync_tag(generation: int, sync: int) -> str:
    return f"g{generation}/sync{sync}"


def learner_send(learner, *, generation: int, sync: int) -> dict:
    """Sync number ``sync``, on every learner at once. Per bucket: gather (ZeRO-3, all
    learners), then the root flattens and broadcasts, once every runner has checked in. An
    error at the root does not end its gathers early (the other learners would wait in
    theirs for ever): it is returned after the last bucket, as ``{"error": ...}``; else
    ``{"bytes", "seconds", "buckets"}`` (root; the others return ``{}``)."""
    end = _learner_end(learner, generation)
    if not (end.root or end.zero3):
        return {}
    start, error = time.perf_counter(), None
    scratch = None
    if end.root:
        tag = sync_tag(generation, sync)
        try:
            on = _buffer_device(end.backend, end.device)
            scratch = _Scratch(end.layout, on)
            header = torch.tensor([generation, rc.weights_seq_no(learner)], dtype=torch.int64, device=on)
        except Exception as e:  # before the runners' go: tell them not to wait
            error = e
            end.store.set(_key(tag, "go"), b"0")
        else:
            try:
                forget(end.store, sync_tag(generation, sync - 1))  # every runner is past it
                await_members(end.store, tag, end.group_size - 1)
                broadcast(end.group, header)
            except Exception as e:
                error = e
    for bucket in end.layout.buckets:
        with _gathered([end.tensors[s.name] for s in bucket.slots], end.zero3):
            if end.root and error is None:
                try:
                    _send_bucket(end, bucket, scratch)
                except Exception as e:
                    error = e
    if not end.root:
        return {}
    if error is not None:
        logger.warning("weight broadcast, generation %d, failed at the root: %r", generation, error)
        drop_group(end)
        return {"error": repr(error)}
    return {"bytes": end.layout.nbytes, "seconds": time.perf_counter() - start, "buckets": len(end.layout.buckets)}


def learner_close(learner) -> None:
    """Drop this learner's end of the group (and the root's store)."""
    end = getattr(learner, _END, None)
    if end is not None:
        drop_group(end)
        end.store = None
        setattr(learner, _END, None)


def _learner_end(learner, generation: int) -> _LearnerEnd:
    end = getattr(learner, _END, None)
    if end is None or end.generation != generation:
        raise RuntimeError(f"this learner holds no weight group of generation {generation} (has {getattr(end, 'generation', None)})")
    return end


def _gathered(params: List[torch.Tensor], zero3: bool):
    """ZeRO-3: the bucket's full parameters on every learner while inside (a collective
    over all learners, in the same order everywhere); otherwise nothing to do."""
    import contextlib

    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([p for p in params if hasattr(p, "ds_id")], modifier_rank=None)


@torch.no_grad()
def _send_bucket(end: _LearnerEnd, bucket: Bucket, scratch: _Scratch) -> None:
    """Cast each tensor into its dtype's flat buffer (the cast is the copy), broadcast. A
    LoRA layer's weight is merged here, one at a time."""
    for dtype, numel in bucket.sizes:
        buf = scratch.get(dtype, numel)
        for slot in bucket.slots:
            if slot.dtype == dtype:
                tensor = resolve(end.tensors[slot.name])
                buf[slot.offset : slot.offset + slot.numel].copy_(tensor.detach().reshape(-1))
        broadcast(end.group, buf)


# --- the runners' end -------------------------------------------------------------------------
@dataclasses.dataclass
class RunnerEnd:
    """What an env runner keeps for the current generation."""

    address: GroupAddress
    rank: int
    device: torch.device
    group: Any = None
    store: Any = None

    @property
    def generation(self) -> int:
        return self.address.generation

    @classmethod
    def join(cls, address: GroupAddress, rank: int, device: torch.device) -> "RunnerEnd":
        """Join the group as ``rank`` (blocks until every member has joined)."""
        end = cls(address, rank, device)
        end.store = store_client(address.host, address.port)
        if not check_in(end.store, join_tag(address.generation)):
            raise RoundCalledOff(f"joining weight group {address.generation} was called off (another member failed)")
        end.group = new_group(end.store, rank, address.world_size, address.backend, node_ip(), device)
        return end

    def missing(self, names: Sequence[str]) -> List[str]:
        """Which of a module's ``names`` this generation's layout does not carry."""
        have = set(self.address.layout.names())
        return [n for n in names if n not in have]

    @torch.no_grad()
    def receive(self, sync: int, targets: Optional[Dict[str, torch.Tensor]]) -> Tuple[int, Optional[Dict[str, torch.Tensor]]]:
        """Sync number ``sync``'s broadcasts, after checking in. With ``targets`` (name -> the
        module's live tensors) each slice is copied into its tensor and nothing is kept;
        without, every tensor is collected in host memory (a buffer per bucket, each tensor a
        view of it; over NCCL each bucket lands in one GPU buffer first and is copied out) and
        returned. Host memory, because the collected state goes into a vLLM engine in one
        ``load_weights`` call: vLLM's in-place reload finishes each layer with what one call
        brought, so a layer split across two calls would be finished half-loaded, and a whole
        model held on the engine's GPU next to its KV cache would not fit the memory plan (the
        object-store path hands the engine host tensors too). Returns ``(weights seq no,
        collected or None)``."""
        if not check_in(self.store, sync_tag(self.generation, sync)):
            raise RoundCalledOff(f"sync {sync} of weight group {self.generation} was called off")
        layout = self.address.layout
        on = _buffer_device(self.address.backend, self.device)
        header = torch.zeros(2, dtype=torch.int64, device=on)
        broadcast(self.group, header)
        generation, seq_no = (int(v) for v in header.tolist())
        if generation != self.generation:
            raise RuntimeError(f"weight broadcast of generation {generation} in the group of {self.generation}")
        collected: Optional[Dict[str, torch.Tensor]] = None if targets is not None else {}
        # Gloo receives into host memory already: a collected bucket's buffer is its own.
        scratch = _Scratch(layout, on) if targets is not None or on.type != "cpu" else None
        for bucket in layout.buckets:
            for dtype, numel in bucket.sizes:
                buf = scratch.get(dtype, numel) if scratch is not None else torch.empty(numel, dtype=dtype, device=on)
                broadcast(self.group, buf)
                if collected is not None and buf.device.type != "cpu":
                    buf = buf.to("cpu")
                for slot in bucket.slots:
                    if slot.dtype != dtype:
                        continue
                    view = buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    if collected is not None:
                        collected[slot.name] = view
                    elif slot.name in targets:
                        targets[slot.name].copy_(view)
        for name, first in layout.aliases:
            if collected is not None:
                collected[name] = collected[first]
            elif name in targets and first in targets and not _same_storage(targets[name], targets[first]):
                targets[name].copy_(targets[first])
        return seq_no, collected

    def close(self) -> None:
        drop_group(self)
        self.store = None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# --- the driver ---------------------------------------------------------------------------------
class WeightBroadcaster:
    """The driver's side of ``weight_sync: collective``: the group's generation and members,
    and one sync (:meth:`sync`). ``invalidate`` makes the next sync build a new group."""

    def __init__(self, bucket_mb: float = 512, timeout_s: float = TIMEOUT_S):
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.timeout_s = float(timeout_s)
        self.generation = 0
        self.members: Tuple[int, ...] = ()
        self.backend: Optional[str] = None
        self.syncs = 0
        self._store = None  # a client of the root's store: to call a round off
        self._stale = True

    def invalidate(self) -> None:
        self._stale = True

    def sync(self, learner_group, runner_group) -> dict:
        """Broadcast the learners' weights to every healthy remote runner, building a new
        group first if its members changed. Raises :class:`WeightSyncFailed` (the runners at
        fault marked unhealthy, the group to be rebuilt) when a member fails."""
        members = tuple(sorted(runner_group.healthy_worker_ids()))
        if not members:
            return {"runners": 0}
        if self._stale or members != self.members:
            self._rebuild(learner_group, runner_group, members)
        return self._broadcast(learner_group, runner_group)

    def close(self, learner_group) -> None:
        """Drop the learners' ends (the root's store); the runners' go with their actors."""
        self._stale, self.members, self._store = True, (), None
        if learner_group is not None:
            learner_group.foreach_learner(learner_close)

    # ---- building a generation ------------------------------------------------------------
    def _rebuild(self, learner_group, runner_group, members: Tuple[int, ...]) -> None:
        generation = self.generation + 1
        self._stale, self._store = True, None
        devices = self._runner_devices(runner_group, members)
        opened = [
            r.get()
            for r in learner_group.foreach_learner(functools.partial(learner_open, generation=generation, bucket_bytes=self.bucket_bytes))
        ]
        root = next(o for o in opened if o)
        backend = "nccl" if root["device"] == "cuda" and all(d == "cuda" for d in devices.values()) else "gloo"
        address = GroupAddress(root["host"], root["port"], len(members) + 1, generation, backend, root["layout"])
        self._store = store_client(address.host, address.port)
        refs = self._launch(runner_group, members, lambda rank: functools.partial(_runner_join, address=address, rank=rank))
        join = functools.partial(learner_join, generation=generation, world_size=address.world_size, backend=backend)
        _, error = self._alongside(
            runner_group,
            members,
            refs,
            join_tag(generation),
            "joining the weight group",
            lambda: [r.get() for r in learner_group.foreach_learner(join)],
        )
        if error is not None:
            raise WeightSyncFailed(f"the root could not build weight group {generation}: {error!r}")
        self.generation, self.members, self.backend, self._stale = generation, members, backend, False
        logger.info(
            "weight group %d: learner 0 + env runners %s over %s, %d bucket(s), %.1f MB a sync",
            generation,
            list(members),
            backend,
            len(address.layout.buckets),
            address.layout.nbytes / 2**20,
        )

    def _runner_devices(self, runner_group, members) -> Dict[int, str]:
        """Each member's receive device (and its module built); a runner that does not answer
        fails the rebuild."""
        got = runner_group.foreach_env_runner(
            lambda r: (r.worker_index, r.weight_receive_device()),
            remote_worker_ids=list(members),
            local_env_runner=False,
            timeout_seconds=self.timeout_s,
        )
        devices = dict(got)
        missing = [m for m in members if m not in devices]
        if missing:
            raise WeightSyncFailed(f"env runner(s) {missing} did not answer before joining the weight group", missing)
        return devices

    # ---- one sync ---------------------------------------------------------------------------
    def _broadcast(self, learner_group, runner_group) -> dict:
        generation, self.syncs = self.generation, self.syncs + 1
        sync = self.syncs
        refs = self._launch(runner_group, self.members, lambda rank: functools.partial(_runner_receive, generation=generation, sync=sync))
        send = functools.partial(learner_send, generation=generation, sync=sync)
        results, error = self._alongside(
            runner_group,
            self.members,
            refs,
            sync_tag(generation, sync),
            "receiving the weights",
            lambda: [r.get() for r in learner_group.foreach_learner(send)],
        )
        sent = next((r for r in results or [] if r), {})
        error = error or sent.get("error")
        if error is not None:
            self._stale = True
            raise WeightSyncFailed(f"the root failed to broadcast weight group {generation}: {error}")
        return {**sent, "runners": len(self.members), "generation": generation}

    # ---- the runners' calls, alongside the learners' --------------------------------------
    def _launch(self, runner_group, members, func_for_rank) -> List[Any]:
        """Start ``func_for_rank(rank)`` on each member (rank 1, 2, ... in member order)
        without waiting: they block in the group until the root takes part. Straight on the
        actors (``apply``), so that RLlib's cap on requests in flight cannot leave one out."""
        actors = rc.runner_actor_manager(runner_group).actors()
        return [actors[wid].apply.remote(func_for_rank(rank)) for rank, wid in enumerate(members, start=1)]

    def _alongside(self, runner_group, members, refs, tag: str, what: str, learner_call):
        """Run ``learner_call`` (the learners' side of round ``tag``; it blocks) in a thread
        while watching the runners' calls: the first that fails calls the round off, so the
        root stops waiting for it. Returns ``(learner results, learner error)``; raises
        :class:`WeightSyncFailed` (the failed runners marked unhealthy, so RLlib's restore
        brings them back) when a runner failed."""
        from concurrent.futures import ThreadPoolExecutor

        import ray

        statuses: Dict[Any, dict] = {}
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-broadcast") as pool:
            learners = pool.submit(learner_call)
            pending, deadline = list(refs), time.monotonic() + self.timeout_s + 60
            while pending and time.monotonic() < deadline:
                ready, pending = ray.wait(pending, num_returns=1, timeout=0.5)
                for ref in ready:
                    statuses[ref] = _status_of(ref)
                    if not statuses[ref].get("ok") and not statuses[ref].get("called_off"):
                        call_off(self._store, tag)
            for ref in pending:  # no answer in time: failed (Ray cannot interrupt a blocked actor call)
                statuses[ref] = {"ok": False, "error": f"no answer in {self.timeout_s + 60:g} s"}
            try:
                results, error = learners.result(), None
            except Exception as e:
                results, error = None, e
        failed = [wid for wid, ref in zip(members, refs) if not statuses[ref].get("ok") and not statuses[ref].get("called_off")]
        if failed:
            self._stale = True
            for wid in failed:
                rc.runner_actor_manager(runner_group).set_actor_state(wid, healthy=False)
            reasons = "; ".join(f"runner {wid}: {statuses[ref].get('error')}" for wid, ref in zip(members, refs) if wid in failed)
            raise WeightSyncFailed(f"{what} failed on env runner(s) {failed}: {reasons}", failed)
        return results, error


def _status_of(ref) -> dict:
    import ray

    try:
        return ray.get(ref)
    except Exception as e:  # the actor died (or was restarted mid-call)
        return {"ok": False, "error": repr(e)}


# Runner-side calls (module level, so that Ray pickles them by reference).
def _runner_join(runner, *, address: GroupAddress, rank: int) -> dict:
    return runner.join_weight_group(address, rank)


def _runner_receive(runner, *, generation: int, sync: int) -> dict:
    return runner.receive_weights(generation, sync)


def runner_join(runner, address: GroupAddress, rank: int, device: torch.device, names: Sequence[str]) -> Tuple[Optional[RunnerEnd], dict]:
    """An env runner joins a generation (its old group dropped first); ``names`` are its
    module's state names, which the layout must all carry. Never raises (an exception in a
    runner's call would end its actor): returns ``(end or None, status)``."""
    runner_leave(runner)
    try:
        end = RunnerEnd.join(address, rank, device)
    except RoundCalledOff as e:
        return None, {"ok": False, "called_off": True, "error": str(e)}
    except Exception as e:
        logger.exception("joining weight group %d failed", address.generation)
        return None, {"ok": False, "error": repr(e)}
    missing = end.missing(names)
    if missing:
        end.close()
        return None, {
            "ok": False,
            "error": f"the learners' weights lack {missing[:5]} ({len(missing)} in all) of this runner's module: a different architecture?",
        }
    setattr(runner, _END, end)
    return end, {"ok": True}


def runner_receive(runner, generation: int, sync: int, targets: Optional[Dict[str, torch.Tensor]]):
    """Sync number ``sync`` on an env runner: ``(seq no, collected, status)``; never raises."""
    end: Optional[RunnerEnd] = getattr(runner, _END, None)
    if end is None or end.generation != generation:
        return 0, None, {"ok": False, "error": f"not a member of weight group {generation} (holds {getattr(end, 'generation', None)})"}
    try:
        start = time.perf_counter()
        seq_no, collected = end.receive(sync, targets)
    except RoundCalledOff as e:
        return 0, None, {"ok": False, "called_off": True, "error": str(e)}
    except Exception as e:
        logger.exception("receiving weight group %d's broadcast failed", generation)
        runner_leave(runner)
        return 0, None, {"ok": False, "error": repr(e)}
    return seq_no, collected, {"ok": True, "seconds": time.perf_counter() - start}


def runner_leave(runner) -> None:
    end = getattr(runner, _END, None)
    if end is not None:
        end.close()
        setattr(runner, _END, None)


# --- measuring what travels through Ray (tests, benchmarks/weight_sync.py) -------------------
#: Ray sends a serialised object of at most this many bytes inline, in the call or its reply
#: (``max_direct_call_object_size``'s default); a larger one goes into the object store.
RAY_INLINE_LIMIT = 100 * 1024
_COUNTS: Dict[str, int] = {}
_UNPATCHED: List[Any] = []


def count_ray_serialization(*_args) -> None:
    """From now on, in this process, count every object Ray serialises (``ray.put``, call
    arguments, return values): all of them, and those above :data:`RAY_INLINE_LIMIT`, which
    Ray puts into the object store. Read (and stop) with :func:`counted_ray_serialization`.
    Takes (and ignores) an actor, so it can be handed to ``foreach_env_runner``."""
    SerializationContext = rc.serialization_context_class()

    counted_ray_serialization()
    _COUNTS.update(objects=0, bytes=0, store_objects=0, store_bytes=0)
    original = SerializationContext.serialize

    def serialize(self, value):
        out = original(self, value)
        size = int(out.total_bytes)
        _COUNTS["objects"] += 1
        _COUNTS["bytes"] += size
        if size > RAY_INLINE_LIMIT:
            _COUNTS["store_objects"] += 1
            _COUNTS["store_bytes"] += size
        return out

    SerializationContext.serialize = serialize
    _UNPATCHED.append(original)


def counted_ray_serialization(*_args) -> Dict[str, int]:
    """Stop counting; what :func:`count_ray_serialization` counted (empty if it was not on)."""
    SerializationContext = rc.serialization_context_class()

    if _UNPATCHED:
        SerializationContext.serialize = _UNPATCHED.pop()
    counts = dict(_COUNTS)
    _COUNTS.clear()
    return counts


def ray_serialization_during(fn, learner_group, runner_group) -> Tuple[Any, Dict[str, int]]:
    """``(fn(), counts)``: what Ray serialised while ``fn`` ran, summed over this process,
    the remote learners and the remote env runners (:func:`count_ray_serialization`;
    ``counts["store_bytes"]``: the bytes that went into Ray's object store)."""
    remote_learners = learner_group is not None and not learner_group.is_local
    runner_group.foreach_env_runner(count_ray_serialization, local_env_runner=False)
    if remote_learners:
        learner_group.foreach_learner(count_ray_serialization)
    count_ray_serialization()
    try:
        result = fn()
    finally:
        parts = [counted_ray_serialization()]
        parts += runner_group.foreach_env_runner(counted_ray_serialization, local_env_runner=False)
        if remote_learners:
            parts += [r.get() for r in learner_group.foreach_learner(counted_ray_serialization)]
    total = {key: sum(p.get(key, 0) for p in parts) for key in ("objects", "bytes", "store_objects", "store_bytes")}
    return result, total
