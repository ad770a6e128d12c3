"""A pool of pages with a reference count and owner tags per page.

Owner: the coordinator (one pool per state group). Every reference carries an owner tag: a
sequence key (``"req#0"``), ``"cache"`` for the prefix cache, or ``"inflight:<op>"`` for an
asynchronous operation. A page returns to the free list only when its last reference is
released (I2); releasing a reference the owner does not hold is a double free and raises.
Freed pages are handed to ``on_free`` (the sanitizer poisons them, I6).
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Iterable, Optional

from tandem.kv.planner import NULL_PAGE


class SanitizerError(AssertionError):
    """A broken state invariant: a leak, a double free, a stale read, unbalanced books."""


class OutOfPagesError(RuntimeError):
    pass


CACHE_OWNER = "cache"
INFLIGHT_PREFIX = "inflight:"


def any_short(pools: Iterable["BlockPool"], needed: Iterable[int]) -> bool:
    """Whether some pool has fewer free pages than ``needed`` of it (one count per pool)."""
    return any(pool.num_free < count for pool, count in zip(pools, needed))


class BlockPool:
    def __init__(self, group_id: int, num_pages: int,
                 on_free: Optional[Callable[[int, list[int]], None]] = None) -> None:
        self.group_id = group_id
        self.num_pages = num_pages
        self._on_free = on_free
        self._free: deque[int] = deque(p for p in range(num_pages) if p != NULL_PAGE)
        self._holders: list[Counter] = [Counter() for _ in range(num_pages)]

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return sum(self._holders[page].values())

    def holders(self, page: int) -> Counter:
        return self._holders[page]

    def allocate(self, count: int, owner: str) -> list[int]:
        if count > len(self._free):
            raise OutOfPagesError(f"group {self.group_id}: need {count} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._holders[page][owner] += 1
        return pages

    def acquire(self, pages: Iterable[int], owner: str) -> None:
        """Take another reference on pages that are already live (the null page, which
        sparse prefix-cache entries hold, is never counted: skipped)."""
        for page in pages:
            if page == NULL_PAGE:
                continue
            if not self._holders[page]:
                raise SanitizerError(f"group {self.group_id}: acquire of free page {page} by {owner}")
            self._holders[page][owner] += 1

    def release(self, pages: Iterable[int], owner: str) -> list[int]:
        """Drop ``owner``'s reference on each page; returns the pages that became free."""
        freed = []
        for page in pages:
            if page == NULL_PAGE:
                continue
            holders = self._holders[page]
            if holders[owner] <= 0:
                raise SanitizerError(
                    f"group {self.group_id}: double free of page {page} by {owner!r} "
                    f"(holders: {dict(holders) or 'none'})")
            holders[owner] -= 1
            if holders[owner] == 0:
                del holders[owner]
            if not holders:
                freed.append(page)
        if freed:
            if self._on_free is not None:
                self._on_free(self.group_id, freed)
            self._free.extend(freed)
        return freed

    def check_owner(self, owner: str, pages: Iterable[int]) -> None:
        """Every page must be held by ``owner`` (I6 owner tags, checked on gather)."""
        for page in pages:
            if page != NULL_PAGE and self._holders[page][owner] <= 0:
                raise SanitizerError(
                    f"group {self.group_id}: {owner!r} reads page {page} it does not hold "
                    f"(holders: {dict(self._holders[page]) or 'none: the page is free'})")

    def census(self) -> dict[str, int]:
        """Classify every usable page once: free, used (a sequence holds it), cached, in flight."""
        counts = {"free": 0, "used": 0, "cached": 0, "inflight": 0}
        for page in range(self.num_pages):
            if page == NULL_PAGE:
                continue
            holders = self._holders[page]
            if not holders:
                counts["free"] += 1
            elif any(not (o == CACHE_OWNER or o.startswith(INFLIGHT_PREFIX)) for o in holders):
                counts["used"] += 1
            elif CACHE_OWNER in holders:
                counts["cached"] += 1
            else:
                counts["inflight"] += 1
        return counts

    def free_list_consistent(self) -> bool:
        free_set = set(self._free)
        return len(free_set) == len(self._free) and all(
            (not self._holders[p]) == (p in free_set) for p in range(self.num_pages) if p != NULL_PAGE)
