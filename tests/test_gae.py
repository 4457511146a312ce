import pytest
import torch

from marlhf_edu import gae_advantages, gae_advantages_reference
from marlhf_edu.math.gae import CountingTask, gae_bias_variance
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


def test_counting_task_values_are_the_mean_score():
    task = CountingTask.random(T=6, noise=0.5, seed=3)
    V = task.true_values()
    counts, tokens, rewards = task.sample(200_000, seed=4)
    assert rewards[:, :-1].abs().max() == 0 and torch.equal(counts[:, 1:] - counts[:, :-1], tokens)
    assert abs(rewards[:, -1].mean().item() - V[0, 0].item()) < 0.01  # V(s_0): the expected score
    after_one = counts[:, 1] == 1
    assert abs(rewards[after_one, -1].mean().item() - V[1, 1].item()) < 0.015
    critic = task.fit_critic(200_000, seed=5)  # many responses: the fitted table approaches V where states are visited
    reachable = torch.ones(3, 3).tril().bool()  # k ≤ t
    assert (critic[:3, :3] - V[:3, :3])[reachable].abs().max() < 0.03


def test_gae_bias_and_spread_against_lambda():
    task = CountingTask.random(T=8, noise=0.0, seed=0)
    V = task.true_values()
    lams = (0.0, 0.5, 0.9, 1.0)
    exact = gae_bias_variance(task, V[:8], lams, n=20_000, seed=1)
    # an exact critic: unbiased at every λ (the bias left is the measurement's noise floor), and with a deterministic
    # score λ = 0's TD error given (s_t, a_t) has no spread at all; the spread grows with λ
    assert all(bias < 0.02 for bias, _ in exact.values())
    assert exact[0.0][1] < 1e-9
    spreads = [exact[lam][1] for lam in lams]
    assert spreads == sorted(spreads) and spreads[-1] > 0.2
    # a critic that is wrong everywhere: λ = 1 only uses it as a baseline (no bias), λ = 0 inherits its errors
    wrong = V[:8] + torch.randn(8, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    off = gae_bias_variance(task, wrong, lams, n=20_000, seed=1)
    assert off[1.0][0] < 0.02 and off[0.0][0] > 0.3
    assert [off[lam][0] for lam in lams] == sorted((off[lam][0] for lam in lams), reverse=True)
    # noise on the score adds spread at every λ > 0 (λ = 0 never sees the score before the last token)
    noisy = gae_bias_variance(CountingTask.random(T=8, noise=1.0, seed=0), V[:8], lams, n=20_000, seed=1)
    assert all(noisy[lam][1] > exact[lam][1] + 0.05 for lam in lams[1:])
    # no critic: λ = 0 credits nothing before the last token, so there its bias is the spread of the true advantages;
    # the last token's error, V(s_{T-1}), does not depend on its action: no bias there
    t_idx = torch.arange(8).expand(20_000, 8)
    counts, tokens, _ = task.sample(20_000, seed=1)
    true_adv = V[t_idx + 1, counts[:, :8] + tokens] - V[t_idx, counts[:, :8]]
    rms_before_last = true_adv[:, :-1].pow(2).mean().sqrt().item()
    none = gae_bias_variance(task, torch.zeros(8, 9), (0.0,), n=20_000, seed=1)[0.0]
    assert abs(none[0] ** 2 - 7 / 8 * rms_before_last ** 2) < 0.002


def test_graded_cell_prints_a_repeated_check_once(capsys):
    """Hidden tests rerun the checker with other seeds: one block, each case PASS on every seed or FAIL with its seed."""
    from marlhf_edu.teaching.exercises import check_gae_bootstrap, grade

    def bootstrapped_gae(values, rewards, mask, bootstrap, gamma, lam):  # written out: the package's GAE is withheld
        mask = mask.bool()
        values, rewards = torch.where(mask, values, 0.0), torch.where(mask, rewards, 0.0)
        advantages, running = torch.zeros_like(values), torch.zeros(values.shape[0])
        for t in reversed(range(values.shape[1])):
            has_next = mask[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(mask[:, 0])
            next_value = torch.where(has_next, values[:, min(t + 1, values.shape[1] - 1)], bootstrap)
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            running = torch.where(mask[:, t], delta + gamma * lam * has_next * running, 0.0)
            advantages[:, t] = running
        return advantages, advantages + values

    reports = [check_gae_bootstrap(bootstrapped_gae, seed=seed) for seed in (4, 141, 142)]
    assert grade(reports, points=3) == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "check_gae_bootstrap, seeds 4, 141, 142: 21 of 21 cases pass"
    assert len(lines) == 1 + 7 + 1 and all(line.startswith("  PASS ") for line in lines[1:8])
    # a learner who ignores the bootstrap fails the cut-off cases, each FAIL naming its seed
    wrong = [check_gae_bootstrap(lambda v, r, m, b, g, l: bootstrapped_gae(v, r, m, 0 * b, g, l), seed=seed)
             for seed in (4, 141, 142)]
    grade(wrong, points=3)
    lines = capsys.readouterr().out.splitlines()
    failed = [line for line in lines if line.startswith("  FAIL ")]
    assert failed and {line.rsplit("(seed ", 1)[1] for line in failed} == {"4)", "141)", "142)"}
    assert sum(line.startswith("  PASS ") for line in lines) == 7 - len(failed) // 3
    grade(reports[:1], points=3)  # run once: nothing to tell apart
    assert capsys.readouterr().out.splitlines()[0] == "check_gae_bootstrap: 7 of 7 cases pass"
