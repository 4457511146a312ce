"""Direct preference optimisation: the policy trained on preference pairs, with no reward model and no sampling.

DPO (Rafailov et al. 2023) starts from the KL-regularised objective PPO optimises
and notes that its optimum satisfies r(x, y) = β log π(y|x)/π_ref(y|x) + β log Z(x).
Put that r into the Bradley–Terry likelihood of chapter 01 and Z cancels in each
pair: the policy itself is the reward model. trl's `DPOTrainer` trains it; this
module holds the loss, written out, and the sequence log-probabilities it needs,
so that the book can check trl's numbers (a test does, with a LoRA policy whose
reference is the same model with its adapter disabled).

Taught in chapter 12.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from marlhf_edu.math._validate import as_bool_mask, check_same_shape
from marlhf_edu.math.logprobs import logprobs_from_logits


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        completion_mask: torch.Tensor) -> torch.Tensor:
    r"""log π(y|x) = Σ_t log π(y_t | x, y_<t) over the completion tokens of each row: (B, T) → (B,).

    `completion_mask` (B, T) marks the completion's tokens in `input_ids` (trl's
    preference collator builds it; padding on the right). The token at position t
    is predicted by the logits at t − 1, hence the one-token shift (chapter 02).

    Taught in chapter 12.
    """
    check_same_shape("completion_logprobs", input_ids=input_ids, attention_mask=attention_mask,
                     completion_mask=completion_mask)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    logprobs = logprobs_from_logits(logits, input_ids[:, 1:])
    mask = as_bool_mask(completion_mask, input_ids, "completion_logprobs")[:, 1:]
    return torch.where(mask, logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)).sum(-1)


def tokenize_preference_pairs(pairs: list[dict], tokenizer) -> list[dict]:
    """Token ids of text preference pairs, split as trl's `DPOTrainer` splits them for training.

    Each row of `pairs` holds the strings "prompt", "chosen" and "rejected" (not chat messages). As trl 1.16
    does for such rows: the tokenizer's EOS is appended to each answer that does not already end with it;
    prompt, prompt + chosen and prompt + rejected are tokenised whole; and the answers start where those token
    sequences first differ from the prompt's (trl's `common_prefix_length`: tokens can merge across the boundary), so
    `prompt_ids + chosen_ids` is exactly the tokenised prompt + chosen text. Returns one dict per pair with
    `prompt_ids`, `chosen_ids`, `rejected_ids`, ready for trl's `DataCollatorForPreference`
    (`trainer.data_collator`). A test pins it against trl's own preparation of a dataset.

    Why not trl's: its preparation is a private method of the trainer; scoring held-out pairs as training
    saw them needs the same ids (chapter 12).
    """
    from trl.data_utils import common_prefix_length

    eos = tokenizer.eos_token
    if eos is None:
        raise ValueError("tokenize_preference_pairs: the tokenizer has no EOS token to end the answers with")
    out = []
    for i, pair in enumerate(pairs):
        missing = [k for k in ("prompt", "chosen", "rejected") if not isinstance(pair.get(k), str)]
        if missing:
            raise ValueError(f"tokenize_preference_pairs: pair {i} needs text under {missing}")
        prompt = tokenizer(text=pair["prompt"])["input_ids"]
        chosen, rejected = (tokenizer(text=pair["prompt"] + (a if a.endswith(eos) else a + eos))["input_ids"]
                            for a in (pair["chosen"], pair["rejected"]))
        n = min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected))
        out.append({"prompt_ids": prompt[:n], "chosen_ids": chosen[n:], "rejected_ids": rejected[n:]})
    return out


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The DPO loss of a batch of pairs, and each response's implicit reward.

    .. math:: L = -\frac1B\sum_b \log\sigma\Big(\beta\big[\log\tfrac{\pi(y_w)}{\pi_{ref}(y_w)}
              - \log\tfrac{\pi(y_l)}{\pi_{ref}(y_l)}\big]\Big),
              \qquad \hat r(y) = \beta\log\frac{\pi(y)}{\pi_{ref}(y)}

    All four inputs are (B,) sequence log-probabilities (`completion_logprobs`) of
    the chosen (y_w) and rejected (y_l) response of each pair. Returns the loss and
    the implicit rewards (B,) of chosen and rejected, detached (they are for
    logging; their gap is what the loss pushes up). β plays the part of PPO's KL
    coefficient: a small β lets the policy move far from the reference for a given
    margin, a large one keeps it close. `logsigmoid` keeps large gaps finite.

    Taught in chapter 12.
    """
    fn = "dpo_loss"
    check_same_shape(fn, policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps,
                     ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    if policy_chosen_logps.dim() != 1:
        raise ValueError(f"{fn}: the log-probs must be (B,), one per response, got shape "
                         f"{tuple(policy_chosen_logps.shape)}")
    if not beta > 0:
        raise ValueError(f"{fn}: `beta` must be > 0, got {beta!r}")
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    loss = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios)).mean()
    return loss, (beta * chosen_logratios).detach(), (beta * rejected_logratios).detach()


