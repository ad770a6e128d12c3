"""The connector API: what the PD engine needs from a transfer backend, and nothing more.

A backend registers memory regions (every state buffer of the registry, plus the metadata
rows), exchanges an opaque description of itself with peers, and performs one-sided writes: a
list of (local address, remote address, length) descriptors, optionally followed by a
notification the peer receives once the write's bytes have landed. The source bytes of a write
are final when it is posted (``write``). Completion is polled; the
engine never blocks on a backend.

Backends (chosen by name in ``backends.py``): ``nixl`` (NIXL over UCX; host or GPU memory; the default) and ``nccl``
(engines of one host: between GPUs ``write`` is copies into the reader's memory, opened over CUDA
IPC at pairing, then one control frame with the notification; NCCL send/receive where that memory
cannot be opened, and gloo between host memories: a send paired with a receive the peer's thread
posts, announced by a header; ``nccl_backend.py``).

Fault injection for tests: with ``failure_probability`` > 0 (``TANDEM_TEST_TRANSFER_FAILURE_PROB``)
each write fails at random instead of being posted, exactly as a failed post would.
"""
from __future__ import annotations

import abc
import enum
import random
from dataclasses import dataclass, field
from typing import Any, Optional

from tandem.transfer.descriptors import MemoryRegion


class WriteStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    ERROR = "error"


@dataclass(eq=False)
class WriteHandle:
    """One posted write. ``native`` is the backend's own handle (None when nothing was posted)."""
    peer: str
    num_bytes: int
    native: Any = None
    status: WriteStatus = WriteStatus.PENDING
    error: str = ""
    released: bool = False
    extra: dict = field(default_factory=dict)
    # the CUDA event the write's reads wait for on the device (``TransferBackend.write``'s
    # ``ready``, for a backend that ``orders_on_device``); None: the sources were final at post
    ready: Any = None


class TransferBackend(abc.ABC):
    name: str = ""
    # a write's notification leaves only from a poll of that write that finds its bytes landed
    # (NIXL): the writer should poll a notified write without pausing
    notifies_on_poll: bool = False
    # the backend can order a write's reads after a CUDA event on the device (``write``'s
    # ``ready``); any other backend's ``write`` waits for that event on the host before posting
    orders_on_device: bool = False

    @property
    @abc.abstractmethod
    def agent_name(self) -> str:
        """This agent's name, as peers see it in notifications."""

    @abc.abstractmethod
    def register(self, regions: list[MemoryRegion]) -> None:
        """Register memory the peers may write into and this side reads from."""

    @abc.abstractmethod
    def local_metadata(self) -> bytes:
        """An opaque description of this agent (and its registered memory) for peers."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's description; returns the peer's agent name."""

    @abc.abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer (no more writes to it)."""

    @abc.abstractmethod
    def _post(self, handle: WriteHandle, peer: str, descriptors: list[tuple[int, int, int]],
              local_device: int, remote_device: int, notification: bytes) -> None:
        """Post the write; set ``handle.native`` or mark the handle failed."""

    @abc.abstractmethod
    def _check(self, handle: WriteHandle) -> WriteStatus:
        """Poll a posted write."""

    @abc.abstractmethod
    def _release(self, handle: WriteHandle) -> bool:
        """Free a write's resources, cancelling it if still pending; False if it cannot be."""

    @abc.abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]:
        """(peer agent name, message) of every notification received since the last call."""

    def prepare(self, peer: str, runs: list, local_device: int = -1, remote_device: int = -1) -> None:
        """Optional: the blocks writes to ``peer`` will move (``block_index.BlockRuns``: a state
        group's pages on both sides, the metadata rows), told once when the peer is added, so a
        backend may describe them ahead of time and a write of whole blocks costs less to post.
        Writes stay correct whether or not a backend does anything with it."""

    def close(self) -> None:
        """Release the agent (registered memory stays owned by its tensors)."""

    # -- the part every backend shares --------------------------------------------------------
    failure_probability: float = 0.0
    _random: Optional[random.Random] = None

    def write(self, peer: str, descriptors: list[tuple[int, int, int]], *, local_device: int = -1,
              remote_device: int = -1, notification: bytes = b"", ready: Any = None) -> WriteHandle:
        """Post a write of ``descriptors`` (source, destination, length) to ``peer``. The source
        bytes must be final when this is called (device memory: the caller waited for the work
        that writes them, e.g. a CUDA event of the forward pass); no backend orders its reads
        after the caller's stream, so a write never waits for work launched after it. The one
        exception is ``ready``: a CUDA event recorded after the last work that writes some of the
        sources, on a stream that runs nothing launched later (the metadata rows' own stream:
        a row staged from host memory, ``MetadataBuffer.stage``). The write's reads are ordered
        after it on the device where the backend can (``orders_on_device``), else the host
        waits for it here, before posting."""
        handle = WriteHandle(peer=peer, num_bytes=sum(length for _, _, length in descriptors))
        if self.failure_probability > 0 and self._random.random() < self.failure_probability:
            handle.status, handle.error = WriteStatus.ERROR, "injected transfer failure"
            return handle
        if ready is not None and not self.orders_on_device:
            ready.synchronize()
        elif ready is not None:
            handle.ready = ready
        try:
            self._post(handle, peer, descriptors, local_device, remote_device, notification)
        except Exception as error:  # noqa: BLE001 - a failed post is a failed write
            handle.status, handle.error = WriteStatus.ERROR, f"{type(error).__name__}: {error}"
        return handle

    def poll(self, handle: WriteHandle) -> WriteStatus:
        if handle.status is WriteStatus.PENDING and handle.native is not None:
            try:
                handle.status = self._check(handle)
            except Exception as error:  # noqa: BLE001
                handle.status, handle.error = WriteStatus.ERROR, f"{type(error).__name__}: {error}"
            if handle.status is WriteStatus.ERROR and not handle.error:
                handle.error = "the backend reported a failed write"
        return handle.status

    def release(self, handle: WriteHandle) -> bool:
        """Free the handle; for a pending write this cancels it. True once nothing can still be
        written by it (then its source pages may be released)."""
        if handle.released:
            return True
        if handle.native is not None:
            try:
                if not self._release(handle):
                    return False
            except Exception:  # noqa: BLE001
                return False
        handle.released = True
        return True
