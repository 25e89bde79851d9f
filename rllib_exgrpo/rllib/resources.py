"""CPUs and GPUs: what a run asks for, fitted to the cluster, and torch threads to match.

Two things RLlib gets wrong for an LLM on a small machine, fixed here in one place:

* **Threads.** Ray starts every worker with ``OMP_NUM_THREADS=1``, so torch runs on one
  thread in a Tune trial, an env runner or a learner, whatever CPUs that actor holds.
  :func:`apply_torch_threads` sets torch's intra-op threads to the CPUs the calling process
  holds (:func:`cpus_held`): a Ray actor's assigned CPUs, or, in a plain driver process,
  the main process's share of the config (:func:`main_process_cpus`). It is called where
  each process starts working: ``ExGRPO.setup`` (the main process: local env runner and
  local learner), ``LLMEnvRunner.__init__`` and ``ExGRPOTorchLearner.build``.

* **Pending forever.** A trial that asks for more CPUs than the cluster has waits in
  PENDING with a warning every minute (``num_env_runners: 2`` on 2 cores asks for 3).
  :func:`fit_resources` checks the request against the cluster before anything starts:
  a CPU shortfall is fitted by giving the main process and every remote actor an equal
  fractional share (logged; they then share cores), a GPU shortfall is an error that
  names the settings to change.

``num_cpus_for_main_process: "auto"`` (the ExGRPO default) gives the main process every
CPU of one node that the env runners and learners leave free, at least 1: a local run with
no remote runners trains on all the machine's cores.

**A Tune search on GPUs.** :func:`plan_trials` decides how many trials of a search run at
once: as many as the GPUs allow (``floor(cluster GPUs / GPUs per trial)``, at most the number
of trials; fewer when each trial asks for a fixed number of CPUs the cluster cannot give that
many times), and divides the CPUs among them: each trial is fitted against its share, so its
``"auto"`` main process takes that share, not every free CPU (which would let one trial run at
a time while the other GPUs idle). A search that asks for no GPU keeps the rule above: an
``"auto"`` trial takes the free CPUs of a node, and the trials run as many at once as fit.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

AUTO = "auto"


class ResourceError(ValueError):
    """The run asks for resources the cluster cannot give (one line, names the keys)."""


@dataclass(frozen=True)
class ClusterResources:
    cpus: float
    gpus: float
    #: CPUs of the largest node: no single bundle (the main process) can be bigger.
    max_node_cpus: float
    #: What these resources are, in messages ("the cluster", or one trial's share of it).
    label: str = "the cluster"

    @classmethod
    def detect(cls) -> "ClusterResources":
        """The running Ray cluster's totals, or this machine's when Ray is not started."""
        try:
            import ray

            if ray.is_initialized():
                totals = ray.cluster_resources()
                nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
                node_cpus = max((n.get("CPU", 0.0) for n in nodes), default=totals.get("CPU", 1.0))
                return cls(float(totals.get("CPU", 1.0)), float(totals.get("GPU", 0.0)), float(node_cpus))
        except Exception:  # noqa: BLE001 - detection must never stop a run
            logger.debug("could not read Ray's cluster resources", exc_info=True)
        cpus = float(_machine_cpus())
        return cls(cpus, float(_machine_gpus()), cpus)


def _machine_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _machine_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def learner_cpus(config) -> float:
    """CPUs of one learner, RLlib's ``"auto"`` rule included (1 without a GPU, else 0)."""
    value = config.num_cpus_per_learner
    if value == AUTO:
        return 1.0 if not config.num_gpus_per_learner else 0.0
    return float(value)


def _remote_cpus(config) -> float:
    runners = config.num_env_runners * float(config.num_cpus_per_env_runner)
    learners = config.num_learners * learner_cpus(config) if config.num_learners > 0 else 0.0
    return runners + learners


def main_process_cpus(config, cluster: Optional[ClusterResources] = None) -> float:
    """CPUs the main process asks for: ``num_cpus_for_main_process``, where ``"auto"``
    means what one node has left after the remote env runners and learners (>= 1). With
    no remote learner the local learner runs there too (RLlib bundles them)."""
    value = config.num_cpus_for_main_process
    if value == AUTO:
        cluster = cluster or ClusterResources.detect()
        value = max(1.0, min(cluster.max_node_cpus, cluster.cpus - _remote_cpus(config)))
    value = float(value)
    if config.num_learners == 0:
        value = max(value, learner_cpus(config))
    return value


