"""CPUs/GPUs fitted to the cluster before start; torch threads follow the CPUs held."""

import os

import pytest
import torch

from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
from rllib_exgrpo.rllib.resources import (
    CUDA_ALLOC_CONF,
    runner_device,
    ClusterResources,
    ResourceError,
    fit_resources,
    main_process_cpus,
    torch_threads,
)


def _cfg(**resources):
    cfg = ExGRPOConfig()
    env_runner_keys = {"num_env_runners", "num_cpus_per_env_runner", "num_gpus_per_env_runner"}
    cfg.env_runners(**{k: v for k, v in resources.items() if k in env_runner_keys})
    cfg.learners(**{k: v for k, v in resources.items() if k in {"num_learners", "num_cpus_per_learner", "num_gpus_per_learner"}})
    if "num_cpus_for_main_process" in resources:
        cfg.resources(num_cpus_for_main_process=resources["num_cpus_for_main_process"])
    return cfg


TWO_CORES = ClusterResources(cpus=2, gpus=0, max_node_cpus=2)


def test_auto_main_process_takes_the_cores_the_remote_actors_leave():
    assert _cfg().num_cpus_for_main_process == "auto"
    assert main_process_cpus(_cfg(), TWO_CORES) == 2  # local run: every core
    assert main_process_cpus(_cfg(num_env_runners=1), TWO_CORES) == 1
    big = ClusterResources(cpus=64, gpus=0, max_node_cpus=16)
    assert main_process_cpus(_cfg(num_env_runners=4), big) == 16  # one node at most
    assert main_process_cpus(_cfg(num_cpus_for_main_process=3), big) == 3


def test_fitting_resolves_auto_and_keeps_a_request_that_fits():
    cfg = _cfg()
    assert fit_resources(cfg, TWO_CORES) == []
    assert cfg.num_cpus_for_main_process == 2


def test_two_runners_on_two_cores_share_the_cores_instead_of_pending_forever():
    cfg = _cfg(num_env_runners=2)
    notes = fit_resources(cfg, TWO_CORES)
    assert len(notes) == 1 and "cluster has 2" in notes[0] and "num_cpus_per_env_runner" in notes[0]
    assert cfg.num_cpus_per_env_runner == cfg.num_cpus_for_main_process == 0.66
    # RLlib bundles the local learner with the main process at max(learner, main)
    assert cfg.num_cpus_per_learner == 0.66
    from rllib_exgrpo.rllib.algorithm import ExGRPO

    bundles = ExGRPO.default_resource_request(cfg).bundles
    assert sum(b.get("CPU", 0) for b in bundles) <= 2
    # fitting again is a no-op (the CLI fits, then Tune asks default_resource_request)
    assert fit_resources(cfg, TWO_CORES) == []


def test_gpu_shortfall_is_one_clear_error_naming_the_keys():
    with pytest.raises(ResourceError, match=r"asks for 4 GPU.*num_gpus_per_env_runner.*cluster has 0"):
        fit_resources(_cfg(num_env_runners=4, num_gpus_per_env_runner=1), TWO_CORES)
    with pytest.raises(ResourceError, match="num_gpus_per_learner"):
        fit_resources(_cfg(num_learners=2, num_gpus_per_learner=1), ClusterResources(8, 1, 8))
    assert fit_resources(_cfg(num_learners=2, num_gpus_per_learner=1), ClusterResources(8, 2, 8)) == []


def test_torch_threads_are_the_whole_cores_held():
    assert [torch_threads(c) for c in (0, 0.5, 0.66, 1, 1.99, 2, 7.0)] == [1, 1, 1, 1, 1, 2, 7]


