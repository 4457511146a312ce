import pytest
import torch

from marlhf_edu import masked_mean, policy_loss, ppo_loss, value_loss
from tests.conftest import right_padded_mask


def test_policy_loss_value_and_stats(gen):
    old = -torch.rand(4, 8, generator=gen)
    new = old + 0.3 * torch.randn(4, 8, generator=gen)
    adv = torch.randn(4, 8, generator=gen)
    m = right_padded_mask(gen, 4, 8)
    loss, stats = policy_loss(new, old, adv, m, cliprange=0.2)
    ratio = torch.exp(new - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    assert torch.allclose(loss, pg[m.bool()].mean())
    clipped = (-adv * ratio.clamp(0.8, 1.2)) > (-adv * ratio)
    assert stats["clipfrac"].item() == pytest.approx(clipped[m.bool()].float().mean().item())
    assert stats["approxkl"].item() == pytest.approx(0.5 * ((new - old)[m.bool()] ** 2).mean().item(), rel=1e-5)


def test_ratio_one_gives_zero_approxkl(gen):
    old = -torch.rand(3, 5, generator=gen)
    loss, stats = policy_loss(old.clone(), old, torch.randn(3, 5, generator=gen), torch.ones(3, 5))
    assert stats["approxkl"].item() == 0 and stats["clipfrac"].item() == 0
    assert stats["ratio_mean"].item() == 1


def test_policy_gradient_zero_exactly_where_clip_active(gen):
    old = -torch.rand(6, 10, generator=gen)
    adv = torch.randn(6, 10, generator=gen)
    new = (old + 0.5 * torch.randn(6, 10, generator=gen)).requires_grad_(True)
    m = torch.ones(6, 10)
    loss, _ = policy_loss(new, old, adv, m, 0.2)
    loss.backward()
    ratio = torch.exp(new.detach() - old)
    active = (-adv * ratio.clamp(0.8, 1.2)) > (-adv * ratio)
    assert active.any() and (~active).any()
    assert (new.grad[active] == 0).all()
    assert (new.grad[~active] != 0).all()


def test_value_gradient_zero_exactly_where_clip_active(gen):
    old_v = torch.randn(5, 9, generator=gen)
    v = (old_v + 0.5 * torch.randn(5, 9, generator=gen)).requires_grad_(True)
    ret = torch.randn(5, 9, generator=gen)
    loss, stats = value_loss(v, old_v, ret, torch.ones(5, 9), 0.2)
    loss.backward()
    vd = v.detach()
    clipped_v = old_v + (vd - old_v).clamp(-0.2, 0.2)
    active = (clipped_v - ret) ** 2 > (vd - ret) ** 2
    assert active.any() and (~active).any()
    assert (v.grad[active] == 0).all() and (v.grad[~active] != 0).all()
    expected = 0.5 * torch.maximum((vd - ret) ** 2, (clipped_v - ret) ** 2).mean()
    assert torch.allclose(loss, expected)
    assert stats["clipfrac"].item() == pytest.approx(active.float().mean().item())


def test_masked_entries_never_matter(gen):
    old = -torch.rand(3, 6, generator=gen)
    new = old + 0.2 * torch.randn(3, 6, generator=gen)
    adv, ret = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    m = right_padded_mask(gen, 3, 6)
    a = ppo_loss(new, old, adv, torch.zeros(3, 6), torch.zeros(3, 6), ret, m)
    junk = lambda x: torch.where(m.bool(), x, torch.tensor(float("nan")))
    b = ppo_loss(junk(new), junk(old), junk(adv), junk(torch.zeros(3, 6)), junk(torch.zeros(3, 6)), junk(ret), m)
    assert torch.equal(a[0], b[0])


def test_token_mean_and_sequence_mean_weigh_tokens_differently():
    from marlhf_edu.math.ppo_objective import aggregate_loss

    mask = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    for how, short_token, long_token in (("token-mean", 1 / 10, 1 / 10), ("sequence-mean", 1 / 4, 1 / 16)):
        per_token = torch.ones(2, 8, requires_grad=True)
        aggregate_loss(per_token, mask, how).backward()
        assert per_token.grad[0, 0].item() == pytest.approx(short_token) and per_token.grad[1, 0].item() == pytest.approx(long_token)
        assert (per_token.grad[~mask] == 0).all()
    with pytest.raises(ValueError, match="how"):
        aggregate_loss(torch.ones(2, 8), mask, "sum")
    new, old, adv = torch.zeros(2, 8), torch.zeros(2, 8), torch.randn(2, 8)
    assert not torch.allclose(policy_loss(new, old, adv, mask)[0], policy_loss(new, old, adv, mask, 0.2, "sequence-mean")[0])


def test_ppo_loss_combines_terms(gen):
    old = -torch.rand(2, 5, generator=gen)
    new = old + 0.1 * torch.randn(2, 5, generator=gen)
    adv, old_v, ret = (torch.randn(2, 5, generator=gen) for _ in range(3))
    v = old_v + 0.5 * torch.randn(2, 5, generator=gen)  # far enough from the old values that clipping acts
    ent = torch.rand(2, 5, generator=gen)
    m = torch.ones(2, 5)
    loss, stats = ppo_loss(new, old, adv, v, old_v, ret, m, ent, vf_coef=0.5, ent_coef=0.01, cliprange_value=0.2)
    pg, _ = policy_loss(new, old, adv, m)
    vf, vf_stats = value_loss(v, old_v, ret, m, 0.2)
    assert 0 < vf_stats["clipfrac"] < 1  # the clipped branch wins on some tokens, not all
    unclipped = 0.5 * masked_mean((v - ret) ** 2, m)
    assert vf > unclipped  # value clipping made this loss larger: it is a max, not a bound on V
    assert torch.allclose(loss, pg + 0.5 * vf - 0.01 * masked_mean(ent, m))
    assert stats["skipped"].item() == 0
    with pytest.raises(ValueError, match="ent_coef"):
        ppo_loss(new, old, adv, v, v, ret, m, ent_coef=0.1)


def test_ratio_threshold_skips_whole_minibatch(gen):
    old = -torch.rand(2, 5, generator=gen)
    new = (old + 3.0).requires_grad_(True)  # ratio e^3 ≈ 20 > 10
    v = torch.zeros(2, 5, requires_grad=True)
    loss, stats = ppo_loss(new, old, torch.randn(2, 5, generator=gen), v, v.detach(), torch.randn(2, 5), torch.ones(2, 5))
    loss.backward()
    assert loss.item() == 0 and stats["skipped"].item() == 1
    assert (new.grad == 0).all() and (v.grad == 0).all()
    loss2, stats2 = ppo_loss(new, old, torch.randn(2, 5), v, v.detach(), torch.randn(2, 5), torch.ones(2, 5),
                             ratio_threshold=100.0)
    assert stats2["skipped"].item() == 0 and loss2.item() != 0


def test_degenerate_inputs():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="selects no element"):
        policy_loss(x, x, x, torch.zeros(2, 3))
    nan = x.clone(); nan[0, 0] = float("nan")
    with pytest.raises(ValueError, match="advantages.*NaN"):
        policy_loss(x, x, nan, torch.ones(2, 3))
    one = torch.tensor([[1, 0, 0], [0, 0, 0]])
    loss, _ = policy_loss(x, x, torch.ones(2, 3), one)  # a single valid token is fine
    assert loss.item() == -1.0


def test_overflowing_ratio_is_skipped_with_finite_zero_gradients(gen):
    old = -torch.rand(2, 5, generator=gen)
    new = (old + 100.0).requires_grad_(True)  # e^100 overflows fp32
    v = torch.zeros(2, 5, requires_grad=True)
    loss, stats = ppo_loss(new, old, -torch.ones(2, 5), v, v.detach(), torch.randn(2, 5), torch.ones(2, 5))
    loss.backward()
    assert stats["skipped"].item() == 1 and loss.item() == 0
    assert torch.isfinite(new.grad).all() and (new.grad == 0).all()
