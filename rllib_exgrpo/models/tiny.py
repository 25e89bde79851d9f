"""The embedded tiny model: a ~0.8M-parameter Qwen2 warm-started on the arithmetic family.

The default training job must run on a fresh CPU machine with no downloads, so the project
builds its own small causal LM and tokenizer on first use and caches the result:

1. **Tokenizer.** A byte-level BPE trained offline (``tokenizers``) on the arithmetic corpus
   (rendered prompts + worked solutions) with *exactly* the Qwen2 pre-tokenization pipeline
   (NFC, the Qwen2 split regex that isolates each digit, ByteLevel), wrapped in
   ``Qwen2Tokenizer``. For ``model_type=qwen2`` ``AutoTokenizer`` rebuilds a
   ``Qwen2Tokenizer`` with that pipeline whatever the saved files say, so a BPE trained with
   any other pipeline would silently change ids on reload; after saving we reload through
   ``AutoTokenizer`` and raise unless ids, vocab, merges, special tokens and the chat
   template are unchanged. Special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``,
   ``<|im_end|>`` (eos) and a small ChatML chat template.
2. **Model.** A transformers ``Qwen2ForCausalLM`` (hidden 128, 3 layers, 4 heads of 32,
   MLP 512, tied embeddings: about 0.83M parameters). Measured here, 3 layers reached the
   target band in fewer steps than 4 (700 vs 900 at batch 64) and cost ~25% less per step.
3. **Supervised warm start** on ``render_prompt(p.question, tokenizer=tok) + p.solution +
   eos`` (loss on the completion only), AdamW with warmup + cosine decay. Every
   ``eval_every`` steps the held-out (``split="test"``) pass@1 at temperature 1.0 is
   measured; training stops at the first evaluation that reaches ``target_pass1 - band``
   (or at ``max_steps``). Stopping early, before the model is sure of itself, leaves RL a
   policy with room to improve and enough entropy to explore.

The build runs in a child process with pinned numerics (``pinned_build``), so a recipe
gives the same weights on any x86-64 machine with AVX2, Intel or AMD (docs/warm_start.md).
Measured on 2 AMD EPYC cores (torch 2.13 CPU, transformers 5.24), default recipe (version
3), seed 0: stopped at step 630 after 504 s with held-out pass@1 0.305 at temperature 1
(levels 1-4: 0.69 / 0.48 / 0.05 / 0.16), mean token entropy 0.12 nats; 0.83M parameters,
vocab 322, prompts 31-37 tokens, completions 15-34 tokens. The step at which the model "gets" carries
varies with the seed: seed 1 was still at 0.25 when it hit ``max_steps=1500``
(``reached_target: false`` in the report, with a warning).

The folder is cached under ``cache_dir`` / ``$RLLIB_EXGRPO_CACHE`` / ``~/.cache/rllib_exgrpo``
in a subfolder keyed by a hash of the whole recipe. Builds go to a temporary folder that is
renamed into place atomically, under a file lock (``filelock``), so concurrent callers (several
Ray actors) wait for one build instead of racing. The default recipe's folder ships with the
package (``shipped``): a cache without it gets a verified copy in a second instead of a build
(``RLLIB_EXGRPO_REBUILD_MODEL=1`` builds instead).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from filelock import FileLock

#: Bump when the build procedure changes in a way the recipe does not capture. Version 2:
#: the build runs with pinned kernels (``pinned_build``) and evaluates through the env's
#: own sampling and verifier (version-1 folders were built by earlier code under the same
#: key). Version 3: MKL on its vendor-neutral COMPATIBLE branch and a fused AdamW, so that
#: an AMD CPU builds the same bits as an Intel one (version 2 held across Intel CPUs only).
RECIPE_VERSION = 3
CACHE_ENV_VAR = "RLLIB_EXGRPO_CACHE"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "rllib_exgrpo")
WARM_START_FILE = "warm_start.json"

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

#: ChatML: an optional system turn, the user turn, then ``<|im_start|>assistant\n``.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


#: Worked examples in an ICL-trained prompt (XRPO's icl_num_examples default).
ICL_NUM_EXAMPLES = 2

#: The families a tiny model can be warm-started on.
TASKS = ("arithmetic", "operators")

#: The hidden-operator warm start (``task="operators"``): every worked solution shows
#: meanings drawn afresh each time the example is drawn (not once per question, which a
#: small model would memorise per question), so the model learns the format and the
#: arithmetic and guesses each meaning uniformly. The build stops when a share
#: ``target_consistency`` of its sampled held-out answers read back as well-formed solutions
#: whose arithmetic is right under the meanings they chose (``operators.read_worked_solution``):
#: its pass@1 then sits at the guessing level by chain length, which the report records next
#: to the exact guessing rates. ``target_pass1`` and ``eval.band`` do not apply.
OPERATORS_TASK: dict[str, Any] = {
    "name": "operators",
    "families": 24,
    "target_consistency": 0.95,
}
#: Recipe values that differ for the operators task (longer answers, a larger eval set
#: because the stop reads a rate near 1; each check costs ~7 s, every 50 steps).
OPERATORS_TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "eval": {"n_eval": 512, "eval_every": 50, "eval_start": 300, "max_new_tokens": 96},
}

#: The format-weak warm start (``boxed_fraction`` < 1): the answer ending a worked solution
#: is written ``\\boxed{N}`` with probability ``boxed_fraction`` and ``other`` otherwise,
#: drawn afresh each time an example is drawn (a format fixed per question could be learnt
#: per question). The ``Answer: N`` line is what a base LLM that was never asked for a box
#: tends to write: the verifier gives it 0, so rewarded answers are rare although the
#: arithmetic is right, and what a success teaches (box the answer) holds for every question.
ANSWER_FORMAT: dict[str, Any] = {"other": "Answer: {answer}"}
_BOXED_END_RE = re.compile(r"\\boxed\{([^{}]*)\}$")


def with_answer_format(solution: str, boxed: bool, recipe: dict) -> str:
    """``solution`` (ending in ``\\boxed{N}``) with its final answer boxed or written in the
    recipe's other format."""
    if boxed:
        return solution
    match = _BOXED_END_RE.search(solution)
    if match is None:
        raise ValueError(f"worked solution does not end in a boxed answer: {solution!r}")
    return solution[: match.start()] + recipe["answer_format"]["other"].format(answer=match.group(1))


def read_final_answer(text: str) -> tuple[Optional[str], bool]:
    """``(answer, boxed)`` of a completion in either format of the format-weak warm start:
    the last ``\\boxed{N}``, else the number after the last ``Answer:``; ``(None, False)``
    when neither is there."""
    from rllib_exgrpo.envs.rewards import last_boxed

    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip(), True
    match = re.findall(r"Answer:\s*(-?\d+)", text)
    return (match[-1], False) if match else (None, False)


