"""Checkers for the exercises of the book's first part, The math (chapters 00–06).

- chapter 00: `check_sequence_means`, each row's mean over its own valid tokens (`check_masked_mean`, the
  batch-wide mean, is kept for the API)
- chapter 01: `check_pairwise_reward_loss`, the Bradley–Terry loss with Llama 2's margin
- chapter 02: `check_tempered_logprobs`, log-probs under the sampling temperature (`check_logprobs_from_logits`:
  at temperature 1)
- chapter 03: `check_kl_penalty`, a per-token KL estimator (k3 in the chapter)
- chapter 04: `check_expected_estimate`, the exact mean of REINFORCE's estimate of the gradient under a baseline
- chapter 05: `check_gae_bootstrap`, GAE with a bootstrap value for truncated rows, compared with
  `gae_with_bootstrap_reference` (`check_gae_advantages`: plain GAE, which problem set p1 grades)
- chapter 06: `check_policy_loss` and `check_value_loss`, PPO's clipped losses, their values and gradients
"""

from __future__ import annotations

from typing import Callable

import torch

from marlhf_edu.math.gae import gae_advantages
from marlhf_edu.math.kl import kl_penalty
from marlhf_edu.math.logprobs import logprobs_from_logits
from marlhf_edu.math.masked import last_valid_index, masked_mean
from marlhf_edu.math.policy_gradient import expected_estimate
from marlhf_edu.math.ppo_objective import policy_loss, value_loss
from marlhf_edu.math.reward import pairwise_reward_loss
from marlhf_edu.teaching.grading import (CheckReport, _compare, _first_tensor, _learner, _padded_mask, _run,
                                         _withholds)


