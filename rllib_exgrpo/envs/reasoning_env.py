"""ReasoningEnv: one question per episode, one completion per step, a verifier reward.

``reset()`` shows a rendered prompt (through :func:`rllib_exgrpo.envs.prompting.render_prompt`, the
one renderer of the project); ``step(completion)`` scores the completion with
:func:`rllib_exgrpo.envs.rewards.math_reward` (or, with ``reward_fn`` / ``reward_fns``, the weighted sum
of reward functions run by :func:`rllib_exgrpo.envs.rewards.score_with_fns`; see ``docs/rewards.md``)
and ends the episode. The ground truth never leaves the env: not in observations, not in
infos.

The training stack mostly bypasses the per-episode loop (it generates G completions per
prompt in batch), so the env also offers batch helpers: :attr:`problems`,
:meth:`get_problem`, :meth:`prompt_for` and :meth:`score` (batched, parallel verification).

Spaces are ``gymnasium.spaces.Text`` whose charset is ``string.printable`` plus every
character of the rendered prompts: the default ``Text`` charset (letters and digits)
rejects ``What is 2+3?``. A plain ``Text`` (not a subclass) survives RLlib's space
serialisation. ``step`` accepts any ``str``: a model may emit characters outside the
charset and nothing here depends on it.
"""

from __future__ import annotations

import logging
import os
import string
from typing import Any, Optional, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from rllib_exgrpo.envs.datasets import load_problems
from rllib_exgrpo.envs.problem import Problem
from rllib_exgrpo.envs.prompting import DEFAULT_INSTRUCTION, render_prompt
from rllib_exgrpo.envs.rewards import (
    REWARD,
    RewardResult,
    load_reward_fn,
    math_reward,
    reward_labels,
    score_batch,
    score_with_fns,
)

logger = logging.getLogger(__name__)

#: Every config key with its default. Unknown keys are rejected (a typo must not pass).
DEFAULT_CONFIG: dict[str, Any] = {
    "dataset": "arithmetic",
    "split": "train",
    "field_map": None,
    "strict": False,
    "limit": None,
    "skip": 0,
    "tokenizer": None,
    "system_prompt": None,
    "instruction": DEFAULT_INSTRUCTION,
    "think_format": False,
    "reward_timeout_s": 5.0,
    "seed": 0,
    "max_prompt_chars": 4096,
    "max_completion_chars": 16384,
    "problems": None,
    # Reward functions (docs/rewards.md): "math" (the default when neither is set),
    # "multiple_choice", "format", "rehearsal" or "package.module:function"; reward_fns
    # with reward_weights (default 1.0 each) is a weighted sum. reward_fn and reward_fns
    # exclude each other.
    "reward_fn": None,
    "reward_fns": None,
    "reward_weights": None,
}

#: Keys that are no longer read, with what to write instead.
REMOVED_KEYS: dict[str, str] = {
    "rehearsal_reward": "remove it; for the rehearsal's stand-in reward write reward_fns: [math, rehearsal] "
    "with reward_weights: [0, 1] (math-verify still runs, the score is the stand-in)",
}


