"""benchmarks/gpu_check.py on CPU with the tiny shape: it runs from the repository root as a
plain script, imports no Ray for the learner's functions, and writes every figure; its
depth fit, master-weight optimiser, transfer accounting, budget skips and plan comparison
on hand-made inputs."""

import importlib.util
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_gpu_check_tiny_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.relative_to(REPO)), "--shape", "tiny", "--device", "cpu", "--steps", "1", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "learner step" in proc.stdout and "generation" in proc.stdout  # the table
    res = json.loads(out.read_text())

    for key in (
        "shape",
        "device",
        "dtype",
        "torch",
        "transformers",
        "imports",
        "params",
        "stage_times_s",
        "total_s",
        "learner",
        "generation",
        "learner_static_gib",
    ):
        assert key in res, key
    assert res["shape"] == "tiny" and res["device"] == "cpu" and res["param_dtype"] == "bfloat16"
    assert res["imports_pull_in_ray"] is False
    assert res["imports"]["rllib_exgrpo.core.scoring+losses"] == []
    assert res["imports"]["rllib_exgrpo.core.packing+attention"] == []
    assert _positive(res["params"]) and _positive(res["total_s"])
    # bf16 weights without an fp32 master copy: an lr 1e-6 AdamW step leaves most unchanged
    assert 0.0 <= res["param_update_fraction"] < 0.5
    assert res["stage_times_s"] and all(_positive(v) for v in res["stage_times_s"].values())

    _check_learner(res)

    assert res["stages"][:7] == ["learner", "packed", "drift", "slice", "transfer", "generation", "colocate"]
    _check_packed(res)
    assert "packed learner pass" in proc.stdout and "measured_over_planned=" in proc.stdout

    _check_drift(res)
    _check_slice(res)
    _check_transfer(res)
    assert "slice" in proc.stdout and "log-prob drift" in proc.stdout and "transfer" in proc.stdout

    _check_generation(res)
    assert res["imports"]["rllib_exgrpo.rllib.colocation"] == []
    _check_colocate(res)
    assert "colocated cycle" in proc.stdout and "round_trip_ok=True" in proc.stdout


def _check_learner(res):
    # two response lengths, each with and without gradient checkpointing
    assert sorted((e["response"], e["gradient_checkpointing"]) for e in res["learner"]) == [
        (16, False),
        (16, True),
        (48, False),
        (48, True),
    ]
    for e in res["learner"]:
        assert e["status"] == "ok", e
        for key in (
            "step_s_mean",
            "step_s_min",
            "tokens_per_s",
            "valid_tokens_per_s",
            "peak_gib",
            "score_nograd_s",
            "score_nograd_tokens_per_s",
            "tokens_per_step",
            "valid_tokens_per_step",
        ):
            assert _positive(e[key]), (e["name"], key, e.get(key))
        assert e["steps"] == 1
        assert e["valid_tokens_per_step"] < e["tokens_per_step"]  # padded like a learner batch


def _check_drift(res):
    # drift: the tiny model and the last slice depth, three compositions each
    assert [e["model"] for e in res["drift"]] == ["tiny", "tiny-untied-2-layers"]
    for e in res["drift"]:
        assert e["status"] == "ok", e
        assert e["dtype"] == "bfloat16" and e["tokens_compared"] > 0
        assert set(e["comparisons"]) == {"repeat", "row_alone_unpadded", "reversed_wider_padding"}
        for c in e["comparisons"].values():
            mx, mean = c["max_abs_delta_logp"], c["mean_abs_delta_logp"]
            assert math.isfinite(mx) and math.isfinite(mean) and 0.0 <= mean <= mx < 1.0, c
            assert 0.0 <= c["max_abs_ratio_minus_1"] < 2.0


