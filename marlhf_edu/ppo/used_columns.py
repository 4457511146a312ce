"""Forward passes over the columns a chunk of rows uses, not the whole batch's width.

A rollout's rows are prompts left-padded to the batch's widest, then responses right-padded to the batch's
longest (every token after a row's EOS is masked). A forward over a chunk of those rows (a forward batch, a
micro-batch of the update) needs only the columns some row of the chunk attends to:

    columns   0 … first-1        first … P-1        P … stop-1             stop … T-1
              padding in         prompts             responses              masked in
              every row                                                     every row

`trim_columns` cuts the two outer blocks. No real token's result changes: a masked key gets attention weight
exactly 0, position ids come from the mask (`position_ids_from_mask`), and a causal model's outputs at a column
never depend on the columns after it. Only the shapes change, so floating-point rounding may. `pad_columns` gives
the per-token outputs back the batch's width, zero where they were cut (masked positions, as before).

On the tiny config (64 rollouts of at most 32 new tokens, about 11 on average) most columns of the response
block are padding. Taught in chapter 09.
"""

from __future__ import annotations

import torch

from marlhf_edu.math.masked import last_valid_index


def used_span(attention_mask: torch.Tensor, n_response: int) -> tuple[int, int]:
    """Columns `[first, stop)` of a (B, P + R) mask that hold every attended token, with R = `n_response`.

    Always keeps the last prompt column (its logits predict the first response token) and at least one response
    column, so the response block of the trimmed batch is `stop - P` ≥ 1 columns wide."""
    if attention_mask.dim() != 2 or not 0 < n_response < attention_mask.shape[1]:
        raise ValueError(f"used_span: expected a (B, P + R) mask with 0 < R < P + R, got shape "
                         f"{tuple(attention_mask.shape)} and n_response={n_response}")
    P = attention_mask.shape[1] - n_response
    used = attention_mask.bool().any(dim=0).tolist()  # one host read per chunk
    first = next((i for i, u in enumerate(used[:P]) if u), P - 1)
    stop = P + max((i + 1 for i, u in enumerate(used[P:]) if u), default=1)
    return min(first, P - 1), stop


def trim_columns(input_ids: torch.Tensor, attention_mask: torch.Tensor, n_response: int
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids, mask, r): the (B, P + R) batch cut to `used_span`, and the width r ≤ R of its response block."""
    first, stop = used_span(attention_mask, n_response)
    P = attention_mask.shape[1] - n_response
    return input_ids[:, first:stop], attention_mask[:, first:stop], stop - P


def right_aligned(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) with each (B, T) row rolled right until its last attended token sits in the last column, then
    cut to the columns some row uses. The padding after a response moves to the front, so a chunk needs only its
    longest prompt + response, where the prompt/response layout needs its widest prompt + longest response. For a
    reader of the last token (the reward model, `last_valid_index`) nothing else changes: position ids come from the
    mask."""
    T = attention_mask.shape[1]
    shift = T - 1 - last_valid_index(attention_mask)  # (B,) the padding after each row's last token
    source = (torch.arange(T, device=attention_mask.device)[None, :] - shift[:, None]) % T
    ids, mask = input_ids.gather(1, source), attention_mask.gather(1, source)
    first = int(mask.bool().any(dim=0).long().argmax())  # the last column is used by every row
    return ids[:, first:], mask[:, first:]


def pad_columns(x: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """A per-response-token (B, r) output back to (B, `width`), zeros on the right (the cut, masked positions);
    differentiable (the zeros take no gradient). None stays None."""
    if x is None or x.shape[1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))
