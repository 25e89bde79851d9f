"""Reading this project's RLlib checkpoints for evaluation: find the latest checkpoint of a
Tune trial folder, read its config, and load its policy module into an HF model.

RLlib's checkpoint API does the work where it has one: ``get_checkpoint_info`` reads an
algorithm checkpoint's ``rllib_checkpoint.json`` and lists its module IDs, the component
names (``learner_group/learner/rl_module/<module_id>``) and file names are RLlib's
constants, and ``RLModule.from_checkpoint`` rebuilds the trained module (its class and
constructor args as saved) and restores its weights, without Ray and without building the
Algorithm (``Algorithm.from_checkpoint`` would start env runners and a learner group).
RLlib imports are local to the functions: importing this module stays cheap.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple, Union

from rllib_exgrpo.models.loading import load_tokenizer

logger = logging.getLogger(__name__)


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


# Tune names an algorithm checkpoint ``checkpoint_<index>`` inside the trial folder.
_CKPT_NUM = re.compile(r"checkpoint_(\d+)$")
# = ``Checkpointable.CLASS_AND_CTOR_ARGS_FILE_NAME`` (a test checks it against RLlib's).
_CTOR_FILE = "class_and_ctor_args.pkl"


def _is_module_dir(p: Path) -> bool:
    """An RLModule folder as ``Checkpointable.save_to_path`` writes it."""
    from ray.rllib.core.rl_module.rl_module import RLModule

    return (p / RLModule.CLASS_AND_CTOR_ARGS_FILE_NAME).is_file() and any(p.glob(RLModule.STATE_FILE_NAME + ".*"))


def _is_algo_dir(p: Path) -> bool:
    """Cheap layout test for a new-API-stack algorithm checkpoint (before asking RLlib:
    ``get_checkpoint_info`` logs a warning and raises on any other folder)."""
    from ray.rllib.algorithms.algorithm import Algorithm
    from ray.rllib.core import COMPONENT_LEARNER_GROUP

    return (p / Algorithm.METADATA_FILE_NAME).is_file() and (p / COMPONENT_LEARNER_GROUP).is_dir()


def _latest_checkpoint(p: Path) -> Optional[Path]:
    # Hand-written: RLlib has no API for a Tune trial folder, and Tune's
    # ``Result.from_path`` needs the trial's result.json / progress.csv (absent from a folder
    # copied without them) and would return a half-written last checkpoint_* as well.
    found = []
    for child in p.iterdir() if p.is_dir() else []:
        m = _CKPT_NUM.search(child.name)
        if m and child.is_dir() and _is_algo_dir(child):
            found.append((int(m.group(1)), child))
    return max(found)[1] if found else None


class RunFolderError(FileNotFoundError):
    """A run folder of several trials where one checkpoint was asked for (one line)."""


def _single_trial_checkpoint(p: Path) -> Optional[Path]:
    """A Tune run folder (``storage_path/<experiment>``) with one trial: that trial's latest
    checkpoint. None when no subfolder is a trial with checkpoints; several trials raise
    ``FileNotFoundError`` naming them (which one is the caller's choice: a trial folder, or
    ``--best`` for the highest ``heldout/accuracy``)."""
    trials = sorted(child for child in p.iterdir() if child.is_dir() and _latest_checkpoint(child) is not None)
    if len(trials) > 1:
        names = ", ".join(t.name for t in trials[:3]) + (", ..." if len(trials) > 3 else "")
        raise RunFolderError(
            f"{p} is a run folder of {len(trials)} trials ({names}): name one trial folder, or pass --best "
            "for the checkpoint of highest heldout/accuracy"
        )
    return _latest_checkpoint(trials[0]) if trials else None


def _module_dir_of(algo: Path) -> Path:
    """The learner's RLModule folder of an algorithm checkpoint (``default_policy`` first)."""
    from ray.rllib.core import COMPONENT_LEARNER, COMPONENT_LEARNER_GROUP, COMPONENT_RL_MODULE, DEFAULT_MODULE_ID
    from ray.rllib.utils.checkpoints import get_checkpoint_info

    try:
        meta = get_checkpoint_info(str(algo))
    except ValueError as e:  # RLlib's "not a valid checkpoint"
        raise FileNotFoundError(f"{algo}: {e}") from None
    module_ids = set(meta.get("module_ids") or ())
    rl_module = algo / COMPONENT_LEARNER_GROUP / COMPONENT_LEARNER / COMPONENT_RL_MODULE
    preferred = [DEFAULT_MODULE_ID] if DEFAULT_MODULE_ID in module_ids else []
    for module_id in preferred + sorted(module_ids - {DEFAULT_MODULE_ID}):
        if _is_module_dir(rl_module / module_id):
            return rl_module / module_id
    raise FileNotFoundError(f"checkpoint {algo} holds no learner module state under {rl_module}")


