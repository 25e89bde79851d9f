"""Benchmark evaluation of a policy: avg@k, pass@k and maj@k per data source.

Settings follow the ExGRPO / LUFFY papers (docs/ALGORITHMS.md, section 2): sampling
at temperature 0.6, top_p 1.0; AIME and AMC are scored as avg@32 (32 samples per
question), every other benchmark as avg@1. A data source gets 32 samples when its name
contains ``aime`` or ``amc`` (case-insensitive), 1 otherwise; ``k=`` overrides this.

What is evaluated (``model=``):

- a model name or path understood by :func:`rllib_exgrpo.models.resolve_model_path`
  (``"tiny"``, ``"smollm2"``, an HF folder or hub name);
- an RLlib checkpoint folder of this project's algorithms (ExGRPO / GRPO): the folder
  ``algo.save_to_path`` or Tune wrote, or a Tune trial folder (its latest
  ``checkpoint_*``), or the module folder itself. See :func:`load_policy_from_checkpoint`;
- an already loaded ``(model, tokenizer)`` pair.

Prompts are rendered by :class:`envs.ReasoningEnv` (the renderer the policy was trained
with) and completions scored by its verifier (``ReasoningEnv.score`` ->
``envs.rewards.score_batch``); generation uses :class:`HFGenerationBackend`, the
backend of the training env runners.

Metrics, per question with ``n`` samples of which ``c`` are correct:

- ``avg@k``: mean correctness of the k samples (the papers' accuracy);
- ``pass@j``: the unbiased estimator ``1 - C(n-c, j) / C(n, j)`` (Chen et al. 2021),
  for each ``j`` of ``pass_ks`` with ``j <= n``;
- ``maj@k``: correctness of the majority answer among the parsed answers of the k
  samples (ties go to the answer seen first; samples without an answer do not vote; no
  answer at all counts as wrong). Answers vote by their text with whitespace removed.

A source's figure is the mean over its questions. The overall row is the mean over all
questions; ``macro_avg_at_k`` is the unweighted mean of the sources' avg@k (the papers'
"avg" column over benchmarks).
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import pickle
import re
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

logger = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 0.6
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_NEW_TOKENS = 1024
DEFAULT_BATCH_SIZE = 64
#: Samples per question for the small competition benchmarks (the papers' avg@32).
MULTI_SAMPLE_K = 32
MULTI_SAMPLE_MARKERS = ("aime", "amc")
#: Default ``pass_ks``: pass@1 and pass@k, ``"k"`` standing for a source's own k.
DEFAULT_PASS_KS: Tuple[Union[int, str], ...] = (1, "k")
REPORT_VERSION = 1

_UNSET: Any = object()

__all__ = [
    "CheckpointInfo",
    "EvalDataError",
    "EvalReport",
    "QuestionResult",
    "aggregate",
    "avg_at_k",
    "default_k",
    "evaluate",
    "find_checkpoint",
    "is_checkpoint",
    "load_eval_problems",
    "load_policy_from_checkpoint",
    "maj_at_k",
    "pass_at_k",
    "read_checkpoint",
]


class EvalDataError(ValueError):
    """A benchmark source that cannot be loaded; the message is one line (for a malformed
    row: ``path:line: reason``, as :class:`envs.DataFormatError`)."""


# =========================================================================== metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate ``1 - C(n-c, k) / C(n, k)`` from ``n`` samples, ``c`` correct.

    Computed in the numerically stable product form ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``
    (no huge binomials). Raises ``ValueError`` when ``k > n`` (not estimable), ``k < 1``,
    or ``c`` is outside ``[0, n]``.
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per question, got n={n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def avg_at_k(correct: Sequence[Union[bool, float]], k: Optional[int] = None) -> float:
    """Mean correctness of the first ``k`` samples (all of them when ``k`` is None)."""
    flags = list(correct)
    if k is not None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if k > len(flags):
            raise ValueError(f"avg@{k} needs {k} samples, got {len(flags)}")
        flags = flags[:k]
    if not flags:
        raise ValueError("avg@k of no samples")
    return float(sum(float(f) for f in flags) / len(flags))


def _vote_key(answer: Optional[str]) -> Optional[str]:
    if answer is None:
        return None
    key = "".join(str(answer).split())
    return key or None


def maj_at_k(answers: Sequence[Optional[str]], correct_flags: Sequence[Union[bool, float]],
             k: Optional[int] = None) -> float:
    """1.0 when the majority answer of the first ``k`` samples is correct, else 0.0.

    ``answers[i]`` is the parsed answer of sample ``i`` (None: no answer; it does not
    vote) and ``correct_flags[i]`` its verdict. Answers vote by their text with whitespace
    removed; a tie goes to the answer that appeared first. The winner's correctness is
    that of its first sample. No answer at all gives 0.0.
    """
    if len(answers) != len(correct_flags):
        raise ValueError(f"{len(answers)} answers but {len(correct_flags)} correctness flags")
    if k is None:
        k = len(answers)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > len(answers):
        raise ValueError(f"maj@{k} needs {k} samples, got {len(answers)}")
    counts: "OrderedDict[str, list]" = OrderedDict()  # key -> [votes, first index]
    for i in range(k):
        key = _vote_key(answers[i])
        if key is None:
            continue
        if key in counts:
            counts[key][0] += 1
        else:
            counts[key] = [1, i]
    if not counts:
        return 0.0
    best = max(counts.values(), key=lambda v: (v[0], -v[1]))
    return 1.0 if float(correct_flags[best[1]]) >= 1.0 else 0.0


def default_k(data_source: str) -> int:
    """32 for data sources whose name contains ``aime`` or ``amc``, else 1 (the papers')."""
    name = data_source.lower()
    return MULTI_SAMPLE_K if any(m in name for m in MULTI_SAMPLE_MARKERS) else 1


def resolve_k(data_source: str, k: Union[None, int, Mapping[str, int]]) -> int:
    """Samples per question for ``data_source``: ``k`` itself when an int; for a mapping its
    entry for the data source (exact name first, then the first key contained in the name,
    case-insensitive); otherwise :func:`default_k`."""
    if k is None:
        return default_k(data_source)
    if isinstance(k, Mapping):
        if data_source in k:
            value = k[data_source]
        else:
            low = data_source.lower()
            value = next((v for key, v in k.items() if str(key).lower() in low), None)
            if value is None:
                return default_k(data_source)
    else:
        value = k
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"k must be a positive int, got {value!r} for {data_source!r}")
    return value