def _check_slice(res):
    # the slice: two depths of a 28-layer untied model, bf16 weights + fp32 master + AdamW moments
    sl = res["slice"]
    assert sl["full_layers"] == 28 and sl["slice_layers"] == [1, 2] and sl["gradient_checkpointing"] is True
    assert [e["layers"] for e in sl["depths"]] == [1, 2]
    for e in sl["depths"]:
        assert e["status"] == "ok", e
        n = e["params"]
        assert e["state_bytes_counted"] == {"weights": 2 * n, "fp32_master": 4 * n, "adamw_moments": 8 * n, "total": 14 * n}
        for key in ("fb_s", "opt_s", "step_s", "tokens_per_s", "fb_tokens_per_s", "score_nograd_s", "peak_bytes"):
            assert _positive(e[key]), (e["name"], key, e.get(key))
        # an lr 1e-6 step moves the fp32 master copy; few of those moves reach the bf16 weights
        assert e["master_update_fraction"] > 0.9 and e["weight_update_fraction"] < 0.5, e
    assert sl["depths"][1]["params"] > sl["depths"][0]["params"]
    fd = sl["full_depth"]
    assert fd["status"] == "ok" and fd["layers"] == 28
    assert fd["params"] == fd["params_actual"] == sl["params_full_depth"]  # parameters are linear in depth
    f = fd["fits"]["step_s"]
    assert math.isclose(fd["step_s"], f["fixed"] + 28 * f["per_layer"])
    assert math.isclose(fd["tokens_per_s"], sl["tokens_per_step"] / fd["step_s"])
    assert math.isclose(fd["state_bytes"], 14 * fd["params"], rel_tol=1e-9)
    plan = sl["plan"]
    if _planning_importable():
        assert plan["status"] == "ok", plan
        assert [r["layers"] for r in plan["per_depth"]] == [1, 2, 28]
        assert all(_positive(r["plan_total_bytes"]) for r in plan["per_depth"])
    else:
        assert plan["status"].startswith("unavailable ("), plan


def _check_transfer(res):
    # transfer: pageable only on CPU, exactly the bytes asked for, both ways, data intact
    tr = res["transfer"]
    assert tr["status"] == "ok" and tr["bytes_requested"] == tr["bytes"] == 16_000_000
    assert tr["pinned"]["status"] == "skipped"
    pg = tr["pageable"]
    assert pg["bytes_h2d"] == pg["bytes_d2h"] == 16_000_000 and pg["round_trip_ok"] is True
    for key in ("h2d_s", "d2h_s", "h2d_gb_per_s", "d2h_gb_per_s"):
        assert _positive(pg[key]), key


def _check_generation(res):
    assert {e["decoder"] for e in res["generation"]} == {"generate", "pruned"}
    for e in res["generation"]:
        assert e["status"] == "ok", e
        assert e["generated_tokens"] == e["batch"] * e["new_tokens"]  # no stop token: full length
        for key in ("seconds", "tokens_per_s", "peak_gib"):
            assert _positive(e[key]), (e["name"], key, e.get(key))


def _check_colocate(res):
    """The colocate stage's figures on CPU: four phases in order, memory unavailable, the
    optimizer round trip checked and passed, the plan's figures beside each phase."""
    co = res["colocate"]
    assert co["status"] == "ok", co
    assert (co["rows"], co["prompt"], co["response"]) == (4, 16, 16)
    assert (co["gen_batch"], co["gen_prompt"], co["gen_new_tokens"]) == (4, 8, 8)
    assert co["weights_dtype"] == "float32" and co["compute_dtype"] == "bfloat16" and _positive(co["params"])
    assert co["offload"] == "rllib_exgrpo.rllib.colocation.OptimizerOffload"
    assert co["memory_source"].startswith("unavailable")
    assert list(co["phases"]) == ["learner", "release", "generation", "restore"]
    for name, e in co["phases"].items():
        assert _positive(e["seconds"]), (name, e)
        assert e["peak_gib"] is None and e["resident_gib"] is None and e["peak_bytes"] is None  # CPU: no figures
    ph = co["phases"]
    assert math.isfinite(ph["learner"]["loss"]) and math.isfinite(ph["restore"]["loss"])
    assert _positive(ph["learner"]["grad_norm"]) and _positive(ph["restore"]["grad_norm"])
    assert ph["generation"]["generated_tokens"] == 4 * 8  # no stop token: every row to full length
    rt = co["round_trip"]
    # AdamW's moments (2 x fp32 per parameter) and a step count per tensor
    assert rt["state_bytes"] >= 8 * co["params"] and rt["state_tensors"] > 0
    # CPU: nothing is on a device; every state tensor is still copied into a new host tensor and back
    assert rt["device_state_bytes"] == 0 and rt["bytes_offloaded"] == rt["bytes_reloaded"] == rt["state_bytes"]
    assert rt["on_host_during_turn"] is True and rt["back_on_device"] is True and rt["pinned_during_turn"] is None
    assert rt["state_bitwise_equal"] is True
    assert rt["weights_unchanged_by_generation"] is True
    assert rt["step_after_reload_matches_reference"] is True
    assert 0.5 < rt["second_step_update_fraction"] <= 1.0  # fp32 weights: an lr 1e-6 step moves them
    assert rt["ok"] is True
    plan = co["plan"]
    if _planning_importable():
        assert plan["status"] == "ok", plan
        for name, e in ph.items():
            assert _positive(e["plan_bytes"]) and e["within_plan"] is None, (name, e)  # no measurement to set
        assert ph["learner"]["plan_bytes"] == ph["restore"]["plan_bytes"] > ph["generation"]["plan_bytes"]
        assert ph["generation"]["plan_bytes"] > ph["release"]["plan_bytes"]
    else:
        assert plan["status"].startswith("unavailable ("), plan


