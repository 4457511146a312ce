"""Batched sampling from a causal LM on left-padded prompts.

Taught in chapter 07 (samples from the SFT model); the PPO rollout in chapter 09 builds on it.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def generate_responses(model, tokenizer, prompts: list[str], max_new_tokens: int = 32, temperature: float = 1.0,
                       do_sample: bool = True, batch_size: int = 64, seed: int | None = 0) -> list[str]:
    """Responses (text after the prompt, up to the first EOS) for each prompt.

    Prompts are left-padded so the new tokens line up; `generate` builds
    position ids from the attention mask. Sampling is plain temperature
    sampling: top-k and top-p are off, so the samples follow softmax(z / T).
    """
    if seed is not None:
        torch.manual_seed(seed)
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True, padding_side="left").to(device)
        kwargs = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, **kwargs)
        out += tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return [text.strip() for text in out]
