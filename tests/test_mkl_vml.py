"""`loading.mkl_vml`: every VML function ATen uses is called once, on one thread, when the package is imported.

The race it prevents (oneMKL choosing a VML function's kernel at its first call, wrongly for one thread when that
call runs on several at once) cannot be made to happen on demand: outside the engine it showed in 1 of 40 fresh
processes for `torch.sin` of 512 × 512 on 2 threads and in none of 30 for a cos shaped like RoPE's (diagnostic
runs on the Intel Xeon of the module's measurement, no record kept). What is checked is what the fix consists of:
each function called on a one-element tensor (one chunk: one thread) in fp32 and fp64, inside its domain, by
`import marlhf_edu`, once a process, and not at all when switched off for a control.
"""

import os
import subprocess
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from marlhf_edu.loading import mkl_vml


class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in mkl_vml.VML_FUNCTIONS:
            self.calls.append((name, args[0].numel(), args[0].dtype, bool(torch.isfinite(out).all())))
        return out


def test_every_function_is_called_once_per_precision_on_one_element_inside_its_domain(monkeypatch):
    monkeypatch.setattr(mkl_vml, "_resolved", False)
    monkeypatch.delenv("MARLHF_EDU_VML_WARMUP", raising=False)
    with _Calls() as mode:
        assert mkl_vml.resolve_vml_dispatch() is True
    seen = {(name, dtype) for name, _, dtype, _ in mode.calls}
    assert seen == {(name, dtype) for name in mkl_vml.VML_FUNCTIONS for dtype in (torch.float32, torch.float64)}
    assert len(mode.calls) == len(seen)
    # one element: ATen's VML kernels split a tensor into chunks of 2,048 across threads; one chunk runs here alone
    assert all(numel == 1 for _, numel, _, _ in mode.calls)
    bad = [name for name, _, _, finite in mode.calls if not finite]
    assert not bad, f"called outside their domain (a NaN or inf result): {bad}"
    # the functions ATen 2.x's aten/src/ATen/cpu/vml.h sends to MKL are all in the list
    assert {"acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt", "tan",
            "tanh", "trunc"} <= set(mkl_vml.VML_FUNCTIONS)


def test_it_runs_once_a_process(monkeypatch):
    monkeypatch.setattr(mkl_vml, "_resolved", False)
    monkeypatch.delenv("MARLHF_EDU_VML_WARMUP", raising=False)
    assert mkl_vml.resolve_vml_dispatch() is True
    with _Calls() as mode:
        assert mkl_vml.resolve_vml_dispatch() is False
    assert mode.calls == []


def test_switched_off_it_calls_nothing(monkeypatch):
    monkeypatch.setattr(mkl_vml, "_resolved", False)
    monkeypatch.setenv("MARLHF_EDU_VML_WARMUP", "0")
    with _Calls() as mode:
        assert mkl_vml.resolve_vml_dispatch() is False
    assert mode.calls == [] and mkl_vml._resolved is False


@pytest.mark.slow
def test_importing_the_package_resolves_them():
    """In a fresh process, `import marlhf_edu` alone has run it (the package's own modules only define functions
    at import; the first computation comes after)."""
    probe = "import sys, marlhf_edu\nprint(sys.modules['marlhf_edu.loading.mkl_vml']._resolved)"
    env = {k: v for k, v in os.environ.items() if k != "MARLHF_EDU_VML_WARMUP"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env=env).stdout.strip()
    assert out == "True"
