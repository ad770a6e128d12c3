"""The transfer state machine (I7): states only move forward; failure and abort end it.

Prefill side::

    WAITING --destination--> BOUND --first page write--> SENDING --prompt done, writes drained,
        metadata row posted--> FINISHING --metadata write done--> DONE

Decode side::

    WAITING --pages + row allocated, destination sent--> BOUND --completion notification,
        room checked--> DONE (committed)

Any non-terminal state may go to FAILED (something broke, on either side) or ABORTED (a client
or the peer gave up). Terminal states never change. Whether writes are still outstanding after
a failure is tracked beside the state (``Transfer.writes_outstanding`` on the prefill side,
``awaiting_drain`` on the decode side), because pages are released only once they are drained.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional


class TransferState(enum.IntEnum):
    WAITING = 0
    BOUND = 1
    SENDING = 2
    FINISHING = 3
    DONE = 4
    FAILED = 5
    ABORTED = 6

    @property
    def terminal(self) -> bool:
        return self >= TransferState.DONE


class TransferStateError(RuntimeError):
    """An illegal transition: a state machine moved backwards or out of a terminal state."""


@dataclass
class TransferStatus:
    """One transfer's position in the machine, with the time of every transition."""
    room: str
    state: TransferState = TransferState.WAITING
    reason: str = ""
    history: list[tuple[TransferState, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history.append((self.state, time.monotonic()))

    def advance(self, new_state: TransferState, reason: str = "") -> None:
        if self.state.terminal:
            raise TransferStateError(f"room {self.room}: {self.state.name} is terminal, cannot go to {new_state.name}")
        ending = new_state in (TransferState.FAILED, TransferState.ABORTED)
        if not ending and new_state <= self.state:
            raise TransferStateError(f"room {self.room}: cannot go back from {self.state.name} to {new_state.name}")
        self.state = new_state
        if reason:
            self.reason = reason
        self.history.append((new_state, time.monotonic()))

    def end(self, new_state: TransferState, reason: str) -> bool:
        """Fail or abort unless already terminal; returns whether this call ended it."""
        if self.state.terminal:
            return False
        self.advance(new_state, reason)
        return True

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def entered(self, state: TransferState) -> Optional[float]:
        for recorded, moment in self.history:
            if recorded == state:
                return moment
        return None
