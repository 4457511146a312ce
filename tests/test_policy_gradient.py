"""REINFORCE, baselines and importance weights (chapter 04)."""

import math
import random

import pytest
import torch

from marlhf_edu.data.toyworld import ToyWorld
from marlhf_edu.math.policy_gradient import (effective_sample_size, importance_weights,
                                             leave_one_out_baseline, reinforce_loss)

MU = torch.tensor([0.2, 0.5, 0.9, 0.4, 0.7, 0.1])


def exact_bandit_gradient(theta):
    theta = theta.clone().requires_grad_(True)
    (torch.softmax(theta, -1) * MU).sum().backward()
    return theta.grad


def bandit_estimates(theta, M, N, offset, baseline, seed):
    gen = torch.Generator().manual_seed(seed)
    thetas = theta.expand(M, -1).clone().requires_grad_(True)
    logp = torch.log_softmax(thetas, -1)
    a = torch.multinomial(logp.detach().exp(), N, replacement=True, generator=gen)
    R = torch.bernoulli(MU[a], generator=gen) + offset
    b = {None: None, "mean": R.mean(1, keepdim=True).expand(M, N).reshape(-1),
         "loo": leave_one_out_baseline(R.reshape(-1), N)}[baseline]
    loss = reinforce_loss(logp.gather(1, a).reshape(-1, 1), R.reshape(-1), torch.ones(M * N, 1), b)
    return -M * torch.autograd.grad(loss, thetas)[0]


THETA = torch.tensor([0.5, 0.3, -0.4, 0.1, 0.0, 0.2])


@pytest.mark.parametrize("baseline", [None, "loo"])
def test_reinforce_is_unbiased_with_and_without_a_leave_one_out_baseline(baseline):
    exact = exact_bandit_gradient(THETA)
    g = bandit_estimates(THETA, 20000, 8, 0.0, baseline, seed=0)
    se = g.std(0) / math.sqrt(len(g))
    assert ((g.mean(0) - exact).abs() < 4 * se + 1e-4).all(), (g.mean(0), exact)


def test_batch_mean_baseline_shrinks_the_gradient_by_n_minus_1_over_n():
    exact = exact_bandit_gradient(THETA)
    g = bandit_estimates(THETA, 20000, 4, 0.0, "mean", seed=1)
    along = (g.mean(0) @ exact / exact.norm() ** 2).item()
    assert abs(along - 0.75) < 0.04, along


def test_baseline_removes_the_variance_of_a_reward_offset():
    plain = bandit_estimates(THETA, 4000, 8, 10.0, None, seed=2).var(0).sum()
    loo = bandit_estimates(THETA, 4000, 8, 10.0, "loo", seed=2).var(0).sum()
    assert plain > 100 * loo
    # the leave-one-out baseline removes a constant exactly: the same draws give the same gradients
    assert torch.allclose(bandit_estimates(THETA, 50, 8, 0.0, "loo", seed=3),
                          bandit_estimates(THETA, 50, 8, 10.0, "loo", seed=3), atol=1e-5)


def test_reinforce_loss_sums_tokens_ignores_padding_and_detaches_the_baseline():
    logprobs = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -9.0, -1e9]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    baseline = torch.tensor([0.5, 0.5], requires_grad=True)
    loss = reinforce_loss(logprobs, torch.tensor([1.0, 0.0]), mask, baseline)
    assert torch.isclose(loss, torch.tensor(-0.5 * (0.5 * -3.0 + -0.5 * -0.5)))
    loss.backward()
    assert baseline.grad is None
    assert torch.equal(logprobs.grad, torch.tensor([[-0.25, -0.25, 0.0], [0.25, 0.0, 0.0]]))


def test_reinforce_loss_errors_name_the_argument():
    lp, m = torch.zeros(3, 2), torch.ones(3, 2)
    with pytest.raises(ValueError, match="`rewards` must have shape \\(3,\\)"):
        reinforce_loss(lp, torch.zeros(3, 1), m)
    with pytest.raises(ValueError, match="`baseline` must be a number or have the shape"):
        reinforce_loss(lp, torch.zeros(3), m, torch.zeros(2))
    with pytest.raises(ValueError, match="`rewards` contains NaN"):
        reinforce_loss(lp, torch.tensor([0.0, float("nan"), 0.0]), m)
    with pytest.raises(ValueError, match="\\(B, T\\)"):
        reinforce_loss(torch.zeros(3), torch.zeros(3), torch.ones(3))


