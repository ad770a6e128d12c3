"""Reusable host buffers for the steps' token bitmasks, and their copies to the device.

Owners: the engine's ``StructuredOutputs`` (the masks it fills: a sampling step's travel on the
host in the sampling message, a verification's in the verification message, a draft's proposals'
go to the device here) and rank 0's worker's ``RankSampling`` (either message's mask, copied in
and to the device). A fresh
``[64, 4008]`` int32 bitmask per step (a 128k vocabulary) costs page faults and a full write on
every step, and a pageable one would make its copy wait for the work queued before it; instead a
small ring of buffers is allocated once (pinned on CUDA, grown when a step has more rows) and
reused.

A buffer is written only once the device has finished reading it: each copy to the device
records an event on the device's stream, and ``take`` hands a slot's buffer out again only once
that event has completed. With ``SLOTS`` buffers it has, one step after another; where one step
takes more masks than that (speculative decoding masks each draft position) and the copy is
still queued, the slot gets a new buffer instead of waiting, and the old one is kept (retired)
until its copy has completed.

The buffers are written through numpy, on the calling thread: a torch operation on a megabyte
runs as a parallel region of torch's intra-op threads, which right after a fill compete for the
cores with xgrammar's fill threads and can stall for milliseconds.

    take(rows) ──► host view [rows, words], every row allowing every token
         │           (the caller fills the constrained rows)
         ▼
    to_device(view) ──► a new device tensor (CUDA: an asynchronous copy + an event on the slot;
                        elsewhere: a copy, so nothing aliases the ring)
"""
from __future__ import annotations

from typing import Optional

import torch

SLOTS = 4
MIN_ROWS = 64


class BitmaskStaging:
    def __init__(self, words: int, device: torch.device) -> None:
        self.words = words
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        self._buffers: list[Optional[torch.Tensor]] = [None] * SLOTS
        self._copied: list[Optional["torch.cuda.Event"]] = [None] * SLOTS
        self._retired: list[tuple[torch.Tensor, "torch.cuda.Event"]] = []  # still read by a queued copy
        self._next = 0
        self._taken: Optional[int] = None  # the slot of the view handed out last

    def take(self, rows: int, allow_all: bool = True) -> torch.Tensor:
        """A host view of ``rows`` rows, each allowing every token (``allow_all=False``: left as
        they were, for a caller that overwrites every row); valid until ``to_device``."""
        slot = self._next
        self._next = (slot + 1) % SLOTS
        buffer, copied = self._buffers[slot], self._copied[slot]
        if copied is not None and not copied.query():  # the device has not read it yet: not reused
            self._retired.append((buffer, copied))
            buffer = None
        self._copied[slot] = None
        self._retired = [(old, event) for old, event in self._retired if not event.query()]
        if buffer is None or buffer.shape[0] < rows:
            capacity = max(rows, MIN_ROWS, 0 if buffer is None else 2 * buffer.shape[0])
            buffer = torch.empty((capacity, self.words), dtype=torch.int32, pin_memory=self._pinned)
            self._buffers[slot] = buffer
        self._taken = slot
        view = buffer[:rows]
        if allow_all:
            view.numpy().fill(-1)  # (one thread: see the module docstring)
        return view

    def to_device(self, view: torch.Tensor) -> torch.Tensor:
        """The view last handed out by ``take``, as a new tensor on the device."""
        if not self._pinned:
            return torch.from_numpy(view.numpy().copy()).to(self.device)
        device_mask = view.to(self.device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))  # the stream the copy was queued on
        self._copied[self._taken] = copied
        return device_mask
