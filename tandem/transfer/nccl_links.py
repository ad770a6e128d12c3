"""The NCCL backend's pairs at work: one thread per pair and side (``WriterLink`` sends the
writes queued on it, ``ReaderLink`` receives them), the write header they exchange over the
pair's control connection, and the acknowledgement that makes a write DONE. See
``nccl_backend.py`` for the protocol; owner: the ``NcclBackend`` that made the link.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import msgspec
import numpy as np
import torch

from tandem.transfer.byte_views import pack, plan_segments, unpack, widest_element
from tandem.transfer.connector import WriteStatus
from tandem.transfer.peer_copies import ASK_COPIES, CHOOSE_COPIES, CHOOSE_NCCL, PeerCopies, landed_frame, \
    notification_of
from tandem.transfer.peer_memory import PROCESS_ID, PeerOffer, offer_regions
from tandem.transfer.pair_group import POLL_SECONDS, READER_RANK, WRITER_RANK, PairRequest, abort_group, \
    form_group, pair_with, receive_frame, send_frame, timedelta

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
STAGING_SLOTS = 3  # staged segments in flight at once per pair (the staging area holds this many)
STAGING_ALIGNMENT = 256
DRAIN_POLL_SECONDS = 20e-6
DRAIN_SPIN_SECONDS = 2e-3
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
        self.error = ""
        self.staging: Optional[torch.Tensor] = None
        self.stream = None  # where sends and receives are posted from
        self.copy_stream = None  # where staged segments are gathered (writer) or scattered (reader)
        self.posted_at = 0.0
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

    def copy_context(self):
        """On a GPU, the copy stream (it runs beside the link's stream: the gather of segment
        i + 1 overlaps the send of segment i, the scatter of segment i the receive of i + 1)."""
        if self.device < 0:
            return nullcontext()
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(device=self.device)
        return torch.cuda.stream(self.copy_stream)

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
            work.wait(timedelta(seconds=self.backend.timeout))

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
            if waited > self.backend.timeout:
                raise TimeoutError(f"transfer (nccl): a write to or from {self.peer} took over "
                                   f"{self.backend.timeout:g} s")
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
                self.group = form_group(store, WRITER_RANK, backend.host, self.device, backend.connect_timeout)
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

        with self.stream_context():  # (the sources are final: the caller waited for the device, connector.py)
            self.after_event(item.ready)  # (but for a row staged on a stream of its own: the gathers wait too)
            self.move(lengths, dtype, backend.direct_bytes, backend.staging_bytes,
                      lambda tensors: group.send(tensors, READER_RANK, 0), tensor_of)
        item.timings["posted"], item.timings["drained"] = self.posted_at, time.perf_counter()
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
        backend, request = self.backend, self.request
        try:
            self.connection = request.connection
            copies = self.device >= 0 and self.answer_data_plane()
            if not copies:
                self.group = form_group(request.store, READER_RANK, backend.host, self.device, backend.connect_timeout)
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

        with self.stream_context():
            self.move(header.lengths, dtype, header.direct_bytes, header.staging_bytes,
                      lambda tensors: group.recv(tensors, WRITER_RANK, 0),
                      lambda segment, staging: targets(segment.first, segment.last)[0] if segment.direct else staging,
                      lambda segment, staging: unpack(staging, targets(segment.first, segment.last)))
        if notification:
            self.backend.received.append((self.peer, notification))
        send_frame(connection, ACKNOWLEDGEMENT)

    def close(self) -> None:
        self.closed = True
        super().close()
