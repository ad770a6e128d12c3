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

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.kv.tiers.hierarchy import TieredState

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


class DiskPrefetch:
    """Reads in flight, one per waiting sequence (by owner)."""

    def __init__(self, tiers: "TieredState") -> None:
        self.tiers = tiers
        self.readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tandem-disk-read")
        self.reads: dict[str, Future] = {}  # owner -> its read
        self.installed_pages = 0  # pages read this way (off the engine loop) so far

    def pending(self, owner: str, token_ids: list[int], max_pages: int, idle: bool = False) -> bool:
        """Whether the sequence ``owner`` must wait for its prefix to come from the store: a
        read is started if the store holds pages its match would take, and while one is in
        flight. When it is done, its payloads go into host pages and the answer is False.
        ``idle``: nothing else can run, so wait a little for the read here."""
        read = self.reads.get(owner)
        if read is None:
            keys = self.tiers.disk_keys_to_read(token_ids, max_pages)
            if not keys:
                return False
            read = self.reads[owner] = self.readers.submit(read_chain, self.tiers.disk, keys)
            mirror = self.tiers.coordinator.mirror
            if mirror is not None:  # tensor parallelism: the other ranks start reading their shards too
                mirror.disk_prefetch(keys)
        if not read.done() and idle:
            try:
                read.result(timeout=WAIT_WHEN_IDLE_SECONDS)
            except Exception:  # noqa: BLE001 - a timeout, or the read's own failure (seen below)
                pass
        if not read.done():
            return True
        del self.reads[owner]
        try:
            entries = read.result()
        except Exception:  # noqa: BLE001 - an I/O failure is a miss: those pages are computed
            entries = {}
        self.installed_pages += self.tiers.install_chain(token_ids, max_pages, entries)
        return False

    def forget(self, owner: str) -> None:
        """The sequence ended or was aborted: its read's result is not wanted."""
        read = self.reads.pop(owner, None)
        if read is not None:
            read.cancel()

    @property
    def in_flight(self) -> int:
        return len(self.reads)

    def close(self) -> None:
        self.reads.clear()
        self.readers.shutdown(wait=True, cancel_futures=True)
