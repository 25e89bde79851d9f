"""The ``scheduler:`` section of an experiment: Tune's trial scheduler, checked before start.

    scheduler:
      type: asha                 # asha (ASHAScheduler) | fifo (Tune's default)
      metric: heldout/accuracy   # a metric the algorithm reports (checked like stop keys)
      mode: max                  # max | min
      time_attr: training_iteration
      max_t: 12                  # ASHA: trials stop at this time_attr
      grace_period: 4            # ASHA: no trial is stopped before this
      reduction_factor: 2        # ASHA: keep the best 1/reduction_factor at each rung

The metric and mode also pick the best trial that ``rllib train`` prints at the end.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

SCHEDULER_TYPES = ("fifo", "asha")
_ASHA_INTS = ("max_t", "grace_period", "reduction_factor", "brackets")
_KEYS = ("type", "metric", "mode", "time_attr") + _ASHA_INTS


def scheduler_settings(value: Any, errors: List[str]) -> Optional[Dict[str, Any]]:
    """The validated section (None when absent); problems go to ``errors``, one line each."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        errors.append(f"scheduler: must be a mapping with `type`, `metric`, `mode`, got {value!r}.")
        return None
    settings = dict(value)
    for key in settings:
        if key not in _KEYS:
            errors.append(f"scheduler.{key}: unknown key. Known: {', '.join(_KEYS)}.")
    kind = settings.setdefault("type", "fifo")
    if kind not in SCHEDULER_TYPES:
        errors.append(f"scheduler.type: must be one of {list(SCHEDULER_TYPES)}, got {kind!r}.")
    if kind == "asha" and not isinstance(settings.get("metric"), str):
        errors.append("scheduler.metric: ASHA needs the metric it compares trials by (e.g. heldout/accuracy).")
    if settings.get("metric") is not None:
        if settings.get("mode") not in ("max", "min"):
            errors.append(f"scheduler.mode: must be 'max' or 'min' with a metric, got {settings.get('mode')!r}.")
    for key in _ASHA_INTS:
        v = settings.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            errors.append(f"scheduler.{key}: must be a positive integer, got {v!r}.")
        elif v is not None and kind != "asha":
            errors.append(f"scheduler.{key}: only for type asha.")
    if isinstance(settings.get("reduction_factor"), int) and settings["reduction_factor"] < 2:
        errors.append("scheduler.reduction_factor: must be >= 2.")
    settings.setdefault("time_attr", "training_iteration")
    return settings


def make_scheduler(settings: Optional[Mapping[str, Any]]) -> Any:
    """Tune's scheduler object for the section (None: Tune's FIFO default)."""
    if not settings or settings["type"] == "fifo":
        return None
    from ray.tune.schedulers import ASHAScheduler

    kwargs = {k: settings[k] for k in _ASHA_INTS if settings.get(k) is not None}
    return ASHAScheduler(time_attr=settings["time_attr"], **kwargs)