def _one_stage(tmp_path, stage: str):
    """``gpu_check.py --shape tiny --device cpu --stages <stage>``: the process and its JSON."""
    out = tmp_path / f"{stage}.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.relative_to(REPO)), "--shape", "tiny", "--device", "cpu", "--stages", stage, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_gpu_check_colocate_stage_alone_on_cpu(tmp_path):
    """``--stages colocate``: the colocated cycle alone (no main model, no earlier rates)."""
    proc, res = _one_stage(tmp_path, "colocate")
    assert res["stages"] == ["colocate"] and "learner" not in res and "params" not in res
    _check_colocate(res)
    assert "predicted_s" not in res["colocate"]  # nothing measured earlier to predict it from
    for phase in ("learner", "release", "generation", "restore"):
        line = next(x for x in proc.stdout.splitlines() if x.strip().startswith(f"phase={phase} "))
        assert "peak_gib=unavailable" in line and "resident_gib=unavailable" in line, line
    assert "step_after_reload_matches_reference=True" in proc.stdout
    assert "state_bitwise_equal=True" in proc.stdout
    assert [x for x in proc.stdout.splitlines() if "round_trip_ok=" in x] == ["  round_trip_ok=True"]


def test_colocate_round_trip_check_catches_a_corrupted_reload(gpu_check, tmp_path, monkeypatch):
    """An offload whose reload hands back AdamW's moments rounded through bf16 (a dtype slip):
    the state is no longer bitwise equal, the step after it is not the reference step."""
    torch = pytest.importorskip("torch")
    from rllib_exgrpo.rllib import colocation

    class LossyOffload(colocation.OptimizerOffload):
        def reload(self):
            moved = super().reload()
            for state, key, value in colocation.optimizer_state_tensors(self._optimizers()):
                if key in ("exp_avg", "exp_avg_sq"):
                    state[key] = value.to(torch.bfloat16).to(value.dtype)
            return moved

    monkeypatch.setattr(colocation, "OptimizerOffload", LossyOffload)
    clock = gpu_check.Clock(600.0, tmp_path / "c.json", {"stage_times_s": {}})
    res = gpu_check.run_colocate(gpu_check.SHAPES["tiny"], torch.device("cpu"), torch.bfloat16, "sdpa", clock)
    assert res["status"] == "ok"
    rt = res["round_trip"]
    assert rt["state_bitwise_equal"] is False and rt["step_after_reload_matches_reference"] is False
    assert rt["weights_unchanged_by_generation"] is True and rt["ok"] is False
    assert json.loads((tmp_path / "c.json").read_text())["colocate"]["round_trip"]["ok"] is False


def test_colocate_plan_figures_for_the_1_5b_shape(gpu_check):
    """The plan beside each phase: the learner entry for the training phases, the turn's
    resident weights for the release, the turn less its optimizer state for the generation."""
    if not _planning_importable():
        pytest.skip("rllib_exgrpo.planning not importable")
    shape = gpu_check.SHAPES["qwen2.5-1.5b"]
    spec = shape["colocate"]
    plan = gpu_check.colocate_plan(shape["config"], spec, "bfloat16", "sdpa", gpu_memory=80 * 2**30)
    assert plan["status"] == "ok", plan
    p = gpu_check.count_params(shape["config"])
    li, ti = plan["learner_items"], plan["turn_items"]
    assert li["weights"] == ti["learner weights"] == 4 * p  # the DDP learner's fp32 weights
    assert li["optimizer state"] == ti["optimizer state"] == 8 * p  # AdamW's two fp32 moments
    ctx = li["CUDA context, workspaces"]
    assert plan["phase_bytes"]["learner"] == plan["phase_bytes"]["restore"] == plan["learner_total_bytes"] - ctx
    assert plan["phase_bytes"]["release"] == 4 * p
    kv = ti["HF generation KV cache"]  # 64 rows x (256 + 128) tokens x 28 KiB (28 layers, 2 kv heads x 128, bf16)
    assert kv == 64 * (256 + 128) * 2 * 28 * 2 * 128 * 2
    assert "scoring pass" not in ti  # behaviour_logprobs engine: the stage only generates
    ac = ti["autocast weight copies"]  # autocast's bf16 copies, cached through the turn as through a pass
    assert ac == plan["autocast_copies_bytes"] == li["autocast weight copies"] > 0
    assert plan["phase_bytes"]["generation"] == 4 * p + kv + ac
    assert plan["generation_as_planned_bytes"] == 4 * p + 8 * p + kv + ac
    assert plan["learner_fits"] is True and plan["turn_fits"] is True


