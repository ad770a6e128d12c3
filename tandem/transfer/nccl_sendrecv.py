"""The NCCL backend's data plane on NCCL send/receive (gloo in host memory): how one write's runs
move between a pair's two ranks. ``plan_segments`` (``byte_views.py``) splits the runs into
segments: long runs are sent in place, short ones gathered into a staging area (writer) and
scattered from it (reader). A write whose staged segments fit the area at once goes as one batch
(one NCCL group between GPUs); longer ones are pipelined through ``STAGING_SLOTS`` slots, the
gather (scatter) of one segment on a copy stream beside the send (receive) of another.

Owner: a link (``nccl_links.py``) of a pair that formed a data group, from its own thread only.
Between GPUs where the reader's memory opened, peer copies move the bytes instead
(``peer_copies.py``).
"""
from __future__ import annotations

import os
import time
from contextlib import nullcontext

import torch

from tandem.transfer.byte_views import plan_segments
from tandem.transfer.pair_group import timedelta

STAGING_SLOTS = 3  # staged segments in flight at once per pair (the staging area holds this many)
STAGING_ALIGNMENT = 256
DRAIN_POLL_SECONDS = 20e-6
DRAIN_SPIN_SECONDS = 2e-3


class SendReceive:
    """One side of a pair's data group: its streams (on a GPU), staging area and the time its
    last write's operations were all posted (``posted_at``, diagnostics)."""

    def __init__(self, group, device: int, timeout: float, peer: str) -> None:
        self.group, self.device, self.timeout, self.peer = group, device, timeout, peer
        self.staging = None
        on_device = device >= 0
        self.stream = torch.cuda.Stream(device=device) if on_device else None  # where sends and receives are posted
        # where staged segments are gathered (writer) or scattered (reader), beside the sends
        self.copy_stream = torch.cuda.Stream(device=device) if on_device else None
        self.posted_at = 0.0

    def stream_context(self):
        """On a GPU, the link's stream current (sends and receives are posted from it)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def copy_context(self):
        """On a GPU, the copy stream (it runs beside the link's stream: the gather of segment
        i + 1 overlaps the send of segment i, the scatter of segment i the receive of i + 1)."""
        return torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else nullcontext()

    def record(self):
        """A CUDA event at the current end of the current stream (None in host memory)."""
        if self.device < 0:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def after_event(self, event) -> None:
        """The current stream waits for ``event`` (nothing in host memory, where work is done when
        it returns)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def staging_slice(self, offset: int, num_bytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Bytes ``offset`` .. ``offset + num_bytes`` of this pair's staging area."""
        return self.staging[offset:offset + num_bytes].view(dtype)

    def ensure_staging(self, num_bytes: int) -> None:
        """A staging area of at least ``num_bytes`` (grown only between writes, when nothing
        staged is in flight)."""
        if self.staging is None or self.staging.numel() < num_bytes:
            device = "cpu" if self.device < 0 else f"cuda:{self.device}"
            self.staging = None
            self.staging = torch.empty(num_bytes, dtype=torch.uint8, device=device)

    def wait(self, work) -> None:
        """Order what follows after ``work``: on a GPU the current stream waits for it (the host
        does not); in host memory the thread waits, at most ``timeout``. Once per work: a second
        wait on a gloo work waits for another operation."""
        if self.device >= 0:
            work.wait()
        else:
            work.wait(timedelta(seconds=self.timeout))

    def drain(self, works: list) -> None:
        """Return once every operation in ``works`` (and everything on the link's and the copy
        stream) is done; TimeoutError after ``timeout``."""
        for work in works:
            self.wait(work)
        events = []
        for stream in (self.stream, self.copy_stream):
            if stream is not None:
                events.append(torch.cuda.Event())
                events[-1].record(stream)
        started = time.monotonic()
        while not all(event.query() for event in events):
            waited = time.monotonic() - started
            if waited > self.timeout:
                raise TimeoutError(f"transfer (nccl): a write to or from {self.peer} took over "
                                   f"{self.timeout:g} s")
            # a write of a few hundred MiB drains within a millisecond or two: yield only (a sleep
            # would oversleep by tens of microseconds each time), then sleep between checks
            time.sleep(0 if waited < DRAIN_SPIN_SECONDS else DRAIN_POLL_SECONDS)

    def move(self, lengths: list[int], dtype: torch.dtype, direct_bytes: int, staging_bytes: int, operation,
             tensor_of, after=None) -> None:
        """Send (writer) or receive (reader) one write's runs as ``plan_segments`` splits them
        (``operation`` posts one tensor's send or receive). ``tensor_of(segment, staging)`` gives
        a segment's tensor: a direct segment's (``staging`` None), or a staged one's gathered
        into ``staging`` (writer) or ``staging`` itself (reader), whose ``after(segment,
        staging)`` scatters it. A write whose staged segments all fit the staging area at once
        (every page-major write: its runs are few and sent in place) goes as one batch
        (``move_batch``); longer ones pipelined through the slots (``move_pipelined``)."""
        slot_bytes = -(-staging_bytes // STAGING_ALIGNMENT) * STAGING_ALIGNMENT
        segments = plan_segments(lengths, direct_bytes, staging_bytes)
        staged = [segment for segment in segments if not segment.direct]
        if staged or not lengths:
            self.ensure_staging(max(STAGING_SLOTS * slot_bytes, STAGING_ALIGNMENT))
        if after is None and self.device >= 0:  # (writer) slots are refilled only after the last write's sends
            with self.copy_context():
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if not lengths:  # the warm-up write: one element
            works = [operation([self.staging_slice(0, 8, torch.int64)[:1]])]
            self.posted_at = time.perf_counter()
            self.finish(works, after is None)
        elif len(staged) <= STAGING_SLOTS:
            self.move_batch(segments, dtype, slot_bytes, operation, tensor_of, after)
        else:
            self.move_pipelined(segments, dtype, slot_bytes, operation, tensor_of, after)

    def move_batch(self, segments, dtype: torch.dtype, slot_bytes: int, operation, tensor_of, after) -> None:
        """Every segment at once: the staged ones (at most STAGING_SLOTS) each in a slot of its
        own, gathered before anything is sent (writer) or scattered once everything arrived
        (reader); all sends (receives) posted together, as one group of point-to-point operations
        between GPUs (``post_all``). A page-major write is one run per state group, plus the
        metadata row on the last write: one batch of as many sends."""
        slots, tensors = {}, []
        for segment in segments:
            if not segment.direct:
                slots[segment] = self.staging_slice(len(slots) * slot_bytes, segment.num_bytes, dtype)
        if after is None:  # writer: gather on the copy stream, then send from the link's stream
            with self.copy_context():
                tensors = [tensor_of(segment, slots.get(segment)) for segment in segments]
                gathered = self.record() if slots else None
            self.after_event(gathered)
        else:
            tensors = [tensor_of(segment, slots.get(segment)) for segment in segments]
        works = self.post_all(operation, tensors)
        if after is not None and slots:  # reader: scatter once every receive is done
            for work in works:
                self.wait(work)
            works = []
            for segment, staging in slots.items():
                after(segment, staging)
        self.posted_at = time.perf_counter()
        self.finish(works, after is None)

    def post_all(self, operation, tensors: list[torch.Tensor]) -> list:
        """Post one send (receive) per tensor: between GPUs as one NCCL group (one launch; the
        operations share the link's channels), else one by one. ``TANDEM_NCCL_COALESCE=0``
        posts them one by one between GPUs too (for measuring)."""
        if (self.device >= 0 and len(tensors) > 1 and os.environ.get("TANDEM_NCCL_COALESCE", "1") != "0"
                and hasattr(self.group, "_start_coalescing")):
            self.group._start_coalescing()
            for tensor in tensors:
                operation([tensor])
            return [self.group._end_coalescing()]
        return [operation([tensor]) for tensor in tensors]

    def move_pipelined(self, segments, dtype: torch.dtype, slot_bytes: int, operation, tensor_of, after) -> None:
        """Post every segment's send or receive without waiting for the one before, so they
        queue back to back on the link. Staged segments take turns in the STAGING_SLOTS slots
        of the staging area, pipelined: the writer gathers a segment into its slot on the copy
        stream and sends it from the link's stream; the reader receives into the slot and
        scatters it on the copy stream. A slot is refilled once what last used it finished: on
        a GPU by stream-side waits only (the host waits once, at the end); in host memory by
        the thread."""
        works = []
        in_use = [None] * STAGING_SLOTS  # per slot: the send (writer) or scatter event (reader) that last used it
        slot = 0
        for segment in segments:
            if segment.direct:
                works.append(operation([tensor_of(segment, None)]))
                continue
            staging = self.staging_slice(slot * slot_bytes, segment.num_bytes, dtype)
            previous, in_use[slot] = in_use[slot], None
            if after is None:  # writer: gather on the copy stream once the slot's last send is done, then send
                with self.copy_context():
                    if previous is not None:  # (waited for once only: a gloo work's wait is not idempotent)
                        self.wait(previous)
                        works.remove(previous)
                    tensor = tensor_of(segment, staging)
                    gathered = self.record()
                self.after_event(gathered)
                in_use[slot] = operation([tensor])
                works.append(in_use[slot])
            else:  # reader: receive once the slot's last scatter is done, scatter on the copy stream
                self.after_event(previous)
                work = operation([tensor_of(segment, staging)])  # waited for here only (the copy stream)
                with self.copy_context():
                    self.wait(work)
                    after(segment, staging)
                    in_use[slot] = self.record()
            slot = (slot + 1) % STAGING_SLOTS
        self.posted_at = time.perf_counter()
        self.finish(works, after is None)

    def finish(self, works: list, writer: bool) -> None:
        """The end of one side's part of a write. The reader drains (its acknowledgement says the
        bytes landed); so does a writer in host memory (gloo works must be waited for). A writer
        between GPUs does not wait at all: the reader's acknowledgement comes only once every
        receive completed, which every send's bytes must have reached, so the sources were read
        in full by then; its streams stay ordered (the next write's gathers wait on the link's
        stream, ``move``)."""
        if writer and self.device >= 0:
            for work in works:
                self.wait(work)  # (stream-side only: the link's stream, for the next write)
            return
        self.drain(works)
