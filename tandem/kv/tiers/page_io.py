"""Low-level file I/O of the disk tier's page files: exact reads and writes, the payload check,
and the rejection record (one reason and its detail) the store counts and logs."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rejected:
    reason: str
    detail: str


def check_payload_tensor(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.device.type != "cpu" \
            or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous uint8 CPU tensor")


def read_exact(f, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def readinto_exact(f, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def write_all(f, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = f.write(view)
        view = view[n:]
