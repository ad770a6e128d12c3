"""Sanitizer mode (docs/design.md I5, I6): poison freed pages, balance the books after every step,
check owner tags on gather, and prove everything is free once idle.

Owner: the coordinator creates one; it is a no-op when disabled except for the checks that
cost nothing (double frees always raise, in the block pool).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Optional, Protocol

import torch

from tandem.kv.block_pool import CACHE_OWNER, BlockPool, SanitizerError
from tandem.kv.registry import StateRegistry


class Books(Protocol):
    """What the checks read of the page books (``kv/coordinator.py``'s ``StateCoordinator`` is
    one): the pools, the prefix cache and the pages held by in-flight operations."""
    pools: list[BlockPool]
    prefix_cache: Optional[Any]  # kv/prefix_cache.py PrefixCache

    def inflight_references(self, group_index: int) -> Iterable[tuple[str, list[int]]]:
        ...


POISON_BYTE = 0xA5  # integer and byte-packed buffers (the indexer's FP8 keys + scales): a fixed pattern
FP8_NAN_BYTE = 0x7F  # NaN in float8 e4m3fn (and e5m2): FP8 K/V pages poison to NaN like wider floats


def poison_byte(dtype: torch.dtype) -> int:
    """The byte a poisoned one-byte element holds: NaN for FP8 dtypes, else ``POISON_BYTE``."""
    return FP8_NAN_BYTE if dtype.is_floating_point and dtype.itemsize == 1 else POISON_BYTE


def poison_fill(tensor: torch.Tensor, index: torch.Tensor) -> None:
    """Fill ``tensor[index]`` with the poison value: NaN for float buffers (FP8 included, as
    the byte 0x7F), else 0xA5 bytes."""
    if tensor.dtype.is_floating_point and tensor.element_size() > 1:
        tensor.index_fill_(0, index, float("nan"))
    else:
        tensor.view(torch.uint8).index_fill_(0, index, poison_byte(tensor.dtype))


class Sanitizer:
    def __init__(self, registry: StateRegistry, enabled: bool) -> None:
        self.registry = registry
        self.enabled = enabled
        self.touched: set[tuple[int, str, str]] = set()  # buffer keys poisoned so far (I1 tests)

    def poison(self, group_id: int, pages: list[int]) -> None:
        """Mover: poison ``pages`` in every buffer of the group (iterates the registry)."""
        if not self.enabled or not pages:
            return
        for descriptor in self.registry.buffers(group_id):
            index = torch.tensor(pages, dtype=torch.long, device=descriptor.tensor.device)
            poison_fill(descriptor.tensor, index)
            self.touched.add(descriptor.key)

    def check_owner(self, coordinator: Books, owner: str,
                    page_tables: list[list[int]]) -> None:
        if not self.enabled:
            return
        for pool, table in zip(coordinator.pools, page_tables):
            pool.check_owner(owner, table)

    def check_books(self, coordinator: Books, live: Iterable) -> None:
        """I5: per pool, every page's holders equal exactly what the live sequences' page
        tables, the prefix cache and in-flight operations account for; the census adds up."""
        if not self.enabled:
            return
        live = list(live)
        for group_index, pool in enumerate(coordinator.pools):
            expected = [Counter() for _ in range(pool.num_pages)]
            for state in live:
                for page in state.page_tables[group_index]:
                    expected[page][state.owner] += 1
            for node in coordinator.prefix_cache.device_nodes() if coordinator.prefix_cache else ():
                expected[node.pages[group_index]][CACHE_OWNER] += 1
            for owner, pages in coordinator.inflight_references(group_index):
                for page in pages:
                    expected[page][owner] += 1
            for page in range(1, pool.num_pages):
                if +expected[page] != +pool.holders(page):
                    raise SanitizerError(
                        f"books unbalanced in group {group_index}, page {page}: holders "
                        f"{dict(pool.holders(page))}, accounted for {dict(expected[page])}")
            if coordinator.prefix_cache is not None:
                self._check_cache_locks(coordinator.prefix_cache, group_index)
            census = pool.census()
            if sum(census.values()) != pool.num_usable or not pool.free_list_consistent():
                raise SanitizerError(f"books unbalanced in group {group_index}: {census}")

    @staticmethod
    def _check_cache_locks(cache, group_index: int) -> None:
        """Locks run along paths from the root (a node is locked at least as often as any
        child), and the count of unlocked device pages that eviction relies on is exact."""
        unlocked = 0
        for node in cache.device_nodes():
            for child in node.children.values():
                if child.lock_count > node.lock_count:
                    raise SanitizerError(f"prefix cache: a node locked {child.lock_count} times under a "
                                         f"parent locked {node.lock_count} times")
            unlocked += node.lock_count == 0 and node.pages[group_index] != 0
        if unlocked != cache.unlocked_pages[group_index]:
            raise SanitizerError(f"prefix cache: {cache.unlocked_pages[group_index]} unlocked pages counted in "
                                 f"group {group_index}, {unlocked} found")

    def check_all_free(self, coordinator: Books) -> None:
        """After idle and a cache flush, every page of every pool is free (I5)."""
        for group_index, pool in enumerate(coordinator.pools):
            if pool.num_free != pool.num_usable:
                leaked = [p for p in range(1, pool.num_pages) if pool.holders(p)]
                raise SanitizerError(
                    f"leak in group {group_index}: {pool.num_usable - pool.num_free} pages not "
                    f"free when idle, e.g. page {leaked[0]} held by {dict(pool.holders(leaked[0]))}")
