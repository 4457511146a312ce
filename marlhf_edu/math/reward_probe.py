"""Linear probing the reward head before fine-tuning it (LP-FT): a reward model that starts from what its
backbone already knows.

A reward model's `score` head starts random. Trained together with a LoRA on a few hundred real pairs, the
backbone bends its features toward whatever the random head happens to read, and little data is left to
learn the preference (chapter 13: 63 % held-out accuracy on hh-rlhf with SmolLM2). The frozen backbone's
features already separate chosen from rejected answers; fitting the head on them first is Bradley–Terry
with a linear reward,

    r(x) = w · h(x),    P(chosen ≻ rejected) = σ(w · (h_c − h_r)),

h (N, H) = the final hidden state at the last real token (what `score` reads), fitted by L2-regularised
logistic regression on the differences h_c − h_r (no bias: it cancels in every pair). The strength is picked
by k-fold cross-validation on the training pairs only, so the held-out split stays unseen. (As the strength
grows, w turns toward the mean difference of the standardised features, chosen − rejected: on a few hundred
noisy pairs that simple direction is often what cross-validation picks.) Fine-tuning then
starts from this head ("LP-FT": Kumar et al., 2022, *Fine-Tuning can Distort Pretrained Features*).

Taught in chapter 13.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from marlhf_edu.math.scoring import last_token_hidden, score_texts_with

#: L2 strengths tried by cross-validation, on features standardised to unit variance.
L2_GRID = (1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0, 10.0)


@dataclass
class ProbeFit:
    """A fitted head: `weight` (H,) acts on raw features; `l2` was chosen by `cv_accuracy` (one per grid value)."""

    weight: torch.Tensor
    l2: float
    train_accuracy: float
    cv_accuracy: dict = field(default_factory=dict)


def _fit(diff: torch.Tensor, l2: float) -> torch.Tensor:
    """argmin_w mean(softplus(−diff·w)) + l2 ‖w‖² on standardised differences (N, H) → w (H,). Convex: LBFGS."""
    w = torch.zeros(diff.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=500, tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.softplus(-(diff @ w)).mean() + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def fit_bradley_terry_head(chosen: torch.Tensor, rejected: torch.Tensor, l2_grid=L2_GRID, folds: int = 5,
                           seed: int = 0) -> ProbeFit:
    """Fit r(x) = w · h(x) to pairs of features `chosen`, `rejected` (N, H), the L2 strength by `folds`-fold CV.

    Features are standardised by the pooled std of both sides (so one strength suits every width); the returned
    weight is mapped back to raw features, ready to copy into a `score` head (its bias, if any, stays 0)."""
    if chosen.shape != rejected.shape or chosen.dim() != 2:
        raise ValueError(f"chosen and rejected must both be (N, H), got {tuple(chosen.shape)} and {tuple(rejected.shape)}")
    n = chosen.shape[0]
    if n < 2 * folds:
        raise ValueError(f"{n} pairs are too few for {folds}-fold cross-validation (need at least {2 * folds})")
    chosen, rejected = chosen.double(), rejected.double()
    std = torch.cat([chosen, rejected]).std(0).clamp_min(1e-6)
    diff = (chosen - rejected) / std
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    fold_of = torch.empty(n, dtype=torch.long)
    fold_of[order] = torch.arange(n) % folds
    cv = {}
    for l2 in l2_grid:
        correct = sum(int(((diff[fold_of == k] @ _fit(diff[fold_of != k], l2)) > 0).sum()) for k in range(folds))
        cv[l2] = correct / n
    best = max(l2_grid, key=lambda l2: (cv[l2], l2))  # ties: the stronger regularisation
    w = _fit(diff, best)
    return ProbeFit(weight=(w / std).float(), l2=best, train_accuracy=float(((diff @ w) > 0).double().mean()),
                    cv_accuracy=cv)


def probe_score_head(model, tokenizer, pairs: list[dict], batch_size: int = 32, **fit_kwargs) -> ProbeFit:
    """Fit the `score` head of a sequence-classification `model` on preference `pairs` (prompt, chosen, rejected)
    with its backbone frozen, and copy the weight in. Features are read exactly as `sequence_scores` reads them
    (EOS appended, last real token)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device

    def features(key):
        return score_texts_with(lambda ids, mask: last_token_hidden(model, ids, mask), tokenizer,
                                [p["prompt"] + p[key] for p in pairs], batch_size, device=device)

    fit = fit_bradley_terry_head(features("chosen"), features("rejected"), **fit_kwargs)  # features: no grad
    score = (model.get_base_model() if hasattr(model, "get_base_model") else model).score
    with torch.no_grad():
        score.weight.copy_(fit.weight.view_as(score.weight).to(score.weight))
        if getattr(score, "bias", None) is not None:
            score.bias.zero_()
    model.train(was_training)
    return fit
