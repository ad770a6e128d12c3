"""Per-transfer bookkeeping of both PD sides: what each remembers about a room and its peer.

Owner: a side's ``transfers`` (and, on the decode side, ``draining``) dicts hold these records
from ``add`` until the room is forgotten; a record owns no memory itself, only the names of the
in-flight holds (``PendingWrite.owner``, ``DecodeTransfer.hold_owner``) its side must release.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tandem.protocol import RequestDelta
from tandem.scheduler.sequence import Sequence
from tandem.transfer.connector import WriteStatus
from tandem.transfer.descriptors import WritePlanner
from tandem.transfer.messages import Destination
from tandem.transfer.state import TransferStatus


# -- prefill side ---------------------------------------------------------------------------------


@dataclass
class PendingWrite:
    """A write, posted to every rank with a part of it (``pd_ranks.RankFanOut``, by ``key``), and
    the in-flight reference holding its source pages (``owner``; None: no pages). A ``final``
    write (the pages the prompt's last chunk completed) goes to the workers at once but rank 0
    holds its part: that part travels with the metadata row and the completion notification, in
    one write (``last``: posted), once every earlier write is done and the workers' parts landed.
    Once every rank's part resolved: ``status``, ``error`` and the bytes every rank moved."""
    key: str
    owner: Optional[str]
    final: bool = False
    last: bool = False
    posted_at: float = 0.0
    status: Optional[WriteStatus] = None
    error: str = ""
    num_bytes: int = 0


@dataclass
class DecodePeer:
    """A decode engine that said hello: where its metadata rows are, and the planner of page
    writes into its rank 0's pages (made once, at the handshake; every rank plans its own)."""
    identity: str
    planner: WritePlanner
    metadata_address: int
    row_bytes: int
    num_rows: int
    last_seen: float
    dead: bool = False


@dataclass(eq=False)
class PrefillTransfer:
    room: str
    sequence: Sequence
    status: TransferStatus
    created: float
    peer: Optional[DecodePeer] = None
    destination: Optional[Destination] = None
    sent: list[set[int]] = field(default_factory=list)
    # computed before the destination came: final entries per group (index -> page), their holds
    unsent: list[dict[int, int]] = field(default_factory=list)
    unsent_holds: list[str] = field(default_factory=list)
    unsent_done: bool = False  # the prompt's last chunk is among them
    writes: list[PendingWrite] = field(default_factory=list)
    metadata_write: Optional[PendingWrite] = None  # the last write: final pages, the row, the notification
    local_row: Optional[int] = None
    # the row was filled as the first token was sampled (``PrefillWrites.prepare_row``): its
    # copies' event, which the last write waits for (None in host memory)
    row_prepared: bool = False
    row_ready: Optional[object] = None
    first_delta: Optional[RequestDelta] = None
    bound_at: float = 0.0
    first_write_at: float = 0.0
    first_token_at: float = 0.0  # the first-token delta came (the prompt is computed)
    ended_at: float = 0.0
    bytes_written: int = 0
    num_writes: int = 0
    notify_drained: bool = False  # the decode side waits for Drained once writes resolve
    suppress_delta: bool = False  # the frontend aborted the request: no delta goes out

    @property
    def outstanding(self) -> bool:
        return bool(self.writes) or self.metadata_write is not None


# -- decode side ----------------------------------------------------------------------------------


@dataclass
class PrefillLink:
    """This engine's connection to one prefill engine."""
    address: str
    since: float
    last_seen: float
    ready: bool = False
    agent: str = ""  # the prefill engine's agent name (the sender of its notifications)


@dataclass(eq=False)
class DecodeTransfer:
    room: str
    sequence: Sequence
    address: str
    status: TransferStatus
    created: float
    row: Optional[int] = None
    bound_at: float = 0.0
    hold_owner: Optional[str] = None  # in-flight hold of the destination pages after a failure
    drain_deadline: float = 0.0
    num_bytes: int = 0
    suppress_delta: bool = False
    held_back: bool = False  # it waited for admission at least once
