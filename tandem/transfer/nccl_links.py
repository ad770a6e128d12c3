"""The NCCL backend's pairs at work: one thread per pair and side (``WriterLink`` sends the
writes queued on it, ``ReaderLink`` receives them), the write header they exchange over the
pair's control connection, and the acknowledgement that makes a write DONE. The bytes move by
peer copies (``peer_copies.py``) or over the pair's data group (``nccl_sendrecv.py``). See
``nccl_backend.py`` for the protocol; owner: the ``NcclBackend`` that made the link.
"""
from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import msgspec
import numpy as np
import torch

from tandem.transfer.byte_views import pack, unpack, widest_element
from tandem.transfer.connector import WriteStatus
from tandem.transfer.peer_copies import ASK_COPIES, CHOOSE_COPIES, CHOOSE_NCCL, PeerCopies, landed_frame, \
    notification_of
from tandem.transfer.peer_memory import PROCESS_ID, PeerOffer, offer_regions
from tandem.transfer.nccl_sendrecv import SendReceive
from tandem.transfer.pair_group import POLL_SECONDS, READER_RANK, WRITER_RANK, PairRequest, abort_group, \
    form_group, pair_with, receive_frame, send_frame

if TYPE_CHECKING:
    from tandem.transfer.nccl_backend import NcclBackend

logger = logging.getLogger("tandem.transfer.nccl_backend")

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
    status: WriteStatus = WriteStatus.PENDING
    error: str = ""
    started: bool = False
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    # perf_counter() when the link's thread took it, sent its header, had posted every send, saw
    # them drained and got the acknowledgement (diagnostics: benchmarks/pd_gpu.py prints them)
    timings: dict = field(default_factory=dict)
    event: Any = None  # peer copies: the CUDA event after the write's copies
    ready: Any = None  # a CUDA event the write's reads wait for on the device (``WriteHandle.ready``)
    link: Any = None  # the ``WriterLink`` it was posted on (its polls complete peer copies)


_HEADER = struct.Struct("<qqqqqq")
MAX_STAGING_BYTES = 1 << 30
ACKNOWLEDGEMENT = b"landed"
CLOSED = "the pair was closed"
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


class Link:
    """One pair's thread, control connection and data group (one direction: writer or reader)."""

    def __init__(self, backend: "NcclBackend", peer: str) -> None:
        self.backend, self.peer = backend, peer
        self.connection: Optional[socket.socket] = None
        self.group = None
        self.plane: Optional[SendReceive] = None  # once the pair formed a data group
        self.error = ""
        self.thread = threading.Thread(target=self.run, name=f"tandem-nccl-{peer[-8:]}", daemon=True)

    @property
    def device(self) -> int:
        return self.backend.views.device

    def form_group(self, store, rank: int) -> None:
        """The pair's data group (NCCL between GPUs, gloo in host memory) and what moves bytes over it."""
        backend = self.backend
        self.group = form_group(store, rank, backend.host, self.device, backend.connect_timeout)
        self.plane = SendReceive(self.group, self.device, backend.timeout, self.peer)

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