def test_colocate_skipped_when_predicted_over_budget(gpu_check, tmp_path):
    torch = pytest.importorskip("torch")
    clock = gpu_check.Clock(0.0, tmp_path / "s.json", {"stage_times_s": {}})
    res = gpu_check.run_colocate(gpu_check.SHAPES["tiny"], torch.device("cpu"), torch.bfloat16, "sdpa", clock, predicted_s=5.0)
    assert res["status"] == "skipped" and "predicted" in res["why"] and "phases" in res and not res["phases"]
    # the prediction: learner FLOP rate, generation rate, the copies of ~16 B/param state
    shape = gpu_check.SHAPES["qwen2.5-1.5b"]
    assert gpu_check.colocate_predicted_s({}, shape) is None
    results = {
        "params": 1_543_714_304,
        "learner": [{"status": "ok", "gradient_checkpointing": True, "rows": 8, "prompt": 1024, "response": 1024, "step_s_mean": 1.0}],
        "generation": [{"status": "ok", "decoder": "generate", "batch": 64, "tokens_per_s": 2048.0}],
    }
    s = gpu_check.colocate_predicted_s(results, shape)
    assert 20.0 < s < 120.0, s


def _check_packed(res):
    """The packed stage's figures: one packed pass of the tiny shape under sdpa_varlen (CPU),
    its measured peak next to the plan's."""
    pk = res["packed"]
    assert pk["status"] == "ok", pk
    assert pk["kernel"] == "sdpa_varlen" and pk["kernel_requested"] == "sdpa_varlen"  # resolve("auto", "cpu")
    assert isinstance(pk["flash_attn_importable"], bool)
    assert pk["flash_attn_importable"] == res["flash_attn"]["importable"]
    assert (pk["rows"], pk["prompt"], pk["response"]) == (6, 32, 96)
    assert pk["tokens"] == 6 * 128 == pk["tokens_budget"] and pk["scored_tokens"] == 6 * 96
    assert pk["gradient_checkpointing"] is True and pk["dtype"] == "bfloat16" and pk["chunk_tokens"] == 512
    assert pk["model_config"]["vocab_size"] == 512 and pk["layers"] == 2
    for key in (
        "pass_s",
        "first_pass_s",
        "tokens_per_s",
        "score_nograd_s",
        "measured_bytes",
        "measured_gib",
        "planned_bytes",
        "planned_gib",
        "measured_over_planned",
        "params",
    ):
        assert _positive(pk[key]), (key, pk.get(key))
    assert math.isclose(pk["tokens_per_s"], pk["tokens"] / pk["pass_s"])
    assert math.isclose(pk["measured_over_planned"], pk["measured_bytes"] / pk["planned_bytes"])
    # the CPU measurement is the profiler's exact tensor bytes: the plan holds it within 25%
    assert 0.75 < pk["measured_over_planned"] < 1.25, pk["measured_over_planned"]
    plan = pk["plan"]
    assert plan["status"] == "ok" and "dense_mask False" in plan["args"]
    assert plan["planned_bytes"] == plan["breakdown"]["peak"] == pk["planned_bytes"]
    assert math.isfinite(pk["loss"])


def test_gpu_check_packed_stage_alone_on_cpu(tmp_path):
    """``--stages packed``: no learner stage before it (no FLOP rate, no main model)."""
    proc, res = _one_stage(tmp_path, "packed")
    assert res["stages"] == ["packed"] and "learner" not in res and "params" not in res
    _check_packed(res)
    assert "flash_attn" in proc.stdout and "measured_over_planned=" in proc.stdout