def test_leave_one_out_baseline():
    r = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0, 30.0])
    assert torch.equal(leave_one_out_baseline(r, 3), torch.tensor([2.5, 2.0, 1.5, 25.0, 20.0, 15.0]))
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        leave_one_out_baseline(r, 4)
    with pytest.raises(ValueError, match="group_size"):
        leave_one_out_baseline(r, 1)


def test_importance_weights_reweight_old_samples_to_the_new_policy():
    gen = torch.Generator().manual_seed(0)
    old, new = torch.log_softmax(torch.randn(5, generator=gen), -1), torch.log_softmax(torch.randn(5, generator=gen), -1)
    a = torch.multinomial(old.exp(), 200000, replacement=True, generator=gen)
    f = torch.arange(5.0)
    w = importance_weights(new[a][:, None], old[a][:, None], torch.ones(len(a), 1))
    assert abs((w * f[a]).mean() - (new.exp() * f).sum()) < 0.02
    # a sequence's weight is the product of its tokens' ratios; padding counts for nothing
    lp, old_lp = torch.tensor([[0.0, -1.0, 5.0]]), torch.tensor([[-1.0, -1.5, 0.0]])
    assert torch.isclose(importance_weights(lp, old_lp, torch.tensor([[1, 1, 0]])), torch.tensor([math.exp(1.5)]))


def test_effective_sample_size():
    assert effective_sample_size(torch.ones(8)).item() == pytest.approx(8)
    assert effective_sample_size(torch.tensor([1.0, 0, 0, 0])).item() == pytest.approx(1)
    assert effective_sample_size(torch.tensor([1.0, 1.0, 2.0])).item() == pytest.approx(16 / 6)
    with pytest.raises(ValueError, match="finite and ≥ 0"):
        effective_sample_size(torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="every weight is 0"):  # 0/0 would return NaN, outside 1 ≤ ESS ≤ B
        effective_sample_size(torch.zeros(3))
    assert effective_sample_size(torch.tensor([1e-30, 1e-30])).item() == pytest.approx(2)  # tiny is not zero


def test_gold_reward_follows_the_judge():
    world = ToyWorld()
    harmful = next(p for p in world.train_prompts if p.harmful)
    benign = next(p for p in world.train_prompts if not p.harmful)
    assert world.gold_reward(harmful, world.refusal(random.Random(0))) == 1.0
    assert world.gold_reward(harmful, world.compliance(harmful)) == 0.0
    assert world.gold_reward(benign, benign.answer) == 1.0
    assert world.gold_reward(benign, "I can't help with that.") == 0.0
    assert world.gold_reward(benign, world.wrong(benign, random.Random(0))) == 0.0


def test_expected_estimate_is_the_exact_gradient_for_unbiased_baselines_and_shrinks_for_the_group_mean():
    from marlhf_edu.math.policy_gradient import expected_estimate, leave_one_out_baseline

    theta = torch.tensor([0.5, 0.3, -0.4, 0.1], dtype=torch.float64, requires_grad=True)
    pay = torch.tensor([0.2, 0.5, 0.9, 0.4], dtype=torch.float64) + 3.0
    (exact,) = torch.autograd.grad((torch.softmax(theta, -1) * pay).sum(), theta)  # ∇J by autograd
    probs = torch.softmax(theta.detach(), -1)
    for K in (1, 2, 3):
        assert torch.allclose(expected_estimate(probs, pay, K), exact, atol=1e-12)
        assert torch.allclose(expected_estimate(probs, pay, K, lambda r: torch.full_like(r, 7.0)), exact, atol=1e-12)
    assert torch.allclose(expected_estimate(probs, pay, 3, lambda r: leave_one_out_baseline(r, 3)), exact, atol=1e-12)
    for K in (2, 3, 4):
        assert torch.allclose(expected_estimate(probs, pay, K, lambda r: r.mean().expand(K)), exact * (K - 1) / K,
                              atol=1e-12)
    assert torch.allclose(expected_estimate(probs, pay, 2, lambda r: r), torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="too many"):
        expected_estimate(torch.full((10,), 0.1), torch.zeros(10), 6)
    with pytest.raises(ValueError, match="probability vector"):
        expected_estimate(torch.tensor([0.5, 0.6]), torch.zeros(2), 2)
