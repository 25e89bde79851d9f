"""The GPU memory plan (rllib_exgrpo/planning): shapes and parameter counts, model states by
backend and ZeRO stage against DeepSpeed's own estimators, the activation formulas against
autograd's saved tensors and the allocator's measured peak on tiny models, the plan of the
shipped GPU recipes through the real `rllib train --dry-run`, and its one-line failure."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from rllib_exgrpo.planning.memory import (
    GIB,
    deepspeed_estimate_bytes,
    layer_saved_bytes,
    learner_activation_breakdown,
    learner_activation_bytes,
    model_state_bytes,
    plan_memory,
    scoring_activation_bytes,
)
from rllib_exgrpo.planning.shapes import PUBLISHED_SHAPES, ModelShape, model_shape

REPO = Path(__file__).resolve().parents[1]
QWEN = "tuned_examples/exgrpo_qwen.yaml"
QWEN15 = "tuned_examples/exgrpo_qwen1.5b.yaml"
Q7 = PUBLISHED_SHAPES["Qwen/Qwen2.5-Math-7B"]
Q15 = PUBLISHED_SHAPES["Qwen/Qwen2.5-Math-1.5B"]
#: A hand-made shape: every size different, GQA, untied.
HAND = ModelShape(
    hidden_size=96,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=24,
    intermediate_size=200,
    vocab_size=1000,
    tie_word_embeddings=False,
    max_position_embeddings=512,
)


# ------------------------------------------------------------------ shapes


def _hf_model(shape: ModelShape, layers: int = None, dtype=None, device="meta"):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = Qwen2Config if shape.model_type == "qwen2" else LlamaConfig
    cfg = cls(
        hidden_size=shape.hidden_size,
        num_hidden_layers=layers or shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=shape.max_position_embeddings,
    )
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32, attn_implementation="sdpa")


def test_published_shapes_are_the_models_config_json():
    assert (
        Q7.hidden_size,
        Q7.num_hidden_layers,
        Q7.num_attention_heads,
        Q7.num_key_value_heads,
        Q7.head_dim,
        Q7.intermediate_size,
        Q7.vocab_size,
        Q7.tie_word_embeddings,
        Q7.max_position_embeddings,
    ) == (3584, 28, 28, 4, 128, 18944, 152064, False, 4096)
    assert (
        Q15.hidden_size,
        Q15.num_hidden_layers,
        Q15.num_attention_heads,
        Q15.num_key_value_heads,
        Q15.intermediate_size,
        Q15.vocab_size,
        Q15.tie_word_embeddings,
        Q15.max_position_embeddings,
    ) == (1536, 28, 12, 2, 8960, 151936, True, 4096)
    # benchmarks/gpu_check.py builds its 1.5B shape from the same numbers
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check

    cfg = gpu_check.SHAPES["qwen2.5-1.5b"]["config"]
    assert {
        k: cfg[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
            "tie_word_embeddings",
        )
    } == {
        k: getattr(Q15, k)
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
            "tie_word_embeddings",
        )
    }
    think = PUBLISHED_SHAPES["Elliott/Qwen2.5-Math-7B-16k-think"]
    assert dataclasses.replace(think, max_position_embeddings=4096) == Q7


@pytest.mark.parametrize(
    "shape", [Q7, Q15, PUBLISHED_SHAPES["HuggingFaceTB/SmolLM2-135M-Instruct"], HAND], ids=["qwen7b", "qwen1.5b", "smollm2", "hand"]
)
def test_parameter_count_is_exact(shape):
    """The formula against a model built from the shape with 2 layers (on the meta device:
    no memory), and the full count against the published totals."""
    model = _hf_model(shape, layers=2)
    counted = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    assert dataclasses.replace(shape, num_hidden_layers=2).num_parameters == counted
    known = {Q7: 7_615_616_512, Q15: 1_543_714_304}
    if shape in known:
        assert shape.num_parameters == known[shape]


def test_shape_from_config_folder_cache_and_table(tmp_path, monkeypatch):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=500,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    s = ModelShape.from_hf_config(cfg)
    assert (s.head_dim, s.num_key_value_heads, s.tie_word_embeddings, s.model_type, s.qkv_bias) == (16, 2, True, "qwen2", True)
    assert ModelShape.from_hf_config(cfg.to_dict()) == s
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg.to_dict()))
    found = model_shape(str(tmp_path / "m"))
    assert found == s and "config.json in" in found.source
    assert model_shape("Qwen/Qwen2.5-Math-1.5B") == Q15  # published (not cached here) or the cache's config.json
    assert model_shape("someone/unknown-model") is None
    # an embedded model that is not built: None, and nothing is built
    monkeypatch.setenv("RLLIB_EXGRPO_CACHE", str(tmp_path / "cache"))
    assert model_shape("tiny:seed=12345") is None
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


# ------------------------------------------------------------------ model states


def test_model_states_by_backend_and_stage_on_a_hand_made_shape():
    p = HAND.num_parameters
    ddp = model_state_bytes(HAND, backend="ddp", num_learners=4, model_dtype="bfloat16")
    assert (ddp["weights"], ddp["gradients"], ddp["optimizer"], ddp["buckets"]) == (4 * p, 4 * p, 8 * p, 4 * p)
    assert ddp["autocast_copies"] == 2 * (3 * HAND.layer_linear_parameters + HAND.vocab_size * HAND.hidden_size)
    assert model_state_bytes(HAND, backend="ddp", num_learners=1, model_dtype="float32")["buckets"] == 0
    assert model_state_bytes(HAND, backend="ddp", num_learners=2, model_dtype="float32", ddp_bucket_view=True)["buckets"] == 0
    n = 4
    z1, z2, z3 = (model_state_bytes(HAND, backend="deepspeed", zero_stage=s, num_learners=n) for s in (1, 2, 3))
    assert (z1["weights"], z1["gradients"], z1["optimizer"]) == (2 * p, 2 * p, int(12 * p / n))
    assert (z2["weights"], z2["gradients"], z2["optimizer"]) == (2 * p, int(2 * p / n), int(12 * p / n))
    assert (z3["weights"], z3["gradients"], z3["optimizer"]) == (int(2 * p / n), int(2 * p / n), int(12 * p / n))
    assert z3["gathered"] == 4 * HAND.vocab_size * HAND.hidden_size and z2["gathered"] == 0
    assert z1["total"] > z2["total"] > z3["total"]
    assert HAND.kv_cache_bytes_per_token(2) == 2 * 3 * 2 * 24 * 2
    assert Q7.kv_cache_bytes_per_token(2) == 57344  # 56 KiB, as the 7B recipe's header says


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_model_states_within_ten_percent_of_deepspeeds_estimators():
    """DeepSpeed's estimate_zero2/3_model_states_mem_needs (what its *_all_cold print)
    against this plan's weights + gradients + optimiser state + the step's fp32 gradients
    (+ ZeRO-3's gathered module). ZeRO-2: the same formula (2P + 18P/N). ZeRO-3: DeepSpeed's
    18P/N leaves out one of the bf16 partitions this plan counts (weights and gradients are
    both partitioned) and does not cap the fp32 gradients at sub_group_size, so it differs
    more on small models with few learners (1.5B on 2 learners: +10.4%)."""
    rows = []
    for shape in (Q7, Q15):
        for n in (1, 2, 4, 8):
            ours = model_state_bytes(shape, backend="deepspeed", zero_stage=2, num_learners=n)["deepspeed_comparable"]
            ds = deepspeed_estimate_bytes(shape, zero_stage=2, num_learners=n)
            rows.append((shape.num_parameters, 2, n, ours / ds - 1))
            assert abs(ours / ds - 1) < 0.10, rows[-1]
        for n in (4, 8):  # the recipes' learner counts
            ours = model_state_bytes(shape, backend="deepspeed", zero_stage=3, num_learners=n)["deepspeed_comparable"]
            ds = deepspeed_estimate_bytes(shape, zero_stage=3, num_learners=n)
            rows.append((shape.num_parameters, 3, n, ours / ds - 1))
            assert abs(ours / ds - 1) < 0.10, rows[-1]
        for n in (1, 2):
            ours = model_state_bytes(shape, backend="deepspeed", zero_stage=3, num_learners=n)["deepspeed_comparable"]
            ds = deepspeed_estimate_bytes(shape, zero_stage=3, num_learners=n)
            assert abs(ours / ds - 1) < 0.11, (shape.num_parameters, 3, n, ours / ds - 1)
    print(
        "\nDeepSpeed cross-check (params, stage, learners, difference):",
        ", ".join(f"{p / 1e9:.2f}B/Z{s}/{n}: {d:+.1%}" for p, s, n, d in rows),
    )
    assert deepspeed_estimate_bytes(Q7, zero_stage=1, num_learners=4) is None


# ------------------------------------------------------------------ activations


@pytest.mark.parametrize("mode", ["fp32", "half", "autocast"])
def test_saved_per_layer_is_what_autograd_keeps(mode):
    """layer_saved_bytes against the bytes autograd saves for one more layer (unique
    storages seen by saved_tensors_hooks, parameters excluded), padded batch."""
    import torch

    from rllib_exgrpo.core.scoring import completion_logprobs_and_entropy

    def saved(layers):
        torch.manual_seed(0)
        model = _hf_model(
            dataclasses.replace(HAND, vocab_size=300),
            layers=layers,
            dtype=torch.bfloat16 if mode == "half" else torch.float32,
            device="cpu",
        )
        model.train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(1, 300, (2, 40))
        attn = torch.ones_like(ids)
        attn[1, :5] = 0
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
            completion_logprobs_and_entropy(model, ids, attn, 24)
        return sum(seen.values())

    autocast_copies = 2 * HAND.layer_linear_parameters if mode == "autocast" else 0
    assert saved(2) - saved(1) == layer_saved_bytes(HAND, 2, 40, mode) + autocast_copies


def _measured_peak(shape, rows, prompt, response, ckpt, nograd=False):
    """Peak live torch CPU bytes of one learner (or no-grad scoring) pass, from the
    profiler's allocator records (as benchmarks/memory_plan.py measures)."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import memory_plan as bench
    import torch

    torch.manual_seed(0)
    model = _hf_model(shape, device="cpu")
    on = "enable" if ckpt else "disable"
    (getattr(model, f"activation_checkpointing_{on}", None) or getattr(model, f"gradient_checkpointing_{on}"))()
    model.train()
    learner, scoring = bench._passes(model, contextlib.nullcontext)  # the benchmark's own passes, fp32

    learner(bench._batch(2, 8, 8, shape.vocab_size, 0), 8)  # gradients exist before
    batch = bench._batch(rows, prompt, response, shape.vocab_size, 1)
    fn = scoring if nograd else learner
    return bench._peak_of(lambda: fn(batch, response))


@pytest.mark.parametrize("ckpt", [False, True])
def test_learner_activation_estimate_matches_the_measured_peak(ckpt):
    shape = dataclasses.replace(HAND, vocab_size=4000)
    measured = _measured_peak(shape, 3, 48, 300, ckpt)
    est = learner_activation_bytes(shape, 3, 348, gradient_checkpointing=ckpt, dtype_bytes=4, response_tokens=300)
    assert abs(est / measured - 1) < 0.10, (est, measured)
    measured = _measured_peak(shape, 2, 40, 300, ckpt=False, nograd=True)
    est = scoring_activation_bytes(shape, 2, 340, response_tokens=300, dtype_bytes=4)
    assert abs(est / measured - 1) < 0.15, (est, measured)


def test_activation_formulas_scale_as_they_should():
    b = learner_activation_breakdown(Q7, 4, 5120, gradient_checkpointing=True, response_tokens=4096)
    # checkpointed: one [T, h] bf16 input per layer
    assert b["layers"] == 28 * 4 * 5120 * 3584 * 2
    # no logits outlive their chunk; the chunk phase holds one chunk of 512 positions
    # (bf16 logits, their float32 copy and the softmax: 10 bytes a logit) beside the running
    # sum of the head's [V, h] bf16 gradients; then the chunk's logit gradient with the new
    # and the summed head gradient; and the scored hidden states' gradient throughout
    assert b["logits"] == 0 and b["chunk_tokens"] == 512
    head = 2 * 152064 * 3584  # one bf16 [V, h] gradient of the untied LM head
    chunk, logit_grad = 10 * 512 * 152064, 2 * 512 * 152064
    assert b["logit_chunks"] == max(chunk + head, logit_grad + 2 * head) + 4 * 4096 * 3584 * 2
    # a packed pass of the same tokens under a variable-length kernel has no [S, S] masks
    packed = learner_activation_breakdown(Q7, 1, 4 * 5120, gradient_checkpointing=True, response_tokens=4 * 4096, dense_mask=False)
    assert packed["layers"] == b["layers"] and packed["outside"] == b["outside"] - 4 * 5120 * 5120
    no = learner_activation_bytes(Q7, 4, 5120, gradient_checkpointing=False, response_tokens=4096)
    assert no > b["peak"] * 5  # 28 layers' saved activations dwarf the logits
    assert learner_activation_bytes(Q7, 4, 5120, gradient_checkpointing=True) > b["peak"]  # all positions scored
    one, two = (learner_activation_bytes(Q15, r, 4096, gradient_checkpointing=True, response_tokens=3072) for r in (1, 2))
    assert one < two < 2 * one + 2 * GIB


# ------------------------------------------------------------------ the plan and the CLI


def _config(path, **over):
    import yaml

    from rllib_exgrpo.cli.config_keys import apply_config
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    spec = next(iter(yaml.safe_load((REPO / path).read_text()).values()))["config"]
    spec.update(over)
    cfg = ExGRPOConfig()
    assert not apply_config(cfg, spec)
    return cfg


def test_plan_of_the_recipes_names_the_key_when_it_does_not_fit():
    gpu = 80 * (1 << 30)
    for path in (QWEN, QWEN15):
        plan = plan_memory(_config(path), gpu_memory=gpu, gpu_memory_source="test")
        assert [a.kind for a in plan.actors] == ["learner", "env runner"] and plan.fits, plan.render()
    cases = {
        "learner_backend": dict(learner_backend="ddp"),
        "gradient_checkpointing": dict(gradient_checkpointing=False),
        "learner_micro_batch_rows": dict(learner_micro_batch_rows=64, learner_micro_batch_tokens=None, gradient_checkpointing=False),
        "learner_micro_batch_tokens": dict(learner_micro_batch_tokens=64 * 9216, gradient_checkpointing=False),
        # Scoring on the runners: each holds a torch copy of the model beside vLLM.
        "vllm_kwargs.gpu_memory_utilization": dict(scoring_on="runners", vllm_kwargs={"gpu_memory_utilization": 0.85}),
        "generation_batch_size": dict(scoring_on="runners", vllm_kwargs={"gpu_memory_utilization": 0.5}, generation_batch_size=48),
    }
    for key, over in cases.items():
        problems = plan_memory(_config(QWEN, **over), gpu_memory=gpu, gpu_memory_source="test").problems()
        assert len(problems) == 1 and problems[0].startswith(f"config.{key}: "), (key, problems)
        assert "\n" not in problems[0]
    # As shipped (scoring_on: learners) a runner holds vLLM's copy of the weights only; with
    # scoring on the runners it holds a torch copy too.
    shipped = plan_memory(_config(QWEN), gpu_memory=gpu, gpu_memory_source="test")
    runner = next(a for a in shipped.actors if a.kind == "env runner")
    assert [i.what for i in runner.items] == [
        "vLLM engine",
        "weight sync receive buffer",
        "weight-sync NCCL buffers",
        "CUDA context, workspaces",
    ], shipped.render()
    two = plan_memory(
        _config(QWEN, scoring_on="runners", vllm_kwargs={"gpu_memory_utilization": 0.5}), gpu_memory=gpu, gpu_memory_source="test"
    )
    assert "policy module (HF copy)" in [i.what for i in next(a for a in two.actors if a.kind == "env runner").items]
    # vLLM's share too small for one sequence of max_model_len
    tiny_share = plan_memory(
        _config(QWEN, vllm_kwargs={"gpu_memory_utilization": 0.18}), gpu_memory=gpu, gpu_memory_source="test"
    ).problems()
    assert tiny_share and tiny_share[0].startswith("config.vllm_kwargs.gpu_memory_utilization: ")
    # no GPU memory known: the plan is made, nothing is judged
    unknown = plan_memory(_config(QWEN, learner_backend="ddp"), gpu_memory=None, gpu_memory_source="none")
    assert unknown.fits is None and not unknown.problems() and "fit not checked" in unknown.render()


def _dry_run(monkeypatch, capsys, tmp_path, extra: dict, recipe: str = QWEN):
    """``--dry-run --ray-num-gpus 8`` of a GPU recipe with the data swapped for the built-in
    set: on this machine, without vLLM (a dry run plans without it) or the model (its shape
    comes from the published table)."""
    from rllib_exgrpo.cli import main

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    # An earlier test in this process may have left Ray running; preflight would then check
    # against that (GPU-less) cluster instead of --ray-num-gpus, as it should for a real run.
    import ray

    if ray.is_initialized():
        ray.shutdown()
    spec = next(iter(yaml.safe_load((REPO / recipe).read_text()).values()))
    # a search's scheduler, and the checkpoints kept by held-out accuracy, read held-out
    # accuracy: keep a held-out set (the built-in one)
    ranks_heldout = spec.get("scheduler") or (spec.get("checkpoint_config") or {}).get("checkpoint_score_attribute")
    heldout = "arithmetic" if ranks_heldout else None
    overrides = {"env_config": {"dataset": "arithmetic"}, "heldout_dataset": heldout, **extra}
    if spec["run"] == "PPO":  # RLlib's PPO on the LLM: the project's settings are model_config's
        overrides = {"env_config": {"dataset": "arithmetic"}, "model_config": {"heldout_dataset": heldout, **extra}}
    rc = main.main(
        [
            "train",
            "file",
            recipe,
            "--dry-run",
            "--ray-num-gpus",
            "8",
            "--storage-path",
            str(tmp_path / "r"),
            "--config",
            json.dumps(overrides),
        ]
    )
    out, err = capsys.readouterr()
    return rc, out, err


def test_dry_run_prints_the_plan_and_fails_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(REPO)
    for recipe, model in ((QWEN, "Qwen/Qwen2.5-Math-7B"), (QWEN15, "Qwen/Qwen2.5-Math-1.5B")):
        rc, out, err = _dry_run(monkeypatch, capsys, tmp_path, {"gpu_memory_gb": 80}, recipe)
        assert rc == 0, out + err
        assert f"memory plan: {model}" in out and "learner x4 (1 GPU each)" in out
        assert "env runner x4 (1 GPU each)" in out and out.count(": fits") == 2, out
        assert f"published config.json of {model}" in out or "Hugging Face cache" in out
        # What runs: packed passes under a variable-length kernel, log-probs in chunks, the
        # card table's usable memory of an 80 GB card, the weight sync's buffers.
        assert "one packed pass of 32768 tokens" in out and "log-prob chunks of 512 positions" in out, out
        assert "the plan uses 79.2 GiB (card table: A100 / H100 80 GB" in out, out
        assert "weight sync receive buffer" in out and "weight-sync NCCL buffers" in out, out
        with capsys.disabled():
            print("\n" + out[out.index("  memory plan") :])

    rc, out, err = _dry_run(
        monkeypatch, capsys, tmp_path, {"gpu_memory_gb": 80, "learner_micro_batch_tokens": 64 * 9216, "gradient_checkpointing": False}
    )
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"rllib train: error: {QWEN}: experiment 'exgrpo-qwen': config.learner_micro_batch_tokens: ")
    assert "Traceback" not in out + err and "memory plan" not in out