def test_packed_pass_reads_the_1_5b_recipe(gpu_check):
    spec = gpu_check.SHAPES["qwen2.5-1.5b"]["packed"]
    cfg = spec["config"]
    assert (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
        cfg["tie_word_embeddings"],
    ) == (1536, 12, 2, 8960, 151936, True)
    assert spec["layers"] == 2 and cfg["num_hidden_layers"] == 28
    pp = gpu_check.packed_pass_spec(spec)
    assert "read_error" not in pp["recipe"], pp
    assert pp["tokens_budget"] == 32768 and pp["gradient_checkpointing"] is True
    assert (pp["rows"], pp["tokens"], pp["scored_tokens"]) == (8, 32768, 8 * 3072)
    plan = gpu_check.packed_plan({**cfg, "num_hidden_layers": 2}, pp["tokens"], pp["scored_tokens"], True)
    assert plan["status"] == "ok" and plan["planned_bytes"] > 0


def test_gpu_check_full_shape_without_cuda_says_so_in_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "never.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.relative_to(REPO)), "--shape", "qwen2.5-1.5b", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "CUDA" in lines[0], lines
    assert not out.exists()


def _planning_importable() -> bool:
    try:
        from rllib_exgrpo.planning.memory import learner_activation_bytes, model_state_bytes  # noqa: F401
        from rllib_exgrpo.planning.shapes import ModelShape  # noqa: F401
    except ImportError:
        return False
    return True


