"""bf16 and fp16 matrix products on CPUs that have no native kernel for them.

The 7B recipe computes in bf16 (chapter 15). On a GPU, and on a CPU whose oneDNN has bf16 kernels (AVX-512),
a bf16 matrix product multiplies bf16 inputs, accumulates in fp32 and rounds the result to bf16. On a CPU
without them (AVX2 only: many AMD EPYC and laptop CPUs), PyTorch falls back to a scalar loop for some operand
layouts, and the backward pass of every `nn.Linear` (gradient = grad_output @ W, W not transposed) takes that
path. One (128 × 11008) @ (11008 × 4096) bf16 product, on a 2-core AMD EPYC without AVX-512 (torch
2.13.0+cpu), took 40.9 s with PyTorch's kernel, 0.16 s in `Fp32Products` (both inputs converted to fp32, the
result rounded), against 0.08 s for the same product in fp32. The 7B-shaped smoke run (chapter 15,
`tests/test_pipeline_7b.py`) hit CI's 15-minute limit there; with this mode `marlhf-edu pipeline` ran it in
3 min 45 s on the same machine.

`fp32_products_where_needed()` makes those products fast without changing what they compute: inside it, on a CPU
without bf16 kernels, `mm`, `addmm`, `bmm` and `baddbmm` whose tensors are all of a dtype this CPU has no
kernels for (bf16, and fp16 where it has none either) are computed in fp32 and rounded to that dtype, forward
and backward (a `TorchDispatchMode` also sees the products the autograd engine runs). Inputs, outputs and every
other operation keep their dtype; the result is the same product up to the order of the fp32 sums. Other
operations are not rerouted: `mv`, `addmv`, `dot`, `.out` overloads, fused CPU attention
(`_scaled_dot_product_flash_attention_for_cpu`) and the products inside a custom operator (bitsandbytes' 4-bit
forward, whose x @ Wᵀ layout PyTorch computes at 0.5 s for the product above) run PyTorch's own kernels. Costs: every operation passes
through the mode's Python dispatch while it is on, and each rerouted product holds fp32 copies of its two inputs
for its duration (0.5 GiB for a 7B language-model head). So the mode is entered only where a run holds such
tensors: inside `fp32_products_where_needed()` a global forward pre-hook checks each module not yet checked when
it runs (`_Watcher`), and the first with a parameter or buffer of a slow dtype on the CPU enters the mode; an fp32
run never enters it, and once every module it built has been checked the hook goes until the next model is built.
Where the CPU has bf16 kernels, or on a machine with a GPU, it is off (a CPU-only run on a GPU host can set
`MARLHF_EDU_FP32_PRODUCTS=1`). Every `marlhf-edu` command and every stage `run_pipeline` starts runs inside it.
`MARLHF_EDU_FP32_PRODUCTS=1` treats bf16 and fp16 as slow everywhere, `=0` turns it off.

Taught in chapter 15.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: the dtypes whose products may lack a native CPU kernel
LOW_PRECISION = (torch.bfloat16, torch.float16)

_active = threading.local()


def native_low_precision_products(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this CPU's PyTorch has oneDNN kernels for `dtype` matrix products (bf16: AVX-512 or AMX; fp16:
    AVX512-FP16 or AVX2-VNNI-2). A PyTorch built without oneDNN has none."""
    if dtype not in LOW_PRECISION:
        return True
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        check = (torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16
                 else torch.ops.mkldnn._is_mkldnn_fp16_supported)
        return bool(check())
    except (AttributeError, RuntimeError):  # a build without these private checks: assume the slow path
        return False


def slow_dtypes() -> tuple[torch.dtype, ...]:
    """The low-precision dtypes whose products `Fp32Products` computes in fp32 here: none where the CPU has bf16
    kernels (the recipe's dtype) or the machine has a GPU; else those without kernels.
    `MARLHF_EDU_FP32_PRODUCTS` = 1 (both) / 0 (none) forces the answer."""
    forced = os.environ.get("MARLHF_EDU_FP32_PRODUCTS", "")
    if forced in ("0", "1"):
        return LOW_PRECISION if forced == "1" else ()
    if torch.cuda.is_available() or native_low_precision_products(torch.bfloat16):
        return ()
    return tuple(d for d in LOW_PRECISION if not native_low_precision_products(d))


def needs_fp32_products() -> bool:
    """True when the mode is on here (`slow_dtypes()` is not empty)."""
    return bool(slow_dtypes())


