"""Generalised Advantage Estimation over response tokens.

Each response token is an action; the episode is one response. The advantage
of token t blends TD errors of all later tokens with weights (γλ)^k.

Taught in chapter 05 (`chapters/05_gae.md`).
"""

from __future__ import annotations

import torch

from marlhf_edu._validate import as_bool_mask, check_no_nan, check_same_shape


def _prepare(values, rewards, mask, fn):
    check_same_shape(fn, values=values, rewards=rewards, mask=mask)
    if values.dim() != 2:
        raise ValueError(f"{fn}: expected (B, T) tensors, got shape {tuple(values.shape)}")
    m = as_bool_mask(mask, values, fn)
    check_no_nan(fn, "values", values, m)
    check_no_nan(fn, "rewards", rewards, m)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values = torch.where(m, values, zero)
    rewards = torch.where(m, rewards.to(values.dtype), zero)
    # V(s_{t+1}) counts only if token t+1 is real; otherwise t was terminal
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    next_mask = torch.cat([m[:, 1:], torch.zeros_like(m[:, :1])], dim=1)
    return values, rewards, m, next_values, next_mask


def gae_advantages_reference(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""GAE as the plain backward loop (the form chapter 05 derives first).

    .. math:: \delta_t = r_t + \gamma V_{t+1} - V_t, \qquad A_t = \delta_t + \gamma\lambda A_{t+1}

    with V_{t+1} = A_{t+1} = 0 past the last real token. Shapes (B, T) in,
    `(advantages, returns)` out, returns = advantages + values, both zero on
    masked positions. Same contract as `gae_advantages`.

    Taught in chapter 05.
    """
    values, rewards, m, next_values, next_mask = _prepare(values, rewards, mask, "gae_advantages_reference")
    T = values.shape[1]
    advantages = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_values[:, t] * next_mask[:, t] - values[:, t]
        last = delta + gamma * lam * next_mask[:, t] * last
        last = torch.where(m[:, t], last, torch.zeros_like(last))
        advantages[:, t] = last
    return advantages, advantages + values


def gae_advantages(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""GAE without a Python loop over time.

    .. math:: A_t = \sum_{k \ge t} (\gamma\lambda)^{k-t}\,\delta_k \quad\text{(within one run of real tokens)}

    All T×T discount weights are built at once: weight (γλ)^{k−t} when k ≥ t and
    no padding lies between t and k, else 0; then A = W·δ, one batched matmul.
    Memory is O(B·T²), fine for response lengths in the hundreds.

    `values`, `rewards`, `mask`: (B, T). Returns `(advantages, returns)` with
    returns = advantages + values (unwhitened); masked positions are 0 and act
    as terminal states. Equals `gae_advantages_reference` up to float rounding.

    Taught in chapter 05.
    """
    values, rewards, m, next_values, next_mask = _prepare(values, rewards, mask, "gae_advantages")
    T = values.shape[1]
    deltas = rewards + gamma * next_values * next_mask - values
    deltas = torch.where(m, deltas, torch.zeros_like(deltas))
    # A "segment" is a run of consecutive real tokens; the recursion never crosses a gap.
    segment = torch.cumsum((~m).long(), dim=1)  # (B, T)
    t_idx = torch.arange(T, device=values.device)
    steps = (t_idx[None, :] - t_idx[:, None]).to(values.dtype)  # steps[t, k] = k - t
    ahead = steps >= 0
    same_segment = segment[:, :, None] == segment[:, None, :]  # (B, T, T)
    weights = torch.where(
        ahead & same_segment,
        torch.pow(torch.tensor(gamma * lam, dtype=values.dtype, device=values.device), steps.clamp_min(0)),
        torch.zeros((), dtype=values.dtype, device=values.device),
    )
    advantages = torch.einsum("btk,bk->bt", weights, deltas)
    advantages = torch.where(m, advantages, torch.zeros_like(advantages))
    return advantages, advantages + values
