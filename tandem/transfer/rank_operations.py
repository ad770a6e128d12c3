"""The PD part of a rank's work: what the PD side tells every rank's worker to do with its own
transfer agent, and what each answers (``tandem/disagg/pd_ranks.py`` says how both are used).

Rank 0's worker gets its operations in process (through its executor); the other ranks' travel
in a ``StepPlan`` of kind TRANSFER (no forward pass), which every worker answers with its
``TransferReport`` (msgpack, over the control group).
"""
from __future__ import annotations

import msgspec

from tandem.transfer.messages import RankAgent

PEER, WRITE, LAST, CANCEL = "peer", "write", "last", "cancel"


class TransferOperation(msgspec.Struct, array_like=True):
    # PEER: load a decode engine's agents; WRITE: write page pairs to it; LAST (rank 0): post its
    # held part of a write, with the metadata row and the completion notification; CANCEL: a write
    kind: str
    key: str  # PEER: the decode engine's id; WRITE/LAST/CANCEL: the write's key
    peer: str = ""  # WRITE: the decode engine's id
    agents: list[RankAgent] = []  # PEER: the decode engine's ranks (rank r takes entry r)
    pairs: list[list[tuple[int, int]]] = []  # WRITE: (source page, destination page) per state group
    hold: bool = False  # WRITE: not posted until this rank's LAST (rank 0's part of a transfer's last pages)
    row: list[tuple[int, int, int]] = []  # LAST: the metadata row's (source, destination, length), if any
    notification: bytes = b""  # LAST: delivered once every byte of the write landed


class WriteOutcome(msgspec.Struct, array_like=True):
    key: str  # a WRITE's key, or a PEER's decode engine id
    done: bool  # False: failed (``error`` says why)
    error: str = ""
    num_bytes: int = 0  # a WRITE's bytes moved by this rank


class TransferReport(msgspec.Struct, array_like=True):
    """A worker's answer to a TRANSFER plan: the operations that resolved since its last one."""
    outcomes: list[WriteOutcome] = []
