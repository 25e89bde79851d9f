"""Memory of each learner while a DeepSpeed ZeRO checkpoint is saved and restored.

    python benchmarks/checkpoint_memory.py [--learners 4] [--stage 2] [--layers 16] [--hidden 768] [--out FILE]
    python benchmarks/checkpoint_memory.py --learners 2 --layers 1 --hidden 64 --repeats 1 --out /tmp/checkpoint_memory.json  # small

Builds a randomly initialised Qwen2 model (no download: the config is written here, the
tokenizer is the embedded tiny one; 16 layers x 768 wide = about 101 M parameters), then an
ExGRPO algorithm with ``learner_backend: deepspeed`` (ZeRO-2 by default), 4 learners over
gloo on CPU (fp32, as DeepSpeed runs on CPU), and one optimiser step on a synthetic batch so
that every rank holds its AdamW shard. Then it measures the checkpoint calls:

* ``save``: ``algo.save_to_path(path)``, the whole checkpoint (learner state, optimiser
  shards and, under ZeRO-3, each rank's weight partitions; env runner, sampler, experience
  pool);
* ``restore``: ``algo.learner_group.restore_from_path(path / "learner_group")`` into the
  same running learners: what ``algo.restore_from_path``, ``--resume`` and
  ``Algorithm.from_checkpoint`` run on each learner;
* ``sync`` (reported, not part of the figure): the weight sync to the env runners that
  ``algo.restore_from_path`` runs after the learners' restore, the same call every
  iteration ends with. Under ZeRO-3 the first learner gathers the model for it.

The measure, per learner (rank): the kernel's resident-memory high-water mark (``VmHWM``)
during the call, above its resident memory just before it (the mark is reset then with
``echo 5 > /proc/self/clear_refs``, after ``gc.collect()`` and ``malloc_trim(0)``), divided
by the bytes of that rank's shard: the parameters it holds (ZeRO-1/2: all of them; ZeRO-3:
its partition) plus its ZeRO optimiser state (fp32 master partition and AdamW moments:
the distinct tensor storages of ``optimizer.state_dict()``). File writes go through the
page cache, which is not part of a process's resident memory. The worst rank of save and
restore is reported.

The last line is ``peak_over_shard=X``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from _common import ROOT

from weight_sync import build_model

MODULE = "default_policy"


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _tensor_bytes(obj, seen) -> int:
    import torch

    if torch.is_tensor(obj):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0


def learner_before(learner) -> dict:
    import ctypes
    import gc

    import torch.distributed as dist

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    engine = learner.deepspeed_engines[MODULE]
    params = 0
    for p in engine.module.parameters():
        t = p.ds_tensor if hasattr(p, "ds_tensor") else p
        params += t.numel() * t.element_size()
    optimizer = _tensor_bytes(engine.optimizer.state_dict(), set())
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return {"rank": dist.get_rank(), "rss_kb": _status_kb("VmRSS"), "params_bytes": params, "optimizer_bytes": optimizer}


def learner_after(learner) -> dict:
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "hwm_kb": _status_kb("VmHWM"), "rss_after_kb": _status_kb("VmRSS")}


def synthetic_batch(pad_id: int, rows: int, prompt: int, response: int, vocab: int):
    import numpy as np

    from rllib_exgrpo.core.groups import Trajectory, learner_batch, score_groups, to_multi_agent_batch

    rng = np.random.default_rng(0)
    trajs = []
    for i in range(rows):
        p = rng.integers(3, vocab, size=prompt)
        c = rng.integers(3, vocab, size=response)
        trajs.append(Trajectory(f"q{i // 2}", p, c, np.full(response, -3.0, np.float32), float(i % 2)))
    groups = score_groups(trajs)
    return to_multi_agent_batch(learner_batch(groups.trajectories, groups.advantages, pad_id))


def measure(algo, label, call, rows):
    group = algo.learner_group
    before = [r.get() for r in group.foreach_learner(learner_before)]
    t0 = time.perf_counter()
    call()
    seconds = time.perf_counter() - t0
    after = {a["rank"]: a for a in (r.get() for r in group.foreach_learner(learner_after))}
    worst = 0.0
    for b in sorted(before, key=lambda x: x["rank"]):
        a = after[b["rank"]]
        shard = b["params_bytes"] + b["optimizer_bytes"]
        peak = (a["hwm_kb"] - b["rss_kb"]) * 1024
        ratio = peak / shard
        worst = max(worst, ratio)
        rows.append(
            dict(call=label, seconds=seconds, peak_bytes=peak, ratio=ratio, **b, hwm_kb=a["hwm_kb"], rss_after_kb=a["rss_after_kb"])
        )
        print(
            f"{label:8s} rank {b['rank']}: RSS {b['rss_kb'] / 1024:.0f} MiB before, peak +{peak / 2**20:.0f} MiB; "
            f"shard {shard / 2**20:.0f} MiB (parameters {b['params_bytes'] / 2**20:.0f} + optimizer "
            f"{b['optimizer_bytes'] / 2**20:.0f}) -> {ratio:.2f} x shard; {seconds:.1f} s",
            flush=True,
        )
    return worst


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "out" / "checkpoint_memory.json", help="where the figures go as JSON"
    )
    return parser.parse_args()


def _build_algo(args: argparse.Namespace, work: Path):
    """The ExGRPO algorithm on the model under ``work``, with ``args.learners`` DeepSpeed
    ZeRO-``args.stage`` learners (Ray already started)."""
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    overrides = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if args.stage == 3 else {}
    config = (
        ExGRPOConfig()
        .environment("rllib_exgrpo.envs.reasoning_env:ReasoningEnv", env_config={"dataset": "arithmetic"})
        .training(
            model_name_or_path=str(work / "model"),
            questions_per_step=2,
            group_size=2,
            max_prompt_tokens=32,
            max_response_tokens=4,
            minibatch_size=2 * args.learners,
            lr=1e-4,
            learner_backend="deepspeed",
            deepspeed_zero_stage=args.stage,
            deepspeed=overrides,
        )
        .learners(num_learners=args.learners, num_cpus_per_learner=1)
        .debugging(seed=0)
    )
    t0 = time.perf_counter()
    algo = config.build_algo()
    print(
        f"algorithm built ({args.learners} DeepSpeed ZeRO-{args.stage} learners over gloo) in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return algo


def _measure_checkpoints(algo, work: Path, repeats: int):
    """Save, restore and sync ``repeats`` times under ``work``; returns ``(rows, worst)``, the
    worst save or restore ratio of any rank."""
    rows, worst = [], 0.0
    for i in range(repeats):
        path = work / f"ckpt_{i}"
        worst = max(worst, measure(algo, "save", lambda: algo.save_to_path(str(path)), rows))
        shard_files = sorted(path.glob("learner_group/learner/optimizer_shards/*/*.pt"))
        print(
            f"  {len(shard_files)} shard files: " + ", ".join(f"{f.name} {f.stat().st_size / 2**20:.0f} MiB" for f in shard_files),
            flush=True,
        )
        worst = max(worst, measure(algo, "restore", lambda: algo.learner_group.restore_from_path(str(path / "learner_group")), rows))
        measure(
            algo,
            "sync",
            lambda: algo.env_runner_group.sync_weights(from_worker_or_learner_group=algo.learner_group, inference_only=True),
            rows,
        )
    return rows, worst


def main() -> None:
    args = _parse_args()

    import ray

    work = Path(tempfile.mkdtemp(prefix="checkpoint_memory_"))
    try:
        t0 = time.perf_counter()
        n_params = build_model(work / "model", args.layers, args.hidden)
        print(
            f"model: random Qwen2, {args.layers} layers x {args.hidden}, {n_params / 1e6:.1f} M parameters "
            f"(fp32 on the learners: {n_params * 4 / 2**20:.0f} MiB); built in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        ray.init(
            address="local",
            num_cpus=args.learners + 2,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=str(work / "ray"),
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        )
        algo = _build_algo(args, work)
        vocab = json.loads((work / "model" / "config.json").read_text())["vocab_size"]
        t0 = time.perf_counter()
        algo.learner_group.update(
            batch=synthetic_batch(algo._pad_id, 2 * args.learners, 16, 4, vocab), minibatch_size=2 * args.learners, num_epochs=1
        )
        print(f"one optimiser step in {time.perf_counter() - t0:.1f} s", flush=True)

        rows, worst = _measure_checkpoints(algo, work, args.repeats)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"n_params": n_params, "learners": args.learners, "stage": args.stage, "rows": rows}, indent=1))
        algo.stop()
        ray.shutdown()
        sync = max((r["ratio"] for r in rows if r["call"] == "sync"), default=0.0)
        print(f"weight sync after a restore (as every iteration, not counted above): worst rank {sync:.2f} x shard")
        print(f"peak_over_shard={worst:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
