"""The control group's primitives beyond broadcast: every rank's bytes, in rank order, and the
smallest of every rank's number.

Used at start-up (the peer all-reduce's agreement, the page counts, the graph captures' agreements)
and by the ranks' answers to ``collective_rpc``; below ``group.py`` and ``allreduce.py`` so neither
imports the other for it.
"""
from __future__ import annotations

import torch


def smallest(control, value: int) -> int:
    """The smallest ``value`` of any rank (every rank calls it at the same point)."""
    import torch.distributed as dist

    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    values = torch.tensor([value], dtype=torch.int64)
    control.allreduce([values], options).wait()
    return int(values.item())


def exchange(control, payload: bytes) -> list[bytes]:
    """Every rank's ``payload``, in rank order (an all-gather over the control group)."""
    size = control.size()
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    control.allgather([lengths], [torch.tensor([len(payload)], dtype=torch.int64)]).wait()
    counts = [int(length.item()) for length in lengths]
    longest = max(1, max(counts))
    buffer = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        buffer[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    control.allgather([parts], [buffer]).wait()
    return [part[:count].numpy().tobytes() for part, count in zip(parts, counts)]
