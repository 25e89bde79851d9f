"""The separate virtual environment of the TRL side of the GRPO benchmark, and its inputs.

TRL is no dependency of the project: the TRL baseline (:mod:`benchmarks._trl_grpo_runner`)
runs in a venv of its own, by default ``benchmarks/out/trl-venv`` (git-ignored).

- :func:`ensure_trl_venv` creates that venv if needed and returns its python. It installs
  ``torch==2.13.0`` first, alone (the CPU wheel on this machine's disk; if anything that
  depends on torch came first, pip would pull a multi-GB CUDA build), then the project
  venv's own ``transformers`` version, ``accelerate``, ``datasets``, math-verify (same range
  as setup.py) and last ``trl==1.16.0``, then runs ``pip check``. Idempotent: a marker file
  records the pins, and a venv whose marker matches is reused without calling pip. A failed
  install raises a one-line RuntimeError naming the package.
- :func:`reward_parity` checks the TRL-side reward against ``ReasoningEnv.score``.
- :func:`trl_inputs` builds the runner's input dict in the *project* venv: the rendered
  prompts and ground truths of the questions GRPO draws at each iteration (the project's
  :class:`~rllib_exgrpo.core.question_sampler.QuestionSampler`, same seed), so both sides train
  on the same questions in the same order.
- :func:`run_trl` writes the input JSON, runs the runner in the TRL venv and returns its
  ``trl_result.json``.

Nothing here imports ray, TRL or torch at module level.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / "benchmarks" / "out" / "trl-venv"
RUNNER = Path(__file__).resolve().parent / "_trl_grpo_runner.py"

TORCH_VERSION = "2.13.0"
TRL_VERSION = "1.16.0"
#: Same range as the project's setup.py.
MATH_VERIFY_SPEC = "math-verify[antlr4_13_2]>=0.9,<0.10"
MARKER = ".rllib_exgrpo_trl_venv.json"

#: B of tuned_examples/grpo_stream_tiny.yaml (questions per iteration). Every other setting of the
#: TRL run defaults to the runner's DEFAULT_SETTINGS (the same recipe); ``settings`` overrides.
QUESTIONS_PER_STEP = 32


def _pins() -> dict:
    """The package specs of the TRL venv (transformers pinned to the calling venv's)."""
    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("transformers is not installed in the calling environment (run this from the project venv)") from None
    # Install order matters: each step keeps what the earlier ones put in place when it is
    # compatible (pip's only-if-needed upgrades), so torch stays the CPU wheel and trl does
    # not replace transformers by the newest release.
    return {
        "torch": f"torch=={TORCH_VERSION}",
        "transformers": f"transformers=={transformers}",
        "accelerate": "accelerate",
        "datasets": "datasets",
        "math-verify": MATH_VERIFY_SPEC,
        "trl": f"trl=={TRL_VERSION}",
    }


def venv_python(path: os.PathLike | str = DEFAULT_VENV) -> Path:
    return Path(path) / "bin" / "python"


def _pip(python: Path, package: str, spec: str, *extra: str) -> None:
    cmd = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *extra, spec]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        last = next((line.strip() for line in reversed(proc.stdout.splitlines()) if line.strip()), "no output")
        raise RuntimeError(f"TRL venv: installing {package} ({spec}) failed: {last}")


def trl_venv_ready(path: os.PathLike | str = DEFAULT_VENV) -> Optional[str]:
    """The python of the TRL venv at ``path`` when it is there with the current pins, else
    None (nothing is installed: :func:`ensure_trl_venv` makes it)."""
    path = Path(path).resolve()
    python, marker = venv_python(path), path / MARKER
    try:
        return str(python) if python.exists() and json.loads(marker.read_text()) == _pins() else None
    except (OSError, ValueError):
        return None


