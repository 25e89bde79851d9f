"""The supervised warm start: AdamW with warmup + cosine decay on prompt + worked solution
(loss on the completion only), stopping at the first held-out check in the target band."""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Optional

from rllib_exgrpo.warm_start.examples import batch_indices, collate, encode_examples, solution_resampler
from rllib_exgrpo.warm_start.in_context import icl_examples, icl_prefixes, operators_icl_resampler
from rllib_exgrpo.warm_start.pass1 import evaluate_at_step
from rllib_exgrpo.warm_start.progress import LineProgress, progress_bar


def run_steps(recipe: dict) -> int:
    """Supervised steps this build runs at most: ``max_steps``, or a continued build's own."""
    return recipe["continue"]["steps"] if "continue" in recipe else recipe["max_steps"]


def lr_at(step: int, recipe: dict) -> float:
    """The learning rate at ``step``: linear warmup, then cosine decay to ``min_lr_ratio``."""
    t = recipe["train"]
    warm, total = t["warmup_steps"], run_steps(recipe)
    if step < warm:
        return t["lr"] * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    floor = t["min_lr_ratio"]
    return t["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def warm_start(model, tokenizer, train_problems, eval_problems, recipe: dict, progress: bool, t0: float) -> dict:
    """Supervised steps until the sampled held-out pass@1 reaches the target band (checked
    every ``eval_every`` steps from ``eval_start``) or ``max_steps``."""
    import torch

    tr, ev = recipe["train"], recipe["eval"]
    next_batch = _batch_feed(tokenizer, train_problems, recipe)
    optim = _optimizer(model, tr)
    history: list[dict] = []
    last_eval: Optional[dict] = None
    reached = False
    step = 0
    model.train()
    total = run_steps(recipe)
    # a continued build runs all of its steps: its start already met the stop
    may_stop = "continue" not in recipe
    bar = progress_bar(total, progress)
    try:
        while step < total:
            input_ids, mask, labels = next_batch()
            for g in optim.param_groups:
                g["lr"] = lr_at(step, recipe)
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tr["grad_clip"])
            optim.step()
            step += 1
            bar.update(1)
            postfix = {"loss": f"{loss.item():.3f}"}
            due = step >= ev["eval_start"] and (step - ev["eval_start"]) % ev["eval_every"] == 0
            if due or step == total:
                last_eval = evaluate_at_step(model, tokenizer, eval_problems, recipe, step)
                reached = _record_check(last_eval, recipe, step, loss.item(), t0, history, postfix)
            bar.set_postfix(postfix)
            if due and isinstance(bar, LineProgress):
                bar.print_line()  # each check's figures, not only every tenth of the steps
            if reached and may_stop:
                break
    finally:
        bar.close()
    if last_eval is None:
        last_eval = evaluate_at_step(model, tokenizer, eval_problems, recipe, step)
    return {"steps": step, "reached": reached, "last_eval": last_eval, "history": history}


def _optimizer(model, tr: dict):
    """AdamW, weight decay on the matrices only.

    Fused: ATen's own vectorised AdamW kernel. The default single-tensor path takes its
    square root through MKL's vector math, whose result differs between Intel and AMD CPUs
    whatever MKL_CBWR says (measured: see pinned_build); the fused kernel's does not.
    """
    import torch

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": tr["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tr["lr"],
        betas=tuple(tr["betas"]),
        fused=True,
    )


def _batch_feed(tokenizer, train_problems, recipe: dict) -> Callable[[], tuple]:
    """A function giving the next batch's ``(input_ids, attention_mask, labels)``, its
    solutions (and in-context rows) drawn anew where the recipe says so."""
    tr = recipe["train"]
    # which examples carry a prefix, and what it shows: one retrieval pass (BM25 over the
    # training questions, a few minutes for 20,000), shared by the prefixes and the resampler
    chosen = icl_examples(train_problems, recipe) if recipe.get("icl") else None
    p_ids, c_ids = encode_examples(tokenizer, train_problems, recipe["instruction"], icl_prefixes(train_problems, recipe, chosen))
    batches = batch_indices(train_problems, tr["batch_size"], tr["level_balanced"], recipe["seed"])
    resample = solution_resampler(train_problems, tokenizer, recipe)
    icl_resample = operators_icl_resampler(train_problems, tokenizer, recipe, chosen)

    def next_batch() -> tuple:
        idx = next(batches)
        # in-context rows: prompt and solution drawn together (one table per family)
        icl_rows = icl_resample(idx) if icl_resample is not None else {}
        for i, (prompt, solution) in icl_rows.items():
            p_ids[i], c_ids[i] = prompt, solution
        rest = [i for i in idx if i not in icl_rows]
        if resample is not None and rest:
            for i, ids in zip(rest, resample(rest)):
                c_ids[i] = ids
        return collate(p_ids, c_ids, idx, tokenizer.pad_token_id)

    return next_batch


def _record_check(last_eval: dict, recipe: dict, step: int, loss: float, t0: float, history: list, postfix: dict) -> bool:
    """Append a held-out check to ``history`` and ``postfix``; whether it meets the stop:
    self-consistency (operators), pass@1 in either format (format-weak), else pass@1."""
    history.append(
        {
            "step": step,
            "loss": round(loss, 4),
            "pass1": last_eval["pass1"],
            "mean_token_entropy": round(last_eval["mean_token_entropy"], 4),
            "per_level": last_eval["per_level"],
            "elapsed_s": round(time.time() - t0, 1),
        }
    )
    postfix["pass1"] = f"{last_eval['pass1']:.2f}"
    target_low = recipe["target_pass1"] - recipe["eval"]["band"]
    if "task" in recipe:
        consistency = last_eval["operators"]["self_consistency"]
        history[-1]["self_consistency"] = round(consistency, 4)
        postfix["consistent"] = f"{consistency:.2f}"
        return consistency >= recipe["task"]["target_consistency"]
    if "answer_format" in recipe:
        figures = last_eval["answer_format"]
        history[-1]["pass1_any_format"] = round(figures["pass1_any_format"], 4)
        history[-1]["boxed_share"] = round(figures["boxed_share"], 4)
        postfix["any_format"] = f"{figures['pass1_any_format']:.2f}"
        return figures["pass1_any_format"] >= target_low
    return last_eval["pass1"] >= target_low


def warn_if_busy(num_threads: int) -> None:
    """Say so when other work already keeps the CPUs busy: OpenMP threads that spin-wait
    for a busy core made a 2-thread step >10x slower here (3.7 s instead of 0.25 s)."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):  # pragma: no cover
        return
    if num_threads > 1 and load + num_threads > cores + 1.0:
        import logging

        logging.getLogger(__name__).warning(
            "building the tiny model with %d torch threads while the CPU load is %.1f on %d cores: "
            "expect it to be much slower than the few minutes it takes on idle cores "
            "(OMP_WAIT_POLICY=PASSIVE in the environment of this process softens the contention)",
            num_threads,
            load,
            cores,
        )