def _gpus_requested(config) -> Tuple[float, str]:
    runner_gpus = config.num_env_runners * float(config.num_gpus_per_env_runner)
    learner_count = config.num_learners if config.num_learners > 0 else 1
    learner_gpus = learner_count * float(config.num_gpus_per_learner)
    detail = (
        f"num_env_runners={config.num_env_runners} x num_gpus_per_env_runner={config.num_gpus_per_env_runner:g}"
        f" + {learner_count} learner(s) x num_gpus_per_learner={config.num_gpus_per_learner:g}"
    )
    return runner_gpus + learner_gpus, detail


def fit_resources(config, cluster: Optional[ClusterResources] = None) -> List[str]:
    """Make ``config``'s CPU request fit ``cluster``; return what was changed, as notes.

    Mutates the (unfrozen) ``config``: ``num_cpus_for_main_process`` becomes a number
    (``"auto"`` resolved), and when the request exceeds the cluster's CPUs, the main
    process and each remote env runner / learner get an equal share
    ``floor(100 * cpus / (1 + remote actors)) / 100`` (fractional CPUs: Ray then packs them
    on shared cores). Raises :class:`ResourceError` when GPUs are short, or when the cluster
    cannot give every process even 0.01 CPU.
    """
    cluster = cluster or ClusterResources.detect()
    notes: List[str] = []
    gpus, detail = _gpus_requested(config)
    if gpus > cluster.gpus + 1e-9:
        raise ResourceError(
            f"the config asks for {gpus:g} GPU(s) ({detail}) but the cluster has {cluster.gpus:g}: "
            "lower num_gpus_per_env_runner / num_gpus_per_learner or run on a node with GPUs"
        )
    shared_learner_gpu = shared_learner_gpu_problem(config)
    if shared_learner_gpu:
        raise ResourceError(shared_learner_gpu)
    main = main_process_cpus(config, cluster)
    remote = _remote_cpus(config)
    config.num_cpus_for_main_process = main
    if main + remote <= cluster.cpus + 1e-9:
        return notes
    # Only actors that ask for CPUs share them (a GPU learner's "auto" CPUs are 0).
    runners = config.num_env_runners if float(config.num_cpus_per_env_runner) > 0 else 0
    learners = config.num_learners if config.num_learners > 0 and learner_cpus(config) > 0 else 0
    actors = runners + learners
    share = math.floor(100 * cluster.cpus / (1 + actors)) / 100
    if share < 0.01:
        raise ResourceError(
            f"{1 + actors} processes (main + num_env_runners={config.num_env_runners} + "
            f"num_learners={config.num_learners}) cannot share {cluster.cpus:g} CPU(s): lower num_env_runners"
        )
    notes.append(
        f"the config asks for {main + remote:g} CPUs (main process {main:g}, "
        f"num_env_runners={config.num_env_runners} x {float(config.num_cpus_per_env_runner):g}"
        + (f", num_learners={config.num_learners} x {learner_cpus(config):g}" if config.num_learners > 0 else "")
        + f") but {cluster.label} has {cluster.cpus:g}: giving the main process and each of the {actors} "
        f"remote actor(s) {share:g} CPU (they share cores; set num_cpus_per_env_runner / "
        "num_cpus_per_learner / num_cpus_for_main_process to choose yourself)"
    )
    config.num_cpus_for_main_process = share
    if runners:
        config.num_cpus_per_env_runner = share
    # With no remote learner RLlib bundles the local one with the main process and asks
    # for max(num_cpus_per_learner, main): that share must shrink too.
    if learners or config.num_learners == 0:
        config.num_cpus_per_learner = share
    return notes


def shared_learner_gpu_problem(config) -> Optional[str]:
    """A fractional ``num_gpus_per_learner`` with several learners: Ray may put two learners
    of the same run on one GPU, and NCCL (DDP's and DeepSpeed's process group) refuses two
    ranks on one device. Fractions are for sharing a GPU between trials (one learner each)."""
    per = float(config.num_gpus_per_learner or 0)
    if config.num_learners > 1 and 0 < per < 1:
        return (
            f"num_gpus_per_learner: {per:g} with num_learners: {config.num_learners}: two learners of one "
            "trial could land on the same GPU, which NCCL refuses (one device per rank); give each learner a "
            "whole GPU (num_gpus_per_learner: 1), or use num_learners: 1 to let trials share GPUs"
        )
    return None