def find_checkpoint(path: Union[str, os.PathLike]) -> Tuple[Optional[Path], Path]:
    """(algorithm checkpoint folder or None, module folder) for ``path``.

    ``path`` may be an algorithm checkpoint (``algo.save_to_path`` / Tune's
    ``checkpoint_*``), a Tune trial folder (its highest-numbered ``checkpoint_*`` is used),
    a run folder of one trial (that trial's), or an RLModule folder (``.../learner_group/learner/rl_module/default_policy``); a
    relative ``path`` is relative to the working directory, and the folders returned are
    absolute. Raises ``FileNotFoundError`` when ``path`` is none of these.
    """
    # Absolute before RLlib sees it: RLlib reads checkpoints through pyarrow, which takes a
    # relative path for a URI without a scheme and fails ("URI has empty scheme").
    p = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    if not p.is_dir():
        raise FileNotFoundError(f"not a checkpoint folder: {p}")
    algo = p if _is_algo_dir(p) else (_latest_checkpoint(p) or _single_trial_checkpoint(p))
    if algo is None:
        if _is_module_dir(p):
            return None, p
        raise FileNotFoundError(
            f"{p} is not an RLlib checkpoint of this project: expected rllib_checkpoint.json and "
            "learner_group/ (algo.save_to_path), checkpoint_* subfolders (a Tune trial), a run folder of one "
            "trial, or a module folder"
        )
    return algo, _module_dir_of(algo)


def is_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a folder :func:`find_checkpoint` understands."""
    try:
        find_checkpoint(path)
        return True
    except (FileNotFoundError, OSError):
        return False


def _ctor_info(folder: Path) -> dict:
    """``{"class": ..., "ctor_args_and_kwargs": (args, kwargs)}`` that ``save_to_path`` wrote.

    Hand-read: RLlib reads this file only inside ``Checkpointable.from_checkpoint``, which
    then constructs the object; there is no API that returns an algorithm's class and
    config, or a module's ``model_config``, without building it (and loading weights).
    """
    with open(folder / _CTOR_FILE, "rb") as fh:
        return pickle.load(fh)


def read_checkpoint(path: Union[str, os.PathLike]) -> CheckpointInfo:
    """Locate a checkpoint's module and read its algorithm config (no weights loaded)."""
    algo_dir, module_dir = find_checkpoint(path)
    config: dict = {}
    algorithm = None
    if algo_dir is not None and (algo_dir / _CTOR_FILE).is_file():
        ctor = _ctor_info(algo_dir)
        algorithm = getattr(ctor.get("class"), "__name__", None)
        # Algorithm.get_ctor_args_and_kwargs(): ((config.get_state(),), {})
        args = ctor.get("ctor_args_and_kwargs", ((), {}))[0]
        if args and isinstance(args[0], dict):
            config = args[0]
        elif args and hasattr(args[0], "to_dict"):
            config = args[0].to_dict()
    # RLModule.get_ctor_args_and_kwargs(): ((), {..., "model_config": ...})
    kwargs = _ctor_info(module_dir).get("ctor_args_and_kwargs", ((), {}))[1]
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


def load_policy_from_checkpoint(path: Union[str, os.PathLike], *, device: Optional[str] = None, info: Optional[CheckpointInfo] = None):
    """``(model, tokenizer)`` of the policy saved in an RLlib checkpoint of this project.

    ``RLModule.from_checkpoint`` rebuilds the learner's module from the module folder (the
    saved module class and ``model_config``: the base HF model, then the saved weights on
    top; a ZeRO-3 checkpoint's weight shards consolidated first, :func:`restore_module`);
    its HF model is returned, in eval mode with the KV cache on, and the tokenizer is
    the base model's. Neither Ray nor the Algorithm is started.
    """
    info = info or read_checkpoint(path)
    module = restore_module(info)
    model = module.plain_model()  # a LoRA learner's merged, under the plain names
    if module.model_config.get("gradient_checkpointing"):  # a learner setting: off for generation
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()
    model.config.use_cache = True
    model.eval()
    if device:
        model.to(device)
    tokenizer = load_tokenizer(info.model_name_or_path)
    return model, tokenizer


