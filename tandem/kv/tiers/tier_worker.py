"""The worker side of the tiers: a rank's host page blocks, its tier copy stream, its disk store,
and the tier page operations applied to them — the same class on every rank, rank 0 included.

The tiers' books (``hierarchy.TieredState``: which node lives where, what is held, when a copy is
done) emit SAVE, LOAD, FENCE, HOST_POISON and DISK_* operations (``kv/page_operations.py``);
every rank's ``TierWorker`` applies them in the same order to its own shard, so every rank moves
exactly the pages the books move, and each forward pass waits for its own rank's loads layer by
layer through the coordinator's ``PendingLoads`` (I3). On rank 0 a SAVE or LOAD returns its
``Transfer``, whose completion the books poll.

I2 across ranks: the books reuse a device page once rank 0's copy holding it is done; another
rank's copy may still be running. The FENCE the books emit then makes this rank's compute stream
wait for its own copy (on the device: no host wait; by then it has usually finished; on rank 0 it
is done already). Host pages are reused only by later copies on the same in-order tier stream;
poisoning one or writing it to disk waits for the copies that used it first.

The disk tier: each rank keeps its own store (``setup.store_location``: its shard of each page).
A DISK_WRITE writes this rank's host pages under the key once the save that filled them is done.
A DISK_PREFETCH starts a read on this rank's reader thread. Before the books install what was
read, every rank counts how many leading pages of the chain it has (``readable``: its reads,
finished here, or read now) and all take the smallest count (``keep``) — a page one rank lacks is
a miss on every rank, computed again, never a mix; each DISK_INSTALL then fills host pages from
the payload this rank kept.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from tandem.kv.page_operations import (DISK_INSTALL, DISK_PREFETCH, DISK_WRITE, FENCE, HOST_POISON, LOAD, SAVE,
                                       PageOperation)
from tandem.kv.planner import NULL_PAGE
from tandem.kv.tiers.copy_stream import Ticket, TierStream
from tandem.kv.tiers.disk_pages import copy_payload, encode_payload, payload_mask
from tandem.kv.tiers.host_pool import HostPages, layouts_of
from tandem.kv.tiers.page_mover import TierMover, Transfer
from tandem.kv.tiers.prefetch import READ_THREADS, read_chain

logger = logging.getLogger(__name__)

MAX_READS_KEPT = 64  # reads started whose agreement has not come (an aborted prompt's never does)


class TierWorker:
    """Owner: each rank builds one (``engine/ranks/build.py``) and attaches it to its coordinator's
    ``PageExecutor``; on rank 0 the ``TieredState`` holds it too (its completions, its reads)."""

    def __init__(self, coordinator, host_pages: int, device: torch.device, disk=None) -> None:
        self.pending_loads = coordinator.pending_loads
        self.host = HostPages(layouts_of(coordinator.registry), host_pages, pin=device.type == "cuda",
                              sanitize=coordinator.sanitizer.enabled)
        self.stream = TierStream(device)
        self.mover = TierMover(coordinator.registry, self.host, self.stream, device)
        self.copies: dict[int, Ticket] = {}  # copy id -> its completion, until its FENCE
        self.host_page_copies: dict[tuple[int, int], Ticket] = {}  # (group, host page) -> the last copy using it
        self.disk = disk if disk is not None and disk.available else None
        self.readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tandem-disk-read") \
            if self.disk is not None else None
        self.reads: "OrderedDict[tuple[bytes, ...], Future]" = OrderedDict()  # keys -> their read
        self.payloads: dict[bytes, tuple[torch.Tensor, str]] = {}  # the latest count's: key -> (payload, origin)
        self.agreed: dict[bytes, torch.Tensor] = {}  # payloads every rank has, until installed
        self._kinds = {SAVE: self._save, LOAD: self._load, FENCE: self._fence, HOST_POISON: self._poison_host,
                       DISK_PREFETCH: self._start_read, DISK_WRITE: self._write, DISK_INSTALL: self._install}

    def apply(self, operation: PageOperation):
        return self._kinds[operation.kind](operation)

    # -- the host tier ----------------------------------------------------------------------------
    def _save(self, operation: PageOperation) -> Transfer:
        return self._issued(operation, self.mover.save(operation.moves))

    def _load(self, operation: PageOperation) -> Transfer:
        return self._issued(operation, self.mover.load(operation.moves, self.pending_loads))

    def _issued(self, operation: PageOperation, transfer: Transfer) -> Transfer:
        (copy_id,) = operation.pages
        self.copies[copy_id] = transfer.ticket  # (the stream runs in order: the last ticket is the copy's)
        for move in operation.moves:
            for page in move.host_pages:
                self.host_page_copies[move.group, page] = transfer.ticket
        return transfer

    def _fence(self, operation: PageOperation) -> None:
        ticket = self.copies.pop(operation.pages[0], None)
        if ticket is not None and not ticket.done():
            ticket.order_reader()

    def _wait_for_host_pages(self, pages: list[tuple[int, int]], forget: bool) -> None:
        """Wait for the copies that last used these (group, host page)s (on rank 0: done already)."""
        tickets = {}
        for key in pages:
            ticket = self.host_page_copies.pop(key, None) if forget else self.host_page_copies.get(key)
            if ticket is not None:
                tickets[id(ticket)] = ticket
        for ticket in tickets.values():
            if not ticket.done():
                ticket.wait()

    def _poison_host(self, operation: PageOperation) -> None:
        group = operation.group_id  # a copy still reading these pages runs first
        self._wait_for_host_pages([(group, page) for page in operation.pages], forget=True)
        self.host.poison(group, operation.pages)

    # -- the disk tier ----------------------------------------------------------------------------
    def _start_read(self, operation: PageOperation) -> Optional[Future]:
        if self.disk is None:
            return None
        read = self.reads[tuple(operation.keys)] = self.readers.submit(read_chain, self.disk, list(operation.keys))
        while len(self.reads) > MAX_READS_KEPT:
            self.reads.popitem(last=False)[1].cancel()
        return read

    def _write(self, operation: PageOperation) -> None:
        if self.disk is None:
            return
        self._wait_for_host_pages([(group, page) for group, page in enumerate(operation.pages)  # (their saves)
                                    if page != NULL_PAGE], forget=False)
        self.disk.write_async(operation.keys[0], encode_payload(self.host, operation.pages))

    def readable(self, keys: list[bytes]) -> int:
        """How many leading pages of ``keys`` this rank has: the reads started for them, finished
        now, and whatever they lack read here; kept until ``keep``."""
        self.payloads = {}
        if self.disk is None or not keys:
            return 0
        entries: dict[bytes, tuple] = {}
        for started in [started for started in self.reads if started[0] == keys[0]]:
            try:
                entries.update(self.reads.pop(started).result())
            except Exception:  # noqa: BLE001 - an I/O failure (or a cancelled read) is a miss
                pass
        for key in keys:
            entry = entries.get(key) or self.disk.read_entry(key)
            if entry is None:
                break
            data = torch.frombuffer(entry[0], dtype=torch.uint8)
            if payload_mask(data, self.host.layouts) is None:
                logger.warning("disk tier: page %s does not match this layout; treated as a miss", key.hex())
                break
            self.payloads[key] = (data, entry[1])
        return len(self.payloads)

    def keep(self, count: int) -> dict[bytes, tuple[list[int], str]]:
        """Every rank has the first ``count`` pages it counted: keep those for the installs.
        Returns them, key -> (presence per group, who wrote them), in chain order."""
        kept = list(self.payloads.items())[:count]
        self.agreed = {key: data for key, (data, _) in kept}
        self.payloads = {}
        return {key: (payload_mask(data, self.host.layouts), origin) for key, (data, origin) in kept}

    def _install(self, operation: PageOperation) -> None:
        key, host_pages = operation.keys[0], operation.pages
        data = self.agreed.pop(key, None)
        if data is None:
            raise RuntimeError(f"disk tier: page {key.hex()} installed, which this rank did not agree to have")
        if [int(page != NULL_PAGE) for page in host_pages] != payload_mask(data, self.host.layouts):
            raise RuntimeError(f"disk tier: page {key.hex()} holds other groups on this rank than the books say")
        copy_payload(self.host, data, host_pages)

    # -- lifetime ---------------------------------------------------------------------------------
    def poll(self) -> None:
        if self.disk is not None:
            self.disk.poll()

    def drain(self) -> None:
        """Wait for every copy and store write issued so far."""
        self.stream.synchronize()
        if self.disk is not None:
            self.disk.drain()
            self.disk.poll()

    def close(self) -> None:
        self.stream.close()
        if self.readers is not None:
            self.readers.shutdown(wait=True, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()
