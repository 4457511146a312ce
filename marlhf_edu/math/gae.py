"""Generalised Advantage Estimation over response tokens.

Each response token is an action; the episode is one response. The advantage
of token t blends TD errors of all later tokens with weights (γλ)^k.

Taught in chapter 05 (`chapters/05_gae.md`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from marlhf_edu.math._validate import as_bool_mask, check_no_nan, check_same_shape


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





@dataclass(frozen=True)
class CountingTask:
    r"""A toy response task whose true values and advantages are known exactly.

    A response is T binary tokens. The state before token t is (t, k), k the number of 1-tokens so far, and the
    policy writes a 1 with probability ``p_one[t, k]``. Only the end is scored, as a reward model scores a response:
    the last token's reward is ``score[k_T] + noise · ε``, ε ~ N(0, 1); every earlier token's reward is 0. The
    transition (t, k) → (t + 1, k + a) is deterministic, so with γ = 1

    .. math:: V(T, k) = \mathrm{score}[k], \qquad V(t, k) = p\,V(t+1, k+1) + (1-p)\,V(t+1, k), \qquad
              A(t, k, a) = V(t+1, k+a) - V(t, k), \quad p = \mathrm{p\_one}[t, k].

    `p_one`: (T, T + 1) (entries with k > t are never used); `score`: (T + 1,); `noise`: the score noise's std.
    Taught in chapter 05.
    """

    p_one: torch.Tensor
    score: torch.Tensor
    noise: float

    @classmethod
    def random(cls, T: int = 16, noise: float = 0.0, seed: int = 0) -> "CountingTask":
        """A task of T tokens with policy probabilities in (0.2, 0.8) and scores ~ N(0, 1), both drawn from `seed`."""
        gen = torch.Generator().manual_seed(seed)
        p_one = 0.2 + 0.6 * torch.rand(T, T + 1, generator=gen, dtype=torch.float64)
        score = torch.randn(T + 1, generator=gen, dtype=torch.float64)
        return cls(p_one, score, float(noise))

    @property
    def T(self) -> int:
        return self.p_one.shape[0]

    def true_values(self) -> torch.Tensor:
        """V(t, k) for t = 0 … T (row T holds the mean scores), by the backward recursion above: (T + 1, T + 1)."""
        T = self.T
        V = torch.zeros(T + 1, T + 1, dtype=torch.float64)
        V[T] = self.score
        for t in reversed(range(T)):
            p = self.p_one[t]
            V[t, :T] = p[:T] * V[t + 1, 1:] + (1 - p[:T]) * V[t + 1, :T]  # k ≤ t < T: k + 1 stays in range
        return V

    def sample(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`n` responses drawn from the policy: counts k_t (n, T + 1), tokens a_t (n, T), rewards r_t (n, T)."""
        gen = torch.Generator().manual_seed(seed)
        T = self.T
        counts = torch.zeros(n, T + 1, dtype=torch.long)
        tokens = torch.zeros(n, T, dtype=torch.long)
        for t in range(T):
            tokens[:, t] = (torch.rand(n, generator=gen, dtype=torch.float64) < self.p_one[t, counts[:, t]]).long()
            counts[:, t + 1] = counts[:, t] + tokens[:, t]
        rewards = torch.zeros(n, T, dtype=torch.float64)
        rewards[:, -1] = self.score[counts[:, T]] + self.noise * torch.randn(n, generator=gen, dtype=torch.float64)
        return counts, tokens, rewards

    def fit_critic(self, n: int, seed: int) -> torch.Tensor:
        r"""A critic trained on `n` sampled responses: the table V̂(t, k) that minimises the squared error to the
        observed returns, :math:`\sum_i \sum_t (\hat V(t, k_{i,t}) - R_{i,t})^2`, which is each visited state's
        mean return (with γ = 1 every token's return is the response's score). A state no response visited gets
        the mean return of its position t. Returns (T, T + 1) like the rows 0 … T − 1 of `true_values`."""
        counts, _, rewards = self.sample(n, seed)
        T = self.T
        returns = rewards.flip(1).cumsum(1).flip(1)  # (n, T): reward-to-go from each token
        sums = torch.zeros(T, T + 1, dtype=torch.float64)
        visits = torch.zeros(T, T + 1, dtype=torch.float64)
        rows = torch.arange(T).expand(n, T)
        sums.index_put_((rows, counts[:, :T]), returns, accumulate=True)
        visits.index_put_((rows, counts[:, :T]), torch.ones_like(returns), accumulate=True)
        position_mean = returns.mean(0)[:, None].expand(T, T + 1)
        return torch.where(visits > 0, sums / visits.clamp_min(1), position_mean)


def _group_mean(x: torch.Tensor, ids: torch.Tensor, size: int) -> torch.Tensor:
    """The mean of `x` (N,) within each group `ids` (N,) in 0 … size − 1: (size,), 0 for an empty group."""
    n = torch.zeros(size, dtype=x.dtype).index_add_(0, ids, torch.ones_like(x))
    return torch.zeros(size, dtype=x.dtype).index_add_(0, ids, x) / n.clamp_min(1)


def gae_bias_variance(task: CountingTask, critic: torch.Tensor, lams, n: int = 20000, seed: int = 1,
                      chunk: int = 10000) -> dict[float, tuple[float, float]]:
    r"""GAE's bias and spread against λ on `task`, with the critic table `critic` (T, T + 1) (γ = 1).

    Samples `n` responses, computes :math:`\hat A_t` with `gae_advantages` for each λ in `lams`, and compares it
    with the true advantage :math:`A(t, k_t, a_t)` of the same token. Tokens are grouped by what they condition
    on, the cell c = (t, k_t, a_t), and the error :math:`e = \hat A_t - A(t, k_t, a_t)` is summarised as

    .. math:: \text{bias}^2 = \frac{1}{N}\sum_c n_c\,(\bar e_c - \bar e_{s(c)})^2, \qquad
              \text{std}^2 = \frac{1}{N}\sum_c \sum_{i \in c} (e_i - \bar e_c)^2,

    :math:`\bar e_c` the mean error in cell c, :math:`\bar e_s` the mean error of every token written at its state
    s = (t, k_t), :math:`n_c` the cell's tokens, N = n·T. The bias leaves out the error shared by both tokens of a
    state: that part acts as a baseline and does not bias the policy gradient (at λ = 1,
    :math:`\hat A_t = R_t - \hat V(s_t)` errs only by it). The bias is what no number of samples averages away; the
    std is the noise around it. A cell's mean carries sampling noise of about std/√n_c, so an unbiased estimator
    measures a small bias that grows with the std (the exact critic's values show it).
    Returns {λ: (bias, std)}, both floats.
    """
    V = task.true_values()
    counts, tokens, rewards = task.sample(n, seed)
    T = task.T
    t_idx = torch.arange(T).expand(n, T)
    true_adv = V[t_idx + 1, counts[:, :T] + tokens] - V[t_idx, counts[:, :T]]  # (n, T)
    values = critic.to(torch.float64)[t_idx, counts[:, :T]]  # (n, T): V̂(s_t) of each token
    cell = (t_idx * (T + 1) + counts[:, :T]) * 2 + tokens  # one id per (t, k, a)
    mask = torch.ones(n, T, dtype=torch.bool)
    out = {}
    for lam in lams:
        adv = torch.cat([gae_advantages(values[i:i + chunk], rewards[i:i + chunk], mask[i:i + chunk], 1.0, lam)[0]
                         for i in range(0, n, chunk)])  # chunks bound the (B, T, T) weights it builds
        err = (adv - true_adv).flatten()
        ids = cell.flatten()
        size = 2 * T * (T + 1)
        cell_mean = _group_mean(err, ids, size)[ids]  # ē_c of each token's cell c = (t, k_t, a_t)
        state_mean = _group_mean(err, ids // 2, size // 2)[ids // 2]  # ē_s of its state s = (t, k_t)
        bias = ((cell_mean - state_mean) ** 2).mean().sqrt().item()
        std = ((err - cell_mean) ** 2).mean().sqrt().item()
        out[float(lam)] = (bias, std)
    return out
