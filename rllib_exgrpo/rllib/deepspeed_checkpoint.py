"""DeepSpeed learner checkpoints: ZeRO optimiser shards and ZeRO-3 weight partitions.

:class:`DeepSpeedCheckpointing` is the checkpoint half of ``DeepSpeedExGRPOLearner``
(``rllib/deepspeed_learner.py``): RLlib's state API and folder layout, with every rank's
ZeRO optimiser state written as its own file (``checkpointing.SHARD_FOLDER``) and, for
ZeRO-3, every rank's weight partitions beside a manifest (``zero3_weights``) instead of
weights gathered on one learner. Nothing here builds an engine: the learner's ``_engines``,
``_module_tensors``, ``_set_module_weights``, ``_full_module_state`` and
``_from_every_rank`` are used as they are. The layout is described in ``docs/deepspeed.md``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import pathlib
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ray.rllib.utils.annotations import override
from ray.rllib.core.learner.learner import Learner
from ray.rllib.core import COMPONENT_OPTIMIZER, COMPONENT_RL_MODULE
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.core.rl_module.rl_module import RLModule
from ray.rllib.utils import force_list
from ray.rllib.utils.checkpoints import Checkpointable
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

from rllib_exgrpo.rllib import rllib_contract as rc
from rllib_exgrpo.rllib import checkpointing, zero3_weights
from rllib_exgrpo.rllib.module import shippable

logger = logging.getLogger(__name__)

#: Seconds the asked learner waits for the other ranks' pieces in ``get_state``.
GATHER_TIMEOUT_S = float(os.environ.get("RLLIB_EXGRPO_DEEPSPEED_GATHER_TIMEOUT_S", "600"))


def zero_stage(engine) -> int:
    return int(engine.zero_optimization_stage())


def _local_path(filesystem, path) -> None:
    """Optimiser shards are written and read with local file operations."""
    if filesystem is not None:
        import pyarrow.fs

        if not isinstance(filesystem, pyarrow.fs.LocalFileSystem):
            raise NotImplementedError(
                f"DeepSpeed optimizer shards need a local (or mounted) checkpoint path, got {type(filesystem).__name__} for {path}"
            )


class _StateFile(Checkpointable):
    """Reads one RLModule folder's state file (``module_state.pkl``) without a module."""

    STATE_FILE_NAME = RLModule.STATE_FILE_NAME

    def __init__(self):
        self.state = None

    @override(Checkpointable)
    def get_state(self, *args, **kwargs):
        return self.state

    @override(Checkpointable)
    def set_state(self, state) -> None:
        self.state = state

    @override(Checkpointable)
    def get_ctor_args_and_kwargs(self):
        return (), {}


