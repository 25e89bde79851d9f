"""TRL side of the GRPO benchmark: TRL 1.16.0's ``GRPOTrainer`` on the project's tiny model.

Runs in the separate TRL venv (see ``benchmarks/_trl_venv.py``; TRL is no project
dependency), so it imports neither ray nor ``rllib_exgrpo``. The only project code it uses
is ``envs/rewards.py`` (standard library only; its verifier workers import math-verify),
loaded from the repository given in the input, so the reward is the project's own.

    <trl-venv>/bin/python benchmarks/_trl_grpo_runner.py INPUT.json
    <trl-venv>/bin/python benchmarks/_trl_grpo_runner.py --score SCORE.json   # reward parity check

Input (``INPUT.json``, as written by ``_trl_venv.trl_inputs``)::

    {"model_path": str,            # HF folder of the tiny model
     "output_dir": str,            # gets the trained model, trl_result.json
     "seed": int,
     "repo_root": str,             # optional, default: this file's repository
     "settings": {...},            # optional overrides of DEFAULT_SETTINGS below
     "iterations": [{"prompts": [str] * B,        # rendered prompts, in order
                     "ground_truths": [str] * B,
                     "question_ids": [str] * B}, ...]}   # question_ids optional

Iteration ``i`` generates G completions for each of exactly the B prompts of
``iterations[i]``, in the given order, then takes ``steps_per_generation`` optimiser steps of
``per_device_train_batch_size`` completions each.

Output (``<output_dir>/trl_result.json``)::

    {"framework": "trl", "versions": {...}, "seed", "settings", "num_threads",
     "generation_config": {...}, "logits_processors": [...],   # what generate really applies
     "optimizer": {"class", "groups": [{"params", "weight_decay", "lr", "betas", "eps"}]},
     "iterations": [{"iteration", "wall_s", "generate_s", "rollout_s", "reward_s",
                     "reward_mean", "num_completions", "completion_tokens",
                     "mean_completion_tokens", "trl_metrics": {...}}, ...],
     "median_s_per_iteration", "median_generate_s", "train_s", "total_s",
     "setup_s", "save_s", "model_dir"}

``wall_s``: the whole iteration (generation, reward, old log-probs, the optimiser steps),
from the trainer's ``on_step_begin`` of its first step to ``on_step_end`` of its last.
``generate_s``: the ``model.generate`` call alone. ``rollout_s``: all of TRL's
``_generate_and_score_completions`` (tokenise, generate, decode, reward, old log-probs).

``--score SCORE.json`` (``{"completions": [...], "ground_truths": [...], "settings": {...}}``)
prints ``{"scores": [...], "parsed": [...], "errors": [...]}`` as JSON: the reward of this
runner for given texts, to check it against the project's ``ReasoningEnv.score``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for _var in ("WANDB_DISABLED", "MLFLOW_DISABLE"):
    os.environ.setdefault(_var, "true")

HERE = Path(__file__).resolve()

#: Settings of tuned_examples/grpo_stream_tiny.yaml (and the project's GRPO defaults).
DEFAULT_SETTINGS = {
    "group_size": 8,  # G completions per prompt
    "questions_per_step": 32,  # B prompts per iteration
    "max_new_tokens": 48,
    "max_prompt_tokens": 256,  # the project's left truncation; the arithmetic prompts are far shorter
    "temperature": 1.0,
    "top_p": 1.0,
    "lr": 3e-4,
    "weight_decay": 0.01,
    "optim": "adamw_torch",
    # "all": decay every parameter, as the project's learner does (torch.optim.AdamW over all
    # of them); "trainer": the HF Trainer's default, no decay on biases and norm weights.
    "weight_decay_params": "all",
    "steps_per_generation": 2,
    "per_device_train_batch_size": 128,
    "epsilon": 0.2,
    "beta": 0.0,
    "max_grad_norm": 1.0,
    "loss_type": "dapo",
    "scale_rewards": "none",
    "reward_timeout_s": 5.0,
    "max_completion_chars": 16384,  # ReasoningEnv's default clip (keeps the tail)
    "think_format": False,
    "num_threads": None,  # None: os.cpu_count()
}


def _settings(given: dict | None) -> dict:
    unknown = sorted(set(given or {}) - set(DEFAULT_SETTINGS))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; known: {sorted(DEFAULT_SETTINGS)}")
    return {**DEFAULT_SETTINGS, **(given or {})}


def _import_project_rewards(repo_root: str | None):
    """``rllib_exgrpo.envs.rewards`` of the repository (stdlib only at import; no ray, no gymnasium)."""
    root = Path(repo_root) if repo_root else HERE.parents[1]
    if not (root / "rllib_exgrpo" / "envs" / "rewards.py").is_file():
        raise FileNotFoundError(f"no rllib_exgrpo/envs/rewards.py under the repository root {root}")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import rllib_exgrpo.envs.rewards as rewards  # envs/__init__ resolves its exports lazily

    return rewards


class ProjectReward:
    """The project's reward: ``ReasoningEnv.score`` without the env (clip, then ``score_batch``)."""

    __name__ = "project_math_verify"

    def __init__(self, rewards_module, settings: dict):
        self.rewards = rewards_module
        self.timeout_s = float(settings["reward_timeout_s"])
        self.max_chars = int(settings["max_completion_chars"])
        self.think_format = bool(settings["think_format"])

    def _clip(self, text: str) -> str:  # == ReasoningEnv._clip
        return text if len(text) <= self.max_chars else text[-self.max_chars :]

    def results(self, completions, ground_truths):
        return self.rewards.score_batch(
            [self._clip(c) for c in completions], list(ground_truths), timeout_s=self.timeout_s, think_format=self.think_format
        )

    def __call__(self, prompts, completions, ground_truth, **kwargs):
        return [r.score for r in self.results(completions, ground_truth)]


