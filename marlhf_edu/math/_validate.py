"""Input checks shared by the math modules.

Every public function turns degenerate input into a `ValueError` that names the
function and the argument, instead of letting a NaN travel silently into a loss.
"""

from __future__ import annotations

import torch


def as_bool_mask(mask: torch.Tensor, like: torch.Tensor, fn: str) -> torch.Tensor:
    """Return `mask` as a bool tensor broadcastable to `like`, or raise."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{fn}: `mask` must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or mask.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
            bad = (mask != 0) & (mask != 1)
            if bool(bad.any()):
                raise ValueError(f"{fn}: `mask` must hold only 0 and 1 (or be bool); found {mask[bad].flatten()[0].item()}")
        mask = mask != 0
    try:
        torch.broadcast_shapes(mask.shape, like.shape)
    except RuntimeError as err:
        raise ValueError(f"{fn}: `mask` of shape {tuple(mask.shape)} does not broadcast to {tuple(like.shape)}") from err
    return mask


def check_no_nan(fn: str, name: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise if `x` holds a NaN where `mask` is true (everywhere when `mask` is None).

    NaN at masked positions is allowed: masked entries never influence a result.
    """
    nan = torch.isnan(x) if x.is_floating_point() else torch.zeros_like(x, dtype=torch.bool)
    if mask is not None:
        nan = nan & mask
    if bool(nan.any()):
        first = tuple(int(i) for i in nan.nonzero()[0].tolist())
        where = "unmasked " if mask is not None else ""
        raise ValueError(f"{fn}: `{name}` contains NaN at {int(nan.sum())} {where}position(s), first at index {first}")


def check_same_shape(fn: str, **tensors: torch.Tensor) -> None:
    """Raise unless all given tensors have one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{k}={v}" for k, v in shapes.items())
        raise ValueError(f"{fn}: shapes must match, got {listed}")