def ensure_trl_venv(path: os.PathLike | str = DEFAULT_VENV, *, verbose: bool = False) -> str:
    """The python executable of a venv holding TRL 1.16.0 and the runner's needs (created once).

    Raises RuntimeError (one line, naming the package) when an install fails.
    """
    path = Path(path).resolve()
    python = venv_python(path)
    pins = _pins()
    marker = path / MARKER
    if python.exists() and marker.exists():
        try:
            if json.loads(marker.read_text()) == pins:
                return str(python)
        except (OSError, ValueError):
            pass
    if not python.exists():
        if verbose:
            print(f"creating the TRL venv at {path}", file=sys.stderr)
        base = getattr(sys, "_base_executable", None) or sys.executable
        proc = subprocess.run([base, "-m", "venv", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"TRL venv: could not create {path}: {last}")
    marker.unlink(missing_ok=True)
    # torch first, alone: with it in place pip does not fetch a CUDA build for trl/accelerate.
    for package, spec in pins.items():
        if verbose:
            print(f"TRL venv: installing {spec}", file=sys.stderr)
        _pip(python, package, spec)
    # One final resolve of everything together, so that no later install broke an earlier pin.
    proc = subprocess.run([str(python), "-m", "pip", "check"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        first = (proc.stdout.strip().splitlines() or ["pip check failed"])[0]
        raise RuntimeError(f"TRL venv: inconsistent packages after install: {first}")
    marker.write_text(json.dumps(pins, indent=1, sort_keys=True))
    return str(python)


# --------------------------------------------------------------------------- inputs


def trl_inputs(
    seed: int = 0,
    iterations: int = 40,
    *,
    model: str = "tiny",
    output_dir: Optional[str] = None,
    dataset: str = "arithmetic",
    settings: Optional[dict] = None,
) -> dict:
    """The runner's input (see the runner's docstring): the prompts the project's GRPO draws.

    Must run in the project venv. Iteration ``i`` gets the ``questions_per_step`` question
    ids of ``QuestionSampler(ids, seed=seed).next_batch(B)`` (the i-th call), rendered by
    ``ReasoningEnv.prompt_for`` with the model's tokenizer, and their ground truths.
    ``settings``: overrides of the runner's ``DEFAULT_SETTINGS`` (stored as given).
    """
    sys.path.insert(0, str(ROOT))
    from rllib_exgrpo.envs.reasoning_env import ReasoningEnv
    from rllib_exgrpo.models import resolve_model_path
    from rllib_exgrpo.core.question_sampler import QuestionSampler

    settings = dict(settings or {})
    model_path = resolve_model_path(model)
    env = ReasoningEnv({"dataset": dataset, "tokenizer": model_path})
    sampler = QuestionSampler([p.id for p in env.problems], seed=seed)
    its = []
    for _ in range(iterations):
        qids = sampler.next_batch(settings.get("questions_per_step", QUESTIONS_PER_STEP))
        its.append(
            {
                "question_ids": qids,
                "prompts": [env.prompt_for(q) for q in qids],
                "ground_truths": [env.get_problem(q).ground_truth for q in qids],
            }
        )
    return {
        "model_path": str(model_path),
        "output_dir": str(output_dir or ROOT / "benchmarks" / "out" / "trl" / f"seed{seed}"),
        "seed": seed,
        "repo_root": str(ROOT),
        "dataset": dataset,
        "settings": settings,
        "iterations": its,
    }


def _parity_examples(env, model_path: str, n_questions: int, seed: int) -> tuple[list, list]:
    """(question ids, completions): hand-made edge cases plus samples of the model itself."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    problems = env.problems[:n_questions]
    qids, texts = [], []
    for p in problems:
        gt = p.ground_truth
        for t in (
            f"So the answer is \\boxed{{{gt}}}.",
            f"\\boxed{{ {gt} }}",
            f"$\\boxed{{{gt}.0}}$",
            f"\\boxed{{{gt}}} then \\boxed{{{gt}1}}",
            f"\\boxed{{{gt}",
            f"answer: {gt}",
            f"\\boxed{{\\frac{{{gt}}}{{1}}}}",
            f"\\boxed{{x = {gt}}}",
            f"\\boxed {gt}.",
            "",
        ):
            qids.append(p.id)
            texts.append(t)
    tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True).eval()
    torch.manual_seed(seed)
    from rllib_exgrpo.core.tokens import left_pad

    prompts = [tok(env.prompt_for(p.id), add_special_tokens=False)["input_ids"] for p in problems]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    width = ids.shape[1]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=48,
            num_return_sequences=4,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    for k, row in enumerate(out[:, width:]):
        qids.append(problems[k // 4].id)
        texts.append(tok.decode(row, skip_special_tokens=True))
    return qids, texts


def reward_parity(
    python: Optional[str] = None, *, n_questions: int = 16, seed: int = 0, model: str = "tiny", dataset: str = "arithmetic"
) -> dict:
    """Score the same completions with the project's ``ReasoningEnv.score`` (here, the project
    venv) and with the runner's reward in the TRL venv (``--score``); report any difference."""
    sys.path.insert(0, str(ROOT))
    from rllib_exgrpo.envs.reasoning_env import ReasoningEnv
    from rllib_exgrpo.models import resolve_model_path

    python = python or ensure_trl_venv()
    model_path = resolve_model_path(model)
    env = ReasoningEnv({"dataset": dataset, "tokenizer": model_path})
    qids, texts = _parity_examples(env, model_path, n_questions, seed)
    project = env.score(qids, texts)
    spec = {"completions": texts, "ground_truths": [env.get_problem(q).ground_truth for q in qids], "repo_root": str(ROOT)}
    proc = subprocess.run(
        [python, str(RUNNER), "--score", "/dev/stdin"], input=json.dumps(spec), stdout=subprocess.PIPE, text=True, check=True
    )
    trl = json.loads(proc.stdout.strip().splitlines()[-1])
    mismatches = [
        {"completion": t, "ground_truth": g, "project": (r.score, r.parsed), "trl": (s, p)}
        for t, g, r, s, p in zip(texts, spec["ground_truths"], project, trl["scores"], trl["parsed"])
        if r.score != s or r.parsed != p
    ]
    return {"n": len(texts), "correct": sum(r.score for r in project), "mismatches": mismatches}


def run_trl(inputs: dict, *, venv: os.PathLike | str = DEFAULT_VENV, timeout_s: Optional[float] = None) -> dict:
    """Write ``inputs`` next to the output, run the runner in the TRL venv, return its result."""
    python = ensure_trl_venv(venv)
    out = Path(inputs["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "trl_input.json"
    spec.write_text(json.dumps(inputs))
    subprocess.run([python, str(RUNNER), str(spec)], check=True, timeout=timeout_s)
    return json.loads((out / "trl_result.json").read_text())


if __name__ == "__main__":  # python benchmarks/_trl_venv.py [--venv PATH] [--inputs SEED ITERS OUT.json]
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", default=str(DEFAULT_VENV))
    ap.add_argument(
        "--inputs",
        nargs=3,
        metavar=("SEED", "ITERATIONS", "OUT_JSON"),
        help="also write the runner's input for this seed and number of iterations",
    )
    ap.add_argument("--output-dir", default=None, help="output_dir recorded in the input (with --inputs)")
    ap.add_argument(
        "--check-reward", action="store_true", help="also check that the TRL-side reward equals ReasoningEnv.score on sample completions"
    )
    args = ap.parse_args()
    python = ensure_trl_venv(args.venv, verbose=True)
    print(python)
    if args.check_reward:
        report = reward_parity(python)
        print(f"reward parity: {report['n']} completions ({int(report['correct'])} correct), {len(report['mismatches'])} mismatches")
        for m in report["mismatches"][:10]:
            print("  ", m)
        if report["mismatches"]:
            sys.exit(1)
    if args.inputs:
        seed, iters, dest = int(args.inputs[0]), int(args.inputs[1]), Path(args.inputs[2])
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(trl_inputs(seed, iters, output_dir=args.output_dir), indent=1))
        print(dest)