@pytest.mark.usefixtures("ray_local")
def test_an_actor_gets_as_many_torch_threads_as_cpus_it_holds():
    import ray

    @ray.remote
    def threads_in_task():
        from rllib_exgrpo.rllib.resources import apply_torch_threads

        torch.set_num_threads(3)  # whatever it was before
        return apply_torch_threads(fallback_cpus=99), torch.get_num_threads()

    # the CPUs Ray assigned win over the fallback (which only a plain driver uses)
    assert ray.get(threads_in_task.options(num_cpus=2).remote()) == (2, 2)
    assert ray.get(threads_in_task.options(num_cpus=0.5).remote()) == (1, 1)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_env_runner_and_learner_actors_use_their_cpus(quick_tiny_model):
    """Real actors of a built algorithm: a 2-CPU env runner, then a 2-CPU remote learner."""
    base = dict(
        model_name_or_path=quick_tiny_model,
        questions_per_step=2,
        group_size=2,
        max_prompt_tokens=64,
        max_response_tokens=4,
        minibatch_size=4,
    )
    cfg = (
        ExGRPOConfig()
        .training(**base)
        .env_runners(num_env_runners=1, num_cpus_per_env_runner=2)
        .learners(num_cpus_per_learner=0)
        .resources(num_cpus_for_main_process=0)
    )
    algo = cfg.build_algo()
    try:
        assert algo.env_runner_group.foreach_env_runner(lambda r: torch.get_num_threads(), local_env_runner=False) == [2]
        assert algo.env_runner_group.foreach_env_runner(lambda r: os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), local_env_runner=False) == [
            CUDA_ALLOC_CONF
        ]
        algo.train()
    finally:
        algo.stop()
    cfg = ExGRPOConfig().training(**base).learners(num_learners=1, num_cpus_per_learner=2).resources(num_cpus_for_main_process=0)
    algo = cfg.build_algo()
    try:
        results = algo.learner_group.foreach_learner(lambda learner: torch.get_num_threads())
        assert [r.get() for r in results] == [2]
        results = algo.learner_group.foreach_learner(lambda learner: os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        assert [r.get() for r in results] == [CUDA_ALLOC_CONF]
        algo.train()
    finally:
        algo.stop()


def test_a_runner_given_a_gpu_keeps_its_module_there():
    cfg = ExGRPOConfig()
    assert runner_device(cfg, cuda_available=True).type == "cpu"  # no GPU asked for
    cfg.env_runners(num_gpus_per_env_runner=1)
    assert runner_device(cfg, cuda_available=True) == torch.device("cuda", 0)
    assert runner_device(cfg, cuda_available=False).type == "cpu"  # asked, but no CUDA here


def test_the_cuda_allocator_default_yields_to_the_users_setting(monkeypatch):
    """Every process of a run sets expandable segments, unless the user chose otherwise."""
    from rllib_exgrpo.rllib.resources import set_cuda_allocator_default

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert set_cuda_allocator_default() == CUDA_ALLOC_CONF == os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert set_cuda_allocator_default() == "max_split_size_mb:128"


# ------------------------------------------------------------------ a search on GPUs

EIGHT_GPU_NODE = ClusterResources(cpus=64, gpus=8, max_node_cpus=64)


def _plan(trials, cluster=EIGHT_GPU_NODE, **resources):
    from rllib_exgrpo.rllib.resources import plan_trials

    cfg = _cfg(**resources)
    return plan_trials(cfg, trials, cluster), cfg


def test_a_gpu_search_runs_as_many_trials_at_once_as_the_gpus_allow_and_divides_the_cpus():
    # one learner GPU per trial: 4 trials on 8 GPUs all at once, 64 CPUs divided by 4
    plan, cfg = _plan(4, num_learners=1, num_gpus_per_learner=1)
    assert (plan.concurrent, plan.gpus_per_trial, plan.cpus_per_trial) == (4, 1, 16)
    assert cfg.num_cpus_for_main_process == 16  # "auto" resolved to the trial's share
    assert plan.line() == "4 trials, 4 at once (1 GPU each of 8; 16 CPUs each of 64)"
    assert not plan.notes
    # the local learner (num_learners: 0) holds its GPU in the main process's bundle
    assert _plan(4, num_learners=0, num_gpus_per_learner=1)[0].concurrent == 4
    # more trials than GPUs: the GPUs decide, the CPUs are divided among those at once
    plan, cfg = _plan(12, num_learners=1, num_gpus_per_learner=1)
    assert plan.line() == "12 trials, 8 at once (1 GPU each of 8; 8 CPUs each of 64)"
    # runners and learners: 4 + 2 GPUs per trial, one trial at a time, every CPU the runners leave
    plan, cfg = _plan(4, num_learners=2, num_gpus_per_learner=1, num_env_runners=4, num_gpus_per_env_runner=1)
    assert (plan.concurrent, plan.gpus_per_trial) == (1, 6)
    assert cfg.num_cpus_for_main_process == 60 and plan.line().startswith("4 trials, 1 at a time (6 GPUs each of 8")


def test_fixed_cpus_per_trial_limit_the_trials_at_once_and_say_so():
    plan, cfg = _plan(4, num_learners=1, num_gpus_per_learner=1, num_cpus_for_main_process=32)
    assert plan.concurrent == 2 and cfg.num_cpus_for_main_process == 32
    assert plan.line().startswith("4 trials, 2 at once (1 GPU each of 8; 32 CPUs each of 64): the GPUs would hold 4")
    assert "num_cpus_for_main_process" in plan.line()


def test_fewer_cores_than_trials_at_once_share_cores():
    plan, cfg = _plan(4, ClusterResources(cpus=2, gpus=4, max_node_cpus=2), num_learners=1, num_gpus_per_learner=1)
    assert plan.line() == "4 trials, 4 at once (1 GPU each of 4; 0.5 CPU each of 2)"
    assert cfg.num_cpus_for_main_process == 0.5 and not plan.notes


def test_a_cpu_search_keeps_one_trial_at_a_time_with_auto():
    plan, cfg = _plan(4, TWO_CORES)
    assert plan.line() == "4 trials, 1 at a time (no GPUs; 2 CPUs each of 2)"
    assert cfg.num_cpus_for_main_process == 2
    plan, _ = _plan(4, ClusterResources(cpus=8, gpus=0, max_node_cpus=8), num_cpus_for_main_process=2)
    assert plan.concurrent == 4  # fixed CPUs: as many as the cores hold


def test_fractional_gpus_put_two_trials_on_a_gpu_and_one_learner_per_trial():
    plan, cfg = _plan(8, ClusterResources(cpus=32, gpus=4, max_node_cpus=32), num_learners=1, num_gpus_per_learner=0.5)
    assert plan.line() == "8 trials, 8 at once (0.5 GPU each of 4, 2 trials to a GPU; 4 CPUs each of 32)"
    with pytest.raises(ResourceError, match=r"^num_gpus_per_learner: 0.5 with num_learners: 2: .*NCCL"):
        _plan(4, num_learners=2, num_gpus_per_learner=0.5)


def test_a_search_the_cluster_cannot_place_fails_as_before():
    with pytest.raises(ResourceError, match=r"asks for 4 GPU.*cluster has 2"):
        _plan(4, ClusterResources(64, 2, 64), num_learners=4, num_gpus_per_learner=1)