class WriterLink(Link):
    """The writer's side of a pair. Until the pair formed, writes queue for the link's thread;
    with peer copies they are then posted and completed in the caller's thread (``post``,
    ``advance``): no handoff to another thread between a write and its copies, nor between its
    copies' event and the frame carrying its notification. Send/receive writes stay with the
    link's thread, one at a time (``send_writes``)."""

    def __init__(self, backend: "NcclBackend", info: AgentInfo) -> None:
        super().__init__(backend, info.name)
        self.info = info
        self.queue: "queue.Queue[Optional[PendingSend]]" = queue.Queue()
        self.copies: Optional[PeerCopies] = None  # the data plane between GPUs, when the reader's memory opened
        # peer copies: writes posted and not yet complete, in posting order (their copies share one
        # stream, so they land in that order); ``direct`` once the caller's thread posts them.
        # The lock guards both, the copies' mapping and the control connection's frames.
        self.in_flight: deque[PendingSend] = deque()
        self.direct = False
        self.lock = threading.Lock()

    def run(self) -> None:
        backend = self.backend
        try:
            self.connection, store = pair_with(self.info.host, self.info.control_port, self.info.store_port,
                                               self.info.token, backend.agent_name, backend.connect_timeout)
            self.copies = self.choose_data_plane()
            if self.copies is None:
                self.form_group(store, WRITER_RANK)
            self.connection.settimeout(backend.timeout)
            if self.copies is None:
                self.send(PendingSend([], b""))  # warm-up: the connections are set up before any real write
        except Exception as error:  # noqa: BLE001 - the pair never formed: every write fails
            self.fail(error)
        if self.copies is not None and not self.error:
            self.copy_writes()
            self.fail_queued()
        else:
            self.send_writes()

    def choose_data_plane(self) -> Optional[PeerCopies]:
        """Between GPUs, ask the reader for peer copies (``peer_copies.py``) unless told not to;
        None (and the reader told so) where the pair sends through NCCL or gloo instead."""
        if self.device < 0:
            return None  # host memory: gloo (both sides know it from the agents' metadata)
        connection, backend = self.connection, self.backend
        if not backend.peer_copies:
            send_frame(connection, CHOOSE_NCCL)
            return None
        send_frame(connection, ASK_COPIES + PROCESS_ID.encode())
        offer = PeerOffer.decode(receive_frame(connection))
        try:
            copies = PeerCopies.open(offer, self.device, backend.timeout)
        except Exception as error:  # noqa: BLE001 - IPC cannot open here: NCCL moves the bytes
            backend.note_fallback(self.peer, error)
            send_frame(connection, CHOOSE_NCCL)
            return None
        try:
            send_frame(connection, CHOOSE_COPIES)
        except Exception:
            copies.release()
            raise
        return copies

    def take(self, item: PendingSend) -> bool:
        """Claim a queued write; False (nothing to do) when it was cancelled, or when the pair has
        failed (then the write is ERROR)."""
        with item.lock:
            if item.cancelled:
                return False
            item.started = True
        if self.error:
            item.status, item.error = WriteStatus.ERROR, self.error
            return False
        return True

    def post(self, item: PendingSend) -> None:
        """The caller's thread: post ``item`` (peer copies, once the pair formed with them: its
        copies now; else queued for the link's thread). Raises when the pair has failed, or when
        posting its copies failed (which ends the pair)."""
        with self.lock:
            if self.error:
                raise RuntimeError(self.error)
            if not self.direct:
                self.queue.put(item)
                return
            item.started = True
            self.start_copies(item)
            self.queue.put(item)  # (for the link's thread to watch: ``watch``)

    def start_copies(self, item: PendingSend) -> None:
        """Post ``item``'s copies (lock held); a failure ends the pair and raises."""
        try:
            self.copies.start(item, self.backend.views, self.connection)
        except Exception as error:
            self.end_copies(error)
            item.status, item.error = WriteStatus.ERROR, self.error
            raise
        self.in_flight.append(item)

    def advance(self) -> None:
        """The caller's thread, at each poll of a write: complete, in order, the writes whose
        copies landed (each one's notification sent, then DONE). A failure (a copy past the
        timeout, the frame not sent) ends the pair."""
        if not self.in_flight:
            return
        with self.lock:
            try:
                while self.in_flight and self.copies.landed(self.in_flight[0]):
                    self.complete(self.in_flight[0])
                    self.in_flight.popleft()
            except Exception as error:  # noqa: BLE001
                self.end_copies(error)

    def end_copies(self, error: BaseException) -> None:
        """A failure of the pair with peer copies (lock held): every later write fails, the
        writes in flight end once their copies stopped (``settle``), the link's thread ends and
        releases the mapping."""
        self.fail(error)
        self.settle()
        self.queue.put(None)

    def copy_writes(self) -> None:
        """The link's thread, once the pair formed with peer copies: post the writes queued before
        that, in order; from then on the caller's thread posts them (``post``) and this thread
        watches each (``watch``) until the link ends. Then the writes still in flight end as
        ERROR once their copies stopped, and the mapping is released (after every copy finished)."""
        if self.device >= 0:  # (this thread's CUDA calls run on the pair's device: no context made on another)
            torch.cuda.set_device(self.device)
        with self.lock:
            closing = self.post_queued()
            self.direct = not closing and not self.error
            posted = list(self.in_flight)
        for item in posted:
            self.watch(item)
        while not closing:
            item = self.queue.get()
            if item is None:
                break
            self.watch(item)
        with self.lock:
            self.direct = False
            self.settle()
            self.copies.release()

    def watch(self, item: PendingSend) -> None:
        """The link's thread: wait for ``item``'s copies (the interpreter free meanwhile: the
        event is waited for in CUDA), then complete what landed as a poll would. So a write's
        notification leaves even while the engine's thread is busy (a forward pass), not only at
        its next poll; whichever comes first completes it."""
        if item.event is not None and item.status is WriteStatus.PENDING:
            item.event.synchronize()
            self.advance()

    def post_queued(self) -> bool:
        """Post the writes queued before the pair formed (lock held); True once the link closed
        (or failed posting one)."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return False
            if item is None:
                return True
            if not self.take(item):
                continue
            try:
                self.start_copies(item)
            except Exception:  # noqa: BLE001 - the pair ended (the write is ERROR)
                return True

    def send_writes(self) -> None:
        """The writes of a pair through NCCL (gloo), one at a time, until the link closes (every
        write queued after its failure fails: ``take``)."""
        while True:
            item = self.queue.get()
            if item is None:
                return
            if not self.take(item):
                continue
            try:
                self.send(item)
                item.status = WriteStatus.DONE
            except Exception as error:  # noqa: BLE001
                self.fail(error)
                item.status, item.error = WriteStatus.ERROR, self.error

    def fail_queued(self) -> None:
        """Once a pair with peer copies ended: the writes still queued and never posted (posting
        an earlier one failed) end as ERROR; a posted one queued for ``watch`` keeps the status
        its copies gave it (``settle``). Nothing is queued later (``post`` raises once the pair
        failed)."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and not item.started:
                self.take(item)

    def complete(self, item: PendingSend) -> None:
        """``item``'s bytes landed: tell the reader its notification, then it is DONE."""
        if item.notification:
            send_frame(self.connection, landed_frame(item.notification))
        item.timings["acknowledged"] = time.perf_counter()
        item.status = WriteStatus.DONE

    def settle(self) -> None:
        """Writes that cannot complete (the pair failed or closed; lock held): ERROR once no copy
        of theirs can still read their sources; a copy that never finishes keeps its write
        PENDING (its pages stay held: never freed under a reader)."""
        if not self.in_flight:
            return
        if not self.copies.quiesce():
            logger.warning("transfer (nccl): copies to %s did not finish; their pages stay held", self.peer)
            return
        for item in self.in_flight:
            item.status, item.error = WriteStatus.ERROR, self.error or CLOSED
        self.in_flight.clear()

    def send(self, item: PendingSend) -> None:
        views = self.backend.views
        sources = [source for source, _, _ in item.descriptors]
        destinations = [destination for _, destination, _ in item.descriptors]
        lengths = [length for _, _, length in item.descriptors]
        dtype = widest_element(sources + destinations, lengths)
        element_size = torch.empty(0, dtype=dtype).element_size()
        connection, group = self.connection, self.group
        backend = self.backend
        item.timings["taken"] = time.perf_counter()
        send_frame(connection, Header(destinations, lengths, item.notification, element_size, backend.direct_bytes,
                                      backend.staging_bytes).encode())
        item.timings["header"] = time.perf_counter()
        def tensor_of(segment, staging):
            parts = [views.view(sources[i], lengths[i]).view(dtype) for i in range(segment.first, segment.last)]
            return parts[0] if segment.direct else pack(parts, staging)

        plane = self.plane
        with plane.stream_context():  # (the sources are final: the caller waited for the device, connector.py)
            plane.after_event(item.ready)  # (but for a row staged on a stream of its own: the gathers wait too)
            plane.move(lengths, dtype, backend.direct_bytes, backend.staging_bytes,
                       lambda tensors: group.send(tensors, READER_RANK, 0), tensor_of)
        item.timings["posted"], item.timings["drained"] = plane.posted_at, time.perf_counter()
        # a send completes once its bytes left; the reader's acknowledgement says they landed
        if receive_frame(connection) != ACKNOWLEDGEMENT:
            raise RuntimeError("transfer (nccl): the reader did not acknowledge the write")
        item.timings["acknowledged"] = time.perf_counter()

    def close(self) -> None:
        super().close()
        self.queue.put(None)


