"""Recurrent state (Mamba-2, gated DeltaNet): one slot per sequence, however long it is.

A page of a recurrent group is a slot holding one layer's convolution window and SSM state. A
sequence's page table in the group:

    [working]               the state after the sequence's computed tokens; allocated when the
                            sequence is admitted, freed (and poisoned in sanitizer mode) with it
    [working, checkpoint]   with prefix caching, when a spare slot is free: the forward pass
                            also writes the state at the last page boundary a chunk crosses
                            into the checkpoint slot, and the prefix cache then takes it

Prefix cache: a node holds this group's checkpoint only at a page boundary where one was
written (the last boundary of a chunk); other nodes hold the null page here (sparse entries),
and a hit lands only at the deepest node of the match that holds a checkpoint. The hit's table
starts as ``[checkpoint]``, shared with the cache; before the next step writes, the sequence
gets a private working slot with a copy of it (copy on write, as for any shared working slot).

Checkpoints are spare capacity: the pool is sized two slots per sequence, a spare slot is taken
only while more than half the pool is free (evicting unlocked cache nodes to get there), so
working slots never wait for checkpoints.

Forks (n > 1): the child gets a copy of the working slot; nothing is shared.
"""
from __future__ import annotations

from typing import Callable

from tandem.kv.managers.base import StateManager
from tandem.kv.planner import NULL_PAGE

WORKING, CHECKPOINT = 0, 1


class RecurrentManager(StateManager):
    sparse_prefix_entries = True

    def pages_for_tokens(self, num_tokens: int) -> int:
        return 1 if num_tokens > 0 else 0

    def num_new_pages(self, page_table: list[int], num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        if not page_table:
            return 1
        return 1 if self._shared(page_table[WORKING]) else 0

    def max_tokens_per_request(self) -> int:
        return 1 << 62  # fixed-size state

    def _shared(self, page: int) -> bool:
        return self.pool.refcount(page) > 1

    def _spare_short(self) -> bool:
        return self.pool.num_free <= self.pool.num_usable // 2

    def allocate(self, page_table: list[int], num_tokens: int, owner: str,
                 copy_page: Callable[[int, int], None],
                 evict_while: Callable[[Callable[[], bool]], None]) -> None:
        if num_tokens <= 0:
            return
        if not page_table:
            page_table.extend(self.pool.allocate(1, owner))
        elif self._shared(page_table[WORKING]):
            (private,) = self.pool.allocate(1, owner)
            copy_page(page_table[WORKING], private)
            self.pool.release([page_table[WORKING]], owner)
            page_table[WORKING] = private
        if self.prefix_caching and len(page_table) == 1:
            evict_while(self._spare_short)
            if not self._spare_short():
                page_table.extend(self.pool.allocate(1, owner))

    def fork_pages(self, page_table: list[int], num_tokens: int) -> tuple[list[int], list[int]]:
        return [], page_table[:1]

    # -- prefix cache ----------------------------------------------------------------------------
    def usable_prefix_pages(self, num_hit_pages: int) -> int:
        return 0  # without the path's checkpoints, no hit point is known to be exact

    def usable_prefix_pages_on_path(self, pages: list[int]) -> int:
        """Up to the deepest node holding a checkpoint."""
        for index in range(len(pages) - 1, -1, -1):
            if pages[index] != NULL_PAGE:
                return index + 1
        return 0

    def hit_page_table(self, pages: list[int]) -> list[int]:
        return [pages[-1]] if pages else []

    def cache_entries(self, page_table: list[int], num_full_pages: int) -> list[int]:
        """The checkpoint (the state at the last page boundary the sequence's latest chunk
        crossed) for the last full page; null for the others."""
        entries = [NULL_PAGE] * num_full_pages
        if num_full_pages and len(page_table) > CHECKPOINT:
            entries[-1] = page_table[CHECKPOINT]
        return entries

    def after_cache_insert(self, page_table: list[int], owner: str) -> None:
        """Hand the checkpoint slot over to the cache once it holds a reference."""
        if len(page_table) > CHECKPOINT and self._shared(page_table[CHECKPOINT]):
            self.pool.release([page_table.pop(CHECKPOINT)], owner)
