"""Losses and rules for reward models.

Taught in chapter 01 (`chapters/01_reward_models.md`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from marlhf_edu.math._validate import check_no_nan, check_same_shape


def pairwise_reward_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    r"""Bradley–Terry loss of a reward model on preference pairs (a scalar).

    .. math:: \mathcal L = -\frac1B\sum_b \log\sigma\big(r_c^{(b)} - r_r^{(b)} - m^{(b)}\big)

    `chosen`, `rejected`: (B,) scores of the preferred and the other response.
    `margin`: optional (B,) tensor (Llama 2's form: e.g. 3 for "significantly
    better", 1 for "slightly better"); the loss then asks the chosen score to
    exceed the rejected one by at least m before it stops pushing.
    `logsigmoid` keeps large negative differences finite.

    Taught in chapter 01.
    """
    check_same_shape("pairwise_reward_loss", chosen=chosen, rejected=rejected)
    check_no_nan("pairwise_reward_loss", "chosen", chosen)
    check_no_nan("pairwise_reward_loss", "rejected", rejected)
    if chosen.numel() == 0:
        raise ValueError("pairwise_reward_loss: got an empty batch")
    diff = chosen - rejected
    if margin is not None:
        margin = torch.as_tensor(margin, dtype=diff.dtype, device=diff.device)
        check_no_nan("pairwise_reward_loss", "margin", margin)
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def llama2_reward_select(
    safety: torch.Tensor, helpfulness: torch.Tensor, threshold: float = 0.15
) -> torch.Tensor:
    r"""Llama 2's combination of a safety and a helpfulness reward, elementwise.

    .. math:: R = \begin{cases} R_s & R_s < \text{threshold} \\ R_h & \text{otherwise} \end{cases}

    Scores are the reward models' sigmoid outputs in (0, 1): a response the
    safety model judges unsafe is scored by safety alone, so helpfulness can
    never buy back an unsafe answer. Shapes: any, matching.

    Taught in chapter 01.
    """
    check_same_shape("llama2_reward_select", safety=safety, helpfulness=helpfulness)
    check_no_nan("llama2_reward_select", "safety", safety)
    check_no_nan("llama2_reward_select", "helpfulness", helpfulness)
    return torch.where(safety < threshold, safety, helpfulness)
