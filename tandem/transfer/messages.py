"""Typed control messages between a prefill and a decode engine (msgspec, over ZMQ), the
state layout both sides compare at handshake, and room ids.

A room id is a 128-bit number written as 32 lowercase hex digits. The router makes one per
request; every control message, the completion notification and the metadata row carry it, and
each side checks it before acting (I7). Connection-level messages (hello, heartbeat) carry
``NULL_ROOM``.

Every message travels in an authenticated frame (``frames.py``, ``control.py``).

Message flow (decode D connects to prefill P's bootstrap address)::

    D -> P  Hello(layout, backend metadata, buffer addresses)   once per peer
    P -> D  HelloReply(accepted | error naming the first difference)
    D <-> P Heartbeat                                           every heartbeat_interval
    D -> P  Destination(room, page ids per group, metadata row) when D admits the request
    P ==> D page writes; the last one, posted once the others are done, carries the last pages,
            the metadata row and the notification "done:<room>"
    P -> D  TransferFailed(room, reason, drained)               P gave up (drained: no more writes)
    D -> P  AbortTransfer(room, reason)                         D gave up; P stops, then ...
    P -> D  Drained(room)                                       ... P will write no more
"""
from __future__ import annotations

import re
import uuid
from typing import Optional, Union

import msgspec

NULL_ROOM = "0" * 32
ROOM_PATTERN = re.compile(r"^[0-9a-f]{32}$")
DONE_PREFIX = b"done:"


def new_room() -> str:
    return uuid.uuid4().hex


def check_room(room: str) -> str:
    if not isinstance(room, str) or not ROOM_PATTERN.match(room):
        raise ValueError(f"kv_transfer_params: room must be 32 lowercase hex digits, got {room!r}")
    return room


def derive_room(room: str, index: int) -> str:
    """The room of the ``index``-th prompt of a multi-prompt request (both legs derive it alike)."""
    return f"{(int(room, 16) + index) % (1 << 128):032x}"


def room_to_bytes(room: str) -> bytes:
    return bytes.fromhex(room)


def room_from_bytes(data: bytes) -> str:
    return data.hex()


def done_notification(room: str) -> bytes:
    return DONE_PREFIX + room.encode()


def room_of_notification(message: bytes) -> Optional[str]:
    if message.startswith(DONE_PREFIX):
        return message[len(DONE_PREFIX):].decode(errors="replace")
    return None


# ---------------------------------------------------------------------------------------------
# Handshake: both sides must agree on these before any byte moves.
# ---------------------------------------------------------------------------------------------


class BufferInfo(msgspec.Struct, array_like=True, frozen=True):
    """One state buffer, in registry order: what a page of it is on this server."""
    group_id: int
    layer_name: str
    kind: str
    item_size: int
    dtype: str
    page_bytes: int
    page_stride: int = 0  # bytes from one page to the next (page_bytes when layer-major)
    offset: int = 0  # page-major: the buffer's byte offset in its group's page block


class StateLayout(msgspec.Struct, kw_only=True, frozen=True):
    """What must match between prefill and decode for pages to mean the same thing."""
    architecture: str
    model: dict[str, int]  # shape-defining config values (vocab, hidden size, layers)
    page_size: int
    num_groups: int
    buffers: list[BufferInfo]
    metadata_row_bytes: int
    kv_cache_layout: str = "layer-major"  # the device pools' layout (--kv-cache-layout)
    # the weights' quantization and how it computes (ModelInfo.quantization): an FP8 and a bf16
    # engine of one model compute different K/V, so their pages never mix
    quantization: str = "none"