@_withholds("marlhf_edu.math.masked.masked_mean")
def check_masked_mean(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(values, mask) -> scalar` against `masked_mean`: one mean over every masked element (chapter 00
    grades the per-sequence `check_sequence_means`)."""
    fn = _learner(fn, check_masked_mean)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 7, generator=gen)

    def case(label, values, mask, atol=1e-6):
        def run():
            expected = masked_mean(values, mask)
            return _compare(label, _first_tensor(fn(values.clone(), mask.clone())), expected, atol, 1e-5)
        return label, run

    right = _padded_mask(gen, 4, 7)
    garbage = torch.where(right, x, torch.full_like(x, 1e6))
    nan_pad = torch.where(right, x, torch.full_like(x, float("nan")))
    return _run("check_masked_mean", seed=seed, cases=[
        case("all tokens valid", x, torch.ones(4, 7)),
        case("right padding (float mask)", x, right.float()),
        case("left padding (bool mask)", x, _padded_mask(gen, 4, 7, left=True)),
        case("padding holds 1e6", garbage, right.float()),
        case("padding holds NaN", nan_pad, right.float()),
        case("one valid token", x, torch.zeros(4, 7).index_put_((torch.tensor([2]), torch.tensor([3])), torch.tensor(1.0))),
    ])


@_withholds("marlhf_edu.math.masked.masked_mean")
def check_sequence_means(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(values, mask) -> (B,)`: each row's mean over its own valid tokens. Chapter 00's exercise.

    The reference is `masked_mean(values, mask, dim=1)`; rows of different
    lengths weigh their tokens differently, which a batch-wide mean hides.
    """
    fn = _learner(fn, check_sequence_means)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 8, generator=gen)

    def case(label, values, mask):
        def run():
            expected = masked_mean(values, mask, dim=1)
            return _compare(label, _first_tensor(fn(values.clone(), mask.clone())), expected, 1e-6, 1e-5)
        return label, run

    right, left = _padded_mask(gen, 5, 8), _padded_mask(gen, 5, 8, left=True)
    one_each = torch.zeros(5, 8, dtype=torch.bool)
    one_each[torch.arange(5), torch.randint(0, 8, (5,), generator=gen)] = True
    return _run("check_sequence_means", seed=seed, cases=[
        case("all tokens valid", x, torch.ones(5, 8)),
        case("right padding (float mask)", x, right.float()),
        case("left padding (bool mask)", x, left),
        case("padding holds 1e6", torch.where(right, x, 1e6), right.float()),
        case("padding holds NaN", torch.where(left, x, float("nan")), left.long()),
        case("one valid token per row", x, one_each),
        case("a single row", x[:1], right[:1].float()),
    ])


@_withholds("marlhf_edu.math.reward.pairwise_reward_loss", "marlhf_edu.math.dpo.dpo_loss")
def check_pairwise_reward_loss(fn: Callable, seed: int = 1) -> CheckReport:
    """Check `fn(chosen, rejected, margin=None) -> scalar`: its value and its gradients with respect to `chosen`
    and `rejected` (a loss computed outside autograd, or with `rejected` detached, cannot train a reward model).
    `dpo_loss` is withheld too: with zero reference log-probs and β = 1 it is this loss. Chapter 01's exercise."""
    fn = _learner(fn, check_pairwise_reward_loss)
    gen = torch.Generator().manual_seed(seed)
    c, r = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    margin = torch.randint(0, 4, (16,), generator=gen).float()

    def case(label, chosen, rejected, m=None):
        inputs = (lambda: [chosen.clone(), rejected.clone()]) if m is None else (
            lambda: [chosen.clone(), rejected.clone(), m.clone()])
        return _loss_and_grad_case(fn, label, inputs, pairwise_reward_loss, wrt=(0, 1))

    return _run("check_pairwise_reward_loss", seed=seed, cases=[
        case("random scores", c, r),
        case("equal scores give log 2", c, c.clone()),
        case("with margins", c, r, margin),
        case("rejected far above chosen (stability)", torch.full((4,), -200.0), torch.full((4,), 200.0)),
        case("chosen far above rejected", torch.full((4,), 200.0), torch.full((4,), -200.0)),
    ])


@_withholds("marlhf_edu.math.logprobs.logprobs_from_logits", "marlhf_edu.ppo.backends.response_logprobs")
def check_logprobs_from_logits(fn: Callable, seed: int = 2) -> CheckReport:
    """Check `fn(logits, labels) -> (B, T)` log-probs (the label's log-softmax)."""
    fn = _learner(fn, check_logprobs_from_logits)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 5), generator=gen)

    def case(label, z, y, atol=1e-5):
        def run():
            expected = logprobs_from_logits(z, y)
            return _compare(label, fn(z.clone(), y.clone()), expected, atol, 1e-5)
        return label, run

    return _run("check_logprobs_from_logits", seed=seed, cases=[
        case("random logits", logits, labels),
        case("large logits (overflow of a naive softmax)", logits * 1000.0, labels, atol=1e-2),
        case("one-token batch", logits[:1, :1], labels[:1, :1]),
        case("bf16 logits", logits.bfloat16(), labels, atol=2e-2),
    ])


@_withholds("marlhf_edu.math.logprobs.logprobs_from_logits", "marlhf_edu.ppo.backends.response_logprobs")
def check_tempered_logprobs(fn: Callable, seed: int = 2) -> CheckReport:
    r"""Check `fn(logits, labels, temperature) -> (B, T)`: log-probs under the sampling distribution.

    .. math:: \log\pi_\tau(y_t) = \log\operatorname{softmax}(z_t / \tau)_{y_t}

    The reference is computed in float64 from the same logits. Chapter 02's exercise.
    """
    fn = _learner(fn, check_tempered_logprobs)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 11, generator=gen) * 3
    labels = torch.randint(0, 11, (3, 5), generator=gen)

    def case(label, z, y, tau, atol=1e-5):
        def run():
            expected = logprobs_from_logits(z.double() / tau, y)
            return _compare(label, fn(z.clone(), y.clone(), tau), expected, atol, 1e-5)
        return label, run

    return _run("check_tempered_logprobs", seed=seed, cases=[
        case("temperature 1", logits, labels, 1.0),
        case("temperature 0.7 (sharper)", logits, labels, 0.7),
        case("temperature 2 (flatter)", logits, labels, 2.0),
        case("large logits at temperature 0.5", logits * 300.0, labels, 0.5, atol=1e-2),
        case("one-token batch", logits[:1, :1], labels[:1, :1], 0.9),
        case("bf16 logits at temperature 0.8", logits.bfloat16(), labels, 0.8, atol=5e-2),
    ])