def trial_gpus(config) -> float:
    """GPUs one trial (one run of ``config``) holds: its remote env runners'
    (``num_env_runners x num_gpus_per_env_runner``) and its learners'
    (``num_learners x num_gpus_per_learner``; with ``num_learners: 0`` the local learner's
    ``num_gpus_per_learner``, which RLlib bundles with the main process). ``colocate`` runs
    have no remote env runners: their learners' GPUs are all."""
    return _gpus_requested(config)[0]


def trial_cpus(config) -> float:
    """CPUs one trial of a fitted ``config`` holds (``num_cpus_for_main_process`` a number):
    the main process (with the local learner when there is no remote one) and the remote env
    runners and learners."""
    return main_process_cpus(config, ClusterResources(0.0, 0.0, 0.0)) + _remote_cpus(config)


@dataclass(frozen=True)
class TrialPlan:
    """How many trials of a search run at once, and each one's GPUs and CPUs
    (:func:`plan_trials`)."""

    trials: int
    concurrent: int
    gpus_per_trial: float
    cpus_per_trial: float
    cluster: ClusterResources
    #: Why fewer run at once than the GPUs allow ("" when the GPUs or the trials decide).
    limit: str = ""
    #: What fitting the config changed (:func:`fit_resources`' notes).
    notes: Tuple[str, ...] = ()

    def line(self) -> str:
        """``4 trials, 4 at once (1 GPU each of 4; 16 CPUs each of 64)``."""
        at_once = "1 at a time" if self.concurrent == 1 else f"{self.concurrent} at once"
        c = self.cluster
        if self.gpus_per_trial > 0:
            gpus = f"{_count(self.gpus_per_trial, 'GPU')} each of {c.gpus:g}"
            if self.gpus_per_trial < 1:
                gpus += f", {math.floor(1 / self.gpus_per_trial + 1e-9)} trials to a GPU"
        else:
            gpus = "no GPUs"
        cpus = f"{_count(self.cpus_per_trial, 'CPU')} each of {c.cpus:g}"
        return f"{_count(self.trials, 'trial')}, {at_once} ({gpus}; {cpus}){': ' + self.limit if self.limit else ''}"


def _count(n: float, what: str) -> str:
    return f"{n:g} {what}" + ("" if float(n) <= 1 else "s")


def plan_trials(config, trials: int, cluster: Optional[ClusterResources] = None) -> TrialPlan:
    """Fit ``config`` (as :func:`fit_resources`, mutating it) for a search of ``trials`` trials
    and say how many run at once.

    * GPU trials: ``concurrent = min(trials, floor(cluster GPUs / GPUs per trial))``, lowered
      only when the trial's CPUs are fixed (``num_cpus_for_main_process`` a number) and the
      cluster cannot give them that many times. The CPUs are divided: each trial is fitted
      against ``floor(100 x cluster CPUs / concurrent) / 100`` (at most one node's), so an
      ``"auto"`` main process takes that share (a fraction of a core where there are fewer
      cores than trials at once: they share cores).
    * CPU-only trials (and a single trial): fitted against the whole cluster, as before;
      ``concurrent`` is how many such trials its CPUs hold (an ``"auto"`` trial takes a whole
      node's free CPUs, so one at a time on one node).

    Raises :class:`ResourceError` as :func:`fit_resources` does.
    """
    cluster = cluster or ClusterResources.detect()
    trials = max(1, int(trials))
    gpus = trial_gpus(config)
    if gpus <= 0 or gpus > cluster.gpus + 1e-9 or trials == 1:
        notes = fit_resources(config, cluster)  # a GPU shortfall raises here
        per = trial_cpus(config)
        concurrent = min(trials, max(1, math.floor(cluster.cpus / per + 1e-9))) if per > 0 else trials
        if gpus > 0:
            concurrent = min(concurrent, max(1, math.floor(cluster.gpus / gpus + 1e-9)))
        return TrialPlan(trials, concurrent, gpus, per, cluster, notes=tuple(notes))
    concurrent = min(trials, max(1, math.floor(cluster.gpus / gpus + 1e-9)))
    limit = ""
    if config.num_cpus_for_main_process != AUTO:
        fixed = main_process_cpus(config, cluster) + _remote_cpus(config)
        by_cpus = max(1, math.floor(cluster.cpus / fixed + 1e-9)) if fixed > 0 else concurrent
        if by_cpus < concurrent:
            limit = (
                f"the GPUs would hold {concurrent}, but each trial asks for {fixed:g} CPUs "
                f"(num_cpus_for_main_process: {float(config.num_cpus_for_main_process):g}; "
                "'auto' divides the CPUs among the trials instead)"
            )
            concurrent = by_cpus
    against = cluster
    if concurrent > 1:
        share = math.floor(100 * cluster.cpus / concurrent) / 100
        against = ClusterResources(
            share,
            cluster.gpus,
            min(cluster.max_node_cpus, share),
            label=f"each of the {concurrent} trials at once ({cluster.cpus:g} CPUs / {concurrent})",
        )
        rest = math.floor(100 * (min(cluster.max_node_cpus, share) - _remote_cpus(config))) / 100
        if config.num_cpus_for_main_process == AUTO and 0.01 <= rest < 1:
            # fewer cores than trials at once: "auto" takes the share left, below one core
            config.num_cpus_for_main_process = rest
    notes = fit_resources(config, against)
    return TrialPlan(trials, concurrent, gpus, trial_cpus(config), cluster, limit, tuple(notes))


