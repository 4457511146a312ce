"""GRPO: PPO's clipped surrogate with no critic; the baseline is the other answers to the same prompt.

GRPO (Shao et al. 2024) samples G answers per prompt and gives every token of
answer i the same advantage, its reward standardised within its group. The KL to
the reference is a loss term (k3 weighted by the ratio, chapter 12), not part of the reward as in PPO.
trl's `GRPOTrainer` trains it; this module holds the advantage and the loss,
written out, and a test checks trl's numbers against them.

Taught in chapter 12.
"""

from __future__ import annotations

import torch

from marlhf_edu.math._validate import as_bool_mask, check_no_nan, check_same_shape
from marlhf_edu.math.kl import kl_penalty

#: How advantages are scaled: by the group's std (GRPO), the batch's std, or not at all (Dr. GRPO).
ADVANTAGE_SCALES = ("group", "batch", "none")
#: How per-token losses become one number: per-sequence token means then their mean ('grpo'), one mean
#: over every token of the batch ('bnpo'; trl's default 'dapo' divides instead by the generation batch's token
#: count spread evenly over its optimizer steps, so the two agree only when every step holds as many tokens), or
#: the sum over every token divided by a constant, B × the longest allowed answer ('dr_grpo', trl's too).
GRPO_LOSS_AGGREGATIONS = ("grpo", "bnpo", "dr_grpo")


