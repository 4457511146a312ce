"""The device a command runs on (`resolve_device`: `auto`, `cpu`, `cuda[:N]`, refused before any model is read
when this machine has no such device) and the name of this machine's CPU (`cpu_name`, written into records)."""

from __future__ import annotations

import pathlib

from marlhf_edu.errors import ConfigError


def resolve_device(device: str = "auto") -> str:
    """`'auto'` → `'cuda'` when a GPU is visible, else `'cpu'`; `'cpu'`, `'cuda'`, `'cuda:N'` as given. A CUDA
    device that this machine does not have is refused here, before any model is read."""
    import torch


    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not (device == "cuda" or device.startswith("cuda:")):
        raise ConfigError(f"--device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device is visible to torch here; use --device cpu")
    return device


def cpu_name() -> str:
    """This machine's CPU by its model name (`/proc/cpuinfo`), else as `platform` names the processor."""
    import platform

    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
