"""The policy gradient before PPO: REINFORCE, baselines and importance weights.

Taught in chapter 04 (`chapters/04_policy_gradient.md`).
"""

from __future__ import annotations

from typing import Callable

import torch

from marlhf_edu.math._validate import as_bool_mask, check_no_nan, check_same_shape


def _check_rewards(fn: str, rewards: torch.Tensor, batch: int) -> None:
    if rewards.dim() != 1 or rewards.shape[0] != batch:
        raise ValueError(f"{fn}: `rewards` must have shape ({batch},) (one reward per sequence), "
                         f"got {tuple(rewards.shape)}")
    check_no_nan(fn, "rewards", rewards)


def reinforce_loss(
    logprobs: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    baseline: torch.Tensor | float | None = None,
) -> torch.Tensor:
    r"""REINFORCE's loss for one reward per sequence: its gradient is an unbiased estimate of −∇J.

    .. math:: L = -\frac1B \sum_b \big(R_b - b_b\big) \sum_t m_{bt} \log\pi_\theta(a_{bt}\mid s_{bt})

    `logprobs`, `mask`: (B, T) log-probs of the sampled tokens and which of
    them are real (a bandit is T = 1). `rewards`: (B,). `baseline`: None, a
    number or (B,); it is detached, because a baseline is a constant of the
    estimator: any b that does not depend on the sampled action leaves the
    expected gradient unchanged, E[∇log π(a)·b] = b·∇Σ_a π(a) = 0, and only
    changes its variance. The log-prob of a sequence is the sum over its
    tokens, so the tokens are summed, not averaged.

    Taught in chapter 04.
    """
    fn = "reinforce_loss"
    check_same_shape(fn, logprobs=logprobs, mask=mask)
    if logprobs.dim() != 2:
        raise ValueError(f"{fn}: `logprobs` must be (B, T), got shape {tuple(logprobs.shape)}")
    m = as_bool_mask(mask, logprobs, fn)
    check_no_nan(fn, "logprobs", logprobs, m)
    _check_rewards(fn, rewards, logprobs.shape[0])
    advantage = rewards.to(logprobs.dtype)
    if baseline is not None:
        baseline = torch.as_tensor(baseline, dtype=logprobs.dtype, device=logprobs.device).detach()
        if baseline.dim() > 0 and tuple(baseline.shape) != tuple(rewards.shape):
            raise ValueError(f"{fn}: `baseline` must be a number or have the shape of `rewards` "
                             f"{tuple(rewards.shape)}, got {tuple(baseline.shape)}")
        check_no_nan(fn, "baseline", baseline)
        advantage = advantage - baseline
    # padding is zeroed with where(), not multiplied by 0: a NaN or -inf there must not reach the sum
    sequence_logprobs = torch.where(m, logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)).sum(-1)
    return -(advantage.detach() * sequence_logprobs).mean()


