"""Forward passes over the columns a chunk of rows uses, not the whole batch's width.

A rollout's rows are prompts left-padded to the batch's widest, then responses right-padded to the batch's
longest (every token after a row's EOS is masked):

    row 0   pad pad  p   p   p | r   r   EOS pad pad
    row 1   p   p    p   p   p | r   EOS pad pad pad      (P + R columns)

A forward over some of those rows needs each row's prompt and response, nothing else. `packed` shifts every row
right, circularly, until its last real token sits in the last column (the padding after the response wraps round
to the front) and cuts the columns that are padding in every row:

    row 0   pad p   p   p   r   r   EOS
    row 1   p   p   p   p   p   r   EOS                  (its longest prompt + response)

which is how trl 0.11 lays out a batch (each query and response without a gap). The response block is then the
last r columns, r the longest response among the rows, as the model-facing functions (`response_logits`,
`response_values`) expect; row i's tokens sit in its last `lengths[i]` of them, and `unpacked` moves every
per-token output back to the batch's layout (zeros after each response, where the mask is 0). No real
token's result changes: a masked key gets attention weight exactly 0, position ids come from the mask
(`position_ids_from_mask`), and a causal model's outputs at a column never depend on later columns. Only the
shapes change, so floating-point rounding may. The reward model reads the last token alone (`right_aligned`).

Chapter 09 packs one rollout of its 8 rows: 408 positions in the batch's layout, 376 packed whole, 348 in the
rollout's two sorted micro-batches, for 317 tokens. Taught in chapter 09.
"""

from __future__ import annotations

import torch

from marlhf_edu.math.masked import last_valid_index


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


def packed(input_ids: torch.Tensor, attention_mask: torch.Tensor, n_response: int
           ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(ids, mask, r, lengths) of a (B, P + R) prompt/response batch, R = `n_response`: its rows right-aligned
    (`right_aligned`), r the longest response, `lengths` (B,) each row's response tokens. A forward over them reads
    the last r columns as its response block; `unpacked(output, lengths, R)` gives its per-token outputs back the
    batch's layout."""
    if attention_mask.dim() != 2 or not 0 < n_response < attention_mask.shape[1]:
        raise ValueError(f"packed: expected a (B, P + R) mask with 0 < R < P + R, got shape "
                         f"{tuple(attention_mask.shape)} and n_response={n_response}")
    lengths = attention_mask[:, -n_response:].sum(dim=1)
    ids, mask = right_aligned(input_ids, attention_mask)
    # at least one response column, and the column before it (its logits predict the first response token)
    r = min(max(int(lengths.max()), 1), ids.shape[1] - 1)
    return ids, mask, r, lengths


def unpacked(x: torch.Tensor | None, lengths: torch.Tensor, width: int) -> torch.Tensor | None:
    """A (B, r) per-response-token output of a `packed` forward, row i's values in its last `lengths[i]` columns,
    back to (B, `width`) with each row's values from column 0 and zeros after (masked positions); differentiable
    (the zeros take no gradient). None stays None."""
    if x is None:
        return None
    r = x.shape[1]
    columns = torch.arange(r, device=x.device)[None, :]
    lengths = lengths.to(x.device)[:, None]
    moved = x.gather(1, (columns + r - lengths).clamp(0, r - 1))
    return pad_columns(torch.where(columns < lengths, moved, torch.zeros((), dtype=x.dtype, device=x.device)), width)
