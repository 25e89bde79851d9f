"""Weight sync over a collective (``weight_sync: collective``, ``rllib/weight_broadcast.py``)
and through Ray's object store (``object_store``, RLlib's ``sync_weights``).

* the bucket plan, and one broadcast end to end in this process (gloo between threads: a
  fp32 master copy shipped as bf16, tied weights, several buckets, received into a module's
  tensors or collected);
* with 2 remote env runners and a DDP learner group (2 learners, bf16 model: fp32 master
  weights cast to bf16) or a DeepSpeed ZeRO-3 learner group (2 learners, every parameter
  partitioned): after a training iteration the runners' weights differ from their initial
  ones and equal the learners', on each path;
* the collective sync puts nothing into Ray's object store (every object Ray serialises in
  the driver, the learners and the runners during the sync is counted; the object-store
  sync, measured the same way, puts the model in at least once);
* a runner killed and restarted rejoins a new generation of the group with the others and
  receives weights equal to the learners'.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from rllib_exgrpo.rllib import weight_broadcast as wb

MODULE = "default_policy"
#: Small buckets: the tiny model (3.3 MB in fp32) goes in several, so several ZeRO-3
#: gathers and broadcasts make one sync.
BUCKET_MB = 0.5


# --- the plan and one broadcast, in this process ------------------------------------------------
def test_buckets_hold_at_most_their_size_and_each_dtype_lies_end_to_end():
    specs = [
        ("a", (4, 4), torch.float32),
        ("b", (8,), torch.bfloat16),
        ("c", (100,), torch.float32),
        ("d", (2, 3), torch.bfloat16),
        ("e", (3,), torch.float32),
    ]
    layout = wb.plan_buckets(specs, bucket_bytes=96, aliases=[("tied", "a")])
    # a (64 B) + b (16 B) fit in 96; c (400 B) is larger than a bucket: one of its own; d + e.
    assert [[s.name for s in b.slots] for b in layout.buckets] == [["a", "b"], ["c"], ["d", "e"]]
    first = layout.buckets[0]
    assert dict(first.sizes) == {torch.float32: 16, torch.bfloat16: 8}
    assert [(s.offset, s.numel) for s in first.slots] == [(0, 16), (0, 8)]
    assert layout.nbytes == 64 + 16 + 400 + 12 + 12
    assert layout.names() == ["a", "b", "c", "d", "e", "tied"]


def test_chosen_path_says_why():
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    cfg = ExGRPOConfig()
    assert cfg.weight_sync == "collective" and cfg.weight_sync_bucket_mb == 512
    path, line = wb.chosen_path(cfg.env_runners(num_env_runners=2))
    assert path == "collective" and "2 env runner(s)" in line and "512 MiB" in line
    path, line = wb.chosen_path(ExGRPOConfig().env_runners(num_env_runners=0))
    assert path == "object_store" and "no remote env runners" in line
    path, _ = wb.chosen_path(ExGRPOConfig().training(weight_sync="object_store").env_runners(num_env_runners=2))
    assert path == "object_store"
    with pytest.raises(ValueError, match="weight_sync must be one of"):
        ExGRPOConfig().training(weight_sync="nccl").validate()


class _MasterModule(torch.nn.Module):
    """A learner's module as the DDP learner holds a bf16 model: fp32 weights, computed in
    bf16 (``compute_dtype``), an output layer tied to the embedding."""

    compute_dtype = torch.bfloat16

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(300, 64)
        self.body = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight


class _Learner:
    def __init__(self, module):
        self.module = {MODULE: module}
        self._device = torch.device("cpu")
        self._weights_seq_no = 7


def test_one_broadcast_in_this_process_casts_buckets_and_fills_or_collects():
    torch.manual_seed(0)
    learner = _Learner(_MasterModule())
    receiver = _MasterModule().to(torch.bfloat16)  # a runner's module, in the compute dtype
    targets = receiver.state_dict()
    opened = wb.learner_open(learner, generation=1, bucket_bytes=8_000)
    layout = opened["layout"]
    assert len(layout.buckets) >= 3 and layout.aliases == (("head.weight", "embed.weight"),)
    assert {s.dtype for b in layout.buckets for s in b.slots} == {torch.bfloat16}
    address = wb.GroupAddress(opened["host"], opened["port"], 3, 1, "gloo", layout)
    ends, out = {}, {}

    def runner(rank):
        ends[rank] = wb.RunnerEnd.join(address, rank, torch.device("cpu"))
        out[rank] = ends[rank].receive(1, targets if rank == 1 else None)

    threads = [threading.Thread(target=runner, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    wb.learner_join(learner, generation=1, world_size=3, backend="gloo")
    sent = wb.learner_send(learner, generation=1, sync=1)
    for t in threads:
        t.join(60)
    assert sent["bytes"] == layout.nbytes and sent["buckets"] == len(layout.buckets)
    expected = {k: v.detach().to(torch.bfloat16) for k, v in learner.module[MODULE].state_dict().items()}
    seq_no, collected = out[1]
    assert seq_no == 7 and collected is None
    for k, v in expected.items():  # straight into the module's own tensors
        assert torch.equal(receiver.state_dict()[k], v), k
    seq_no, collected = out[2]
    assert seq_no == 7 and set(collected) == set(expected)
    for k, v in expected.items():  # collected (what a vLLM engine is handed)
        assert collected[k].dtype == torch.bfloat16 and torch.equal(collected[k], v), k
    with pytest.raises(RuntimeError, match="generation 2"):
        wb.learner_send(learner, generation=2, sync=1)
    for end in ends.values():
        end.close()
    wb.learner_close(learner)


def test_a_runner_that_never_checks_in_calls_the_round_off_without_a_timeout():
    """The driver calls a round off when a runner's call fails: the root stops waiting and
    the runners that checked in are told not to go, at once (no collective entered)."""
    store = wb.serve_store("127.0.0.1")
    waiting = wb.store_client("127.0.0.1", store.port)
    answers = []
    checked = threading.Thread(target=lambda: answers.append(wb.check_in(waiting, "g1/sync1")))
    checked.start()
    threading.Timer(0.3, wb.call_off, args=(wb.store_client("127.0.0.1", store.port), "g1/sync1")).start()
    t0 = time.perf_counter()
    with pytest.raises(wb.RoundCalledOff, match="1 of 2 runner"):
        wb.await_members(store, "g1/sync1", members=2)
    checked.join(10)
    assert answers == [False] and time.perf_counter() - t0 < 5


# --- with Ray: learner groups and remote runners -------------------------------------------------
def _config(model: str, **training):
    from test_ddp import two_learner_config

    return two_learner_config(model, weight_sync_bucket_mb=BUCKET_MB, **training).env_runners(
        num_env_runners=2, num_cpus_per_env_runner=0.5
    )


def _learner_weights(algo) -> dict:
    """The weights as a sync ships them (inference-only, in the runners' dtype)."""
    state = algo.learner_group.get_state(components="learner/rl_module", inference_only=True)
    return {
        k: torch.as_tensor(np.array(v)) if not torch.is_tensor(v) else v.clone() for k, v in state["learner"]["rl_module"][MODULE].items()
    }


def _runner_weights(algo) -> list:
    return algo.env_runner_group.foreach_env_runner(
        lambda r: {k: v.detach().clone() for k, v in r.module.state_dict().items()}, local_env_runner=False
    )


def _assert_runners_hold(algo, expected: dict) -> None:
    views = _runner_weights(algo)
    assert len(views) == 2
    for i, view in enumerate(views):
        assert set(view) == set(expected), f"runner {i + 1}: other names"
        for k, v in expected.items():
            assert view[k].dtype == v.dtype and torch.equal(view[k], v), f"runner {i + 1} differs at {k}"


def _nudge_learners(algo) -> None:
    """Move every learner's weights by the same amount (an update the runners have not seen)."""

    def add(learner):  # ZeRO-3: each rank moves its own partition
        module = learner.module[MODULE]
        module = module.unwrapped() if hasattr(module, "unwrapped") else module
        with torch.no_grad():
            for p in module.parameters():
                (p.ds_tensor if hasattr(p, "ds_tensor") else p).add_(0.01)
        for engine in getattr(learner, "deepspeed_engines", {}).values():
            engine.optimizer.refresh_fp32_params()
        learner._weights_seq_no += 1  # as an update does (a runner skips a state it has seen)

    algo.learner_group.foreach_learner(add)


def _sync_on(algo, path: str) -> dict:
    """One sync on ``path`` as the algorithm makes it; returns what Ray serialised meanwhile."""

    def sync():
        if path == "collective":
            algo._sync_runner_weights()
        else:
            algo.env_runner_group.sync_weights(from_worker_or_learner_group=algo.learner_group, inference_only=True, timeout_seconds=None)

    _, counts = wb.ray_serialization_during(sync, algo.learner_group, algo.env_runner_group)
    return counts


def _check_both_paths(algo) -> dict:
    """Train one iteration (synced at its end: collective), then each path after a nudge of
    the learners' weights; returns the object-store bytes each path put in."""
    from test_ddp import record_steps

    initial = _runner_weights(algo)[0]
    record_steps(algo)
    result = algo.train()
    assert result["weight_sync"]["group_generation"] == 1 and result["weight_sync"]["bytes_per_runner"] > 0
    trained = _learner_weights(algo)
    assert any(not torch.equal(trained[k], initial[k]) for k in trained), "training moved nothing"
    _assert_runners_hold(algo, trained)
    stored = {}
    for path in ("object_store", "collective"):
        _nudge_learners(algo)
        counts = _sync_on(algo, path)
        _assert_runners_hold(algo, _learner_weights(algo))
        stored[path] = counts
    return stored


#: The DDP algorithm the tests below share (a build costs ~30 s on 2 cores). The session's Ray
#: has 2 CPUs, all of which one algorithm's actors hold: a test that builds another one
#: stops it first (``_stop_shared``), whatever order the tests run in, and the next test
#: that wants it builds it again.
_SHARED: dict = {}


def _stop_shared() -> None:
    algo = _SHARED.pop("ddp", None)
    if algo is not None:
        algo.stop()


@pytest.fixture(scope="module", autouse=True)
def _shared_stopped_at_the_end():
    yield
    _stop_shared()


@pytest.fixture
def ddp_algo(ray_local, quick_tiny_model):
    """A bf16 model (fp32 master weights on the learners) on 2 DDP learners, 2 runners."""
    if "ddp" not in _SHARED:
        _SHARED["ddp"] = _config(quick_tiny_model, model_dtype="bfloat16").build_algo()
    return _SHARED["ddp"]


@pytest.mark.slow
def test_ddp_runners_equal_the_learners_on_each_path(ddp_algo):
    stored = _check_both_paths(ddp_algo)
    assert all(v.dtype == torch.bfloat16 for v in _learner_weights(ddp_algo).values())  # the cast master copy
    model_bytes = sum(v.numel() * v.element_size() for v in _learner_weights(ddp_algo).values())
    # The measure sees the object store's copies: the learner's reply and the driver's put.
    assert stored["object_store"]["store_bytes"] >= 2 * model_bytes
    assert stored["collective"]["store_bytes"] == 0 and stored["collective"]["store_objects"] == 0
    print(
        f"\nDDP x2 -> 2 runners: object store path {stored['object_store']['store_bytes'] / 2**20:.1f} MiB into "
        f"the object store, collective {stored['collective']['store_bytes']} B "
        f"({stored['collective']['bytes']} B of small call arguments and replies in all)"
    )


@pytest.mark.slow
def test_collective_sync_puts_nothing_into_the_object_store(ddp_algo):
    _nudge_learners(ddp_algo)
    counts = _sync_on(ddp_algo, "collective")
    assert counts["store_bytes"] == 0, counts
    # What did go through Ray is the calls themselves: a few small arguments and replies.
    assert counts["bytes"] < 64 * 1024, counts
    _assert_runners_hold(ddp_algo, _learner_weights(ddp_algo))


@pytest.mark.slow
def test_a_restarted_runner_rejoins_and_gets_the_learners_weights(ddp_algo, caplog):
    import logging

    import ray

    algo = ddp_algo
    group = algo.env_runner_group
    before = algo._weight_broadcaster.generation
    ray.kill(group._worker_manager.actors()[1], no_restart=False)  # Ray starts it again, empty
    _nudge_learners(algo)
    # The restarted runner holds no end of the group: the round is called off (no timeout),
    # the algorithm restores it and builds a new group with every healthy runner.
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="rllib_exgrpo.rllib.algorithm"):
        algo._sync_runner_weights()
    assert "failed on env runner(s) [1]" in caplog.text and "building the weight group again" in caplog.text
    assert algo._weight_broadcaster.generation > before
    print(f"\nrunner 1 killed: the sync after it (restart, new group, broadcast) took {time.perf_counter() - t0:.1f} s")
    deadline = time.time() + 120  # the restarted actor loads its model again first
    while len(group.healthy_worker_ids()) < 2 and time.time() < deadline:
        algo.restore_env_runners(group)  # the restored runner rejoins with the others
        time.sleep(1)
    assert sorted(group.healthy_worker_ids()) == [1, 2]
    assert algo._weight_broadcaster.members == (1, 2)
    _assert_runners_hold(algo, _learner_weights(algo))
    # and the group keeps working
    _nudge_learners(algo)
    algo.train()
    _assert_runners_hold(algo, _learner_weights(algo))


