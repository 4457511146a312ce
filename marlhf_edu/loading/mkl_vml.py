"""MKL's vector math functions resolved on one thread, before any parallel call.

On an x86 CPU build of torch, ATen computes a contiguous fp32 or fp64 unary function (cos, sin, exp, log, sqrt,
tanh, erf, ...) with oneMKL's vector math library (VML), each intra-op thread calling it on its chunk of the tensor
with high accuracy requested. oneMKL picks each VML function's kernel (instruction set and accuracy) lazily, at
that function's first call. When the first call runs on several threads at once, one thread can run a
low-accuracy kernel on its whole chunk of that one call; the next call is correct (pytorch/pytorch#188792, open;
in that report oneMKL 2025.0 and later did not show it; torch 2.13.0's CPU wheel does, below).

Seen in this engine (`configs/smollm2/ma_ppo.yaml`, 2 threads, a 2-core Intel Xeon with AVX512-BF16, torch
2.13.0+cpu): the first forward of a fresh process, the first rollout's prefill, computed RoPE's cos of 8 prompts ×
62 positions × 64 frequencies with errors up to 1.5e-4 in one thread's half of the rows (at most 6e-8 from the
fp64 value otherwise, and in every later call), in 6 of 12 diagnostic runs (none of 10 with the fix; not stored).
The tokens drawn were the same, the log-probs the sampler recorded were not, and from there the runs of one seed
drift apart. `python tools/replay_check.py --control` (`benchmarks/replay_smollm2_intel_xeon_avx512bf16.json`):
with the fix, six fresh processes gave the same two step records, the sampler's log-probs 6.3e-6 a token from the
training forward's (`rollout/logprob_gap` at step 1); without it, three gave those records and three others, with
a gap of 9.1e-5.

`resolve_vml_dispatch` calls each of these functions once on a one-element tensor per precision, on the
calling thread alone, so that every later, parallel call finds its kernel chosen: the fix proposed upstream
(a one-element call per function and precision, pytorch/pytorch#188791). It costs well under a millisecond and
changes no result but the raced ones. `import marlhf_edu` calls it, before any of the package's own computation;
a process that computed such a function in parallel before that import may have raced on that call only.
`MARLHF_EDU_VML_WARMUP=0` in the environment skips it: the control of `tools/replay_check.py --control`.
"""

from __future__ import annotations

import os

import torch

#: Unary functions ATen may hand to VML (a superset: a function computed another way is called for nothing).
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
        x = torch.full((1,), 1.5, dtype=dtype)  # in the domain of acosh (≥ 1) and of the rest
        for name in VML_FUNCTIONS:
            getattr(torch, name)(x if name not in ("acos", "asin", "atanh", "erfinv") else x - 1.0)
    _resolved = True
    return True