def _pass_ks_for(pass_ks: Sequence[Union[int, str]], k: int) -> List[int]:
    out: List[int] = []
    for j in pass_ks:
        j = k if j == "k" else j
        if isinstance(j, bool) or not isinstance(j, int) or j < 1:
            raise ValueError(f"pass_ks entries must be positive ints or 'k', got {j!r}")
        if j not in out:
            out.append(j)
    return sorted(out)


# =========================================================================== results


@dataclass
class QuestionResult:
    """Every sample of one question."""

    id: str
    data_source: str
    source: str  # the spec / file it came from
    correct: List[bool]
    answers: List[Optional[str]]
    response_tokens: List[int]
    truncated: List[bool]
    unscored: int = 0  # verifier errors (counted as wrong)
    timed_out: int = 0
    prompt_tokens: int = 0
    difficulty: Optional[int] = None
    completions: Optional[List[str]] = None

    @property
    def n(self) -> int:
        return len(self.correct)

    @property
    def num_correct(self) -> int:
        return int(sum(self.correct))

    def to_dict(self) -> dict:
        d = {
            "id": self.id,
            "data_source": self.data_source,
            "source": self.source,
            "difficulty": self.difficulty,
            "prompt_tokens": self.prompt_tokens,
            "n": self.n,
            "num_correct": self.num_correct,
            "correct": [bool(c) for c in self.correct],
            "answers": list(self.answers),
            "response_tokens": list(self.response_tokens),
            "truncated": [bool(t) for t in self.truncated],
            "unscored": self.unscored,
            "timed_out": self.timed_out,
        }
        if self.completions is not None:
            d["completions"] = list(self.completions)
        return d


