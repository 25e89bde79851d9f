"""Registries a user package adds to: advantage estimators, loss aggregations, ratio modes."""

import pytest
import torch

from rllib_exgrpo.core import losses as L
from rllib_exgrpo.core.registry import Registry, RegistryError


@pytest.fixture
def user_estimator():
    """``A_i = r_i - max_{j in g(i)} r_j`` (how far below the group's best)."""

    @L.register_advantage_estimator("below_best")
    def below_best(rewards, group_index, eps=1e-6):
        best = torch.full((int(group_index.max()) + 1,), -float("inf")).scatter_reduce(0, group_index, rewards, reduce="amax")
        return rewards - best[group_index]

    yield "below_best"
    L.ADVANTAGE_ESTIMATORS.unregister("below_best")


@pytest.fixture
def user_agg():
    """``sum_{i,t} m l``: the plain token sum."""

    @L.register_loss_agg_mode("token-sum")
    def token_sum(per_token_loss, mask, *, max_len=None, micro_batch_rows=None, totals=None):
        return (per_token_loss * mask.to(per_token_loss.dtype)).sum()

    yield "token-sum"
    L.LOSS_AGG_MODES.unregister("token-sum")


def test_builtins_are_registered_in_order():
    assert L.ADVANTAGE_ESTIMATORS.names() == ("mean_centered", "std_normalized")
    assert L.LOSS_AGG_MODES.names() == ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum-norm-official")
    assert L.RATIO_MODES.names() == ("token", "sequence")


def test_user_estimator_and_aggregation_end_to_end(user_estimator, user_agg):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0])
    group_index = torch.tensor([7, 7, 7, 3, 3])
    adv = L.group_advantages(rewards, group_index, mode=user_estimator)
    torch.testing.assert_close(adv, torch.tensor([0.0, -1.0, -0.5, 0.0, 0.0]))

    logp = torch.tensor(
        [[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0], [-1.2, -0.1, -0.4], [-0.6, -0.6, -0.6], [-2.0, -1.0, -3.0]], requires_grad=True
    )
    old_logp = logp.detach() + torch.tensor([[0.05, -0.1, 0.0], [0.1, -0.05, 0.2], [-0.02, 0.0, 0.03], [0.0, 0.1, 0.0], [0.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    off_policy = torch.tensor([False, True, False, False, False])
    beta = 0.1
    loss, metrics = L.mixed_policy_loss(logp, old_logp, adv, mask, off_policy, agg_mode=user_agg, beta=beta, eps_low=0.2, eps_high=0.2)

    # By hand: ratios are within the clip range, so fresh tokens give -w * A, the replayed
    # row -A * w / (w + beta); the user aggregation sums the valid tokens.
    w = torch.exp(logp.detach() - old_logp)
    fresh = -w * adv[:, None]
    replayed = -adv[:, None] * w / (w + beta)
    per_token = torch.where(off_policy[:, None], replayed, fresh)
    expected = (per_token * mask).sum()
    torch.testing.assert_close(loss.detach(), expected)
    torch.testing.assert_close(metrics["policy_loss"], expected)
    loss.backward()
    # d/d logp of -A * w (fresh) is -A * w; of -A * w / (w + beta) is -A * beta * w / (w + beta)^2.
    grad = torch.where(off_policy[:, None], -adv[:, None] * beta * w / (w + beta) ** 2, -w * adv[:, None])
    torch.testing.assert_close(logp.grad, grad * mask)


def test_user_names_pass_config_validation(user_estimator, user_agg):
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
    from rllib_exgrpo.rllib.config_fields import FIELDS_BY_NAME

    config = ExGRPOConfig().training(advantage_estimator=user_estimator, loss_agg_mode=user_agg)
    config.validate()
    assert "below_best" in FIELDS_BY_NAME["advantage_estimator"].check.describe
    assert FIELDS_BY_NAME["loss_agg_mode"].error("token-sum") is None


def test_unregistered_name_fails_validation_naming_the_choices():
    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    with pytest.raises(ValueError, match=r"advantage_estimator must be one of \['mean_centered', 'std_normalized'\]"):
        ExGRPOConfig().training(advantage_estimator="below_best").validate()


@pytest.mark.parametrize(
    "call, fragment",
    [
        (
            lambda: L.group_advantages(torch.ones(2), torch.zeros(2, dtype=torch.long), mode="nope"),
            "unknown advantage estimator 'nope'; choose from ['mean_centered', 'std_normalized']",
        ),
        (
            lambda: L.agg_loss(torch.ones(1, 2), torch.ones(1, 2), "nope"),
            "unknown loss aggregation mode 'nope'; choose from ['token-mean', ",
        ),
        (
            lambda: L.clipped_surrogate(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), ratio_mode="nope"),
            "unknown ratio mode 'nope'; choose from ['token', 'sequence']",
        ),
    ],
)
def test_unknown_name_is_a_clear_value_error(call, fragment):
    with pytest.raises(ValueError) as err:
        call()
    assert fragment in str(err.value)


def test_duplicate_registration_is_refused():
    with pytest.raises(RegistryError, match="'mean_centered' is already registered"):
        L.register_advantage_estimator("mean_centered")(lambda rewards, group_index, eps=1e-6: rewards)
    with pytest.raises(RegistryError, match="'token-mean' is already registered"):
        L.register_loss_agg_mode("token-mean")(lambda *a, **k: None)
    assert L.ADVANTAGE_ESTIMATORS.get("mean_centered").__name__ == "_adv_mean_centered"


def test_registry_basics():
    reg = Registry("widget")
    with pytest.raises(RegistryError, match="non-empty string"):
        reg.register("")
    with pytest.raises(RegistryError, match="must be a function"):
        reg.register("a")(3)

    @reg.register("b")
    def b():
        return "b"

    assert b() == "b" and list(reg) == ["b"] and "b" in reg and 3 not in reg and len(reg) == 1
    assert reg["b"] is b and reg.unregister("b") is b
    with pytest.raises(RegistryError, match=r"unknown widget 'b'; choose from \[\]"):
        reg.get("b")
