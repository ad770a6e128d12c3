"""Authenticated frames of the PD control channel (HMAC-SHA256 over the whole frame).

Every control message travels as one frame (big-endian integers)::

    offset  size  field
    0       4     magic b"TPC1" (tandem PD control, version 1)
    4       1     S: sender length
    5       1     R: recipient length
    6       8     sequence: strictly increasing per sender
    14      4     P: payload length
    18      S     sender: the sending engine's id (also its ZMQ identity)
    18+S    R     recipient: the engine id the frame is meant for ("" only for Hello/Heartbeat)
    18+S+R  P     payload: the msgpack message
    end-32  32    HMAC-SHA256(key, every byte before it); key = HMAC(secret, "tandem pd control v1")

An engine id is random per engine start, so a (sender, sequence) pair names one frame for all
time: a receiver keeps the highest sequence accepted from each sender and drops anything not
above it (a replay). The recipient binds a frame to one engine start, so a recorded frame cannot
be replayed into another engine (or a restarted one at the same address).

``FrameCodec.open`` checks, in order, and raises ``RejectedFrame(reason)`` naming the first
failure; ``REJECT_REASONS`` are the metric's labels.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple, Optional

MAGIC = b"TPC1"
HEADER = struct.Struct(">4sBBQI")
TAG_BYTES = hashlib.sha256().digest_size
KEY_LABEL = b"tandem pd control v1"
MAX_FRAME_BYTES = 8 << 20  # a Hello of a large model, or a page table of a very long prompt, fit
REJECT_REASONS = ("oversized", "truncated", "garbage", "bad_authenticator", "replayed", "misaddressed",
                  "impersonation", "undecodable")


class RejectedFrame(Exception):
    """A frame that must be dropped; ``reason`` is one of ``REJECT_REASONS``."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class OpenedFrame(NamedTuple):
    sender: str
    recipient: str
    sequence: int
    payload: bytes


class FrameCodec:
    """Seals this engine's frames and opens its peers'. Owner: one ``ControlChannel``."""

    def __init__(self, identity: str, secret: bytes, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.identity = identity
        self._key = derive_key(secret)
        self.max_frame_bytes = max_frame_bytes
        self.sequence = 0
        self.last_sequence: dict[str, int] = {}  # per authenticated sender: the highest accepted

    def seal(self, payload: bytes, recipient: str = "") -> bytes:
        self.sequence += 1
        return seal_frame(self._key, self.identity, recipient, self.sequence, payload)

    def open(self, frame: bytes, expected_sender: Optional[str] = None) -> OpenedFrame:
        """Authenticate a frame and check it is fresh, meant for this engine and (when the
        transport names its sender, as a ZMQ identity does) sent by whom it says."""
        opened = parse_frame(frame, self.max_frame_bytes)
        body = memoryview(frame)[:len(frame) - TAG_BYTES]
        expected = hmac.new(self._key, body, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, frame[len(frame) - TAG_BYTES:]):
            raise RejectedFrame("bad_authenticator", "the frame's HMAC does not match (a different secret, or altered)")
        if expected_sender is not None and opened.sender != expected_sender:
            raise RejectedFrame("impersonation", f"signed by {opened.sender} but sent as {expected_sender!r}")
        if opened.recipient not in ("", self.identity):
            raise RejectedFrame("misaddressed", f"meant for {opened.recipient}")
        if opened.sequence <= self.last_sequence.get(opened.sender, 0):
            raise RejectedFrame("replayed", f"sequence {opened.sequence} of {opened.sender} was already passed")
        self.last_sequence[opened.sender] = opened.sequence
        return opened


def derive_key(secret: bytes) -> bytes:
    return hmac.new(secret, KEY_LABEL, hashlib.sha256).digest()


def seal_frame(key: bytes, sender: str, recipient: str, sequence: int, payload: bytes) -> bytes:
    sender_bytes, recipient_bytes = sender.encode(), recipient.encode()
    body = b"".join((HEADER.pack(MAGIC, len(sender_bytes), len(recipient_bytes), sequence, len(payload)),
                     sender_bytes, recipient_bytes, payload))
    return body + hmac.new(key, body, hashlib.sha256).digest()


def parse_frame(frame: bytes, max_frame_bytes: int) -> OpenedFrame:
    """The frame's fields (not yet authenticated); rejects frames whose shape is wrong."""
    if len(frame) > max_frame_bytes:
        raise RejectedFrame("oversized", f"{len(frame)} bytes, the limit is {max_frame_bytes}")
    if len(frame) < HEADER.size:
        raise RejectedFrame("truncated" if frame and MAGIC.startswith(frame[:len(MAGIC)]) else "garbage",
                            f"{len(frame)} bytes")
    magic, sender_length, recipient_length, sequence, payload_length = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise RejectedFrame("garbage", "not a tandem control frame")
    payload_start = HEADER.size + sender_length + recipient_length
    expected_length = payload_start + payload_length + TAG_BYTES
    if len(frame) < expected_length:
        raise RejectedFrame("truncated", f"{len(frame)} of {expected_length} bytes")
    if len(frame) > expected_length:
        raise RejectedFrame("garbage", f"{len(frame) - expected_length} bytes after the frame")
    try:
        sender = frame[HEADER.size:HEADER.size + sender_length].decode()
        recipient = frame[HEADER.size + sender_length:payload_start].decode()
    except UnicodeDecodeError:
        raise RejectedFrame("garbage", "sender or recipient is not UTF-8") from None
    return OpenedFrame(sender, recipient, sequence, bytes(frame[payload_start:payload_start + payload_length]))