def _check(cond: bool, key: str, want: str, value: Any) -> None:
    if not cond:
        raise ValueError(f"ReasoningEnv config {key!r} must be {want}, got {value!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def validate_config(config: Optional[dict]) -> dict:
    """Defaults merged with ``config``, each value checked; unknown keys rejected."""
    config = dict(config or {})  # EnvContext is a dict subclass
    removed = sorted(set(config) & set(REMOVED_KEYS))
    if removed:
        raise ValueError(f"ReasoningEnv config {removed[0]!r} is gone: {REMOVED_KEYS[removed[0]]}")
    unknown = sorted(set(config) - set(DEFAULT_CONFIG))
    if unknown:
        raise ValueError(f"unknown ReasoningEnv config key(s) {unknown}; known keys: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    _check(isinstance(cfg["dataset"], (str, os.PathLike)), "dataset", "a path or 'arithmetic[:opts]'", cfg["dataset"])
    _check(isinstance(cfg["split"], str), "split", "a string", cfg["split"])
    _check(cfg["field_map"] is None or isinstance(cfg["field_map"], dict), "field_map", "a dict or None", cfg["field_map"])
    for key in ("strict", "think_format"):
        _check(isinstance(cfg[key], bool), key, "a bool", cfg[key])
    _check(_is_int(cfg["skip"]) and cfg["skip"] >= 0, "skip", "a non-negative int", cfg["skip"])
    _check(cfg["limit"] is None or (_is_int(cfg["limit"]) and cfg["limit"] > 0), "limit", "a positive int or None", cfg["limit"])
    for key in ("system_prompt", "instruction"):
        _check(cfg[key] is None or isinstance(cfg[key], str), key, "a string or None", cfg[key])
    t = cfg["reward_timeout_s"]
    _check(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0, "reward_timeout_s", "a number > 0", t)
    _check(cfg["seed"] is None or _is_int(cfg["seed"]), "seed", "an int or None", cfg["seed"])
    for key in ("max_prompt_chars", "max_completion_chars"):
        _check(_is_int(cfg[key]) and cfg[key] > 0, key, "a positive int", cfg[key])
    p = cfg["problems"]
    _check(
        p is None or (isinstance(p, (list, tuple)) and all(isinstance(x, Problem) for x in p)),
        "problems",
        "a list of rllib_exgrpo.envs.problem.Problem or None",
        type(p).__name__ if p is not None else p,
    )
    _validate_rewards(cfg)
    return cfg


def _validate_rewards(cfg: dict) -> None:
    """``reward_fn`` / ``reward_fns`` / ``reward_weights``: shapes, then every function
    imported here (a bad path is one line naming the key, before anything starts)."""
    one, many, weights = cfg["reward_fn"], cfg["reward_fns"], cfg["reward_weights"]
    want = f"a registered name ({', '.join(REWARD.names())}) or 'package.module:function'"
    _check(one is None or isinstance(one, str), "reward_fn", f"{want} or None", one)
    _check(
        many is None or (isinstance(many, (list, tuple)) and len(many) > 0 and all(isinstance(x, str) for x in many)),
        "reward_fns",
        f"a non-empty list of {want}s, or None",
        many,
    )
    if one is not None and many is not None:
        raise ValueError(
            "ReasoningEnv config 'reward_fn' cannot be set together with reward_fns "
            f"(reward_fn={one!r}, reward_fns={list(many)!r}): set one of them"
        )
    if weights is not None:
        _check(many is not None, "reward_weights", "given only with reward_fns (one weight per function)", weights)
        _check(
            isinstance(weights, (list, tuple))
            and len(weights) == len(many)
            and all(isinstance(w, (int, float)) and not isinstance(w, bool) and np.isfinite(w) for w in weights),
            "reward_weights",
            f"a list of {len(many)} finite numbers (one per reward_fns entry)",
            weights,
        )
    specs = [("reward_fn", one)] if one is not None else [("reward_fns", x) for x in (many or ())]
    for key, spec in specs:
        if spec == "math":
            continue
        try:
            load_reward_fn(spec)
        except ValueError as exc:
            where = f" (entry {list(many).index(spec) + 1})" if key == "reward_fns" else ""
            raise ValueError(f"ReasoningEnv config {key!r} cannot import {spec!r}{where}: {exc}") from None


def reward_specs(cfg: dict) -> tuple[list[str], list[float]]:
    """(reward specs, weights) of a validated config; ``(["math"], [1.0])`` when unset."""
    if cfg["reward_fn"] is not None:
        return [cfg["reward_fn"]], [1.0]
    if cfg["reward_fns"] is not None:
        weights = cfg["reward_weights"]
        return list(cfg["reward_fns"]), [float(w) for w in weights] if weights is not None else [1.0] * len(cfg["reward_fns"])
    return ["math"], [1.0]


def _load_tokenizer(tokenizer: Any):
    if tokenizer is None or not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    except Exception as exc:
        raise ValueError(f"could not load tokenizer {str(tokenizer)!r} from local files: {exc}") from exc


class ReasoningEnv(gym.Env):
    """Single-step text env over a set of verifiable reasoning problems.

    Args:
        config: RLlib's ``env_config`` (a dict or ``EnvContext``) with the keys of
            :data:`DEFAULT_CONFIG`. When it is an ``EnvContext``, the sampler seed is mixed
            with ``worker_index`` / ``vector_index`` so that copies draw different orders.

    Attributes:
        problems: The problems in play (prompts over ``max_prompt_chars`` are dropped).
        skipped_rows: Malformed data rows skipped while loading.
        dropped_long_prompts: Problems dropped because their prompt was too long.
    """

    metadata = {"render_modes": []}

    def __init__(self, config: Optional[dict] = None):
        super().__init__()
        cfg = validate_config(config)
        self.config = cfg
        self.think_format: bool = cfg["think_format"]
        self.reward_timeout_s: float = float(cfg["reward_timeout_s"])
        self.max_prompt_chars: int = int(cfg["max_prompt_chars"])
        self.max_completion_chars: int = int(cfg["max_completion_chars"])
        self.tokenizer = _load_tokenizer(cfg["tokenizer"])
        self._init_rewards(cfg)
        self._init_problems(self._load(cfg), cfg["dataset"])
        self._init_spaces()
        self._init_sampler(cfg["seed"], config)

    def _init_rewards(self, cfg: dict) -> None:
        self.reward_fns, self.reward_weights = reward_specs(cfg)
        #: The plain math reward (nothing set, or only "math" with weight 1): today's path.
        self._plain_math = self.reward_fns == ["math"] and self.reward_weights == [1.0]
        self.reward_labels: list[str] = reward_labels(self.reward_fns)
        self._component_sums: dict[str, float] = dict.fromkeys(self.reward_labels, 0.0)
        self._component_rows = 0
        self._row_kwargs: dict[str, dict] = {}

    def _load(self, cfg: dict) -> list[Problem]:
        """The configured problems (given, or loaded from ``dataset``; sets :attr:`skipped_rows`);
        ids must be unique."""
        if cfg["problems"] is not None:
            problems = list(cfg["problems"])[cfg["skip"] :][: cfg["limit"]]
            self.skipped_rows = 0
        else:
            problems = load_problems(
                cfg["dataset"], split=cfg["split"], field_map=cfg["field_map"], strict=cfg["strict"], limit=cfg["limit"], skip=cfg["skip"]
            )
            self.skipped_rows = getattr(problems, "skipped", 0)
        ids = [p.id for p in problems]
        if len(set(ids)) != len(ids):
            dupes = sorted({i for i in ids if ids.count(i) > 1})[:5]
            raise ValueError(f"problem ids must be unique; repeated: {dupes}")
        return problems

    def _init_problems(self, problems: list[Problem], dataset: Any) -> None:
        """Render every prompt; keep the problems whose prompt fits ``max_prompt_chars``."""
        self._prompts: dict[str, str] = {}
        self._too_long: set[str] = set()
        kept = []
        for p in problems:
            prompt = self._render(p)
            if len(prompt) > self.max_prompt_chars:
                self._too_long.add(p.id)
                continue
            self._prompts[p.id] = prompt
            kept.append(p)
        self.dropped_long_prompts = len(self._too_long)
        if self._too_long:
            logger.warning("dropped %d problem(s) whose prompt exceeds max_prompt_chars=%d", len(self._too_long), self.max_prompt_chars)
        if not kept:
            raise ValueError(f"no problems to serve from {dataset!r} ({len(problems)} loaded, {len(self._too_long)} over max_prompt_chars)")
        self.problems: list[Problem] = kept
        self._by_id: dict[str, Problem] = {p.id: p for p in kept}

    def _init_spaces(self) -> None:
        """Text spaces over ``string.printable`` plus every character of the prompts."""
        charset = set(string.printable)
        for prompt in self._prompts.values():
            charset.update(prompt)
        self.charset = "".join(sorted(charset))
        self.observation_space = spaces.Text(max_length=self.max_prompt_chars, min_length=1, charset=self.charset)
        self.action_space = spaces.Text(max_length=self.max_completion_chars, min_length=0, charset=self.charset)

    def _init_sampler(self, seed: Optional[int], config: Any) -> None:
        """The seeded question order; an ``EnvContext``'s worker and vector index are mixed in."""
        worker, vector = getattr(config, "worker_index", None), getattr(config, "vector_index", None)
        if seed is not None and (worker or vector):
            seed = int(np.random.SeedSequence([seed, int(worker or 0), int(vector or 0)]).generate_state(1)[0])
        self._np_random, self._np_random_seed = gym.utils.seeding.np_random(seed)
        self._order: Optional[np.ndarray] = None
        self._cursor = 0
        self._current: Optional[Problem] = None

    # ------------------------------------------------------------------ helpers
    def _render(self, problem: Problem) -> str:
        return render_prompt(
            problem.question,
            tokenizer=self.tokenizer,
            system_prompt=self.config["system_prompt"],
            instruction=self.config["instruction"],
            think_format=self.think_format,
        )

    def get_problem(self, question_id: str) -> Problem:
        """The problem with this id (KeyError with a reason otherwise)."""
        try:
            return self._by_id[question_id]
        except KeyError:
            if question_id in self._too_long:
                raise KeyError(
                    f"question {question_id!r} was dropped: its prompt exceeds max_prompt_chars={self.max_prompt_chars}"
                ) from None
            sample = ", ".join(repr(p.id) for p in self.problems[:3])
            raise KeyError(f"unknown question id {question_id!r} ({len(self.problems)} problems, e.g. {sample})") from None

    def prompt_for(self, question_id: str) -> str:
        """The rendered prompt of a question (what ``reset`` shows for it)."""
        self.get_problem(question_id)
        return self._prompts[question_id]

    def _clip(self, completion: str) -> tuple[str, bool]:
        if not isinstance(completion, str):
            raise TypeError(f"a completion must be a str, got {type(completion).__name__}")
        if len(completion) <= self.max_completion_chars:
            return completion, False
        # Keep the tail: that is where the final answer is.
        return completion[-self.max_completion_chars :], True

    def score(self, question_ids: Sequence[str], completions: Sequence[str]) -> list[RewardResult]:
        """Verify ``completions[i]`` against question ``question_ids[i]``, in parallel."""
        if len(question_ids) != len(completions):
            raise ValueError(f"{len(question_ids)} question ids but {len(completions)} completions")
        problems = [self.get_problem(q) for q in question_ids]
        clipped = [self._clip(c)[0] for c in completions]
        return self._reward(problems, clipped)

    def _reward(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[RewardResult]:
        truths = [p.ground_truth for p in problems]
        if self._plain_math:
            return score_batch(completions, truths, timeout_s=self.reward_timeout_s, think_format=self.think_format)
        results = score_with_fns(
            completions,
            truths,
            fns=self.reward_fns,
            weights=self.reward_weights,
            rows=[self.row_kwargs(p) for p in problems],
            timeout_s=self.reward_timeout_s,
            think_format=self.think_format,
        )
        for r in results:
            for label, value in (r.components or {}).items():
                self._component_sums[label] += value
        self._component_rows += len(results)
        return results

    def row_kwargs(self, problem: Problem) -> dict:
        """The row's fields a reward function gets besides ``completion`` and
        ``ground_truth``: ``question``, ``question_id``, ``data_source``, ``solution``,
        ``difficulty`` and the row's other scalar columns (``Problem.extra``, e.g.
        ``line``); the named fields win over a column of the same name."""
        kw = self._row_kwargs.get(problem.id)
        if kw is None:
            kw = {k: v for k, v in problem.extra.items() if isinstance(k, str) and k.isidentifier()}
            kw.update(
                question=problem.question,
                question_id=problem.id,
                data_source=problem.data_source,
                solution=problem.solution,
                difficulty=problem.difficulty,
            )
            kw.pop("completion", None)
            kw.pop("ground_truth", None)
            self._row_kwargs[problem.id] = kw
        return kw

    def reward_metrics(self, reset: bool = True) -> dict[str, float]:
        """Each reward function's mean score over the completions scored since the last
        reset: ``{"reward_<label>_mean": mean}`` (labels: :attr:`reward_labels`). Empty
        with the plain math reward, whose mean is ``reward_mean``."""
        if self._plain_math or not self._component_rows:
            return {}
        out = {f"reward_{label}_mean": total / self._component_rows for label, total in self._component_sums.items()}
        if reset:
            self._component_sums = dict.fromkeys(self.reward_labels, 0.0)
            self._component_rows = 0
        return out

    def _next_problem(self) -> Problem:
        if self._order is None or self._cursor >= len(self._order):
            self._order = self._np_random.permutation(len(self.problems))
            self._cursor = 0
        problem = self.problems[int(self._order[self._cursor])]
        self._cursor += 1
        return problem

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        """Start an episode: ``options={"question_id": id}`` picks the question, else the
        seeded sampler's next one (a fresh shuffle each epoch). ``seed`` restarts it."""
        super().reset(seed=seed)
        if seed is not None:
            self._order, self._cursor = None, 0
        options = options or {}
        unknown = sorted(set(options) - {"question_id"})
        if unknown:
            raise ValueError(f"unknown reset option(s) {unknown}; known: ['question_id']")
        qid = options.get("question_id")
        self._current = self.get_problem(qid) if qid is not None else self._next_problem()
        return self._prompts[self._current.id], self._info(self._current)

    @staticmethod
    def _info(problem: Problem) -> dict:
        return {"question_id": problem.id, "data_source": problem.data_source}

    def step(self, action: str):
        """Score the completion; the episode always ends here."""
        if self._current is None:
            raise RuntimeError(
                "ReasoningEnv.step() called before reset() (or after the episode ended): call reset() to get a question first"
            )
        problem, self._current = self._current, None
        completion, truncated_text = self._clip(action)
        if self._plain_math:
            result = math_reward(completion, problem.ground_truth, timeout_s=self.reward_timeout_s, think_format=self.think_format)
        else:
            result = self._reward([problem], [completion])[0]
        info = self._info(problem)
        info.update(
            parsed=result.parsed,
            timed_out=result.timed_out,
            format_ok=result.format_ok,
            error=result.error,
            correct=result.correct,
            completion_truncated=truncated_text,
        )
        if result.components is not None:
            info.update({f"reward_{label}": value for label, value in result.components.items()})
        # The terminal observation is the prompt again: valid in the space, never read.
        return self._prompts[problem.id], float(result.score), True, False, info

    def render(self):
        return None
