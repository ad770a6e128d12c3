"""Forks for n > 1: a request's siblings start from the state of its first sequence.

At the end of the prompt each sibling shares the parent's pages and gets copies of those both
will write (the managers say which: for token pages the partial last page, for a recurrent
working slot the slot), and shares the parent's prefix-cache path as far as the pages it shares.

Owner: the ``StateCoordinator`` (``coordinator.forks``); the engine core forks each sibling
(``fork``). Room for the copies comes from the coordinator's allocation (``make_room``: the
prefix cache gives way), the copies go through its mover (``copy_page``: a COPY page operation,
iterating the registry's buffers, I1), and the path through ``coordinator.prefix_hits``.
"""
from __future__ import annotations

from typing import Callable

from tandem.kv.block_pool import BlockPool, OutOfPagesError
from tandem.kv.planner import NULL_PAGE
from tandem.kv.prefix_hits import PrefixHits
from tandem.kv.request_state import RequestState


class Forks:
    def __init__(self, managers: list, pools: list[BlockPool], page_size: int, prefix_hits: PrefixHits,
                 make_room: Callable[[list[int]], None], copy_page: Callable[[int, int, int], None]) -> None:
        self._managers = managers
        self._pools = pools
        self._page_size = page_size
        self._prefix_hits = prefix_hits
        self._make_room = make_room  # raises OutOfPagesError when the pools cannot give the pages
        self._copy_page = copy_page
        # Set through the coordinator (``state_reads_next_token``): the page holding the last
        # token is then copied, not shared, even when whole.
        self.state_reads_next_token = False

    def fork(self, parent: RequestState, child: RequestState, num_tokens: int) -> bool:
        """Share the parent's pages with the child and copy those both will write.

        Returns False (child left empty) when no page is free for the copies."""
        private_last = self.state_reads_next_token
        num_shared = (num_tokens - 1 if private_last and num_tokens else num_tokens) // self._page_size
        plans = [manager.fork_pages(table, num_tokens, private_last)
                 for manager, table in zip(self._managers, parent.page_tables)]
        needed = [len(copied) for _, copied in plans]
        if any(needed):
            try:
                self._make_room(needed)
            except OutOfPagesError:
                return False
        for group_index, (pool, (shared, copied)) in enumerate(zip(self._pools, plans)):
            pool.acquire([page for page in shared if page != NULL_PAGE], child.owner)
            child.page_tables[group_index].extend(shared)
            for source in copied:
                (copy,) = pool.allocate(1, child.owner)
                self._copy_page(group_index, source, copy)
                child.page_tables[group_index].append(copy)
        self._prefix_hits.share_path(parent, child, num_shared)
        return True