def test_optimizer_steps_match_the_minibatch_plan():
    """The steps the plan prints are the steps ``plan_minibatches`` makes."""
    import numpy as np

    from rllib_exgrpo.core.minibatches import optimizer_steps_per_iteration, plan_minibatches

    for rows in (3, 8, 260, 1024):
        for minibatch in (1, 64, 128, 512, 2000):
            for learners in (1, 2, 4, 8):
                for epochs in (1, 2):
                    plan = plan_minibatches(
                        np.arange(rows) // 8,
                        minibatch_size=minibatch,
                        num_learners=learners,
                        num_epochs=epochs,
                        rng=np.random.default_rng(0),
                    )
                    steps = sum(len(epoch) for epoch in plan)
                    assert optimizer_steps_per_iteration(rows, minibatch, learners, epochs) == steps


def test_the_plan_prints_optimizer_steps_and_warns_when_learners_change_them(monkeypatch, capsys, tmp_path):
    """The recipe: 128 questions x 8 = 1024 completions, minibatch_size 128 on 4 learners: 2
    steps. Moved to 2 learners on the command line it makes 4, said once with the fix."""
    monkeypatch.chdir(REPO)
    rc, out, err = _dry_run(monkeypatch, capsys, tmp_path, {"gpu_memory_gb": 80})
    assert rc == 0 and "warning" not in out + err, out + err
    assert ("optimiser steps per iteration: 2 = num_epochs 1 x round(1024 completions / (minibatch_size 128 x 4 learner(s)))") in out, out
    rc, out, err = _dry_run(monkeypatch, capsys, tmp_path, {"gpu_memory_gb": 80, "num_learners": 2})
    assert rc == 0, out + err
    assert (
        out.count("warning:") == 1
        and ("warning: num_learners 2 (the file has 4) makes 4 optimiser step(s) per iteration instead of 2") in out
        and "minibatch_size: 256 keeps 2" in out
    ), out
    assert "optimiser steps per iteration: 4 = " in out
    rc, out, err = _dry_run(monkeypatch, capsys, tmp_path, {"gpu_memory_gb": 80, "num_learners": 2, "minibatch_size": 256})
    assert rc == 0 and "warning" not in out + err and "optimiser steps per iteration: 2 = " in out, out + err
    rc, out, err = _dry_run(monkeypatch, capsys, tmp_path, {"gpu_memory_gb": 80, "num_learners": {"grid_search": [2, 4]}})
    assert rc == 0, out + err
    assert (
        "warning: the search over num_learners gives its trials different optimiser steps per iteration (2 learner(s): 4, 4 learner(s): 2)"
    ) in out, out


