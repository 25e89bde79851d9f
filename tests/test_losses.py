"""Tests for rllib_exgrpo.core.losses: every function against a loop-by-hand reference."""

import math

import pytest
import torch

from rllib_exgrpo.core import losses as L

# float(t) on a graph-attached scalar is intended in the hand-number checks below
pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")


@pytest.fixture(autouse=True)
def _float64_default():
    """Run every test in float64 (exact loop references), restoring the default after."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(prev)


# ------------------------------------------------------------------ fixtures / references


def _ragged():
    """4 rows, T = 5, ragged mask (one row fully padded)."""
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(4, 5, generator=g) * 2.0).requires_grad_(True)
    old = -torch.rand(4, 5, generator=g) * 2.0
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([0.5, -1.0, 0.3, 2.0])
    return logp, old, mask, adv


def _ref_adv(rewards, groups, mode, eps=1e-6):
    out = []
    for i in range(len(rewards)):
        members = [float(rewards[j]) for j in range(len(rewards)) if int(groups[j]) == int(groups[i])]
        mean = sum(members) / len(members)
        if mode == "mean_centered":
            out.append(float(rewards[i]) - mean)
        else:
            if len(members) == 1:
                out.append(0.0)
                continue
            var = sum((x - mean) ** 2 for x in members) / (len(members) - 1)
            out.append((float(rewards[i]) - mean) / (math.sqrt(var) + eps))
    return torch.tensor(out)


def _ref_clip_loss(logp, old, adv, eps_low, eps_high, clip=True):
    n, t = logp.shape
    out = torch.zeros(n, t)
    for i in range(n):
        for j in range(t):
            lw = max(min(float(logp.detach()[i, j] - old[i, j]), 20.0), -20.0)
            w = math.exp(lw)
            a = float(adv[i])
            if clip:
                wc = min(max(w, 1 - eps_low), 1 + eps_high)
                out[i, j] = -min(w * a, wc * a)
            else:
                out[i, j] = -w * a
    return out


def _ref_agg(loss, mask, mode, max_len=None):
    n, t = loss.shape
    total, count = 0.0, 0.0
    seq_means = []
    for i in range(n):
        s, c = 0.0, 0
        for j in range(t):
            if mask[i, j]:
                s += float(loss[i, j])
                c += 1
        total += s
        count += c
        if c > 0:
            seq_means.append(s / c)
    ml = t if max_len is None else max_len
    if mode == "token-mean":
        return total / count if count else 0.0
    if mode == "seq-mean-token-mean":
        return sum(seq_means) / len(seq_means) if seq_means else 0.0
    if mode == "seq-mean-token-sum-norm":
        return total / (n * ml)
    return total / ml


# ------------------------------------------------------------------ advantages


@pytest.mark.parametrize("mode", ["mean_centered", "std_normalized"])
def test_group_advantages_ragged_groups(mode):
    # ids non-contiguous and unsorted; sizes 3, 1 (singleton), 4 (all equal), 2
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([7, 7, 7, 3, 11, 11, 11, 11, 2, 2])
    got = L.group_advantages(rewards, groups, mode=mode)
    ref = _ref_adv(rewards, groups, mode)
    torch.testing.assert_close(got, ref)
    assert got[3] == 0.0  # singleton group
    assert torch.all(got[4:8] == 0.0)  # all-equal group


def test_group_advantages_int_rewards_and_registry():
    rewards = torch.tensor([1, 0, 0, 1, 1, 1], dtype=torch.long)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    got = L.group_advantages(rewards, groups)
    assert got.is_floating_point()
    torch.testing.assert_close(got, _ref_adv(rewards.double(), groups, "mean_centered").to(got.dtype))
    assert set(L.ADVANTAGE_ESTIMATORS) == {"mean_centered", "std_normalized"}
    with pytest.raises(ValueError):
        L.group_advantages(rewards.float(), groups, mode="nope")


def test_replayed_group_shares_mean():
    # ExGRPO: 1 replayed (correct) + 3 fresh in one group
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    got = L.group_advantages(rewards, torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_zero_variance_group_mask():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([5, 5, 1, 1, 9, 9, 0])
    got = L.zero_variance_group_mask(rewards, groups)
    # order of sorted ids: 0 (singleton), 1 (mixed), 5 (all 1), 9 (all 0)
    assert got.tolist() == [True, False, True, True]


# ------------------------------------------------------------------ ratios / surrogates


def test_log_ratio_clamp():
    a = torch.tensor([[0.0, 50.0, -50.0]])
    b = torch.zeros(1, 3)
    assert L.log_ratio(a, b).tolist() == [[0.0, 20.0, -20.0]]
    assert L.log_ratio(a, b, clamp=5.0).tolist() == [[0.0, 5.0, -5.0]]


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.2, 0.28)])
@pytest.mark.parametrize("clip", [True, False])
def test_clipped_surrogate_matches_loop(eps_low, eps_high, clip):
    logp, old, mask, adv = _ragged()
    got, stats = L.clipped_surrogate(logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, clip=clip)
    ref = _ref_clip_loss(logp.detach(), old, adv, eps_low, eps_high, clip)
    torch.testing.assert_close(got.detach(), ref)
    torch.testing.assert_close(stats["ratio"], torch.exp(logp.detach() - old))
    # [N, T] advantages give the same as broadcast [N]
    got2, _ = L.clipped_surrogate(logp, old, adv.unsqueeze(-1).expand(4, 5), mask, eps_low=eps_low, eps_high=eps_high, clip=clip)
    torch.testing.assert_close(got2, got)
    if not clip:
        assert stats["clipped"].sum() == 0


def test_clipping_zeroes_gradient_outside_trust_region():
    old = torch.zeros(1, 4)
    # ratios: 1.5 (above), 0.5 (below), 1.1 (inside), 0.9 (inside)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.9]])).requires_grad_(True)
    for a, dead in ((1.0, [True, False, False, False]), (-1.0, [False, True, False, False])):
        logp.grad = None
        loss, stats = L.clipped_surrogate(logp, old, torch.tensor([a]))
        loss.sum().backward()
        g = logp.grad[0]
        for j in range(4):
            if dead[j]:
                assert g[j] == 0.0
            else:
                # d(-w a)/dlogp = -w a
                assert g[j] == pytest.approx(-math.exp(float(logp.detach()[0, j])) * a)
        assert stats["clipped"][0].bool().tolist() == dead
        assert stats["outside_trust_region"][0].bool().tolist() == dead
    # without clip the gradient flows everywhere but the would-clip stat stays
    logp.grad = None
    loss, stats = L.clipped_surrogate(logp, old, torch.tensor([1.0]), clip=False)
    loss.sum().backward()
    assert torch.all(logp.grad != 0)
    assert stats["outside_trust_region"][0].bool().tolist() == [True, False, False, False]


def test_gspo_sequence_ratio():
    logp, old, mask, adv = _ragged()
    loss, stats = L.clipped_surrogate(logp, old, adv, mask, ratio_mode="sequence", eps_low=0.3, eps_high=0.3)
    for i in range(4):
        lws = [float(logp.detach()[i, j] - old[i, j]) for j in range(5) if mask[i, j]]
        s = math.exp(sum(lws) / len(lws)) if lws else 1.0
        torch.testing.assert_close(stats["ratio"][i], torch.full((5,), s))
        a = float(adv[i])
        sc = min(max(s, 0.7), 1.3)
        torch.testing.assert_close(loss[i].detach(), torch.full((5,), -min(s * a, sc * a)))
    # gradient: GSPO-token w = sg[s] * pi / sg[pi] -> d l_t / d logp_t = -s a (if unclipped)
    logp2 = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old2 = torch.tensor([[-1.05, -1.9, -0.5]])
    l2, st2 = L.clipped_surrogate(logp2, old2, torch.tensor([2.0]), torch.ones(1, 3), ratio_mode="sequence")
    l2.sum().backward()
    s = math.exp(((-1.0 + 1.05) + (-2.0 + 1.9) + 0.0) / 3)
    torch.testing.assert_close(logp2.grad, torch.full((1, 3), -s * 2.0))
    with pytest.raises(ValueError):
        L.clipped_surrogate(logp2, old2, torch.tensor([2.0]), ratio_mode="bad")


def test_policy_shaping_value_and_grad():
    w = torch.tensor([0.01, 0.5, 1.0, 3.0], requires_grad=True)
    beta = 0.1
    f = L.policy_shaping(w, beta)
    torch.testing.assert_close(f.detach(), w.detach() / (w.detach() + beta))
    f.sum().backward()
    torch.testing.assert_close(w.grad, beta / (w.detach() + beta) ** 2)


def test_shaped_surrogate():
    logp, old, mask, adv = _ragged()
    loss, stats = L.shaped_surrogate(logp, old, adv, beta=0.1)
    for i in range(4):
        for j in range(5):
            w = math.exp(float(logp.detach()[i, j] - old[i, j]))
            assert float(loss.detach()[i, j]) == pytest.approx(-float(adv[i]) * w / (w + 0.1))
            assert float(stats["shaping"][i, j]) == pytest.approx(w / (w + 0.1))


# ------------------------------------------------------------------ aggregation


@pytest.mark.parametrize("mode", sorted(L.LOSS_AGG_MODES))
@pytest.mark.parametrize("max_len", [None, 8])
def test_agg_loss_matches_loop(mode, max_len):
    logp, old, mask, adv = _ragged()
    per_tok = logp * 3.0 + 1.0
    got = L.agg_loss(per_tok, mask, mode, max_len=max_len)
    ref = _ref_agg(per_tok.detach(), mask, mode, max_len)
    assert float(got) == pytest.approx(ref)


def test_agg_loss_hand_numbers():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert float(L.agg_loss(loss, mask, "token-mean")) == pytest.approx(10.0 / 4)
    assert float(L.agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((2.0 + 4.0) / 2)
    assert float(L.agg_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx(10.0 / (3 * 3))
    assert float(L.agg_loss(loss, mask, "seq-mean-token-sum-norm", max_len=5)) == pytest.approx(10.0 / 15)
    assert float(L.agg_loss(loss, mask, "seq-mean-token-sum-norm-official")) == pytest.approx(10.0 / 3)
    assert float(L.agg_loss(loss, mask, "seq-mean-token-sum-norm-official", max_len=5)) == pytest.approx(2.0)
    # 3 rows in micro-batches of 1 row: sum / ((3 / 1) * 5)
    assert float(L.agg_loss(loss, mask, "seq-mean-token-sum-norm-official", max_len=5, micro_batch_rows=1)) == pytest.approx(10.0 / 15)
    with pytest.raises(ValueError):
        L.agg_loss(loss, mask, "nope")


@pytest.mark.parametrize("mode", sorted(L.LOSS_AGG_MODES))
def test_agg_loss_all_zero_mask_has_graph(mode):
    per_tok = torch.full((3, 4), float("nan"), requires_grad=True)  # padding garbage
    out = L.agg_loss(per_tok, torch.zeros(3, 4), mode)
    assert float(out) == 0.0
    assert out.requires_grad
    out.backward()
    assert torch.all(per_tok.grad == 0)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert float(L.masked_mean(x, m)) == pytest.approx(1.5)
    torch.testing.assert_close(L.masked_mean(x, m, dim=-1), torch.tensor([1.5, 0.0]))
    torch.testing.assert_close(L.masked_mean(x, m.bool(), dim=0), torch.tensor([1.0, 2.0, 0.0]))
    assert float(L.masked_mean(x, torch.zeros_like(x))) == 0.0


# ------------------------------------------------------------------ logits utilities, KL


def test_entropy_uniform_and_reference():
    V = 7
    assert float(L.entropy_from_logits(torch.zeros(V))) == pytest.approx(math.log(V))
    z = torch.randn(2, 3, V) * 5
    p = torch.softmax(z, -1)
    torch.testing.assert_close(L.entropy_from_logits(z), -(p * p.log()).sum(-1))
    # masked vocabulary (-inf) is fine
    z2 = torch.tensor([0.0, 0.0, float("-inf")])
    assert float(L.entropy_from_logits(z2)) == pytest.approx(math.log(2))
    # bf16 input comes back as float32
    assert L.entropy_from_logits(z.to(torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_log_softmax(temperature):
    z = torch.randn(3, 4, 11)
    ids = torch.randint(0, 11, (3, 4))
    ref = torch.log_softmax(z / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(L.token_logprobs_from_logits(z, ids, temperature), ref)
    got_bf = L.token_logprobs_from_logits(z.to(torch.bfloat16), ids, temperature)
    ref_bf = torch.log_softmax(z.to(torch.bfloat16).float() / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert got_bf.dtype == torch.float32
    torch.testing.assert_close(got_bf, ref_bf, atol=3e-2, rtol=3e-2)


def test_k3_kl():
    logp = torch.randn(4, 6) * 3
    ref = torch.randn(4, 6) * 3
    kl = L.k3_kl(logp, ref)
    assert torch.all(kl >= 0)
    assert torch.all(kl <= 10.0)
    for i in range(4):
        for j in range(6):
            d = max(min(float(ref[i, j] - logp[i, j]), 10.0), -10.0)
            assert float(kl[i, j]) == pytest.approx(min(math.exp(d) - d - 1, 10.0))
    assert torch.all(L.k3_kl(logp, logp) == 0)


# ------------------------------------------------------------------ mixed objective


@pytest.mark.parametrize("mode", sorted(L.LOSS_AGG_MODES))
@pytest.mark.parametrize("ratio_mode", ["token", "sequence"])
def test_mixed_without_replay_equals_grpo(mode, ratio_mode):
    logp, old, mask, adv = _ragged()
    rep = torch.zeros(4, dtype=torch.bool)
    loss, met = L.mixed_policy_loss(
        logp,
        old,
        adv,
        mask,
        rep,
        eps_low=0.2,
        eps_high=0.28,
        clip_fresh=True,
        beta=0.1,
        agg_mode=mode,
        ratio_mode=ratio_mode,
    )
    pt, st = L.clipped_surrogate(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, ratio_mode=ratio_mode)
    ref = L.agg_loss(pt, mask, mode)
    torch.testing.assert_close(loss, ref)
    (g1,) = torch.autograd.grad(loss, logp)
    (g2,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(g1, g2)
    assert float(met["replayed_token_fraction"]) == 0.0
    assert float(met["fresh_token_fraction"]) == 1.0
    assert float(met["replay_shaping_mean"]) == 0.0
    assert float(met["clip_fraction"]) == pytest.approx(float(L.masked_mean(st["clipped"], mask)))


def test_mixed_policy_loss_by_hand():
    logp, old, mask, adv = _ragged()
    rep = torch.tensor([False, True, False, True])
    ref_logp = -torch.rand(4, 5, generator=torch.Generator().manual_seed(3))
    ent = torch.rand(4, 5, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    for clip_fresh in (True, False):
        loss, met = L.mixed_policy_loss(
            logp,
            old,
            adv,
            mask,
            rep,
            eps_low=0.2,
            eps_high=0.2,
            clip_fresh=clip_fresh,
            beta=0.1,
            agg_mode="seq-mean-token-sum-norm",
            max_len=6,
            entropy=ent,
            entropy_coeff=0.001,
            ref_logp=ref_logp,
            kl_coeff=0.05,
        )
        clip_ref = _ref_clip_loss(logp.detach(), old, adv, 0.2, 0.2, clip_fresh)
        per_tok = torch.zeros(4, 5)
        shaping, rratios, fratios = [], [], []
        for i in range(4):
            for j in range(5):
                w = math.exp(float(logp.detach()[i, j] - old[i, j]))
                if rep[i]:
                    per_tok[i, j] = -float(adv[i]) * w / (w + 0.1)
                    if mask[i, j]:
                        shaping.append(w / (w + 0.1))
                        rratios.append(w)
                else:
                    per_tok[i, j] = clip_ref[i, j]
                    if mask[i, j]:
                        fratios.append(w)
        pg = _ref_agg(per_tok, mask, "seq-mean-token-sum-norm", 6)
        e = _ref_agg(ent.detach(), mask, "token-mean")  # a token mean whatever the mode
        kl = _ref_agg(L.k3_kl(logp.detach(), ref_logp), mask, "seq-mean-token-sum-norm", 6)
        assert float(loss) == pytest.approx(pg - 0.001 * e + 0.05 * kl)
        assert float(met["policy_loss"]) == pytest.approx(pg)
        assert float(met["replay_shaping_mean"]) == pytest.approx(sum(shaping) / len(shaping))
        assert float(met["replay_ratio_mean"]) == pytest.approx(sum(rratios) / len(rratios))
        assert float(met["ratio_mean"]) == pytest.approx(sum(fratios) / len(fratios))
        assert float(met["ratio_max"]) == pytest.approx(max(fratios))
        assert float(met["ratio_min"]) == pytest.approx(min(fratios))
        n_valid = int(mask.sum())
        assert float(met["replayed_token_fraction"]) == pytest.approx((2 + 3) / n_valid)
        assert float(met["fresh_token_fraction"]) == pytest.approx(5 / n_valid)
        assert "entropy" in met and "kl" in met
        assert all(not v.requires_grad for v in met.values())
        # entropy bonus gradient flows with the right sign
        (ge,) = torch.autograd.grad(loss, ent)
        assert float(ge[0, 0]) == pytest.approx(-0.001 / n_valid)  # a token mean
        assert float(ge[2, 0]) == 0.0


# ------------------------------------------------------------------ XRPO novelty


def _ref_novelty(adv, rewards, s, groups, lam, kappa):
    out, bonus = [], []
    for i in range(len(adv)):
        members = [float(s[j]) for j in range(len(adv)) if int(groups[j]) == int(groups[i])]
        ms = sum(members) / len(members)
        a = float(adv[i])
        b = 0.0
        if float(rewards[i]) > 0 and float(s[i]) < ms and a > 0:
            b = max(min(max(lam * (1 - math.exp(float(s[i]) - ms)), 0.0), kappa * a), 0.0)
        out.append(a + b)
        bonus.append(b)
    return torch.tensor(out), torch.tensor(bonus)


@pytest.mark.parametrize("lam,kappa", [(1.0, 1.0), (5.0, 0.1), (1.0, 0.0)])
def test_novelty_sharpening_matches_loop(lam, kappa):
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 4, 4, 4, 9, 9])
    adv = L.group_advantages(rewards, groups)
    s = torch.tensor([-0.2, -1.5, -3.0, -0.1, -0.3, -2.0, -0.1, -0.9, -0.5])
    new, bonus = L.novelty_sharpened_advantages(adv, rewards, s, groups, lambda_nov=lam, kappa=kappa)
    ref_new, ref_bonus = _ref_novelty(adv, rewards, s, groups, lam, kappa)
    torch.testing.assert_close(new, ref_new)
    torch.testing.assert_close(bonus, ref_bonus)
    assert torch.all(bonus >= 0)
    assert torch.all(bonus <= torch.clamp(kappa * adv, min=0) + 1e-12)
    # group 4 is all correct: A = 0 -> no bonus even for the unlikely completion
    assert torch.all(bonus[4:7] == 0)
    # incorrect completions never get a bonus
    assert torch.all(bonus[rewards == 0] == 0)
    if lam == 1.0 and kappa == 1.0:
        # row 1: correct, below group mean, A = 0.5 > 0 -> positive bonus
        assert float(bonus[1]) > 0
        # row 0: correct but above the group mean -> none
        assert float(bonus[0]) == 0


def test_novelty_nonpositive_advantage_gets_zero_bonus():
    # std-normalised advantage could be <= 0 for a correct answer only via a custom A;
    # force it: correct, novel, but A <= 0
    adv = torch.tensor([-0.5, 0.0, 0.5])
    rewards = torch.tensor([1.0, 1.0, 0.0])
    s = torch.tensor([-3.0, -3.0, 0.0])
    groups = torch.zeros(3, dtype=torch.long)
    new, bonus = L.novelty_sharpened_advantages(adv, rewards, s, groups)
    assert bonus.tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(new, adv)


def test_float32_inputs_with_float64_advantages():
    logp, old, mask, adv = _ragged()
    lp32 = logp.detach().float().requires_grad_(True)
    loss, met = L.mixed_policy_loss(
        lp32,
        old.float(),
        adv,
        mask,
        torch.tensor([False, True, False, False]),
        clip_fresh=False,
        beta=0.1,
        agg_mode="token-mean",
    )
    assert loss.dtype == torch.float32
    loss.backward()
    assert torch.isfinite(lp32.grad).all()
    assert all(torch.isfinite(v) for v in met.values())


def test_streamed_entropy_matches_plain_values_and_gradient(monkeypatch):
    """Same values and gradient as the plain formula, across chunk boundaries, with masked
    (-inf) vocabulary entries, half-precision input and no-grad input."""
    monkeypatch.setattr(L, "ENTROPY_CHUNK_ROWS", 3)  # force several chunks
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(2, 5, 11, generator=g) * 3).double()
    z[0, 1, :4] = float("-inf")
    a = z.clone().requires_grad_(True)
    b = z.clone().requires_grad_(True)
    weights = torch.randn(2, 5, generator=g).double()
    ref = L.entropy_from_logits(a)
    got = L.streamed_entropy(b)
    torch.testing.assert_close(got.double(), ref.double(), rtol=1e-5, atol=1e-6)
    (ref * weights).sum().backward()
    (got.double() * weights).sum().backward()
    assert torch.isfinite(b.grad).all()
    rows = torch.ones(2, 5, dtype=torch.bool)
    rows[0, 1] = False  # the plain formula's gradient is NaN on a row with -inf logits
    torch.testing.assert_close(b.grad[rows], a.grad[rows], rtol=1e-4, atol=1e-6)
    # that row: masked entries get 0, the others the gradient over the unmasked vocabulary
    c = z[0, 1, 4:].clone().requires_grad_(True)
    (L.entropy_from_logits(c) * weights[0, 1]).backward()
    assert (b.grad[0, 1, :4] == 0).all()
    torch.testing.assert_close(b.grad[0, 1, 4:], c.grad, rtol=1e-4, atol=1e-6)
    # finite differences on one entry, straight from H = -sum p log p
    eps = 1e-6
    zp, zm = z.clone(), z.clone()
    zp[1, 2, 3] += eps
    zm[1, 2, 3] -= eps
    fd = (L.entropy_from_logits(zp)[1, 2] - L.entropy_from_logits(zm)[1, 2]) / (2 * eps) * weights[1, 2]
    assert float(b.grad[1, 2, 3]) == pytest.approx(float(fd), rel=1e-4, abs=1e-7)
    # no graph needed: plain tensor out, same values
    plain = L.streamed_entropy(z.float())
    assert not plain.requires_grad and plain.dtype == torch.float32
    torch.testing.assert_close(plain, ref.detach().float(), rtol=1e-5, atol=1e-5)
    half = L.streamed_entropy(z.float().to(torch.bfloat16))
    assert half.dtype == torch.float32 and half.shape == (2, 5)


@pytest.mark.parametrize("num_learners", [1, 2, 4])
def test_official_aggregation_gradient_equals_the_official_run(num_learners):
    """The official ExGRPO step: a 512-row mini-batch over 8 GPUs, 64-row micro-batches,
    each micro-batch's token-loss sum / 8192, gradients averaged over the GPUs. Ours, with
    any number of learners (each its shard, averaged as DDP does), gives the same gradient."""
    torch.manual_seed(0)
    rows, width, L_max, micro = 512, 6, 8192, 64
    theta = torch.randn(rows, width, requires_grad=True)  # stands in for log-probs
    mask = (torch.rand(rows, width) > 0.3).float()
    weights = torch.randn(rows, width)

    def per_token(lo, hi):
        return theta[lo:hi] * weights[lo:hi]

    # Official: 8 GPUs x one 64-row micro-batch each; DDP averages the 8 gradients.
    official = sum(
        (per_token(g * micro, (g + 1) * micro) * mask[g * micro : (g + 1) * micro]).sum() / L_max for g in range(rows // micro)
    ) / (rows // micro)
    (g_official,) = torch.autograd.grad(official, theta)

    shard = rows // num_learners
    ours = (
        sum(
            L.agg_loss(
                per_token(k * shard, (k + 1) * shard),
                mask[k * shard : (k + 1) * shard],
                "seq-mean-token-sum-norm-official",
                max_len=L_max,
                micro_batch_rows=micro,
            )
            for k in range(num_learners)
        )
        / num_learners
    )
    (g_ours,) = torch.autograd.grad(ours, theta)
    torch.testing.assert_close(g_ours, g_official)
    # ... which is 64x Dr.GRPO's scale (sum / (N * L)), not the 512x of "sum / L".
    drgrpo = L.agg_loss(per_token(0, rows), mask, "seq-mean-token-sum-norm", max_len=L_max)
    (g_dr,) = torch.autograd.grad(drgrpo, theta)
    torch.testing.assert_close(g_ours, 64 * g_dr)


def test_ratio_cap_truncates_the_unclipped_ratio():
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.2]])).requires_grad_(True)
    old = torch.log(torch.tensor([[0.1, 0.8, 0.4]]))  # ratios 5, 1.125, 0.5
    adv = torch.tensor([1.0])
    loss, _ = L.clipped_surrogate(logp, old, adv, clip=False, ratio_cap=2.0)
    torch.testing.assert_close(loss.detach(), torch.tensor([[-2.0, -1.125, -0.5]]))
    (g,) = torch.autograd.grad(loss.sum(), logp)
    # truncated importance sampling: gradient min(w, C) * A * grad log pi (bounded, kept)
    torch.testing.assert_close(g, torch.tensor([[-2.0, -1.125, -0.5]]))
    uncapped, _ = L.clipped_surrogate(logp, old, adv, clip=False)
    assert float(uncapped[0, 0]) == pytest.approx(-5.0)


# ------------------------------------------------------------------ numerical guards


def test_log_ratio_clamp_is_verls_twenty():
    assert L.LOG_RATIO_CLAMP == 20.0
    lw = L.log_ratio(torch.tensor([[0.0, -1.0, 0.0]]), torch.tensor([[float("-inf"), 1e6, float("nan")]]))
    assert lw[0, :2].tolist() == [20.0, -20.0]
    assert math.isnan(lw[0, 2])  # a NaN is not hidden: the learner drops the step


@pytest.mark.parametrize("mode", ["mean_centered", "std_normalized"])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_zero_variance_groups_get_exactly_zero_advantage(mode, eps):
    # all-correct, all-wrong, a singleton, continuous all-equal (0.1 x 3: mean off by an ulp)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1], dtype=torch.float32)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3])
    adv = L.group_advantages(rewards, groups, mode=mode, eps=eps)
    assert torch.equal(adv, torch.zeros(9))
    # a mixed group next to them is untouched (the loop reference)
    rewards2 = torch.cat([rewards, torch.tensor([1.0, 0.0, 0.0])])
    groups2 = torch.cat([groups, torch.tensor([4, 4, 4])])
    adv2 = L.group_advantages(rewards2, groups2, mode=mode, eps=eps)
    assert torch.equal(adv2[:9], torch.zeros(9))
    torch.testing.assert_close(adv2[9:], _ref_adv(rewards2[9:], groups2[9:], mode, eps).to(adv2.dtype))


@pytest.mark.parametrize("agg", sorted(L.LOSS_AGG_MODES))
@pytest.mark.parametrize("ratio_mode", L.RATIO_MODES)
@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("estimator", sorted(L.ADVANTAGE_ESTIMATORS))
def test_all_zero_variance_step_is_finite_with_zero_policy_gradient(agg, ratio_mode, clip, estimator):
    logp, old, mask, _ = _ragged()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])  # every group all-correct or all-wrong
    adv = L.group_advantages(rewards, torch.tensor([0, 0, 1, 1]), mode=estimator)
    assert torch.equal(adv, torch.zeros(4))
    for rep in (torch.zeros(4, dtype=torch.bool), torch.tensor([False, True, False, True])):
        for cap in (None, 2.0):
            loss, met = L.mixed_policy_loss(
                logp,
                old,
                adv,
                mask,
                rep,
                agg_mode=agg,
                ratio_mode=ratio_mode,
                clip_fresh=clip,
                ratio_cap=cap,
                max_len=8,
                micro_batch_rows=2,
            )
            (g,) = torch.autograd.grad(loss, logp)
            assert float(loss) == 0.0
            assert torch.equal(g, torch.zeros_like(g))
            assert float(met["zero_advantage_fraction"]) == 1.0
            assert all(math.isfinite(float(v)) for v in met.values())
    # all rows padded too: still finite, still attached
    loss, _ = L.mixed_policy_loss(logp, old, adv, torch.zeros_like(mask), torch.zeros(4, dtype=torch.bool), agg_mode=agg)
    (g,) = torch.autograd.grad(loss, logp)
    assert float(loss) == 0.0 and torch.equal(g, torch.zeros_like(g))


def test_zero_advantage_fraction_counts_valid_tokens():
    logp, old, mask, _ = _ragged()
    adv = torch.tensor([0.0, 1.0, 0.0, 0.0])  # valid tokens per row: 5, 2, 0, 3
    _, met = L.mixed_policy_loss(logp, old, adv, mask, torch.zeros(4, dtype=torch.bool))
    assert float(met["zero_advantage_fraction"]) == pytest.approx(8 / 10)


def test_official_aggregation_rejects_zero_micro_batch_rows():
    logp, _, mask, _ = _ragged()
    with pytest.raises(ValueError, match="micro_batch_rows"):
        L.agg_loss(logp, mask, "seq-mean-token-sum-norm-official", micro_batch_rows=0)


@pytest.mark.parametrize("shift", [1000.0, -1000.0])
@pytest.mark.parametrize("ratio_mode", L.RATIO_MODES)
@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("agg", sorted(L.LOSS_AGG_MODES))
def test_extreme_log_ratios_give_finite_loss_and_gradient(shift, ratio_mode, clip, agg):
    for dtype in (torch.float32, torch.float64):
        logp, _, mask, adv = _ragged()
        logp = logp.detach().to(dtype).requires_grad_(True)
        old = logp.detach() - shift  # logp - old_logp = +-1000 on every token
        for rep in (torch.zeros(4, dtype=torch.bool), torch.tensor([True, False, False, True])):
            for cap in (None, 2.0):
                loss, met = L.mixed_policy_loss(
                    logp,
                    old,
                    adv.to(dtype),
                    mask,
                    rep,
                    agg_mode=agg,
                    ratio_mode=ratio_mode,
                    clip_fresh=clip,
                    ratio_cap=cap,
                    max_len=8,
                    micro_batch_rows=2,
                )
                (g,) = torch.autograd.grad(loss, logp)
                assert torch.isfinite(loss) and torch.isfinite(g).all()
                assert float(met["ratio_max"]) <= math.exp(20.0) * (1 + 1e-6)
                assert all(math.isfinite(float(v)) for v in met.values())
                if cap is None:
                    # outside the clamp no gradient flows (token and sequence ratio alike)
                    assert torch.equal(g, torch.zeros_like(g))
    # -inf behaviour log-probs (an engine's underflow) are clamped as well
    logp, _, mask, adv = _ragged()
    old = torch.full_like(logp, float("-inf"))
    for ratio_mode in L.RATIO_MODES:
        loss, _ = L.mixed_policy_loss(
            logp, old, adv, mask, torch.tensor([True, False, False, False]), ratio_mode=ratio_mode, clip_fresh=False
        )
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(g).all()


def test_nonfinite_inputs_reach_the_loss():
    """The guards keep exp finite; they do not hide NaN/inf inputs (the learner drops them)."""
    logp, old, mask, adv = _ragged()
    rep = torch.zeros(4, dtype=torch.bool)
    bad_adv = adv.clone()
    bad_adv[0] = float("nan")
    assert math.isnan(float(L.mixed_policy_loss(logp, old, bad_adv, mask, rep)[0]))
    bad_old = old.clone()
    bad_old[0, 1] = float("nan")
    for ratio_mode in L.RATIO_MODES:
        assert math.isnan(float(L.mixed_policy_loss(logp, bad_old, adv, mask, rep, ratio_mode=ratio_mode)[0]))
    # ... but a NaN on a padding token stays out (row 1 is valid up to t = 1)
    pad_old = old.clone()
    pad_old[1, 4] = float("nan")
    assert math.isfinite(float(L.mixed_policy_loss(logp, pad_old, adv, mask, rep)[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_guards_leave_normal_ranges_bit_for_bit(dtype):
    """Inside the clamp the guarded surrogates equal the unguarded formulas exactly, values
    and gradients (torch.equal, not allclose)."""
    g = torch.Generator().manual_seed(7)
    logp0 = -torch.rand(6, 7, generator=g, dtype=dtype) * 3.0
    old = logp0 + (torch.rand(6, 7, generator=g, dtype=dtype) - 0.5) * 2.0
    mask = torch.rand(6, 7, generator=g) > 0.3
    adv = torch.randn(6, generator=g, dtype=dtype)
    a = adv.unsqueeze(-1)

    def plain_token(logp):
        w = torch.exp(logp - old)
        return torch.maximum(-w * a, -torch.clamp(w, 0.8, 1.28) * a)

    def plain_sequence(logp):
        seq = L.masked_mean(logp.detach() - old, mask, dim=-1)
        w = torch.exp(seq.unsqueeze(-1) + logp - logp.detach())
        return torch.maximum(-w * a, -torch.clamp(w, 0.8, 1.28) * a)

    def plain_shaped(logp):
        w = torch.exp(logp - old)
        return -a * (w / (w + 0.1))

    cases = [
        (plain_token, lambda lp: L.clipped_surrogate(lp, old, adv, mask, eps_high=0.28)[0]),
        (plain_sequence, lambda lp: L.clipped_surrogate(lp, old, adv, mask, eps_high=0.28, ratio_mode="sequence")[0]),
        (plain_shaped, lambda lp: L.shaped_surrogate(lp, old, adv)[0]),
    ]
    for plain, guarded in cases:
        lp1 = logp0.clone().requires_grad_(True)
        lp2 = logp0.clone().requires_grad_(True)
        want, got = plain(lp1), guarded(lp2)
        assert torch.equal(got, want)
        (g1,) = torch.autograd.grad(L.agg_loss(want, mask), lp1)
        (g2,) = torch.autograd.grad(L.agg_loss(got, mask), lp2)
        assert torch.equal(g2, g1)


@pytest.mark.parametrize("mode", sorted(L.LOSS_AGG_MODES))
@pytest.mark.parametrize("cut", [1, 2, 3])
def test_micro_batch_losses_with_batch_totals_sum_to_the_whole(mode, cut):
    """Learner gradient accumulation: rows cut into slices, each slice aggregated with the
    whole batch's ``agg_totals``; the slices' losses (policy + entropy + KL) and gradients
    add up to the one-pass ones. Rows of different lengths, one with no valid token."""
    g = torch.Generator().manual_seed(7)
    N, T = 5, 6
    logp = (-torch.rand(N, T, generator=g, dtype=torch.float64) - 0.1).requires_grad_(True)
    old = logp.detach() - 0.3 * torch.rand(N, T, generator=g, dtype=torch.float64)
    ref = logp.detach() - 0.2
    ent = torch.rand(N, T, generator=g, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -0.5, 0.25, 2.0, -1.0], dtype=torch.float64)
    mask = torch.zeros(N, T)
    for i, n in enumerate([6, 3, 0, 5, 1]):
        mask[i, :n] = 1
    off = torch.tensor([False, True, False, False, True])
    kw = dict(agg_mode=mode, max_len=T, micro_batch_rows=2, clip_fresh=False, entropy_coeff=0.01, kl_coeff=0.05)

    whole, _ = L.mixed_policy_loss(logp, old, adv, mask, off, entropy=ent, ref_logp=ref, **kw)
    g_logp, g_ent = torch.autograd.grad(whole, (logp, ent))
    totals = L.agg_totals(mask)
    parts = []
    for s in range(0, N, cut):
        sl = slice(s, s + cut)
        part, _ = L.mixed_policy_loss(logp[sl], old[sl], adv[sl], mask[sl], off[sl], entropy=ent[sl], ref_logp=ref[sl], totals=totals, **kw)
        parts.append(part)
    summed = sum(parts)
    p_logp, p_ent = torch.autograd.grad(summed, (logp, ent))
    assert torch.allclose(summed, whole, atol=1e-12)
    assert torch.allclose(p_logp, g_logp, atol=1e-12) and torch.allclose(p_ent, g_ent, atol=1e-12)
    # without the totals a slice divides by its own counts: the sum differs (the point)
    if cut < N and mode != "seq-mean-token-sum-norm-official":
        own = sum(
            L.mixed_policy_loss(
                logp[s : s + cut],
                old[s : s + cut],
                adv[s : s + cut],
                mask[s : s + cut],
                off[s : s + cut],
                entropy=ent[s : s + cut],
                ref_logp=ref[s : s + cut],
                **kw,
            )[0]
            for s in range(0, N, cut)
        )
        assert not torch.allclose(own, whole)
