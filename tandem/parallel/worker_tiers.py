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
poisoning one waits for the stream first (sanitizer mode only). The disk tier is not shared by
ranks (``config.py`` refuses it with tensor parallelism).
"""
from __future__ import annotations

from typing import Optional

import torch

from tandem.kv.tiers.copy_stream import Ticket, TierStream
from tandem.kv.tiers.host_pool import HostPool, layouts_of
from tandem.kv.tiers.page_mover import Move, TierMover
from tandem.parallel.plan import FENCE, HOST_POISON, LOAD, SAVE, PageOperation


class WorkerTiers:
    def __init__(self, coordinator, host_pages: int, device: torch.device) -> None:
        self.pending_loads = coordinator.pending_loads
        self.host = HostPool(layouts_of(coordinator.registry), host_pages, pin=device.type == "cuda",
                             sanitize=coordinator.sanitizer.enabled)
        self.stream = TierStream(device)
        self.mover = TierMover(coordinator.registry, self.host, self.stream, device)
        self.last: Optional[Ticket] = None  # the latest copy's completion (the stream runs in order)
        self.copies = 0

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
        else:
            raise RuntimeError(f"tensor parallelism: unknown page operation {operation.kind!r}")

    def close(self) -> None:
        self.stream.close()
