"""KL estimators, KL controllers and the KL-penalised per-token reward.

PPO for RLHF keeps the policy π close to the reference π_ref (the SFT model)
by charging every generated token −β·KL_t, where KL_t is estimated from the
sampled token alone. The sequence's reward-model score is added on its last
token.

Taught in chapter 03 (`chapters/03_kl.md`).
"""

from __future__ import annotations

import math

import torch

from marlhf_edu.math._validate import as_bool_mask, check_no_nan, check_same_shape
from marlhf_edu.math.masked import last_valid_index

KL_KINDS = ("k1", "abs", "k2", "mse", "k3", "full")


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 = e^d − 1 − d with d = log π_ref − log π, never negative, accurate near 0."""
    d = log_ratio
    # expm1(d) - d cancels catastrophically for tiny d; its Taylor series does not.
    series = d * d * (0.5 + d * (1.0 / 6.0 + d / 24.0))
    direct = torch.expm1(d) - d
    return torch.where(d.abs() < 1e-2, series, direct).clamp_min(0.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    r"""Per-token estimate of KL(π ‖ π_ref) from tokens sampled from π.

    With :math:`d = \log\pi(a) - \log\pi_{ref}(a)` for the sampled token a:

    - ``k1``: :math:`d` — unbiased, high variance, can be negative;
    - ``abs``: :math:`|d|`;
    - ``k2`` (alias ``mse``): :math:`\tfrac12 d^2` — biased, low variance;
    - ``k3``: :math:`e^{-d} - 1 + d` — unbiased, never negative (Schulman's estimator),
      computed stably near d = 0;
    - ``full``: inputs are full (B, T, V) log-prob tensors and the exact
      :math:`\sum_v \pi(v)(\log\pi(v) - \log\pi_{ref}(v))` is returned, shape (B, T).

    Shapes: (B, T) in, (B, T) out (``full``: (B, T, V) in).

    Taught in chapter 03.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kl_penalty: unknown kind {kind!r}; choose one of {', '.join(KL_KINDS)}")
    check_same_shape("kl_penalty", logprobs=logprobs, ref_logprobs=ref_logprobs)
    check_no_nan("kl_penalty", "logprobs", logprobs)
    check_no_nan("kl_penalty", "ref_logprobs", ref_logprobs)
    if kind == "full":
        if logprobs.dim() != 3:
            raise ValueError(f"kl_penalty(kind='full') needs (B, T, V) log-probs, got {tuple(logprobs.shape)}")
        p = logprobs.exp()
        # 0 · log 0 = 0: positions where π(v) = 0 add nothing even if π_ref(v) = 0 too.
        return torch.where(p > 0, p * (logprobs - ref_logprobs), 0.0).sum(-1)
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    return _k3(-d)


class FixedKLController:
    """A constant KL coefficient β. Taught in chapter 03."""

    def __init__(self, kl_coef: float):
        if not kl_coef >= 0:
            raise ValueError(f"FixedKLController: kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing: the coefficient is fixed."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    r"""Adaptive KL coefficient of Ziegler et al. (2019).

    .. math:: e = \operatorname{clip}\!\left(\frac{\mathrm{KL}}{\mathrm{target}} - 1, -0.2, 0.2\right),
              \qquad \beta \leftarrow \beta\,\left(1 + e\,\frac{n_\text{steps}}{\text{horizon}}\right)

    β grows while the measured KL is above target and shrinks while below;
    the clip bounds how fast. trl 0.11 used init 0.2, target 6, horizon 10000.

    Taught in chapter 03.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if not init_kl_coef >= 0 or not target > 0 or not horizon > 0:
            raise ValueError(
                "AdaptiveKLController: need init_kl_coef >= 0, target > 0 and horizon > 0, "
                f"got {init_kl_coef}, {target}, {horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = float(current_kl)
        if math.isnan(current_kl):
            raise ValueError("AdaptiveKLController.update: current_kl is NaN")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.target, self.horizon = (float(state[k]) for k in ("value", "target", "horizon"))


def token_level_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Per-token rewards of RLHF-PPO: a KL charge on every token, the score on the last.

    .. math:: r_t = -\beta\,\mathrm{KL}_t + \mathbb 1[t = t_\text{last}]\; s

    `scores`: (B,) reward-model scores; `logprobs`, `ref_logprobs`, `mask`: (B, T)
    over response tokens. Returns `(rewards, non_score_rewards, kls)`, each (B, T)
    and zero wherever `mask` is 0; t_last is each row's last masked-in position.

    Taught in chapter 03.
    """
    fn = "token_level_rewards"
    check_same_shape(fn, logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    m = as_bool_mask(mask, logprobs, fn)
    if scores.shape != (logprobs.shape[0],):
        raise ValueError(f"{fn}: scores must have shape ({logprobs.shape[0]},), got {tuple(scores.shape)}")
    check_no_nan(fn, "scores", scores)
    check_no_nan(fn, "logprobs", logprobs, m)
    check_no_nan(fn, "ref_logprobs", ref_logprobs, m)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # zero the padding before the estimator so inf/NaN there cannot leak in
    kls = torch.where(m, kl_penalty(torch.where(m, logprobs, zero), torch.where(m, ref_logprobs, zero), kind), zero)
    non_score = -kl_coef * kls
    last = last_valid_index(m)
    rewards = non_score.clone()
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards, non_score, kls
