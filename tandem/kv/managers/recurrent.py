"""Recurrent state (Mamba-2, gated DeltaNet): one slot per sequence, however long it is.

A page of a recurrent group is a slot holding one layer's convolution window and SSM state. A
sequence's page table in the group:

    [working]               the state after the sequence's computed tokens; allocated when the
                            sequence is admitted, freed (and poisoned in sanitizer mode) with it
    [working, checkpoint]   with prefix caching: the forward pass also writes the state at the
                            last page boundary a chunk crosses into the checkpoint slot; the
                            prefix cache then takes that slot and the sequence gets a new one

Prefix cache: a node holds this group's checkpoint only at a page boundary where one was
written (the last boundary of a chunk); other nodes hold the null page here (sparse entries),
and a hit lands only at the deepest node of the match that holds a checkpoint. The hit's table
starts as ``[checkpoint]``, shared with the cache; before the next step writes, the sequence
gets a private working slot with a copy of it (copy on write, as for any shared working slot).

Sizing: the pool has, per sequence seat, a working slot, a checkpoint slot and (with prefix
caching) one more slot's worth of room for cached checkpoints. Cached checkpoints use whatever
is free; when a sequence needs a slot, the prefix cache gives way (``kv/prefix_hits.py``): the
least recently used cached checkpoints are dropped (the nodes stay, with their other groups'
pages), so a sequence never waits for checkpoints.

Forks (n > 1): the child gets a copy of the working slot; nothing is shared.

Speculative decoding: before a verification the working slot is copied aside; if any token is
rejected, the copy (the state before the verified tokens) is written back and the sequence
recomputes the accepted ones in its next step (the state after the rejected tokens cannot be
taken apart). A draft model's speculative chain runs on such a copy instead of the working slot,
with no checkpoint slot, so it leaves both untouched. The copy goes into a slot the sequence
reserved with its other slots (``set_aside_slots``), so a step never allocates one midway.
"""
from __future__ import annotations

from typing import Callable

from tandem.kv.managers.base import StateManager
from tandem.kv.planner import NULL_PAGE

WORKING, CHECKPOINT = 0, 1


class RecurrentManager(StateManager):
    sparse_prefix_entries = True
    caches_transferred_entries = False

    def _slots_per_sequence(self) -> int:
        return 2 if self.prefix_caching else 1

    def pages_for_tokens(self, num_tokens: int) -> int:
        return self._slots_per_sequence() if num_tokens > 0 else 0

    def num_new_pages(self, page_table: list[int], num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        if not page_table:
            return self._slots_per_sequence()
        copy_on_write = 1 if self._shared(page_table[WORKING]) else 0
        return max(0, self._slots_per_sequence() - len(page_table)) + copy_on_write

    def max_tokens_per_request(self) -> int:
        return 1 << 62  # fixed-size state

    def _shared(self, page: int) -> bool:
        return self.pool.refcount(page) > 1

    def allocate(self, page_table: list[int], num_tokens: int, owner: str,
                 copy_page: Callable[[int, int], None]) -> None:
        if num_tokens <= 0:
            return
        if not page_table:
            page_table.extend(self.pool.allocate(1, owner))
        elif self._shared(page_table[WORKING]):
            (private,) = self.pool.allocate(1, owner)
            copy_page(page_table[WORKING], private)
            self.pool.release([page_table[WORKING]], owner)
            page_table[WORKING] = private
        missing = self._slots_per_sequence() - len(page_table)
        if missing > 0:
            page_table.extend(self.pool.allocate(missing, owner))

    def fork_pages(self, page_table: list[int], num_tokens: int,
                   private_last: bool = False) -> tuple[list[int], list[int]]:
        return [], page_table[:1]

    def final_page_indices(self, page_table: list[int], num_computed_tokens: int, prompt_done: bool) -> list[int]:
        """PD: only the working slot, and only once the whole prompt is in it (a checkpoint
        slot, if any, belongs to this server's prefix cache)."""
        return [WORKING] if prompt_done and page_table else []

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
        crossed, which is the end of its last full page) for the last full page; null for the
        others."""
        entries = [NULL_PAGE] * num_full_pages
        if num_full_pages and len(page_table) > CHECKPOINT:
            entries[-1] = page_table[CHECKPOINT]
        return entries

    def after_cache_insert(self, page_table: list[int], owner: str) -> None:
        """Hand the checkpoint slot over to the cache once it holds a reference; the next
        allocation gives the sequence a fresh one."""
        if len(page_table) > CHECKPOINT and self._shared(page_table[CHECKPOINT]):
            self.pool.release([page_table.pop(CHECKPOINT)], owner)

    # -- speculative decoding ------------------------------------------------------------------------
    speculation_sets_aside = True

    def speculation_sources(self, page_table: list[int]) -> list[int]:
        return page_table[WORKING:WORKING + 1]

    def set_aside_slots(self, num_tokens: int) -> int:
        return 1 if num_tokens > 0 else 0

    def chain_page_table(self, page_table: list[int], copies: list[int]) -> list[int]:
        return list(copies)

    def rollback(self, page_table: list[int], copies: list[int], owner: str, num_valid: int, num_written: int,
                 copy_page: Callable[[int, int], None]) -> bool:
        if num_valid >= num_written:
            return True
        copy_page(copies[0], page_table[WORKING])
        return False
