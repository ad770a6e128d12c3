"""A step whose forward pass and sampling have been launched on the device but whose tokens
have not been read back yet (the overlapped engine loop keeps one such step in flight). It holds
no tensor: the handle of the tokens' copy to the host, and host books.

Owned by the engine core from launch until it is completed. ``held`` lists sequences that
finished while the step still computed for them: their pages are released only when the step
is completed, after the device has finished with it (I2).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tandem.scheduler.scheduler import ScheduledChunk
from tandem.scheduler.sequence import Sequence
from tandem.worker.sampler import HostSamplerOutput
from tandem.worker.step_inputs import PendingTokens


@dataclass(eq=False)
class LaunchedStep:
    chunks: list[ScheduledChunk]
    prompt_logprobs: dict  # id(chunk) -> that chunk's prompt logprobs
    sequences: list[Sequence] = field(default_factory=list)  # the sampled rows, in order
    positions: list[int] = field(default_factory=list)  # where each row's pending token stands
    host: Optional[HostSamplerOutput] = None  # the sampled tokens' copy to the host, in flight (rank 0's
    # worker keeps them on its device too: the next step's pending input tokens)
    held: list[Sequence] = field(default_factory=list)
    computed: bool = False  # the scheduler has booked its chunks as computed
    # The previous step's deltas, when it was completed during this step's launch (a grammar's
    # mask needed its tokens).
    earlier_deltas: list = field(default_factory=list)
    started: float = 0.0  # time.perf_counter() when the step began to be scheduled
    _members: Optional[set[int]] = field(default=None, repr=False)  # ids, built on first use

    def includes(self, sequence: Sequence) -> bool:
        """Whether the step computes for ``sequence`` (a chunk of it, or a sampled row)."""
        if self._members is None:
            self._members = {id(chunk.sequence) for chunk in self.chunks} | {id(row) for row in self.sequences}
        return id(sequence) in self._members

    def pending_tokens(self) -> Optional[PendingTokens]:
        """The step's sampled rows, whose tokens the next step reads on rank 0's device."""
        if not self.sequences:
            return None
        return PendingTokens(self.sequences)
