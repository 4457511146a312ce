"""Statistics over the valid tokens of a padded batch.

RLHF batches are padded: a (B, T) tensor of per-token values comes with a (B, T)
mask that is 1 on real response tokens and 0 on padding. Every average in PPO is
taken over the mask, never over the padded rectangle.

Taught in chapter 00 (notation) and used by every later chapter.
"""

from __future__ import annotations

import torch

from marlhf_edu.math._validate import as_bool_mask, check_no_nan


#: What `masked_mean` does where the mask selects nothing: raise, or return NaN for that slice.
MASKED_MEAN_EMPTY = ("raise", "nan")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                empty: str = "raise") -> torch.Tensor:
    r"""Mean of `values` over the positions where `mask` is 1.

    .. math:: \operatorname{mean}_m(x) = \frac{\sum_i x_i m_i}{\sum_i m_i}

    Shapes: `values` (B, T) or any shape; `mask` broadcastable to it (0/1 or bool).
    With `dim=None` the result is a scalar; with `dim=d` the mean is taken along
    that dimension only (e.g. `dim=0` on (B, T): one mean per position, (T,)).
    Masked entries never influence the result, even when they hold NaN or inf.

    Where the mask selects nothing (the whole tensor, or a slice along `dim`)
    the mean is 0/0. `empty="raise"` (the default) raises `ValueError`;
    `empty="nan"` returns NaN for those slices and the masked mean elsewhere, as
    trl 0.11's `masked_mean`, sum(x·m)/sum(m), does: per-position statistics
    over a right-padded batch have positions no answer reaches. Either way a
    NaN in a selected entry raises `ValueError`.

    Taught in chapter 00.
    """
    if empty not in MASKED_MEAN_EMPTY:
        raise ValueError(f"masked_mean: `empty` must be one of {MASKED_MEAN_EMPTY}, got {empty!r}")
    m = as_bool_mask(mask, values, "masked_mean")
    check_no_nan("masked_mean", "values", values, m)
    m = m.expand_as(values) if m.shape != values.shape else m
    # torch.where rather than values * mask: NaN * 0 is NaN, and padding may hold anything.
    kept = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device))
    count = m.sum() if dim is None else m.sum(dim)
    if empty == "raise" and bool((count == 0).any()):
        where = "" if dim is None else f" along dim {dim} in some slice"
        raise ValueError(f"masked_mean: the mask selects no element{where}; the mean of nothing is undefined")
    total = kept.sum() if dim is None else kept.sum(dim)
    mean = total / count.clamp(min=1).to(total.dtype)
    if empty == "raise":
        return mean
    # 0/0 would be NaN too; `where` says so, and the division itself stays finite (count clamped to 1).
    return torch.where(count > 0, mean, torch.full((), float("nan"), dtype=mean.dtype, device=mean.device))


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    r"""Variance of `values` over the positions where `mask` is 1 (a scalar).

    .. math:: \operatorname{var}_m(x) = \frac{n}{n-1}\,\operatorname{mean}_m\big((x - \operatorname{mean}_m x)^2\big),
              \quad n = \textstyle\sum_i m_i

    The factor n/(n-1) (Bessel's correction) is applied when `unbiased=True`.
    Raises `ValueError` when fewer than 2 entries are selected with `unbiased=True`
    (fewer than 1 otherwise) instead of returning inf or NaN.

    Taught in chapter 00; used for advantage whitening in chapter 05.
    """
    m = as_bool_mask(mask, values, "masked_var")
    n = int(m.expand_as(values).sum()) if m.shape != values.shape else int(m.sum())
    needed = 2 if unbiased else 1
    if n < needed:
        raise ValueError(
            f"masked_var: the mask selects {n} element(s); an {'unbiased' if unbiased else 'biased'} "
            f"variance needs at least {needed}"
        )
    mean = masked_mean(values, m)
    var = masked_mean((values - mean) ** 2, m)
    if unbiased:
        var = var * (n / (n - 1))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    r"""Standardise `values` with statistics of the masked entries.

    .. math:: \hat x = \frac{x - \operatorname{mean}_m x}{\sqrt{\operatorname{var}_m x + 10^{-8}}}
              \;(+\operatorname{mean}_m x \text{ when shift\_mean=False})

    Shapes: `values` and `mask` (B, T). Masked positions of the output are 0, so
    the output never depends on what padding held. The variance is the unbiased
    `masked_var`, hence at least 2 selected entries are required.

    Taught in chapter 05.
    """
    m = as_bool_mask(mask, values, "masked_whiten")
    mean = masked_mean(values, m)
    var = masked_var(values, m, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, torch.zeros((), dtype=whitened.dtype, device=whitened.device))


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a (B, T) mask, as a (B,) long tensor.

    Works for left and right padding alike: it is where a sequence's final real
    token sits, hence where a reward model's score is read and where PPO adds
    the score to the per-token rewards. Raises `ValueError` for an all-zero row.

    Taught in chapter 01.
    """
    m = as_bool_mask(mask, mask, "last_valid_index")
    if m.dim() != 2:
        raise ValueError(f"last_valid_index: expected a (B, T) mask, got shape {tuple(m.shape)}")
    empty = ~m.any(dim=1)
    if bool(empty.any()):
        raise ValueError(f"last_valid_index: row {int(empty.nonzero()[0])} of the mask is all zero")
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    return torch.where(m, positions, torch.full_like(positions, -1)).amax(dim=1)
