"""The PD part of a tensor-parallel plan: what rank 0 tells the workers to do with their own
transfer agents, and what they answer (``tandem/disagg/pd_ranks.py`` says how both are used).

Operations travel in a ``StepPlan`` of kind TRANSFER (no forward pass); every worker answers
such a plan with its ``TransferReport`` (msgpack, over the control group).
"""
from __future__ import annotations

import msgspec

from tandem.transfer.messages import RankAgent

PEER, WRITE, CANCEL = "peer", "write", "cancel"


class TransferOperation(msgspec.Struct, array_like=True):
    kind: str  # PEER: load a decode engine's agents; WRITE: write page pairs to it; CANCEL: a write
    key: str  # PEER: the decode engine's id; WRITE/CANCEL: the write's key
    peer: str = ""  # WRITE: the decode engine's id
    agents: list[RankAgent] = []  # PEER: the decode engine's ranks 1 .. N-1 (worker r takes entry r - 1)
    pairs: list[list[tuple[int, int]]] = []  # WRITE: (source page, destination page) per state group


class WriteOutcome(msgspec.Struct, array_like=True):
    key: str  # a WRITE's key, or a PEER's decode engine id
    done: bool  # False: failed (``error`` says why)
    error: str = ""
    num_bytes: int = 0  # a WRITE's bytes moved by this rank


class TransferReport(msgspec.Struct, array_like=True):
    """A worker's answer to a TRANSFER plan: the operations that resolved since its last one."""
    outcomes: list[WriteOutcome] = []
