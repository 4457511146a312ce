"""bf16 and fp16 matrix products on CPUs that have no native kernel for them.

The 7B recipe computes in bf16 (chapter 15). On a GPU, and on a CPU whose oneDNN has bf16 kernels (AVX-512),
a bf16 matrix product multiplies bf16 inputs, accumulates in fp32 and rounds the result to bf16. On a CPU
without them (AVX2 only: many AMD EPYC and laptop CPUs), PyTorch falls back to a scalar loop for some operand
layouts, and the backward pass of every `nn.Linear` (gradient = grad_output @ W, W not transposed) takes that
path. Measured on a 2-core AMD EPYC (AVX2, torch 2.13.0+cpu), for a (128 × 11008) @ (11008 × 4096) product:

| product | seconds |
|---|---|
| fp32 | 0.08 |
| bf16, PyTorch's kernel | 40.9 |
| bf16, in `Fp32Products` (both inputs converted to fp32, the result rounded) | 0.16 |

The 7B-shaped smoke run (chapter 15, `tests/test_pipeline_7b.py`) hit CI's 15-minute limit there; inside this
mode its whole pipeline took 3 min 45 s on the same machine.

`fp32_products_where_needed()` makes those products fast without changing what they compute: inside it, on a CPU
without native kernels, `mm`, `addmm`, `bmm` and `baddbmm` whose tensors are all bf16 (or all fp16) are computed
in fp32 and rounded to that dtype, forward and backward (a `TorchDispatchMode` sees the autograd engine's
products too). Inputs, outputs and every other operation keep their dtype; the result is the same product up to
the order of the fp32 sums. Where the CPU has native kernels, or on a machine with a GPU, it does nothing. Every
`marlhf-edu` command and every stage `run_pipeline` starts runs inside it. `MARLHF_EDU_FP32_PRODUCTS=1` turns
it on everywhere (tests), `=0` off.

Taught in chapter 15.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: the dtypes whose products may lack a native CPU kernel
LOW_PRECISION = (torch.bfloat16, torch.float16)

_active = threading.local()


def native_low_precision_products(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this CPU's PyTorch has oneDNN kernels for `dtype` matrix products (AVX-512 or AMX for bf16)."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def needs_fp32_products() -> bool:
    """True when bf16 or fp16 products should be computed in fp32 here (see the module docstring): a CPU without
    native kernels and no GPU (a GPU run keeps its products on the GPU and needs no dispatch on every operation).
    `MARLHF_EDU_FP32_PRODUCTS` = 1 / 0 forces the answer."""
    forced = os.environ.get("MARLHF_EDU_FP32_PRODUCTS", "")
    if forced in ("0", "1"):
        return forced == "1"
    if torch.cuda.is_available():
        return False
    return not all(native_low_precision_products(d) for d in LOW_PRECISION)


class Fp32Products(TorchDispatchMode):
    """Computes CPU `mm` / `addmm` / `bmm` / `baddbmm` of bf16 (or fp16) tensors in fp32 and rounds the result
    to their dtype. `count` tallies the products it computed (tests read it)."""

    OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default)

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            dtype = tensors[0].dtype
            if (dtype in LOW_PRECISION and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)
                    and not kwargs.get("out_dtype")):
                self.count += 1
                up = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
                return func(*up, **kwargs).to(dtype)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fp32_products_where_needed():
    """Inside: bf16/fp16 CPU products in fp32 where this CPU has no native kernel for them (else nothing).
    Nested uses enter the mode once. Yields the `Fp32Products` mode, or None where it is not needed."""
    if getattr(_active, "mode", None) is not None or not needs_fp32_products():
        yield getattr(_active, "mode", None)
        return
    with Fp32Products() as mode:
        _active.mode = mode
        try:
            yield mode
        finally:
            _active.mode = None
