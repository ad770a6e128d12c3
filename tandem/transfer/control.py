"""The PD control channel: ZMQ sockets carrying ``messages.ControlMessage`` (msgpack) inside
authenticated frames (``frames.py``: HMAC-SHA256 with the deployment secret, a per-sender
sequence, the recipient's engine id).

Each PD engine binds one ROUTER socket at its bootstrap address; a decode engine opens one
DEALER per prefill engine it talks to (its ZMQ identity is its engine id). Replies to a DEALER
go back through the ROUTER, addressed by that identity::

    decode  DEALER(identity=decode id) ---tcp---> ROUTER  prefill (bootstrap address)

Only authenticated messages reach the PD side: a frame that is oversized, truncated, garbage,
forged (wrong secret), replayed, meant for another engine, or whose ZMQ identity or ``sender``
field differs from its authenticated sender is dropped, counted by reason (``rejected``), and
logged once per peer (its network address). Nothing is ever sent in answer to such a frame.
Frames from a DEALER are bound to the prefill engine's id once it has answered; ``Hello`` and
``Heartbeat`` go unbound (the first one cannot be; a heartbeat reaching a restarted engine at the
same address is then answered with "say hello first" instead of being dropped).

Sends never block: a message to a peer that is gone is dropped, and heartbeats (not socket
errors) decide when a peer is dead. Owner: the PD side of one engine; only its thread uses it.
"""
from __future__ import annotations

import logging
import socket
from collections import Counter
from typing import Optional
from urllib.parse import urlsplit

import msgspec
import zmq

from tandem.transfer.frames import MAX_FRAME_BYTES, REJECT_REASONS, FrameCodec, RejectedFrame
from tandem.transfer.messages import UNBOUND_MESSAGES, ControlMessage

logger = logging.getLogger(__name__)
MAX_LOGGED_PEERS = 1024  # rejections are logged once per peer, for this many peers


def advertised_host(address: str) -> str:
    """The host peers reach a "tcp://HOST:PORT" bind address at (for every interface: this
    host's address)."""
    host = urlsplit(address).hostname or "127.0.0.1"
    return socket.gethostbyname(socket.gethostname()) if host in ("0.0.0.0", "*") else host


class ControlChannel:
    def __init__(self, identity: str, bind_address: str, secret: bytes,
                 max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.identity = identity
        self.codec = FrameCodec(identity, secret, max_frame_bytes)
        # ZMQ itself drops (and disconnects) anything far beyond the limit before it is buffered.
        self.socket_limit = 2 * max_frame_bytes
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, self.socket_limit)
        self.address = self._bind(bind_address)
        self.dealers: dict[str, zmq.Socket] = {}
        self.peer_ids: dict[str, str] = {}  # address -> the engine id that answered from it
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ControlMessage)
        self.rejected: Counter[str] = Counter({reason: 0 for reason in REJECT_REASONS})
        self.logged_peers: set[str] = set()

    def _bind(self, address: str) -> str:
        """Bind; return the address peers connect to (on every interface: this host's address)."""
        parts = urlsplit(address)
        everywhere = (parts.hostname or "127.0.0.1") in ("0.0.0.0", "*")
        bind_host = "*" if everywhere else (parts.hostname or "127.0.0.1")
        if parts.port in (None, 0):
            port = self.router.bind_to_random_port(f"tcp://{bind_host}")
        else:
            port = parts.port
            self.router.bind(f"tcp://{bind_host}:{port}")
        return f"tcp://{advertised_host(address)}:{port}"

    # -- links to peers we connect to (decode -> prefill) ----------------------------------------
    def connect(self, address: str) -> None:
        if address in self.dealers:
            return
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self.identity.encode())
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.socket_limit)
        dealer.connect(address)
        self.dealers[address] = dealer

    def disconnect(self, address: str) -> None:
        self.peer_ids.pop(address, None)
        dealer = self.dealers.pop(address, None)
        if dealer is not None:
            dealer.close(linger=0)

    def send_to_address(self, address: str, message) -> None:
        dealer = self.dealers.get(address)
        if dealer is None:
            return
        recipient = "" if isinstance(message, UNBOUND_MESSAGES) else self.peer_ids.get(address, "")
        try:
            dealer.send(self.codec.seal(self.encoder.encode(message), recipient), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            logger.debug("control message to %s dropped", address)

    # -- peers that connected to us (prefill <- decode) --------------------------------------------
    def send_to_identity(self, identity: str, message) -> None:
        frame = self.codec.seal(self.encoder.encode(message), identity)
        try:
            self.router.send_multipart([identity.encode(), frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            logger.debug("control message to %s dropped", identity)

    # -- receiving -------------------------------------------------------------------------------------
    def receive(self) -> list[tuple[Optional[str], Optional[str], object]]:
        """Every queued authenticated message as (identity of a connected peer, or None; address
        of a peer we connected to, or None; message). Everything else is counted and dropped."""
        received = []
        while True:
            try:
                parts = self.router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            identity = bytes(parts[0]).decode(errors="replace")
            message = self._open(parts[1:], peer_address(parts[-1]), identity=identity)
            if message is not None:
                received.append((identity, None, message))
        for address, dealer in list(self.dealers.items()):
            while True:
                try:
                    parts = dealer.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                message = self._open(parts, address, address=address)
                if message is not None:
                    received.append((None, address, message))
        return received

    def _open(self, parts: list, peer: str, *, identity: Optional[str] = None, address: Optional[str] = None):
        """The message in ``parts`` if it is authentic, fresh and meant for this engine; else None."""
        try:
            if len(parts) != 1:
                raise RejectedFrame("garbage", f"{len(parts)} message parts, expected 1")
            opened = self.codec.open(parts[0].bytes, expected_sender=identity)
            try:
                message = self.decoder.decode(opened.payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                raise RejectedFrame("undecodable", str(error)) from None
            if getattr(message, "sender", opened.sender) != opened.sender:
                raise RejectedFrame("impersonation", f"signed by {opened.sender} but names {message.sender}")
            if opened.recipient == "" and not isinstance(message, UNBOUND_MESSAGES):
                raise RejectedFrame("misaddressed", f"an unbound {type(message).__name__}")
        except RejectedFrame as rejection:
            self._count(rejection, peer)
            return None
        if address is not None:
            self.peer_ids[address] = opened.sender
        return message

    def _count(self, rejection: RejectedFrame, peer: str) -> None:
        self.rejected[rejection.reason] += 1
        if peer in self.logged_peers:
            return
        if len(self.logged_peers) < MAX_LOGGED_PEERS:
            self.logged_peers.add(peer)
            logger.warning("PD control: dropped a message from %s (%s); further ones from this peer are only "
                           "counted (tandem:pd_control_rejected_total)", peer, rejection)
        elif len(self.logged_peers) == MAX_LOGGED_PEERS:
            self.logged_peers.add("")
            logger.warning("PD control: rejected messages from more than %d peers; no longer logging new peers",
                           MAX_LOGGED_PEERS)

    def sockets(self) -> list[zmq.Socket]:
        return [self.router, *self.dealers.values()]

    def close(self) -> None:
        for address in list(self.dealers):
            self.disconnect(address)
        self.router.close(linger=0)
        self.context.term()


def peer_address(frame) -> str:
    """The network address a frame came from (libzmq's Peer-Address), or "unknown"."""
    try:
        return frame.get("Peer-Address") or "unknown"
    except (zmq.ZMQError, AttributeError, TypeError):
        return "unknown"
