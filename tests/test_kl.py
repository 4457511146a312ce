import math

import pytest
import torch

from marlhf_edu import AdaptiveKLController, FixedKLController, kl_penalty, token_level_rewards


def categorical_pair(gen, V=25, shift=0.6):
    ref = torch.log_softmax(torch.randn(V, generator=gen), -1)
    logp = torch.log_softmax(ref + shift * torch.randn(V, generator=gen), -1)
    return logp, ref


def test_k1_and_k3_monte_carlo_approach_exact_kl(gen):
    logp, ref = categorical_pair(gen)
    exact = (logp.exp() * (logp - ref)).sum().item()
    assert kl_penalty(logp[None, None], ref[None, None], "full").item() == pytest.approx(exact, rel=1e-5)
    a = torch.multinomial(logp.exp(), 400_000, replacement=True, generator=gen)
    for kind in ("k1", "k3"):
        est = kl_penalty(logp[a], ref[a], kind).mean().item()
        assert est == pytest.approx(exact, rel=0.03), kind
    # k2 is biased: its mean is measurably off at this distance
    k2 = kl_penalty(logp[a], ref[a], "k2").mean().item()
    assert abs(k2 - exact) > 0.05 * exact


def test_k3_never_negative_and_accurate_near_zero():
    d = torch.cat([torch.linspace(-20, 20, 4001), torch.logspace(-9, -1, 200), -torch.logspace(-9, -1, 200)])
    k3 = kl_penalty(torch.zeros_like(d), d, "k3")  # log π = 0, log π_ref = d
    assert (k3 >= 0).all()
    exact = (torch.expm1(d.double()) - d.double())
    small = d.abs() < 1e-2
    assert torch.allclose(k3[small].double(), exact[small], rtol=1e-5, atol=1e-20)
    assert torch.allclose(k3[~small].double(), exact[~small], rtol=1e-5)


def test_estimator_formulas(gen):
    logp, ref = -torch.rand(3, 5, generator=gen), -torch.rand(3, 5, generator=gen)
    d = logp - ref
    assert torch.equal(kl_penalty(logp, ref, "k1"), d)
    assert torch.equal(kl_penalty(logp, ref, "abs"), d.abs())
    assert torch.allclose(kl_penalty(logp, ref, "k2"), 0.5 * d**2)
    assert torch.equal(kl_penalty(logp, ref, "mse"), kl_penalty(logp, ref, "k2"))
    assert torch.allclose(kl_penalty(logp, ref, "k3"), torch.exp(-d) - 1 + d, atol=1e-7)


def test_full_kl_matches_torch_and_handles_zero_probabilities(gen):
    p = torch.log_softmax(torch.randn(2, 3, 10, generator=gen), -1)
    q = torch.log_softmax(torch.randn(2, 3, 10, generator=gen), -1)
    expected = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=p),
                                                 torch.distributions.Categorical(logits=q))
    assert torch.allclose(kl_penalty(p, q, "full"), expected, atol=1e-6)
    p0 = p.clone(); p0[..., 0] = float("-inf")
    q0 = q.clone(); q0[..., 0] = float("-inf")
    assert torch.isfinite(kl_penalty(torch.log_softmax(p0, -1), torch.log_softmax(q0, -1), "full")).all()


def test_kl_penalty_errors():
    with pytest.raises(ValueError, match="unknown kind"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="shapes must match"):
        kl_penalty(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), "full")


def test_adaptive_controller_follows_the_rule():
    c = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    c.update(9.0, n_steps=256)  # error 0.5 -> clipped to 0.2
    assert c.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000))
    v = c.value
    c.update(4.8, n_steps=100)  # error -0.2 exactly
    assert c.value == pytest.approx(v * (1 - 0.2 * 100 / 10000))
    v = c.value
    c.update(6.6, n_steps=50)  # error 0.1, inside the clip
    assert c.value == pytest.approx(v * (1 + 0.1 * 50 / 10000))
    state = c.state_dict()
    d = AdaptiveKLController(1.0, 1.0, 1.0)
    d.load_state_dict(state)
    assert d.value == c.value and d.target == 6.0
    with pytest.raises(ValueError):
        c.update(float("nan"), 1)


def test_fixed_controller():
    c = FixedKLController(0.05)
    c.update(100.0, 1000)
    assert c.value == 0.05
    with pytest.raises(ValueError):
        FixedKLController(-1)


def test_token_level_rewards(gen):
    logp = -torch.rand(3, 6, generator=gen)
    ref = -torch.rand(3, 6, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    scores = torch.tensor([1.0, -2.0, 3.0])
    rewards, non_score, kls = token_level_rewards(scores, logp, ref, mask, kl_coef=0.1)
    expected_kls = (logp - ref) * mask
    assert torch.allclose(kls, expected_kls)
    assert torch.allclose(non_score, -0.1 * expected_kls)
    bonus = torch.zeros(3, 6); bonus[0, 5], bonus[1, 2], bonus[2, 0] = 1.0, -2.0, 3.0
    assert torch.allclose(rewards, non_score + bonus)
    # padding content is irrelevant
    garbage = torch.where(mask.bool(), logp, torch.tensor(float("nan")))
    again, _, _ = token_level_rewards(scores, garbage, ref, mask, kl_coef=0.1)
    assert torch.equal(again, rewards)
    with pytest.raises(ValueError, match="scores must have shape"):
        token_level_rewards(scores[:2], logp, ref, mask, 0.1)