@pytest.mark.slow
def test_zero3_runners_equal_the_learners_on_each_path(ray_local, quick_tiny_model):
    from rllib_exgrpo.rllib.deepspeed_learner import deepspeed_importable

    if not deepspeed_importable():
        pytest.skip("deepspeed is not importable")
    from test_deepspeed import ds_training

    _stop_shared()  # its CPUs
    algo = _config(quick_tiny_model, **ds_training(3)).build_algo()
    try:
        held = algo.learner_group.foreach_learner(
            lambda learner: all(hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel for p in learner.module[MODULE].parameters())
        )
        assert all(h.get() for h in held), "ZeRO-3 did not partition every parameter"
        stored = _check_both_paths(algo)
        assert stored["collective"]["store_bytes"] == 0
        assert stored["object_store"]["store_bytes"] > 0
    finally:
        algo.stop()


def _engine_only_vllm_algo(model: str):
    """ExGRPO with one remote env runner generating with vLLM and scoring on the learners (no
    torch module on the runner), small buckets for the collective sync."""
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    return (
        ExGRPOConfig()
        .environment(env_config={"dataset": "arithmetic"})
        .training(
            model_name_or_path=model,
            questions_per_step=4,
            group_size=4,
            max_prompt_tokens=128,
            max_response_tokens=12,
            lr=1e-3,
            minibatch_size=16,
            loss_agg_mode="token-mean",
            generation_backend="vllm",
            scoring_on="learners",
            weight_sync_bucket_mb=BUCKET_MB,
            vllm_kwargs={"kv_cache_memory_bytes": 64 << 20, "block_size": 32},
        )
        .env_runners(num_env_runners=1, num_cpus_per_env_runner=1)
        .build_algo()
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_only_vllm_runner_gets_the_broadcast_through_load_weights(ray_local, quick_tiny_model):
    """``generation_backend: vllm`` with ``scoring_on: learners`` on a remote runner: no torch
    module there, the broadcast tensors are collected and pushed into the engine in one
    ``load_weights`` call; its greedy completions are then those of the learner's weights."""
    pytest.importorskip("vllm", reason="the vLLM CPU build runs this (bash tests/run.sh vllm)")
    from test_vllm_backend import assert_same_greedy

    from rllib_exgrpo.generation.base import SamplingParams
    from rllib_exgrpo.generation.hf import HFGenerationBackend
    from rllib_exgrpo.models.loading import load_causal_lm

    _stop_shared()
    algo = _engine_only_vllm_algo(quick_tiny_model)

    def greedy(runner):
        qids = [runner.env.reset()[1]["question_id"] for _ in range(4)]
        prompts = [runner.encode_prompt(q) for q in qids]
        params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=runner.stop_token_ids)
        out = runner.backend.generate(prompts, [1] * 4, params)
        return (runner.engine_only and runner.module is None, prompts, [g[0].token_ids for g in out], params, runner.tokenizer.pad_token_id)

    try:
        engine_only, prompts, before, _, _ = algo.env_runner_group.foreach_env_runner(greedy, local_env_runner=False)[0]
        assert engine_only

        def shake(learner):  # weights far enough from the start to change greedy completions
            gen = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for p in learner.module[MODULE].parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * (2.0 * float(p.std()) + 1e-3))
            learner._weights_seq_no += 1

        algo.learner_group.foreach_learner(shake)
        counts = _sync_on(algo, "collective")
        assert counts["store_bytes"] == 0
        _, prompts, got, params, pad = algo.env_runner_group.foreach_env_runner(greedy, local_env_runner=False)[0]
        model = load_causal_lm({"model": quick_tiny_model, "dtype": "float32"}).eval()
        model.load_state_dict({k[len("model.") :]: v for k, v in _learner_weights(algo).items()})
        want = [g[0].token_ids for g in HFGenerationBackend(model, pad_token_id=pad).generate(prompts, [1] * 4, params)]
        assert any(not np.array_equal(a, b) for a, b in zip(got, before)), "the engine kept its old weights"
        for prompt, a, b in zip(prompts, got, want):
            assert_same_greedy(model, prompt, a, b)
    finally:
        algo.stop()
