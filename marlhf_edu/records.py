"""What a measurement writes beside its numbers: the machine it ran on and the JSON record itself.

The scripts in `tools/` that make the records in `benchmarks/` import these, so every record names its machine
the same way: `machine()` (a dict, stored under `machine`), `measured_on()` (one line, stored under
`measured_on`), `cpu_name()`, `cpu_kind(cpuinfo)` (the name records are filed under), `cpu_features(cpuinfo)`
(the vector flags and reported clock `machine()` adds) and `write_result(out, summary)`. torch is imported inside `machine()`, so importing
this module loads nothing heavy.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform

from marlhf_edu.loading.device import cpu_name

__all__ = ["VECTOR_FLAGS", "cpu_features", "cpu_kind", "cpu_name", "machine", "measured_on", "write_result"]

#: the `/proc/cpuinfo` flags that decide which kernels PyTorch, oneDNN and MKL may pick on an x86 CPU
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                "amx_int8")


def cpu_features(cpuinfo: str) -> dict:
    """`{"cpu_flags": [...], "cpu_mhz_reported": float | None}` of a `/proc/cpuinfo` text: which of `VECTOR_FLAGS`
    its first CPU lists, and the clock the kernel reports for it (a virtual machine's nominal rate, not a measured
    one). Two machines of one `cpu_kind` can differ in both."""
    flags, mhz = None, None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and flags is None:
            listed = set(value.split())
            flags = [f for f in VECTOR_FLAGS if f in listed]
        elif key.strip() == "cpu MHz" and mhz is None:
            mhz = float(value)
    return {"cpu_flags": flags or [], "cpu_mhz_reported": mhz}


def machine() -> dict:
    """This machine as a record stores it: CPU count, torch's thread count and version, Python's version, the
    processor as `platform` names it, the first GPU's name (None without one) and, where `/proc/cpuinfo` exists,
    the CPU's vector flags and reported clock (`cpu_features`)."""
    import torch

    here = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "processor": platform.processor() or platform.machine(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        here.update(cpu_features(pathlib.Path("/proc/cpuinfo").read_text()))
    except (OSError, ValueError):  # no /proc/cpuinfo (macOS), or a clock line that is not a number
        pass
    return here


def measured_on() -> str:
    """One line for a record's `measured_on`: the CPU's name, torch's thread count and torch's version."""
    here = machine()
    return f"{cpu_name()}, {here['torch_threads']} threads, torch {here['torch']}"


def write_result(out: pathlib.Path | None, summary: dict) -> None:
    """`summary` as indented JSON in `out` (its folder made), if `out` is given."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1) + "\n")


def cpu_kind(cpuinfo: str) -> str:
    """`<vendor>_<widest vector set>` of a `/proc/cpuinfo` text, e.g. `amd_epyc_avx512bf16`, `intel_xeon_avx2`."""
    name, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not name:
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    if not flags:
        raise ValueError("cpu_kind: no 'flags' line in the CPU description (is this /proc/cpuinfo of an x86 CPU?)")
    lowered = name.lower()
    vendor = ("amd_epyc" if "epyc" in lowered else "intel_xeon" if "xeon" in lowered else
              "_".join("".join(c if c.isalnum() else " " for c in lowered).split()[:2]) or "cpu")
    widest = ("avx512bf16" if "avx512_bf16" in flags else "avx512" if "avx512f" in flags else
              "avx2" if "avx2" in flags else "sse")
    return f"{vendor}_{widest}"
