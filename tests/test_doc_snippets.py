"""Every code snippet of README.md and docs/**/*.md works as written.

* A ```python block is executed at a tiny size: ``ExGRPOConfig.build_algo`` and
  ``tune.Tuner`` are wrapped so that the config they get is shrunk (the quick tiny model,
  4 questions x 4 completions, 12 completion tokens, 4 held-out questions, no remote
  runners; a Tune grid collapsed to its first value, one iteration). The block's own
  keys are not touched, so a misspelled field still fails (``.training()`` rejects it).
  A block containing the comment ``# build only`` is run up to its first ``train()`` /
  ``fit()``, which then stops it (for blocks too slow to run here).
* A ```yaml block that is an experiment (a top-level key holding ``run``) goes through
  ``rllib train file <tmp> --dry-run``; a fragment (a ``config:`` mapping, or a few config
  keys) is merged into ``tuned_examples/exgrpo_tiny.yaml`` first. GPU recipes are dry-run
  with ``--ray-num-gpus`` set to the GPUs they ask for (and 80 GB GPUs); a data file
  that only the recipe's machine has is replaced by the arithmetic family.
  A reward function of a user's own package that is not installed here
  (``my_project.rewards:fn``) is replaced by ``math`` for the dry run.
* A python block whose first line is ``# snippet: skip (<reason>)`` is not run (the reason
  says why it cannot run here, e.g. it needs a GPU). YAML blocks cannot opt out: a GPU
  recipe is still dry-run, with ``--ray-num-gpus``.

Blocks in other languages (bash, text) are not checked here.

The README's GPU recipe is an exact excerpt of ``tuned_examples/exgrpo_qwen.yaml`` (its lines
appear verbatim, in order, and every value it shows is the file's), and the README stays a
product page (at most 250 lines, its "Results in brief" at most 25).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
BASE_RECIPE = REPO / "tuned_examples" / "exgrpo_tiny.yaml"
QUICK_TINY = "tiny:max_steps=30,target_pass1=0.99"  # as tests/conftest.py

#: The shrink applied to every config a python snippet builds or tunes.
TINY = {"questions_per_step": 4, "group_size": 4, "max_response_tokens": 12, "minibatch_size": 16, "heldout_num_questions": 4}
SKIP = re.compile(r"^#\s*snippet:\s*skip\s*\((.+)\)\s*$")


@dataclass
class Snippet:
    path: Path
    line: int
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def snippets(lang: str) -> List[Snippet]:
    out = []
    fence = re.compile(r"^```(\w+)\s*$")
    for path in DOC_FILES:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = fence.match(lines[i])
            if m:
                j = i + 1
                while j < len(lines) and not lines[j].startswith("```"):
                    j += 1
                if m.group(1) == lang:
                    out.append(Snippet(path, i + 1, lang, "\n".join(lines[i + 1 : j]) + "\n"))
                i = j + 1
            else:
                i += 1
    return out


PYTHON = snippets("python")
YAML = snippets("yaml")


def _skip_reason(text: str):
    first = text.lstrip().splitlines()[0] if text.strip() else ""
    m = SKIP.match(first.strip())
    return m.group(1) if m else None


# ---------------------------------------------------------------------------------------
# YAML: rllib train file <tmp> --dry-run
# ---------------------------------------------------------------------------------------
def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def as_experiments(text: str) -> Dict[str, Any]:
    """The snippet as an experiment file: itself, or a fragment merged into the base recipe."""
    doc = yaml.safe_load(text)
    assert isinstance(doc, dict), "a yaml snippet must be a mapping"
    if all(isinstance(v, dict) and "run" in v for v in doc.values()):
        return doc
    base = yaml.safe_load(BASE_RECIPE.read_text())
    name, exp = next(iter(base.items()))
    if set(doc) <= {"config", "stop", "checkpoint_config", "mlflow", "scheduler", "num_samples", "env", "run"}:
        exp = _deep_merge(exp, doc)
    else:  # a few config keys
        exp = _deep_merge(exp, {"config": doc})
    return {name: exp}


def _gpus(config: dict) -> int:
    runners = int(config.get("num_env_runners", 0) or 0)
    learners = int(config.get("num_learners", 0) or 0)
    return int(
        round(runners * float(config.get("num_gpus_per_env_runner", 0) or 0) + learners * float(config.get("num_gpus_per_learner", 0) or 0))
    )


def _foreign(name: Any) -> bool:
    """``"pkg.mod:fn"`` whose top-level package is not installed here (``my_project...``);
    a missing module or function inside an installed package (``envs``) still fails."""
    import importlib.util

    if not isinstance(name, str) or ":" not in name:
        return False
    return importlib.util.find_spec(name.split(":")[0].split(".")[0]) is None


def _localise(experiments: Dict[str, Any]) -> int:
    """Data files only the recipe's machine has -> arithmetic; the GPUs the file asks for."""
    gpus = 0
    for exp in experiments.values():
        cfg = exp.setdefault("config", {})
        env = cfg.get("env_config") or {}
        data = env.get("dataset")
        if isinstance(data, str) and not data.startswith("arithmetic") and not (REPO / data).exists():
            env["dataset"] = "arithmetic"
        held = cfg.get("heldout_dataset")
        if isinstance(held, str) and not held.startswith("arithmetic") and not (REPO / held).exists():
            cfg["heldout_dataset"] = None
        for key in ("reward_fn", "reward_fns"):  # a user's own package that is not installed here
            value = env.get(key)
            if value is not None:
                names = [value] if isinstance(value, str) else list(value)
                names = ["math" if _foreign(n) else n for n in names]
                env[key] = names[0] if isinstance(value, str) else names
        n = _gpus(cfg)
        if n:
            cfg.setdefault("gpu_memory_gb", 80)
        gpus = max(gpus, n)
    return gpus