def ipo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
) -> torch.Tensor:
    r"""IPO's loss (Azar et al. 2023): each pair's log-ratio margin regressed onto 1/(2β).

    .. math:: h = \log\tfrac{\pi(y_w)}{\pi_{ref}(y_w)} - \log\tfrac{\pi(y_l)}{\pi_{ref}(y_l)},
              \qquad L = \frac1B\sum_b \Big(h_b - \frac{1}{2\beta}\Big)^2

    Inputs as `dpo_loss` (B,). DPO's −log σ(βh) keeps falling as h grows, so on a pair whose
    preference is certain its optimum is h = ∞ for every β; IPO's square has its minimum at
    h = 1/(2β), so β sets where the margin stops. trl's `loss_type="ipo"` averages each answer's
    token log-probs before this; here the caller chooses what it passes.

    Taught in chapter 12 (withheld, with `margin_trajectory`, during its exercise).
    """
    fn = "ipo_loss"
    check_same_shape(fn, policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps,
                     ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    if not beta > 0:
        raise ValueError(f"{fn}: `beta` must be > 0, got {beta!r}")
    margin = (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)
    return ((margin - 1 / (2 * beta)) ** 2).mean()


def ipo_preferred_margin(p, beta: float):
    r"""Where IPO's loss puts the log-ratio margin h(y, y') of a pair the data state as (y, y') a share p of the
    time and as (y', y) the rest: the minimum of p·(h − 1/(2β))² + (1 − p)·(−h − 1/(2β))²,

    .. math:: h^* = \frac{2p - 1}{2\beta} = \frac{p - 1/2}{\beta},

    finite for every p, 1/(2β) for a certain preference (p = 1) and 0 for none. DPO's optimum for the same data,
    σ(βh) = p, is h = log(p / (1 − p)) / β: unbounded as p → 1. `p` a float or a tensor.

    Taught in chapter 12 (the reference of its exercise).
    """
    if not beta > 0:
        raise ValueError(f"ipo_preferred_margin: `beta` must be > 0, got {beta!r}")
    return (2 * p - 1) / (2 * beta)


def margin_trajectory(loss_fn, beta: float, steps: int = 2000, lr: float = 0.1) -> list[float]:
    r"""The log-ratio margin h of one pair under `loss_fn`, after each of `steps` gradient steps: a certain
    preference when `loss_fn` is DPO's or IPO's loss of the pair in one order, an uncertain one when it averages
    the two orders (the exercise's check does that).

    The policy is the simplest one: a free logit per answer (chosen, rejected, one other), the reference
    uniform, plain SGD. Then h = logit_w − logit_l, and each step moves h by −2·lr·∂L/∂h, so what the loss
    does to the margin is all there is to see. `loss_fn(pc, pr, rc, rr, beta)` takes (1,) log-probs as
    `dpo_loss` does and returns the loss (or a tuple whose first item is the loss).

    Taught in chapter 12.
    """
    logits = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.zeros(3, dtype=torch.float64), -1)
    opt = torch.optim.SGD([logits], lr=lr)
    margins = []
    for _ in range(steps):
        logp = torch.log_softmax(logits, -1)
        loss = loss_fn(logp[0:1], logp[1:2], ref[0:1], ref[1:2], beta)
        loss = loss[0] if isinstance(loss, (tuple, list)) else loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            logp = torch.log_softmax(logits, -1)
            margins.append(float((logp[0] - ref[0]) - (logp[1] - ref[1])))
    return margins
