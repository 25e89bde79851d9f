"""A tiny model folder built from its recipe: tokenizer, model, warm start, report."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from rllib_exgrpo.models.cache import WARM_START_FILE, is_complete
from rllib_exgrpo.models.recipe import recipe_key, task_problems
from rllib_exgrpo.models.tiny_tokenizer import check_tokenizer_stable, corpus_texts, train_tokenizer
from rllib_exgrpo.warm_start.examples import tokenizer_corpus, whole_words
from rllib_exgrpo.warm_start.training import warm_start, warn_if_busy
from rllib_exgrpo.models.pinned_build import PINNED_CAPABILITY


def build_into(folder: Path, recipe: dict, progress: bool) -> dict:
    """Tokenizer, model, supervised warm start to the target pass@1, report; in ``folder``.
    The report, ``warm_start.json``, is written last: its presence marks a complete folder."""
    import torch

    t0 = time.time()
    tr, ev = recipe["train"], recipe["eval"]
    train_problems = task_problems(recipe, "train", tr["n_train"])
    eval_problems = task_problems(recipe, "test", ev["n_eval"])
    base = continued_from(folder, recipe)
    tokenizer, texts = _tokenizer_for(folder, recipe, train_problems, base)
    warn_if_busy(tr["num_threads"])

    old_threads = torch.get_num_threads()
    torch.set_num_threads(tr["num_threads"])
    try:
        torch.manual_seed(recipe["seed"])
        if base is None:
            model = new_model(recipe, tokenizer)
            model.config.save_pretrained(str(folder))  # so AutoTokenizer resolves the qwen2 class
            tokenizer = check_tokenizer_stable(tokenizer, str(folder), texts[:200] + [p.question for p in eval_problems[:50]])
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True, dtype=torch.float32)
            model.config.save_pretrained(str(folder))
        run = warm_start(model, tokenizer, train_problems, eval_problems, recipe, progress, t0)
        model.save_pretrained(str(folder), safe_serialization=True)
    finally:
        torch.set_num_threads(old_threads)

    report = _report(recipe, run, model, tokenizer, t0)
    _warn_about(report, recipe, run)
    with open(folder / WARM_START_FILE, "w") as fh:
        json.dump(report, fh, indent=2)
    return report


def _tokenizer_for(folder: Path, recipe: dict, train_problems: list, base: Optional[Path]) -> tuple:
    """``(tokenizer, corpus texts)``, the tokenizer saved in ``folder``: trained on the
    warm-start corpus, or a continued build's base's (its ids are what the weights know;
    texts ``None``)."""
    texts = None
    if base is None:
        texts = corpus_texts(tokenizer_corpus(train_problems, recipe), recipe["instruction"])
        tokenizer = train_tokenizer(texts, **recipe["tokenizer"], whole_words=whole_words(recipe))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    tokenizer.save_pretrained(str(folder))
    return tokenizer, texts


def _report(recipe: dict, run: dict, model, tokenizer, t0: float) -> dict:
    """The ``warm_start.json`` report: recipe, steps, held-out figures, sizes, versions, kernels."""
    import torch

    last_eval = run["last_eval"]
    return {
        "recipe": recipe,
        "recipe_key": recipe_key(recipe),
        "steps": run["steps"],
        "reached_target": run["reached"],
        "wall_time_s": round(time.time() - t0, 1),
        "final_pass1": last_eval["pass1"],
        "per_level_pass1": last_eval["per_level"],
        "per_level_n": last_eval["per_level_n"],
        "mean_token_entropy": last_eval["mean_token_entropy"],
        "mean_prompt_tokens": last_eval["mean_prompt_tokens"],
        "mean_completion_tokens": last_eval["mean_completion_tokens"],
        "n_eval": last_eval["n"],
        **({"operators": last_eval["operators"]} if "operators" in last_eval else {}),
        **({"answer_format": last_eval["answer_format"]} if "answer_format" in last_eval else {}),
        "n_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "sample_completions": last_eval["samples"],
        "history": run["history"],
        "versions": _versions(),
        # The kernels the weights came from: AVX2 when the pin of pinned_build took effect.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # MKL's reproducibility branch (COMPATIBLE in a pinned build; None: MKL's own dispatch).
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "build_threads": recipe["train"]["num_threads"],
    }


def _warn_about(report: dict, recipe: dict, run: dict) -> None:
    """Warn when the kernels were not the pinned ones, or the warm start missed its target."""
    import warnings

    if report["cpu_capability"] != PINNED_CAPABILITY:
        warnings.warn(
            f"tiny model built with {report['cpu_capability']} CPU kernels, not {PINNED_CAPABILITY}: "
            "its weights will differ from an AVX2 machine's build of the same recipe",
            RuntimeWarning,
            stacklevel=3,
        )
    if run["reached"]:
        return
    last_eval = run["last_eval"]
    if "task" in recipe:
        reached_what = f"self-consistency {last_eval['operators']['self_consistency']:.3f} < {recipe['task']['target_consistency']:.3f}"
    else:
        read = last_eval["answer_format"]["pass1_any_format"] if "answer_format" in recipe else last_eval["pass1"]
        reached_what = f"held-out pass@1 {read:.3f} < {recipe['target_pass1'] - recipe['eval']['band']:.3f}"
    warnings.warn(f"tiny model warm start stopped at max_steps={run['steps']} with {reached_what}", RuntimeWarning, stacklevel=3)


def continued_from(folder: Path, recipe: dict) -> Optional[Path]:
    """The built base folder a continued recipe starts from (a sibling of the folder being
    built: both live in the cache root), or ``None`` for a build from scratch."""
    if "continue" not in recipe:
        return None
    base = folder.parent / recipe["continue"]["from"]
    if not is_complete(base):
        raise FileNotFoundError(f"continued tiny build: its base model {base} is not built")
    return base


def new_model(recipe: dict, tokenizer):
    """A freshly initialised Qwen2 of the recipe's shape with a neutral generation config."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    mc = dict(recipe["model"])
    rope_theta = mc.pop("rope_theta")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        use_cache=True,
        **mc,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    return model


def _versions() -> dict:
    """The versions of the libraries whose numerics the weights depend on."""
    import tokenizers
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
