"""ZeRO-3 module weights in a checkpoint: each rank's own partitions, never gathered.

Under ZeRO-3 every learner holds a 1/N slice of each parameter. Writing the module folder
with the full weights (as under ZeRO-1/2) would gather the whole model into one rank for
the save, and make every rank read the whole model on restore, only to keep its slice.
So a ZeRO-3 checkpoint's module folder holds a **manifest** instead of weights:

``{MANIFEST_KEY: {"world_size": N, "whole": {name: tensor}, "shapes": {name: (shape, dtype)},
"tied": {name: first_name}}}``

* ``whole``: the tensors every rank holds in full (buffers, and parameters ZeRO-3 keeps
  whole: ``stage3_param_persistence_threshold``), small;
* each rank's partitions of the others: ``<learner folder>/module_shards/<module
  id>/rank_<r>_of_<N>.pt`` (``{name: ds_tensor}``, written from the live tensors), beside
  the optimiser shards.

A restore reads the manifest and its own rank's file only (the same ZeRO stage and number
of learners, as for the optimiser shards). :func:`consolidate` (also ``python -m
rllib_exgrpo.rllib.zero3_weights CHECKPOINT OUT``) writes the full weights as an ordinary
module folder, as DeepSpeed's ``zero_to_fp32.py`` and verl's model merger do for theirs: for
evaluation, ``RLModule.from_checkpoint`` or export.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pickle
import shutil
from typing import Any, Dict, Optional, Union

import torch

#: The key that marks a module state as a ZeRO-3 manifest.
MANIFEST_KEY = "deepspeed_zero3_module"
#: The folder, inside a learner's checkpoint folder, of the per-rank module partitions.
MODULE_SHARD_FOLDER = "module_shards"

PathLike = Union[str, os.PathLike]


def is_manifest(state: Any) -> bool:
    return isinstance(state, dict) and MANIFEST_KEY in state


def not_weights_error(where: str) -> ValueError:
    return ValueError(
        f"{where} is a ZeRO-3 checkpoint's module folder: it holds a manifest, each learner's slice of the "
        "weights is in module_shards/. Restore it with the same learners (learner_backend: deepspeed, "
        "deepspeed_zero_stage: 3, the same num_learners), or write the full weights first: "
        "python -m rllib_exgrpo.rllib.zero3_weights CHECKPOINT OUT"
    )


def rank_file(learner_folder: PathLike, module_id: str, rank: int, world_size: int) -> pathlib.Path:
    return pathlib.Path(learner_folder) / MODULE_SHARD_FOLDER / str(module_id) / f"rank_{rank}_of_{world_size}.pt"


def full_tensor(pieces, shape, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """One parameter from its rank partitions (rank order; each padded to the same size)."""
    numel = 1
    for s in shape:
        numel *= int(s)
    flat = torch.cat([p.reshape(-1) for p in pieces])[:numel].reshape(tuple(shape))
    return flat if dtype is None else flat.to(dtype)


def _read_pickle(path: pathlib.Path) -> Any:
    with open(path, "rb") as fh:
        return pickle.load(fh)


def _learner_folders(checkpoint: pathlib.Path):
    """The learner folders under ``checkpoint`` (an algorithm's, a learner group's or a
    learner's checkpoint)."""
    for cand in (checkpoint, checkpoint / "learner", checkpoint / "learner_group" / "learner"):
        if (cand / "rl_module").is_dir():
            return cand
    raise FileNotFoundError(f"{checkpoint}: no learner folder with an rl_module/ inside")


def consolidate(checkpoint: PathLike, out: PathLike) -> Dict[str, pathlib.Path]:
    """Write each ZeRO-3 module of ``checkpoint`` as a module folder with its full weights
    under ``out/<module id>`` (the files of the checkpoint's module folder, with the state
    file holding the full weights in the module's dtype). Reads one rank's partitions at a
    time through memory maps, so it needs about one copy of the weights in memory."""
    from ray.rllib.core.rl_module.rl_module import RLModule

    learner = _learner_folders(pathlib.Path(checkpoint))
    out = pathlib.Path(out)
    written = {}
    for module_folder in sorted(p for p in (learner / "rl_module").iterdir() if p.is_dir()):
        state_file = module_folder / (RLModule.STATE_FILE_NAME + ".pkl")
        if not state_file.is_file():
            continue
        state = _read_pickle(state_file)
        if not is_manifest(state):
            continue
        manifest = state[MANIFEST_KEY]
        world = manifest["world_size"]
        ranks = [
            torch.load(str(rank_file(learner, module_folder.name, r, world)), map_location="cpu", mmap=True, weights_only=True)
            for r in range(world)
        ]
        full: Dict[str, Any] = dict(manifest["whole"])
        for name, (shape, dtype) in manifest["shapes"].items():
            full[name] = full_tensor([rk[name] for rk in ranks], shape, dtype)
        for name, first in manifest.get("tied", {}).items():
            full[name] = full[first]
        target = out / module_folder.name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(module_folder, target)
        with open(target / state_file.name, "wb") as fh:
            pickle.dump(full, fh, protocol=pickle.HIGHEST_PROTOCOL)
        written[module_folder.name] = target
        del ranks, full
    if not written:
        raise ValueError(f"{checkpoint}: no ZeRO-3 module manifest found (its module folders hold full weights)")
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Write the full weights of a ZeRO-3 checkpoint's modules as ordinary RLlib module folders "
        "(OUT/<module id>, readable by RLModule.from_checkpoint)."
    )
    parser.add_argument("checkpoint", help="an algorithm checkpoint (or its learner_group/learner folder)")
    parser.add_argument("out", help="folder to write OUT/<module id> into")
    args = parser.parse_args(argv)
    for mid, path in consolidate(args.checkpoint, args.out).items():
        print(f"{mid}: full weights written to {path}")


if __name__ == "__main__":
    main()
