"""Reusable host buffers for the steps' token bitmasks, and their copies to the device.

Owner: the engine's ``StructuredOutputs``. A fresh ``[64, 4008]`` int32 bitmask per step (a
128k vocabulary) costs page faults and a full write on every step, and a pageable one would
make its copy wait for the work queued before it; instead a small ring of buffers is
allocated once (pinned on CUDA, grown when a step has more rows) and reused.

A buffer is written only once the device has finished reading it: each copy to the device
records an event on the stream, and ``take`` waits for that slot's event before handing the
buffer out again. With ``SLOTS`` buffers in the ring the event is long done by then (a step
and a verification take at most two), so the wait costs nothing.

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
        self._next = 0
        self._taken: Optional[int] = None  # the slot of the view handed out last

    def take(self, rows: int) -> torch.Tensor:
        """A host view of ``rows`` rows, each allowing every token; valid until ``to_device``."""
        slot = self._next
        self._next = (slot + 1) % SLOTS
        copied = self._copied[slot]
        if copied is not None:
            copied.synchronize()  # the device has read this buffer (I2's rule for host buffers)
            self._copied[slot] = None
        buffer = self._buffers[slot]
        if buffer is None or buffer.shape[0] < rows:
            capacity = max(rows, MIN_ROWS, 0 if buffer is None else 2 * buffer.shape[0])
            buffer = torch.empty((capacity, self.words), dtype=torch.int32, pin_memory=self._pinned)
            self._buffers[slot] = buffer
        self._taken = slot
        view = buffer[:rows]
        view.fill_(-1)
        return view

    def to_device(self, view: torch.Tensor) -> torch.Tensor:
        """The view last handed out by ``take``, as a new tensor on the device."""
        if not self._pinned:
            return view.to(self.device, copy=True)
        device_mask = view.to(self.device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._copied[self._taken] = copied
        return device_mask
