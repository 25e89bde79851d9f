"""What ``rllib train`` prints: one line per iteration and trial (Tune's tables only with -v)."""

from __future__ import annotations


from typing import Any, Dict


from rllib_exgrpo.cli.mlflow_logging import new_heldout_step


def iteration_lines_callback_class() -> type:
    """A Tune callback that prints one line per training iteration (Tune's own tables only
    with ``--verbose``): reward, solve rate, held-out accuracy when measured, s/iteration."""
    from ray.tune import Callback

    class IterationLines(Callback):
        def __init__(self):
            self._heldout_seen: Dict[Any, Any] = {}

        def on_trial_result(self, iteration, trials, trial, result, **info):
            runners = result.get("env_runners") or {}
            reward = result.get("reward_mean", runners.get("episode_return_mean"))
            parts = [f"[{trial.trial_id}] iter {result.get('training_iteration', 0):4d}"]
            if reward is not None:
                parts.append(f"reward {float(reward):.3f}")
            if "solve_rate" in result:
                parts.append(f"solve {float(result['solve_rate']):.3f}")
            step = new_heldout_step(self._heldout_seen, trial, result)
            if step is not None:
                parts.append(f"held-out {float(result['heldout']['accuracy']):.3f} (after {step})")
            if "time_this_iter_s" in result:
                parts.append(f"{float(result['time_this_iter_s']):.2f} s/it")
            print("  ".join(parts), flush=True)

        def on_trial_error(self, iteration, trials, trial, **info):
            print(f"[{trial.trial_id}] errored: see {trial.error_file or trial.path}", flush=True)

    return IterationLines