def score_main(path: str) -> None:
    spec = json.loads(sys.stdin.read() if path in ("-", "/dev/stdin") else Path(path).read_text())
    reward = ProjectReward(_import_project_rewards(spec.get("repo_root")), _settings(spec.get("settings")))
    res = reward.results(spec["completions"], spec["ground_truths"])
    json.dump({"scores": [r.score for r in res], "parsed": [r.parsed for r in res], "errors": [r.error for r in res]}, sys.stdout)
    print()


# --------------------------------------------------------------------------- training


def _check_iterations(its: list, settings: dict) -> None:
    """Each iteration holds exactly B prompts, and its B*G completions fill exactly
    ``steps_per_generation`` optimiser steps of ``per_device_train_batch_size``."""
    B, G = settings["questions_per_step"], settings["group_size"]
    spg, mb = settings["steps_per_generation"], settings["per_device_train_batch_size"]
    if not its:
        raise ValueError("the input holds no iterations")
    for i, it in enumerate(its):
        if len(it["prompts"]) != B or len(it["ground_truths"]) != B:
            raise ValueError(f"iteration {i}: {len(it['prompts'])} prompts / {len(it['ground_truths'])} ground truths, expected {B}")
    if B * G != spg * mb:
        raise ValueError(f"B*G = {B * G} completions per iteration but steps_per_generation * per_device_train_batch_size = {spg * mb}")


def _load_model_and_tokenizer(model_path: str):
    """The tiny model in float32 and its tokenizer, padding on the left (for generation)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
    return model, tokenizer


def _check_prompt_tokenisation(tokenizer, its: list, max_prompt_tokens: int) -> None:
    """TRL tokenises plain-text prompts with the tokenizer's defaults (add_special_tokens=True);
    the project with add_special_tokens=False and a left cut at max_prompt_tokens. Both must
    give the same ids here, or the two sides would not see the same prompts."""
    all_prompts = [p for it in its for p in it["prompts"]]
    for p in dict.fromkeys(all_prompts):
        a = tokenizer(text=[p])["input_ids"][0]
        b = tokenizer(p, add_special_tokens=False)["input_ids"]
        if a != b or len(b) > max_prompt_tokens:
            raise ValueError(f"prompt tokenisation differs from the project's (or is over max_prompt_tokens): {p!r}")


def _train_dataset(its: list, B: int):
    """One row per prompt, the iterations' prompts one after the other, in their given order."""
    import datasets

    rows = {"prompt": [], "ground_truth": [], "question_id": [], "iteration": []}
    for i, it in enumerate(its):
        rows["prompt"] += it["prompts"]
        rows["ground_truth"] += [str(g) for g in it["ground_truths"]]
        rows["question_id"] += list(it.get("question_ids") or [f"it{i}-q{k}" for k in range(B)])
        rows["iteration"] += [i] * B
    return datasets.Dataset.from_dict(rows)


