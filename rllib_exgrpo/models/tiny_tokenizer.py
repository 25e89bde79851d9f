"""The tiny model's tokenizer: a byte-level BPE with exactly Qwen2's pre-tokenization.

A byte-level BPE trained offline (``tokenizers``) on the arithmetic corpus (rendered prompts
+ worked solutions) with *exactly* the Qwen2 pre-tokenization pipeline (NFC, the Qwen2 split
regex that isolates each digit, ByteLevel), wrapped in ``Qwen2Tokenizer``. For
``model_type=qwen2`` ``AutoTokenizer`` rebuilds a ``Qwen2Tokenizer`` with that pipeline
whatever the saved files say, so a BPE trained with any other pipeline would silently change
ids on reload; :func:`check_tokenizer_stable` reloads a saved folder through
``AutoTokenizer`` and raises unless ids, vocab, merges, special tokens and the chat template
are unchanged. Special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>``
(eos) and a small ChatML chat template.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Optional, Sequence

from rllib_exgrpo.envs.prompting import render_prompt

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


def wrap_tokenizer(vocab: dict[str, int], merges: list):
    """A ``Qwen2Tokenizer`` of ``vocab`` and ``merges`` with the tiny model's special tokens
    and chat template."""
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


def base_vocab() -> dict[str, int]:
    """The vocab every tiny tokenizer starts with: the special tokens, then the 256 bytes."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in _bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    return vocab


def corpus_texts(problems: Sequence[Any], instruction: str) -> list[str]:
    """The warm-start corpus: each rendered prompt followed by its solution and eos."""
    renderer = wrap_tokenizer(base_vocab(), [])  # chat template only; ids unused
    return [render_prompt(p.question, tokenizer=renderer, instruction=instruction) + p.solution + IM_END for p in problems]


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 512, min_frequency: int = 2, whole_words: Sequence[str] = ()):
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
    vocab = base_vocab()
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = wrap_tokenizer(vocab, merges)
    if whole_words:
        tok.add_tokens(list(whole_words))
    return tok


def merges_of(tok) -> list:
    """The BPE merges of a fast tokenizer, as ``[left, right]`` pairs."""
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    return [list(m) if isinstance(m, (list, tuple)) else m.split(" ") for m in merges]


def check_tokenizer_stable(saved_tok, folder: str, sample_texts: Sequence[str]):
    """Reload ``folder`` through ``AutoTokenizer`` and raise unless nothing changed.

    Compares ids on ``sample_texts`` (and against a bare ``tokenizers`` pipeline built from the
    same vocab/merges), the vocab, the merges, special tokens/ids and the chat template.
    Returns the reloaded tokenizer.
    """
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    raw = _qwen2_pipeline_tokenizer(saved_tok.get_vocab(), [tuple(m) for m in merges_of(saved_tok)])
    raw.add_special_tokens(list(SPECIAL_TOKENS))
    raw.add_tokens([t.content for t in saved_tok.added_tokens_decoder.values() if not t.special])
    problems = []
    if type(reloaded).__name__ != "Qwen2Tokenizer":
        problems.append(f"class {type(reloaded).__name__} instead of Qwen2Tokenizer")
    if reloaded.get_vocab() != saved_tok.get_vocab():
        problems.append("vocab differs")
    if merges_of(reloaded) != merges_of(saved_tok):
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
        raise RuntimeError(f"the tiny tokenizer saved in {folder} changes when reloaded with AutoTokenizer: " + "; ".join(problems))
    return reloaded
