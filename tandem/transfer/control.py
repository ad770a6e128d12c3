"""The PD control channel: ZMQ sockets carrying ``messages.ControlMessage`` (msgpack).

Each PD engine binds one ROUTER socket at its bootstrap address; a decode engine opens one
DEALER per prefill engine it talks to (its ZMQ identity is its engine id). Replies to a DEALER
go back through the ROUTER, addressed by that identity::

    decode  DEALER(identity=decode id) ---tcp---> ROUTER  prefill (bootstrap address)

Sends never block: a message to a peer that is gone is dropped, and heartbeats (not socket
errors) decide when a peer is dead. Owner: the PD side of one engine; only its thread uses it.
"""
from __future__ import annotations

import logging
import socket
from typing import Optional
from urllib.parse import urlsplit

import msgspec
import zmq

from tandem.transfer.messages import ControlMessage

logger = logging.getLogger(__name__)


class ControlChannel:
    def __init__(self, identity: str, bind_address: str) -> None:
        self.identity = identity
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.address = self._bind(bind_address)
        self.dealers: dict[str, zmq.Socket] = {}
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ControlMessage)

    def _bind(self, address: str) -> str:
        """Bind; return the address peers connect to (on every interface: this host's address)."""
        parts = urlsplit(address)
        host = parts.hostname or "127.0.0.1"
        everywhere = host in ("0.0.0.0", "*")
        bind_host = "*" if everywhere else host
        if parts.port in (None, 0):
            port = self.router.bind_to_random_port(f"tcp://{bind_host}")
        else:
            port = parts.port
            self.router.bind(f"tcp://{bind_host}:{port}")
        if everywhere:
            host = socket.gethostbyname(socket.gethostname())
        return f"tcp://{host}:{port}"

    # -- links to peers we connect to (decode -> prefill) ----------------------------------------
    def connect(self, address: str) -> None:
        if address in self.dealers:
            return
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self.identity.encode())
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.connect(address)
        self.dealers[address] = dealer

    def disconnect(self, address: str) -> None:
        dealer = self.dealers.pop(address, None)
        if dealer is not None:
            dealer.close(linger=0)

    def send_to_address(self, address: str, message) -> None:
        dealer = self.dealers.get(address)
        if dealer is None:
            return
        try:
            dealer.send(self.encoder.encode(message), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            logger.debug("control message to %s dropped", address)

    # -- peers that connected to us (prefill <- decode) --------------------------------------------
    def send_to_identity(self, identity: str, message) -> None:
        try:
            self.router.send_multipart([identity.encode(), self.encoder.encode(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            logger.debug("control message to %s dropped", identity)

    # -- receiving -------------------------------------------------------------------------------------
    def receive(self) -> list[tuple[Optional[str], Optional[str], object]]:
        """Every queued message as (identity of a connected peer, or None; address of a peer we
        connected to, or None; message). Undecodable messages are logged and dropped."""
        received = []
        while True:
            try:
                identity, payload = self.router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            message = self._decode(payload)
            if message is not None:
                received.append((identity.decode(errors="replace"), None, message))
        for address, dealer in list(self.dealers.items()):
            while True:
                try:
                    payload = dealer.recv(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                message = self._decode(payload)
                if message is not None:
                    received.append((None, address, message))
        return received

    def _decode(self, payload: bytes):
        try:
            return self.decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            logger.warning("dropping an undecodable control message: %s", error)
            return None

    def sockets(self) -> list[zmq.Socket]:
        return [self.router, *self.dealers.values()]

    def close(self) -> None:
        for address in list(self.dealers):
            self.disconnect(address)
        self.router.close(linger=0)
        self.context.term()
