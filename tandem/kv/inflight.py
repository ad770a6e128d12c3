"""In-flight operations' hold on pages (invariant I2): a PD write or receive, or a tier copy,
holds every page it reads or writes until it ends, so none of them is freed, reused or poisoned
under it.

Owner: the ``StateCoordinator`` (``coordinator.inflight``). The PD sides and the tiers take a hold
when they start an operation (``hold``) and give it back when it completes or fails
(``release``); the scheduler waits instead of preempting while holds exist (``any``: their pages
come back); the prefix cache's eviction counts cached pages that only holds keep as not
evictable (``held_cached_pages``); the sanitizer's books count every hold (``references``, I5).
"""
from __future__ import annotations

from typing import Iterator

from tandem.kv.block_pool import CACHE_OWNER, INFLIGHT_PREFIX, BlockPool
from tandem.kv.planner import NULL_PAGE


class InflightHolds:
    def __init__(self, pools: list[BlockPool]) -> None:
        self._pools = pools
        self._holds: dict[str, list[list[int]]] = {}  # owner tag -> held pages per group

    def hold(self, operation: str, page_tables: list[list[int]]) -> str:
        """Hold the pages of ``page_tables`` (one list per group; null pages skipped) for
        ``operation``; returns the owner tag ``release`` takes."""
        owner = f"{INFLIGHT_PREFIX}{operation}"
        live = [[page for page in pages if page != NULL_PAGE] for pages in page_tables]
        for pool, pages in zip(self._pools, live):
            pool.acquire(pages, owner)
        self._holds[owner] = live
        return owner

    def release(self, owner: str) -> None:
        for pool, pages in zip(self._pools, self._holds.pop(owner)):
            pool.release(pages, owner)

    def any(self) -> bool:
        """Pages are held for in-flight operations: they come back once those end."""
        return bool(self._holds)

    def references(self, group_index: int) -> Iterator[tuple[str, list[int]]]:
        """(owner tag, held pages) of every hold in one group (the books, I5)."""
        for owner, tables in self._holds.items():
            yield owner, tables[group_index]

    def held_cached_pages(self, group_index: int) -> int:
        """Unlocked cached pages that in-flight operations also hold: evicting them frees
        nothing until those end, so they are not evictable now."""
        if not self._holds:
            return 0
        pool = self._pools[group_index]
        pages = {page for tables in self._holds.values() for page in tables[group_index]}
        return sum(1 for page in pages if pool.holders(page)[CACHE_OWNER] > 0
                   and all(count <= 0 or owner == CACHE_OWNER or owner.startswith(INFLIGHT_PREFIX)
                           for owner, count in pool.holders(page).items()))
