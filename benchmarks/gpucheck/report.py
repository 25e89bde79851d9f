"""The printed report: every stage's figures, then the table of stages."""

from __future__ import annotations

from gpucheck.colocate import COLOCATE_PHASES
from gpucheck.common import GIB


def _fmt_gib(x) -> str:
    return "unavailable" if x is None else f"{x:.2f}"


def print_table(results: dict) -> None:
    print()
    params = f"{results['params'] / 1e6:,.1f} M params" if "params" in results else "no main model"
    print(
        f"{results['shape']} ({params}) on {results['device_name']}, "
        f"{results['dtype']}, attention {results['attn_implementation']}; "
        f"torch {results['torch']}, transformers {results['transformers']}"
    )
    print_learner(results)
    print_packed(results)
    print_slice(results)
    print_drift(results)
    print_transfer(results)
    print_generation(results)
    print_colocate(results)
    print()
    print("stage times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in results["stage_times_s"].items()))
    print(f"total {results['total_s']:.1f} s")


def print_learner(results: dict) -> None:
    if "learner" in results:
        print(
            f"weights + AdamW state: {results.get('learner_static_gib', 0):.2f} GiB; one AdamW step at lr 1e-6 "
            f"changes {results.get('param_update_fraction', float('nan')):.1%} of the {results['param_dtype']} weights"
        )
        head = (
            f"{'learner step (fwd+loss+bwd+clip+AdamW)':<40}{'s/step':>8}{'tok/s':>11}{'real tok/s':>12}"
            f"{'peak GiB':>10}{'no-grad score s':>17}"
        )
        print(head)
        print("-" * len(head))
        for e in results["learner"]:
            if e.get("status") == "ok":
                print(
                    f"{e['name']:<40}{e['step_s_mean']:>8.2f}{e['tokens_per_s']:>11,.0f}"
                    f"{e['valid_tokens_per_s']:>12,.0f}{e['peak_gib']:>10.2f}{e['score_nograd_s']:>17.2f}"
                )
            else:
                print(f"{e['name']:<40}{e.get('status', 'not run'):>8}  {e.get('error', '')[:80]}")


def print_packed(results: dict) -> None:
    pk = results.get("packed")
    if isinstance(pk, dict):
        print()
        if pk.get("status") == "ok":
            fa = "importable" if pk["flash_attn_importable"] else "not importable"
            print(
                f"packed learner pass: {pk['model']}, {pk['layers']} of {pk['full_layers']} layers "
                f"({pk['params'] / 1e6:,.1f} M params), bf16, {pk['rows']} rows x ({pk['prompt']} + "
                f"{pk['response']}) = {pk['tokens']} tokens packed, "
                f"{'checkpointing' if pk['gradient_checkpointing'] else 'no checkpointing'}, log-prob chunks of "
                f"{pk['chunk_tokens']}; kernel {pk['kernel']} (flash_attn {fa})"
            )
            print(
                f"  {pk['pass_s']:.3f} s/pass (first {pk['first_pass_s']:.3f}), {pk['tokens_per_s']:,.0f} tok/s; "
                f"no-grad scoring {pk['score_nograd_s']:.3f} s"
            )
            plan = pk.get("plan", {})
            if "measured_over_planned" in pk:
                print(
                    f"  peak beyond the pass's start: measured {pk['measured_gib']:.3f} GiB, planned "
                    f"{pk['planned_gib']:.3f} GiB ({plan['peak_phase'].replace('_', ' ')}): "
                    f"measured_over_planned={pk['measured_over_planned']:.3f}"
                )
            else:
                print(f"  peak beyond the pass's start: measured {pk['measured_gib']:.3f} GiB; plan: {plan.get('status')}")
            if not str(pk.get("memory_source", "")).startswith("torch.cuda"):
                print(f"  memory: {pk['memory_source']}")
        else:
            print(f"packed learner pass: {pk.get('status')} ({pk.get('why', pk.get('error', ''))})")


def print_slice(results: dict) -> None:
    sl = results.get("slice")
    if isinstance(sl, dict) and "depths" in sl:
        print()
        print(
            f"slice of {sl['model']} (bf16 weights, fp32 master + AdamW in the optimiser, checkpointing), "
            f"{sl['rows']}x({sl['prompt']}+{sl['response']}) tokens"
        )
        head = (
            f"{'layers':<10}{'params M':>10}{'fwd+bwd s':>11}{'optim s':>9}{'tok/s':>11}{'fb tok/s':>11}"
            f"{'state GiB':>11}{'peak GiB':>10}{'score s':>9}"
        )
        print(head)
        print("-" * len(head))
        rows = [(str(e["layers"]), e) for e in sl["depths"]]
        fd = sl.get("full_depth", {})
        if fd.get("status") == "ok":
            rows.append((f"{fd['layers']} (fit)", fd))
        for label, e in rows:
            if e.get("status") == "ok":
                print(
                    f"{label:<10}{e['params'] / 1e6:>10,.1f}{e['fb_s']:>11.2f}{e['opt_s']:>9.2f}"
                    f"{e['tokens_per_s']:>11,.0f}{e['fb_tokens_per_s']:>11,.0f}{e['state_bytes'] / GIB:>11.2f}"
                    f"{e['peak_bytes'] / GIB:>10.2f}"
                    f"{e['score_nograd_s']:>9.2f}"
                )
            else:
                print(f"{label:<10}{e.get('status', 'not run')}  {e.get('why', e.get('error', ''))[:80]}")
        if fd.get("status") == "ok":
            print(f"fit check: {fd['params']:,} parameters extrapolated, {fd['params_actual']:,} in the full model")
        print(f"memory: {sl['memory_source']}")
        plan = sl.get("plan", {})
        if plan.get("status") == "ok":
            for r in plan["per_depth"]:
                print(
                    f"plan at {r['layers']} layers: state {r['plan_state_bytes'] / GIB:.2f} GiB (measured "
                    f"{r['measured_state_bytes'] / GIB:.2f}), state + activations {r['plan_total_bytes'] / GIB:.2f} "
                    f"GiB (measured peak {r['measured_peak_bytes'] / GIB:.2f})"
                )
            g = plan["recipe_per_gpu"]
            r = g["recipe"]
            where = f"{r['learner_backend']}, ZeRO {r['zero_stage']}, {r['num_learners']} learners"
            print(
                f"plan per GPU as the recipe runs ({where}): "
                + (f"{g['plan_total_bytes'] / GIB:.2f} GiB" if g["status"] == "ok" else g["status"])
            )
        elif plan:
            print(f"plan: {plan.get('status')}")


def print_drift(results: dict) -> None:
    for e in results.get("drift", []):
        if e.get("status") == "ok":
            print(
                f"\nlog-prob drift, {e['model']} {e['rows']}x({e['prompt']}+{e['response']}), {e['dtype']}, "
                f"{e['tokens_compared']} completion tokens vs {e['reference']}:"
            )
            for k, v in e["comparisons"].items():
                print(
                    f"  {k:<26} max |d logp| {v['max_abs_delta_logp']:.3g}, mean {v['mean_abs_delta_logp']:.3g}, "
                    f"max |ratio - 1| {v['max_abs_ratio_minus_1']:.3g}"
                )
        else:
            print(f"\n{e['name']}: {e.get('status')} {e.get('why', e.get('error', ''))}")


def print_transfer(results: dict) -> None:
    tr = results.get("transfer")
    if isinstance(tr, dict):
        print()
        if tr.get("status") == "ok":
            print(
                f"host<->device transfer, {tr['bytes'] / 1e9:.3f} GB of bf16 each way in "
                f"{tr['chunk_bytes'] / 1e6:.0f} MB chunks" + (f" (sized down {tr['sized_down']})" if "sized_down" in tr else "")
            )
            for kind in ("pinned", "pageable"):
                r = tr.get(kind, {})
                if r.get("status") == "ok":
                    print(
                        f"  {kind:<9} h2d {r['h2d_gb_per_s']:7.2f} GB/s ({r['h2d_s_per_15_2_gb']:.2f} s per 15.2 GB), "
                        f"d2h {r['d2h_gb_per_s']:7.2f} GB/s ({r['d2h_s_per_15_2_gb']:.2f} s per 15.2 GB)"
                    )
                elif r:
                    print(f"  {kind:<9} {r.get('status')} ({r.get('why', '')})")
        else:
            print(f"transfer: {tr.get('status')} ({tr.get('why', '')})")


def print_generation(results: dict) -> None:
    if "generation" in results:
        head = f"{'generation (sampling, T=1)':<40}{'s':>8}{'new tok/s':>11}{'':>12}{'peak GiB':>10}"
        print()
        print(head)
        print("-" * len(head))
        for e in results["generation"]:
            if e.get("status") == "ok":
                print(f"{e['name']:<40}{e['seconds']:>8.2f}{e['tokens_per_s']:>11,.0f}{'':>12}{e['peak_gib']:>10.2f}")
            else:
                print(f"{e['name']:<40}{e.get('status', 'not run'):>8}  {e.get('why', e.get('error', ''))[:80]}")


def print_colocate(results: dict) -> None:
    co = results.get("colocate")
    if isinstance(co, dict):
        print()
        if co.get("status") == "ok":
            print(
                f"colocated cycle: fp32 weights + AdamW, compute {co['compute_dtype']}, {co['params'] / 1e6:,.1f} M "
                f"params; learner {co['rows']}x({co['prompt']}+{co['response']}) ckpt; generate "
                f"{co['gen_batch']}x({co['gen_prompt']}+{co['gen_new_tokens']}) from the same model"
            )
            plan = co.get("plan", {})
            for ph in COLOCATE_PHASES:
                e = co["phases"][ph]
                line = (
                    f"  phase={ph} seconds={e['seconds']:.2f} peak_gib={_fmt_gib(e['peak_gib'])} resident_gib={_fmt_gib(e['resident_gib'])}"
                )
                if "plan_gib" in e:
                    within = "unavailable" if e["within_plan"] is None else e["within_plan"]
                    line += f" plan_gib={e['plan_gib']:.2f} within_plan={within} (plan vs {e['compares']})"
                    if "over_plan_bytes" in e:
                        line += f" over_plan_gib={e['over_plan_bytes'] / GIB:.2f}"
                else:
                    line += f" plan={plan.get('status', 'unavailable')}"
                print(line)
            if plan.get("status") == "ok":
                g = co["phases"]["generation"]
                print(
                    f"  plan: {plan['args']}; allocator's share (less CUDA context); generation with the optimizer "
                    f"state offloaded (as planned for the HF turn, state kept: "
                    f"{plan['generation_as_planned_bytes'] / GIB:.2f} GiB"
                    + (f", within={g['within_plan_as_planned']})" if "within_plan_as_planned" in g else ")")
                    + f"; the learner entry's autocast weight copies {plan['autocast_copies_bytes'] / GIB:.2f} GiB"
                )
            rt = co["round_trip"]
            print(
                f"  optimizer round trip: state_bytes={rt['state_bytes']} bytes_offloaded={rt['bytes_offloaded']} "
                f"offload_s={rt['offload_s']:.3f} reload_s={rt['reload_s']:.3f} "
                f"pinned={'n/a' if rt['pinned_during_turn'] is None else rt['pinned_during_turn']} "
                f"state_bitwise_equal={rt['state_bitwise_equal']} "
                f"weights_unchanged_by_generation={rt['weights_unchanged_by_generation']} "
                f"step_after_reload_matches_reference={rt['step_after_reload_matches_reference']}"
            )
            if "note" in rt:
                print(f"  note: {rt['note']}")
            print(f"  memory: {co['memory_source']}")
            print(f"  round_trip_ok={rt['ok']}")
        else:
            print(
                f"colocated cycle: {co.get('status')} ({co.get('why', co.get('error', ''))}"
                + (f", in phase {co['phase']})" if "phase" in co else ")")
            )


def print_stage_table(results: dict) -> None:
    """The table every run ends with: stage | status | seconds | note."""
    rows = results.get("summary", [])
    width = max([len("stage")] + [len(r["stage"]) for r in rows])
    print()
    print(f"{'stage':<{width}} | {'status':<7} | {'seconds':>8} | note")
    print(f"{'-' * width}-+-{'-' * 7}-+-{'-' * 8}-+-{'-' * 40}")
    for r in rows:
        note = " ".join(str(r.get("note", "")).split())
        print(f"{r['stage']:<{width}} | {r['status']:<7} | {r['seconds']:>8.1f} | {note[:200]}")
    failed = [r["stage"] for r in rows if r["status"] == "failed"]
    print(
        f"{len(rows)} stages: {sum(r['status'] == 'ran' for r in rows)} ran, "
        f"{sum(r['status'] == 'skipped' for r in rows)} skipped, {len(failed)} failed" + (f" ({', '.join(failed)})" if failed else "")
    )
