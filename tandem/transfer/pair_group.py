"""Pairs of engines for the NCCL backend: a control connection (a TCP socket: write headers,
acknowledgements) and a two-rank ``torch.distributed`` group for the data, built without
``init_process_group`` (no global state: an engine may pair with many peers, and tensor
parallelism owns the default group).

Every agent listens (``Rendezvous``: a socket for control connections and a ``TCPStore`` for
the groups' rendezvous) and names both ports and a random token in its backend metadata, which
travels in the authenticated PD handshake. A writer that loads a reader's metadata connects,
says token, its name and a fresh pair id; the reader checks the token (so a process that merely
reaches the port cannot pair) and both build the data group under the pair id's prefix, the
writer as rank 0 and the reader as rank 1::

    writer (rank 0)                                  reader (rank 1): listens, hosts the store
    connect; frame(token, writer, pair id) ------->  accept loop: check the token
    data group (NCCL on CUDA, gloo on CPU) <------>  data group (store prefix: pair id)

The control connection is a plain socket so that an idle reader waits for the next header with
a timeout it can leave (on close) and a peer that is gone shows as end of stream at once; a
gloo receive cannot be left without breaking its pair.

Owner: the backend (``nccl_backend.py``); each pair is used by one thread of each side only.
"""
from __future__ import annotations

import datetime
import hmac
import os
import socket
import struct
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as distributed

WRITER_RANK, READER_RANK = 0, 1
MAX_FRAME_BYTES = 64 << 20
POLL_SECONDS = 0.2  # an idle reader checks this often whether it was closed
_LENGTH = struct.Struct("<I")


def timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


# -- control frames -------------------------------------------------------------------------------


def send_frame(connection: socket.socket, payload: bytes) -> None:
    connection.sendall(_LENGTH.pack(len(payload)) + payload)


def _read_exactly(connection: socket.socket, count: int, idle: Optional[Callable[[], bool]]) -> bytes:
    """``count`` bytes; while nothing has arrived yet and ``idle`` is given, waits in slices of
    POLL_SECONDS and gives up (ConnectionAbortedError) once ``idle()`` says so."""
    chunks, received = [], 0
    while received < count:
        try:
            chunk = connection.recv(count - received)
        except socket.timeout:
            if idle is not None and not received:
                if idle():
                    raise ConnectionAbortedError("the pair was closed") from None
                continue
            raise
        if not chunk:
            raise ConnectionResetError("the peer closed the connection")
        chunks.append(chunk)
        received += len(chunk)
    return b"".join(chunks)


def receive_frame(connection: socket.socket, idle: Optional[Callable[[], bool]] = None) -> bytes:
    """The next frame. With ``idle``, waits for it as long as ``idle()`` is false (the socket's
    timeout must be POLL_SECONDS); without, for the socket's timeout."""
    (length,) = _LENGTH.unpack(_read_exactly(connection, _LENGTH.size, idle))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"transfer (nccl): a control frame of {length} bytes")
    return _read_exactly(connection, length, None)


# -- data groups ------------------------------------------------------------------------------------


def _gloo(store, rank: int, host: str, timeout: float):
    options = distributed.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout)
    options._devices = [distributed.ProcessGroupGloo.create_device(hostname=host)]
    return distributed.ProcessGroupGloo(store, rank, 2, options)


def _nccl(store, rank: int, timeout: float):
    if not hasattr(distributed, "ProcessGroupNCCL"):
        raise RuntimeError("transfer_backend nccl: this torch build has no NCCL")
    options = distributed.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout)
    # $TANDEM_NCCL_MIN_CTAS: at least this many channels (thread blocks) in the pair's
    # communicator, which NCCL's point-to-point channels follow; this group's alone, unlike
    # NCCL_MIN_P2P_NCHANNELS (for measuring: benchmarks/pd_gpu.py --env)
    min_ctas = int(os.environ.get("TANDEM_NCCL_MIN_CTAS") or 0)
    if min_ctas > 0 and hasattr(options, "config"):
        options.config.min_ctas = min_ctas
    return distributed.ProcessGroupNCCL(store, rank, 2, options)


def form_group(store, rank: int, host: str, device: int, timeout: float) -> distributed.ProcessGroup:
    """A pair's data group: NCCL between GPUs, gloo between host memories (blocks until the
    other rank does the same, at most ``timeout``)."""
    if device >= 0:
        torch.cuda.set_device(device)
        return _nccl(store, rank, timeout)
    return _gloo(store, rank, host, timeout)


def abort_group(group: Optional[distributed.ProcessGroup]) -> None:
    if group is not None:
        try:
            group.abort()
        except Exception:  # noqa: BLE001 - already torn down
            pass


# -- pairing --------------------------------------------------------------------------------------------


@dataclass
class PairRequest:
    writer: str
    pair_id: str
    connection: socket.socket
    store: distributed.Store


class Rendezvous:
    """This agent's listening socket and store, where writers pair with it."""

    def __init__(self, host: str, token: str, timeout: float) -> None:
        self.host, self.token, self.timeout = host, token, timeout
        self.store = distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                          timeout=timedelta(seconds=timeout), use_libuv=True)
        self.listener = socket.create_server((host, 0))
        self.listener.settimeout(POLL_SECONDS)
        self.store_port, self.control_port = self.store.port, self.listener.getsockname()[1]

    def accept(self) -> Optional[PairRequest]:
        """The next writer that paired (None when none came within POLL_SECONDS); a writer with a
        wrong token is refused (PermissionError)."""
        try:
            connection, _ = self.listener.accept()
        except socket.timeout:
            return None
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # acknowledgements leave at once
        connection.settimeout(self.timeout)
        try:
            token, writer, pair_id = receive_frame(connection).decode(errors="replace").split("\n")
        except (OSError, ValueError) as error:
            connection.close()
            raise PermissionError(f"a pairing attempt failed: {error}") from None
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            connection.close()
            raise PermissionError(f"a writer ({writer!r}) tried to pair with a wrong token")
        client = distributed.TCPStore(self.host, self.store_port, is_master=False, timeout=timedelta(self.timeout),
                                      use_libuv=True)
        return PairRequest(writer, pair_id, connection, distributed.PrefixStore(f"{pair_id}/", client))

    def close(self) -> None:
        self.listener.close()


def pair_with(host: str, control_port: int, store_port: int, token: str, writer: str,
              timeout: float) -> tuple[socket.socket, distributed.Store]:
    """Writer side: connect to the reader and say who pairs; returns the control connection and
    the pair's store prefix."""
    pair_id = uuid.uuid4().hex
    connection = socket.create_connection((host, control_port), timeout=timeout)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_frame(connection, f"{token}\n{writer}\n{pair_id}".encode())
    store = distributed.TCPStore(host, store_port, is_master=False, timeout=timedelta(seconds=timeout), use_libuv=True)
    return connection, distributed.PrefixStore(f"{pair_id}/", store)