#: Everything that shapes the result besides the public arguments.
_DEFAULTS: dict[str, Any] = {
    "tokenizer": {"vocab_size": 512, "min_frequency": 2},
    "model": {
        "hidden_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "intermediate_size": 512,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    },
    "train": {
        "n_train": 20000,
        "batch_size": 64,
        "lr": 3e-3,
        "min_lr_ratio": 0.1,
        "warmup_steps": 50,
        "weight_decay": 0.01,
        "betas": (0.9, 0.98),
        "grad_clip": 1.0,
        # Torch intra-op threads, fixed (results are bitwise reproducible only for a fixed
        # thread count). Measured here on idle cores, 3 layers, batch 64: 1 thread 0.35
        # s/step, 2 threads 0.20 s/step. But when anything else keeps the cores busy, two
        # spin-waiting OpenMP threads collapse (3.7-5 s/step at load ~6, 1 thread 0.7
        # s/step): on a shared box use {"train": {"num_threads": 1}} / "tiny:threads=1".
        "num_threads": 2,
        "level_balanced": True,
    },
    "eval": {
        "n_eval": 256,
        "eval_seed": 0,
        # Every 10 steps: pass@1 rises fast once the model gets carries (0.25 -> 0.39 in 50
        # steps, measured), and a coarser check overshoots the target band's lower edge by
        # that much, leaving RL a stronger start (held-out greedy 0.455 instead of ~0.35)
        # and less room. Each check costs ~2 s.
        "eval_every": 10,
        "eval_start": 300,
        "band": 0.05,
        "max_new_tokens": 40,
        "temperature": 1.0,
        "batch_size": 256,
    },
}


# --------------------------------------------------------------------------- recipe & cache


def tiny_recipe(
    *,
    seed: int = 0,
    target_pass1: float = 0.35,
    levels: Sequence[int] = (1, 2, 3, 4),
    max_steps: int = 1500,
    overrides: Optional[dict] = None,
    icl_fraction: float = 0.0,
    task: str = "arithmetic",
    known_families: int = 0,
    tag_tokens: bool = False,
    boxed_fraction: float = 1.0,
    continue_steps: int = 0,
) -> dict:
    """The full, JSON-serialisable recipe of a tiny model (what the cache key hashes).

    ``task`` is the family the warm start learns: ``"arithmetic"`` (the default model), or
    ``"operators"`` (:mod:`rllib_exgrpo.envs.operators`: format and arithmetic with every meaning
    guessed, see :data:`OPERATORS_TASK`; ``levels`` are then chain lengths, default 1-3).
    ``known_families`` > 0 (operators only) adds that many *other* families, tagged after
    the task's own, whose solutions always show their true meanings: the warm start then
    learns that a meaning is read off the family tag and the symbol, without seeing any
    meaning of the families the RL task uses (each family's table is drawn on its own).
    ``tag_tokens`` (operators only) gives every family tag (``[F07]``) a token of its own.
    The 512-token BPE otherwise spells a tag with the digit tokens the operands use, so a
    family's identity lives in the embeddings every question shares, and what RL learns
    about one family's meanings spills onto all others; a tag token gives each family a
    representation of its own, as a large model's vocabulary and width give distinct names.

    ``overrides`` is a nested dict merged into the defaults, e.g.
    ``{"model": {"num_hidden_layers": 2}, "eval": {"eval_every": 25}}``; unknown keys raise.
    ``icl_fraction`` > 0 makes the model able to read worked examples in its prompt (see
    :func:`icl_prefixes`); at 0 the recipe has no ``icl`` section, so the default model's
    cache key is what it was before the option existed.

    ``boxed_fraction`` < 1 makes a *format-weak* warm start (:data:`ANSWER_FORMAT`): each time
    a worked solution is drawn it ends in ``\\boxed{N}`` with that probability and in
    ``Answer: N`` otherwise, so the model computes as well as the default one but boxes about
    that share of its answers, and the verifier (reward only for a boxed, correct answer)
    rewards about ``boxed_fraction`` x its accuracy. The build's stop then reads accuracy in
    either format (``target_pass1`` as usual); the report adds the boxed share.

    ``continue_steps`` > 0 makes a *continued* warm start: the build loads the model of the
    same recipe without ``icl`` and ``continue`` (built or copied first; its key is
    ``recipe["continue"]["from"]``), keeps its tokenizer, and trains exactly that many more
    steps of this recipe, the learning rate warming up again and decaying over those steps,
    with no early stop. What it is for: teaching a built model to read in-context examples
    (``icl``) costs a few hundred steps, where a from-scratch build with them pays for the
    longer rows on all of its steps.
    """
    from rllib_exgrpo.envs.prompting import DEFAULT_INSTRUCTION

    if not 0.0 < target_pass1 <= 1.0:
        raise ValueError(f"target_pass1 must be in (0, 1], got {target_pass1}")
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    if not 0.0 <= icl_fraction < 1.0:
        raise ValueError(f"icl_fraction must be in [0, 1), got {icl_fraction}")
    if task not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
    if not 0.0 < boxed_fraction <= 1.0:
        raise ValueError(f"boxed_fraction must be in (0, 1], got {boxed_fraction}")
    if continue_steps < 0:
        raise ValueError(f"continue_steps must be >= 0, got {continue_steps}")
    if known_families and task != "operators":
        raise ValueError(f"known_families applies to task='operators' only, got task={task!r}")
    if tag_tokens and task != "operators":
        raise ValueError(f"tag_tokens applies to task='operators' only, got task={task!r}")
    from rllib_exgrpo.envs.operators import MAX_FAMILIES

    most_known = MAX_FAMILIES - OPERATORS_TASK["families"]  # the tags F00-F99 shared with the task's
    if not 0 <= known_families <= most_known:
        raise ValueError(f"known_families must be in [0, {most_known}], got {known_families}")
    if task == "operators" and tuple(levels) == (1, 2, 3, 4):
        levels = (1, 2, 3)  # the arithmetic default: chain lengths 1-3 instead
    levels = tuple(int(lv) for lv in levels)
    recipe: dict[str, Any] = {
        "kind": "tiny-qwen2-arithmetic",
        "version": RECIPE_VERSION,
        "seed": int(seed),
        "target_pass1": float(target_pass1),
        "levels": list(levels),
        "max_steps": int(max_steps),
        "instruction": DEFAULT_INSTRUCTION,
        "chat_template": CHAT_TEMPLATE,
        "special_tokens": list(SPECIAL_TOKENS),
    }
    for section, values in _DEFAULTS.items():
        recipe[section] = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    for section, values in (overrides or {}).items():
        if section not in _DEFAULTS or not isinstance(values, dict):
            raise ValueError(f"unknown recipe section {section!r}; known: {sorted(_DEFAULTS)}")
        unknown = set(values) - set(_DEFAULTS[section])
        if unknown:
            raise ValueError(f"unknown {section} options {sorted(unknown)}; known: {sorted(_DEFAULTS[section])}")
        recipe[section].update(values)
    if icl_fraction > 0:
        from rllib_exgrpo.xrpo.icl import DEFAULT_TEMPLATE

        recipe["icl"] = {"fraction": float(icl_fraction), "num_examples": ICL_NUM_EXAMPLES,
                         "template": DEFAULT_TEMPLATE}
    if task == "operators":
        # Only a non-default task adds a section, so the default model's key is unchanged.
        recipe["task"] = dict(OPERATORS_TASK)
        if known_families:  # only when used, so the first operators model's key is unchanged
            recipe["task"]["known_families"] = int(known_families)
        if tag_tokens:  # the same: absent unless used
            recipe["task"]["tag_tokens"] = True
        for section, values in OPERATORS_TASK_DEFAULTS.items():
            recipe[section].update({k: v for k, v in values.items()
                                    if k not in (overrides or {}).get(section, {})})
    if boxed_fraction < 1.0:  # absent unless used, so every other model's key is unchanged
        recipe["answer_format"] = {**ANSWER_FORMAT, "boxed_fraction": float(boxed_fraction)}
    if continue_steps:  # absent unless used
        base = tiny_recipe(seed=seed, target_pass1=target_pass1, levels=levels, max_steps=max_steps,
                           overrides=overrides, task=task, known_families=known_families,
                           tag_tokens=tag_tokens, boxed_fraction=boxed_fraction)
        recipe["continue"] = {"from": f"tiny-{recipe_key(base)}", "steps": int(continue_steps)}
    # Fingerprint of the data the build would see: a change in the generator rebuilds.
    sample = _task_problems(recipe, "train", 16) + _task_problems(recipe, "test", 4)
    recipe["data_fingerprint"] = hashlib.sha256(
        "\n".join(f"{p.question}|{p.solution}|{p.ground_truth}" for p in sample).encode()
    ).hexdigest()[:16]
    return recipe


def _task_problems(recipe: dict, split: str, n: int) -> list:
    """``n`` problems of the recipe's task: warm-start questions (``"train"``, drawn with the
    recipe's seed) or held-out ones (``"test"``, the eval seed; true meanings)."""
    seed = recipe["seed"] if split == "train" else recipe["eval"]["eval_seed"]
    task = recipe.get("task")
    if task is None:
        from rllib_exgrpo.envs import arithmetic

        return arithmetic.generate(n, split=split, seed=seed, levels=tuple(recipe["levels"]))
    from rllib_exgrpo.envs import operators

    families = task["families"] + (task.get("known_families", 0) if split == "train" else 0)
    return operators.generate(n, split=split, seed=seed, families=families, lengths=tuple(recipe["levels"]))


def _whole_words(recipe: dict) -> list[str]:
    """Strings the recipe's tokenizer keeps as one token each: with ``tag_tokens`` the
    operators task's family tags ``[F00]`` .. ``[F99]``, otherwise none."""
    if not recipe.get("task", {}).get("tag_tokens"):
        return []
    from rllib_exgrpo.envs.operators import MAX_FAMILIES, family_tag

    return [family_tag(f) for f in range(MAX_FAMILIES)]


def _shows_true_meanings(problem: Any, recipe: dict) -> bool:
    """Whether a warm-start solution keeps its true meanings: only in the extra "known"
    families (tagged after the task's own), never in a family the RL task uses."""
    return problem.extra["family"] >= recipe["task"]["families"]


def recipe_key(recipe: dict) -> str:
    """A short stable hash of a recipe."""
    blob = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def cache_root(cache_dir: Optional[str] = None) -> Path:
    """``cache_dir``, else ``$RLLIB_EXGRPO_CACHE``, else ``~/.cache/rllib_exgrpo``."""
    root = cache_dir or os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_DIR
    return Path(os.path.expanduser(root)).resolve()


def _is_complete(folder: Path) -> bool:
    return (folder / WARM_START_FILE).is_file()


def build_cached(root: Path, name: str, builder) -> Path:
    """Return ``root/name``, building it first with ``builder(tmp_dir)`` when missing.

    The builder writes into a fresh temporary folder inside ``root``; the folder is renamed to
    ``root/name`` only when the builder returned, so readers never see a half-built folder.
    A completed folder is one that holds ``warm_start.json`` (or whatever marker the builder
    writes last, see ``marker``). One builder at a time per name (file lock); the others wait
    and then reuse its result.
    """
    final = root / name
    marker = getattr(builder, "marker", WARM_START_FILE)
    if (final / marker).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / f".{name}.lock"):  # one builder per name; the others wait
        if (final / marker).is_file():
            return final
        # Only the lock holder builds, so any temporary folder of this name is left over
        # from a builder that was killed (SIGKILL skips the cleanup below).
        for stale in root.glob(f".tmp-{name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            builder(tmp)
            if not (tmp / marker).is_file():
                raise RuntimeError(f"builder for {name} did not write {marker}")
            if final.exists():  # left over from an interrupted manual copy: replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# --------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet), in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(sorted(zip(bs, (chr(c) for c in cs))))


def _qwen2_pipeline_tokenizer(vocab: Optional[dict] = None, merges: Optional[list] = None):
    """A bare ``tokenizers.Tokenizer`` with exactly Qwen2Tokenizer's pipeline."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    model = models.BPE(vocab=vocab, merges=merges) if vocab is not None else models.BPE()
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _wrap(vocab: dict[str, int], merges: list):
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    tok = Qwen2Tokenizer(
        vocab=dict(vocab),
        merges=[tuple(m) for m in merges],
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START],
        model_max_length=512,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _base_vocab() -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in _bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    return vocab


def corpus_texts(problems: Sequence[Any], instruction: str) -> list[str]:
    """The warm-start corpus: each rendered prompt followed by its solution and eos."""
    from rllib_exgrpo.envs.prompting import render_prompt

    renderer = _wrap(_base_vocab(), [])  # chat template only; ids unused
    return [
        render_prompt(p.question, tokenizer=renderer, instruction=instruction) + p.solution + IM_END
        for p in problems
    ]


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 512, min_frequency: int = 2,
                    whole_words: Sequence[str] = ()):
    """Train the byte-level BPE on ``texts`` and wrap it as a ``Qwen2Tokenizer``.

    Special tokens are cut out of the texts before training (they are atomic). The vocab is
    laid out as: the 3 special tokens, the 256 bytes in byte order, then one token per merge,
    then ``whole_words``: strings that always encode as one (non-special) token each, matched
    before the BPE sees the text (the operators task's family tags, ``tags=token``).
    """
    from tokenizers import pre_tokenizers, trainers

    splitter = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))

    def pieces():
        for text in texts:
            for piece in splitter.split(text):
                if piece:
                    yield piece

    raw = _qwen2_pipeline_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(pieces(), trainer)
    merges = [tuple(m) if isinstance(m, (list, tuple)) else tuple(m.split(" ")) for m in json.loads(raw.to_str())["model"]["merges"]]
    vocab = _base_vocab()
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = _wrap(vocab, merges)
    if whole_words:
        tok.add_tokens(list(whole_words))
    return tok


def _merges_of(tok) -> list:
    return [list(m) if isinstance(m, (list, tuple)) else m.split(" ") for m in json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]]


def check_tokenizer_stable(saved_tok, folder: str, sample_texts: Sequence[str]):
    """Reload ``folder`` through ``AutoTokenizer`` and raise unless nothing changed.

    Compares ids on ``sample_texts`` (and against a bare ``tokenizers`` pipeline built from the
    same vocab/merges), the vocab, the merges, special tokens/ids and the chat template.
    Returns the reloaded tokenizer.
    """
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    raw = _qwen2_pipeline_tokenizer(saved_tok.get_vocab(), [tuple(m) for m in _merges_of(saved_tok)])
    raw.add_special_tokens(list(SPECIAL_TOKENS))
    raw.add_tokens([t.content for t in saved_tok.added_tokens_decoder.values() if not t.special])
    problems = []
    if type(reloaded).__name__ != "Qwen2Tokenizer":
        problems.append(f"class {type(reloaded).__name__} instead of Qwen2Tokenizer")
    if reloaded.get_vocab() != saved_tok.get_vocab():
        problems.append("vocab differs")
    if _merges_of(reloaded) != _merges_of(saved_tok):
        problems.append("merges differ")
    for attr in ("eos_token", "pad_token", "bos_token", "eos_token_id", "pad_token_id", "all_special_tokens"):
        if getattr(reloaded, attr) != getattr(saved_tok, attr):
            problems.append(f"{attr}: {getattr(saved_tok, attr)!r} -> {getattr(reloaded, attr)!r}")
    if reloaded.chat_template != CHAT_TEMPLATE:
        problems.append("chat template differs")
    for text in sample_texts:
        a = saved_tok(text, add_special_tokens=False)["input_ids"]
        b = reloaded(text, add_special_tokens=False)["input_ids"]
        c = raw.encode(text, add_special_tokens=False).ids
        if not (a == b == c):
            problems.append(f"ids differ on {text[:60]!r}")
        elif reloaded.decode(b) != text:
            problems.append(f"decode does not round-trip {text[:60]!r}")
        if len(problems) > 8:
            break
    if problems:
        raise RuntimeError(
            f"the tiny tokenizer saved in {folder} changes when reloaded with AutoTokenizer: "
            + "; ".join(problems)
        )
    return reloaded


# --------------------------------------------------------------------------- evaluation


def evaluate_pass1(
    model,
    tokenizer,
    problems: Sequence[Any],
    *,
    instruction: Optional[str] = None,
    max_new_tokens: int = 40,
    temperature: float = 1.0,
    batch_size: int = 256,
    seed: int = 0,
    return_texts: bool = False,
) -> dict:
    """Sampled pass@1 (one sample per problem) with per-level rates, on the project's one
    sample-and-score path (``generation.sample_and_score``: the HF backend's sampling at
    ``temperature`` with no top-k / top-p, the verifier of ``ReasoningEnv``).

    Also returns the mean per-token surprisal -log p of the sampled tokens (eos included),
    an unbiased estimate of the sampling distribution's per-token entropy in nats
    (``mean_token_entropy``), and the mean prompt / completion lengths in tokens; with
    ``return_texts`` every completion text, in the order of ``problems``. Does not disturb
    the global torch RNG.
    """
    import torch

    from rllib_exgrpo.envs.prompting import DEFAULT_INSTRUCTION
    from rllib_exgrpo.envs.reasoning_env import ReasoningEnv
    from rllib_exgrpo.generation.base import SamplingParams
    from rllib_exgrpo.generation.hf import HFGenerationBackend
    from rllib_exgrpo.generation.sample_and_score import encode_prompt, sample_and_score, stop_token_ids

    instruction = DEFAULT_INSTRUCTION if instruction is None else instruction
    env = ReasoningEnv({"problems": list(problems), "tokenizer": tokenizer, "instruction": instruction,
                        "max_prompt_chars": 10**9})
    backend = HFGenerationBackend(model, pad_token_id=tokenizer.pad_token_id, batch_size=batch_size,
                                  logprobs_from_generation=True)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            stop_token_ids=stop_token_ids(model, tokenizer), return_logprobs=True)
    was_training = model.training
    model.eval()
    items = []
    prompt_tokens = 0
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            for start in range(0, len(env.problems), batch_size):
                chunk = env.problems[start : start + batch_size]
                prompts = [encode_prompt(tokenizer, env.prompt_for(p.id)) for p in chunk]
                prompt_tokens += sum(len(x) for x in prompts)
                batch = sample_and_score(backend, tokenizer, prompts, [1] * len(chunk), params,
                                         [p.id for p in chunk], env.score)
                items += [(chunk[i.prompt_index], i) for i in batch.items]
    finally:
        model.train(was_training)
        env.close()
    correct = [i.result.score >= 1.0 for _, i in items]
    surprisal = sum(-float(i.completion.logp.sum()) for _, i in items)
    completion_tokens = sum(len(i.completion.token_ids) for _, i in items)
    per_level: dict[str, list[int]] = {}
    for (p, _), ok in zip(items, correct):
        per_level.setdefault(str(p.difficulty), []).append(int(ok))
    n = max(len(correct), 1)
    return {
        "pass1": sum(correct) / n,
        "per_level": {k: sum(v) / len(v) for k, v in sorted(per_level.items())},
        "per_level_n": {k: len(v) for k, v in sorted(per_level.items())},
        "mean_token_entropy": surprisal / max(completion_tokens, 1),
        "mean_prompt_tokens": prompt_tokens / n,
        "mean_completion_tokens": completion_tokens / n,
        "n": len(correct),
        "samples": [i.text for _, i in items[:8]],
        **({"texts": _texts_in_order(env.problems, items)} if return_texts else {}),
    }


def _texts_in_order(problems, items) -> list[str]:
    by_id = {p.id: i.text for p, i in items}
    return [by_id[p.id] for p in problems]


# --------------------------------------------------------------------------- build


def _run_steps(recipe: dict) -> int:
    """Supervised steps this build runs at most: ``max_steps``, or a continued build's own."""
    return recipe["continue"]["steps"] if "continue" in recipe else recipe["max_steps"]


def _lr_at(step: int, recipe: dict) -> float:
    t = recipe["train"]
    warm, total = t["warmup_steps"], _run_steps(recipe)
    if step < warm:
        return t["lr"] * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    floor = t["min_lr_ratio"]
    return t["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def icl_prefixes(problems, recipe: dict, chosen: Optional[dict[int, list[int]]] = None) -> list[str]:
    """The in-context prefix of each warm-start example ("" for most): what makes the
    model able to use XRPO's in-context seeding.

    XRPO seeds a question whose completions all failed by putting a few solved questions
    similar to it before its prompt (BM25 over the question texts, ``xrpo/icl.py``). A model
    never trained on such prompts has no reason to use them (a pretrained LLM has). So a
    ``recipe["icl"]["fraction"]`` share of the warm-start examples get exactly that prefix:
    the ``num_examples`` training questions most similar to it by the same retrieval, with
    their worked solutions, rendered by the same ``format_examples``. Similar arithmetic
    questions share numbers and sub-expressions ("94 - 76 + 73" retrieves "94 - 76 + 12",
    whose solution holds "94 - 76 = 18"), so the examples carry usable information and the
    model can learn to copy it. The choice of examples is seeded by the recipe's seed.

    For the operators task the examples' solutions share the question's guessed table
    (:func:`_operators_icl_draw`): the prefixes here are one such draw, and the warm start
    draws them anew each time an example is used (:func:`_operators_icl_resampler`).
    """
    icl = recipe.get("icl")
    if not icl:
        return [""] * len(problems)
    from rllib_exgrpo.xrpo.icl import Example, format_examples

    chosen = _icl_examples(problems, recipe) if chosen is None else chosen
    if "task" in recipe:
        rng = random.Random(f"tiny-operators-icl-prefixes:{recipe['seed']}")
        return [_operators_icl_draw(problems, i, chosen[i], recipe, rng)[0] if i in chosen else ""
                for i in range(len(problems))]
    return [format_examples([Example(j, problems[j].question, problems[j].solution) for j in chosen[i]],
                            icl["template"]) if i in chosen else ""
            for i in range(len(problems))]


def _icl_examples(problems, recipe: dict) -> dict[int, list[int]]:
    """Which warm-start examples get an in-context prefix, and the indices of the training
    questions it shows (XRPO's retrieval; the example itself excluded), chosen once."""
    from rllib_exgrpo.xrpo.icl import SolvedCorpus

    icl = recipe["icl"]
    corpus = SolvedCorpus(capacity=len(problems), seed=recipe["seed"])
    for i, p in enumerate(problems):
        corpus.add(i, p.question, p.solution)
    rng = random.Random(f"tiny-icl:{recipe['seed']}")
    chosen: dict[int, list[int]] = {}
    for i, p in enumerate(problems):
        if rng.random() >= icl["fraction"]:
            continue
        examples = corpus.retrieve(p.question, k=icl["num_examples"], exclude_ids=[i])
        chosen[i] = [ex.question_id for ex in examples]
    return chosen


def _operators_icl_draw(problems, i: int, shown: Sequence[int], recipe: dict, rng: random.Random) -> tuple[str, str]:
    """One draw of an operators warm-start example with an in-context prefix: the prefix
    text (the ``shown`` questions with worked solutions) and the example's own solution.

    In a family the RL task uses, every meaning the warm start shows is guessed, but within
    one draw the guesses come from *one* table per family, ``meaning[symbol][position]``,
    shared by the prefix and the solution. A prefix example of the same family then shows
    the meanings the solution uses wherever it holds the same symbol at the same position,
    and is worth copying; the next draw has another table, so no family's meanings are
    learned, only the reading of them off the examples: what XRPO's seeding with a solved
    example of the family needs. Known families (``known=N``) show their true meanings, as
    everywhere in the warm start.
    """
    from rllib_exgrpo.envs import operators
    from rllib_exgrpo.xrpo.icl import Example, format_examples

    tables: dict[int, dict[tuple[str, int], str]] = {}

    def solution(p) -> str:
        if _shows_true_meanings(p, recipe):
            return p.solution
        question = operators.parse_question(p.question)
        table = tables.setdefault(p.extra["family"], {})
        meanings = tuple(table.setdefault((symbol, k), rng.choice(operators.MEANINGS))
                         for k, symbol in enumerate(question.symbols))
        return operators.worked_solution(question, meanings)

    own = solution(problems[i])
    prefix = format_examples([Example(j, problems[j].question, solution(problems[j])) for j in shown],
                             recipe["icl"]["template"])
    return prefix, own


def _operators_icl_resampler(problems: Sequence[Any], tokenizer, recipe: dict,
                             chosen: Optional[dict[int, list[int]]] = None):
    """For an operators recipe with ``icl``: a function giving, for the in-context examples
    among a batch's indices, fresh ``(prompt ids, solution ids)`` drawn together
    (:func:`_operators_icl_draw`); ``None`` for any other recipe."""
    if "task" not in recipe or not recipe.get("icl"):
        return None
    from rllib_exgrpo.envs.prompting import render_prompt

    chosen = _icl_examples(problems, recipe) if chosen is None else chosen
    rng = random.Random(f"tiny-operators-icl:{recipe['seed']}")
    format_rng = random.Random(f"tiny-operators-icl-format:{recipe['seed']}")

    def resample(idx) -> dict[int, tuple[list[int], list[int]]]:
        mine = [i for i in idx if i in chosen]
        prompts, solutions = [], []
        for i in mine:
            prefix, own = _operators_icl_draw(problems, i, chosen[i], recipe, rng)
            if "answer_format" in recipe:
                own = with_answer_format(own, format_rng.random() < recipe["answer_format"]["boxed_fraction"], recipe)
            prompts.append(prefix + render_prompt(problems[i].question, tokenizer=tokenizer,
                                                  instruction=recipe["instruction"]))
            solutions.append(own + IM_END)
        if not mine:
            return {}
        p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(solutions, add_special_tokens=False)["input_ids"]
        return {i: (p, c) for i, p, c in zip(mine, p_ids, c_ids)}

    return resample


def _encode_examples(tokenizer, problems, instruction: str, prefixes: Optional[Sequence[str]] = None):
    from rllib_exgrpo.envs.prompting import render_prompt

    prompts = [render_prompt(p.question, tokenizer=tokenizer, instruction=instruction) for p in problems]
    if prefixes is not None:
        prompts = [pre + prompt for pre, prompt in zip(prefixes, prompts)]
    completions = [p.solution + IM_END for p in problems]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    # Prompt and completion tokenised apart must equal the whole text tokenised at once
    # (the prompt ends in "\n", a pre-tokenizer boundary): otherwise training and sampling
    # would see different token sequences.
    for i in range(min(64, len(problems))):
        joint = tokenizer(prompts[i] + completions[i], add_special_tokens=False)["input_ids"]
        if joint != p_ids[i] + c_ids[i]:
            raise RuntimeError(f"prompt/completion tokenisation is not separable on {problems[i].question!r}")
    return p_ids, c_ids


def _batch_indices(problems, batch_size: int, level_balanced: bool, seed: int):
    """Endless batches of example indices: epochs of a seeded shuffle, or (level-balanced)
    each example's level drawn uniformly, then the next example of that level's own
    shuffled cycle (small levels repeat, large ones are not exhausted)."""
    rng = random.Random(f"tiny-warm-start:{seed}")
    groups: dict[Any, list[int]] = {}
    for i, p in enumerate(problems):
        groups.setdefault(p.difficulty if level_balanced else None, []).append(i)
    keys = sorted(groups, key=lambda k: (k is None, k))
    queues: dict[Any, list[int]] = {k: [] for k in keys}

    def draw(key):
        if not queues[key]:
            fresh = list(groups[key])
            rng.shuffle(fresh)
            queues[key] = fresh
        return queues[key].pop()

    while True:
        yield [draw(rng.choice(keys)) for _ in range(batch_size)]


def _collate(p_ids, c_ids, idx, pad_id):
    """Whole supervised sequences (prompt + completion) right-padded; the loss only on
    completion tokens (labels -100 elsewhere, HF's convention)."""
    import torch

    from rllib_exgrpo.core.tokens import right_pad

    seqs = [p_ids[i] + c_ids[i] for i in idx]
    input_ids, mask = right_pad(seqs, pad_id)
    labels = torch.full_like(input_ids, -100)
    for row, i in enumerate(idx):
        labels[row, len(p_ids[i]) : len(seqs[row])] = torch.tensor(c_ids[i])
    return input_ids, mask, labels


def _build_into(folder: Path, recipe: dict, progress: bool) -> dict:
    """Tokenizer, model, supervised warm start to the target pass@1, report; in ``folder``."""
    import torch

    t0 = time.time()
    seed, instruction = recipe["seed"], recipe["instruction"]
    tr, ev = recipe["train"], recipe["eval"]
    train_problems = _task_problems(recipe, "train", tr["n_train"])
    eval_problems = _task_problems(recipe, "test", ev["n_eval"])

    base = _continued_from(folder, recipe)
    if base is None:
        texts = corpus_texts(_tokenizer_corpus(train_problems, recipe), instruction)
        tokenizer = train_tokenizer(texts, **recipe["tokenizer"], whole_words=_whole_words(recipe))
    else:  # a continued build keeps the base's tokenizer: its ids are what the weights know
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    tokenizer.save_pretrained(str(folder))
    _warn_if_busy(tr["num_threads"])

    old_threads = torch.get_num_threads()
    torch.set_num_threads(tr["num_threads"])
    try:
        torch.manual_seed(seed)
        if base is None:
            model = _new_model(recipe, tokenizer)
            model.config.save_pretrained(str(folder))  # so AutoTokenizer resolves the qwen2 class
            tokenizer = check_tokenizer_stable(tokenizer, str(folder),
                                               texts[:200] + [p.question for p in eval_problems[:50]])
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True, dtype=torch.float32)
            model.config.save_pretrained(str(folder))
        run = _warm_start(model, tokenizer, train_problems, eval_problems, recipe, progress, t0)
        model.save_pretrained(str(folder), safe_serialization=True)
    finally:
        torch.set_num_threads(old_threads)

    last_eval = run["last_eval"]
    report = {
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
        "build_threads": tr["num_threads"],
    }
    import warnings

    from rllib_exgrpo.models.pinned_build import PINNED_CAPABILITY

    if report["cpu_capability"] != PINNED_CAPABILITY:
        warnings.warn(
            f"tiny model built with {report['cpu_capability']} CPU kernels, not {PINNED_CAPABILITY}: "
            "its weights will differ from an AVX2 machine's build of the same recipe", RuntimeWarning, stacklevel=3,
        )
    if not run["reached"]:
        if "task" in recipe:
            reached_what = (f"self-consistency {last_eval['operators']['self_consistency']:.3f} < "
                            f"{recipe['task']['target_consistency']:.3f}")
        else:
            read = (last_eval["answer_format"]["pass1_any_format"] if "answer_format" in recipe
                    else last_eval["pass1"])
            reached_what = f"held-out pass@1 {read:.3f} < {recipe['target_pass1'] - ev['band']:.3f}"
        warnings.warn(f"tiny model warm start stopped at max_steps={run['steps']} with {reached_what}",
                      RuntimeWarning, stacklevel=3)
    # written last: its presence marks a complete folder
    with open(folder / WARM_START_FILE, "w") as fh:
        json.dump(report, fh, indent=2)
    return report


def _continued_from(folder: Path, recipe: dict) -> Optional[Path]:
    """The built base folder a continued recipe starts from (a sibling of the folder being
    built: both live in the cache root), or ``None`` for a build from scratch."""
    if "continue" not in recipe:
        return None
    base = folder.parent / recipe["continue"]["from"]
    if not _is_complete(base):
        raise FileNotFoundError(f"continued tiny build: its base model {base} is not built")
    return base


def _new_model(recipe: dict, tokenizer):
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
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    return model


def _warm_start(model, tokenizer, train_problems, eval_problems, recipe: dict, progress: bool, t0: float) -> dict:
    """Supervised steps until the sampled held-out pass@1 reaches the target band (checked
    every ``eval_every`` steps from ``eval_start``) or ``max_steps``."""
    import torch

    tr, ev = recipe["train"], recipe["eval"]
    # which examples carry a prefix, and what it shows: one retrieval pass (BM25 over the
    # training questions, a few minutes for 20,000), shared by the prefixes and the resampler
    chosen = _icl_examples(train_problems, recipe) if recipe.get("icl") else None
    p_ids, c_ids = _encode_examples(tokenizer, train_problems, recipe["instruction"],
                                    icl_prefixes(train_problems, recipe, chosen))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    # fused: ATen's own vectorised AdamW kernel. The default single-tensor path takes its
    # square root through MKL's vector math, whose result differs between Intel and AMD CPUs
    # whatever MKL_CBWR says (measured: see pinned_build); the fused kernel's does not.
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tr["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tr["lr"], betas=tuple(tr["betas"]), fused=True,
    )
    batches = _batch_indices(train_problems, tr["batch_size"], tr["level_balanced"], recipe["seed"])
    resample = _solution_resampler(train_problems, tokenizer, recipe)
    icl_resample = _operators_icl_resampler(train_problems, tokenizer, recipe, chosen)
    history: list[dict] = []
    target_low = recipe["target_pass1"] - ev["band"]
    last_eval: Optional[dict] = None
    reached = False
    step = 0
    model.train()
    total = _run_steps(recipe)
    # a continued build runs all of its steps: its start already met the stop
    may_stop = "continue" not in recipe
    bar = _progress_bar(total, progress)
    try:
        while step < total:
            idx = next(batches)
            # in-context rows: prompt and solution drawn together (one table per family)
            icl_rows = icl_resample(idx) if icl_resample is not None else {}
            for i, (prompt, solution) in icl_rows.items():
                p_ids[i], c_ids[i] = prompt, solution
            rest = [i for i in idx if i not in icl_rows]
            if resample is not None and rest:
                for i, ids in zip(rest, resample(rest)):
                    c_ids[i] = ids
            input_ids, mask, labels = _collate(p_ids, c_ids, idx, tokenizer.pad_token_id)
            for g in optim.param_groups:
                g["lr"] = _lr_at(step, recipe)
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
                last_eval = _eval(model, tokenizer, eval_problems, recipe, step)
                history.append({"step": step, "loss": round(loss.item(), 4), "pass1": last_eval["pass1"],
                                "mean_token_entropy": round(last_eval["mean_token_entropy"], 4),
                                "per_level": last_eval["per_level"], "elapsed_s": round(time.time() - t0, 1)})
                postfix["pass1"] = f"{last_eval['pass1']:.2f}"
                if "task" in recipe:
                    consistency = last_eval["operators"]["self_consistency"]
                    history[-1]["self_consistency"] = round(consistency, 4)
                    postfix["consistent"] = f"{consistency:.2f}"
                    reached = consistency >= recipe["task"]["target_consistency"]
                elif "answer_format" in recipe:
                    figures = last_eval["answer_format"]
                    history[-1]["pass1_any_format"] = round(figures["pass1_any_format"], 4)
                    history[-1]["boxed_share"] = round(figures["boxed_share"], 4)
                    postfix["any_format"] = f"{figures['pass1_any_format']:.2f}"
                    reached = figures["pass1_any_format"] >= target_low
                else:
                    reached = last_eval["pass1"] >= target_low
            bar.set_postfix(postfix)
            if due and isinstance(bar, _LineProgress):
                bar.print_line()  # each check's figures, not only every tenth of the steps
            if reached and may_stop:
                break
    finally:
        bar.close()
    if last_eval is None:
        last_eval = _eval(model, tokenizer, eval_problems, recipe, step)
    return {"steps": step, "reached": reached, "last_eval": last_eval, "history": history}


def _warn_if_busy(num_threads: int) -> None:
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
            num_threads, load, cores,
        )


def _eval(model, tokenizer, problems, recipe, step):
    ev = recipe["eval"]
    out = evaluate_pass1(
        model, tokenizer, problems, instruction=recipe["instruction"], max_new_tokens=ev["max_new_tokens"],
        temperature=ev["temperature"], batch_size=ev["batch_size"], seed=recipe["seed"] * 100_003 + step,
        return_texts="task" in recipe or "answer_format" in recipe,
    )
    texts = out.pop("texts", None)
    if "task" in recipe:
        out["operators"] = operators_warm_start_figures(problems, texts)
    if "answer_format" in recipe:
        out["answer_format"] = answer_format_figures(problems, texts)
    return out


def answer_format_figures(problems: Sequence[Any], completions: Sequence[str]) -> dict:
    """A format-weak warm start's two halves, from one sampled completion per held-out
    problem: ``pass1_any_format`` (the final answer right, boxed or not: its arithmetic,
    what the build's stop reads) and ``boxed_share`` (answers boxed: what the verifier
    needs), with ``pass1_any_format`` by level."""
    right, boxed, per_level = 0, 0, {}
    for p, text in zip(problems, completions):
        answer, is_boxed = read_final_answer(text)
        ok = answer is not None and answer == str(p.ground_truth).strip()
        right += ok
        boxed += is_boxed
        per_level.setdefault(str(p.difficulty), []).append(int(ok))
    n = max(len(completions), 1)
    return {"pass1_any_format": right / n, "boxed_share": boxed / n,
            "per_level_any_format": {k: sum(v) / len(v) for k, v in sorted(per_level.items())}}


def operators_warm_start_figures(problems: Sequence[Any], completions: Sequence[str]) -> dict:
    """What an operators warm start must and must not know, from one sampled completion per
    held-out problem: ``self_consistency`` (share of well-formed solutions with right
    arithmetic under their own meanings), ``meaning_shares`` (how often each meaning was
    chosen among them: uniform guessing gives 1/3 each), and the exact uniform-guessing
    pass@1 by chain length (``guessing_pass1``), the level pass@1 should sit at."""
    from rllib_exgrpo.envs import operators

    consistent, chosen = 0, {m: 0 for m in operators.MEANINGS}
    guess: dict[str, list[float]] = {}
    for p, text in zip(problems, completions):
        used = operators.read_worked_solution(p, text)
        if used is not None:
            consistent += 1
            for m in used:
                chosen[m] += 1
        guess.setdefault(str(p.difficulty), []).append(operators.guessing_rate(p, int(p.ground_truth)))
    total = max(sum(chosen.values()), 1)
    return {
        "self_consistency": consistent / max(len(completions), 1),
        "meaning_shares": {m: round(c / total, 4) for m, c in chosen.items()},
        "guessing_pass1": {k: round(sum(v) / len(v), 4) for k, v in sorted(guess.items())},
    }


def _tokenizer_corpus(problems: Sequence[Any], recipe: dict) -> list:
    """The problems whose texts train the tokenizer: for the operators task with one set of
    guessed meanings each (the true ones are never in the warm-start data); for a
    format-weak recipe with each answer's format drawn once, so both formats are in it."""
    import dataclasses

    if "task" in recipe:
        from rllib_exgrpo.envs import operators

        rng = random.Random(f"tiny-operators-corpus:{recipe['seed']}")
        problems = [p if _shows_true_meanings(p, recipe) else
                    dataclasses.replace(p, solution=operators.random_meaning_solution(p, rng)) for p in problems]
    if "answer_format" in recipe:
        rng = random.Random(f"tiny-answer-format-corpus:{recipe['seed']}")
        fraction = recipe["answer_format"]["boxed_fraction"]
        problems = [dataclasses.replace(p, solution=with_answer_format(p.solution, rng.random() < fraction, recipe))
                    for p in problems]
    return list(problems)


def _solution_resampler(problems: Sequence[Any], tokenizer, recipe: dict):
    """A function giving fresh solution ids for a batch of example indices, drawn anew every
    time so no question gets a fixed answer: for the operators task guessed meanings, for a
    format-weak recipe the answer's format; ``None`` when neither applies (the arithmetic
    task's solutions are fixed)."""
    if "task" not in recipe and "answer_format" not in recipe:
        return None
    from rllib_exgrpo.envs import operators

    rng = random.Random(f"tiny-operators-solutions:{recipe['seed']}")
    format_rng = random.Random(f"tiny-answer-format:{recipe['seed']}")

    def solution(p):
        if "task" in recipe and not _shows_true_meanings(p, recipe):
            text = operators.random_meaning_solution(p, rng)
        else:
            text = p.solution
        if "answer_format" in recipe:
            text = with_answer_format(text, format_rng.random() < recipe["answer_format"]["boxed_fraction"], recipe)
        return text

    def resample(idx):
        texts = [solution(problems[i]) + IM_END for i in idx]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return resample


def _progress_bar(total: int, enabled: bool):
    """A tqdm bar on a terminal; elsewhere (a Ray actor's forwarded log, a file) one line
    per tenth of the steps, since every bar refresh would become a line of its own."""
    import sys

    from tqdm.auto import tqdm

    if enabled and not sys.stderr.isatty():
        return _LineProgress(total, "warm-starting tiny model")
    return tqdm(total=total, desc="warm-starting tiny model", unit="step", disable=not enabled, dynamic_ncols=True)


class _LineProgress:
    """The subset of tqdm's interface the warm start uses, printing a line every 10%."""

    def __init__(self, total: int, desc: str):
        import time

        self.total, self.desc, self.n, self.postfix = total, desc, 0, {}
        self._every = max(1, total // 10)
        self._start = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self._every == 0 or self.n == self.total:
            self._print()

    def set_postfix(self, postfix=None, **kwargs) -> None:
        self.postfix = dict(postfix or {}, **kwargs)

    def print_line(self) -> None:
        self._print()

    def _print(self) -> None:
        import sys
        import time

        extra = ", ".join(f"{k}={v}" for k, v in self.postfix.items())
        print(f"{self.desc}: {self.n}/{self.total} steps, {time.perf_counter() - self._start:.0f} s"
              + (f" ({extra})" if extra else ""), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.n % self._every:
            self._print()


def _versions() -> dict:
    import tokenizers
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def build_tiny_model(
    cache_dir: Optional[str] = None,
    *,
    seed: int = 0,
    target_pass1: float = 0.35,
    levels: Sequence[int] = (1, 2, 3, 4),
    max_steps: int = 1500,
    progress: bool = True,
    overrides: Optional[dict] = None,
    icl_fraction: float = 0.0,
    task: str = "arithmetic",
    known_families: int = 0,
    tag_tokens: bool = False,
    boxed_fraction: float = 1.0,
    continue_steps: int = 0,
) -> str:
    """Build (once) and return the folder of the warm-started tiny model.

    The folder loads offline with ``AutoModelForCausalLM.from_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)`` and holds ``warm_start.json`` (recipe, steps,
    wall time, held-out pass@1 overall and per level, mean token entropy, history).

    Args:
        cache_dir: Cache root; default ``$RLLIB_EXGRPO_CACHE`` or ``~/.cache/rllib_exgrpo``.
        seed: Seeds the training data, initialisation, batch order and evaluation sampling.
        target_pass1: Training stops at the first held-out evaluation with pass@1 at
            temperature 1 >= ``target_pass1 - 0.05`` (the ``eval.band`` of the recipe).
        levels: Arithmetic difficulty levels trained and evaluated on.
        max_steps: Hard stop (also the length of the cosine learning-rate schedule).
        progress: Show a tqdm progress bar while building.
        overrides: Nested recipe overrides, see :func:`tiny_recipe`.
        icl_fraction: Share of warm-start examples with worked examples before the question
            (:func:`icl_prefixes`); 0, the default, trains on bare prompts only.
        task: ``"arithmetic"`` or ``"operators"`` (see :func:`tiny_recipe`).
        known_families: operators only: extra families shown with their true meanings
            (see :func:`tiny_recipe`).
        tag_tokens: operators only: one token per family tag (see :func:`tiny_recipe`).
        boxed_fraction: < 1 for a format-weak warm start that boxes about that share of its
            answers (see :func:`tiny_recipe`).
        continue_steps: > 0 to continue the build of the same arguments without
            ``icl_fraction`` and ``continue_steps`` (built first if missing) for that many
            steps (see :func:`tiny_recipe`).

    Returns:
        The folder path. A second call with the same recipe returns at once; concurrent
        callers wait for a single build.
    """
    # what a continued build's base shares with it (everything but icl and continue)
    base_args = dict(seed=seed, target_pass1=target_pass1, levels=levels, max_steps=max_steps,
                     overrides=overrides, task=task, known_families=known_families,
                     tag_tokens=tag_tokens, boxed_fraction=boxed_fraction)
    recipe = tiny_recipe(**base_args, icl_fraction=icl_fraction, continue_steps=continue_steps)
    name = f"tiny-{recipe_key(recipe)}"
    if continue_steps:  # the base first, in the same cache root (the build reads it there)
        build_tiny_model(cache_dir, progress=progress, **base_args)
    root = cache_root(cache_dir)
    took_shipped = []

    def builder(tmp: Path):
        from rllib_exgrpo.models import shipped
        from rllib_exgrpo.models.pinned_build import build_in_pinned_process

        if shipped.shipped_folder(name) is not None and not shipped.rebuild_requested():
            try:
                shipped.copy_verified(name, tmp)
                took_shipped.append(True)
                return
            except shipped.ShippedModelMismatch as exc:
                import warnings

                warnings.warn(f"{exc}: building the model from its recipe instead (minutes)",
                              RuntimeWarning, stacklevel=4)
                for leftover in tmp.iterdir():
                    leftover.unlink()
        build_in_pinned_process(tmp, recipe, progress)

    folder = build_cached(root, name, builder)
    if took_shipped:
        import sys

        print(f"rllib-exgrpo: tiny model {name}: copied the build shipped with the package "
              f"(sha256 verified) to {folder} ({_REBUILD_HINT})", file=sys.stderr, flush=True)
    return str(folder)


_REBUILD_HINT = "RLLIB_EXGRPO_REBUILD_MODEL=1 on an empty cache builds it from its recipe instead"


def read_warm_start(path: str) -> dict:
    """The ``warm_start.json`` report of a built tiny model folder."""
    with open(os.path.join(path, WARM_START_FILE)) as fh:
        return json.load(fh)


def load_tiny_model(path: Optional[str] = None, **build_kwargs):
    """``(model, tokenizer)`` of a tiny model folder (built with ``build_kwargs`` if no path)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = path or build_tiny_model(**build_kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer
