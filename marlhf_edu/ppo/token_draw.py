"""Drawing a token from softmax(z / T): transformers' multinomial, or one uniform per row against the CDF.

transformers' `generate` samples each new token with `torch.multinomial(probs, 1)`. On a CPU that is an
exponential race: one exponential variate E_v per vocabulary entry and the token argmax_v p_v / E_v. It draws
exactly from p, but it makes B × V random numbers a decode step; at SmolLM2's 16 rows × 49,152 tokens, with its
softmax, 14-15 ms a step on a 2-core AMD EPYC (`tools/bench_token_draw.py`; "draw_microbenchmark" in
`benchmarks/smollm2_step_token_draw_*.json`), 0.7 s of a 48-token rollout.

The inverse-CDF draw makes one uniform u per row and takes the first token whose cumulative probability
reaches a threshold t in (0, C_V]:

    C_v = Σ_{w ≤ v} p_w,        y = min{ v : C_v ≥ t },        t = (1 − u) · C_V,   u ~ U[0, 1)

so token v is drawn with probability (C_v − C_{v−1}) / C_V = p_v / Σ_w p_w, the same distribution (up to the
rounding below), from another stream of random numbers. A token of probability 0 is never drawn: t > 0 passes
over a leading run of zeros, and C_v = C_{v−1} cannot reach a threshold that C_{v−1} did not (on a CPU the sum
runs in order, so C never decreases). t ≤ C_V keeps y inside the vocabulary (with u · C_V instead, rounding could
land the threshold on C_V itself). With the exp of the log-probs and the one-hot scores below it costs 0.8 ms a
step at 16 × 49,152 (the same record).

Precision is why both C and u are fp64: in fp32 a cumulative sum over 49,152 entries carries rounding of ~6e-8
(2⁻²⁴ of a total near 1), as large as a tail token's whole probability, and an fp32 uniform has the same
2⁻²⁴ grid. In fp64 each token's probability is off by at most about 2⁻⁵³ of the total (a token below that
can be lost in the sum), a total variation of at most V · 2⁻⁵³ ≈ 5e-12 a step at V = 49,152.

`SampledLogprobs(draw=True)` draws this way inside `generate` (greedy mode: it hands `generate` scores of 0
for the drawn token and −inf elsewhere, so the argmax is the draw); `PPOConfig.token_draw` chooses. Taught in
chapter 09.
"""

from __future__ import annotations

import torch

#: How the sampler draws each token (`PPOConfig.token_draw`, `backends.sample`).
TOKEN_DRAWS = ("multinomial", "inverse_cdf")


def inverse_cdf_draw(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` (B, V), non-negative and not necessarily normalised, drawn with probability
    p_v / Σ_w p_w: the first v with C_v ≥ (1 − u) · C_V, C the fp64 cumulative sum, u ~ U[0, 1) in fp64 from
    torch's global generator (one number a row). Returns (B,) int64. A row that sums to 0, NaN or ∞ is refused."""
    if probs.dim() != 2:
        raise ValueError(f"inverse_cdf_draw: expected (B, V) probabilities, got shape {tuple(probs.shape)}")
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    total = cdf[:, -1:]
    if not (torch.isfinite(total).all() and (total > 0).all()):
        bad = (~(torch.isfinite(total) & (total > 0))).nonzero()[0, 0].item()
        raise ValueError(f"inverse_cdf_draw: row {bad} of the probabilities sums to {total[bad, 0].item()}; "
                         "need a finite positive total (a row of NaN or all-zero probabilities)")
    # on a CPU u is a multiple of 2⁻⁵³, so 1 − u is exact in fp64; 0 < t ≤ C_V after rounding either way
    threshold = torch.rand(total.shape, dtype=torch.float64, device=probs.device).neg_().add_(1).mul_(total)
    return torch.searchsorted(cdf, threshold).squeeze(1)  # the first v with C_v ≥ t