def test_gpu_memory_from_the_field_or_the_machine(monkeypatch):
    import subprocess

    from rllib_exgrpo.planning import memory

    cfg = _config(QWEN15, gpu_memory_gb=40)
    assert memory.gpu_memory_for(cfg) == (40 * (1 << 30), "gpu_memory_gb")
    smi = "0, NVIDIA H100 80GB HBM3, 81559\n1, NVIDIA H100 80GB HBM3, 81559\n2, NVIDIA A100-SXM4-40GB, 40960\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=smi))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert memory._nvidia_smi_memory(2) == (81559 << 20, "detected: NVIDIA H100 80GB HBM3, nvidia-smi")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert memory._nvidia_smi_memory(3)[0] == 40960 << 20  # the smallest GPU


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_lora_adapter_count_is_peft_s(targets):
    """The plan's adapter count equals what peft trains on a Qwen2 of the same shape."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rllib_exgrpo.planning.shapes import ModelShape

    hf = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=500,
        tie_word_embeddings=False,
    )
    model = get_peft_model(
        AutoModelForCausalLM.from_config(hf), LoraConfig(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM")
    )
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ModelShape.from_hf_config(hf).lora_parameters(8, targets) == trained


def test_lora_learner_plan_holds_a_frozen_base_and_adapter_state():
    """7B, LoRA rank 64 on one 80 GB GPU: the base in bf16 without master copy, AdamW on the
    adapters only, no KL reference copy; the same config fully fine-tuned does not fit."""
    from rllib_exgrpo.planning.memory import plan_memory
    from rllib_exgrpo.planning.shapes import model_shape

    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    def plan(rank):
        cfg = ExGRPOConfig().training(
            model_name_or_path="Qwen/Qwen2.5-Math-7B",
            model_dtype="bfloat16",
            lora_rank=rank,
            kl_coeff=0.001,
            gradient_checkpointing=True,
            learner_micro_batch_tokens=16384,
            gpu_memory_gb=80,
        )
        return plan_memory(cfg.learners(num_learners=0, num_gpus_per_learner=1)).actors[0]

    shape = model_shape("Qwen/Qwen2.5-Math-7B")
    adapters = shape.lora_parameters(64)
    lora, full = plan(64), plan(0)
    items = {it.what: it.bytes for it in lora.items}
    assert items["weights"] == 2 * shape.num_parameters + 4 * adapters
    assert items["optimizer state"] == 8 * adapters and items["gradients"] == 4 * adapters
    assert "KL reference model" not in items and "KL reference model" in {it.what for it in full.items}
    assert lora.fits and not full.fits


def _gpu_recipes():
    out = []
    for path in sorted((REPO / "tuned_examples").glob("*.yaml")):
        spec = next(iter(yaml.safe_load(path.read_text()).values()))
        if float(spec.get("config", {}).get("num_gpus_per_learner", 0) or 0) > 0:
            out.append(path)
    return out


@pytest.mark.parametrize("recipe", _gpu_recipes(), ids=lambda p: p.stem)
def test_every_gpu_recipe_fits_its_card_and_the_readme_table_shows_its_plan(recipe, monkeypatch, capsys, tmp_path):
    """``--dry-run`` of each GPU recipe on this machine (no GPU, no vLLM, no model: the shape
    from the published table) plans every actor, each turn of a colocated GPU included, as
    fitting the recipe's own card (``gpu_memory_gb``, 80 GB unless it says), and the README's
    recipe table row states the same figures."""
    import re

    monkeypatch.chdir(REPO)
    spec = next(iter(yaml.safe_load(recipe.read_text()).values()))
    card = spec["config"].get("gpu_memory_gb") or spec["config"].get("model_config", {}).get("gpu_memory_gb") or 80
    rc, out, err = _dry_run(monkeypatch, capsys, tmp_path, {"gpu_memory_gb": card}, str(recipe.relative_to(REPO)))
    assert rc == 0, out + err
    actors = re.findall(r"^    (\S.*?) x\d+ \(.*?\): ([\d.]+) GiB of ([\d.]+) GiB: (\w+)", out, flags=re.M)
    assert actors, out
    assert all(verdict == "fits" for *_, verdict in actors), out
    if spec["config"].get("colocate"):
        assert [kind for kind, *_ in actors] == ["learner, training turn (colocate)", "learner, generation turn (colocate)"], out
    row = next((ln for ln in (REPO / "README.md").read_text().splitlines() if ln.startswith(f"| `{recipe.name}`")), None)
    assert row is not None, f"README's recipe table has no row for {recipe.name}"
    for _, used, budget, _ in actors:
        assert f"{used} GiB" in row and f"{budget} GiB" in row, (row, actors)
    # The time estimate: per iteration and for the recipe's stop, on the card of the plan.
    time = re.search(r"time per iteration \(ESTIMATE, (.*?), no GPU measurement\): (~\S+ s) .*; \d+ iterations: (~\S+ h)", out)
    assert time, out
    card, per_iteration, per_run = time.groups()
    assert f"{per_iteration} / iteration, {per_run} a run ({card}" in row, (row, time.group(0))


def test_lora_under_deepspeed_is_planned_for_colocated_learners():
    """LoRA on DeepSpeed learners (colocated only): the frozen base sliced under ZeRO-3, bf16
    adapters with fp32 master copies and AdamW moments over the learners; a generation turn
    with one decoder layer gathered and merged in flight, and the merge's bf16 temporaries."""
    from rllib_exgrpo.planning.memory import model_state_bytes

    shape = PUBLISHED_SHAPES["Qwen/Qwen2.5-Math-7B"]
    a = shape.lora_parameters(64, "all-linear")
    states = model_state_bytes(shape, backend="deepspeed", zero_stage=3, num_learners=8, model_dtype="bfloat16", lora_parameters=a)
    assert states["weights"] == (2 * shape.num_parameters + 2 * a) // 8
    assert states["optimizer"] == 12 * a // 8 and states["gradients"] == 2 * a // 8
    cfg = _config(
        QWEN,
        colocate=True,
        num_env_runners=0,
        num_gpus_per_env_runner=0,
        learner_backend="deepspeed",
        deepspeed_zero_stage=3,
        lora_rank=64,
        num_learners=8,
        scoring_on="learners",
    )
    plan = plan_memory(cfg, gpu_memory=80 << 30, gpu_memory_source="test")
    training, turn = plan.actors
    assert training.kind == "learner, training turn (colocate)" and training.fits
    items = {it.what: it.bytes for it in turn.items}
    assert items["one decoder layer gathered for the push"] == shape.layer_parameters * 2
    assert items["one decoder layer merged for the push"] == 2 * shape.layer_linear_parameters
    assert items["LoRA merge temporaries"] == 2 * 2 * 3584 * 18944  # bf16 B @ A and its scaled copy, MLP weight
    assert items["learner weights"] == states["weights"] and turn.fits