def zero3_shard_folder(module_path: Union[str, os.PathLike]) -> Optional[Path]:
    """The per-rank weight partitions of a ZeRO-3 checkpoint's module folder (its module
    state is a manifest then: :mod:`rllib_exgrpo.rllib.zero3_weights`), else None."""
    # lazy: the CLI's parsers import evaluation/; Ray loads only when a command runs
    from rllib_exgrpo.rllib import zero3_weights

    module = Path(module_path)
    learner = module.parent.parent  # <learner>/rl_module/<module id>
    shards = learner / zero3_weights.MODULE_SHARD_FOLDER / module.name
    return shards if shards.is_dir() else None


def restore_module(info: CheckpointInfo):
    """The learner's module of a checkpoint, as saved (class, ``model_config``, weights).

    ``LLMTorchRLModule.from_checkpoint`` does the work. The module folder of a ZeRO-3
    checkpoint holds a manifest, each learner's slice of the weights lying beside it:
    :func:`rllib_exgrpo.rllib.zero3_weights.consolidate` writes the full weights to a
    temporary module folder first (removed once loaded).
    """
    import shutil
    import tempfile

    # lazy: the CLI's parsers import evaluation/; Ray loads only when a command runs
    from rllib_exgrpo.rllib import zero3_weights
    from rllib_exgrpo.rllib.module import LLMTorchRLModule

    # Calling it on LLMTorchRLModule checks that the saved class is one. The saved
    # constructor args are used as they are: RLlib can only override arguments that the
    # class' signature names, and TorchRLModule's is (*args, **kwargs).
    # RLlib loads the weights with strict=False (TorchRLModule.set_state); the module is
    # rebuilt from the model_config it was saved with, so the keys match unless the base
    # model changed on disk since training (a changed shape still raises).
    module_path = Path(info.module_path)
    if zero3_shard_folder(module_path) is None:
        return LLMTorchRLModule.from_checkpoint(str(module_path))
    tmp = Path(tempfile.mkdtemp(prefix="zero3-full-"))
    try:
        written = zero3_weights.consolidate(module_path.parent.parent, tmp)
        if module_path.name not in written:
            raise FileNotFoundError(f"{module_path}: no ZeRO-3 manifest for module {module_path.name!r}")
        return LLMTorchRLModule.from_checkpoint(str(written[module_path.name]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


#: What ``--best`` ranks checkpoints by (the recipes' ``checkpoint_score_attribute``).
BEST_METRIC = "heldout/accuracy"


def best_checkpoint(path: Union[str, os.PathLike], metric: str = BEST_METRIC, mode: str = "max") -> Tuple[Path, float]:
    """``(checkpoint folder, its metric)``: the best checkpoint kept in a run (experiment)
    folder, or in one of its trial folders, by ``metric`` as recorded when the checkpoint was
    saved (Tune's checkpoint records in the experiment state, read with
    ``ray.tune.ExperimentAnalysis``). Raises ``FileNotFoundError`` (one line) when there is no
    run or no checkpoint carries the metric."""
    from ray.tune import ExperimentAnalysis

    p = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    run = p if any(p.glob("experiment_state-*.json")) else p.parent
    if not any(run.glob("experiment_state-*.json")):
        raise FileNotFoundError(f"{p}: no Tune run here (a run folder with experiment_state-*.json, or one of its trial folders)")
    analysis = ExperimentAnalysis(str(run))
    found = []
    for trial in analysis.trials:
        if p != run and Path(trial.path) != p:
            continue
        for saved in trial.run_metadata.checkpoint_manager.best_checkpoint_results:
            value = _lookup(saved.metrics, metric)
            if value is not None and value == value:  # not NaN
                found.append((float(value), Path(saved.checkpoint.path)))
    if not found:
        raise FileNotFoundError(
            f"{p}: no kept checkpoint recorded {metric!r} (set heldout_dataset, and checkpoints at iterations with a held-out evaluation)"
        )
    value, folder = (max if mode == "max" else min)(found, key=lambda x: x[0])
    return folder, value


def _lookup(metrics: dict, key: str):
    """``metrics[key]`` of Tune's nested result dict (``"heldout/accuracy"``)."""
    node = metrics
    for part in key.split("/"):
        if not isinstance(node, dict) or part not in node:
            return metrics.get(key) if isinstance(metrics, dict) else None
        node = node[part]
    return node
