"""Weight sync from the learner to the env runners, on both paths: bytes, memory, time.

    python benchmarks/weight_sync.py [--layers 20] [--hidden 1024] [--syncs 3] [--bucket-mb 512] [--out FILE]
    python benchmarks/weight_sync.py --layers 1 --hidden 64 --syncs 1 --out /tmp/weight_sync.json   # seconds

Builds a randomly initialised Qwen2 model (no download: the config is written here, the
tokenizer is the embedded tiny one; 20 layers x 1024 wide = 226 M parameters) in bf16,
then an ExGRPO algorithm with that model (`model_dtype: bfloat16`), one local learner and
2 remote env runners on CPU, and measures each path of ``weight_sync``:

* **object_store** (RLlib's): each measured sync is
  ``env_runner_group.sync_weights(from_worker_or_learner_group=learner_group,
  inference_only=True)``, as ``ExGRPO.training_step`` makes it with ``weight_sync:
  object_store``, with ``timeout_seconds=None`` so that the call returns when every runner
  has loaded the weights;
* **collective** (the default): each measured sync is the algorithm's own
  ``_sync_runner_weights()`` (``rllib/weight_broadcast.py``: a gloo broadcast from the learner
  to the runners in buckets of ``--bucket-mb``), which returns when every runner holds them.

Figures, per path:

* **bytes_per_param** (object store): the size of the object the sync puts into Ray's object
  store (the one copy every runner reads; ``ray.experimental.get_object_locations`` ->
  object_size), over the model's parameter count.
* **object-store bytes** (both): every object Ray serialises during the sync in the driver
  and the runners (``weight_broadcast.ray_serialization_during``: ``ray.put``, call arguments,
  replies), those above Ray's inline limit (100 KiB) being the ones that go into the object
  store. For the collective path this is the first number of the last line.
* **extra_copies**: each runner's peak resident memory during the sync above its resident
  memory just before it, in model sizes (the runner's own model: parameter count x bytes
  of its dtype). The peak is the kernel's high-water mark (``VmHWM`` of
  ``/proc/<pid>/status``), reset right before the sync (``echo 5 > /proc/self/clear_refs``),
  so a transient peak cannot be missed between samples. It counts every page the runner
  touches: its own allocations (the collective path's receive buffer: one bucket), and the
  object-store pages of the synced state it reads (shared by the runners, counted in each
  runner's RSS while mapped). The worst runner of the worst sync is reported.
  Ray maps its object store into every worker once; pages a runner touched in an earlier
  sync stay resident, so in the steady state reading the synced state adds no resident
  memory, and the delta is what the runner allocates itself (``--plain-tensors`` shows
  what the measure catches when the state arrives as a copy). The object store holds one
  copy of the state per sync, shared by all runners, freed when the sync returns.
* **seconds**: the wall time of the sync call (median over the syncs).

After the collective syncs each runner's weights are checked bit for bit against the
learner's (sha256 of every tensor), and the local env runner on the driver is checked to
hold no copy of the weights (no module, no pending state).

The line ``bytes_per_param=X extra_copies=Y seconds=Z`` (the object-store path) comes
second to last; the last line is ``collective_object_store_bytes=B collective_seconds=X
object_store_seconds=Y``, B measured as above.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import ROOT  # (also puts the repository on sys.path)


def build_model(folder: Path, layers: int, hidden: int) -> int:
    """A random bf16 Qwen2 saved to ``folder`` with the embedded tokenizer; its size."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rllib_exgrpo.models import resolve_model_path

    tok_dir = resolve_model_path("rehearsal:qwen2")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    tokenizer.save_pretrained(str(folder))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(folder), safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    del model
    return n


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def runner_before(runner) -> dict:
    """On a runner: its model's bytes and resident memory; reset the high-water mark."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS: an honest baseline
    params = list(runner.module.model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return {"model_bytes": model_bytes, "rss_kb": _status_kb("VmRSS"), "shmem_kb": _status_kb("RssShmem"), "pid": os.getpid()}


def runner_after(runner) -> dict:
    return {
        "hwm_kb": _status_kb("VmHWM"),
        "rss_after_kb": _status_kb("VmRSS"),
        "seq_no": runner.held_weights_seq_no,
        "dtype": str(next(runner.module.model.parameters()).dtype),
    }


def digest(tensor) -> str:
    """sha256 of a tensor's bytes (bit-for-bit comparison across processes)."""
    import hashlib

    import numpy as np
    import torch

    t = tensor.as_subclass(torch.Tensor) if torch.is_tensor(tensor) else torch.from_numpy(np.asarray(tensor))
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def runner_digest(runner) -> dict:
    """On a runner: the digest of each of its module's tensors."""
    return {k: digest(v) for k, v in runner.module.state_dict().items()}