@_withholds("marlhf_edu.math.kl.kl_penalty", "marlhf_edu.math.kl._k3")
def check_kl_penalty(fn: Callable, kind: str = "k3", seed: int = 3) -> CheckReport:
    """Check a learner's per-token KL estimator `fn(logprobs, ref_logprobs)` of one `kind`.

    Chapter 03's exercise uses k3. Near d = 0 the tolerance is absolute 1e-8,
    which a naive fp32 `exp(d) - 1 - d` misses.
    """
    fn = _learner(fn, check_kl_penalty)
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 6, generator=gen) * 5
    ref = logp + torch.randn(4, 6, generator=gen)

    def case(label, a, b, atol=1e-6):
        def run():
            expected = kl_penalty(a, b, kind)
            got = fn(a, b)
            problem = _compare(label, got, expected, atol, 1e-4)
            if problem is None and kind == "k3" and bool((got < 0).any()):
                problem = f"{label}: k3 must never be negative, got {got.min().item():.3g}"
            return problem
        return label, run

    tiny = logp + torch.linspace(-1e-3, 1e-3, 24).view(4, 6)
    return _run(f"check_kl_penalty[{kind}]", seed=seed, cases=[
        case("random log-probs", logp, ref),
        case("policy equals reference", logp, logp.clone()),
        case("tiny differences (|d| <= 1e-3)", logp, tiny, atol=1e-8),
        case("large differences", logp, logp + 8.0),
    ])


def _gae_case(fn, label, values, rewards, mask, gamma, lam, expected_fn, extra=()):
    def run():
        adv, ret = expected_fn()
        got = fn(values.clone(), rewards.clone(), mask.clone(), *extra, gamma, lam)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            return f"{label}: expected a tuple (advantages, returns)"
        return _compare(f"{label} (advantages)", got[0], adv, 1e-5, 1e-5) or \
            _compare(f"{label} (returns)", got[1], ret, 1e-5, 1e-5)
    return label, run


@_withholds("marlhf_edu.math.gae.gae_advantages", "marlhf_edu.math.gae.gae_advantages_reference")
def check_gae_advantages(fn: Callable, seed: int = 4) -> CheckReport:
    """Check `fn(values, rewards, mask, gamma, lam) -> (advantages, returns)` against `gae_advantages`."""
    fn = _learner(fn, check_gae_advantages)
    gen = torch.Generator().manual_seed(seed)
    v, r = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)
    right = _padded_mask(gen, 3, 8)

    def case(label, values, rewards, mask, gamma=1.0, lam=0.95):
        return _gae_case(fn, label, values, rewards, mask, gamma, lam,
                         lambda: gae_advantages(values, rewards, mask, gamma, lam))

    return _run("check_gae_advantages", seed=seed, cases=[
        case("no padding", v, r, torch.ones(3, 8)),
        case("right padding", v, r, right.float()),
        case("padding holds garbage", torch.where(right, v, 1e3), torch.where(right, r, -1e3), right.float()),
        case("lambda = 0 (TD residual)", v, r, right.float(), 0.9, 0.0),
        case("gamma = lambda = 1 (reward-to-go)", v, r, right.float(), 1.0, 1.0),
        case("gamma = 0.9, lambda = 0.8", v, r, right.float(), 0.9, 0.8),
    ])


