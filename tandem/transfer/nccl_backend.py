"""The NCCL backend: one-sided writes between paired engines of one host. Between GPUs, where
the writer asks for them (the default; $TANDEM_NCCL_PEER_COPIES=0 or ``peer_copies=False``
for send/receive), the bytes move by peer copies (``peer_copies.py``): at pairing the reader shares its registered
memory over CUDA IPC (``peer_memory.py``) and a write is one device copy per merged run into it,
on the pair's own stream, then one control frame carrying the notification once the copies'
event completed (no receive to post, no acknowledgement: the writer saw its copies finish).
Where the reader's memory cannot be opened (its GPU not visible here, an allocator whose memory
IPC cannot share; said once, at WARNING), where the writer did not ask for them, and between
host memories, the bytes go
through ``torch.distributed`` point-to-point (NCCL between GPUs; gloo between host memories, so
CI runs the same logic on a CPU), as described below.

A send/receive write is a send on the writer paired with a receive the reader posts: the reader cannot know
a write is coming, so every write first sends a small header over the pair's control connection
(a TCP socket, ``pair_group.py``) naming the destination runs and the notification; the
reader's thread for that pair waits for the next header, receives the data as the header
describes, queues the notification once the bytes landed and acknowledges. Per pair and side
one thread does all of it, so the engine loop only posts and polls (``WriteHandle``), never
blocks. Peer copies need no thread once the pair formed: ``write`` posts the copies from the
caller's thread and the poll that finds them landed sends the notification (``notifies_on_poll``:
the engine polls a last write without pausing). Pairs form in those threads too; the first
write waits for that, and a tiny warm-up write at pairing sets up the NCCL connection (peer
copies: a read of the reader's memory sets up peer access), so the first real write pays no
connection setup.

Descriptors are merged where they continue on both sides (``merge_adjacent``), then sent as
``byte_views.plan_segments`` says: a write of a few runs (every page-major write: one run per
state group, plus the metadata row on the last) sends each run in place, all of them as one
group of point-to-point operations (one NCCL launch; the last write's pages and row together);
otherwise runs of at least ``direct_bytes`` go in place and shorter ones are gathered into
staged segments of at most ``staging_bytes`` (``torch._foreach_copy_``: a few kernels for many
runs), each sent as one message and scattered on the reader. Staged segments that fit the
staging area at once go in the same single batch; more are pipelined, the gathers and scatters
on a copy stream beside the link's stream, so the gather (scatter) of one segment overlaps the
send (receive) of the one before. The reader's host waits once per write, at its end; a writer
between GPUs never waits on its sends (the reader's acknowledgement says every byte arrived).
Source bytes are final when ``write`` is called (the connector's contract): the sends do not
wait on the engine's stream, so a write never queues behind forward passes launched after it.

Wire format of one send/receive write, in order::

    control  frame   MAGIC, number of runs n, notification length k, element size, the writer's
                     direct_bytes and staging_bytes (int64 each: the reader plans the same segments);
                     n destination addresses, n lengths (int64); the notification (k bytes)
    data     one tensor per segment (n = 0: one warm-up element)
    control  frame   reader -> writer: "landed" (the write is DONE only then)

Failure: a send, receive or copy that raises fails its write (ERROR) and every later write on
the pair (the pair is torn down; the reader's thread ends). A peer that is gone shows as the end
of the control stream (a writer with peer copies looks before each write), so the write fails at
once instead of hanging; a data operation that never completes fails after ``timeout``. Writes
with peer copies that were in flight when their pair failed end as ERROR only once their copies
stopped (a copy still reading a write's source pages keeps the write pending: I2).
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import deque
from typing import Optional

import msgspec

from tandem.transfer.byte_views import DIRECT_BYTES, STAGING_BYTES, RegionViews
from tandem.transfer.connector import TransferBackend, WriteHandle, WriteStatus
from tandem.transfer.descriptors import MemoryRegion, merge_adjacent
from tandem.transfer.nccl_links import CLOSE_WAIT_SECONDS, MAX_STAGING_BYTES, AgentInfo, PendingSend, ReaderLink, \
    WriterLink
from tandem.transfer.pair_group import POLL_SECONDS, Rendezvous
from tandem.transfer.peer_memory import peer_copies_wanted

logger = logging.getLogger(__name__)


class NcclBackend(TransferBackend):
    name = "nccl"
    orders_on_device = True  # a write's ``ready`` event: the link's stream waits for it

    def __init__(self, agent_name: str, host: str = "127.0.0.1", connect_timeout: float = 30.0,
                 timeout: float = 120.0, direct_bytes: Optional[int] = None,
                 staging_bytes: Optional[int] = None, peer_copies: Optional[bool] = None) -> None:
        """``connect_timeout``: how long pairing may take; ``timeout``: how long one write's
        operations may take once its header went out (a write to a pair still forming waits).
        ``direct_bytes``/``staging_bytes`` (this side's writes): default ``byte_views``'s, or
        $TANDEM_NCCL_DIRECT_BYTES / $TANDEM_NCCL_STAGING_BYTES (for measuring alternatives).
        ``peer_copies``: whether this side's writes between GPUs ask the reader for peer copies
        (default: yes, unless $TANDEM_NCCL_PEER_COPIES == "0"); read when a pair forms."""
        direct_bytes = direct_bytes or int(os.environ.get("TANDEM_NCCL_DIRECT_BYTES") or DIRECT_BYTES)
        staging_bytes = staging_bytes or int(os.environ.get("TANDEM_NCCL_STAGING_BYTES") or STAGING_BYTES)
        if not (direct_bytes >= 1 and 0 < staging_bytes <= MAX_STAGING_BYTES):
            raise ValueError(f"transfer_backend nccl: direct bytes {direct_bytes} and staging bytes {staging_bytes} "
                             f"must be positive (staging at most {MAX_STAGING_BYTES})")
        self._name, self.host = agent_name, host
        self.connect_timeout, self.timeout = connect_timeout, timeout
        self.direct_bytes, self.staging_bytes = direct_bytes, staging_bytes
        self.peer_copies = peer_copies_wanted(peer_copies)
        self.fallback_logged = False
        self.views = RegionViews()
        self.received: deque[tuple[str, bytes]] = deque()
        self.writers: dict[str, WriterLink] = {}
        self.readers: list[ReaderLink] = []
        self.rendezvous = Rendezvous(host, secrets.token_hex(16), connect_timeout)
        self.closed = threading.Event()
        self.acceptor = threading.Thread(target=self.accept, name="tandem-nccl-accept", daemon=True)
        self.acceptor.start()

    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def notifies_on_poll(self) -> bool:
        """With peer copies a write completes (and its notification leaves) in a poll of it."""
        return any(link.copies is not None for link in list(self.writers.values()))

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
            link = self.writers[info.name] = WriterLink(self, info)
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
        item = PendingSend(merge_adjacent(descriptors), bytes(notification), ready=handle.ready, link=link)
        handle.native = item
        link.post(item)

    def _check(self, handle: WriteHandle) -> WriteStatus:
        item: PendingSend = handle.native
        item.link.advance()  # peer copies: complete the writes whose copies landed
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

    def note_fallback(self, peer: str, error: BaseException) -> None:
        """A pair between GPUs could not open its reader's memory and sends through NCCL: said
        once per backend at WARNING (the rate is NCCL's then), after that at DEBUG."""
        level = logging.DEBUG if self.fallback_logged else logging.WARNING
        self.fallback_logged = True
        logger.log(level, "transfer (nccl): peer copies to %s are not possible (%s); its writes go through NCCL "
                          "send/receive", peer, error)

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
                link = ReaderLink(self, request)
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