def aggregate(questions: Sequence[QuestionResult], pass_ks: Sequence[Union[int, str]] = DEFAULT_PASS_KS) -> dict:
    """Metrics of a set of questions (each question's k is its number of samples).

    Returns a dict with ``k`` (None when the questions have different k), ``n_questions``,
    ``samples``, ``avg_at_k``, ``pass_at_k`` ({str(j): value}, for each j of ``pass_ks``
    with the mean over questions that have at least j samples), ``maj_at_k``,
    ``mean_response_tokens``, ``truncated_fraction``, ``unscored``, ``timed_out``, and
    ``metrics``: the same figures under their usual names (``avg@32``, ``pass@1``...).
    """
    if not questions:
        raise ValueError("no questions to aggregate")
    ks = sorted({q.n for q in questions})
    k = ks[0] if len(ks) == 1 else None
    js = sorted({j for q in questions for j in _pass_ks_for(pass_ks, q.n)})
    pass_at: Dict[str, float] = {}
    for j in js:
        vals = [pass_at_k(q.n, q.num_correct, j) for q in questions if q.n >= j]
        if vals:
            pass_at[str(j)] = float(sum(vals) / len(vals))
    avg = float(sum(avg_at_k(q.correct) for q in questions) / len(questions))
    maj = float(sum(maj_at_k(q.answers, q.correct) for q in questions) / len(questions))
    lengths = [n for q in questions for n in q.response_tokens]
    truncated = [t for q in questions for t in q.truncated]
    label = str(k) if k is not None else "k"
    metrics = {f"avg@{label}": avg, **{f"pass@{j}": v for j, v in pass_at.items()}, f"maj@{label}": maj}
    return {
        "k": k,
        "n_questions": len(questions),
        "samples": len(lengths),
        "avg_at_k": avg,
        "pass_at_k": pass_at,
        "maj_at_k": maj,
        "mean_response_tokens": float(sum(lengths) / len(lengths)) if lengths else 0.0,
        "truncated_fraction": float(sum(truncated) / len(truncated)) if truncated else 0.0,
        "unscored": int(sum(q.unscored for q in questions)),
        "timed_out": int(sum(q.timed_out for q in questions)),
        "metrics": metrics,
    }