def learner_digest(algo) -> dict:
    """The digests of the learner's weights as a sync ships them (the local learner)."""
    state = algo.learner_group._learner.module["default_policy"].get_state(inference_only=True)
    return {k: digest(v) for k, v in state.items()}


def measure(path: str, sync, group, ids, n_params: int, syncs: int, measured_put, put_sizes) -> tuple:
    """``syncs`` timed syncs on ``path`` (after one warm-up): per-runner rows, seconds, and
    what Ray serialised during each (``ray_serialization_during``)."""
    import ray

    from rllib_exgrpo.rllib.weight_broadcast import ray_serialization_during

    sync()  # warm-up: allocator, object store, weight group in their steady state
    rows, seconds, serialised = [], [], []
    real_put = ray.put
    for i in range(syncs):
        before = group.foreach_env_runner(runner_before, local_env_runner=False, remote_worker_ids=ids)
        put_sizes.clear()
        ray.put = measured_put
        t_sync = []

        def timed():
            t0 = time.perf_counter()
            sync()
            t_sync.append(time.perf_counter() - t0)

        try:
            _, counts = ray_serialization_during(timed, None, group)
        finally:
            ray.put = real_put
        seconds.append(t_sync[0])
        serialised.append(counts)
        after = group.foreach_env_runner(runner_after, local_env_runner=False, remote_worker_ids=ids)
        for wid, b, a in zip(ids, before, after):
            extra = (a["hwm_kb"] - b["rss_kb"]) * 1024 / b["model_bytes"]
            rows.append(
                dict(
                    path=path,
                    sync=i + 1,
                    runner=wid,
                    extra=extra,
                    **b,
                    **a,
                    shipped=sum(put_sizes),
                    store_bytes=counts["store_bytes"],
                    serialised_bytes=counts["bytes"],
                )
            )
            print(
                f"{path} sync {i + 1}, runner {wid}: {sum(put_sizes) / n_params:.3f} bytes/param put, "
                f"{counts['store_bytes'] / 2**20:.1f} MiB into the object store ({counts['bytes']} B serialised), "
                f"RSS {b['rss_kb'] / 1024:.0f} MiB before ({b['shmem_kb'] / 1024:.0f} MiB of it shared), "
                f"peak +{(a['hwm_kb'] - b['rss_kb']) / 1024:.0f} MiB = {extra:.2f} model sizes "
                f"(model {b['model_bytes'] / 2**20:.0f} MiB, {a['dtype']}), weights seq no {a['seq_no']}, "
                f"{seconds[-1]:.2f} s",
                flush=True,
            )
    return rows, seconds, serialised


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=512, help="weight_sync_bucket_mb of the collective path")
    parser.add_argument(
        "--plain-tensors",
        action="store_true",
        help="check of the measure: ship bf16 as plain torch tensors (pickled through bytes) instead of zero-copy",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "weight_sync.json", help="where the figures go as JSON")
    return parser.parse_args()


def _ship_bf16_as_plain_tensors() -> None:
    """``--plain-tensors``: pickle the shipped bf16 weights as plain torch tensors (a copy
    through bytes) instead of zero-copy, to show what the memory measure catches."""
    import torch

    from rllib_exgrpo.rllib.module import ShippedBF16

    ShippedBF16.__reduce_ex__ = lambda self, proto: self.as_subclass(torch.Tensor).__reduce_ex__(proto)


def _build_algo(work: Path, bucket_mb: float):
    """Start a local Ray (its files under ``work``) and build ExGRPO on the model in
    ``work/model``: one local learner, 2 env runners, the collective weight sync."""
    import ray

    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=2 * 2**30,
        _temp_dir=str(work / "ray"),
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    config = (
        ExGRPOConfig()
        .environment("rllib_exgrpo.envs.reasoning_env:ReasoningEnv", env_config={"dataset": "arithmetic"})
        .training(
            model_name_or_path=str(work / "model"),
            model_dtype="bfloat16",
            questions_per_step=2,
            group_size=2,
            max_prompt_tokens=64,
            max_response_tokens=4,
            minibatch_size=4,
            weight_sync="collective",
            weight_sync_bucket_mb=bucket_mb,
        )
        .env_runners(num_env_runners=2, num_cpus_per_env_runner=1)
        .learners(num_learners=0)
    )
    t0 = time.perf_counter()
    algo = config.build_algo()
    print(f"algorithm built (1 local learner, 2 env runners) in {time.perf_counter() - t0:.1f} s", flush=True)
    return algo


