"""Batched reward-model scoring, read at the last non-pad token.

Taught in chapter 07 (`chapters/07_reward_model_training.md`); the PPO engines
score rollouts with the same function.
"""

from __future__ import annotations

import torch

from marlhf_edu.masked import last_valid_index


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) attention mask → (B, T) position ids counting only real tokens.

    With left padding the first real token must get position 0, exactly as the
    unpadded sequence would; padding positions get 0 (they are masked anyway).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scores (B,) of a sequence-classification reward model (plain or peft-wrapped).

    Runs the backbone once on the batch, gathers the hidden state at each row's
    last real token (`last_valid_index`, any padding side) and applies the score
    head to those B vectors only.
    """
    seqcls = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(seqcls, seqcls.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids_from_mask(attention_mask)).last_hidden_state
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    last = hidden[rows, last_valid_index(attention_mask)]
    return seqcls.score(last).squeeze(-1).float()


@torch.no_grad()
def score_texts(model, tokenizer, texts: list[str], batch_size: int = 64, padding_side: str = "right",
                add_eos: bool = True) -> torch.Tensor:
    """Score full texts (prompt + response) in batches; EOS is appended as in reward training."""
    device = next(model.parameters()).device
    scores = []
    for start in range(0, len(texts), batch_size):
        chunk = [t + tokenizer.eos_token if add_eos and not t.endswith(tokenizer.eos_token) else t
                 for t in texts[start:start + batch_size]]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, padding_side=padding_side)
        scores.append(sequence_scores(model, enc["input_ids"].to(device), enc["attention_mask"].to(device)).cpu())
    return torch.cat(scores) if scores else torch.zeros(0)
