"""MLflow tracking of ``rllib train`` runs: the ``mlflow:`` section, a local ``sqlite:///``
store by default, and a Tune callback that logs each trial's params and metrics (held-out
metrics only on the iterations that measure them).
"""

from __future__ import annotations


import math
import os
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional


from rllib_exgrpo.cli.config_keys import suggest
from rllib_exgrpo.rllib import rllib_contract as rc

MLFLOW_KEYS = (
    "tracking_uri",
    "experiment_name",
    "tags",
    "save_artifact",
    "log_params_on_trial_end",
    "registry_uri",
)


def _is_file_store(uri: str) -> bool:
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    return scheme in ("", "file")


def build_mlflow(
    name: str, spec: Dict[str, Any], storage_path: str, mlflow_uri: Optional[str], errors: List[str]
) -> Optional[Dict[str, Any]]:
    block = spec.get("mlflow")
    if block is None and mlflow_uri is None:
        return None
    if block is False and mlflow_uri is None:
        return None
    if block is True or block is None or block is False:  # --mlflow-uri wins over `false`
        block = {}
    if not isinstance(block, dict):
        errors.append(f"mlflow: must be a mapping (or true), got {block!r}.")
        return None
    for k in block:
        if k not in MLFLOW_KEYS:
            errors.append(f"mlflow: unknown key {k!r}.{suggest(str(k), MLFLOW_KEYS)} Known: {', '.join(MLFLOW_KEYS)}.")
    settings = {k: v for k, v in block.items() if k in MLFLOW_KEYS}
    uri = mlflow_uri or settings.get("tracking_uri")
    if not uri:
        if "://" in storage_path:
            errors.append("mlflow: give `tracking_uri` when storage_path is a remote URI.")
            return None
        uri = f"sqlite:///{os.path.join(storage_path, 'mlflow.db')}"
    settings["tracking_uri"] = str(uri)
    settings.setdefault("experiment_name", name)
    return settings


_SAFE_MLFLOW_CLS: Optional[type] = None


def _chunks(items: List[Any], n: int) -> Iterable[List[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def mlflow_callback_class() -> type:
    """``MLflowLoggerCallback`` with two fixes for Ray 2.60:

    * ``log_trial_end`` indexes its ``_trial_runs[trial]`` unguarded: a trial whose
      actor dies in ``__init__`` (bad env, bad config) never got a run, and the
      KeyError aborts the whole Tune run instead of marking one trial errored;
    * params and metrics are logged one call (one DB transaction) per key: an
      AlgorithmConfig has ~300 keys and a result ~100 metrics, which cost seconds per
      trial start and per iteration on a sqlite store, blocking Tune's driver loop.
      Here they go in ``log_batch`` calls (falling back to Ray's way on any error).
    """
    global _SAFE_MLFLOW_CLS
    if _SAFE_MLFLOW_CLS is None:
        from ray.air.integrations.mlflow import MLflowLoggerCallback
        from ray.rllib.utils.annotations import override

        class BatchedMLflowLoggerCallback(MLflowLoggerCallback):
            def _log_params_batched(self, run_id: str, config: Dict[str, Any]) -> None:
                client = rc.mlflow_client(self)
                for chunk in _chunks(_mlflow_params(config), 100):
                    client.log_batch(run_id, params=chunk, synchronous=True)

            @override(MLflowLoggerCallback)
            def log_trial_start(self, trial):
                if self.log_params_on_trial_end:
                    return super().log_trial_start(trial)
                if trial not in rc.mlflow_trial_runs(self):
                    tags = dict(self.tags)
                    tags["trial_name"] = str(trial)
                    run = self.mlflow_util.start_run(tags=tags, run_name=str(trial))
                    rc.mlflow_trial_runs(self)[trial] = run.info.run_id
                try:
                    self._log_params_batched(rc.mlflow_trial_runs(self)[trial], trial.config)
                except Exception:  # e.g. a restored trial whose params exist
                    self.mlflow_util.log_params(run_id=rc.mlflow_trial_runs(self)[trial], params_to_log=trial.config)

            @override(MLflowLoggerCallback)
            def log_trial_result(self, iteration: int, trial, result: Dict):
                if trial not in rc.mlflow_trial_runs(self):
                    return
                run_id = rc.mlflow_trial_runs(self)[trial]
                heldout_step = new_heldout_step(self.__dict__.setdefault("_heldout_seen", {}), trial, result)
                metrics = _mlflow_metrics(result, heldout_step)
                try:
                    client = rc.mlflow_client(self)
                    for chunk in _chunks(metrics, 1000):
                        client.log_batch(run_id, metrics=chunk, synchronous=True)
                except Exception:
                    super().log_trial_result(iteration, trial, result)

            @override(MLflowLoggerCallback)
            def log_trial_end(self, trial, failed: bool = False):
                if trial not in rc.mlflow_trial_runs(self):
                    return
                super().log_trial_end(trial, failed=failed)

        _SAFE_MLFLOW_CLS = BatchedMLflowLoggerCallback
    return _SAFE_MLFLOW_CLS


def _mlflow_params(config: Dict[str, Any]) -> list:
    """MLflow ``Param`` entities of a (nested) trial config, flattened with ``/``, values
    cut to MLflow's 6000 characters."""
    from mlflow.entities import Param
    from ray.tune.utils import flatten_dict

    return [Param(str(k), str(v)[:6000]) for k, v in flatten_dict(config).items()]


def _mlflow_metrics(result: Mapping[str, Any], heldout_step: Optional[int]) -> list:
    """MLflow ``Metric`` entities of one Tune result: every numeric (or bool) value at the
    result's step (``timesteps_total``, else ``training_iteration``), stamped now.
    ``heldout/*`` only on the iterations that measured it, at ``heldout_step`` (the step it
    belongs to, 0 for the starting point; None: left out), not repeated (or NaN) in between."""
    from mlflow.entities import Metric
    from ray.tune.result import TIMESTEPS_TOTAL, TRAINING_ITERATION
    from ray.tune.utils import flatten_dict

    step = result.get(TIMESTEPS_TOTAL) or result[TRAINING_ITERATION]
    now = int(time.time() * 1000)
    metrics = []
    for k, v in flatten_dict(result).items():
        if isinstance(v, bool):
            v = float(v)
        at = step
        if str(k).startswith("heldout/"):
            if heldout_step is None:
                continue
            at = heldout_step
        try:
            metrics.append(Metric(str(k), float(v), now, int(at)))
        except (TypeError, ValueError):
            continue
    return metrics


def new_heldout_step(seen: Dict[Any, Any], trial: Any, result: Mapping[str, Any]) -> Optional[int]:
    """The iteration a result's held-out evaluation belongs to, if it was not logged yet."""
    after = (result.get("heldout") or {}).get("after_iteration")
    if after is None or isinstance(after, float) and math.isnan(after):
        return None
    if seen.get(trial) == after:
        return None
    seen[trial] = after
    return int(after)


def make_mlflow_callback(settings: Dict[str, Any]) -> Any:
    return mlflow_callback_class()(**settings)


def prepare_mlflow(settings: Dict[str, Any]) -> None:
    uri = settings["tracking_uri"]
    if _is_file_store(uri):
        # mlflow 3 refuses file stores unless opted in.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).expanduser().parent.mkdir(parents=True, exist_ok=True)