def _measuring_put() -> tuple:
    """``(measured_put, put_sizes)``: ``ray.put`` that also appends to ``put_sizes`` the size of
    each object it puts into the object store (what each object-store sync ships)."""
    import ray

    put_sizes = []
    real_put = ray.put

    def measured_put(value, *a, **k):
        ref = real_put(value, *a, **k)
        loc = ray.experimental.get_object_locations([ref]).get(ref, {})
        put_sizes.append(int(loc.get("object_size") or 0))
        return ref

    return measured_put, put_sizes


def _check_runner_weights(algo, group, ids) -> tuple:
    """``(equal, local_holds)``: whether each remote runner's weights equal the learner's bit for
    bit, and whether the local env runner holds a copy of them (module or pending state)."""
    expected = learner_digest(algo)
    digests = group.foreach_env_runner(runner_digest, local_env_runner=False, remote_worker_ids=ids)
    equal = all(d == expected for d in digests)
    print(
        f"after the collective syncs, each runner's weights equal the learner's bit for bit: "
        f"{'yes' if equal else 'NO'} ({len(expected)} tensors, sha256)"
    )
    local = group.local_env_runner
    local_holds = local.module is not None or local._pending_module_state is not None
    print(
        f"local env runner after the syncs: module={'yes' if local.module is not None else 'no'}, "
        f"pending state={'yes' if local._pending_module_state is not None else 'no'}"
    )
    return equal, local_holds


def _measure_syncs(algo, group, ids, n_params: int, syncs: int) -> tuple:
    """``syncs`` object-store weight syncs, then ``syncs`` collective ones, each measured:
    ``(store_rows, store_seconds, coll_rows, coll_seconds, coll_counts)``."""
    # The size of what each object-store sync puts into the object store (the driver's ray.put).
    measured_put, put_sizes = _measuring_put()

    def object_store_sync():
        group.sync_weights(from_worker_or_learner_group=algo.learner_group, inference_only=True, timeout_seconds=None)

    store_rows, store_seconds, _ = measure("object_store", object_store_sync, group, ids, n_params, syncs, measured_put, put_sizes)
    coll_rows, coll_seconds, coll_counts = measure(
        "collective", algo._sync_runner_weights, group, ids, n_params, syncs, measured_put, put_sizes
    )
    return store_rows, store_seconds, coll_rows, coll_seconds, coll_counts


def main() -> None:
    args = _parse_args()
    if args.plain_tensors:
        _ship_bf16_as_plain_tensors()

    import ray

    work = Path(tempfile.mkdtemp(prefix="weight_sync_"))
    try:
        t0 = time.perf_counter()
        n_params = build_model(work / "model", args.layers, args.hidden)
        print(
            f"model: random Qwen2, {args.layers} layers x {args.hidden}, {n_params / 1e6:.1f} M parameters, "
            f"bf16 ({n_params * 2 / 2**20:.0f} MiB); built in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        algo = _build_algo(work, args.bucket_mb)
        group = algo.env_runner_group
        ids = group.healthy_worker_ids()
        store_rows, store_seconds, coll_rows, coll_seconds, coll_counts = _measure_syncs(algo, group, ids, n_params, args.syncs)
        equal, local_holds = _check_runner_weights(algo, group, ids)
        bytes_per_param = max(r["shipped"] for r in store_rows) / n_params
        extra_copies = max(r["extra"] for r in store_rows)
        coll_extra = max(r["extra"] for r in coll_rows)
        coll_store_bytes = max(c["store_bytes"] for c in coll_counts)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "n_params": n_params,
                    "bucket_mb": args.bucket_mb,
                    "rows": store_rows + coll_rows,
                    "seconds": {"object_store": store_seconds, "collective": coll_seconds},
                    "collective_serialised": coll_counts,
                    "runners_equal_learner": equal,
                    "local_runner_holds_weights": local_holds,
                },
                indent=1,
            )
        )
        algo.stop()
        ray.shutdown()
        if local_holds:
            print("WARNING: the local env runner holds a copy of the weights")
        if not equal:
            print("WARNING: a runner's weights differ from the learner's after the collective syncs")
        print(
            f"collective: {max(c['bytes'] for c in coll_counts)} B serialised by Ray per sync (call arguments "
            f"and replies), runner peak +{coll_extra:.2f} model sizes (one bucket of {args.bucket_mb:g} MiB at most)"
        )
        print(f"bytes_per_param={bytes_per_param:.3f} extra_copies={extra_copies:.2f} seconds={statistics.median(store_seconds):.2f}")
        print(
            f"collective_object_store_bytes={coll_store_bytes} collective_seconds={statistics.median(coll_seconds):.2f} "
            f"object_store_seconds={statistics.median(store_seconds):.2f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