def gae_with_bootstrap_reference(values, rewards, mask, bootstrap, gamma=1.0, lam=0.95):
    r"""GAE where a truncated row continues past its last real token with value `bootstrap` (B,).

    .. math:: \delta_{t_\text{last}} = r_{t_\text{last}} + \gamma\,b - V_{t_\text{last}}

    which is plain GAE with γ·b added to the last real reward. `bootstrap` is 0
    for rows that ended (EOS). The checker's reference for chapter 05's exercise.
    """
    m = mask.bool()
    extra = torch.zeros_like(rewards)
    extra[torch.arange(rewards.shape[0]), last_valid_index(m)] = gamma * bootstrap.to(rewards.dtype)
    return gae_advantages(values, torch.where(m, rewards, 0.0) + extra, mask, gamma, lam)


# the checker's own reference too: calling it from the answer would pass every case without the idea
@_withholds("marlhf_edu.math.gae.gae_advantages", "marlhf_edu.math.gae.gae_advantages_reference",
            "marlhf_edu.teaching.checks.part1_math.gae_with_bootstrap_reference")
def check_gae_bootstrap(fn: Callable, seed: int = 4) -> CheckReport:
    """Check `fn(values, rewards, mask, bootstrap, gamma, lam) -> (advantages, returns)`. Chapter 05's exercise.

    `bootstrap` (B,) is the value of the state after the last real token for
    responses cut off by the length limit, 0 for responses that ended with EOS.
    """
    fn = _learner(fn, check_gae_bootstrap)
    gen = torch.Generator().manual_seed(seed)
    v, r = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    right = _padded_mask(gen, 4, 8)
    boot = torch.randn(4, generator=gen)
    truncated = torch.tensor([True, False, True, False])

    # γ < 1 wherever a bootstrap is non-zero: at γ = 1 an answer that adds b where γ·b belongs would pass
    def case(label, values, rewards, mask, b, gamma=0.9, lam=0.95):
        return _gae_case(fn, label, values, rewards, mask, gamma, lam,
                         lambda: gae_with_bootstrap_reference(values, rewards, mask, b, gamma, lam), extra=(b.clone(),))

    one = torch.zeros(4, 8).index_fill_(1, torch.tensor([0]), 1.0)
    return _run("check_gae_bootstrap", seed=seed, cases=[
        case("every row ended (bootstrap 0): plain GAE", v, r, right.float(), torch.zeros(4), 1.0),
        case("every row truncated, no padding", v, r, torch.ones(4, 8), boot),
        case("some rows truncated, right padding", v, r, right.float(), torch.where(truncated, boot, 0.0)),
        case("padding holds garbage", torch.where(right, v, 1e3), torch.where(right, r, -1e3), right.float(), boot),
        case("gamma = 0.8, lambda = 0 (TD residual)", v, r, right.float(), boot, 0.8, 0.0),
        case("gamma = 0.97, lambda = 0.8", v, r, right.float(), boot, 0.97, 0.8),
        case("one real token per row", v, r, one, boot, 0.95, 0.9),
    ])


def _loss_and_grad_case(fn, label, make_inputs, reference, wrt, atol_grad: float = 1e-6):
    """Compare a learner's loss and its gradient with respect to input `wrt` (an index, or a tuple of them) with
    the reference's. A one-element loss of shape (1,) counts as the scalar it holds."""
    indices = (wrt,) if isinstance(wrt, int) else tuple(wrt)

    def run():
        ref_inputs = make_inputs()
        for i in indices:
            ref_inputs[i].requires_grad_(True)
        expected = _first_tensor(reference(*ref_inputs))
        expected.backward()
        inputs = make_inputs()
        for i in indices:
            inputs[i].requires_grad_(True)
        got = _first_tensor(fn(*inputs))
        if isinstance(got, torch.Tensor) and got.dim() == 1 and got.numel() == 1 and expected.dim() == 0:
            got = got.reshape(())
        problem = _compare(f"{label} (loss)", got, expected, 1e-5, 1e-5)
        if problem:
            return problem
        if not got.requires_grad:  # computed outside autograd (.item(), numpy, math): nothing to train with
            return f"{label}: the loss does not depend on its inputs through autograd (no gradient)"
        got.backward()
        for i in indices:
            if inputs[i].grad is None:
                return f"{label}: the loss does not depend on its input {i} (no gradient)"
            problem = _compare(f"{label} (gradient, input {i})", inputs[i].grad, ref_inputs[i].grad, atol_grad, 1e-5)
            if problem:
                return problem
        return None
    return label, run