def group_relative_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group",
                              eps: float = 1e-4) -> torch.Tensor:
    r"""Each answer's reward relative to its group: (B,) → (B,).

    .. math:: A_i = \frac{R_i - \bar R_{g(i)}}{s + \delta}, \qquad
              s = \mathrm{std}_{g(i)}(R)\ \text{('group')},\ \mathrm{std}(R)\ \text{('batch')},\ 1 - \delta\ \text{('none')}

    δ = `eps` only keeps the division finite (ε is PPO's clip range elsewhere).

    `rewards` in B / G consecutive groups of `group_size` = G answers to one prompt
    (the `repeat_interleave` layout of trl and of `leave_one_out_baseline`). The
    standard deviations use Bessel's correction, as trl's do. Unlike the
    leave-one-out baseline (chapter 04), the group mean contains R_i itself, which
    shrinks every advantage by (G − 1)/G; the division by the group's std then
    rescales it anyway, and weighs groups whose answers barely differ strongly.

    Taught in chapter 12.
    """
    fn = "group_relative_advantages"
    if rewards.dim() != 1:
        raise ValueError(f"{fn}: `rewards` must be (B,), got shape {tuple(rewards.shape)}")
    check_no_nan(fn, "rewards", rewards)
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"{fn}: `group_size` must be an int >= 2, got {group_size!r}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"{fn}: {rewards.shape[0]} rewards do not split into groups of {group_size}")
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"{fn}: `scale` must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    groups = rewards.view(-1, group_size)
    centred = (groups - groups.mean(-1, keepdim=True)).view(-1)
    if scale == "none":
        return centred
    std = groups.std(-1).repeat_interleave(group_size) if scale == "group" else rewards.std().expand_as(rewards)
    return centred / (std + eps)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float = 0.2,
    beta: float = 0.0,
    aggregation: str = "grpo",
    kl_importance_weighted: bool = True,
    max_length: int | None = None,
) -> torch.Tensor:
    r"""GRPO's loss: PPO's clipped surrogate per token with a sequence's advantage, plus β·k3 to the reference.

    .. math:: \ell_{bt} = -\min\big(\rho_{bt} A_b,\ \mathrm{clip}(\rho_{bt}, 1-\epsilon, 1+\epsilon) A_b\big)
              + \beta\,[\rho_{bt}]\,\big(e^{\log\pi_{ref} - \log\pi} - (\log\pi_{ref} - \log\pi) - 1\big)_{bt},
              \qquad \rho_{bt} = e^{\log\pi_{bt} - \log\pi_{old,bt}}

    where [ρ] is there with `kl_importance_weighted` (the default) and 1 without.

    `logprobs` (with gradient), `old_logprobs`, `ref_logprobs`, `mask`: (B, T) over
    the completion tokens; `advantages`: (B,). `ref_logprobs` may be None when
    β = 0 (no reference is needed then).

    `kl_importance_weighted` multiplies the k3 term by ρ (trl's `use_bias_correction_kl`,
    on by default in trl 1.16, off in earlier releases). It changes the gradient even where ρ = 1, because ρ's
    gradient there is ∇log π, not 0. Sampled from π_old = π, the expected gradient of
    the weighted term ρ·k3 is ∇KL(π ‖ π_ref), the reverse KL (chapter 03), token by token
    given each token's prefix; that of plain k3 (DeepSeekMath's loss) is ∇KL(π_ref ‖ π), the
    forward KL. Once π has moved from π_old the weight also keeps the estimate of the
    KL's value unbiased.

    `aggregation` turns the (B, T) token losses ℓ with mask m into one number:

    .. math:: \mathtt{grpo}: \frac1B\sum_b \frac{\sum_t m_{bt}\ell_{bt}}{\sum_t m_{bt}},\qquad
              \mathtt{bnpo}: \frac{\sum_{bt} m_{bt}\ell_{bt}}{\sum_{bt} m_{bt}},\qquad
              \mathtt{dr\_grpo}: \frac{\sum_{bt} m_{bt}\ell_{bt}}{B\,L}

    'grpo' gives each token of an answer of `|o|` tokens the weight `1/(B|o|)`, so a
    short answer's tokens are pushed harder than a long one's (a length bias:
    chapter 06); 'bnpo' weighs every token of the batch alike, by one over the
    batch's token count, which changes from batch to batch. 'dr_grpo' (Liu et al.
    2025, "Understanding R1-Zero-Like Training") divides by a constant instead:
    L = `max_length`, the longest answer generation allows (trl's
    `max_completion_length`; trl's `loss_type="dr_grpo"` is this), required with
    'dr_grpo' and at least the longest answer in `mask`. Dr. GRPO also drops the
    division by the group's std: `group_relative_advantages(..., scale="none")`.
    Padding is selected out with `where`, so garbage there cannot leak.

    Taught in chapter 12.
    """
    fn = "grpo_loss"
    check_same_shape(fn, logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    if logprobs.dim() != 2:
        raise ValueError(f"{fn}: `logprobs` must be (B, T), got shape {tuple(logprobs.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"{fn}: `advantages` must be (B,) = ({logprobs.shape[0]},), got {tuple(advantages.shape)}")
    if aggregation not in GRPO_LOSS_AGGREGATIONS:
        raise ValueError(f"{fn}: `aggregation` must be one of {GRPO_LOSS_AGGREGATIONS}, got {aggregation!r}")
    if beta < 0 or epsilon <= 0:
        raise ValueError(f"{fn}: need beta >= 0 and epsilon > 0, got {beta!r}, {epsilon!r}")
    m = as_bool_mask(mask, logprobs, fn)
    if aggregation == "dr_grpo":
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
            raise ValueError(f"{fn}: aggregation 'dr_grpo' needs `max_length`, a positive int (the generation "
                             f"limit on answer tokens), got {max_length!r}")
        longest = int(m.sum(-1).max()) if m.shape[0] else 0
        if longest > max_length:
            raise ValueError(f"{fn}: an answer has {longest} tokens, more than `max_length` = {max_length}")
    elif max_length is not None:
        raise ValueError(f"{fn}: `max_length` is only used by aggregation 'dr_grpo', not {aggregation!r}")
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs, old_logprobs = torch.where(m, logprobs, zero), torch.where(m, old_logprobs, zero)
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None].to(logprobs.dtype)
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - epsilon, 1 + epsilon) * adv)
    if beta:
        if ref_logprobs is None:
            raise ValueError(f"{fn}: beta = {beta} needs `ref_logprobs`")
        check_same_shape(fn, logprobs=logprobs, ref_logprobs=ref_logprobs)
        kl = kl_penalty(logprobs, torch.where(m, ref_logprobs, zero), "k3")
        per_token = per_token + beta * (kl * ratio if kl_importance_weighted else kl)
    per_token = torch.where(m, per_token, zero)
    if aggregation == "grpo":
        return (per_token.sum(-1) / m.sum(-1).clamp(min=1)).mean()
    if aggregation == "dr_grpo":  # a constant: every token's weight is 1 / (B L) whatever the answers' lengths
        return per_token.sum() / (per_token.shape[0] * max_length)
    return per_token.sum() / m.sum().clamp(min=1)