@dataclass
class EvalReport:
    """Result of :func:`evaluate`.

    Attributes:
        model: What was evaluated (name, path or checkpoint folder).
        settings: Sampling and prompt settings (temperature, top_p, max_new_tokens, seed...).
        sources: data source name -> :func:`aggregate` dict (plus ``wall_time_s``).
        overall: :func:`aggregate` over every question, plus ``macro_avg_at_k``.
        wall_time_s: Whole evaluation, model loading included.
        questions: Every question's samples.
    """

    model: str
    settings: dict
    sources: Dict[str, dict]
    overall: dict
    wall_time_s: float
    questions: List[QuestionResult] = field(default_factory=list)
    created: str = field(default_factory=lambda: _dt.datetime.now().isoformat(timespec="seconds"))

    def to_dict(self, *, include_questions: bool = True) -> dict:
        d = {
            "version": REPORT_VERSION,
            "created": self.created,
            "model": self.model,
            "settings": self.settings,
            "sources": self.sources,
            "overall": self.overall,
            "wall_time_s": self.wall_time_s,
        }
        if include_questions:
            d["questions"] = [q.to_dict() for q in self.questions]
        return d

    def to_json(self, path: Union[str, os.PathLike], *, include_questions: bool = True) -> str:
        """Write the report as JSON (parent folders created); returns the path."""
        path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(include_questions=include_questions), fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
        return path

    def table(self) -> str:
        """A plain-text table: one row per data source, then overall and macro average.
        Accuracies in percent; ``pass@k`` is at each source's own k."""
        pass_cols = [j for j in self.settings.get("pass_ks", DEFAULT_PASS_KS)]
        pass_cols = list(dict.fromkeys(pass_cols))
        header = ["source", "k", "questions", "samples", "avg@k"] + [f"pass@{j}" for j in pass_cols] + \
                 ["maj@k", "resp.tok", "trunc%", "time s"]

        def pct(x: Optional[float]) -> str:
            return "-" if x is None else f"{100.0 * x:.1f}"

        def row(name: str, m: dict, seconds: Optional[float]) -> List[str]:
            k = m.get("k")
            cells = [name, "mixed" if k is None else str(k), str(m["n_questions"]), str(m["samples"]),
                     pct(m["avg_at_k"])]
            for j in pass_cols:
                jj = k if j == "k" else j
                cells.append(pct(m["pass_at_k"].get(str(jj))) if jj is not None else "-")
            cells += [pct(m["maj_at_k"]), f"{m['mean_response_tokens']:.1f}",
                      f"{100.0 * m['truncated_fraction']:.1f}", "-" if seconds is None else f"{seconds:.1f}"]
            return cells

        rows = [row(name, m, m.get("wall_time_s")) for name, m in self.sources.items()]
        rows.append(row("overall", self.overall, self.wall_time_s))
        if len(self.sources) > 1:
            macro = ["macro avg", "", "", "", pct(self.overall.get("macro_avg_at_k"))]
            macro += [""] * (len(header) - len(macro))
            rows.append(macro)
        widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

        def fmt(cells):
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

        rule = "-" * len(fmt(header))
        s = self.settings
        lines = [
            f"model: {self.model}",
            f"temperature {s.get('temperature')}  top_p {s.get('top_p')}  max_new_tokens {s.get('max_new_tokens')}"
            f"  seed {s.get('seed')}  (accuracies in %)",
            rule, fmt(header), rule,
        ]
        lines += [fmt(r) for r in rows[: len(self.sources)]]
        lines.append(rule)
        lines += [fmt(r) for r in rows[len(self.sources):]]
        unscored = self.overall.get("unscored", 0)
        if unscored:
            lines.append(f"note: {unscored} sample(s) could not be verified (verifier error) and count as wrong")
        return "\n".join(lines)


# =========================================================================== checkpoints


@dataclass
class CheckpointInfo:
    """Where the pieces of an RLlib checkpoint of this project are.

    Attributes:
        path: The algorithm checkpoint folder (None when only a module folder was given).
        module_path: The RLModule folder with the policy weights.
        config: The algorithm config as saved (``AlgorithmConfig.get_state()``), or {}.
        model_config: The module's ``model_config`` (``model``, ``dtype``, ...).
        algorithm: Name of the algorithm class (``"ExGRPO"``, ``"GRPO"``) when known.
    """

    path: Optional[str]
    module_path: str
    config: dict
    model_config: dict
    algorithm: Optional[str] = None

    @property
    def model_name_or_path(self) -> str:
        return self.model_config.get("model") or self.config.get("model_name_or_path")

    @property
    def env_config(self) -> dict:
        return dict(self.config.get("env_config") or {})


_CKPT_NUM = re.compile(r"checkpoint_(\d+)$")
_MODULE_ID = "default_policy"


def _is_module_dir(p: Path) -> bool:
    return (p / "class_and_ctor_args.pkl").is_file() and any(p.glob("module_state.*"))


def _is_algo_dir(p: Path) -> bool:
    return (p / "rllib_checkpoint.json").is_file() and (p / "learner_group").is_dir()


def _latest_checkpoint(p: Path) -> Optional[Path]:
    found = []
    for child in p.iterdir() if p.is_dir() else []:
        m = _CKPT_NUM.search(child.name)
        if m and child.is_dir() and _is_algo_dir(child):
            found.append((int(m.group(1)), child))
    return max(found)[1] if found else None