class ReaderLink(Link):
    def __init__(self, backend: "NcclBackend", request: PairRequest) -> None:
        super().__init__(backend, request.writer)
        self.request = request
        self.closed = False

    def run(self) -> None:
        request = self.request
        try:
            self.connection = request.connection
            copies = self.device >= 0 and self.answer_data_plane()
            if not copies:
                self.form_group(request.store, READER_RANK)
            self.connection.settimeout(POLL_SECONDS)
            while not self.closed:
                if copies:
                    self.receive_landed()
                else:
                    self.receive()
        except Exception as error:  # noqa: BLE001 - the writer is gone or broke the protocol
            if not self.closed:
                self.fail(error)

    def answer_data_plane(self) -> bool:
        """The reader's part of ``WriterLink.choose_data_plane``: offer the registered regions if
        asked; True when the writer chose peer copies."""
        connection = self.connection
        choice = receive_frame(connection)
        if choice.startswith(ASK_COPIES):
            writer_process = choice[len(ASK_COPIES):].decode(errors="replace")
            send_frame(connection, offer_regions(self.backend.views.regions, self.device, writer_process).encode())
            choice = receive_frame(connection)
        if choice not in (CHOOSE_COPIES, CHOOSE_NCCL):
            raise RuntimeError("transfer (nccl): malformed pairing")
        return choice == CHOOSE_COPIES

    def receive_landed(self) -> None:
        """A pair with peer copies: the next write's bytes landed; queue its notification."""
        frame = receive_frame(self.connection, idle=lambda: self.closed)
        self.backend.received.append((self.peer, notification_of(frame)))

    def receive(self) -> None:
        views = self.backend.views
        connection, group = self.connection, self.group
        frame = receive_frame(connection, idle=lambda: self.closed)
        header = Header.decode(frame)
        dtype, notification = ELEMENT_TYPES[header.element_size], header.notification
        views.check(header.destinations, header.lengths)  # before anything is received

        def targets(first: int, last: int) -> list[torch.Tensor]:  # made as each segment needs them
            return [views.view(header.destinations[i], header.lengths[i]).view(dtype) for i in range(first, last)]

        plane = self.plane
        with plane.stream_context():
            plane.move(header.lengths, dtype, header.direct_bytes, header.staging_bytes,
                       lambda tensors: group.recv(tensors, WRITER_RANK, 0),
                       lambda segment, staging: targets(segment.first, segment.last)[0] if segment.direct else staging,
                       lambda segment, staging: unpack(staging, targets(segment.first, segment.last)))
        if notification:
            self.backend.received.append((self.peer, notification))
        send_frame(connection, ACKNOWLEDGEMENT)

    def close(self) -> None:
        self.closed = True
        super().close()