def leave_one_out_baseline(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    r"""For K samples per prompt, each sample's baseline is the mean reward of the other K − 1.

    .. math:: b_i = \frac{1}{K-1}\sum_{j \in g(i),\, j \ne i} R_j

    `rewards`: (B,), laid out as B / K consecutive groups of `group_size` = K
    samples of one prompt (`prompts.repeat_interleave(K)`, as trl's GRPO does).
    Returns (B,). Unlike the group mean, b_i does not contain R_i, so it is
    independent of sample i and the estimator stays unbiased (RLOO, Ahmadian
    et al. 2024).

    Taught in chapter 04.
    """
    fn = "leave_one_out_baseline"
    if rewards.dim() != 1:
        raise ValueError(f"{fn}: `rewards` must be (B,), got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"{fn}: `group_size` must be an int ≥ 2 (the others' mean needs another sample), "
                         f"got {group_size!r}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"{fn}: {rewards.shape[0]} rewards do not split into groups of {group_size}")
    check_no_nan(fn, "rewards", rewards)
    groups = rewards.view(-1, group_size)
    return ((groups.sum(-1, keepdim=True) - groups) / (group_size - 1)).view(-1)


def importance_weights(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Per-sequence importance weights π(y)/π_old(y) of samples drawn from π_old.

    .. math:: w_b = \exp\Big(\sum_t m_{bt}\,\big(\log\pi(a_{bt}) - \log\pi_{old}(a_{bt})\big)\Big)

    All inputs (B, T); returns (B,). E_{π_old}[w·f] = E_π[f], so samples can be
    reused after π moved, but w is a product over tokens: small per-token
    ratios multiply into weights that span orders of magnitude.

    Taught in chapter 04.
    """
    fn = "importance_weights"
    check_same_shape(fn, logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    m = as_bool_mask(mask, logprobs, fn)
    check_no_nan(fn, "logprobs", logprobs, m)
    check_no_nan(fn, "old_logprobs", old_logprobs, m)
    log_ratio = torch.where(m, logprobs - old_logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))
    return log_ratio.sum(-1).exp()


def effective_sample_size(weights: torch.Tensor) -> torch.Tensor:
    r"""Kish's effective sample size of importance weights (B,): how many equally weighted samples they are worth.

    .. math:: \mathrm{ESS} = \frac{(\sum_b w_b)^2}{\sum_b w_b^2}, \qquad 1 \le \mathrm{ESS} \le B

    B when all weights are equal; 1 when one sample carries all the weight.

    Taught in chapter 04.
    """
    if weights.dim() != 1 or weights.numel() == 0:
        raise ValueError(f"effective_sample_size: `weights` must be a non-empty (B,) tensor, got {tuple(weights.shape)}")
    if bool((weights < 0).any()) or not bool(torch.isfinite(weights).all()):
        raise ValueError("effective_sample_size: `weights` must be finite and ≥ 0")
    if not bool((weights > 0).any()):  # (Σw)² / Σw² is 0/0: no sample carries any weight
        raise ValueError("effective_sample_size: every weight is 0 (did exp() of very negative log-weights "
                         "underflow? subtract their maximum first)")
    w = weights.double()
    return (w.sum() ** 2 / (w**2).sum()).to(weights.dtype)


def expected_estimate(probs: torch.Tensor, arm_rewards: torch.Tensor, group_size: int,
                      baseline: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    r"""The exact mean of REINFORCE's estimate of ∇_θ J on a bandit, for any baseline rule.

    A softmax policy π = softmax(θ) over A arms; arm a pays the fixed reward μ(a). One estimate draws K arms
    a_1 … a_K independently from π and averages

    .. math:: g = \frac1K\sum_{i=1}^K (R_i - b_i)\,\nabla_\theta\log\pi(a_i), \qquad
              \nabla_\theta\log\pi(a) = e_a - \pi, \qquad b = \mathrm{baseline}(R_1, \dots, R_K).

    Its mean sums g over all A^K draws, each weighted by its probability ∏_i π(a_i). It equals
    ∇J = π ⊙ (μ − π·μ) whenever b_i does not depend on sample i's own draw (none, a constant, the others'
    mean); the group mean, which contains R_i, gives (K − 1)/K of it.

    `probs`, `arm_rewards`: (A,). `baseline`: None, or a function from the K rewards of one estimate, a (K,)
    tensor, to their K baselines (K,). Returns (A,), float64. Exact, so A^K is kept below 200,000 draws.

    Taught in chapter 04 (its exercise).
    """
    fn = "expected_estimate"
    probs, mu = torch.as_tensor(probs, dtype=torch.float64), torch.as_tensor(arm_rewards, dtype=torch.float64)
    if probs.dim() != 1 or probs.shape != mu.shape:
        raise ValueError(f"{fn}: `probs` and `arm_rewards` must both be (A,), got {tuple(probs.shape)} "
                         f"and {tuple(mu.shape)}")
    if bool((probs < 0).any()) or abs(float(probs.sum()) - 1) > 1e-6:
        raise ValueError(f"{fn}: `probs` must be a probability vector (≥ 0, summing to 1)")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{fn}: `group_size` must be an int ≥ 1, got {group_size!r}")
    arms = probs.shape[0]
    if arms ** group_size > 200_000:
        raise ValueError(f"{fn}: {arms}^{group_size} draws are too many to sum exactly; use fewer arms or samples")
    draws = torch.cartesian_prod(*[torch.arange(arms)] * group_size).view(-1, group_size)  # (A^K, K)
    weight = probs[draws].prod(-1)  # probability of each draw
    rewards = mu[draws]  # (A^K, K)
    if baseline is not None:
        rewards = rewards - torch.stack([torch.as_tensor(baseline(r.clone()), dtype=torch.float64) for r in rewards])
    score = torch.nn.functional.one_hot(draws, arms).double() - probs  # ∇_θ log π(a_i) = e_{a_i} − π: (A^K, K, A)
    per_draw = (rewards[..., None] * score).mean(1)  # g of each draw: (A^K, A)
    return (weight[:, None] * per_draw).sum(0)