def _grpo_config(out: Path, seed: int, settings: dict, num_iterations: int):
    """TRL's config for the project's recipe: CPU, float32, no shuffle, ``num_iterations`` iterations."""
    from trl import GRPOConfig

    G = settings["group_size"]
    spg, mb = settings["steps_per_generation"], settings["per_device_train_batch_size"]
    return GRPOConfig(
        output_dir=str(out / "trainer"),
        seed=seed,
        data_seed=seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        # data and batching
        shuffle_dataset=False,
        num_generations=G,
        per_device_train_batch_size=mb,
        steps_per_generation=spg,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_steps=spg * num_iterations,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        # generation: plain softmax at T (top_k=0 disables top-k; None would let transformers
        # fill in its global default of 50)
        max_completion_length=settings["max_new_tokens"],
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        # optimisation
        learning_rate=settings["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim=settings["optim"],
        weight_decay=settings["weight_decay"],
        max_grad_norm=settings["max_grad_norm"],
        # loss
        beta=settings["beta"],
        epsilon=settings["epsilon"],
        loss_type=settings["loss_type"],
        scale_rewards=settings["scale_rewards"],
        mask_truncated_completions=False,
        # no reporting, no evaluation, no checkpoints
        report_to="none",
        eval_strategy="no",
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=spg,
        disable_tqdm=True,
        log_completions=False,
    )


class _OrderedReward(ProjectReward):
    """The project reward, plus a check that TRL kept the prompt order and grouping.

    Records, per iteration, the reward time and the completions' count, tokens and mean
    reward in ``timings``, and the question ids of the first batch's first rows in ``order_log``."""

    def __init__(self, rewards_module, settings: dict, its: list, timings: dict, order_log: list):
        super().__init__(rewards_module, settings)
        self.its, self.timings, self.order_log = its, timings, order_log
        self.B, self.G = settings["questions_per_step"], settings["group_size"]
        self.spg = settings["steps_per_generation"]

    def __call__(
        self, prompts, completions, ground_truth, iteration=None, question_id=None, completion_ids=None, trainer_state=None, **kwargs
    ):
        B, G, timings = self.B, self.G, self.timings
        it_index = trainer_state.global_step // self.spg
        want = [p for p in self.its[it_index]["prompts"] for _ in range(G)]
        if list(prompts) != want or list(iteration) != [it_index] * (B * G):
            raise RuntimeError(f"iteration {it_index}: TRL fed prompts out of the given order or grouping")
        if not self.order_log:
            self.order_log.append(list(question_id[: 2 * G + 1]))
        t0 = time.perf_counter()
        scores = [r.score for r in self.results(completions, ground_truth)]
        timings["reward"].append(time.perf_counter() - t0)
        timings.setdefault("tokens", []).append(sum(len(c) for c in completion_ids))
        timings.setdefault("reward_mean", []).append(sum(scores) / len(scores))
        timings.setdefault("n", []).append(len(scores))
        return scores


def _ordered_grpo_trainer_class(settings: dict, timings: dict):
    """A ``GRPOTrainer`` subclass that keeps the given prompt order, decays the parameters
    ``weight_decay_params`` names, and times generation and rollouts into ``timings``."""
    from torch.utils.data import Sampler
    from trl import GRPOTrainer
    from trl.trainer.utils import RepeatSampler

    class OrderedGRPOTrainer(GRPOTrainer):
        def get_decay_parameter_names(self, model):
            if settings["weight_decay_params"] == "all":
                return [n for n, _ in model.named_parameters()]
            return super().get_decay_parameter_names(model)

        def _get_train_sampler(self, dataset=None) -> Sampler:
            # TRL's RepeatSampler without the shuffle: chunks of B consecutive rows (one
            # iteration's prompts), each row G times in a row, each chunk yielded
            # steps_per_generation times (the dataloader batch of the later steps is a repeat
            # TRL ignores: they train on the buffered generation).
            return RepeatSampler(
                data_source=dataset if dataset is not None else self.train_dataset,
                mini_repeat_count=self.num_generations,
                batch_size=self.args.generation_batch_size // self.num_generations,
                repeat_count=self.num_iterations * self.args.steps_per_generation,
                shuffle=False,
            )

        def _generate_single_turn(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                timings["generate"].append(time.perf_counter() - t0)

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                timings["rollout"].append(time.perf_counter() - t0)

    return OrderedGRPOTrainer


def _iteration_clock(spg: int):
    """A trainer callback timing each iteration (``spg`` optimiser steps) into ``wall`` and
    keeping TRL's logged metrics of each iteration in ``logs``."""
    from transformers import TrainerCallback

    class IterationClock(TrainerCallback):
        def __init__(self):
            self.begin = {}
            self.wall = []
            self.logs = []
            self.train_begin = None

        def on_train_begin(self, args, state, control, **kw):
            self.train_begin = time.perf_counter()

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step % spg == 0:
                self.begin[state.global_step // spg] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % spg == 0:
                i = state.global_step // spg - 1
                self.wall.append(time.perf_counter() - self.begin[i])

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and state.global_step % spg == 0 and "train_runtime" not in logs:
                self.logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    return IterationClock()


def _checked_generation_config(trainer, settings: dict) -> tuple[dict, list]:
    """What generate will really apply: TRL's GenerationConfig merged with the model's own
    generation_config.json and transformers' global defaults, then the logits processors.
    Raises unless that is plain sampling from the softmax at the set temperature."""
    from transformers import LogitsProcessorList

    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    merged, _ = unwrapped._prepare_generation_config(trainer.generation_config)
    processors = unwrapped._get_logits_processor(
        generation_config=merged, input_ids_seq_length=8, logits_processor=LogitsProcessorList(), device="cpu"
    )
    gen_info = {
        k: getattr(merged, k, None)
        for k in (
            "do_sample",
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "typical_p",
            "repetition_penalty",
            "no_repeat_ngram_size",
            "max_new_tokens",
            "eos_token_id",
            "pad_token_id",
            "bos_token_id",
            "suppress_tokens",
            "bad_words_ids",
            "epsilon_cutoff",
            "eta_cutoff",
        )
    }
    processor_names = [type(p).__name__ for p in processors]
    if processor_names:
        raise RuntimeError(f"generation would not sample the plain softmax: processors {processor_names}")
    if not merged.do_sample or merged.temperature != settings["temperature"]:
        raise RuntimeError(f"unexpected sampling config: {gen_info}")
    return gen_info, processor_names


def _create_optimizer(trainer) -> dict:
    """Create the trainer's optimiser now (train() reuses it) and describe its parameter groups."""
    trainer.create_optimizer()
    opt = trainer.optimizer
    return {
        "class": type(opt).__name__,
        "groups": [
            {
                "params": len(g["params"]),
                "weight_decay": g["weight_decay"],
                "lr": g["lr"],
                "betas": list(g.get("betas", ())),
                "eps": g.get("eps"),
            }
            for g in opt.param_groups
        ],
    }


def _save_model(trainer, tokenizer, out: Path) -> float:
    """Save the trained model and the tokenizer to ``out``; returns the seconds that took."""
    t_save = time.perf_counter()
    trainer.model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    save_s = time.perf_counter() - t_save
    try:
        (out / "trainer").rmdir()  # the Trainer's output_dir: empty (no checkpoints are saved)
    except OSError:
        pass
    return save_s


def _iteration_rows(timings: dict, clock, n: int) -> list[dict]:
    """The result's per-iteration rows, after checking every iteration was recorded once."""
    for key in ("generate", "rollout", "reward", "reward_mean", "tokens", "n"):
        if len(timings.get(key, [])) != n:
            raise RuntimeError(f"recorded {len(timings.get(key, []))} {key} values for {n} iterations")
    if len(clock.wall) != n:
        raise RuntimeError(f"recorded {len(clock.wall)} iteration times for {n} iterations")
    iterations = []
    for i in range(n):
        iterations.append(
            {
                "iteration": i + 1,
                "wall_s": clock.wall[i],
                "generate_s": timings["generate"][i],
                "rollout_s": timings["rollout"][i],
                "reward_s": timings["reward"][i],
                "reward_mean": timings["reward_mean"][i],
                "num_completions": timings["n"][i],
                "completion_tokens": timings["tokens"][i],
                "mean_completion_tokens": timings["tokens"][i] / timings["n"][i],
                "trl_metrics": clock.logs[i] if i < len(clock.logs) else {},
            }
        )
    return iterations


def _set_torch_threads(settings: dict) -> int:
    """Set torch's intra-op threads to ``num_threads`` (default: all CPUs); returns that number."""
    import torch

    threads = int(settings["num_threads"] or os.cpu_count() or 1)
    torch.set_num_threads(threads)
    return threads


def _write_result(out: Path, result: dict) -> None:
    """Write ``<out>/trl_result.json`` and print a one-line summary of the run."""
    iterations = result["iterations"]
    (out / "trl_result.json").write_text(json.dumps(result, indent=1))
    print(
        f"[trl-runner] {len(iterations)} iterations: median {result['median_s_per_iteration']:.2f} s/iteration "
        f"(generate {result['median_generate_s']:.2f} s), rewards "
        f"{[round(r['reward_mean'], 3) for r in iterations]}; wrote {out / 'trl_result.json'}",
        flush=True,
    )


def _versions() -> dict:
    import datasets
    import torch
    import transformers
    import trl

    return {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "datasets": datasets.__version__,
        "python": sys.version.split()[0],
    }


def _build_trainer(spec: dict, settings: dict, out: Path, seed: int, its: list, rewards_module):
    """The model, its data and the ordered trainer -> ``(trainer, tokenizer, clock, timings,
    order_log)``: the clock's ``wall`` and ``logs``, ``timings`` and ``order_log`` fill as it trains."""
    model, tokenizer = _load_model_and_tokenizer(spec["model_path"])
    _check_prompt_tokenisation(tokenizer, its, settings["max_prompt_tokens"])
    train_dataset = _train_dataset(its, settings["questions_per_step"])
    args = _grpo_config(out, seed, settings, len(its))

    timings: dict = {"generate": [], "rollout": [], "reward": []}
    order_log: list = []
    if settings["weight_decay_params"] not in ("all", "trainer"):
        raise ValueError(f"weight_decay_params must be 'all' or 'trainer', got {settings['weight_decay_params']!r}")
    clock = _iteration_clock(settings["steps_per_generation"])
    trainer = _ordered_grpo_trainer_class(settings, timings)(
        model=model,
        reward_funcs=[_OrderedReward(rewards_module, settings, its, timings, order_log)],
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    return trainer, tokenizer, clock, timings, order_log


def main(path: str) -> dict:
    t_start = time.perf_counter()
    spec = json.loads(Path(path).read_text())
    settings = _settings(spec.get("settings"))
    out = Path(spec["output_dir"]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seed = int(spec["seed"])
    its = spec["iterations"]
    B, G = settings["questions_per_step"], settings["group_size"]
    spg, mb = settings["steps_per_generation"], settings["per_device_train_batch_size"]
    _check_iterations(its, settings)

    threads = _set_torch_threads(settings)

    rewards_module = _import_project_rewards(spec.get("repo_root"))
    rewards_module.warm_up()  # start the verifier processes before the clock runs
    trainer, tokenizer, clock, timings, order_log = _build_trainer(spec, settings, out, seed, its, rewards_module)

    gen_info, processor_names = _checked_generation_config(trainer, settings)
    print(f"[trl-runner] generation config: {gen_info}; logits processors: {processor_names or 'none'}", flush=True)
    print(f"[trl-runner] threads={threads}; {len(its)} iterations of {B}x{G}; {spg} optimiser steps x {mb} completions", flush=True)
    optimizer_info = _create_optimizer(trainer)
    print(f"[trl-runner] optimiser: {optimizer_info}", flush=True)

    setup_s = time.perf_counter() - t_start
    t_train = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t_train
    print(f"[trl-runner] first batch, question ids of rows 0..{2 * G}: {order_log[0] if order_log else None}", flush=True)
    save_s = _save_model(trainer, tokenizer, out)

    iterations = _iteration_rows(timings, clock, len(its))
    result = {
        "framework": "trl",
        "versions": _versions(),
        "seed": seed,
        "settings": settings,
        "num_threads": threads,
        "generation_config": gen_info,
        "logits_processors": processor_names,
        "optimizer": optimizer_info,
        "iterations": iterations,
        "median_s_per_iteration": statistics.median(r["wall_s"] for r in iterations),
        "median_generate_s": statistics.median(r["generate_s"] for r in iterations),
        "median_rollout_s": statistics.median(r["rollout_s"] for r in iterations),
        "train_s": train_s,
        "setup_s": setup_s,
        "save_s": save_s,
        "total_s": time.perf_counter() - t_start,
        "model_dir": str(out),
        "reward_stats": rewards_module.reward_stats(),
    }
    _write_result(out, result)
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--score":
        score_main(sys.argv[2])
    elif len(sys.argv) == 2 and not sys.argv[1].startswith("-"):
        main(sys.argv[1])
    else:
        sys.exit("usage:\n" + __doc__.split("\n\n")[2])
