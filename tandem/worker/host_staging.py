"""Host-to-device copies that never wait for the device.

A copy from ordinary (pageable) host memory cannot start before the work already queued on the
stream has finished, so the host would stall behind the step in flight: every per-step input
goes through pinned memory instead. PyTorch's caching host allocator keeps a pinned block from
being reused until the copies that read it have run.
"""
from __future__ import annotations

import numpy as np
import torch


def _pinned_copy(values, dtype: torch.dtype | None) -> torch.Tensor:
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.as_tensor(values, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a numpy array, a list or a CPU tensor) as a new tensor on ``device``."""
    device = torch.device(device)
    if device.type != "cuda":
        host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.as_tensor(values, dtype=dtype)
        return host.to(device=device, dtype=dtype or host.dtype)
    return _pinned_copy(values, dtype).to(device, non_blocking=True)


def copy_to_device(target: torch.Tensor, values) -> None:
    """Copy ``values`` into the device tensor ``target`` (same shape), queued on the stream."""
    if target.device.type != "cuda":
        target.copy_(torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.as_tensor(values))
        return
    target.copy_(_pinned_copy(values, target.dtype), non_blocking=True)
