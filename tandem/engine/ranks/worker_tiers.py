"""A worker rank's host tier: as many host pages as rank 0's, each holding this rank's shard of
the page, and the same copies, driven by rank 0's plans.

Rank 0 keeps every book (which node lives where, what is held, when a copy is done); its
``TieredState`` journals each copy it issues (a save, or a load registered layer by layer), each
release of device pages a copy held, and each host page it poisons (``plan.py``). A worker
replays them in order with its own ``TierMover`` on its own tier stream, so it moves exactly the
pages rank 0 moves, and its forward pass waits for its own loads layer by layer through the
coordinator's pending loads (I3) as rank 0's does.

I2 across ranks: rank 0 reuses a device page once *its* copy of that page is done; this rank's copy
may still be running. A FENCE, journaled where rank 0 releases the pages, makes this rank's compute
stream wait for every tier copy issued so far (on the device: no host wait; by then it has
usually finished). Host pages are reused only by later copies on the same in-order tier stream;
poisoning one waits for the stream first (sanitizer mode only).

The disk tier: each rank keeps its own store (``setup.store_location``: its shard of each page).
A node rank 0 writes, this rank writes from its own host pages under the same key once its tier
stream has finished (the save that filled them). A read rank 0 starts (DISK_PREFETCH), this rank
starts on its own reader thread; before rank 0 installs what it read, a DISK plan asks every
rank how many leading pages of the chain it has (its reads, finished here, or read now), and all
take the smallest count — a page one rank lacks is a miss on every rank, computed again, never a
mix. The payloads agreed on wait here for rank 0's DISK_INSTALL, which names their host pages.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from tandem.kv.planner import NULL_PAGE
from tandem.kv.tiers.copy_stream import Ticket, TierStream
from tandem.kv.tiers.disk_pages import copy_payload, encode_payload, payload_mask
from tandem.kv.tiers.host_pool import HostPool, layouts_of
from tandem.kv.tiers.page_mover import Move, TierMover
from tandem.kv.tiers.prefetch import READ_THREADS, read_chain
from tandem.engine.ranks.plan import (DISK_INSTALL, DISK_PREFETCH, DISK_WRITE, FENCE, HOST_POISON, LOAD, SAVE,
                                  PageOperation)

logger = logging.getLogger("tandem.parallel")

MAX_READS_KEPT = 64  # reads rank 0 started whose agreement has not come (an aborted prompt's never does)


class WorkerTiers:
    def __init__(self, coordinator, host_pages: int, device: torch.device, disk=None) -> None:
        self.pending_loads = coordinator.pending_loads
        self.host = HostPool(layouts_of(coordinator.registry), host_pages, pin=device.type == "cuda",
                             sanitize=coordinator.sanitizer.enabled)
        self.stream = TierStream(device)
        self.mover = TierMover(coordinator.registry, self.host, self.stream, device)
        self.last: Optional[Ticket] = None  # the latest copy's completion (the stream runs in order)
        self.copies = 0
        self.disk = disk if disk is not None and disk.available else None
        self.readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tandem-disk-read") \
            if self.disk is not None else None
        self.reads: "OrderedDict[tuple[bytes, ...], Future]" = OrderedDict()  # keys -> their read
        self.payloads: dict[bytes, torch.Tensor] = {}  # the latest DISK plan's, counted
        self.agreed: dict[bytes, torch.Tensor] = {}  # payloads every rank has, until rank 0 installs them

    def replay(self, operation: PageOperation) -> None:
        if operation.kind in (SAVE, LOAD):
            half = len(operation.pages) // 2
            moves = [Move(operation.group_id, operation.pages[:half], operation.pages[half:])]
            transfer = (self.mover.load(moves, self.pending_loads) if operation.kind == LOAD
                        else self.mover.save(moves))
            self.last = transfer.ticket
            self.copies += 1
        elif operation.kind == FENCE:
            if self.last is not None:
                self.last.order_reader()
        elif operation.kind == HOST_POISON:
            self.stream.synchronize()  # a copy still reading these pages runs first
            self.host.poison(operation.group_id, operation.pages)
        elif operation.kind == DISK_PREFETCH:
            self._start_read(operation.keys)
        elif operation.kind == DISK_WRITE:
            self._write(operation.keys[0], operation.pages)
        elif operation.kind == DISK_INSTALL:
            self._install(operation.keys[0], operation.pages)
        else:
            raise RuntimeError(f"tensor parallelism: unknown page operation {operation.kind!r}")

    # -- the disk tier ----------------------------------------------------------------------------
    def _start_read(self, keys: list[bytes]) -> None:
        if self.disk is None:
            return
        self.reads[tuple(keys)] = self.readers.submit(read_chain, self.disk, list(keys))
        while len(self.reads) > MAX_READS_KEPT:
            self.reads.popitem(last=False)[1].cancel()

    def readable(self, keys: list[bytes]) -> int:
        """How many leading pages of ``keys`` this rank has (a DISK plan): the reads started for
        them, finished now, and whatever they lack read here; kept until rank 0 installs them."""
        if self.disk is None or not keys:
            return 0
        entries: dict[bytes, tuple] = {}
        for started in [started for started in self.reads if started[0] == keys[0]]:
            try:
                entries.update(self.reads.pop(started).result())
            except Exception:  # noqa: BLE001 - an I/O failure is a miss
                pass
        payloads: dict[bytes, torch.Tensor] = {}
        for key in keys:
            entry = entries.get(key) or self.disk.read_entry(key)
            data = torch.frombuffer(entry[0], dtype=torch.uint8) if entry is not None else None
            if data is None or payload_mask(data, self.host.layouts) is None:
                break
            payloads[key] = data
        self.payloads = payloads
        return len(payloads)

    def keep(self, count: int) -> None:
        """Every rank has the first ``count`` pages it counted: keep those for the installs."""
        self.agreed = dict(list(self.payloads.items())[:count])
        self.payloads = {}

    def _install(self, key: bytes, host_pages: list[int]) -> None:
        data = self.agreed.pop(key, None)
        if data is None:
            raise RuntimeError(f"tensor parallelism: rank 0 installed disk page {key.hex()}, which this rank "
                               "did not agree to have")
        mask = payload_mask(data, self.host.layouts)
        if [int(page != NULL_PAGE) for page in host_pages] != mask:
            raise RuntimeError(f"tensor parallelism: disk page {key.hex()} holds other groups here than on rank 0")
        copy_payload(self.host, data, host_pages)

    def _write(self, key: bytes, host_pages: list[int]) -> None:
        if self.disk is None:
            return
        self.stream.synchronize()  # the save that filled these host pages has landed
        self.disk.write_async(key, encode_payload(self.host, host_pages))

    def poll(self) -> None:
        if self.disk is not None:
            self.disk.poll()

    def close(self) -> None:
        self.stream.close()
        if self.readers is not None:
            self.readers.shutdown(wait=True, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()