def dry_run(text: str, tmp_path: Path, monkeypatch) -> tuple[int, str]:
    """``rllib train file <snippet> --dry-run`` in this process; (exit code, output)."""
    import ray

    from rllib_exgrpo.cli import main, preflight

    monkeypatch.chdir(REPO)
    for var in ("RAY_ADDRESS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    if ray.is_initialized():  # preflight would check that (GPU-less) cluster instead
        ray.shutdown()
    experiments = as_experiments(text)
    gpus = _localise(experiments)
    if gpus:  # as on a GPU node: vLLM importable
        real_find = preflight._find
        monkeypatch.setattr(preflight, "_find", lambda m: True if m == "vllm" else real_find(m))
    f = tmp_path / "snippet.yaml"
    f.write_text(yaml.safe_dump(experiments, sort_keys=False))
    argv = ["train", "file", str(f), "--dry-run", "--storage-path", str(tmp_path / "results")]
    if gpus:
        argv += ["--ray-num-gpus", str(gpus)]
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main.main(argv)
    return rc, out.getvalue() + err.getvalue()


@pytest.mark.parametrize("snippet", YAML, ids=[s.id for s in YAML])
def test_yaml_snippet_dry_runs(snippet, tmp_path, monkeypatch):
    rc, log = dry_run(snippet.text, tmp_path, monkeypatch)
    assert rc == 0, f"{snippet.id}: rllib train --dry-run exited {rc}:\n{log[-3000:]}"


# ---------------------------------------------------------------------------------------
# Python: executed at a tiny size
# ---------------------------------------------------------------------------------------
class _BuildOnly(Exception):
    """Raised at a `# build only` block's first train() / fit()."""


def _shrink(config):
    from ray.tune.search.sample import Domain

    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    if not isinstance(config, ExGRPOConfig):
        return config
    config = config.copy(copy_frozen=False)
    for key, value in list(vars(config).items()):  # a Tune grid -> its first value
        if isinstance(value, dict) and "grid_search" in value:
            setattr(config, key, value["grid_search"][0])
        elif isinstance(value, Domain):
            setattr(config, key, value.sample())
    if str(config.model_name_or_path).startswith("tiny"):
        config.model_name_or_path = QUICK_TINY
    config.training(**TINY)
    config.env_runners(num_env_runners=0)
    return config


@pytest.fixture
def tiny_world(monkeypatch, tmp_path, quick_tiny_model):
    """Patches under which a snippet's configs are built and tuned at a tiny size."""
    import ray
    from ray import tune
    from ray.rllib.algorithms.algorithm import Algorithm

    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    monkeypatch.chdir(tmp_path)

    def private_ray():  # started when a snippet first builds or tunes, not before
        if not ray.is_initialized():
            ray.init(
                address="local",
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
            )

    real_build = ExGRPOConfig.build_algo

    def build_algo(self, *a, **k):
        small = _shrink(self)
        private_ray()
        return real_build(small, *a, **k)

    monkeypatch.setattr(ExGRPOConfig, "build_algo", build_algo)
    real_tuner = tune.Tuner

    class TinyTuner(real_tuner):
        def __init__(self, trainable=None, *, param_space=None, run_config=None, **kw):
            private_ray()
            run_config = tune.RunConfig(stop={"training_iteration": 1}, storage_path=str(tmp_path / "tune"), verbose=0)
            super().__init__(trainable, param_space=_shrink(param_space), run_config=run_config, **kw)

    monkeypatch.setattr(tune, "Tuner", TinyTuner)
    return {"Algorithm": Algorithm, "Tuner": TinyTuner, "monkeypatch": monkeypatch}


def _registries():
    from rllib_exgrpo.core import losses

    return (losses.ADVANTAGE_ESTIMATORS, losses.LOSS_AGG_MODES, losses.RATIO_MODES)


def _registered_names() -> list:
    return [set(r.names()) for r in _registries()]


def _forget_names_registered_since(before: list) -> None:
    """A snippet that registers an estimator (docs/ALGORITHMS.md) changes a process-wide
    registry: later tests in this worker expect the built-ins only."""
    for registry, names in zip(_registries(), before):
        for name in set(registry.names()) - names:
            registry.unregister(name)


def run_python(snippet_text: str, world: dict) -> None:
    if "# build only" in snippet_text:

        def stop(*a, **k):
            raise _BuildOnly()

        world["monkeypatch"].setattr(world["Algorithm"], "train", stop)
        world["monkeypatch"].setattr(world["Tuner"], "fit", stop)
    code = compile(snippet_text, "<snippet>", "exec")
    namespace: Dict[str, Any] = {"__name__": "__snippet__"}
    registered = _registered_names()
    try:
        exec(code, namespace)
    except _BuildOnly:
        pass
    finally:
        _forget_names_registered_since(registered)
        algo = namespace.get("algo")
        if algo is not None and hasattr(algo, "stop"):
            try:
                algo.stop()
            except Exception:
                pass


#: The whole file takes ~30 s on 2 idle cores (~95 s when other jobs load them); the
#: longest are the two README python snippets (an algorithm, a Tune trial: 11-39 s each).
@pytest.mark.parametrize("snippet", PYTHON, ids=[s.id for s in PYTHON])
def test_python_snippet_runs(snippet, tiny_world):
    if _skip_reason(snippet.text):
        pytest.skip(_skip_reason(snippet.text))
    run_python(snippet.text, tiny_world)


# ---------------------------------------------------------------------------------------
# The check catches a misspelled key (acceptance: a typo in a snippet fails this file)
# ---------------------------------------------------------------------------------------
def _readme_snippet(lang: str, marker: str) -> Snippet:
    found = [s for s in snippets(lang) if s.path.name == "README.md" and marker in s.text]
    assert found, f"README.md has no {lang} snippet with {marker!r}"
    return found[0]


def test_snippet_inventory():
    assert any(s.path.name == "README.md" for s in PYTHON) and any(s.path.name == "README.md" for s in YAML)
    for s in PYTHON + YAML:
        first = s.text.lstrip().splitlines()[0] if s.text.strip() else ""
        if first.strip().startswith("# snippet:"):
            assert s.lang == "python", f"{s.id}: a yaml snippet cannot opt out (GPU recipes are dry-run)"
            assert SKIP.match(first.strip()), f"{s.id}: `# snippet: skip (<reason>)` needs a reason"


def test_misspelled_python_field_fails_the_check(tiny_world):
    snippet = _readme_snippet("python", "build_algo()")
    assert "questions_per_step=" in snippet.text
    typo = snippet.text.replace("questions_per_step=", "question_per_step=")
    with pytest.raises(Exception, match="question_per_step"):
        run_python(typo, tiny_world)


def test_misspelled_yaml_key_fails_the_check(tmp_path, monkeypatch):
    snippet = _readme_snippet("yaml", "exgrpo-qwen:")
    assert "learner_micro_batch_tokens:" in snippet.text
    rc, log = dry_run(snippet.text, tmp_path, monkeypatch)
    assert rc == 0, log[-2000:]
    typo = snippet.text.replace("learner_micro_batch_tokens:", "learner_micro_batch_token:")
    rc, log = dry_run(typo, tmp_path, monkeypatch)
    assert rc == 2 and "learner_micro_batch_token" in log, log[-2000:]
    # the same for an env_config key of a fragment
    frag = "config:\n  env_config:\n    dataset: arithmetic\n    think_formatt: true\n"
    rc, log = dry_run(frag, tmp_path, monkeypatch)
    assert rc == 2 and "think_formatt" in log, log[-2000:]


# ---------------------------------------------------------------------------------------
# The README shows the GPU recipe as it is, and stays short
# ---------------------------------------------------------------------------------------
def _values_within(part: Any, whole: Any, where: str = "") -> List[str]:
    """Where ``part`` (a parsed excerpt) differs from ``whole`` (the parsed file)."""
    if isinstance(part, dict):
        if not isinstance(whole, dict):
            return [f"{where or '/'}: a mapping in the excerpt, {whole!r} in the file"]
        out = []
        for k, v in part.items():
            if k not in whole:
                out.append(f"{where}/{k}: not in the file")
            else:
                out.extend(_values_within(v, whole[k], f"{where}/{k}"))
        return out
    return [] if part == whole else [f"{where}: {part!r} in the excerpt, {whole!r} in the file"]


def test_readme_gpu_recipe_is_an_exact_excerpt_of_its_file():
    snippet = _readme_snippet("yaml", "exgrpo-qwen:")
    recipe_path = REPO / "tuned_examples" / "exgrpo_qwen.yaml"
    recipe = recipe_path.read_text(encoding="utf-8").splitlines()
    at = 0
    for line in snippet.text.splitlines():
        if not line.strip():
            continue
        assert line in recipe[at:], (
            f"{snippet.id}: {line!r} is not a line of {recipe_path.name} (after line {at}): show the recipe's own lines"
        )
        at = recipe.index(line, at) + 1
    diffs = _values_within(yaml.safe_load(snippet.text), yaml.safe_load("\n".join(recipe)))
    assert not diffs, f"{snippet.id} differs from {recipe_path.name}: {diffs}"


def test_readme_is_a_product_page_of_bounded_length():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250; details go to docs/)"
    start = lines.index("## Results in brief")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    assert end - start <= 25, f"README's 'Results in brief' has {end - start} lines (at most 25)"
    text = "\n".join(lines)
    assert "RAY_AUTH_MODE" not in text, "the README's commands keep Ray's token authentication on"
