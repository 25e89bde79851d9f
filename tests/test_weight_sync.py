"""Weight sync: bf16 ships as bf16 (2 bytes a parameter, zero-copy through Ray's object
store), and the driver's local env runner keeps no copy of the synced weights.

``benchmarks/weight_sync.py`` measures the same path on a 226 M-parameter model.
"""

import pickle

import pytest
import torch

from rllib_exgrpo.rllib.module import ShippedBF16, shippable


def test_bf16_state_pickles_as_its_own_two_bytes_out_of_band():
    t = torch.randn(64, 32).to(torch.bfloat16)
    shipped = shippable(t)
    assert isinstance(shipped, ShippedBF16) and shipped.dtype == torch.bfloat16
    buffers = []
    data = pickle.dumps({"w": shipped}, protocol=5, buffer_callback=buffers.append)
    # The values travel as one out-of-band buffer of 2 bytes a parameter (what Ray's object
    # store hands to the readers without a copy); the pickle itself is a few hundred bytes.
    assert sum(b.raw().nbytes for b in buffers) == t.numel() * 2 and len(data) < 1000
    back = pickle.loads(data, buffers=buffers)["w"]
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)
    # Operations give plain tensors (a cast never pickles as the wrong bits).
    assert type(shipped.float()) is torch.Tensor and type(shipped + 1) is torch.Tensor
    # Without protocol 5 (checkpoint files written with pickle) it reads back the same.
    assert torch.equal(pickle.loads(pickle.dumps(shipped)), t)


def test_module_set_state_loads_bf16_without_a_float32_detour(quick_tiny_model):
    from rllib_exgrpo.rllib.module import LLMTorchRLModule
    from rllib_exgrpo.rllib.env_runner import token_spaces

    obs, act = token_spaces(100, 8, 8)
    module = LLMTorchRLModule(
        observation_space=obs, action_space=act, inference_only=True, model_config={"model": quick_tiny_model, "dtype": "bfloat16"}
    )
    state = module.get_state()
    assert all(isinstance(v, ShippedBF16) for v in state.values())
    new = {k: (v.float() + 1).to(torch.bfloat16).as_subclass(ShippedBF16) for k, v in state.items()}
    module.set_state(new)
    for k, v in module.get_state().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, new[k]), k


@pytest.mark.usefixtures("ray_local")
def test_local_runner_keeps_no_weights_and_remote_runner_gets_bf16(quick_tiny_model):
    from ray.rllib.core import COMPONENT_RL_MODULE

    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    config = (
        ExGRPOConfig()
        .environment("rllib_exgrpo.envs.reasoning_env:ReasoningEnv", env_config={"dataset": "arithmetic"})
        .training(
            model_name_or_path=quick_tiny_model,
            model_dtype="bfloat16",
            questions_per_step=2,
            group_size=2,
            max_prompt_tokens=64,
            max_response_tokens=4,
            minibatch_size=4,
        )
        .env_runners(num_env_runners=1, num_cpus_per_env_runner=1)
        .learners(num_learners=0)
    )
    algo = config.build_algo()
    try:
        group = algo.env_runner_group
        learner_module = algo.learner_group._learner.module["default_policy"].unwrapped()
        synced = algo.learner_group.get_state(components="learner/rl_module", inference_only=True)
        synced = synced["learner"]["rl_module"]["default_policy"]
        assert synced and all(isinstance(v, ShippedBF16) for v in synced.values())

        # Move the learner's weights, then sync as the training step does.
        with torch.no_grad():
            for p in learner_module.model.parameters():
                p.add_(0.5)
        group.sync_weights(from_worker_or_learner_group=algo.learner_group, inference_only=True, timeout_seconds=None)
        expected = {k: p.detach().to(torch.bfloat16) for k, p in learner_module.state_dict().items()}

        local = group.local_env_runner
        assert local.module is None and local._pending_module_state is None, "the local runner holds weights"
        # RLlib's restore_env_runners asks for the whole state: no weights, no model built.
        assert COMPONENT_RL_MODULE not in local.get_state() and local.module is None

        def remote_view(runner):
            return {k: v.detach().clone() for k, v in runner.module.state_dict().items()}

        remote = group.foreach_env_runner(remote_view, local_env_runner=False)[0]
        for k, v in expected.items():
            assert remote[k].dtype == torch.bfloat16 and torch.equal(remote[k], v), k

        # Asked for its weights, the local runner builds its module and fetches the current ones.
        got = local.get_state(components=COMPONENT_RL_MODULE)[COMPONENT_RL_MODULE]
        for k, v in expected.items():
            assert torch.equal(torch.as_tensor(got[k]), v), k
    finally:
        algo.stop()
