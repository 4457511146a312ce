"""Batched sampling from a causal LM on left-padded prompts.

Taught in chapter 07 (samples from the SFT model); the PPO rollout in chapter 09 builds on it.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def generate_responses(model, tokenizer, prompts: list[str], max_new_tokens: int = 32, temperature: float = 1.0,
                       do_sample: bool = True, batch_size: int = 64, seed: int | None = 0,
                       with_finished: bool = False) -> list[str] | tuple[list[str], list[bool]]:
    """Responses (text after the prompt, up to the first EOS) for each prompt.

    Prompts are left-padded so the new tokens line up; `generate` builds
    position ids from the attention mask. Sampling is plain temperature
    sampling: top-k and top-p are off, so the samples follow softmax(z / T).
    With `with_finished`, also whether each response ended with EOS (False: cut off at `max_new_tokens`),
    read from the sampled ids, not the decoded text: `(responses, finished)`.
    """
    if seed is not None:
        torch.manual_seed(seed)
    device = next(model.parameters()).device
    out, finished = [], []
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True, padding_side="left").to(device)
        kwargs = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, **kwargs)
        new = ids[:, enc["input_ids"].shape[1]:]
        finished += (new == tokenizer.eos_token_id).any(dim=1).tolist()
        out += tokenizer.batch_decode(new, skip_special_tokens=True)
    texts = [text.strip() for text in out]
    return (texts, finished) if with_finished else texts
