"""The NCCL transfer backend: one-sided writes over ``torch.distributed`` point-to-point between
paired engines of one host (NCCL between GPUs; gloo between host memories, so CI runs the same
logic on a CPU).

A write is a send on the writer paired with a receive the reader posts: the reader cannot know
a write is coming, so every write first sends a small header over the pair's control connection
(a TCP socket, ``pair_group.py``) naming the destination runs and the notification; the
reader's thread for that pair waits for the next header, receives the data as the header
describes, queues the notification once the bytes landed and acknowledges. Per pair and side
one thread does all of it, so the engine loop only posts and polls (``WriteHandle``), never
blocks. Pairs form in those threads too; the first write waits for that, and a tiny warm-up
write at pairing sets up the NCCL connection, so the first real write pays no connection setup.

Descriptors are merged where they continue on both sides (``merge_adjacent``), then sent as
``byte_views.plan_segments`` says: runs of at least ``direct_bytes`` in place, shorter ones
gathered into a staging buffer (``torch._foreach_copy_``: a few kernels for many runs), sent as
one message, and scattered on the reader. Source pages are read on a side stream after the
engine's stream reached the point where the write was posted (a CUDA event).

Wire format of one write, in order::

    control  frame   MAGIC, number of runs n, notification length k, element size, the writer's
                     direct_bytes and staging_bytes (int64 each: the reader plans the same segments);
                     n destination addresses, n lengths (int64); the notification (k bytes)
    data     one tensor per segment (n = 0: one warm-up element)
    control  frame   reader -> writer: "landed" (the write is DONE only then)

Failure: a send or receive that raises fails its write (ERROR) and every later write on the
pair (the pair is torn down; the reader's thread ends). A peer that is gone shows as the end of
the control stream, so the write fails at once instead of hanging; a data operation that never
completes fails after ``timeout``.
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional

import msgspec
import numpy as np
import torch

from tandem.transfer.byte_views import DIRECT_BYTES, STAGING_BYTES, RegionViews, pack, plan_segments, unpack, \
    widest_element
from tandem.transfer.connector import TransferBackend, WriteHandle, WriteStatus
from tandem.transfer.descriptors import MemoryRegion, merge_adjacent
from tandem.transfer.pair_group import POLL_SECONDS, READER_RANK, WRITER_RANK, PairRequest, Rendezvous, abort_group, \
    form_group, pair_with, receive_frame, send_frame, timedelta

logger = logging.getLogger(__name__)

MAGIC = 0x74616E64656D  # "tandem"
ELEMENT_TYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class AgentInfo(msgspec.Struct, frozen=True):
    """What a peer needs to pair with this agent (the backend's opaque metadata)."""
    name: str
    host: str
    control_port: int
    store_port: int
    token: str
    device: int


@dataclass(eq=False)
class PendingSend:
    """One write queued on a writer link; the link's thread sets ``status``."""
    descriptors: list[tuple[int, int, int]]
    notification: bytes
    ready: Optional[object] = None  # a CUDA event: the source pages are final once it completes
    status: WriteStatus = WriteStatus.PENDING
    error: str = ""
    started: bool = False
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


_HEADER = struct.Struct("<qqqqqq")
MAX_STAGING_BYTES = 1 << 30
ACKNOWLEDGEMENT = b"landed"
CLOSED = "the pair was closed"
STAGING_SLOTS = 2  # staged segments in flight at once per pair (the staging area holds this many)
STAGING_ALIGNMENT = 256
DRAIN_POLL_SECONDS = 20e-6
CLOSE_WAIT_SECONDS = 2.0


@dataclass(frozen=True)
class Header:
    """What the reader of a write must know: where the runs go, how the writer splits them into
    segments (its ``direct_bytes``/``staging_bytes``: the reader plans the same segments), the
    element type and the notification."""
    destinations: list[int]
    lengths: list[int]
    notification: bytes
    element_size: int
    direct_bytes: int
    staging_bytes: int

    def encode(self) -> bytes:
        runs = np.asarray(self.destinations + self.lengths, dtype="<i8").tobytes()
        return _HEADER.pack(MAGIC, len(self.lengths), len(self.notification), self.element_size, self.direct_bytes,
                            self.staging_bytes) + runs + self.notification

    @classmethod
    def decode(cls, frame: bytes) -> "Header":
        magic, count, notification_length, element_size, direct_bytes, staging_bytes = _HEADER.unpack_from(frame)
        if magic != MAGIC or count < 0 or element_size not in ELEMENT_TYPES or direct_bytes < 1 \
                or not 0 < staging_bytes <= MAX_STAGING_BYTES \
                or len(frame) != _HEADER.size + 16 * count + notification_length:
            raise RuntimeError("transfer (nccl): malformed write header")
        runs = np.frombuffer(frame, dtype="<i8", count=2 * count, offset=_HEADER.size).tolist()
        return cls(runs[:count], runs[count:], frame[_HEADER.size + 16 * count:], element_size, direct_bytes,
                   staging_bytes)


class _Link:
    """One pair's thread, control connection and data group (one direction: writer or reader)."""

    def __init__(self, backend: "NcclBackend", peer: str) -> None:
        self.backend, self.peer = backend, peer
        self.connection: Optional[socket.socket] = None
        self.group = None
        self.error = ""
        self.staging: Optional[torch.Tensor] = None
        self.stream = None
        self.thread = threading.Thread(target=self.run, name=f"tandem-nccl-{peer[-8:]}", daemon=True)

    @property
    def device(self) -> int:
        return self.backend.views.device

    def stream_context(self):
        if self.device < 0:
            return nullcontext()
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.device)
        return torch.cuda.stream(self.stream)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

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
        """Order what follows after ``work``: on a GPU the side stream waits for it (the host
        does not); in host memory the thread waits, at most ``timeout``."""
        if self.device >= 0:
            work.wait()
        else:
            work.wait(timedelta(self.backend.timeout))

    def drain(self, works: list) -> None:
        """Return once every operation in ``works`` (and everything on the side stream) is
        done; TimeoutError after ``timeout``."""
        for work in works:
            self.wait(work)
        if self.stream is None:
            return
        done = torch.cuda.Event()
        done.record(self.stream)
        deadline = time.monotonic() + self.backend.timeout
        while not done.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfer (nccl): a write to or from {self.peer} took over "
                                   f"{self.backend.timeout:g} s")
            time.sleep(DRAIN_POLL_SECONDS)

    def move(self, lengths: list[int], dtype: torch.dtype, direct_bytes: int, staging_bytes: int, operation,
             tensor_of, after=None) -> None:
        """Post every segment's send or receive (``operation``) without waiting for the one
        before, so they queue back to back on the link; staged segments take turns in the
        staging area (when it is full, what was posted drains first). ``tensor_of(segment,
        staging)`` gives the tensor to move; ``after(segment, staging)`` runs once a staged
        segment's receive is done (the scatter)."""
        works, offset = [], 0
        capacity = STAGING_SLOTS * -(-staging_bytes // STAGING_ALIGNMENT) * STAGING_ALIGNMENT
        segments = plan_segments(lengths, direct_bytes, staging_bytes)
        if any(not segment.direct for segment in segments) or not lengths:
            self.ensure_staging(max(capacity, STAGING_ALIGNMENT))
        if not lengths:  # the warm-up write: one element
            works.append(operation([self.staging_slice(0, 8, torch.int64)[:1]]))
        for segment in segments:
            staging = None
            if not segment.direct:
                if offset + segment.num_bytes > capacity:
                    self.drain(works)
                    works, offset = [], 0
                staging = self.staging_slice(offset, segment.num_bytes, dtype)
                offset += -(-segment.num_bytes // STAGING_ALIGNMENT) * STAGING_ALIGNMENT
            work = operation([tensor_of(segment, staging)])
            if after is not None and staging is not None:
                self.wait(work)
                after(segment, staging)
            else:
                works.append(work)
        self.drain(works)

    def fail(self, error: BaseException | str) -> None:
        """End the pair: later writes fail; the peer's thread sees the connection close."""
        if not self.error:
            self.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            # this side closed it, or the writer went away between writes (its engine stopped;
            # the PD layer's heartbeats judge whether that is a failure)
            level = logging.DEBUG if error == CLOSED else \
                logging.INFO if isinstance(error, ConnectionResetError) else logging.WARNING
            logger.log(level, "transfer (nccl): pair with %s ended: %s", self.peer, self.error)
        connection, self.connection = self.connection, None
        if connection is not None:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            connection.close()
        group, self.group = self.group, None
        abort_group(group)

    def run(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.fail(CLOSED)


class _WriterLink(_Link):
    def __init__(self, backend: "NcclBackend", info: AgentInfo) -> None:
        super().__init__(backend, info.name)
        self.info = info
        self.queue: "queue.Queue[Optional[PendingSend]]" = queue.Queue()

    def run(self) -> None:
        backend = self.backend
        try:
            self.connection, store = pair_with(self.info.host, self.info.control_port, self.info.store_port,
                                               self.info.token, backend.agent_name, backend.connect_timeout)
            self.group = form_group(store, WRITER_RANK, backend.host, self.device, backend.connect_timeout)
            self.connection.settimeout(backend.timeout)
            self.send(PendingSend([], b""))  # warm-up: the connections are set up before any real write
        except Exception as error:  # noqa: BLE001 - the pair never formed: every write fails
            self.fail(error)
        while True:
            item = self.queue.get()
            if item is None:
                return
            with item.lock:
                if item.cancelled:
                    continue
                item.started = True
            if self.error:
                item.status, item.error = WriteStatus.ERROR, self.error
                continue
            try:
                self.send(item)
                item.status = WriteStatus.DONE
            except Exception as error:  # noqa: BLE001
                self.fail(error)
                item.status, item.error = WriteStatus.ERROR, self.error

    def send(self, item: PendingSend) -> None:
        views = self.backend.views
        sources = [source for source, _, _ in item.descriptors]
        destinations = [destination for _, destination, _ in item.descriptors]
        lengths = [length for _, _, length in item.descriptors]
        dtype = widest_element(sources + destinations, lengths)
        element_size = torch.empty(0, dtype=dtype).element_size()
        connection, group = self.connection, self.group
        backend = self.backend
        send_frame(connection, Header(destinations, lengths, item.notification, element_size, backend.direct_bytes,
                                      backend.staging_bytes).encode())
        def tensor_of(segment, staging):
            parts = [views.view(sources[i], lengths[i]).view(dtype) for i in range(segment.first, segment.last)]
            return parts[0] if segment.direct else pack(parts, staging)

        with self.stream_context():
            if item.ready is not None:
                self.stream.wait_event(item.ready)
            self.move(lengths, dtype, backend.direct_bytes, backend.staging_bytes,
                      lambda tensors: group.send(tensors, READER_RANK, 0), tensor_of)
        # a send completes once its bytes left; the reader's acknowledgement says they landed
        if receive_frame(connection) != ACKNOWLEDGEMENT:
            raise RuntimeError("transfer (nccl): the reader did not acknowledge the write")

    def close(self) -> None:
        super().close()
        self.queue.put(None)


class _ReaderLink(_Link):
    def __init__(self, backend: "NcclBackend", request: PairRequest) -> None:
        super().__init__(backend, request.writer)
        self.request = request
        self.closed = False

    def run(self) -> None:
        backend, request = self.backend, self.request
        try:
            self.connection = request.connection
            self.group = form_group(request.store, READER_RANK, backend.host, self.device, backend.connect_timeout)
            self.connection.settimeout(POLL_SECONDS)
            while not self.closed:
                self.receive()
        except Exception as error:  # noqa: BLE001 - the writer is gone or broke the protocol
            if not self.closed:
                self.fail(error)

    def receive(self) -> None:
        views = self.backend.views
        connection, group = self.connection, self.group
        frame = receive_frame(connection, idle=lambda: self.closed)
        header = Header.decode(frame)
        dtype, notification = ELEMENT_TYPES[header.element_size], header.notification
        targets = [views.view(address, length).view(dtype)
                   for address, length in zip(header.destinations, header.lengths)]
        with self.stream_context():
            self.move(header.lengths, dtype, header.direct_bytes, header.staging_bytes,
                      lambda tensors: group.recv(tensors, WRITER_RANK, 0),
                      lambda segment, staging: targets[segment.first] if segment.direct else staging,
                      lambda segment, staging: unpack(staging, targets[segment.first:segment.last]))
        if notification:
            self.backend.received.append((self.peer, notification))
        send_frame(connection, ACKNOWLEDGEMENT)

    def close(self) -> None:
        self.closed = True
        super().close()


class NcclBackend(TransferBackend):
    name = "nccl"

    def __init__(self, agent_name: str, host: str = "127.0.0.1", connect_timeout: float = 30.0,
                 timeout: float = 120.0, direct_bytes: Optional[int] = None,
                 staging_bytes: Optional[int] = None) -> None:
        """``connect_timeout``: how long pairing may take; ``timeout``: how long one write's
        operations may take once its header went out (a write to a pair still forming waits).
        ``direct_bytes``/``staging_bytes`` (this side's writes): default ``byte_views``'s, or
        $TANDEM_NCCL_DIRECT_BYTES / $TANDEM_NCCL_STAGING_BYTES (for measuring alternatives)."""
        direct_bytes = direct_bytes or int(os.environ.get("TANDEM_NCCL_DIRECT_BYTES") or DIRECT_BYTES)
        staging_bytes = staging_bytes or int(os.environ.get("TANDEM_NCCL_STAGING_BYTES") or STAGING_BYTES)
        if not (direct_bytes >= 1 and 0 < staging_bytes <= MAX_STAGING_BYTES):
            raise ValueError(f"transfer_backend nccl: direct bytes {direct_bytes} and staging bytes {staging_bytes} "
                             f"must be positive (staging at most {MAX_STAGING_BYTES})")
        self._name, self.host = agent_name, host
        self.connect_timeout, self.timeout = connect_timeout, timeout
        self.direct_bytes, self.staging_bytes = direct_bytes, staging_bytes
        self.views = RegionViews()
        self.received: deque[tuple[str, bytes]] = deque()
        self.writers: dict[str, _WriterLink] = {}
        self.readers: list[_ReaderLink] = []
        self.rendezvous = Rendezvous(host, secrets.token_hex(16), connect_timeout)
        self.closed = threading.Event()
        self.acceptor = threading.Thread(target=self.accept, name="tandem-nccl-accept", daemon=True)
        self.acceptor.start()

    @property
    def agent_name(self) -> str:
        return self._name

    def register(self, regions: list[MemoryRegion]) -> None:
        devices = {region.device for region in regions} | ({self.views.device} if self.views.device != -1 else set())
        if len(devices) > 1:
            raise ValueError(f"transfer_backend nccl: registered memory spans several devices {sorted(devices)}")
        for region in regions:
            self.views.add(region)

    def local_metadata(self) -> bytes:
        rendezvous = self.rendezvous
        return msgspec.msgpack.encode(AgentInfo(self._name, self.host, rendezvous.control_port, rendezvous.store_port,
                                                rendezvous.token, self.views.device))

    def add_peer(self, metadata: bytes) -> str:
        info = msgspec.msgpack.decode(metadata, type=AgentInfo)
        if (info.device < 0) != (self.views.device < 0):
            raise ValueError("transfer_backend nccl: one side's state is in host memory and the other's on a GPU")
        link = self.writers.get(info.name)
        if link is None or link.error:
            link = self.writers[info.name] = _WriterLink(self, info)
            link.thread.start()
        return info.name

    def remove_peer(self, peer: str) -> None:
        link = self.writers.pop(peer, None)
        if link is not None:
            link.close()

    def _post(self, handle: WriteHandle, peer: str, descriptors, local_device: int, remote_device: int,
              notification: bytes) -> None:
        link = self.writers.get(peer)
        if link is None:
            raise RuntimeError(f"no pair with {peer}")
        if link.error:
            raise RuntimeError(link.error)
        ready = None
        if self.views.device >= 0:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.views.device))
        item = PendingSend(merge_adjacent(descriptors), bytes(notification), ready)
        handle.native = item
        link.queue.put(item)

    def _check(self, handle: WriteHandle) -> WriteStatus:
        item: PendingSend = handle.native
        if item.status is WriteStatus.ERROR:
            handle.error = item.error
        return item.status

    def _release(self, handle: WriteHandle) -> bool:
        item: PendingSend = handle.native
        with item.lock:
            if item.status is not WriteStatus.PENDING:
                return True
            if item.started:
                return False  # being sent: its pages stay held until it resolves
            item.cancelled = True
            return True

    def notifications(self) -> list[tuple[str, bytes]]:
        received = []
        while self.received:
            received.append(self.received.popleft())
        return received

    def accept(self) -> None:
        """Take writers that pair with this agent; each gets a reader thread."""
        while not self.closed.is_set():
            try:
                request = self.rendezvous.accept()
            except PermissionError as error:
                logger.warning("transfer (nccl): %s", error)
                continue
            except Exception:  # noqa: BLE001 - the listener is gone (closing)
                if not self.closed.is_set():
                    logger.warning("transfer (nccl): accepting a pair failed", exc_info=True)
                    time.sleep(POLL_SECONDS)
                continue
            if request is not None:
                link = _ReaderLink(self, request)
                self.readers.append(link)
                link.thread.start()

    def close(self) -> None:
        """End every pair and wait (briefly) for their threads, so no group outlives the backend."""
        self.closed.set()
        self.rendezvous.close()
        links = [*self.writers.values(), *self.readers]
        for link in links:
            link.close()
        for thread in [self.acceptor, *(link.thread for link in links)]:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(CLOSE_WAIT_SECONDS)
        self.writers.clear()
        self.readers.clear()
