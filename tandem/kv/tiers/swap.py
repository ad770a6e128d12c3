"""Preemption by swap: a sequence's whole state to the host tier and back (part of ``TieredState``).

A preempted sequence's pages — every group, in page-table order, null entries kept — are copied
into host pages owned by ``swap:<sequence>`` (the preemption waits for the copy, then its device
pages go). When the sequence is admitted again it gets fresh device pages and their loads, layer
by layer (I3), with the computed-token count it had, so it never re-feeds a token whose state it
did not save. The host copy is dropped only once the admission succeeded (``commit_swap_in``):
an admission that fails keeps it for the next try.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.kv.planner import NULL_PAGE
from tandem.kv.page_operations import PageMove
from tandem.kv.request_state import SwappedState

if TYPE_CHECKING:
    from tandem.kv.request_state import RequestState


class Swap:
    """Swap out and in; mixed into ``TieredState`` (its host pool, copies and books)."""

    def swap_out(self, state: "RequestState", num_computed_tokens: int) -> bool:
        """Copy every page of the sequence to the host tier (waits for the copy). False when
        the host tier cannot hold it (the caller recomputes instead)."""
        device = [[page for page in table if page != NULL_PAGE] for table in state.page_tables]
        owner = f"swap:{state.owner}"
        host = self._allocate_host([len(pages) for pages in device], owner)
        if host is None:
            self.stats.swaps_refused += 1
            return False
        moves = [PageMove(group, pages, host_pages) for group, (pages, host_pages) in enumerate(zip(device, host))]
        host_tables = []
        for table, host_pages in zip(state.page_tables, host):
            cursor = iter(host_pages)
            host_tables.append([NULL_PAGE if page == NULL_PAGE else next(cursor) for page in table])
        self._wait(self._start(moves, False, device, host))
        state.swapped = SwappedState(owner, host_tables, num_computed_tokens)
        self._swapped[owner] = state.swapped
        self.stats.swap_outs += 1
        return True

    def swap_in(self, state: "RequestState") -> bool:
        """Fresh device pages for a swapped sequence and their loads (per layer); False when
        the device pool cannot take them now. The host copy stays until ``commit_swap_in``."""
        swapped = state.swapped
        host = [[page for page in table if page != NULL_PAGE] for table in swapped.host_tables]
        counts = [len(pages) for pages in host]
        if not self.coordinator.fits(counts):
            return False
        self.coordinator.make_room(counts)
        device = [pool.allocate(count, state.owner) if count else []
                  for pool, count in zip(self.coordinator.pools, counts)]
        for table, host_table, pages in zip(state.page_tables, swapped.host_tables, device):
            cursor = iter(pages)
            table[:] = [NULL_PAGE if page == NULL_PAGE else next(cursor) for page in host_table]
        moves = [PageMove(group, pages, host_pages) for group, (pages, host_pages) in enumerate(zip(device, host))]
        self._start(moves, True, device, host)
        return True

    def commit_swap_in(self, state: "RequestState") -> None:
        """The sequence runs again: its host copy goes (the load, if still running, holds it)."""
        self.drop_swapped(state)
        self.stats.swap_ins += 1

    def drop_swapped(self, state: "RequestState") -> None:
        swapped, state.swapped = state.swapped, None
        del self._swapped[swapped.owner]
        for pool, table in zip(self.host.pools, swapped.host_tables):
            pool.release([page for page in table if page != NULL_PAGE], swapped.owner)
