"""The measuring stages (learner ... colocate) as the driver calls them, and each one's
status in the table of stages (ran / skipped / failed) read from what it recorded."""

from __future__ import annotations

from gpucheck.colocate import colocate_predicted_s, run_colocate
from gpucheck.common import RECIPE_7B, free_memory, learner_flops_rate, nograd_token_rate, read_recipe
from gpucheck.drift import run_drift
from gpucheck.generation import run_generation
from gpucheck.learner import run_learner
from gpucheck.packed import run_packed
from gpucheck.slice import plan_comparison, run_slice
from gpucheck.transfer import run_transfer


def _no_budget(ctx, key: str, **extra) -> bool:
    """True (and the stage marked skipped) when the budget is spent."""
    if ctx.clock.left() > 0:
        return False
    ctx.results[key] = {"status": "skipped", "why": "no budget left", **extra}
    ctx.clock.save()
    return True


def learner(ctx) -> None:
    run_learner(ctx.model, ctx.shape, ctx.device, ctx.args.steps, ctx.clock)


def packed(ctx) -> None:
    if not _no_budget(ctx, "packed"):
        run_packed(ctx.shape["packed"], ctx.device, ctx.clock, flops_rate=learner_flops_rate(ctx.results, ctx.shape["config"]))


def drift(ctx) -> None:
    run_drift(
        ctx.model,
        ctx.args.shape,
        ctx.shape["drift"],
        ctx.shape["config"]["vocab_size"],
        ctx.device,
        ctx.clock,
        tokens_per_s=nograd_token_rate(ctx.results),
    )


def slice_(ctx) -> None:
    spec = ctx.args.slice_spec

    def slice_drift(slice_model, entry):  # the drift stage on the deepest slice's weights
        if "drift" in ctx.args.stage_list:
            run_drift(
                slice_model,
                f"{spec['name']}-{entry['layers']}-layers",
                spec,
                spec["config"]["vocab_size"],
                ctx.device,
                ctx.clock,
                tokens_per_s=spec["rows"] * (spec["prompt"] + spec["response"]) / entry["score_nograd_s"],
            )

    if not _no_budget(ctx, "slice"):
        res = run_slice(
            spec,
            ctx.device,
            ctx.args.attn,
            min(ctx.args.steps, spec["steps"]),
            ctx.clock,
            flops_rate=learner_flops_rate(ctx.results, ctx.shape["config"]),
            after_last=slice_drift,
        )
        res["plan"] = plan_comparison(res, read_recipe(RECIPE_7B))
        ctx.clock.save()


def transfer(ctx) -> None:
    nbytes = int(ctx.args.transfer_gb * 1e9)
    if not _no_budget(ctx, "transfer", bytes_requested=nbytes):
        run_transfer(ctx.device, nbytes, int(ctx.args.chunk_mb * 1e6), ctx.clock)


def generation(ctx) -> None:
    if not _no_budget(ctx, "generation"):
        run_generation(ctx.model, ctx.shape, ctx.device, ctx.clock)


def colocate(ctx) -> None:
    ctx.model = None  # the stage builds its own learner model (fp32 weights); nothing after it needs this one
    free_memory(ctx.device)
    if not _no_budget(ctx, "colocate"):
        run_colocate(ctx.shape, ctx.device, ctx.dtype, ctx.args.attn, ctx.clock, predicted_s=colocate_predicted_s(ctx.results, ctx.shape))


LEGACY_RUNNERS = {
    "learner": learner,
    "packed": packed,
    "drift": drift,
    "slice": slice_,
    "transfer": transfer,
    "generation": generation,
    "colocate": colocate,
}


def _entries(stage: str, results: dict) -> list:
    got = results.get(stage)
    if stage == "slice" and isinstance(got, dict) and "depths" in got:
        return got["depths"]
    if isinstance(got, dict):
        return [got]
    return list(got or [])


def legacy_outcome(stage: str, results: dict) -> tuple:
    """``(status, note)`` of a measuring stage: failed on an error or a failed check (a
    transfer's or the colocated round trip's), skipped when nothing of it ran (budget), else
    ran (an out-of-memory is a measurement: said in the note)."""
    entries = _entries(stage, results)
    if not entries:
        return "skipped", "no budget left"
    statuses = [e.get("status") for e in entries]
    errors = [e.get("error", "") for e in entries if e.get("status") == "error"]
    if errors:
        return "failed", errors[0]
    checks = [e.get("round_trip", {}).get("ok") for e in entries if "round_trip" in e]
    checks += [
        e.get(k, {}).get("round_trip_ok")
        for e in entries
        for k in ("pinned", "pageable")
        if isinstance(e.get(k), dict) and "round_trip_ok" in e[k]
    ]
    if any(c is False for c in checks):
        return "failed", "round trip check failed"
    if all(s == "skipped" for s in statuses):
        return "skipped", entries[0].get("why", "budget")
    ooms = sum(s == "oom" for s in statuses)
    skipped = sum(s == "skipped" for s in statuses)
    parts = (
        [f"{len(entries) - ooms - skipped}/{len(entries)} ok"]
        + ([f"{ooms} out of memory"] if ooms else [])
        + ([f"{skipped} skipped (budget)"] if skipped else [])
    )
    return "ran", ", ".join(parts)
