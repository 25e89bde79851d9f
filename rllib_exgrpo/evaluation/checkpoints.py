"""Reading this project's RLlib checkpoints for evaluation: find the latest checkpoint of a
Tune trial folder, read its config, and load its policy module's weights into an HF model.
"""
from __future__ import annotations

import logging
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple, Union

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
