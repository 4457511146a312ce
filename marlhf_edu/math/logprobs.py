"""From logits to per-token log-probabilities and entropies.

A causal LM gives logits (B, T, V); PPO needs log π(a_t | s_t) for the tokens
that were actually sampled, a (B, T) tensor. The naive route,
`log_softmax(logits).gather(labels)`, builds a second (B, T, V) tensor in fp32:
at V = 32000 that is 128 kB per token. Here the vocabulary axis is reduced a
chunk of rows at a time, and the backward pass recomputes the softmax chunk by
chunk, so no full-vocabulary fp32 copy is ever kept.

Taught in chapter 02 (`chapters/02_logprobs.md`).
"""

from __future__ import annotations

import torch

from marlhf_edu.math._validate import check_no_nan

#: Elements of fp32 scratch per chunk (2**20 floats = 4 MiB).
CHUNK_ELEMENTS = 2**20


def _row_chunks(n_rows: int, vocab: int):
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


class _LabelLogProb(torch.autograd.Function):
    """log softmax(z)[y] per row of a (N, V) matrix, with O(chunk·V) fp32 scratch."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor):
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for rows in _row_chunks(logits.shape[0], logits.shape[1]):
            lse[rows] = torch.logsumexp(logits[rows].float(), dim=-1)
        picked = logits.gather(-1, labels[:, None]).squeeze(-1).float()
        ctx.save_for_backward(logits, labels, lse)
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        # (with create_graph the chunks are not computed in place: an out= operation is not differentiable)
        fp32 = grad.dtype == torch.float32 and not torch.is_grad_enabled()
        # d/dz_v [z_y - lse(z)] = 1[v = y] - softmax(z)_v
        for rows in _row_chunks(logits.shape[0], logits.shape[1]):
            # fp32 logits: each chunk is computed in grad's own rows, in place (no scratch tensor per operation);
            # the same operations, so the same numbers
            z = logits[rows].float()
            g = torch.sub(z, lse[rows, None], out=grad[rows]) if fp32 else z - lse[rows, None]
            g.exp_().mul_(-grad_out[rows, None])
            g.scatter_add_(-1, labels[rows, None], grad_out[rows, None].float())
            if not fp32:
                grad[rows] = g.to(grad.dtype)
        return grad, None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    r"""Log-probability of each label under the softmax of its logits.

    .. math:: \log\pi(y_{b,t}) = z_{b,t,y_{b,t}} - \log\sum_v e^{z_{b,t,v}}

    `logits`: (B, T, V), any float dtype; `labels`: (B, T) token ids.
    Returns (B, T) fp32. Alignment is the caller's job: for a causal LM the
    logits at position t predict token t+1, so pass `logits[:, :-1]` with
    `input_ids[:, 1:]`. Differentiable with respect to `logits`.

    Taught in chapter 02.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logprobs_from_logits: expected logits (B, T, V) and labels (B, T), "
            f"got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    vocab = logits.shape[-1]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= vocab):
        raise ValueError(f"logprobs_from_logits: labels must lie in [0, {vocab}), got range "
                         f"[{int(labels.min())}, {int(labels.max())}]")
    B, T, V = logits.shape
    out = _LabelLogProb.apply(logits.reshape(B * T, V), labels.reshape(B * T).long()).view(B, T)
    # a NaN logit makes its row's log-sum-exp NaN: checking the (B, T) result finds every such position without a
    # (B, T, V) scan of the logits on every call of the hot loop
    check_no_nan("logprobs_from_logits", "logits", out)
    return out


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    r"""Entropy of the softmax distribution at every position.

    .. math:: H_{b,t} = -\sum_v p_v \log p_v = \log\sum_v e^{z_v} - \sum_v p_v z_v

    `logits`: (B, T, V) → (B, T) fp32, computed a chunk of rows at a time.
    PPO usually reports entropy as a statistic (under `torch.no_grad`); with
    gradients enabled the per-chunk softmax is kept for backward as usual.

    Taught in chapter 02; used as the entropy bonus in chapter 06.
    """
    if logits.dim() != 3:
        raise ValueError(f"entropy_from_logits: expected logits (B, T, V), got {tuple(logits.shape)}")
    B, T, V = logits.shape
    flat = logits.reshape(B * T, V)
    parts = []
    for rows in _row_chunks(B * T, V):
        z = flat[rows].float()
        probs = torch.softmax(z, dim=-1)
        # a logit of -inf (a banned token) has p = 0 and contributes 0, not 0 * -inf = NaN
        parts.append(torch.logsumexp(z, dim=-1) - (probs * torch.where(probs > 0, z, 0.0)).sum(-1))
    out = torch.cat(parts).view(B, T) if parts else flat.new_zeros(B, T, dtype=torch.float32)
    check_no_nan("entropy_from_logits", "logits", out)  # a NaN logit makes its position's entropy NaN
    return out
