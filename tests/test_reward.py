import math

import pytest
import torch
import torch.nn.functional as F

from marlhf_edu import llama2_reward_select, pairwise_reward_loss


def test_bradley_terry_value(gen):
    c, r = torch.randn(32, generator=gen), torch.randn(32, generator=gen)
    assert torch.allclose(pairwise_reward_loss(c, r), -torch.log(torch.sigmoid(c - r)).mean())
    assert math.isclose(pairwise_reward_loss(c, c).item(), math.log(2), rel_tol=1e-6)


def test_margin_shifts_the_gap(gen):
    c, r = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    m = torch.randint(0, 4, (16,), generator=gen).float()
    assert torch.allclose(pairwise_reward_loss(c, r, m), pairwise_reward_loss(c - m, r))
    # a larger margin always means a larger loss for the same scores
    assert pairwise_reward_loss(c, r, m + 1) > pairwise_reward_loss(c, r, m)


def test_margin_gradient_is_sigmoid_of_shortfall():
    gap = torch.tensor([2.0], requires_grad=True)
    pairwise_reward_loss(gap, torch.zeros(1), torch.tensor([3.0])).backward()
    assert torch.allclose(gap.grad, -torch.sigmoid(torch.tensor([1.0])))


def test_stable_for_huge_gaps():
    loss = pairwise_reward_loss(torch.tensor([-500.0]), torch.tensor([500.0]))
    assert torch.isfinite(loss) and abs(loss.item() - 1000) < 1e-3
    assert pairwise_reward_loss(torch.tensor([500.0]), torch.tensor([-500.0])).item() == pytest.approx(0, abs=1e-6)


def test_reward_loss_bad_input():
    with pytest.raises(ValueError, match="shapes must match"):
        pairwise_reward_loss(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="NaN"):
        pairwise_reward_loss(torch.tensor([float("nan")]), torch.zeros(1))
    with pytest.raises(ValueError, match="empty"):
        pairwise_reward_loss(torch.zeros(0), torch.zeros(0))


def test_llama2_select():
    s = torch.tensor([0.0, 0.149, 0.15, 0.9])
    h = torch.tensor([1.0, 1.0, 0.2, 0.3])
    assert llama2_reward_select(s, h).tolist() == pytest.approx([0.0, 0.149, 0.2, 0.3])
    assert llama2_reward_select(s, h, threshold=0.5).tolist() == pytest.approx([0.0, 0.149, 0.15, 0.3])
