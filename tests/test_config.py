"""ExGRPOConfig: official defaults, validation with clear messages, YAML key checks."""

import pytest

from rllib_exgrpo.rllib.algorithm import ExGRPOConfig, GRPOConfig
from rllib_exgrpo.rllib.config_fields import FIELDS
from rllib_exgrpo.cli.experiment import CliConfigError, build_experiments


def test_official_defaults():
    c = ExGRPOConfig()
    assert (c.lr, c.questions_per_step, c.group_size, c.minibatch_size) == (1e-6, 128, 8, 512)
    assert (c.grad_clip, c.skip_update_grad_norm, c.entropy_coeff, c.kl_coeff) == (1.0, 500.0, 0.001, 0.0)
    assert (c.experience_ratio, c.delayed_start_solve_rate, c.policy_shaping_beta) == (0.5, 0.35, 0.1)
    assert (c.bucket_weighting, c.bucket_mu, c.bucket_sigma) == ("gaussian", 0.5, 0.125)
    assert c.trajectory_selection == "lowest_entropy" and c.remove_clip_in_mixed_mode
    assert (c.clip_eps_low, c.clip_eps_high, c.temperature, c.top_p) == (0.2, 0.2, 1.0, 1.0)
    assert c.advantage_estimator == "mean_centered"
    assert GRPOConfig().experience_replay is False and c.experience_replay is True


def test_every_field_has_its_table_default_and_passes_its_own_check():
    c = ExGRPOConfig()
    for f in FIELDS:
        assert getattr(c, f.name) == f.default, f.name
        assert f.check(f.default) is None, f.name


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"group_size": 1}, "group_size must be an integer >= 2"),
        ({"experience_ratio": 1.5}, "experience_ratio must be in [0, 1]"),
        ({"loss_agg_mode": "mean"}, "loss_agg_mode must be one of"),
        ({"bucket_weighting": "linear"}, "bucket_weighting must be one of"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"xrpo_planner": True, "planner_n0": 9}, "planner_n0 (9) must be <= group_size (8)"),
        ({"model_name_or_path": ""}, "model_name_or_path must be a non-empty string"),
    ],
)
def test_validation_names_the_field(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        ExGRPOConfig().training(**kwargs).validate()
    assert fragment in str(err.value)


def test_unknown_training_keyword_is_rejected():
    with pytest.raises(TypeError):
        ExGRPOConfig().training(experince_ratio=0.3)


def test_yaml_with_misspelled_key_fails_before_anything_starts(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(
        "x:\n  run: ExGRPO\n  env: rllib_exgrpo.envs.reasoning_env:ReasoningEnv\n"
        "  config:\n    experince_ratio: 0.3\n    model_name_or_path: tiny\n"
    )
    with pytest.raises(CliConfigError) as err:
        build_experiments(str(path))
    msg = str(err.value)
    assert "experince_ratio" in msg and "experience_ratio" in msg


def test_tuned_examples_validate():
    from pathlib import Path

    for f in sorted(Path(__file__).resolve().parents[1].glob("tuned_examples/*_tiny.yaml")):
        assert build_experiments(str(f)), f


def test_algorithms_and_configs_at_the_package_top():
    import rllib_exgrpo
    from rllib_exgrpo import GRPO, ExGRPO, ExGRPOConfig, ExGRPOTorchLearner, GRPOConfig, LLMEnvRunner, LLMTorchRLModule
    from rllib_exgrpo.rllib.algorithm import ExGRPO as ExGRPOClass

    assert ExGRPO is ExGRPOClass and issubclass(GRPO, ExGRPO)
    assert isinstance(GRPOConfig(), ExGRPOConfig) and GRPOConfig().experience_replay is False
    assert ExGRPOConfig().algo_class is ExGRPO
    assert ExGRPOConfig().get_default_learner_class() is ExGRPOTorchLearner
    assert ExGRPOConfig().get_default_rl_module_spec().module_class is LLMTorchRLModule
    assert ExGRPOConfig().env_runner_cls is LLMEnvRunner
    with pytest.raises(AttributeError):
        rllib_exgrpo.NoSuchThing


def test_grpo_with_experience_replay_is_refused_naming_exgrpo():
    """A copied ExGRPO recipe whose run line says GRPO must not train ExGRPO silently."""
    with pytest.raises(ValueError, match="experience_replay: true is ExGRPO: use run: ExGRPO"):
        GRPOConfig().update_from_dict({"experience_replay": True}).validate()
    GRPOConfig().validate()  # the default (off) is fine
