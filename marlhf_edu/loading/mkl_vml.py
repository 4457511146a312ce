"""MKL's vector math functions resolved on one thread, before any parallel call.

On an x86 CPU build of torch, ATen computes fp32 and fp64 cos, sin, exp, log, sqrt, tanh, erf and a few more unary
functions with oneMKL's vector math library (VML), each intra-op thread calling it on its chunk of the tensor
with high accuracy requested. oneMKL picks each VML function's kernel (instruction set and accuracy) lazily, at
that function's first call. When the first call runs on several threads at once, one thread can run a
low-accuracy kernel on its whole chunk of that one call; the next call is correct (pytorch/pytorch#188792,
reported on oneMKL 2024.2, the version torch 2.13.0's CPU wheel bundles: Build 20240605).

In this engine (`configs/smollm2/ma_ppo.yaml`, 2 threads, a 2-core Intel Xeon with AVX512-BF16, torch 2.13.0+cpu)
the first such call is RoPE's cos in the first rollout's prefill. In diagnostic runs (no record kept): a first
`generate` of 8 of its prompts computed that cos (8 × 62 positions × 64 columns, 32 frequencies twice) with errors
up to 1.5e-4 in one thread's half of the rows (at most 6e-8 from the fp64 value otherwise, and in every later
call) in 6 of 12 fresh processes with the warm-up below off, in none of 10 with it on; in a first rollout of the
config (16 prompts) one thread's 8 rows of recorded log-probs differed from a repeat's by up to 1.4e-3. The tokens
drawn were the same, the log-probs the sampler recorded were not, and from there the runs of one seed drift apart.
`python tools/replay_check.py --control` (`benchmarks/replay_smollm2_intel_xeon_avx512bf16.json`) measures the
runs themselves.

`resolve_vml_dispatch` calls each of these functions once on a one-element tensor per precision, on the
calling thread alone (ATen hands a tensor of fewer than 2,048 elements to one thread), so that every later,
parallel call finds its kernel chosen: the fix proposed upstream (a one-element call per function and precision,
pytorch/pytorch#188791). It took 2-3 ms in a fresh process on that Xeon (three tries, no record kept) and
changes no result but the raced ones. `import marlhf_edu` calls it, before any of the package's own computation;
a process that computed such a function in parallel before that import may have raced on that call only.
`MARLHF_EDU_VML_WARMUP=0` in the environment skips it: the control of `tools/replay_check.py --control`.
"""

from __future__ import annotations

import os

import torch

#: Unary functions ATen may hand to VML: a superset of those its vml.h sends there (acos, asin, atan, cos, erf,
#: erfc, erfinv, exp, log, log10, log2, sin, sqrt, tan, tanh, trunc), since the list changes between versions; a
#: function computed another way is called for nothing.
VML_FUNCTIONS = ("abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "erf", "erfc", "erfinv",
                 "exp", "exp2", "expm1", "lgamma", "log", "log10", "log1p", "log2", "reciprocal", "rsqrt", "sigmoid",
                 "sin", "sinh", "sqrt", "tan", "tanh", "trunc")

_resolved = False


def resolve_vml_dispatch() -> bool:
    """Call every function of `VML_FUNCTIONS` once on a one-element fp32 and fp64 CPU tensor (an argument inside
    every function's domain), on this thread only. Returns False when it had already run in this process (or is
    switched off by `MARLHF_EDU_VML_WARMUP=0`)."""
    global _resolved
    if _resolved or os.environ.get("MARLHF_EDU_VML_WARMUP", "") == "0":
        return False
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 1.5, dtype=dtype)  # inside every domain but those of acos, asin, atanh and erfinv
        for name in VML_FUNCTIONS:  # (|x| < 1: they take 0.5), acosh's (x ≥ 1) included
            getattr(torch, name)(x if name not in ("acos", "asin", "atanh", "erfinv") else x - 1.0)
    _resolved = True
    return True