def find_checkpoint(path: Union[str, os.PathLike]) -> Tuple[Optional[Path], Path]:
    """(algorithm checkpoint folder or None, module folder) for ``path``.

    ``path`` may be an algorithm checkpoint (``algo.save_to_path`` / Tune's
    ``checkpoint_*``), a Tune trial folder (its highest-numbered ``checkpoint_*`` is used),
    or an RLModule folder (``.../learner_group/learner/rl_module/default_policy``).
    Raises ``FileNotFoundError`` when ``path`` is none of these.
    """
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"not a checkpoint folder: {p}")
    algo = p if _is_algo_dir(p) else _latest_checkpoint(p)
    if algo is None:
        if _is_module_dir(p):
            return None, p
        raise FileNotFoundError(
            f"{p} is not an RLlib checkpoint of this project: expected rllib_checkpoint.json and "
            "learner_group/ (algo.save_to_path), checkpoint_* subfolders (a Tune trial), or a module folder"
        )
    rl_module = algo / "learner_group" / "learner" / "rl_module"
    candidates = [rl_module / _MODULE_ID] + sorted(c for c in rl_module.glob("*") if c.is_dir())
    for c in candidates:
        if _is_module_dir(c):
            return algo, c
    raise FileNotFoundError(f"checkpoint {algo} holds no learner module state under {rl_module}")


def is_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a folder :func:`find_checkpoint` understands."""
    try:
        find_checkpoint(path)
        return True
    except (FileNotFoundError, OSError):
        return False


def _read_pickle(path: Path) -> Any:
    with open(path, "rb") as fh:
        return pickle.load(fh)


def read_checkpoint(path: Union[str, os.PathLike]) -> CheckpointInfo:
    """Locate a checkpoint's module and read its algorithm config (no weights loaded)."""
    algo_dir, module_dir = find_checkpoint(path)
    config: dict = {}
    algorithm = None
    if algo_dir is not None and (algo_dir / "class_and_ctor_args.pkl").is_file():
        ctor = _read_pickle(algo_dir / "class_and_ctor_args.pkl")
        algorithm = getattr(ctor.get("class"), "__name__", None)
        args = ctor.get("ctor_args_and_kwargs", ((), {}))[0]
        if args and isinstance(args[0], dict):
            config = args[0]
        elif args and hasattr(args[0], "to_dict"):
            config = args[0].to_dict()
    module_ctor = _read_pickle(module_dir / "class_and_ctor_args.pkl")
    kwargs = module_ctor.get("ctor_args_and_kwargs", ((), {}))[1]
    model_config = dict(kwargs.get("model_config") or {})
    if not model_config.get("model"):
        if not config.get("model_name_or_path"):
            raise ValueError(f"checkpoint {path} names no model (module model_config: {model_config})")
        model_config.update(model=config["model_name_or_path"], dtype=config.get("model_dtype", "float32"))
    return CheckpointInfo(
        path=str(algo_dir) if algo_dir is not None else None,
        module_path=str(module_dir),
        config=config,
        model_config=model_config,
        algorithm=algorithm,
    )


def _load_module_state(module_dir: Path) -> dict:
    pkl = module_dir / "module_state.pkl"
    if pkl.is_file():
        return _read_pickle(pkl)
    packed = module_dir / "module_state.msgpack"
    if packed.is_file():
        from ray.rllib.utils.checkpoints import try_import_msgpack

        msgpack = try_import_msgpack(error=True)
        with open(packed, "rb") as fh:
            return msgpack.load(fh, strict_map_key=False)
    raise FileNotFoundError(f"no module_state.pkl / .msgpack in {module_dir}")