class DeepSpeedCheckpointing(TorchLearner):
    """Checkpoint I/O of the DeepSpeed learner (see the module doc); a base of
    ``DeepSpeedExGRPOLearner``, after ``ExGRPOTorchLearner`` in its MRO."""

    def _zero3_manifest(self, module_id, inference_only: bool = False) -> Dict[str, Any]:
        """A ZeRO-3 module's state in a checkpoint (``zero3_weights``): nothing gathered.
        The tensors every rank holds whole go in it; each rank writes its partitions of the
        others beside it (:meth:`_ds_own_module_partitions`)."""
        dtypes = self._ds_dtypes[module_id]
        whole, shapes, tied, first = {}, {}, {}, {}
        for key, t in self._module_tensors(module_id, inference_only).items():
            want = dtypes.get(key, t.dtype)
            if not hasattr(t, "ds_id"):
                whole[key] = shippable(t, want)
            elif t.ds_id in first:
                tied[key] = first[t.ds_id]
            else:
                first[t.ds_id] = key
                if t.data.numel() == t.ds_numel:  # kept whole on every rank (persistent)
                    whole[key] = shippable(t.data, want)
                else:
                    shapes[key] = (tuple(t.ds_shape), want)
        return {
            zero3_weights.MANIFEST_KEY: {
                "world_size": dist.get_world_size(),
                "whole": whole,
                "shapes": shapes,
                "tied": tied,
            }
        }

    def _ds_own_module_partitions(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """This rank's live ZeRO-3 partitions (``ds_tensor``) of each partitioned
        parameter, by name (no copy: ``torch.save`` writes them from their own storage)."""
        out = {}
        for mid in self._engines:
            if not self._is_zero3(mid):
                continue
            parts, seen = {}, set()
            for key, t in self._module_tensors(mid).items():
                if hasattr(t, "ds_id") and t.ds_id not in seen and t.data.numel() != t.ds_numel:
                    seen.add(t.ds_id)
                    parts[key] = t.ds_tensor.data
            out[mid] = parts
        return out

    @torch.no_grad()
    def _load_own_module_partitions(self, module_id, manifest: Dict[str, Any], learner_folder: pathlib.Path) -> None:
        """A ZeRO-3 manifest in: the whole tensors, then this rank's own partition file."""
        entry = manifest[zero3_weights.MANIFEST_KEY]
        rank, world = dist.get_rank(), dist.get_world_size()
        if not self._is_zero3(module_id) or entry["world_size"] != world:
            raise ValueError(
                f"module {module_id!r}: the checkpoint holds ZeRO-3 weight partitions of {entry['world_size']} "
                f"learner(s); this run has ZeRO-{zero_stage(self._engines[module_id]) if module_id in self._engines else 0} "
                f"with {world}. Restore with the same deepspeed_zero_stage and num_learners, or write the full "
                "weights first: python -m rllib_exgrpo.rllib.zero3_weights CHECKPOINT OUT"
            )
        path = zero3_weights.rank_file(learner_folder, module_id, rank, world)
        if not path.is_file():
            raise FileNotFoundError(f"module weight partition {path} missing from the checkpoint")
        self._set_module_weights(module_id, entry["whole"])
        saved = torch.load(str(path), map_location="cpu", weights_only=True)
        tensors = self._module_tensors(module_id)
        for key in entry["shapes"]:
            part = tensors[key].ds_tensor
            part.data.copy_(saved.pop(key).reshape(part.shape))
        del saved
        self._engines[module_id].optimizer.refresh_fp32_params()

    # ---- optimizer state -----------------------------------------------------------------
    @override(TorchLearner)
    def _get_optimizer_state(self) -> Dict[str, Any]:
        """In a checkpoint (and any state not asking for the optimiser by name): a manifest,
        ``{"deepspeed_sharded": {module_id: {zero_stage, world_size}}}``; each rank writes
        its own shard beside it (``save_to_path``). Asked for by name
        (``get_state(components="optimizer")``): every rank's shard, gathered here through
        Ray (in memory: tests, debugging)."""
        if not self._ds_gather_optimizer:
            return {
                "deepspeed_sharded": {
                    mid: {"zero_stage": zero_stage(engine), "world_size": dist.get_world_size()} for mid, engine in self._engines.items()
                }
            }
        shards = {
            mid: {
                "zero_stage": zero_stage(engine),
                "world_size": dist.get_world_size(),
                "shards": self._from_every_rank("_ds_local_optimizer_state", mid),
            }
            for mid, engine in self._engines.items()
        }
        return {"deepspeed": shards}

    def _check_shard_layout(self, mid, entry) -> None:
        engine = self._engines[mid]
        stage, world = zero_stage(engine), dist.get_world_size()
        if entry["zero_stage"] != stage or entry["world_size"] != world:
            raise ValueError(
                f"module {mid!r}: the checkpoint holds ZeRO-{entry['zero_stage']} optimizer shards of "
                f"{entry['world_size']} learner(s); this run has ZeRO-{stage} with {world}. Restore with the "
                "same deepspeed_zero_stage and num_learners (re-sharding is not supported)"
            )

    def _load_zero_state(self, mid, own: Dict[str, Any], read_rank=None) -> None:
        """This rank's ZeRO optimiser state into its engine. DeepSpeed's rigid (default)
        layout reads only the own rank's entry of the list; an elastic one reads all ranks'
        (``read_rank(r)`` gives rank r's)."""
        engine = self._engines[mid]
        rank, world = dist.get_rank(), dist.get_world_size()
        if getattr(engine.optimizer, "elastic_checkpoint", False) and world > 1:
            if read_rank is None:
                raise ValueError("zero_optimization.elastic_checkpoint needs every rank's shard")
            shards = [own if r == rank else read_rank(r) for r in range(world)]
        else:
            shards = [own if r == rank else None for r in range(world)]
        engine.optimizer.load_state_dict(shards, load_optimizer_states=True, load_from_fp32_weights=True)

    @override(TorchLearner)
    def _set_optimizer_state(self, state: Dict[str, Any]) -> None:
        if "deepspeed_sharded" in state:
            # A manifest: the shards are files beside the state (restore_from_path reads this
            # rank's); in memory (set_state(get_state()) on the same learners) nothing moves.
            for mid, entry in state["deepspeed_sharded"].items():
                if mid in self._engines:
                    self._check_shard_layout(mid, entry)
            self._ds_shards_to_load = state["deepspeed_sharded"]
            return
        if "deepspeed" not in state:
            if state:
                logger.warning(
                    "optimizer state without DeepSpeed shards (saved by another learner backend): weights "
                    "restored, optimizer state (AdamW moments, step) starts afresh"
                )
            return
        rank = dist.get_rank()
        for mid, entry in state["deepspeed"].items():
            if mid not in self._engines:
                continue
            self._check_shard_layout(mid, entry)
            shards = entry["shards"]
            # Only this rank's shard is copied (the engine adopts the tensors it is given).
            self._load_zero_state(mid, copy.deepcopy(shards[rank]), lambda r: copy.deepcopy(shards[r]))

    # ---- sharded checkpoints -----------------------------------------------------------------
    #: Set on every learner while the algorithm writes a checkpoint (``ExGRPO.save_to_path``):
    #: the state RLlib asks for then carries a ZeRO-3 module as a manifest, each rank's
    #: partitions being written beside it, instead of the gathered weights.
    _ds_checkpointing = False

    def set_checkpointing(self, on: bool) -> None:
        self._ds_checkpointing = bool(on)

    def _ds_write_own_shards(self, folder: str, module_folder: Optional[str] = None) -> int:
        """This rank's ZeRO optimiser state, as the optimiser holds it (no copy first), to
        ``folder/<module id>/rank_<r>_of_<n>.pt``, and (ZeRO-3, ``module_folder`` given) its
        weight partitions to ``module_folder/<module id>/rank_<r>_of_<n>.pt``; returns the
        bytes written."""
        rank, world = dist.get_rank(), dist.get_world_size()
        written = 0
        for mid, engine in self._engines.items():
            written += checkpointing.save_shard(engine.optimizer.state_dict(), checkpointing.shard_file(folder, mid, rank, world))
        if module_folder is not None:
            for mid, parts in self._ds_own_module_partitions().items():
                written += checkpointing.save_shard(parts, checkpointing.shard_file(module_folder, mid, rank, world))
        return written

    def _ds_node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def _ds_own_shard_states(self) -> Dict[str, Any]:
        """This rank's optimiser state dicts and (ZeRO-3) weight partitions, returned
        through Ray to a writer on another node."""
        return {
            "optimizer": {mid: engine.optimizer.state_dict() for mid, engine in self._engines.items()},
            "module": self._ds_own_module_partitions(),
        }

    def _write_optimizer_shards(self, learner_folder: pathlib.Path) -> None:
        """Every rank's shard into ``learner_folder/optimizer_shards`` (written under a
        temporary name, renamed when all are in). Ranks on this node write their own, at the
        same time; a rank on another node hands its state to this one, one rank at a time."""
        import ray

        rank, world = dist.get_rank(), dist.get_world_size()
        zero3 = any(self._is_zero3(mid) for mid in self._engines)
        with contextlib.ExitStack() as stack:
            tmp = stack.enter_context(checkpointing.atomic_folder(learner_folder / checkpointing.SHARD_FOLDER))
            tmp_module = (
                str(stack.enter_context(checkpointing.atomic_folder(learner_folder / zero3_weights.MODULE_SHARD_FOLDER))) if zero3 else None
            )
            local_refs, remote = [], []
            if self._ds_peers:
                here = self._ds_node_ip()
                ips = ray.get([h._ds_node_ip.remote() for r, h in enumerate(self._ds_peers) if r != rank], timeout=GATHER_TIMEOUT_S)
                others = [(r, h) for r, h in enumerate(self._ds_peers) if r != rank]
                for (r, h), ip in zip(others, ips):
                    if ip == here:
                        local_refs.append(h._ds_write_own_shards.remote(str(tmp), tmp_module))
                    else:
                        remote.append((r, h))
            self._ds_write_own_shards(str(tmp), tmp_module)
            ray.get(local_refs, timeout=GATHER_TIMEOUT_S)
            for r, h in remote:
                states = ray.get(h._ds_own_shard_states.remote(), timeout=GATHER_TIMEOUT_S)
                for mid, sd in states["optimizer"].items():
                    checkpointing.save_shard(sd, checkpointing.shard_file(tmp, mid, r, world))
                for mid, parts in states["module"].items():
                    checkpointing.save_shard(parts, checkpointing.shard_file(tmp_module, mid, r, world))
                del states

    def _read_optimizer_shards(self, learner_folder: pathlib.Path) -> None:
        """This rank's shard (only) from ``learner_folder/optimizer_shards``."""
        manifest, self._ds_shards_to_load = self._ds_shards_to_load, None
        folder = learner_folder / checkpointing.SHARD_FOLDER
        rank, world = dist.get_rank(), dist.get_world_size()
        for mid in manifest:
            if mid not in self._engines:
                continue
            device = next(self._engines[mid].module.parameters()).device

            def read(r, mid=mid):
                path = checkpointing.shard_file(folder, mid, r, world)
                if not path.is_file():
                    raise FileNotFoundError(f"optimizer shard {path} missing from the checkpoint")
                return checkpointing.load_shard(path, map_location=device)

            self._load_zero_state(mid, read(rank), read)

    @override(Checkpointable)
    def save_to_path(self, path=None, *, state=None, filesystem=None, use_msgpack: bool = False) -> str:
        """RLlib's layout (state file, ``rl_module/`` with the full weights), plus each
        rank's ZeRO optimiser shard in ``optimizer_shards/`` (``docs/deepspeed.md``)."""
        path = super().save_to_path(path, state=state, filesystem=filesystem, use_msgpack=use_msgpack)
        if self._engines:
            saved = state if state is not None else None
            sharded = saved is None or "deepspeed_sharded" in (saved.get(COMPONENT_OPTIMIZER) or {})
            if sharded:
                _local_path(filesystem, path)
                self._write_optimizer_shards(pathlib.Path(path))
        return path

    @override(Checkpointable)
    def restore_from_path(self, path, *, component=None, filesystem=None, **kwargs) -> None:
        self._ds_shards_to_load = None
        super().restore_from_path(path, component=component, filesystem=filesystem, **kwargs)
        if self._engines and self._ds_shards_to_load is not None:
            # Each learner reads its own shard (RLlib restores every learner from the path).
            p = str(path if not isinstance(path, pathlib.Path) else path.as_posix())
            if filesystem is None:
                import pyarrow.fs

                filesystem, p = pyarrow.fs.FileSystem.from_uri(p)
            _local_path(filesystem, p)
            self._read_optimizer_shards(pathlib.Path(p))

    # ---- RLlib's state API -----------------------------------------------------------------
    @override(Learner)
    def get_state(self, components=None, *, not_components=None, **kwargs):
        rc.check_is_built(self)
        if not self._engines:
            return super().get_state(components, not_components=not_components, **kwargs)
        want_module = rc.check_component(self, COMPONENT_RL_MODULE, components, not_components)
        self._ds_gather_optimizer = components is not None and any(
            c == COMPONENT_OPTIMIZER or c.startswith(COMPONENT_OPTIMIZER + "/") for c in force_list(components)
        )
        try:
            state = super().get_state(components, not_components=force_list(not_components) + [COMPONENT_RL_MODULE], **kwargs)
        finally:
            self._ds_gather_optimizer = False
        if want_module:
            sub = rc.get_subcomponents(self, COMPONENT_RL_MODULE, components)
            not_sub = rc.get_subcomponents(self, COMPONENT_RL_MODULE, not_components)
            inference_only = kwargs.get("inference_only", False)
            state[COMPONENT_RL_MODULE] = {
                mid: (
                    self._zero3_manifest(mid, inference_only)
                    if self._ds_checkpointing and self._is_zero3(mid)
                    else self._full_module_state(mid, inference_only=inference_only)
                )
                for mid in self.module.keys()
                if rc.check_component(self.module, mid, sub, not_sub)
            }
        return state

    @override(Learner)
    def set_state(self, state) -> None:
        rc.check_is_built(self)
        if not self._engines:
            return super().set_state(state)
        state = dict(state)
        module_state = state.pop(COMPONENT_RL_MODULE, None)
        seq_no = state.get(WEIGHTS_SEQ_NO, 0)
        if module_state is not None and (seq_no == 0 or rc.weights_seq_no(self) < seq_no):
            for mid, weights in module_state.items():
                if mid in self.module:
                    self._set_module_weights(mid, weights)
        super().set_state(state)  # optimizer (_set_optimizer_state), seq no, metrics

    @override(Checkpointable)
    def _restore_all_subcomponents_from_path(self, path, filesystem, only_comp_names=None, component=None, **kwargs):
        """The module folder's weights go through ``_set_module_weights`` (a ZeRO-3 module
        cannot ``load_state_dict`` full tensors); folders as RLlib writes them."""
        path = pathlib.Path(path)
        if component is None:
            if only_comp_names is not None and COMPONENT_RL_MODULE not in only_comp_names:
                return
            folder, mids, learner = path / COMPONENT_RL_MODULE, list(self.module.keys()), path
        elif component == COMPONENT_RL_MODULE:
            folder, mids, learner = path, list(self.module.keys()), path.parent
        elif component.startswith(COMPONENT_RL_MODULE + "/"):
            mid = component[len(COMPONENT_RL_MODULE) + 1 :].split("/")[0]
            self._restore_module_folder(mid, path, filesystem, path.parent.parent)
            return
        else:
            return
        for mid in mids:
            self._restore_module_folder(mid, folder / mid, filesystem, learner)

    def _restore_module_folder(self, module_id, folder: pathlib.Path, filesystem, learner_folder: pathlib.Path) -> None:
        if not (rc.exists_at_fs_path(filesystem, folder.as_posix()) if filesystem is not None else folder.exists()):
            return
        reader = _StateFile()
        reader.restore_from_path(folder, filesystem=filesystem)
        if zero3_weights.is_manifest(reader.state):
            _local_path(filesystem, folder)
            self._load_own_module_partitions(module_id, reader.state, learner_folder)
        else:
            self._set_module_weights(module_id, reader.state)