def test_gpu_check_help_lists_stages_and_flags():
    proc = subprocess.run([sys.executable, str(SCRIPT.relative_to(REPO)), "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for word in (
        "learner",
        "packed",
        "drift",
        "slice",
        "transfer",
        "generation",
        "colocate",
        "--stages",
        "--slice-layers",
        "--transfer-gb",
        "--transfer-chunk-mb",
        "--budget-s",
        "--shape",
    ):
        assert word in proc.stdout, word


def test_depth_fit_on_hand_made_numbers(gpu_check):
    # two depths: the line through them; fixed part 6, 2 per layer -> 62 at 28 layers
    assert gpu_check.linear_fit([2, 4], [10.0, 14.0]) == pytest.approx((6.0, 2.0))
    fit = gpu_check.depth_fit([2, 4], [10.0, 14.0], 28)
    assert fit == pytest.approx({"fixed": 6.0, "per_layer": 2.0, "at_layers": 28, "value": 62.0})
    # three depths: least squares (y = 1 + 0.5 x through (1,1), (2,3), (3,2))
    assert gpu_check.linear_fit([1, 2, 3], [1.0, 3.0, 2.0]) == pytest.approx((1.0, 0.5))
    with pytest.raises(ValueError):
        gpu_check.linear_fit([4, 4], [1.0, 2.0])
    # the slice's own extrapolation: params 100 + 10/layer, step 0.5 + 0.25 s/layer
    depths = [
        {
            "layers": L,
            "status": "ok",
            "params": 100 + 10 * L,
            "state_bytes": 14 * (100 + 10 * L),
            "fb_peak_bytes": 1000 + 50 * L,
            "opt_peak_bytes": 800 + 60 * L,
            "peak_bytes": 1000 + 60 * L,
            "peak_above_state_bytes": 1000 + 60 * L - 14 * (100 + 10 * L),
            "score_nograd_s": 0.1 * L,
            "fb_s": 0.4 + 0.2 * L,
            "opt_s": 0.1 + 0.05 * L,
            "step_s": 0.5 + 0.25 * L,
        }
        for L in (2, 4)
    ]
    depths.append({"layers": 3, "status": "oom"})  # ignored by the fit
    res = {"depths": depths, "full_layers": 28, "tokens_per_step": 900, "params_full_depth": 380}
    out = gpu_check.extrapolate_slice(res)
    assert out["status"] == "ok" and out["depths_used"] == [2, 4]
    assert out["params"] == 380 == out["params_actual"]
    assert out["step_s"] == pytest.approx(7.5) and out["tokens_per_s"] == pytest.approx(120.0)
    assert out["fb_s"] == pytest.approx(6.0) and out["fb_tokens_per_s"] == pytest.approx(150.0)
    assert out["peak_bytes"] == pytest.approx(2680.0) and out["state_bytes"] == pytest.approx(14 * 380)
    one = gpu_check.extrapolate_slice({**res, "depths": depths[:1]})
    assert one["status"].startswith("not extrapolated")


def test_master_weight_adamw_keeps_fp32_master(gpu_check):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64).to(torch.bfloat16)
    opt = gpu_check.MasterWeightAdamW(lin.parameters(), lr=1e-6, weight_decay=0.01, max_norm=1.0)
    w0 = lin.weight.detach().clone()
    m0 = opt.masters[0].clone()
    assert opt.masters[0].dtype == torch.float32 and torch.equal(m0.to(torch.bfloat16), w0)
    lin(torch.randn(8, 64, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    opt.step()
    assert all(p.grad is None for p in lin.parameters()) and all(m.grad is None for m in opt.masters)
    moved = (opt.masters[0] != m0).float().mean().item()
    assert moved > 0.99  # AdamW's first step moves every element with a gradient by ~lr
    assert torch.equal(lin.weight.detach(), opt.masters[0].to(torch.bfloat16))  # weights = rounded master
    assert (lin.weight.detach() != w0).float().mean().item() < 0.5  # most lr-1e-6 moves round away in bf16
    n = sum(p.numel() for p in lin.parameters())
    assert opt.state_bytes() == {"weights": 2 * n, "fp32_master": 4 * n, "adamw_moments": 8 * n, "total": 14 * n}


def test_transfer_moves_exactly_the_bytes_asked_and_sizes_down(gpu_check, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    cpu = torch.device("cpu")
    clock = gpu_check.Clock(60.0, tmp_path / "t.json", {"stage_times_s": {}})
    e = gpu_check.run_transfer(cpu, 1_000_002, 300_000, clock)  # 4 chunks, the last one short
    assert e["status"] == "ok" and "sized_down" not in e
    assert e["bytes"] == e["pageable"]["bytes_h2d"] == e["pageable"]["bytes_d2h"] == 1_000_002
    assert e["pageable"]["round_trip_ok"] is True
    assert json.loads((tmp_path / "t.json").read_text())["transfer"]["bytes"] == 1_000_002
    monkeypatch.setattr(sys.modules["gpucheck.transfer"], "CPU_TRANSFER_CAP_GB", 0.0005)
    e = gpu_check.run_transfer(cpu, 2_000_000, 100_000, clock)
    assert e["bytes"] == e["pageable"]["bytes_h2d"] == 500_000 and "CPU run" in e["sized_down"]


def test_stages_over_budget_are_skipped_with_a_reason(gpu_check, tmp_path):
    torch = pytest.importorskip("torch")
    clock = gpu_check.Clock(0.0, tmp_path / "b.json", {"stage_times_s": {}})
    e = gpu_check.run_drift(None, "m", {"rows": 4, "prompt": 8, "response": 8}, 32, torch.device("cpu"), clock, tokens_per_s=1.0)
    assert e["status"] == "skipped" and "predicted" in e["why"]
    e = gpu_check.run_transfer(torch.device("cpu"), 10_000_000, 1_000_000, clock)
    assert e["status"] == "skipped" and "predicted" in e["why"]
    spec = {
        "name": "t",
        "layers": (1, 2),
        "rows": 1,
        "prompt": 4,
        "response": 4,
        "steps": 1,
        "config": dict(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            vocab_size=64,
            tie_word_embeddings=False,
            max_position_embeddings=64,
        ),
    }
    res = gpu_check.run_slice(spec, torch.device("cpu"), "sdpa", 1, clock, flops_rate=1.0)
    assert [d["status"] for d in res["depths"]] == ["skipped", "skipped"]
    assert res["full_depth"]["status"].startswith("not extrapolated")
    e = gpu_check.run_packed(gpu_check.SHAPES["tiny"]["packed"], torch.device("cpu"), clock, flops_rate=1.0)
    assert e["status"] == "skipped" and "predicted" in e["why"] and "measured_bytes" not in e


def _stand_in_plan_modules(calls: list):
    """Stand-ins for ``planning.memory`` and ``planning.shapes``: per layer, 10 bytes of weights,
    4 of optimiser state split over the learners, rows x tokens of activations; each
    ``model_state_bytes`` call is recorded in ``calls``."""

    class Shape:
        def __init__(self, layers):
            self.num_hidden_layers = layers

        @classmethod
        def from_hf_config(cls, cfg):
            return cls(cfg.num_hidden_layers)

    def model_state_bytes(shape, *, backend, zero_stage, num_learners, model_dtype):
        calls.append((shape.num_hidden_layers, backend, zero_stage, num_learners, model_dtype))
        return {
            "weights": 10 * shape.num_hidden_layers,
            "optimizer": 4 * shape.num_hidden_layers // num_learners,
            "total": 10 * shape.num_hidden_layers + 4 * shape.num_hidden_layers // num_learners,
        }

    def learner_activation_bytes(shape, rows, tokens, *, gradient_checkpointing, dtype_bytes=2, response_tokens=None):
        assert gradient_checkpointing and dtype_bytes == 2 and response_tokens == 2 < tokens
        return rows * tokens * shape.num_hidden_layers

    memory = types.ModuleType("rllib_exgrpo.planning.memory")
    memory.model_state_bytes, memory.learner_activation_bytes = model_state_bytes, learner_activation_bytes
    shapes = types.ModuleType("rllib_exgrpo.planning.shapes")
    shapes.ModelShape = Shape
    return memory, shapes


def _measured_slice() -> dict:
    """A run_slice result of a 28-layer model measured at 2 and 4 layers and at full depth."""
    cfg = dict(
        hidden_size=32,
        num_hidden_layers=28,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=64,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    depth = {"status": "ok", "state_bytes": 20, "peak_bytes": 100, "peak_above_state_bytes": 80}
    return {
        "model_config": cfg,
        "rows": 2,
        "prompt": 3,
        "response": 2,
        "full_layers": 28,
        "memory_source": "torch.cuda.max_memory_allocated",
        "depths": [{**depth, "layers": 2}, {**depth, "layers": 4}],
        "full_depth": {"status": "ok", "state_bytes": 280, "peak_bytes": 1400, "peak_above_state_bytes": 1120},
    }


def test_plan_comparison_wiring(gpu_check, monkeypatch):
    """With a stand-in plan module: the plan's figures sit next to the measured ones, per
    depth, at full depth, and per GPU as the recipe runs; without one: 'unavailable'."""
    calls = []
    memory, shapes = _stand_in_plan_modules(calls)
    monkeypatch.setitem(sys.modules, "rllib_exgrpo.planning", types.ModuleType("rllib_exgrpo.planning"))
    monkeypatch.setitem(sys.modules, "rllib_exgrpo.planning.memory", memory)
    monkeypatch.setitem(sys.modules, "rllib_exgrpo.planning.shapes", shapes)

    res = _measured_slice()
    recipe = {"learner_backend": "deepspeed", "deepspeed_zero_stage": 2, "num_learners": 4, "model_dtype": "bfloat16"}
    out = gpu_check.plan_comparison(res, recipe)
    assert out["status"] == "ok", out
    assert [r["layers"] for r in out["per_depth"]] == [2, 4, 28]
    r2, r28 = out["per_depth"][0], out["per_depth"][2]
    assert r2["plan_state_bytes"] == 28 and r2["plan_activation_bytes"] == 2 * 5 * 2 and r2["plan_total_bytes"] == 48
    assert r2["measured_over_plan_total"] == pytest.approx(100 / 48)
    assert r28["extrapolated"] is True and r28["plan_total_bytes"] == 280 + 112 + 280
    assert (28, "deepspeed", 2, 1, "bfloat16") in calls and calls[-1] == (28, "deepspeed", 2, 4, "bfloat16")
    assert out["recipe_per_gpu"]["status"] == "ok" and out["recipe_per_gpu"]["recipe"]["num_learners"] == 4
    g = out["recipe_per_gpu"]
    assert g["plan_state_bytes"] == 280 + 28 and g["plan_state_plus_measured_above_state_bytes"] == 308 + 1120

    monkeypatch.setitem(sys.modules, "rllib_exgrpo.planning.memory", None)  # import fails
    assert gpu_check.plan_comparison(res, recipe)["status"].startswith("unavailable (")


def test_recipe_settings_read_from_the_yaml(gpu_check):
    recipe = gpu_check.read_recipe(gpu_check.RECIPE_7B)
    assert "read_error" not in recipe, recipe
    assert recipe["learner_micro_batch_rows"] == 4
    assert recipe["max_prompt_tokens"] + recipe["max_response_tokens"] == 9216
    spec = gpu_check.SHAPES["qwen2.5-1.5b"]["slice"]
    assert (spec["rows"], spec["prompt"], spec["response"]) == (4, 1024, 8192)


# ---- the table of stages, --cpu, and the stages after the measuring ones ------------------------
def _table(stdout: str) -> dict:
    """``stage -> (status, note)`` from the table of stages the run ends with."""
    rows = {}
    lines = stdout.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("stage ") and "| status" in x)
    for line in lines[start + 2 :]:
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < 4:
            break
        rows[parts[0]] = (parts[1], parts[3])
    return rows


def _deepspeed_here() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def test_gpu_check_cpu_runs_every_stage_a_cpu_allows(tmp_path):
    """``--cpu``: exit 0, a table of every stage; the ZeRO offload round trip ran (bitwise equal
    to the run without offload, at ZeRO-1, 2 and 3); the GPU-only stages skipped with why."""
    out = tmp_path / "cpu.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.relative_to(REPO)), "--cpu", "--steps", "1", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = _table(proc.stdout)
    assert list(table) == [
        "learner",
        "packed",
        "drift",
        "slice",
        "transfer",
        "generation",
        "colocate",
        "zero3-colocate-offload",
        "nccl-broadcast",
        "packed-flash",
        "vllm-reload",
        "vllm-sleep-wake",
    ]
    assert all(table[s][0] == "ran" for s in ("learner", "packed", "drift", "slice", "transfer", "generation", "colocate")), table
    assert table["packed-flash"] == ("skipped", "flash-attention needs a CUDA device")
    assert table["vllm-sleep-wake"][0] == "skipped"
    res = json.loads(out.read_text())
    assert [r["stage"] for r in res["summary"]] == list(table)
    if _deepspeed_here():
        assert table["zero3-colocate-offload"][0] == "ran", table
        z = res["zero3_colocate_offload"]
        for stage in ("1", "2", "3"):
            r = z["per_stage"][stage]
            assert r["ok"] and r["bitwise_equal_to_reference"] and r["lp_params_kept"], r
            assert r["bytes_offloaded"] == r["bytes_reloaded"] > 0 and r["moved_by_kind"]["optim_states"] > 0
            assert r["plan"]["status"] == "ok" and 0.99 < r["plan"]["moved_over_plan"] < 1.01, r["plan"]
        assert set(z["per_stage"]["3"]["moved_by_kind"]) >= {"hp_params", "optim_states"}
    else:
        assert table["zero3-colocate-offload"][0] == "skipped"
    if res["optional_dependencies"]["ray"]:
        assert table["nccl-broadcast"][0] == "ran", table
        b = res["nccl_broadcast"]
        assert b["backend"] == "gloo" and b["tensors_equal"] == b["tensors"] > 0 and b["layout_buckets"] >= 2
    if not res["optional_dependencies"]["vllm"]:
        assert table["vllm-reload"] == ("skipped", "vllm is not installed")


def test_stage_table_status_of_the_measuring_stages(gpu_check):
    from gpucheck.legacy import legacy_outcome

    assert legacy_outcome("packed", {"packed": {"status": "ok"}}) == ("ran", "1/1 ok")
    assert legacy_outcome("packed", {"packed": {"status": "error", "error": "E: x"}}) == ("failed", "E: x")
    assert legacy_outcome("slice", {"slice": {"depths": [{"status": "skipped", "why": "w"}] * 2}})[0] == "skipped"
    assert legacy_outcome("learner", {"learner": [{"status": "ok"}, {"status": "oom"}]}) == ("ran", "1/2 ok, 1 out of memory")
    bad = {"colocate": {"status": "ok", "round_trip": {"ok": False}}}
    assert legacy_outcome("colocate", bad)[0] == "failed"
    assert legacy_outcome("transfer", {})[0] == "skipped"


def test_a_failing_stage_fails_the_run(tmp_path, monkeypatch, gpu_check, capsys):
    """A stage that raises is a row ``failed`` with the error in one line; the run goes on
    and exits non-zero."""
    from gpucheck import newstages

    def boom(ctx):
        raise RuntimeError("broken on purpose\nsecond line")

    monkeypatch.setitem(newstages.NEW_RUNNERS, "packed-flash", boom)
    rc = gpu_check.main(["--cpu", "--stages", "packed-flash,vllm-sleep-wake", "--out", str(tmp_path / "f.json")])
    assert rc == 1
    table = _table(capsys.readouterr().out)
    assert table["packed-flash"] == ("failed", "RuntimeError: broken on purpose")
    assert table["vllm-sleep-wake"][0] == "skipped"