@_withholds("marlhf_edu.math.policy_gradient.expected_estimate")
def check_expected_estimate(fn: Callable, seed: int = 0) -> CheckReport:
    r"""Check `fn(probs, arm_rewards, group_size, baseline) -> (A,)`: the exact mean of REINFORCE's estimate of
    ∇_θ J on a softmax bandit with fixed arm rewards, K = `group_size` samples per estimate, each sample's
    baseline given by `baseline` (None, or a function from the K rewards (K,) to K baselines).

    Chapter 04's exercise; compared with `marlhf_edu.math.policy_gradient.expected_estimate` (float64, exact sum
    over the A^K draws). The cases mix baselines that keep the estimate unbiased (none, a constant, the others'
    mean or median, another sample's reward) with ones that do not (the batch mean, the sample's own reward),
    so computing ∇J directly, or ignoring the baseline, fails. A non-zero `seed` draws other random cases.
    """
    fn = _learner(fn, check_expected_estimate)
    gen = torch.Generator().manual_seed(seed + 4)

    def others_mean(r):
        return (r.sum() - r) / (len(r) - 1)

    def others_median(r):
        return torch.stack([torch.cat([r[:i], r[i + 1:]]).median() for i in range(len(r))])

    def batch_mean(r):
        return r.mean().expand(len(r)).clone()

    def case(label, arms, K, baseline, shift=0.0):
        probs = torch.softmax(torch.randn(arms, generator=gen, dtype=torch.float64), -1)
        rewards = torch.rand(arms, generator=gen, dtype=torch.float64) + shift

        def run():
            expected = expected_estimate(probs, rewards, K, baseline)
            got = fn(probs.clone(), rewards.clone(), K, baseline)
            return _compare(label, torch.as_tensor(got), expected, 1e-6, 1e-5)
        return label, run

    cases = [
        case("no baseline, 3 arms, 2 samples", 3, 2, None),
        case("one sample per estimate (K = 1), no baseline", 4, 1, None),
        case("a constant baseline (0.5), 3 arms, 3 samples", 3, 3, lambda r: torch.full_like(r, 0.5)),
        case("leave-one-out baseline, 4 arms, 3 samples", 4, 3, others_mean),
        case("the batch mean (contains the sample's own reward), 3 arms, 4 samples", 3, 4, batch_mean),
        case("the batch mean with rewards shifted by 10", 3, 2, batch_mean, shift=10.0),
        case("the sample's own reward as its baseline", 3, 3, lambda r: r.clone()),
        case("the next sample's reward as baseline (another sample: unbiased)", 3, 3, lambda r: r.roll(-1)),
        case("the others' median, 6 arms, 4 samples", 6, 4, others_median),
    ]
    if seed:
        for i in range(3):
            arms, K = int(torch.randint(2, 6, (1,), generator=gen)), int(torch.randint(2, 5, (1,), generator=gen))
            rule = (others_mean, batch_mean, others_median)[i]
            cases.append(case(f"random: {arms} arms, {K} samples, {rule.__name__.replace('_', ' ')}", arms, K, rule,
                              shift=float(torch.randn(1, generator=gen)) * 5))
    return _run("check_expected_estimate", seed=seed, cases=cases)