def load_policy_from_checkpoint(path: Union[str, os.PathLike], *, device: Optional[str] = None,
                                info: Optional[CheckpointInfo] = None):
    """``(model, tokenizer)`` of the policy saved in an RLlib checkpoint of this project.

    The HF model named by the checkpoint (module ``model_config['model']``, i.e. the config's
    ``model_name_or_path``) is loaded and the learner's module weights are put into it;
    the tokenizer is that model's. The model is in eval mode with the KV cache on.
    """
    import torch

    from rllib_exgrpo.rllib.env_runner import load_tokenizer
    from rllib_exgrpo.rllib.module import load_causal_lm

    info = info or read_checkpoint(path)
    model = load_causal_lm({**info.model_config, "gradient_checkpointing": False})
    state = _load_module_state(Path(info.module_path))
    prefix = "model."
    weights = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not weights:
        raise ValueError(f"{info.module_path}: module state holds no 'model.*' weights (keys: {list(state)[:5]})")
    tensors = {k: torch.as_tensor(v) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # Tied embeddings: lm_head.weight may be absent from the state and is shared anyway.
    missing = [m for m in missing if not (m == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False))]
    if missing or unexpected:
        raise ValueError(f"checkpoint weights do not fit {info.model_name_or_path!r}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.config.use_cache = True
    model.eval()
    if device:
        model.to(device)
    tokenizer = load_tokenizer(info.model_name_or_path)
    return model, tokenizer


# =========================================================================== data


@dataclass
class EvalSource:
    """One ``sources`` entry, loaded."""

    spec: str
    problems: list  # envs.Problem


def load_eval_problems(sources: Sequence[Union[str, os.PathLike]], *, limit: Optional[int] = None,
                       split: str = "test") -> List[EvalSource]:
    """Load every source strictly (a malformed row is an error, not a skip).

    Sources are files (``.jsonl`` / ``.json`` / ``.parquet``) or ``"arithmetic[:opts]"``
    specs (their ``split``, held-out ``"test"`` by default; a spec with options becomes
    its own data source named by the spec). Raises :class:`EvalDataError` with a one-line
    message (``path:line: reason`` for a malformed row).
    """
    from envs.datasets import DataFormatError, load_problems

    if not sources:
        raise EvalDataError("no benchmark given")
    out = []
    for src in sources:
        spec = os.fspath(src)
        is_arith = spec == "arithmetic" or spec.startswith("arithmetic:")
        try:
            problems = load_problems(
                spec, split=split, strict=True, limit=limit,
                data_source=spec if is_arith and spec != "arithmetic" and not os.path.exists(spec) else None,
            )
        except DataFormatError as e:
            raise EvalDataError(str(e)) from e
        except (OSError, ValueError, TypeError) as e:
            raise EvalDataError(f"{spec}: {e}") from e
        if not problems:
            raise EvalDataError(f"{spec}: no problems")
        out.append(EvalSource(spec=spec, problems=list(problems)))
    return out


# =========================================================================== evaluate


def _stop_token_ids(model, tokenizer) -> tuple:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return tuple(sorted(i for i in ids if i is not None))


def _chunks(items: list, sizes: List[int], budget: int):
    """Consecutive slices of ``items`` whose ``sizes`` sum to about ``budget``."""
    start, total = 0, 0
    for i, s in enumerate(sizes):
        if total and total + s > budget:
            yield items[start:i], sizes[start:i]
            start, total = i, 0
        total += s
    if start < len(items):
        yield items[start:], sizes[start:]


def evaluate(
    model: Union[str, os.PathLike, Tuple[Any, Any]],
    sources: Sequence[Union[str, os.PathLike]],
    *,
    k: Union[None, int, Mapping[str, int]] = None,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    max_new_tokens: Optional[int] = None,
    limit: Optional[int] = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    instruction: Optional[str] = _UNSET,
    system_prompt: Optional[str] = _UNSET,
    think_format: bool = _UNSET,
    pass_ks: Sequence[Union[int, str]] = DEFAULT_PASS_KS,
    split: str = "test",
    max_prompt_tokens: Optional[int] = None,
    reward_timeout_s: float = 5.0,
    keep_completions: bool = False,
    device: Optional[str] = None,
    progress: Union[bool, Callable[[str], None]] = False,
) -> EvalReport:
    """Evaluate a policy on benchmark sources; see the module docstring for the metrics.

    Args:
        model: Model name/path (:func:`resolve_model_path`), RLlib checkpoint folder, or a
            ``(model, tokenizer)`` pair.
        sources: Benchmark files and/or ``"arithmetic[:opts]"`` specs.
        k: Samples per question: an int for every source, a {data_source: k} mapping
            (see :func:`resolve_k`), or None for the papers' defaults (:func:`default_k`).
            Greedy decoding (``temperature == 0``) always uses k = 1.
        temperature, top_p: Sampling (papers: 0.6, 1.0). 0 means greedy.
        max_new_tokens: Completion budget; default the checkpoint's ``max_response_tokens``,
            else 1024.
        limit: Evaluate at most the first ``limit`` questions of each source.
        batch_size: Sequences per ``generate`` call.
        seed: Seeds sampling (the global torch RNG is left as it was).
        instruction, system_prompt, think_format: Prompt settings passed to the env
            config; default: the checkpoint's ``env_config``, else the env's defaults.
        pass_ks: pass@j to report; ``"k"`` stands for each source's k. Entries larger than
            a source's k are left out for it.
        split: Split of ``arithmetic`` specs (held-out ``"test"``).
        max_prompt_tokens: Left-truncate prompts to this many tokens (default: no limit).
        reward_timeout_s: Verifier wall-clock limit per completion.
        keep_completions: Keep the completion texts in the report (and its JSON).
        device: Torch device for generation; default CUDA when available, else CPU.
        progress: True prints progress lines to stderr; a callable receives them.
    """
    import torch

    from envs.reasoning_env import ReasoningEnv
    from rllib_exgrpo.generation.base import SamplingParams
    from rllib_exgrpo.generation.hf import HFGenerationBackend

    t_start = time.perf_counter()
    say = progress if callable(progress) else ((lambda m: print(m, file=sys.stderr, flush=True)) if progress else (lambda m: None))
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    _pass_ks_for(pass_ks, 1)  # checks the entries

    # 1. data first: a bad file fails before any model is loaded
    loaded = load_eval_problems(sources, limit=limit, split=split)

    # 2. the policy
    env_defaults: dict = {}
    ckpt: Optional[CheckpointInfo] = None
    if isinstance(model, (tuple, list)):
        policy, tokenizer = model
        label = type(policy).__name__
    else:
        label = os.fspath(model)
        if os.path.isdir(label) and is_checkpoint(label):
            ckpt = read_checkpoint(label)
            say(f"loading {ckpt.algorithm or 'RLlib'} checkpoint {ckpt.path or ckpt.module_path} "
                f"(model {ckpt.model_name_or_path})")
            policy, tokenizer = load_policy_from_checkpoint(label, info=ckpt)
            env_defaults = {key: ckpt.env_config[key] for key in ("instruction", "system_prompt", "think_format")
                            if key in ckpt.env_config}
            if max_new_tokens is None and ckpt.config.get("max_response_tokens"):
                max_new_tokens = int(ckpt.config["max_response_tokens"])
        else:
            from rllib_exgrpo.rllib.env_runner import load_tokenizer
            from rllib_exgrpo.rllib.module import load_causal_lm

            say(f"loading model {label}")
            policy = load_causal_lm({"model": label})
            tokenizer = load_tokenizer(label)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    policy.to(device)
    policy.eval()
    max_new_tokens = int(max_new_tokens or DEFAULT_MAX_NEW_TOKENS)

    env_config: dict = dict(env_defaults)
    for key, value in (("instruction", instruction), ("system_prompt", system_prompt), ("think_format", think_format)):
        if value is not _UNSET:
            env_config[key] = value
    greedy = temperature == 0
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        stop_token_ids=_stop_token_ids(policy, tokenizer),
        return_logprobs=False,
    )
    backend = HFGenerationBackend(policy, pad_token_id=tokenizer.pad_token_id, batch_size=batch_size)
    max_positions = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    over_positions = 0

    # 3. generate + verify, source by source
    questions: List[QuestionResult] = []
    source_seconds: Dict[str, float] = {}
    k_used: Dict[str, int] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for src in loaded:
            t0 = time.perf_counter()
            env = ReasoningEnv({**env_config, "problems": src.problems, "tokenizer": tokenizer, "seed": seed,
                                "reward_timeout_s": reward_timeout_s, "max_prompt_chars": 10**9})
            ks = []
            for p in env.problems:
                kk = 1 if greedy else resolve_k(p.data_source, k)
                if greedy and resolve_k(p.data_source, k) > 1 and p.data_source not in k_used:
                    logger.warning("greedy decoding: k = 1 for %s (its samples would all be the same)", p.data_source)
                k_used.setdefault(p.data_source, kk)
                ks.append(kk)
            say(f"{src.spec}: {len(env.problems)} questions, {sum(ks)} samples")
            done = 0
            for chunk, sizes in _chunks(list(env.problems), ks, batch_size):
                prompts = []
                for p in chunk:
                    ids = tokenizer(env.prompt_for(p.id), add_special_tokens=False)["input_ids"]
                    if max_prompt_tokens and len(ids) > max_prompt_tokens:
                        ids = ids[-max_prompt_tokens:]
                    prompts.append(ids)
                    if max_positions and len(ids) + max_new_tokens > max_positions:
                        over_positions += 1
                groups = backend.generate(prompts, sizes, params)
                flat = [(qi, c) for qi, g in enumerate(groups) for c in g]
                texts = tokenizer.batch_decode([c.token_ids for _, c in flat], skip_special_tokens=True)
                results = env.score([chunk[qi].id for qi, _ in flat], texts)
                per_q: Dict[int, list] = {}
                for (qi, c), text, r in zip(flat, texts, results):
                    per_q.setdefault(qi, []).append((c, text, r))
                for qi, p in enumerate(chunk):
                    items = per_q.get(qi, [])
                    questions.append(QuestionResult(
                        id=p.id,
                        data_source=p.data_source,
                        source=src.spec,
                        correct=[r.score >= 1.0 for _, _, r in items],
                        answers=[r.parsed for _, _, r in items],
                        response_tokens=[int(len(c.token_ids)) for c, _, _ in items],
                        truncated=[c.finish_reason == "length" for c, _, _ in items],
                        unscored=sum(r.error is not None for _, _, r in items),
                        timed_out=sum(bool(r.timed_out) for _, _, r in items),
                        prompt_tokens=len(prompts[qi]),
                        difficulty=p.difficulty,
                        completions=[t for _, t, _ in items] if keep_completions else None,
                    ))
                done += len(chunk)
                say(f"  {src.spec}: {done}/{len(env.problems)} questions")
            env.close()
            dt = time.perf_counter() - t0
            for ds in {p.data_source for p in env.problems}:
                source_seconds[ds] = source_seconds.get(ds, 0.0) + dt

    if over_positions:
        msg = (f"{over_positions} question(s) have prompt + max_new_tokens > the model's "
               f"max_position_embeddings={max_positions}")
        if progress:
            say(f"warning: {msg}")
        else:
            logger.warning(msg)

    # 4. aggregate
    by_source: "OrderedDict[str, List[QuestionResult]]" = OrderedDict()
    for q in questions:
        by_source.setdefault(q.data_source, []).append(q)
    per_source = {}
    for name, qs in by_source.items():
        per_source[name] = {**aggregate(qs, pass_ks), "wall_time_s": round(source_seconds.get(name, 0.0), 3)}
    overall = aggregate(questions, pass_ks)
    overall["macro_avg_at_k"] = float(sum(m["avg_at_k"] for m in per_source.values()) / len(per_source))
    overall["n_sources"] = len(per_source)
    settings = {
        "temperature": float(temperature),
        "top_p": float(top_p),
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "k": k if not isinstance(k, Mapping) else dict(k),
        "k_used": k_used,
        "pass_ks": [j for j in pass_ks],
        "limit": limit,
        "split": split,
        "data": [src.spec for src in loaded],
        "instruction": env_config.get("instruction", "<env default>"),
        "system_prompt": env_config.get("system_prompt"),
        "think_format": bool(env_config.get("think_format", False)),
        "max_prompt_tokens": max_prompt_tokens,
        "batch_size": batch_size,
        "device": str(device),
        "over_max_positions": over_positions,
        "checkpoint": None if ckpt is None else {
            "path": ckpt.path, "module_path": ckpt.module_path, "algorithm": ckpt.algorithm,
            "model_name_or_path": ckpt.model_name_or_path,
        },
    }
    if settings["instruction"] == "<env default>":
        from envs.prompting import DEFAULT_INSTRUCTION

        settings["instruction"] = DEFAULT_INSTRUCTION
    return EvalReport(
        model=label,
        settings=settings,
        sources=per_source,
        overall=overall,
        wall_time_s=round(time.perf_counter() - t_start, 3),
        questions=questions,
    )
