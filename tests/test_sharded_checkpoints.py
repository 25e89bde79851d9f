"""Checkpoints: written atomically, and each DeepSpeed learner writes and reads only its own
ZeRO optimiser shard (``rllib_exgrpo/rllib/checkpointing.py``, ``docs/deepspeed.md``).

``benchmarks/checkpoint_memory.py`` measures the memory this saves.
"""

import pickle

import numpy as np
import pytest
import torch

from rllib_exgrpo.rllib import checkpointing


def test_atomic_folder_replaces_only_when_complete(tmp_path):
    final = tmp_path / "ckpt"
    with checkpointing.atomic_folder(final) as tmp:
        (tmp / "a.txt").write_text("one")
        assert not final.exists()  # nothing at the final path until the folder is complete
    assert (final / "a.txt").read_text() == "one"

    with pytest.raises(RuntimeError):
        with checkpointing.atomic_folder(final) as tmp:
            (tmp / "a.txt").write_text("two")
            raise RuntimeError("killed mid-save")
    assert (final / "a.txt").read_text() == "one"  # the previous checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left behind

    with checkpointing.atomic_folder(final) as tmp:
        (tmp / "b.txt").write_text("three")
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]

    empty = tmp_path / "tune_made_it"  # Tune creates the checkpoint folder before the save
    empty.mkdir()
    with checkpointing.atomic_folder(empty) as tmp:
        (tmp / "c.txt").write_text("four")
    assert (empty / "c.txt").read_text() == "four"


def test_shard_files_round_trip_and_are_written_atomically(tmp_path):
    state = {"state": {0: {"exp_avg": torch.randn(10)}}, "fp32": [torch.randn(5)], "scaler": {"scale": 1.0}}
    path = checkpointing.shard_file(tmp_path, "default_policy", 1, 4)
    assert path.name == "rank_1_of_4.pt"
    n = checkpointing.save_shard(state, path)
    assert n == path.stat().st_size > 0
    back = checkpointing.load_shard(path)
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert [p.name for p in path.parent.iterdir()] == [path.name]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_zero2_learners_write_and_read_their_own_shards(quick_tiny_model, tmp_path):
    pytest.importorskip("deepspeed")
    from ray.rllib.core import COMPONENT_OPTIMIZER

    from rllib_exgrpo.rllib.algorithm import ExGRPO
    from test_ddp import two_learner_config
    from test_deepspeed import ds_training, optimizer_tensors

    algo = two_learner_config(quick_tiny_model, **ds_training(2)).build_algo()
    try:
        algo.train()
        saved = optimizer_tensors(algo)  # every rank's shard, gathered in memory on request
        algo.save_to_path(str(tmp_path / "ckpt"))
    finally:
        algo.stop()

    learner = tmp_path / "ckpt" / "learner_group" / "learner"
    shards = sorted(p.name for p in (learner / "optimizer_shards" / "default_policy").iterdir())
    assert shards == ["rank_0_of_2.pt", "rank_1_of_2.pt"]
    with open(learner / "state.pkl", "rb") as fh:
        state = pickle.load(fh)
    # The learner's state file names the shards and holds none of them.
    assert state[COMPONENT_OPTIMIZER] == {"deepspeed_sharded": {"default_policy": {"zero_stage": 2, "world_size": 2}}}
    assert (tmp_path / "ckpt" / "learner_group" / "learner" / "rl_module" / "default_policy").is_dir()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left

    restored = ExGRPO.from_checkpoint(str(tmp_path / "ckpt"))
    try:
        got = optimizer_tensors(restored)
        assert got.keys() == saved.keys() and len(saved) >= 4
        for key, value in saved.items():
            assert np.array_equal(got[key], value), key
        restored.train()  # and trains on
    finally:
        restored.stop()
