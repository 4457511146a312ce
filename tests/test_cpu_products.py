"""bf16/fp16 matrix products computed in fp32 on CPUs without native kernels (marlhf_edu.loading.cpu_products).

On an AVX2-only CPU PyTorch's bf16 product falls back to a scalar loop for the layout of every linear layer's
backward (about 500x slower than fp32 at 7B widths): CI's 7B-shaped smoke run timed out there. The mode must
compute the same products, forward and backward, and every command and pipeline stage must run inside it.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import yaml

from marlhf_edu.loading import cpu_products
from marlhf_edu.loading.cpu_products import Fp32Products, fp32_products_where_needed, needs_fp32_products


def test_a_bf16_linear_layer_is_computed_in_fp32_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    layer = torch.nn.Linear(64, 96, dtype=torch.bfloat16)
    with Fp32Products() as mode:
        y = layer(x)
        g = torch.randn_like(y)
        y.backward(g)
    # forward, the input's gradient and the weight's gradient: three products, all in fp32
    assert mode.count == 3
    assert y.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.bfloat16
    w, b = layer.weight.float(), layer.bias.float()
    assert torch.equal(y, (x.float().reshape(15, 64) @ w.t() + b).to(torch.bfloat16).reshape(3, 5, 96))
    assert torch.equal(x.grad, (g.float().reshape(15, 96) @ w).to(torch.bfloat16).reshape(3, 5, 64))
    # the weight's gradient, as autograd computes it: grad_output.T @ input, rounded once
    expected = (g.float().reshape(15, 96).t() @ x.detach().float().reshape(15, 64)).to(torch.bfloat16)
    assert torch.equal(layer.weight.grad, expected)


def test_batched_products_and_fp16_are_covered_and_fp32_or_mixed_ones_left_alone():
    a, b = torch.randn(2, 4, 8), torch.randn(2, 8, 3)
    with Fp32Products() as mode:
        half = torch.bmm(a.half(), b.half())
        torch.baddbmm(torch.zeros(2, 4, 3, dtype=torch.bfloat16), a.bfloat16(), b.bfloat16())
        assert mode.count == 2
        torch.bmm(a, b)                                # fp32: nothing to do
        torch.mm(a[0], b[0])
        with pytest.raises(RuntimeError):              # mixed: PyTorch's own error, as without the mode
            torch.mm(a[0].bfloat16(), b[0])
        assert mode.count == 2
    assert half.dtype == torch.float16 and torch.equal(half, torch.bmm(a.half().float(), b.half().float()).half())
    with Fp32Products(dtypes=(torch.float16,)) as mode:  # bf16 has kernels here: left to PyTorch
        torch.mm(a[0].bfloat16(), b[0].bfloat16())
        torch.mm(a[0].half(), b[0].half())
    assert mode.count == 1


def no_kernels_for(*missing):
    return lambda dtype=torch.bfloat16: dtype not in missing


def test_when_it_is_needed(monkeypatch):
    monkeypatch.delenv("MARLHF_EDU_FP32_PRODUCTS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bf16, fp16 = torch.bfloat16, torch.float16
    monkeypatch.setattr(cpu_products, "native_low_precision_products", no_kernels_for(bf16, fp16))  # an AVX2 CPU
    assert cpu_products.slow_dtypes() == (bf16, fp16) and needs_fp32_products()
    monkeypatch.setattr(cpu_products, "native_low_precision_products", no_kernels_for())
    assert cpu_products.slow_dtypes() == () and not needs_fp32_products()
    # an AVX-512 CPU with bf16 kernels but none for fp16: the recipe's bf16 is fast, so the mode stays off
    monkeypatch.setattr(cpu_products, "native_low_precision_products", no_kernels_for(fp16))
    assert not needs_fp32_products()
    monkeypatch.setenv("MARLHF_EDU_FP32_PRODUCTS", "1")
    assert cpu_products.slow_dtypes() == (bf16, fp16)
    monkeypatch.setenv("MARLHF_EDU_FP32_PRODUCTS", "0")
    monkeypatch.setattr(cpu_products, "native_low_precision_products", no_kernels_for(bf16, fp16))
    assert not needs_fp32_products()
    monkeypatch.delenv("MARLHF_EDU_FP32_PRODUCTS")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU run keeps its products on the GPU
    assert not needs_fp32_products()


def test_the_detection_asks_onednn(monkeypatch):
    expected = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert cpu_products.native_low_precision_products(torch.bfloat16) == expected
    assert cpu_products.native_low_precision_products(torch.float32)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)  # a build without oneDNN
    assert not cpu_products.native_low_precision_products(torch.float16)


def test_nested_uses_enter_the_mode_once(monkeypatch):
    monkeypatch.setenv("MARLHF_EDU_FP32_PRODUCTS", "1")
    layer = torch.nn.Linear(2, 2, bias=False, dtype=torch.bfloat16)
    with fp32_products_where_needed() as outer:
        with fp32_products_where_needed() as inner:
            layer(torch.randn(3, 2, dtype=torch.bfloat16))
        assert inner is outer and outer.entered and outer.count == 1
    assert torch._C._len_torch_dispatch_stack() == 0
    monkeypatch.setenv("MARLHF_EDU_FP32_PRODUCTS", "0")
    with fp32_products_where_needed() as mode:
        assert mode is None


def test_every_command_and_every_pipeline_stage_runs_inside_it(monkeypatch, tmp_path):
    from marlhf_edu import cli
    from marlhf_edu.stages import pipeline
    from marlhf_edu.training.pipeline_file import load_pipeline

    monkeypatch.setenv("MARLHF_EDU_FP32_PRODUCTS", "1")
    seen = []

    def record(argv, **kwargs):  # a command: its bf16 layer's product must go through the mode
        torch.nn.Linear(2, 2, bias=False, dtype=torch.bfloat16)(torch.ones(2, 2, dtype=torch.bfloat16))
        seen.append((cpu_products._active.mode, cpu_products._active.mode.count))

    monkeypatch.setitem(sys.modules, "fake_command", types.SimpleNamespace(main=record))
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_command", "a test command"))
    assert cli.main(["fake"]) == 0
    assert isinstance(seen[-1][0], Fp32Products) and seen[-1][1] == 1
    assert cpu_products._active.mode is None  # and left again

    spec = {"stages": {"sft": "configs/tiny_sft.yaml", "rm": "configs/tiny_rm.yaml"},
            "overrides": {n: {"output_dir": str(tmp_path / n)} for n in ("sft", "rm")}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    monkeypatch.setattr(pipeline, "release_memory", lambda: None)
    monkeypatch.setattr(pipeline, "resolve_model", lambda ref: None)
    stages, _ = load_pipeline(str(path), [])
    for stage in stages:
        stage.module = "fake_command"
    seen.clear()
    pipeline.run_pipeline(stages, log=lambda line: None)
    assert len(seen) == 2 and all(isinstance(m, Fp32Products) and count == 1 for m, count in seen)


def test_a_run_without_slow_tensors_never_enters_the_mode(monkeypatch):
    """An fp32 run pays no Python dispatch: its operations never see the mode, however many run."""
    monkeypatch.setenv("MARLHF_EDU_FP32_PRODUCTS", "1")
    stack_seen = []
    layer = torch.nn.Linear(4, 4)
    layer.register_forward_hook(lambda m, a, out: stack_seen.append(torch._C._len_torch_dispatch_stack()))
    with fp32_products_where_needed() as mode:
        for _ in range(3):
            layer(torch.randn(2, 4, requires_grad=True)).sum().backward()
        assert not mode.entered and mode.count == 0 and stack_seen == [0, 0, 0]
        # the first module holding a bf16 tensor enters it, for the rest of the block, backward included
        half = torch.nn.Linear(4, 4, dtype=torch.bfloat16)
        x = torch.randn(2, 4, dtype=torch.bfloat16, requires_grad=True)
        half(x).float().sum().backward()
        assert mode.entered and mode.count == 3  # forward, and the backward's two products (input, weight)
        layer(torch.randn(2, 4))
        assert stack_seen[-1] == 1
    assert torch._C._len_torch_dispatch_stack() == 0


def test_the_watching_hook_goes_once_every_module_is_checked_and_returns_for_a_new_model(monkeypatch):
    """While a global forward hook is registered every module call takes PyTorch's slower path, so an fp32 run
    keeps it only until the modules alive or built so far are checked. A model built later arms it again, and a
    bf16 one is found at the next module call, whichever module runs."""
    monkeypatch.setenv("MARLHF_EDU_FP32_PRODUCTS", "1")
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = len(hooks)
    fp32 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with fp32_products_where_needed() as mode:
        assert len(hooks) == before + 1
        fp32(torch.randn(2, 4))
        assert len(hooks) == before and not mode.entered  # all checked: the hook went
        for _ in range(50):
            fp32(torch.randn(2, 4))
        assert len(hooks) == before and not mode.entered
        fp32.append(torch.nn.Linear(4, 4))  # an fp32 module built: the hook is back until it is checked
        assert len(hooks) == before + 1
        fp32(torch.randn(2, 4))
        assert len(hooks) == before and not mode.entered
        half = torch.nn.Linear(4, 4, dtype=torch.bfloat16)  # a bf16 one: found at the next call of any module
        assert len(hooks) == before + 1
        fp32(torch.randn(2, 4))
        assert mode.entered and len(hooks) == before
        half(torch.randn(2, 4, dtype=torch.bfloat16))
        assert mode.count == 1
    assert len(hooks) == before and torch._C._len_torch_dispatch_stack() == 0


def test_the_mode_is_not_pushed_above_another_dispatch_mode(monkeypatch):
    """Pushed above a library's own mode it could be popped in that mode's place; it waits for an empty stack."""
    monkeypatch.setenv("MARLHF_EDU_FP32_PRODUCTS", "1")

    class Other(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    half = torch.nn.Linear(2, 2, bias=False, dtype=torch.bfloat16)
    with fp32_products_where_needed() as mode:
        with Other():
            half(torch.ones(1, 2, dtype=torch.bfloat16))
        assert not mode.entered
        half(torch.ones(1, 2, dtype=torch.bfloat16))
        assert mode.entered and mode.count == 1


@pytest.mark.skipif(not needs_fp32_products(), reason="this CPU has native bf16 kernels: nothing to speed up")
def test_it_makes_a_7b_wide_backward_fast_here():
    """Where it is needed, the backward of a 4096 → 11008 bf16 layer (the 7B MLP) takes well under a second per
    product; PyTorch's own fallback took about 40 s per product on a 2-core AMD EPYC."""
    import time

    x = torch.randn(128, 4096, dtype=torch.bfloat16, requires_grad=True)
    layer = torch.nn.Linear(4096, 11008, bias=False, dtype=torch.bfloat16)
    with fp32_products_where_needed() as mode:
        start = time.perf_counter()
        layer(x).float().square().sum().backward()
        seconds = time.perf_counter() - start
    assert mode.count == 3 and seconds < 15, seconds
