"""Measuring memory.

`run_isolated` runs one function in a fresh Python process and reports the
growth of the process's peak resident memory during that call: a clean,
allocator-independent reading on CPU, where torch has no memory statistics.

Taught in chapter 02 (log-prob memory); extended for the PPO engines later.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys


def _peak_rss_bytes() -> int:
    """Peak resident memory of this process (Linux's VmHWM; ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _reset_peak() -> None:
    """Hand freed heap pages back to the OS and restart the peak count from the current RSS.

    Without this, memory freed earlier but still resident is silently reused by
    the measured call and its allocations never show up in the peak.
    """
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def logprob_workload(method: str, batch: int, tokens: int, vocab: int) -> int:
    """Allocate (B, T, V) fp32 logits, then return the peak-RSS growth of one log-prob call.

    `method` is "naive" (log_softmax + gather) or "chunked" (`logprobs_from_logits`).
    Meant to run in a fresh process through `run_isolated`.
    """
    import torch

    from marlhf_edu.logprobs import logprobs_from_logits

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, tokens, vocab, generator=gen)
    labels = torch.randint(0, vocab, (batch, tokens), generator=gen)
    # warm the kernels on a small input so one-off allocations do not count
    logprobs_from_logits(logits[:1, :1], labels[:1, :1])
    torch.log_softmax(logits[:1, :1], -1)
    _reset_peak()
    before = _peak_rss_bytes()
    if method == "naive":
        out = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    elif method == "chunked":
        out = logprobs_from_logits(logits, labels)
    else:
        raise ValueError(f"unknown method {method!r}; use 'naive' or 'chunked'")
    del out
    return _peak_rss_bytes() - before


def run_isolated(target: str, **kwargs) -> int:
    """Call `module:function(**kwargs)` in a fresh interpreter and return its (int) result.

    A fresh process matters: peak RSS is a high-water mark, so earlier work in
    the calling process would hide the call's own peak.
    """
    module, func = target.split(":")
    code = (
        "import json, sys, importlib\n"
        f"fn = getattr(importlib.import_module({module!r}), {func!r})\n"
        "print(json.dumps(fn(**json.loads(sys.argv[1]))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run_isolated({target}) failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- what models and optimizers hold ---------------------------------------------------------

def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`: a tensor shared by two modules (a tied
    embedding, one base under several adapters) counts once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not hasattr(t, "untyped_storage"):
            continue
        storage = t.untyped_storage()
        key = (storage.device.type, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _optimizer_tensors(optimizer):
    for state in optimizer.state.values():
        yield from (v for v in state.values() if hasattr(v, "untyped_storage") and v.dim() > 0)


def model_state_bytes(models: dict, optimizer=None) -> dict[str, int]:
    """Measured bytes held by each model (parameters + buffers), gradients and optimizer states.

    `models`: `{name: nn.Module}`. A storage already counted under an earlier
    name is not counted again, so the total is what the process really holds.
    Taught in chapter 08 (four models) and chapter 09 (one base, many adapters).
    """
    out, seen = {}, []
    for name, module in models.items():
        tensors = list(module.parameters()) + list(module.buffers())
        out[name] = storage_bytes(seen + tensors) - storage_bytes(seen)
        seen += tensors
    params = [p for m in models.values() for p in m.parameters()]
    out["gradients"] = storage_bytes(p.grad for p in params if p.grad is not None)
    out["optimizer"] = storage_bytes(_optimizer_tensors(optimizer)) if optimizer is not None else 0
    out["total"] = sum(out.values())
    return out
