"""Turns the daemon's device and dtype names into torch objects, and reads free device memory.

The daemon passes strings; this is the one place they become torch values.
"""

from __future__ import annotations

import torch

from prefixd.gpu import kernels

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """("cpu" | "cuda[:N]", "bf16" | "fp32") -> torch values; a clear error for a missing GPU."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    check_device(device)
    return torch.device(device), DTYPES[dtype]


class DeviceError(RuntimeError):
    """The asked-for device is not usable by this torch build or machine; the message says why."""


def check_device(device: str) -> None:
    """Raise DeviceError when `device` ("cpu" | "cuda[:N]") cannot run here; cheap, loads no model."""
    if torch.device(device).type != "cuda":
        return
    if torch.cuda.is_available():
        if not kernels.triton_available():
            # without it a row's bits would depend on the round: refuse rather than be inexact
            raise DeviceError(f"--device {device}: prefixd's row-invariant CUDA kernels need Triton "
                              "(CUDA builds of torch install it; else `pip install triton`)")
        return
    if torch.version.cuda is None:
        raise DeviceError(f"--device {device}: this torch {torch.__version__} is a CPU-only build and sees no CUDA "
                          "device; install a CUDA build (pip install torch --index-url "
                          "https://download.pytorch.org/whl/cu128) or use --device cpu")
    raise DeviceError(f"--device {device}: this CUDA build of torch sees no CUDA device "
                      "(check the driver and CUDA_VISIBLE_DEVICES)")


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device; None for the CPU (the daemon reads /proc/meminfo)."""
    if device.type != "cuda":
        return None
    free_bytes, _total = torch.cuda.mem_get_info(device)
    return int(free_bytes)
