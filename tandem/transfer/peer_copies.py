"""The NCCL backend's data plane between GPUs: peer copies into the reader's memory, opened in
the writer's process over CUDA IPC (``peer_memory.py``).

A write is one ``copy_`` per merged run (a page-major write: a run per state group, and the
metadata row on the last) from the writer's registered memory into the reader's, on the pair's
own stream (never behind the engine's forward passes: the sources are final when the write is
posted, ``connector.py``; a metadata row staged on its rows' own stream is waited for there,
``WriteHandle.ready``), then a CUDA event. The copy engines move the bytes over NVLink at a
device copy's rate. When the event completes the bytes have landed: the write is DONE, and one
control frame tells the reader the notification (``LANDED`` + its bytes; a write without a
notification sends nothing). There is no receive to post and no acknowledgement to wait for.
Both ends run in the engine's own thread, once the pair formed: ``write`` posts the copies, and
the poll of a write that finds its event complete sends the frame (``nccl_links.WriterLink``:
``post``, ``advance``), so no other thread stands between a write and its bytes or its
notification. The link's thread waits on the same event meanwhile (outside the interpreter) and
completes the write itself if the engine's thread is busy when it lands.

Pairing (the control connection, after the token check of ``pair_group.py``)::

    writer                                           reader
    ASK_COPIES + its process id ----------------->   offer_regions
    open_peer_memory, warm-up read  <-------------   PeerOffer (handles, or why not)
    CHOOSE_COPIES (or CHOOSE_NCCL) -------------->   no data group (or form the NCCL group)

Owner: the writer link (``nccl_links.WriterLink``), which uses a ``PeerCopies`` only under its
lock (from the caller's thread; from its own while posting writes queued before the pair
formed) and whose thread releases it when the link ends.
"""
from __future__ import annotations

import select
import socket
import time
from contextlib import ExitStack
from typing import Any

import torch

from tandem.transfer.byte_views import RegionViews
from tandem.transfer.peer_memory import PeerMemory, PeerOffer, open_peer_memory

# a queued write (``nccl_links.PendingSend``: descriptors, notification, timings, event); not
# imported, so that this module stays below the links that use it
QueuedWrite = Any

ASK_COPIES = b"tandem-copies?"  # writer -> reader at pairing, followed by the writer's process id
CHOOSE_COPIES = b"tandem-copies"  # writer -> reader: the pair moves bytes by peer copies
CHOOSE_NCCL = b"tandem-nccl"  # writer -> reader: the pair moves bytes by NCCL send/receive
LANDED = b"L"  # writer -> reader, after a write's bytes landed: LANDED + the notification
POLL_SECONDS = 20e-6


class PeerCopies:
    """One writer link's copies into its reader's memory (see the module docstring)."""

    def __init__(self, memory: PeerMemory, device: int, timeout: float) -> None:
        self.memory, self.device, self.timeout = memory, device, timeout
        self.stream = torch.cuda.Stream(device=device)  # the copies run on the writer's GPU, from here
        # in the reader's own process its memory is on its device: torch orders a copy between
        # devices after the target device's current stream too, here one of the link's own
        self.target_stream = torch.cuda.Stream(device=memory.device) if memory.device != device else None

    @classmethod
    def open(cls, offer: PeerOffer, device: int, timeout: float) -> "PeerCopies":
        """Open the offered memory and read a few bytes of it (peer access is set up now, not in
        the first write); RuntimeError saying why not."""
        memory = open_peer_memory(offer, device)
        try:
            copies = cls(memory, device, timeout)
            copies.warm_up()
        except Exception as error:
            memory.release()
            raise RuntimeError(f"a first copy from the reader's memory failed: {type(error).__name__}: {error}") \
                from error
        return copies

    def streams(self):
        """The pair's stream current (and, in the reader's own process, the link's stream of the
        reader's device: see ``__init__``)."""
        if self.target_stream is None:
            return torch.cuda.stream(self.stream)
        stack = ExitStack()
        stack.enter_context(torch.cuda.stream(self.stream))
        stack.enter_context(torch.cuda.stream(self.target_stream))
        return stack

    def warm_up(self) -> None:
        regions = self.memory.views.regions
        if not regions:
            return
        probe = torch.empty(8, dtype=torch.uint8, device=f"cuda:{self.device}")
        with self.streams():
            count = min(8, regions[0].length)
            probe[:count].copy_(self.memory.view(regions[0].address, count), non_blocking=True)
        self.stream.synchronize()

    def start(self, item: QueuedWrite, sources: RegionViews, connection: socket.socket) -> None:
        """Post ``item``'s copies and its event. Raises (nothing posted) when the reader closed
        the pair or a run lies outside the memory either side registered."""
        item.timings["taken"] = item.timings["header"] = time.perf_counter()
        ensure_open(connection)
        # every run's views first: one outside either side's memory raises before anything is copied
        runs = [(self.memory.view(destination, length), sources.view(source, length))
                for source, destination, length in item.descriptors]
        if item.ready is not None:  # (a source staged on a stream of its own: the metadata row)
            self.stream.wait_event(item.ready)
        with self.streams():
            for target, source in runs:
                target.copy_(source, non_blocking=True)
        item.event = torch.cuda.Event(blocking=True)  # (the link's thread sleeps on it: ``WriterLink.watch``)
        item.event.record(self.stream)
        item.timings["posted"] = time.perf_counter()

    def landed(self, item: QueuedWrite) -> bool:
        """Whether ``item``'s copies completed; TimeoutError once they took over ``timeout``."""
        if item.event.query():
            item.timings["drained"] = time.perf_counter()
            return True
        if time.perf_counter() - item.timings["posted"] > self.timeout:
            raise TimeoutError(f"transfer (nccl): peer copies took over {self.timeout:g} s")
        return False

    def quiesce(self) -> bool:
        """Wait (at most ``timeout``) for every copy posted so far; False if they did not finish."""
        event = torch.cuda.Event()
        event.record(self.stream)
        started = time.perf_counter()
        while not event.query():
            if time.perf_counter() - started > self.timeout:
                return False
            time.sleep(POLL_SECONDS)
        return True

    def release(self) -> None:
        """Drop the mapping, once no copy into it can still run (if one never finishes, the
        mapping is kept: memory that is still being written stays mapped)."""
        if self.quiesce():
            self.memory.release()


def ensure_open(connection: socket.socket) -> None:
    """ConnectionResetError when the reader closed the control connection (it never sends
    anything on a pair with peer copies, so anything readable is its end)."""
    readable, _, _ = select.select([connection], [], [], 0)
    if not readable:
        return
    try:
        data = connection.recv(1, socket.MSG_PEEK)
    except OSError as error:
        raise ConnectionResetError(f"the reader's connection failed: {error}") from None
    if not data:
        raise ConnectionResetError("the reader closed the pair")
    raise RuntimeError("transfer (nccl): unexpected data from the reader of a pair with peer copies")


def landed_frame(notification: bytes) -> bytes:
    return LANDED + notification


def notification_of(frame: bytes) -> bytes:
    """The notification a LANDED frame carries (RuntimeError for anything else)."""
    if not frame.startswith(LANDED):
        raise RuntimeError("transfer (nccl): malformed control frame on a pair with peer copies")
    return frame[len(LANDED):]
