"""The coordinator: one entry point for a request's state across every group.

Owner of the block pools, the managers and the prefix cache. Sequences own a ``RequestState``
(their page tables, one per group); the coordinator allocates into it and frees from it. All
methods fan out over the groups; none knows what kind of state a group holds. It touches no
state buffer to move a page: copies and poison are page operations sent through its ``outbox``
(``page_operations.py``), which this rank's executor applies and, under tensor parallelism, the
other ranks' executors apply from the step message.

Its core is allocation: new states, capacity (what growing a sequence needs, whether it fits,
making room), freeing, dropping pages no step reads, page copies, accounting and page tables.
Every other job is a class of its own it holds, called through it (``coordinator.<job>``):

- ``prefix_hits`` (``prefix_hits.py``): hits, caching computed pages, the cache's eviction and
  the listener's part in a hit;
- ``forks`` (``forks.py``): a request's siblings for n > 1;
- ``pd_tables`` (``pd_tables.py``): PD's destination tables and final entries;
- ``speculation`` (``set_aside.py``): the slots a speculative step copies pages aside into;
- ``inflight`` (``inflight.py``): in-flight operations' holds on pages (I2).

Above it, a ``StateListener`` (``state_events.py``; the host and disk tiers register as one) is
fed its events: a state freed, nodes cached, a path released, and the queries of a hit. The
coordinator knows that interface only; the listener calls back into it.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from tandem.kv.accessor import PendingLoads
from tandem.kv.block_pool import BlockPool, OutOfPagesError, any_short
from tandem.kv.forks import Forks
from tandem.kv.inflight import InflightHolds
from tandem.kv.keys import chain_hash
from tandem.kv.managers import manager_class_for
from tandem.kv.page_operations import COPY, POISON, Outbox, PageExecutor, PageOperation
from tandem.kv.pd_tables import PDPageTables
from tandem.kv.planner import NULL_PAGE, PoolPlan
from tandem.kv.prefix_cache import PrefixCache
from tandem.kv.prefix_hits import PrefixHits
from tandem.kv.keys import chain_hash
from tandem.kv.registry import StateRegistry
from tandem.kv.request_state import RequestState
from tandem.kv.sanitizer import Sanitizer
from tandem.kv.set_aside import SetAsideSlots
from tandem.kv.state_events import StateListener


class StateCoordinator:
    def __init__(self, registry: StateRegistry, plan: PoolPlan, *, enable_prefix_caching: bool,
                 sanitize: bool) -> None:
        self.registry = registry
        self.plan = plan
        self.page_size = plan.page_size
        self.sanitizer = Sanitizer(registry, sanitize)
        # Per-layer completions of asynchronous loads into device pages; every read of a
        # layer's state waits for its own (the accessor, I3; a page copy too).
        self.pending_loads = PendingLoads()
        # The page operations the books emit (copies, poison, the tiers'): applied to this rank's
        # shard by its executor, and recorded for the other ranks under tensor parallelism
        # (``kv/page_operations.py``; the rank's executor switches recording on).
        self.outbox = Outbox(PageExecutor(registry, self.sanitizer, self.pending_loads))
        self.pools = [BlockPool(group.group_id, plan.pages_of(group.group_id), on_free=self._poison_freed)
                      for group in registry.groups]
        for pool in self.pools:  # a page never written reads as poison too (I6)
            self.sanitizer.poison(pool.group_id, [page for page in range(pool.num_pages) if page != NULL_PAGE])
        self.managers = [manager_class_for(group.spec.manager_kind)(group, pool, plan.page_size)
                         for group, pool in zip(registry.groups, self.pools)]
        self.prefix_cache = PrefixCache(self.pools, plan.page_size, chain_hash) if enable_prefix_caching else None
        for manager in self.managers:
            manager.prefix_caching = self.prefix_cache is not None
        self.inflight = InflightHolds(self.pools)  # I2: pages in-flight operations hold (kv/inflight.py)
        # The prefix cache's use: hits, caching computed pages, eviction (``prefix_hits.py``).
        self.prefix_hits = PrefixHits(self.managers, self.pools, plan.page_size, self.prefix_cache, self.inflight)
        # Speculation's job: the slots a speculative step copies pages aside into, reserved with
        # a sequence's pages, its draft chains' tables and its rollbacks (``set_aside.py``).
        self.speculation = SetAsideSlots(self.managers, self.pools, self.copy_page)
        # The features' adapters: forks for n > 1 (``forks.py``) and PD's tables (``pd_tables.py``).
        self.forks = Forks(self.managers, self.pools, plan.page_size, self.prefix_hits, self.make_room,
                           self.copy_page)
        self.pd_tables = PDPageTables(self.managers, self.pools)
        self.listener: Optional[StateListener] = None  # fed the events (the tiers, when configured)

    def attach_listener(self, listener: StateListener) -> None:
        """``listener`` is fed this coordinator's events and its prefix hits'."""
        self.listener = listener
        self.prefix_hits.attach_listener(listener)

    @property
    def state_reads_next_token(self) -> bool:
        """Whether some layer's state at a position depends on the token after it (an MTP draft
        layer's): the last slot of a page is then not final until the next token is known, so a
        prefix hit leaves its last page to be recomputed into pages of the sequence's own, and
        a fork copies the page holding the last token instead of sharing it."""
        return self.prefix_hits.state_reads_next_token

    @state_reads_next_token.setter
    def state_reads_next_token(self, value: bool) -> None:
        self.prefix_hits.state_reads_next_token = value
        self.forks.state_reads_next_token = value

    @property
    def num_groups(self) -> int:
        return len(self.pools)

    def new_state(self, owner: str) -> RequestState:
        return RequestState.empty(owner, self.num_groups)

    # -- capacity --------------------------------------------------------------------------
    def max_tokens_per_request(self) -> int:
        return min((manager.max_tokens_per_request() for manager in self.managers), default=1 << 62)

    def pages_needed(self, state: RequestState, num_tokens: int) -> list[int]:
        """Per group: the pages growing to ``num_tokens`` takes, the set-aside slots included."""
        slots = self.speculation.missing(state, num_tokens)
        return [manager.num_new_pages(table, num_tokens) + missing
                for manager, table, missing in zip(self.managers, state.page_tables, slots)]

    def can_allocate(self, state: RequestState, num_tokens: int) -> bool:
        return self.fits(self.pages_needed(state, num_tokens))

    def fits(self, needed: list[int]) -> bool:
        """Whether ``needed`` pages per group are free, or can be freed by evicting cache."""
        if all(pool.num_free >= n for pool, n in zip(self.pools, needed)):
            return True
        evictable = self.prefix_hits.evictable_pages()
        return all(pool.num_free + e >= n for pool, e, n in zip(self.pools, evictable, needed))

    def try_allocate(self, state: RequestState, num_tokens: int) -> bool:
        """``allocate`` when ``can_allocate``, computing the pages needed once (the scheduler's
        per-step call for every running sequence); False, with nothing changed, otherwise."""
        needed = self.pages_needed(state, num_tokens)
        if not any(needed):  # managers allocate nothing when they need no new page
            return True
        if not self.fits(needed):
            return False
        self.make_room(needed)
        self._grow(state, num_tokens)
        return True

    def allocate(self, state: RequestState, num_tokens: int) -> None:
        """Grow every page table to hold ``num_tokens``; evicts cached pages if needed."""
        self.make_room(self.pages_needed(state, num_tokens))
        self._grow(state, num_tokens)

    def _grow(self, state: RequestState, num_tokens: int) -> None:
        for group_index, (manager, table) in enumerate(zip(self.managers, state.page_tables)):
            manager.allocate(table, num_tokens, state.owner,
                             lambda source, destination, group=group_index: self.copy_page(group, source, destination))
        self.speculation.reserve(state, num_tokens)

    def make_room(self, needed: list[int]) -> None:
        """Make ``needed`` pages per group free, the prefix cache giving way where it must;
        ``OutOfPagesError`` when they cannot be had."""
        if any_short(self.pools, needed):
            self.prefix_hits.give_way(needed)
        if any_short(self.pools, needed):
            raise OutOfPagesError(f"need {needed} pages, free {[p.num_free for p in self.pools]}")

    def free(self, state: RequestState, keep_swapped: bool = False) -> None:
        """Release every reference the sequence holds and unlock its cache path (and, unless
        ``keep_swapped``, its copy above the device: the listener's ``on_freed``)."""
        if self.listener is not None and not keep_swapped:
            self.listener.on_freed(state)
        for pool, table in zip(self.pools, state.page_tables):
            pool.release([page for page in table if page != NULL_PAGE], state.owner)
            table.clear()
        self.prefix_hits.release(state)
        state.remote_tokens = 0
        self.speculation.release(state)

    def drop_unneeded_pages(self, state: RequestState, num_computed_tokens: int) -> None:
        """Release pages the managers say no future step reads (e.g. outside a window)."""
        for manager, pool, table in zip(self.managers, self.pools, state.page_tables):
            for index in manager.droppable_page_indices(table, num_computed_tokens):
                if table[index] != NULL_PAGE:
                    pool.release([table[index]], state.owner)
                    table[index] = NULL_PAGE

    def copy_page(self, group_id: int, source: int, destination: int) -> None:
        """One page of the group copied across every buffer (a COPY: ``PageExecutor.copy_page``)."""
        self.outbox.send(PageOperation(COPY, group_id, [source, destination]))

    def _poison_freed(self, group_id: int, pages: list[int]) -> None:
        if self.sanitizer.enabled and pages:
            self.outbox.send(PageOperation(POISON, group_id, list(pages)))

    # -- the books' other holders ---------------------------------------------------------------------
    def inflight_references(self, group_index: int) -> Iterator[tuple[str, list[int]]]:
        """Every reference neither a page table nor the prefix cache holds: in-flight
        operations' (I2) and speculation's set-aside slots."""
        yield from self.inflight.references(group_index)
        yield from self.speculation.references(group_index)

    # -- accounting ----------------------------------------------------------------------------------
    def pages_used(self) -> int:
        return sum(pool.num_usable - pool.num_free for pool in self.pools)

    def pages_total(self) -> int:
        return sum(pool.num_usable for pool in self.pools)

    def page_table_tensor(self, tables: list[list[int]], device: torch.device) -> torch.Tensor:
        width = max((len(t) for t in tables), default=0) or 1
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.long, device=device)
