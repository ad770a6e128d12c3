"""Reading a waiting sequence's prefix from the disk store off the engine loop.

A prefix match that reaches the store used to read its pages in the engine loop, so every
running sequence stalled for the read. Now, before a waiting sequence is matched, the scheduler
asks ``pending``: the pages its prompt would take from the store (the path down the prefix tree,
then past the tree's end while the store holds the chain) are read by a thread, and the sequence
waits (the running ones keep stepping) until they are in. The thread only reads files (the store
is thread-safe); the engine loop then puts the payloads into host pages (``install``) right before
the match, which finds them host-resident and loads them to the device as any host hit. Nothing
is held while a read is in flight: no page is allocated until the payloads are back, so an
aborted sequence just forgets its read.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from tandem.kv.page_operations import DISK_PREFETCH, Outbox, PageOperation

READ_THREADS = 2
WAIT_WHEN_IDLE_SECONDS = 0.005  # nothing else to run: wait this long for a read before yielding


def read_chain(disk, keys: list[bytes]) -> dict[bytes, tuple[memoryview, str]]:
    """key -> (payload, origin) for ``keys`` in order, up to the first miss (in a reader thread)."""
    entries = {}
    for key in keys:
        entry = disk.read_entry(key)
        if entry is None:
            break
        entries[key] = entry
    return entries


class TierBooks(Protocol):
    """What a prefetch asks of the tiers' books (``hierarchy.py``'s ``TieredState`` is them)."""
    outbox: Outbox

    def disk_keys_to_read(self, token_ids: list[int], max_pages: int) -> list[bytes]:
        ...

    def install_chain(self, token_ids: list[int], max_pages: int, keys: list[bytes]) -> int:
        ...


class DiskPrefetch:
    """Reads in flight, one per waiting sequence (by owner): a DISK_PREFETCH each, which every
    rank's tier worker starts on its own reader thread (``tier_worker.py``); this rank's read is
    the one waited for here."""

    def __init__(self, tiers: TierBooks) -> None:
        self.tiers = tiers
        self.reads: dict[str, tuple[list[bytes], Future]] = {}  # owner -> its keys and this rank's read
        self.installed_pages = 0  # pages read this way (off the engine loop) so far

    def pending(self, owner: str, token_ids: list[int], max_pages: int, idle: bool = False) -> bool:
        """Whether the sequence ``owner`` must wait for its prefix to come from the store: a
        read is started if the store holds pages its match would take, and while one is in
        flight. When it is done, its payloads go into host pages and the answer is False.
        ``idle``: nothing else can run, so wait a little for the read here."""
        if owner not in self.reads:
            keys = self.tiers.disk_keys_to_read(token_ids, max_pages)
            if not keys:
                return False
            self.reads[owner] = (keys, self.tiers.outbox.send(PageOperation(DISK_PREFETCH, -1, [], keys)))
        keys, read = self.reads[owner]
        if not read.done() and idle:
            try:
                read.result(timeout=WAIT_WHEN_IDLE_SECONDS)
            except Exception:  # noqa: BLE001 - a timeout, or the read's own failure (seen below)
                pass
        if not read.done():
            return True
        del self.reads[owner]  # (an I/O failure is a miss: those pages are computed)
        self.installed_pages += self.tiers.install_chain(token_ids, max_pages, keys)
        return False

    def forget(self, owner: str) -> None:
        """The sequence ended or was aborted: its read's result is not wanted."""
        started = self.reads.pop(owner, None)
        if started is not None:
            started[1].cancel()

    @property
    def in_flight(self) -> int:
        return len(self.reads)

    def close(self) -> None:
        self.reads.clear()  # (the reader threads are the tier worker's)