# ------------------------------------------------------------------ terms tied to the tensors the code makes


class _Outputs:
    """Every tensor an op makes while inside (op name, shape, dtype, bytes)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch

                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if torch.is_tensor(t) and t._base is None:
                        outer.seen.append((str(func), tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
                return out

        self.seen, self.mode = [], Mode()


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("q_len", [32, 1], ids=["padded-pass", "decode-step"])
def test_masked_attention_terms_are_the_tensors_sdpa_varlen_makes(dtype_name, q_len):
    """masked_attention_bytes against what sdpa_varlen's masked call makes on a padded input
    (GQA, 6 query / 2 key-value heads): the boolean mask and its construction, SDPA's
    additive mask in the query's dtype, and k and v repeated to the query's heads (none for
    a decoding step); the per-layer saved bytes and the scoring pass use the same terms."""
    import torch

    from rllib_exgrpo.core.attention import sdpa_varlen_forward
    from rllib_exgrpo.planning.memory import masked_attention_bytes

    dtype = getattr(torch, dtype_name)
    shape = dataclasses.replace(HAND, num_attention_heads=6, num_key_value_heads=2, head_dim=8, hidden_size=48)
    rows, kv_len, d = 3, 32, shape.head_dim
    q = torch.randn(rows, 6, q_len, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(rows, 2, kv_len, d, dtype=dtype, requires_grad=True) for _ in range(2))
    mask = torch.ones(rows, kv_len, dtype=torch.long)
    mask[0, :5] = 0

    class Module:
        training = True

    rec = _Outputs()
    with rec.mode:
        sdpa_varlen_forward(Module(), q, k, v, mask)
    planned = masked_attention_bytes(shape, rows, q_len, kv_len, dtype_bytes=q.element_size())
    by_op = {}
    for op, shp, dt, nbytes in rec.seen:
        by_op.setdefault(op.split(".")[1], []).append((shp, dt, nbytes))
    boolean = [n for shp, dt, n in by_op["bitwise_or"] if dt == torch.bool]
    assert boolean == [planned["boolean_mask"]]
    building = sum(n for op in ("bitwise_and", "bitwise_or", "le") for shp, dt, n in by_op[op])
    assert building == planned["building"]
    additive = [n for shp, dt, n in by_op["where"] if dt == dtype and shp == (rows, 1, q_len, kv_len)]
    assert additive == [planned["float_mask"]]  # kv_len is a multiple of 8: no padding
    repeated = sum(n for shp, dt, n in by_op.get("clone", []) if len(shp) == 5)  # expand + copy over the group
    assert repeated == planned["repeated_kv"] == (2 * rows * 6 * kv_len * d * q.element_size() if q_len > 1 else 0)
    b = q.element_size()
    # the per-layer saved bytes of a padded pass hold the additive mask, a packed pass none
    mode = "fp32" if b == 4 else "half"
    padded = layer_saved_bytes(shape, rows, kv_len, mode, dense_mask=True)
    packed = layer_saved_bytes(shape, rows, kv_len, mode, dense_mask=False)
    full = masked_attention_bytes(shape, rows, kv_len, kv_len, dtype_bytes=b)
    assert padded - packed == full["float_mask"]


@pytest.mark.parametrize("bucket_mb", [512, 4096])
def test_weight_sync_buffer_is_the_largest_bucket_the_broadcast_makes(bucket_mb):
    """weight_sync_bytes against the buffers rllib/weight_broadcast.py makes for Qwen2.5-Math-7B's
    tensors in bf16 (a 2-layer slice with the real vocabulary, on the meta device: nothing
    allocated): with 512 MiB buckets the embedding (152064 x 3584 x 2 B = 1.09 GB) is a bucket
    of its own and sets the buffer; with larger buckets a bucket does."""
    import torch

    from rllib_exgrpo.planning.memory import weight_sync_bytes
    from rllib_exgrpo.rllib.weight_broadcast import _Scratch, plan_buckets

    shape = dataclasses.replace(Q7, num_hidden_layers=2)
    model = _hf_model(shape, dtype=torch.bfloat16)
    specs = [(name, tuple(t.shape), torch.bfloat16) for name, t in model.state_dict().items()]
    layout = plan_buckets(specs, int(bucket_mb * 2**20))
    scratch = _Scratch(layout, torch.device("meta"))
    made = sum(buf.numel() * buf.element_size() for buf in scratch._buffers.values())
    assert made == weight_sync_bytes(shape, bucket_mb=bucket_mb, dtype_bytes=2)
    if bucket_mb == 512:
        assert made == 152064 * 3584 * 2
    assert weight_sync_bytes(Q7, bucket_mb=512) == 152064 * 3584 * 2  # the whole model: the same largest tensor


def test_the_split_recipes_plan_the_weight_sync_and_the_colocated_ones_do_not():
    """Learner 0 and every GPU env runner of a collective sync over NCCL hold NCCL's buffers
    (640 MiB: 32 channels x 2 ring peers x 10 MiB); a runner also the receive buffer; the
    learner's bucket buffer and ZeRO-3 gather come after the update, below its activations
    (a note). The object store and colocated learners have none of them."""
    from rllib_exgrpo.planning.memory import NCCL_BUFFER_BYTES, weight_sync_bytes

    assert NCCL_BUFFER_BYTES == 640 << 20
    gpu = 80 << 30
    plan = plan_memory(_config(QWEN), gpu_memory=gpu, gpu_memory_source="test")
    learner, runner = plan.actors
    li, ri = ({it.what: it.bytes for it in a.items} for a in (learner, runner))
    assert li["weight-sync NCCL buffers"] == ri["weight-sync NCCL buffers"] == NCCL_BUFFER_BYTES
    assert ri["weight sync receive buffer"] == weight_sync_bytes(Q7) == 152064 * 3584 * 2
    assert "weight sync buffers" not in li and any(n.startswith("weight sync (nccl") for n in learner.notes)
    # where the update frees less than the sync holds (here: nothing), the rest is an item:
    # learner 0's bucket buffer and, under ZeRO-3, the bucket gathered on every learner
    from rllib_exgrpo.planning.memory import ActorPlan, Item, _learner_sync_items

    bare = ActorPlan("learner", 4, 1, items=[Item("CUDA context, workspaces", 1)])
    _learner_sync_items(bare, _config(QWEN), Q7, 2, after=0)
    assert {it.what: it.bytes for it in bare.items}["weight sync buffers"] == 2 * weight_sync_bytes(Q7)
    for over in (dict(weight_sync="object_store"), dict(colocate=True, num_env_runners=0, num_gpus_per_env_runner=0, num_learners=8)):
        actors = plan_memory(_config(QWEN, **over), gpu_memory=gpu, gpu_memory_source="test").actors
        assert not [it.what for a in actors for it in a.items if "weight sync" in it.what or "NCCL" in it.what]


def test_lora_merge_terms_match_the_measured_peak_of_a_layer_push():
    """lora_merge_bytes against the allocator's peak while the colocated push reads one decoder
    layer (models/weight_buckets.py, models/lora.py's MergedWeight, peft's get_delta_weight):
    a bf16 base with fp32 adapters, every linear layer targeted, on CPU, where peft computes
    in the adapters' dtype as on a GPU. The peak is the layer's merged bf16 weights plus the
    fp32 B @ A and its scaled copy of the largest weight (the MLP's, merged last)."""
    import sys

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rllib_exgrpo.models import lora
    from rllib_exgrpo.models.weight_buckets import plain_weight_buckets
    from rllib_exgrpo.planning.memory import lora_merge_bytes

    sys.path.insert(0, str(REPO / "benchmarks"))
    import memory_plan as bench

    hf = Qwen2Config(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=704,
        vocab_size=300,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = lora.wrap(AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16), {"rank": 16, "alpha": 32})
    for name, p in model.named_parameters():  # B is zero at the start: a real merge has a real delta
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    _, read = next(iter(plain_weight_buckets(model)))
    kept = []
    measured = bench._peak_of(lambda: kept.append(read()))
    shape = ModelShape.from_hf_config(hf)
    planned = lora_merge_bytes(shape, base_bytes=2, adapter_bytes=4)
    assert planned["temporaries"] == 8 * 256 * 704
    assert sum(t.numel() * t.element_size() for k, t in kept[0].items() if k.endswith("proj.weight")) == planned["merged_layer"]
    assert abs(measured / (planned["merged_layer"] + planned["temporaries"]) - 1) < 0.02, (measured, planned)


def test_the_card_table_gives_each_card_its_usable_memory(monkeypatch):
    """One table turns a card into the memory the plan checks against: by nominal size
    (gpu_memory_gb), by the size a tool reports, and by the name a user types."""
    from rllib_exgrpo.planning import cards, memory

    gib = 1 << 30
    assert memory.usable_memory(24 * gib) == int(22.5 * gib)
    assert memory.usable_memory(80 * gib) == int(79.2 * gib)
    assert memory.usable_memory(141 * gib) == int(139.8 * gib)
    assert memory.usable_memory(81559 << 20) == int(79.2 * gib)  # nvidia-smi's H100 80GB HBM3
    assert memory.usable_memory(23028 << 20) == 23028 << 20  # an A10 as NVML reports it: below 22.5 GiB
    assert memory.usable_memory(40 * gib) == int(40 * gib * cards.UNKNOWN_CARD_FRACTION)  # not in the table
    assert cards.card_by_name("H100").nominal_gb == cards.card_by_name("nvidia a100-80gb").nominal_gb == 80
    assert cards.card_by_name("A10").nominal_gb == cards.card_by_name("L4").nominal_gb == 24
    assert cards.card_by_name("NVIDIA GeForce RTX 4090").nominal_gb == 24
    assert cards.card_by_name("H200").usable_gib == 139.8
    assert cards.card_by_name("A100-SXM4-40GB") is None and cards.card_by_name("A1000") is None
    cfg = _config(QWEN15, gpu_memory_gb=80)
    cfg.gpu_memory_gb = "H200"  # a card's name, where the config takes one
    assert memory.gpu_memory_for(cfg) == (141 * gib, "gpu_memory_gb: H200")
    plan = plan_memory(_config(QWEN15), gpu_memory=24 * gib, gpu_memory_source="test")
    assert all(a.budget == int(22.5 * gib) for a in plan.actors)
    assert "the plan uses 22.5 GiB (card table: 24 GB" in plan.render()


# ------------------------------------------------------------------ every mirrored term has its tie

#: Each function of the plan that mirrors tensors the code makes (``planning/memory.py``'s
#: ``*_bytes`` and ``*_breakdown``), and the test that ties it to those tensors: autograd's
#: saved tensors, the allocator's peak of the real pass, the buffers the real code allocates,
#: peft's or DeepSpeed's own counts.
MIRRORED_TERMS = {
    "model_state_bytes": "test_model_states_within_ten_percent_of_deepspeeds_estimators",
    "_lora_state_bytes": "test_lora_learner_plan_holds_a_frozen_base_and_adapter_state",
    "_lora_adapter_bytes": "test_lora_adapter_count_is_peft_s",
    "layer_saved_bytes": "test_saved_per_layer_is_what_autograd_keeps",
    "_saved_activation_bytes": "test_learner_activation_estimate_matches_the_measured_peak",
    "_layer_backward_bytes": "test_learner_activation_estimate_matches_the_measured_peak",
    "_logit_chunk_phase_bytes": "test_learner_activation_estimate_matches_the_measured_peak",
    "logit_chunk_bytes": "test_learner_activation_estimate_matches_the_measured_peak",
    "learner_activation_breakdown": "test_learner_activation_estimate_matches_the_measured_peak",
    "learner_activation_bytes": "test_learner_activation_estimate_matches_the_measured_peak",
    "scoring_activation_bytes": "test_learner_activation_estimate_matches_the_measured_peak",
    "masked_attention_bytes": "test_masked_attention_terms_are_the_tensors_sdpa_varlen_makes",
    "lora_merge_bytes": "test_lora_merge_terms_match_the_measured_peak_of_a_layer_push",
    "weight_sync_bytes": "test_weight_sync_buffer_is_the_largest_bucket_the_broadcast_makes",
    "_layer_bytes": "test_lora_under_deepspeed_is_planned_for_colocated_learners",
}
#: Functions with ``_bytes`` in their name that mirror no tensor of the code.
NOT_MIRRORED = {"dtype_bytes": "a dtype's size", "deepspeed_estimate_bytes": "DeepSpeed's own estimator, called"}


def test_every_mirrored_term_is_tied_to_the_code_it_mirrors():
    """A new term of the plan must name its tie here, and the tie must exist."""
    import inspect

    from rllib_exgrpo.planning import memory

    terms = {
        name
        for name, f in vars(memory).items()
        if inspect.isfunction(f) and f.__module__ == memory.__name__ and (name.endswith("_bytes") or name.endswith("_breakdown"))
    }
    assert terms - set(NOT_MIRRORED) == set(MIRRORED_TERMS), sorted(terms ^ (set(MIRRORED_TERMS) | set(NOT_MIRRORED)))
    for term, test in MIRRORED_TERMS.items():
        assert callable(globals().get(test)), f"{term}: its tie {test} is not a test of this module"