class Fp32Products(TorchDispatchMode):
    """Computes CPU `mm` / `addmm` / `bmm` / `baddbmm` whose tensors are all of one of `dtypes` (bf16 and fp16 by
    default) in fp32 and rounds the result to that dtype. `count` tallies the products it computed (tests read it);
    `entered` says whether `fp32_products_where_needed` pushed it (a `with` block enters it directly)."""

    OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default)

    def __init__(self, dtypes: tuple[torch.dtype, ...] = LOW_PRECISION):
        super().__init__()
        self.dtypes, self.count, self.entered = tuple(dtypes), 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            dtype = tensors[0].dtype
            if dtype in self.dtypes and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors):
                self.count += 1
                up = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
                return func(*up, **kwargs).to(dtype)
        return func(*args, **kwargs)


def holds_slow_tensors(module: torch.nn.Module, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether `module` itself (not its children) has a CPU parameter or buffer of one of `dtypes`."""
    for tensors in (module._parameters, module._buffers):
        for t in tensors.values():
            if t is not None and t.dtype in dtypes and t.device.type == "cpu":
                return True
    return False


def _materialized(module: torch.nn.Module) -> bool:
    """Whether every tensor `module` itself holds has storage (not `meta`: transformers builds models there first)."""
    return not any(t is not None and t.is_meta for tensors in (module._parameters, module._buffers)
                   for t in tensors.values())


class _Watcher:
    """Finds the first module holding a tensor of `dtypes` on the CPU, and enters `mode` then.

    A global forward pre-hook sees every module call, and while any global hook is registered every call of every
    module takes PyTorch's slower path (about 0.08 s of a 1.1 s tiny MA-PPO step, measured with
    `MARLHF_EDU_FP32_PRODUCTS=1`, which takes this path on an AMD EPYC with AVX512-BF16). So the
    hook is armed only while some module remains unchecked: the modules alive at the start, and every module that
    registers a parameter or buffer afterwards (a model being built), are `pending` until checked, at a hook call,
    once their tensors have storage. With none pending the forward hook goes; the registration hooks stay and arm
    it again when the next model is built. Not seen: a module cast in place to a slow dtype after it was checked
    (`.to(torch.bfloat16)`); its products then run PyTorch's own kernels, slower but the same numbers."""

    def __init__(self, mode: Fp32Products, dtypes: tuple[torch.dtype, ...]):
        self.mode, self.dtypes, self.forward_hook = mode, dtypes, None
        # type(), not isinstance: isinstance reads __class__, which some of the heap's proxies warn on
        self.pending = weakref.WeakSet(m for m in gc.get_objects() if issubclass(type(m), torch.nn.Module))
        module_hooks = torch.nn.modules.module
        self.registration_hooks = [module_hooks.register_module_parameter_registration_hook(self.registered),
                                   module_hooks.register_module_buffer_registration_hook(self.registered)]
        self.arm()

    def arm(self) -> None:
        if self.forward_hook is None:
            self.forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(self.check)

    def registered(self, module, name, tensor):
        self.pending.add(module)
        self.arm()

    def check(self, module, args):
        # only from an empty dispatch stack: a mode pushed above another one (a library's) could be popped in its place
        if torch._C._len_torch_dispatch_stack() != 0:
            return
        self.pending.add(module)  # the module being called is checked first
        for m in [module, *self.pending]:
            if not _materialized(m):
                continue
            if holds_slow_tensors(m, self.dtypes):
                self.mode.__enter__()
                self.mode.entered = True
                self.remove()
                return
            self.pending.discard(m)
        if not self.pending:
            self.forward_hook.remove()
            self.forward_hook = None

    def remove(self) -> None:
        for handle in [self.forward_hook, *self.registration_hooks]:
            if handle is not None:
                handle.remove()
        self.forward_hook, self.registration_hooks = None, []


@contextlib.contextmanager
def fp32_products_where_needed():
    """Inside: the CPU products of `slow_dtypes()` in fp32, from the first forward of a module once a module holding
    a tensor of one of them is found (nothing where `slow_dtypes()` is empty, nothing in a run that never holds
    one; `_Watcher` finds it). Nested uses share one mode. Yields the `Fp32Products` mode (its `entered` says
    whether it was entered), or None where it is off."""
    dtypes = slow_dtypes()
    if getattr(_active, "mode", None) is not None or not dtypes:
        yield getattr(_active, "mode", None)
        return
    mode = Fp32Products(dtypes)
    _active.mode = mode
    watcher = _Watcher(mode, dtypes)
    try:
        yield mode
    finally:
        watcher.remove()
        _active.mode = None
        if mode.entered:
            mode.__exit__(None, None, None)