def first_difference(local: StateLayout, remote: StateLayout, local_name: str = "local",
                     remote_name: str = "remote") -> Optional[str]:
    """A sentence naming the first field on which the layouts differ, or None when they agree."""
    def differ(field: str, mine, theirs) -> str:
        return f"{field}: {local_name} has {mine!r}, {remote_name} has {theirs!r}"

    for field in ("page_size", "architecture", "kv_cache_layout", "quantization"):
        if getattr(local, field) != getattr(remote, field):
            return differ(field, getattr(local, field), getattr(remote, field))
    for key in sorted(set(local.model) | set(remote.model)):
        if local.model.get(key) != remote.model.get(key):
            return differ(f"model.{key}", local.model.get(key), remote.model.get(key))
    if local.num_groups != remote.num_groups:
        return differ("number of state groups", local.num_groups, remote.num_groups)
    for index, (mine, theirs) in enumerate(zip(local.buffers, remote.buffers)):
        for field in BufferInfo.__struct_fields__:
            if getattr(mine, field) != getattr(theirs, field):
                return differ(f"state buffer {index} ({mine.layer_name}/{mine.kind}) {field}",
                              getattr(mine, field), getattr(theirs, field))
    if len(local.buffers) != len(remote.buffers):
        return differ("number of state buffers", len(local.buffers), len(remote.buffers))
    if local.metadata_row_bytes != remote.metadata_row_bytes:
        return differ("metadata row bytes", local.metadata_row_bytes, remote.metadata_row_bytes)
    return None


# ---------------------------------------------------------------------------------------------
# Control messages (tagged union, msgpack). Each carries the room it concerns.
# ---------------------------------------------------------------------------------------------


class RankAgent(msgspec.Struct, array_like=True, frozen=True):
    """One tensor-parallel rank's transfer agent: what a peer needs to write into its shard."""
    backend_metadata: bytes
    buffer_addresses: list[int]  # base address of each layout buffer, in layout order
    device: int
    scratch_address: int = 0  # where the prefill engine's same rank writes its warm-up bytes
    page_counts: list[int] = []  # pages of each layout buffer, in layout order (its pools' sizes)
    rows: list[int] = []  # rank 0: its metadata rows as [address, row bytes, number of rows]


class Hello(msgspec.Struct, kw_only=True, tag="hello"):
    """Decode -> prefill, once per connection: who I am and where my pages are."""
    room: str = NULL_ROOM
    sender: str  # the decode engine's id (also its ZMQ identity)
    layout: StateLayout
    backend: str
    backend_metadata: bytes  # the transfer backend's description of this agent
    buffer_addresses: list[int]  # base address of each layout buffer, in layout order
    device: int  # where the buffers live: -1 host memory, else the CUDA device index
    metadata_address: int  # base address of the metadata rows
    num_metadata_rows: int
    scratch_address: int = 0  # a few bytes the prefill server writes once, at handshake, to warm the pair
    page_counts: list[int] = []  # pages of each layout buffer, in layout order
    ranks: list[RankAgent] = []  # tensor parallelism: ranks 1 .. N-1 (rank 0 is the fields above)


class HelloReply(msgspec.Struct, kw_only=True, tag="hello_reply"):
    room: str = NULL_ROOM
    sender: str
    accepted: bool
    error: str = ""
    layout: Optional[StateLayout] = None


class Heartbeat(msgspec.Struct, kw_only=True, tag="heartbeat"):
    room: str = NULL_ROOM
    sender: str


class Destination(msgspec.Struct, kw_only=True, tag="destination"):
    """Decode -> prefill: the pages (one table per group, null entries skipped) and the
    metadata row the prefill server writes this request's state into."""
    room: str
    page_tables: list[list[int]]
    metadata_row: int
    num_prompt_tokens: int


class TransferFailed(msgspec.Struct, kw_only=True, tag="failed"):
    """Prefill -> decode: the transfer failed. ``drained``: no write of it is outstanding, so
    the destination pages may be released now; otherwise ``Drained`` follows."""
    room: str
    reason: str
    drained: bool


class AbortTransfer(msgspec.Struct, kw_only=True, tag="abort"):
    """Decode -> prefill: stop this transfer (the decode side failed or was aborted)."""
    room: str
    reason: str


class Drained(msgspec.Struct, kw_only=True, tag="drained"):
    """Prefill -> decode: nothing more will be written for this room."""
    room: str


ControlMessage = Union[Hello, HelloReply, Heartbeat, Destination, TransferFailed, AbortTransfer, Drained]
# Messages that may travel without a recipient (the decode side's first words to an address, and
# its heartbeats); every other one is bound to the receiving engine's id (``frames.py``).
UNBOUND_MESSAGES = (Hello, Heartbeat)