def cpus_held(fallback: float) -> float:
    """CPUs Ray assigned to the calling actor or task; ``fallback`` in a plain driver."""
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            if ctx.worker.mode == ray.WORKER_MODE:
                return float(ctx.get_assigned_resources().get("CPU", fallback))
    except Exception:  # noqa: BLE001 - a thread count must never stop a run
        logger.debug("could not read the actor's CPUs", exc_info=True)
    return float(fallback)


def torch_threads(cpus: float) -> int:
    """Intra-op threads for ``cpus`` CPUs: the whole cores held, at least one."""
    return max(1, int(math.floor(float(cpus) + 1e-9)))


#: The CUDA caching allocator's setting every process of a run gets unless the user set
#: ``PYTORCH_CUDA_ALLOC_CONF``: segments that grow in place instead of new fixed-size ones,
#: so the varying sizes of packed passes and vocabulary chunks do not fragment the card
#: (what verl and NeMo RL set too; the memory plan's reserve assumes it).
CUDA_ALLOC_CONF = "expandable_segments:True"


def set_cuda_allocator_default() -> str:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to :data:`CUDA_ALLOC_CONF` where the user has not set
    it; returns the value in force. Torch reads it when its CUDA allocator first allocates,
    which in a learner or env runner happens after this runs (the model is built on the
    CPU and moved later). Harmless without a GPU."""
    return os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)


def apply_threads_for(config, role: str, worker_index: int = 0) -> int:
    """Size torch's threads for one of the run's processes (the one rule, used by
    ``ExGRPO.setup``, ``LLMEnvRunner.__init__`` and ``ExGRPOTorchLearner.build``), and set
    the CUDA allocator's default there (:func:`set_cuda_allocator_default`).

    ``role``: ``"main"``, ``"env_runner"`` (``worker_index`` 0 is the local runner, in the
    main process) or ``"learner"`` (remote when ``num_learners > 0``, else local). A Ray
    actor uses what Ray assigned it; the numbers here are the fallback of a plain driver.
    """
    set_cuda_allocator_default()
    if role == "env_runner" and worker_index:
        cpus, who = float(config.num_cpus_per_env_runner), f"env runner {worker_index}"
    elif role == "learner" and config.num_learners > 0:
        cpus, who = learner_cpus(config), "learner"
    elif role in ("main", "env_runner", "learner"):
        cpus, who = main_process_cpus(config), f"main process ({role})"
    else:
        raise ValueError(f"role must be 'main', 'env_runner' or 'learner', got {role!r}")
    return apply_torch_threads(cpus, who=who)


def apply_torch_threads(fallback_cpus: float, *, who: str = "process") -> int:
    """Set torch's threads to the CPUs this process holds (see :func:`cpus_held`)."""
    import torch

    cpus = cpus_held(fallback_cpus)
    n = torch_threads(cpus)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    logger.info("%s: %g CPU(s) held -> %d torch thread(s)", who, cpus, n)
    return n


def runner_device(config, cuda_available: Optional[bool] = None) -> "torch.device":
    """Where an env runner keeps its policy module: its GPU when it was given one
    (``num_gpus_per_env_runner > 0``; Ray then sets ``CUDA_VISIBLE_DEVICES`` to it, so it is
    ``cuda:0`` inside the actor) and CUDA is there, else the CPU. RLlib's own
    SingleAgentEnvRunner places its module the same way; without this the HF backend's
    generation and every scoring pass (behaviour log-probs, the lowest-entropy choice of a
    replayed trajectory) would run on the runner's CPU next to an idle GPU."""
    import torch

    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if float(getattr(config, "num_gpus_per_env_runner", 0) or 0) > 0 and cuda_available:
        return torch.device("cuda", 0)
    return torch.device("cpu")
