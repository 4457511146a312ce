import pytest
import torch

from marlhf_edu import gae_advantages, gae_advantages_reference
from tests.conftest import right_padded_mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.9, 0.0), (1.0, 1.0), (0.5, 0.5)])
def test_vectorised_equals_loop(gen, gamma, lam):
    v, r = torch.randn(6, 40, generator=gen), torch.randn(6, 40, generator=gen)
    m = right_padded_mask(gen, 6, 40)
    a1, r1 = gae_advantages(v, r, m, gamma, lam)
    a2, r2 = gae_advantages_reference(v, r, m, gamma, lam)
    assert torch.allclose(a1, a2, atol=1e-5) and torch.allclose(r1, r2, atol=1e-5)


def test_holes_in_the_mask_split_episodes(gen):
    v, r = torch.randn(2, 8, generator=gen), torch.randn(2, 8, generator=gen)
    m = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]])  # a gap; left padding
    a1, _ = gae_advantages(v, r, m)
    a2, _ = gae_advantages_reference(v, r, m)
    assert torch.allclose(a1, a2, atol=1e-6)
    alone, _ = gae_advantages_reference(v[:1, 3:6], r[:1, 3:6], torch.ones(1, 3))
    assert torch.allclose(a1[0, 3:6], alone[0], atol=1e-6)


def test_lambda_zero_is_td_residual(gen):
    v, r = torch.randn(3, 10, generator=gen), torch.randn(3, 10, generator=gen)
    m = torch.ones(3, 10)
    adv, ret = gae_advantages(v, r, m, gamma=0.9, lam=0.0)
    next_v = torch.cat([v[:, 1:], torch.zeros(3, 1)], 1)
    assert torch.allclose(adv, r + 0.9 * next_v - v, atol=1e-6)
    assert torch.allclose(ret, adv + v)


def test_gamma_lambda_one_is_reward_to_go(gen):
    v, r = torch.randn(3, 10, generator=gen), torch.randn(3, 10, generator=gen)
    m = right_padded_mask(gen, 3, 10)
    adv, ret = gae_advantages(v, r, m, gamma=1.0, lam=1.0)
    rm = r * m
    to_go = rm.flip(1).cumsum(1).flip(1) * m
    assert torch.allclose(adv, to_go - v * m, atol=1e-5)
    assert torch.allclose(ret, to_go, atol=1e-5)


def test_masked_entries_never_change_results(gen):
    v, r = torch.randn(4, 12, generator=gen), torch.randn(4, 12, generator=gen)
    m = right_padded_mask(gen, 4, 12)
    base = gae_advantages(v, r, m)
    for fill in (1e6, float("nan"), float("-inf")):
        vv = torch.where(m.bool(), v, torch.tensor(fill))
        rr = torch.where(m.bool(), r, torch.tensor(fill))
        for fn in (gae_advantages, gae_advantages_reference):
            out = fn(vv, rr, m)
            assert torch.equal(out[0], fn(v, r, m)[0])
            assert (out[0][~m.bool()] == 0).all() and (out[1][~m.bool()] == 0).all()
    assert torch.allclose(base[0], gae_advantages_reference(v, r, m)[0], atol=1e-5)


def test_gae_errors():
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        gae_advantages(torch.zeros(3), torch.zeros(3), torch.ones(3))
    bad = torch.zeros(1, 3); bad[0, 1] = float("nan")
    with pytest.raises(ValueError, match="values.*NaN"):
        gae_advantages(bad, torch.zeros(1, 3), torch.ones(1, 3))
    with pytest.raises(ValueError, match="shapes must match"):
        gae_advantages(torch.zeros(1, 3), torch.zeros(1, 4), torch.ones(1, 3))
