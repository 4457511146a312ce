"""Frozen fp32 weights multiplied by oneDNN, reordered once: a CPU run's products with frozen weights.

On an x86 CPU build of torch (the book's torch 2.13.0+cpu), an fp32 `F.linear(x, W)` goes to MKL's sgemm. oneDNN,
a second matrix library in the same wheel (`torch.ops.mkldnn`), multiplies fastest from a weight reordered into its
own blocked layout, a reordering that costs one pass over the weight. A weight that does not change pays that pass
once:

    y  = x · Wᵀ     (B, …, in) → (B, …, out)    oneDNN, W reordered once
    ∂x = ∂y · W     (B, …, out) → (B, …, in)    oneDNN, Wᵀ reordered once (the input gradient; W is frozen)

A LoRA run multiplies frozen weights in every phase: the base under the adapters (every rollout, reference, reward
and training forward, and the backward's input gradient), the LM head, and the dense sampling copy of
`merged_rollout` (which changes once a step, after the update, and is reordered again). On the 2-core AMD EPYC (AVX512-BF16) of `benchmarks/matmul_onednn_amd_epyc_avx512bf16.json`
(`tools/bench_matmul.py`), SmolLM2's products ran 1.9-2.3x as fast through oneDNN as through MKL at 992 rows and
2.8-4.7x at 16 rows (one decode step of 16 samples); with torch, oneDNN and MKL held to AVX2 kernels on the same
CPU (capped kernels, not an AVX2-only CPU: its caches and memory stay the EPYC's), 1.2-1.4x and 1.9-2.3x. On a 2-core Intel Xeon (AVX-512, bf16, AMX;
`benchmarks/matmul_onednn_intel_xeon_avx512bf16.json`) oneDNN ran at 0.98-1.06x MKL's speed (the LM head at 16
rows 1.46x): MKL was fast there, oneDNN slower than on the EPYC.

Not bit for bit: oneDNN sums in another order than MKL, so outputs differ in the last bits of fp32 (a relative
1e-6 or so; `tests/test_onednn.py` states the tolerance), and which kernel runs, so which rounding, depends on the
CPU. The rollout's no-grad forward and the update's first forward multiply by the same reordered weights, so the
PPO ratio at the first minibatch is still 1; trainable layers (the adapters, the value head) keep `F.linear`.
Memory: each reordered weight is a second copy, two (W and Wᵀ) where a backward needs the input gradient.
`_linear_pointwise` and `_reorder_linear_weight` are private torch operators (inductor's own for frozen weights): if
a later torch drops them, `available()` is False and the config refuses `onednn_matmuls`; if it changes them, the
tests fail.

The config switch is `onednn_matmuls` (a CPU, fp32): multi-adapter PPO's base, LM head and merged copy; four-model
PPO's reference and reward model (no gradient through either) and merged copy. Chapter 09 measures it.
"""

from __future__ import annotations

import types

import torch
from torch import nn


def available() -> bool:
    """True when this torch has oneDNN and the reordered-weight linear product this module calls."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in), fp32 on the CPU, reordered into oneDNN's layout for `x · weightᵀ` (an opaque tensor)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"oneDNN reordering takes an fp32 CPU weight, got {weight.dtype} on {weight.device}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def _product(x: torch.Tensor, reordered: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")


class OneDNNWeight:
    """A frozen (out, in) weight reordered for oneDNN: `forward` for x · Wᵀ and, with `backward=True`, `transposed`
    for the input gradient ∂y · W."""

    def __init__(self, dense: torch.Tensor, backward: bool = True):
        self.shape = tuple(dense.shape)
        self.forward = reorder(dense)
        self.transposed = reorder(dense.t()) if backward else None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.forward, self.transposed) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class _FrozenLinear(torch.autograd.Function):
    """y = x · Wᵀ + b through oneDNN; the backward returns ∂x = ∂y · W only (W and b are frozen)."""

    @staticmethod
    def forward(ctx, x, weight: OneDNNWeight, bias):
        ctx.weight = weight
        return _product(x, weight.forward, bias)

    @staticmethod
    def backward(ctx, grad):
        if ctx.weight.transposed is None:
            raise RuntimeError("a oneDNN weight reordered without its transpose (backward=False) was differentiated")
        return _product(grad, ctx.weight.transposed, None), None, None


def frozen_linear(x: torch.Tensor, weight: OneDNNWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, W, bias)` for a frozen W (and bias) reordered into `weight`; differentiable in x only."""
    if bias is not None and bias.requires_grad:
        raise RuntimeError("frozen_linear: the bias requires grad; a trainable layer keeps torch's own F.linear")
    if x.requires_grad and torch.is_grad_enabled():
        # (rows, in) through the Function: oneDNN returns a view for a 3-D input, and a caller that writes the output
        # in place (the LM head's logits divided by T) may not modify a custom Function's view
        out = _FrozenLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
        return out.view(*x.shape[:-1], out.shape[-1])
    return _product(x, weight.forward, bias)


def _forward_onednn(self, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward` through a reordered copy of the weight while the weight is frozen, fp32 and on the CPU;
    re-reordered when the weight changed (a new tensor, new storage, an in-place write: its version counter)."""
    weight, bias = self.weight, self.bias
    if (weight.requires_grad or (bias is not None and bias.requires_grad) or x.dtype != torch.float32
            or weight.dtype != torch.float32 or x.device.type != "cpu"):
        return nn.functional.linear(x, weight, bias)
    key = (id(weight), weight.data_ptr(), weight._version)
    kept = self.__dict__.get("_onednn_weight")
    if kept is None or kept[0] != key:
        kept = (key, OneDNNWeight(weight, backward=self.__dict__["_onednn_backward"]))
        self.__dict__["_onednn_weight"] = kept
    return frozen_linear(x, kept[1], bias)


def use_onednn(model: nn.Module, backward: bool = True) -> int:
    """Every plain `nn.Linear` of `model` multiplies through a reordered copy of its weight whenever that weight is
    frozen (trainable ones, a LoRA adapter's or a value head's, keep `F.linear`); returns how many were patched.

    `backward=False` reorders no transpose: for a model no gradient flows through (a sampling copy, a four-model
    reference or reward model). 4-bit layers
    are `quantization.dequantize_once`'s to route (its `onednn` flag)."""
    if not available():
        raise RuntimeError("onednn_matmuls: this torch build has no oneDNN linear product (torch.ops.mkldnn)")
    patched = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__dict__["_onednn_backward"] = backward
            module.forward = types.MethodType(_forward_onednn, module)
            patched += 1
    return patched


def onednn_weights(model: nn.Module):
    """The reordered tensors the plain linear layers of `model` hold now (`use_onednn`; a 4-bit layer's are among
    `quantization.dequantized_weights`): what a memory measurement counts beside parameters and buffers."""
    for module in model.modules():
        kept = module.__dict__.get("_onednn_weight")
        if kept is not None:
            yield from kept[1].tensors()
