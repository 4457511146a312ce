"""The clipped PPO objective: policy loss, value loss, entropy bonus.

Taught in chapter 06 (`chapters/06_ppo_losses.md`).
"""

from __future__ import annotations

import torch

from marlhf_edu.math._validate import as_bool_mask, check_no_nan, check_same_shape
from marlhf_edu.math.masked import masked_mean


#: Bound on the absolute log-ratio log π − log π_old inside `policy_loss`, so the ratio can never overflow.
LOG_RATIO_LIMIT = 20.0


def _zero_masked(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


LOSS_AGGREGATIONS = ("token-mean", "sequence-mean")


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, how: str = "token-mean") -> torch.Tensor:
    r"""Reduce a (B, T) per-token loss to a scalar.

    .. math:: \text{token-mean} = \frac{\sum_{b,t} m_{bt}\ell_{bt}}{\sum_{b,t} m_{bt}}, \qquad
              \text{sequence-mean} = \frac1B \sum_b \frac{\sum_t m_{bt}\ell_{bt}}{\sum_t m_{bt}}

    token-mean (trl 0.11, this engine) weighs every token alike, so a long response weighs more in total.
    sequence-mean weighs every response alike, so each token of a response of length L weighs 1/(B·L):
    a long response's tokens count less, a length bias (chapter 06 measures it).

    Taught in chapter 06.
    """
    if how == "token-mean":
        return masked_mean(per_token, mask)
    if how == "sequence-mean":
        return masked_mean(per_token, mask, dim=-1).mean()
    raise ValueError(f"aggregate_loss: `how` must be one of {LOSS_AGGREGATIONS}, got {how!r}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float = 0.2,
    loss_aggregation: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""PPO's clipped surrogate, as a loss to minimise.

    .. math:: \rho_t = e^{\log\pi(a_t) - \log\pi_{old}(a_t)}, \qquad
              L = \operatorname{mean}_m \max\big(-A_t\rho_t,\; -A_t\operatorname{clip}(\rho_t, 1-\epsilon, 1+\epsilon)\big)

    All inputs (B, T). The log-ratio is clamped to ±20 before `exp` so the loss
    stays finite. The mean over tokens is `loss_aggregation` (`aggregate_loss`).
    Returns `(loss, stats)`; stats (0-dim, detached):
    `clipfrac` — share of tokens where the clipped term is the larger (there the
    gradient is exactly 0); `approxkl` — ½·mean_m (log π − log π_old)²;
    `policykl` — mean_m (log π_old − log π); `ratio_mean`, `ratio_max`.

    Taught in chapter 06.
    """
    fn = "policy_loss"
    check_same_shape(fn, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    m = as_bool_mask(mask, logprobs, fn)
    for name, x in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        check_no_nan(fn, name, x, m)
    # padding is zeroed before exp() so a garbage log-prob there cannot overflow into the mean;
    # the clamp keeps exp() finite (e^20 ≈ 5e8): a minibatch anywhere near it is skipped by
    # ppo_loss's ratio threshold, and a finite loss times 0 has zero gradients, inf times 0 has NaN ones.
    log_ratio = _zero_masked((logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), m)
    advantages = _zero_masked(advantages, m)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = aggregate_loss(torch.maximum(unclipped, clipped), m, loss_aggregation)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), m),
            "approxkl": 0.5 * masked_mean(log_ratio**2, m),
            "policykl": masked_mean(-log_ratio, m),
            "ratio_mean": masked_mean(ratio, m),
            "ratio_max": torch.where(m, ratio, torch.zeros_like(ratio)).max(),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Clipped value loss.

    .. math:: L_V = \tfrac12\operatorname{mean}_m \max\big((V_t - R_t)^2,\;
              (\operatorname{clip}(V_t, V^{old}_t - \epsilon_v, V^{old}_t + \epsilon_v) - R_t)^2\big)

    All inputs (B, T). Returns `(loss, stats)` with `clipfrac` (share of tokens
    where the clipped error is the larger) and `error` (mean_m (V − R)²).

    Taught in chapter 06.
    """
    fn = "value_loss"
    check_same_shape(fn, values=values, old_values=old_values, returns=returns, mask=mask)
    m = as_bool_mask(mask, values, fn)
    for name, x in (("values", values), ("old_values", old_values), ("returns", returns)):
        check_no_nan(fn, name, x, m)
    values, old_values, returns = (_zero_masked(x, m) for x in (values, old_values, returns))
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_error, clipped_error), m)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped_error > unclipped_error).to(values.dtype), m),
            "error": masked_mean(unclipped_error, m),
        }
    return loss, stats


def ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor | None = None,
    *,
    cliprange: float = 0.2,
    cliprange_value: float = 0.2,
    vf_coef: float = 0.1,
    ent_coef: float = 0.0,
    ratio_threshold: float = 10.0,
    loss_aggregation: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Total PPO loss for one minibatch.

    .. math:: L = L_\pi + c_v L_V - c_H \operatorname{mean}_m H_t

    All tensors (B, T); `entropy` (B, T) is optional (needed only when
    `ent_coef` ≠ 0). When the masked mean ratio exceeds `ratio_threshold` the
    minibatch is judged corrupt (trl 0.11's safeguard): the loss is multiplied
    by 0, so a backward pass gives zero gradients, and `stats["skipped"]` is 1.
    The check is a tensor operation, so it costs no device synchronisation.

    Stats (0-dim, detached): `loss/total`, `loss/policy`, `loss/value`,
    `loss/entropy`, `policy/clipfrac`, `policy/approxkl`, `policy/policykl`,
    `policy/ratio_mean`, `policy/ratio_max`, `value/clipfrac`, `value/error`,
    `skipped`.

    Taught in chapter 06.
    """
    pg_loss, pg_stats = policy_loss(logprobs, old_logprobs, advantages, mask, cliprange, loss_aggregation)
    vf_loss, vf_stats = value_loss(values, old_values, returns, mask, cliprange_value)
    m = as_bool_mask(mask, logprobs, "ppo_loss")
    if entropy is None:
        if ent_coef != 0:
            raise ValueError("ppo_loss: ent_coef is non-zero but no `entropy` tensor was given")
        ent = torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device)
    else:
        check_same_shape("ppo_loss", entropy=entropy, mask=mask)
        ent = masked_mean(entropy, m)
    loss = pg_loss + vf_coef * vf_loss - ent_coef * ent
    skipped = pg_stats["ratio_mean"] > ratio_threshold
    loss = torch.where(skipped, loss * 0.0, loss)
    stats = {
        "loss/total": loss.detach(),
        "loss/policy": pg_loss.detach(),
        "loss/value": vf_loss.detach(),
        "loss/entropy": ent.detach(),
        **{f"policy/{k}": v for k, v in pg_stats.items()},
        **{f"value/{k}": v for k, v in vf_stats.items()},
        "skipped": skipped.to(loss.dtype),
    }
    return loss, stats
