"""Page operations: what the books ask of a rank's buffers outside the forward pass, and the one
executor that carries them out on every rank.

The books (the coordinator, the host and disk tiers' ``TieredState``) never touch a tensor to
move a page: they emit a ``PageOperation`` into their rank's ``Outbox``. The outbox hands it to
the rank's ``PageExecutor`` at once (so rank 0's timing and outputs are those of a direct call)
and, under tensor parallelism, records it too: the recorded operations travel in the next step
message (``engine/ranks/plan.py``), and every other rank applies them, in order, through its own
``PageExecutor``. A page-moving feature is therefore written once, here (copies, poison) and in
``tiers/tier_worker.py`` (the tiers' kinds), and runs the same on every rank.

    books ──PageOperation──▶ Outbox ──apply──▶ PageExecutor (this rank's shard)
                               │
                               └─record─▶ step message ──▶ PageExecutor (rank 1 .. N-1)

Kinds (``PageOperation.kind``):

- COPY: ``pages == [source, destination]``: one page of ``group_id`` copied across every buffer of
  the group (it reads the group's state, so it waits for the group's pending loads first, I3).
- POISON: the device pages of ``group_id`` freed (sanitizer mode: filled with poison, I6).
- SAVE / LOAD: ``pages == [copy id]``; ``moves``: per group, device pages and as many host pages
  (device → host / host → device, the loads layer by layer behind ``PendingLoads``, I3).
- FENCE: ``pages == [copy id]``: the books observed that copy's completion and release the pages it
  held; this rank's compute stream waits for its own copy first (I2 across ranks).
- HOST_POISON: host pages of ``group_id`` freed (sanitizer mode), once the copies using them are done.
- DISK_PREFETCH: ``keys`` read from this rank's store on a reader thread.
- DISK_WRITE / DISK_INSTALL: ``pages``: the host pages (one per group, 0 where absent) of ``keys[0]``
  written to this rank's store / filled from the payload every rank agreed it read.
"""
from __future__ import annotations

from typing import Any, Optional

import msgspec

from tandem.kv.accessor import PendingLoads
from tandem.kv.registry import StateRegistry
from tandem.kv.sanitizer import Sanitizer

COPY, POISON = "copy", "poison"
SAVE, LOAD, FENCE, HOST_POISON = "save", "load", "fence", "host_poison"  # the host tier's
DISK_PREFETCH, DISK_WRITE, DISK_INSTALL = "disk_prefetch", "disk_write", "disk_install"  # the disk tier's
TIER_KINDS = frozenset({SAVE, LOAD, FENCE, HOST_POISON, DISK_PREFETCH, DISK_WRITE, DISK_INSTALL})


class PageMove(msgspec.Struct, array_like=True):
    """Pages of one group: device page ``device_pages[i]`` ⇄ host page ``host_pages[i]``."""
    group: int
    device_pages: list[int]
    host_pages: list[int]


class PageOperation(msgspec.Struct, array_like=True):
    """One page operation (the kinds: the module docstring)."""
    kind: str
    group_id: int
    pages: list[int]
    keys: list[bytes] = []
    moves: list[PageMove] = []


class PageExecutor:
    """Applies page operations to this rank's shard: its registry's buffers (COPY, POISON through
    the sanitizer) and its side of the tiers (``tiers``: ``kv/tiers/tier_worker.TierWorker``, for
    every other kind). Owner: the coordinator makes one per rank and hands it to its outbox."""

    def __init__(self, registry: StateRegistry, sanitizer: Sanitizer, pending_loads: PendingLoads) -> None:
        self.registry = registry
        self.sanitizer = sanitizer
        self.pending_loads = pending_loads
        self.tiers: Optional[Any] = None  # this rank's TierWorker, when a host tier is configured

    def attach_tiers(self, tiers) -> None:
        self.tiers = tiers

    def apply(self, operation: PageOperation) -> Any:
        """Carry out one operation; returns what completes asynchronously (a tier copy's
        ``Transfer``, a read's future), else None."""
        if operation.kind == COPY:
            return self.copy_page(operation.group_id, *operation.pages)
        if operation.kind == POISON:
            return self.sanitizer.poison(operation.group_id, operation.pages)
        if operation.kind not in TIER_KINDS:
            raise RuntimeError(f"page operations: unknown kind {operation.kind!r}")
        if self.tiers is None:
            raise RuntimeError(f"page operations: a tier operation ({operation.kind}) on a rank without a host tier")
        return self.tiers.apply(operation)

    def apply_all(self, operations: list[PageOperation]) -> None:
        for operation in operations:
            self.apply(operation)

    def copy_page(self, group_id: int, source: int, destination: int) -> None:
        """Mover: copy one page across every buffer of the group (iterates the registry); it
        reads the group's state, so it first waits for the group's pending loads (I3)."""
        for layer_name in self.registry.groups[group_id].layer_names:
            self.pending_loads.wait(layer_name)
        for descriptor in self.registry.buffers(group_id):
            descriptor.tensor[destination].copy_(descriptor.tensor[source])


class Outbox:
    """A rank's page operations: each is applied at once by the rank's ``PageExecutor`` and,
    once ``record_for_other_ranks`` was called (tensor parallelism, rank 0), recorded for the
    next step message (``take``). With one rank it only applies."""

    def __init__(self, executor: PageExecutor) -> None:
        self.executor = executor
        self.recording = False
        self._recorded: list[PageOperation] = []

    def record_for_other_ranks(self) -> None:
        self.recording = True

    def send(self, operation: PageOperation) -> Any:
        """Apply ``operation`` here (returns the executor's completion handle) and record it."""
        result = self.executor.apply(operation)
        if self.recording:
            self._recorded.append(operation)
        return result

    def pending(self) -> bool:
        return bool(self._recorded)

    def take(self) -> list[PageOperation]:
        """The operations recorded since the last ``take``, in order."""
        operations, self._recorded = self._recorded, []
        return operations