@_withholds("marlhf_edu.math.ppo_objective.policy_loss", "marlhf_edu.math.ppo_objective.ppo_loss",
            "marlhf_edu.math.grpo.grpo_loss")
def check_policy_loss(fn: Callable, seed: int = 5) -> CheckReport:
    """Check `fn(logprobs, old_logprobs, advantages, mask, cliprange) -> loss` (or `(loss, stats)`).

    Compares the loss value and its gradient with respect to `logprobs` (a ratio from detached log-probs has
    the right value and no gradient). Most cases put ratios outside [1 − ε, 1 + ε], above, below and on both
    sides, with advantages of both signs, where `min` for `max` or a missing clip changes the value:
    such an answer passes at most the two cases inside the clip range. `grpo_loss` is withheld too: its
    token-mean form with β = 0 is this loss. Chapter 06's first exercise.
    """
    fn = _learner(fn, check_policy_loss)
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=gen) * 3
    adv = torch.randn(4, 6, generator=gen)
    mask = _padded_mask(gen, 4, 6).float()

    def case(label, shift, eps=0.2):
        return _loss_and_grad_case(fn, label, lambda: [(old + shift).clone(), old.clone(), adv.clone(), mask.clone(), eps],
                                   policy_loss, wrt=0)

    sides = torch.where(torch.rand(4, 6, generator=gen) < 0.5, -0.4, 0.4)  # ratios 0.67 or 1.49: all outside
    return _run("check_policy_loss", seed=seed, cases=[
        case("ratio exactly 1", torch.zeros(4, 6)),
        case("small policy change (inside the clip range)", 0.05 * torch.randn(4, 6, generator=gen)),
        case("large policy change (clip active)", 0.6 * torch.randn(4, 6, generator=gen)),
        case("every ratio above 1 + ε, advantages of both signs", torch.full((4, 6), 0.4)),
        case("every ratio below 1 − ε, advantages of both signs", torch.full((4, 6), -0.4)),
        case("ratios on both sides of the clip range", sides),
        case("another clip range, ε = 0.1 (ratios 0.86 and 1.16)", 0.375 * sides, eps=0.1),
        case("garbage in padding (clip active on the real tokens)", torch.where(mask.bool(), 0.4, 50.0)),
    ])


@_withholds("marlhf_edu.math.ppo_objective.value_loss", "marlhf_edu.math.ppo_objective.ppo_loss")
def check_value_loss(fn: Callable, seed: int = 6) -> CheckReport:
    r"""Check `fn(values, old_values, returns, mask, cliprange_value) -> loss` (or `(loss, stats)`).

    .. math:: L_V = \tfrac12\operatorname{mean}_m \max\big((V - R)^2, (\operatorname{clip}(V, V^{old} \pm \epsilon_v) - R)^2\big)

    Value and gradient with respect to `values` are compared, on moves inside
    and outside the clip range, towards and away from the returns. Chapter 06's second exercise.
    """
    fn = _learner(fn, check_value_loss)
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(4, 6, generator=gen)
    ret = old + torch.randn(4, 6, generator=gen)
    mask = _padded_mask(gen, 4, 6).float()

    def case(label, new, eps=0.2):
        return _loss_and_grad_case(fn, label, lambda: [new.clone(), old.clone(), ret.clone(), mask.clone(), eps],
                                   value_loss, wrt=0)

    towards = old + 0.5 * (ret - old)
    return _run("check_value_loss", seed=seed, cases=[
        case("values equal old values", old.clone()),
        case("small moves (inside the clip range)", old + 0.05 * torch.randn(4, 6, generator=gen)),
        case("large moves towards the returns (clip active)", towards),
        case("large moves away from the returns", old - 0.8 * (ret - old)),
        case("garbage in padding", torch.where(mask.bool(), towards, 1e3)),
        case("cliprange 0.5", towards, 0.5),
    ])
