"""Batched reward-model scoring, read at the last non-pad token.

Taught in chapter 08 (`chapters/08_reward_model_training.md`); the PPO engines
score rollouts with the same function. A reward model is trained on texts that end
with EOS, so a rollout cut off at `max_new_tokens` is scored with EOS appended
(`append_missing_eos`) and its truncation penalised explicitly
(`penalise_missing_eos`): chapter 13 measures what goes wrong otherwise.
"""

from __future__ import annotations

import torch

from marlhf_edu.math.masked import last_valid_index


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) attention mask → (B, T) position ids counting only real tokens.

    With left padding the first real token must get position 0, exactly as the
    unpadded sequence would; padding positions get 0 (they are masked anyway).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def last_token_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, H) final hidden state at each row's last real token, from the backbone of a sequence-classification
    model (plain or peft-wrapped): what its score head reads. `use_cache=False`: a scoring pass never decodes
    further, and the KV cache it would build costs about 10.7 GB at 7B for 64 x 320 tokens."""
    seqcls = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(seqcls, seqcls.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows, last_valid_index(attention_mask)]


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scores (B,) of a sequence-classification reward model (plain or peft-wrapped).

    Runs the backbone once on the batch, gathers the hidden state at each row's
    last real token (`last_valid_index`, any padding side) and applies the score
    head to those B vectors only.
    """
    seqcls = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = seqcls.score  # fp32 over a bf16 backbone on a GPU (the stages keep trainables fp32): read in its dtype
    return head(last_token_hidden(model, input_ids, attention_mask).to(head.weight.dtype)).squeeze(-1).float()


#: How a rollout that never reached EOS is read by the reward model (`PPOConfig.truncated_scoring`).
TRUNCATED_SCORING = ("append_eos", "last_token")


def append_missing_eos(input_ids: torch.Tensor, attention_mask: torch.Tensor, has_eos: torch.Tensor,
                       eos_token_id: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and mask → (B, T + 1) ids and mask in which every row without EOS (`has_eos` false) ends with an
    EOS right after its last real token; rows that have one get a padding column (mask 0).

    This is how a truncated rollout must reach a reward model trained on EOS-terminated texts: read at its last
    generated token it is a text mid-sentence, which the reward model never saw (chapter 13 measures the gap on
    the same answers). The policy's tokens are unchanged; only the scoring input grows. Any padding side: the EOS
    goes after each row's last 1 in the mask (`last_valid_index`). When every row has its EOS the inputs are
    returned as they are (no extra column, so nothing about the scoring forward changes)."""
    has_eos = has_eos.to(device=input_ids.device, dtype=torch.bool)
    if bool(has_eos.all()):
        return input_ids, attention_mask
    B = input_ids.shape[0]
    ids = torch.cat([input_ids, input_ids.new_full((B, 1), pad_token_id)], dim=1)
    mask = torch.cat([attention_mask, attention_mask.new_zeros((B, 1))], dim=1)
    rows = (~has_eos).nonzero().squeeze(-1)
    at = last_valid_index(attention_mask)[rows] + 1
    ids[rows, at] = eos_token_id
    mask[rows, at] = 1
    return ids, mask


def penalise_missing_eos(scores: torch.Tensor, has_eos: torch.Tensor, penalty: float | None) -> torch.Tensor:
    """`scores` less `penalty` where a response never reached EOS (None or 0: unchanged). The one rule of the
    PPO engines (`PPOTrainer.transform_scores`) and GRPO's `RewardModelReward`."""
    if not penalty:
        return scores
    return torch.where(has_eos.to(torch.bool), scores, scores - penalty)


@torch.no_grad()
def score_texts_with(score_fn, tokenizer, texts: list[str], batch_size: int = 64, padding_side: str = "right",
                     add_eos: bool = True, device=None) -> torch.Tensor:
    """Score full texts (prompt + response) in batches with `score_fn(input_ids, attention_mask) -> (B,)`.

    EOS is appended as in reward training. Any scorer fits: a reward model
    (`score_texts`) or a PPO backend's `scores` (the reward adapter of MA-PPO).
    """
    scores = []
    for start in range(0, len(texts), batch_size):
        chunk = [t + tokenizer.eos_token if add_eos and not t.endswith(tokenizer.eos_token) else t
                 for t in texts[start:start + batch_size]]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, padding_side=padding_side)
        scores.append(score_fn(enc["input_ids"].to(device), enc["attention_mask"].to(device)).float().cpu())
    return torch.cat(scores) if scores else torch.zeros(0)


def score_texts(model, tokenizer, texts: list[str], batch_size: int = 64, padding_side: str = "right",
                add_eos: bool = True) -> torch.Tensor:
    """Score full texts with a sequence-classification reward model, in batches (see `score_texts_with`)."""
    device = next(model.parameters()).device
    return score_texts_with(lambda ids, mask: sequence_scores(model, ids, mask), tokenizer, texts, batch_size,
                            padding_side, add_eos, device)
