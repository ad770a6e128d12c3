"""The coordinator: one entry point for a request's state across every group.

Owner of the block pools, the managers and the prefix cache. Sequences own a ``RequestState``
(their page tables, one per group); the coordinator allocates into it and frees from it. All
methods fan out over the groups; none knows what kind of state a group holds. It touches no
state buffer to move a page: copies and poison are page operations sent through its ``outbox``
(``page_operations.py``), which this rank's executor applies and, under tensor parallelism, the
other ranks' executors apply from the step message.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional

import torch

from tandem.kv.accessor import PendingLoads
from tandem.kv.inflight import InflightHolds
from tandem.kv.block_pool import CACHE_OWNER, BlockPool, OutOfPagesError
from tandem.kv.managers import manager_class_for
from tandem.kv.page_operations import COPY, POISON, Outbox, PageExecutor, PageOperation
from tandem.kv.planner import NULL_PAGE, PoolPlan
from tandem.kv.prefix_cache import CacheNode, PrefixCache
from tandem.kv.tiers.keys import chain_hash
from tandem.kv.registry import StateRegistry
from tandem.kv.request_state import RequestState
from tandem.kv.sanitizer import Sanitizer
from tandem.kv.set_aside import SetAsideSlots

if TYPE_CHECKING:
    from tandem.kv.tiers.hierarchy import TieredState


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
        # Speculation's job: the slots a speculative step copies pages aside into, reserved with
        # a sequence's pages, its draft chains' tables and its rollbacks (``set_aside.py``).
        self.speculation = SetAsideSlots(self.managers, self.pools, self.copy_page)
        # Set when some layer's state at a position depends on the token after it (an MTP draft
        # layer's): the last slot of a page is then not final until the next token is known, so
        # a prefix hit leaves its last page to be recomputed into pages of the request's own, and
        # a fork copies the page holding the last token instead of sharing it.
        self.state_reads_next_token = False
        self.tiers: Optional["TieredState"] = None  # host and disk tiers, when configured

    def attach_tiers(self, tiers: "TieredState") -> None:
        self.tiers = tiers
        if self.prefix_cache is not None:
            self.prefix_cache.keeps_below = tiers.keeps_below

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
        evictable = self.evictable_pages()
        return all(pool.num_free + e >= n for pool, e, n in zip(self.pools, evictable, needed))

    def evictable_pages(self) -> list[int]:
        """Per group: the pages evicting would free. A node that is unlocked with no locked
        descendant frees its page in each group; a sparse group's entry can be dropped from
        any node, freeing the page where the cache is its only holder."""
        counts = [0] * self.num_groups
        if self.prefix_cache is None:
            return counts
        cache = self.prefix_cache
        sparse = [index for index, manager in enumerate(self.managers) if manager.sparse_prefix_entries]
        for group_index in range(self.num_groups):
            if group_index not in sparse:
                counts[group_index] = cache.unlocked_pages[group_index] - self.inflight.held_cached_pages(group_index)
        if sparse:  # a sparse entry can be dropped from any node where the cache alone holds it
            for node in cache.device_nodes():
                for group_index in sparse:
                    page = node.pages[group_index]
                    counts[group_index] += page != NULL_PAGE and self.pools[group_index].refcount(page) == 1
        return counts

    def _drop_sparse_entries(self, needed: list[int]) -> None:
        """Where a sparse group's pool has fewer than ``needed`` free pages, drop the cache's
        pages of that group (least recently used nodes first), keeping the nodes: they stay
        usable up to their remaining entries."""
        short = [index for index, (manager, pool, count) in enumerate(zip(self.managers, self.pools, needed))
                 if manager.sparse_prefix_entries and pool.num_free < count]
        if not short:
            return
        nodes = sorted(self.prefix_cache.device_nodes(), key=lambda node: node.last_access)
        for group_index in short:
            pool, count = self.pools[group_index], needed[group_index]
            for node in nodes:
                if pool.num_free >= count:
                    break
                if node.pages is None:
                    continue
                page = node.pages[group_index]
                if page != NULL_PAGE:
                    self.prefix_cache.set_device_pages(
                        node, node.pages[:group_index] + (NULL_PAGE,) + node.pages[group_index + 1:])
                    self.pools[group_index].release([page], CACHE_OWNER)

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
        def short() -> bool:
            return any(pool.num_free < n for pool, n in zip(self.pools, needed))
        if short() and self.prefix_cache is not None:
            self._drop_sparse_entries(needed)
        if short() and self.prefix_cache is not None:
            # Evict a little past the need (1/64 of each pool): one walk over the cache serves
            # the next allocations too.
            slack = [n + max(1, pool.num_usable // 64) for pool, n in zip(self.pools, needed)]
            self.prefix_cache.evict(1 << 62, is_short=lambda: any(
                pool.num_free < want for pool, want in zip(self.pools, slack)))
        if short():
            raise OutOfPagesError(f"need {needed} pages, free {[p.num_free for p in self.pools]}")

    def free(self, state: RequestState, keep_swapped: bool = False) -> None:
        """Release every reference the sequence holds and unlock its cache path (and, unless
        ``keep_swapped``, its swapped-out copy in the host tier)."""
        if state.swapped is not None and not keep_swapped:
            self.tiers.drop_swapped(state)
        if self.tiers is not None and self.tiers.prefetch is not None:
            self.tiers.prefetch.forget(state.owner)
        for pool, table in zip(self.pools, state.page_tables):
            pool.release([page for page in table if page != NULL_PAGE], state.owner)
            table.clear()
        if self.prefix_cache is not None and state.cache_path:
            self.prefix_cache.unlock(state.cache_path)
        state.cache_path = []
        state.remote_tokens = 0
        self.speculation.release(state)

    def drop_unneeded_pages(self, state: RequestState, num_computed_tokens: int) -> None:
        """Release pages the managers say no future step reads (e.g. outside a window)."""
        for manager, pool, table in zip(self.managers, self.pools, state.page_tables):
            for index in manager.droppable_page_indices(table, num_computed_tokens):
                if table[index] != NULL_PAGE:
                    pool.release([table[index]], state.owner)
                    table[index] = NULL_PAGE

    # -- prefix cache ------------------------------------------------------------------------
    def prefix_loading(self, state: RequestState, token_ids: list[int], idle: bool = False) -> bool:
        """Whether the sequence must wait before ``match_prefix``: pages its match would take
        from the disk store are being read off the engine loop (``tiers/prefetch.py``). ``idle``:
        nothing else can run meanwhile."""
        if self.prefix_cache is None or self.tiers is None or self.tiers.prefetch is None or any(state.page_tables):
            return False
        max_pages = (len(token_ids) - 1) // self.page_size
        return self.tiers.prefetch.pending(state.owner, token_ids, max_pages, idle)

    def match_prefix(self, state: RequestState, token_ids: list[int]) -> int:
        """Take the longest cached prefix (whole pages, leaving at least one token to compute).

        Returns the number of tokens hit. The sequence gets its own reference on each page and
        locks the nodes. With tiers, nodes off the device are restored first (their loads are
        issued here and land layer by layer before the layers read them, I3)."""
        if self.prefix_cache is None or any(state.page_tables):
            return 0
        max_pages = (len(token_ids) - 1) // self.page_size
        path = self.prefix_cache.match(token_ids, max_pages)
        if self.tiers is None:
            if self.state_reads_next_token:
                path = path[:-1]
            path = path[:self._usable_pages(path)]
            self.prefix_cache.lock(path)
        else:
            # Locked while it is completed and restored: making room must not evict it.
            path = self.tiers.complete_path(path, token_ids, max_pages)
            if self.state_reads_next_token:
                path = self._truncate_locked(path, max(len(path) - 1, 0))
            path = self._truncate_locked(path, self._usable_pages(path))
            path = self._truncate_locked(path, self.tiers.restore(path))
            path = self._truncate_locked(path, self._usable_pages(path))
        if not path:
            return 0
        state.cache_path = path
        num_hit_tokens = len(path) * self.page_size
        for group_index, (pool, manager) in enumerate(zip(self.pools, self.managers)):
            pages = [node.pages[group_index] for node in path]
            # Entries no future step reads (e.g. before a sliding window) stay null.
            for index in manager.droppable_page_indices(pages, num_hit_tokens):
                pages[index] = NULL_PAGE
            pages = manager.hit_page_table(pages)
            pool.acquire([page for page in pages if page != NULL_PAGE], state.owner)
            state.page_tables[group_index].extend(pages)
        return num_hit_tokens

    def _truncate_locked(self, path: list[CacheNode], length: int) -> list[CacheNode]:
        self.prefix_cache.unlock(path[length:])
        return path[:length]

    def _usable_pages(self, path: list[CacheNode]) -> int:
        """How many leading nodes of ``path`` a hit may use, every group considered (a node's
        entry: its device page, else its host page)."""
        if not path:
            return 0
        def entry(node: CacheNode, group_index: int) -> int:
            pages = node.pages if node.pages is not None else node.host_pages
            return pages[group_index] if pages is not None else NULL_PAGE
        return min(manager.usable_prefix_pages_on_path([entry(node, group_index) for node in path])
                   for group_index, manager in enumerate(self.managers))

    def cache_computed_pages(self, state: RequestState, token_ids: list[int],
                             num_computed_tokens: int) -> None:
        """Insert the sequence's newly completed whole pages into the prefix cache."""
        if self.prefix_cache is None:
            return
        num_full = num_computed_tokens // self.page_size
        start = len(state.cache_path)
        if num_full <= start:
            return
        entries = [manager.cache_entries(table, num_full)
                   for manager, table in zip(self.managers, state.page_tables)]
        remote_pages = state.remote_tokens // self.page_size
        for entry, manager in zip(entries, self.managers):
            if not manager.caches_transferred_entries:  # a transfer brought the state, not these entries
                entry[:remote_pages] = [NULL_PAGE] * len(entry[:remote_pages])
        # Insert only pages the sequence still holds in every group: a node never holds null,
        # except in groups whose entries are sparse by design (recurrent checkpoints).
        for index in range(start, num_full):
            if any(entry[index] == NULL_PAGE for entry, manager in zip(entries, self.managers)
                   if not manager.sparse_prefix_entries):
                num_full = index
                break
        if num_full <= start:
            return
        parent = state.cache_path[-1] if state.cache_path else None
        new_nodes = self.prefix_cache.insert(token_ids, entries, num_full, parent, start)
        self._fill_sparse_entries(new_nodes, entries, start)
        self.prefix_cache.lock(new_nodes)
        state.cache_path.extend(new_nodes)
        if self.tiers is not None:
            self.tiers.on_cached(new_nodes)
        for manager, table in zip(self.managers, state.page_tables):
            manager.after_cache_insert(table, state.owner)

    def _fill_sparse_entries(self, nodes: list[CacheNode], entries: list[list[int]], start: int) -> None:
        """Where a node that already existed holds no page of a sparse group and the sequence
        has one for it, the node takes it (the cache's reference)."""
        for group_index, (manager, pool) in enumerate(zip(self.managers, self.pools)):
            if not manager.sparse_prefix_entries:
                continue
            for index, node in enumerate(nodes, start):
                page = entries[group_index][index]
                if node.pages[group_index] == NULL_PAGE and page != NULL_PAGE:
                    pool.acquire([page], CACHE_OWNER)
                    self.prefix_cache.set_device_pages(
                        node, node.pages[:group_index] + (page,) + node.pages[group_index + 1:])

    def reset_prefix_cache(self) -> int:
        return self.prefix_cache.reset() if self.prefix_cache is not None else 0

    # -- forks (n > 1) ---------------------------------------------------------------------------
    def fork(self, parent: RequestState, child: RequestState, num_tokens: int) -> bool:
        """Share the parent's pages with the child and copy those both will write (the managers
        say which: for token pages the partial last page, for a recurrent slot the slot).

        Returns False (child left empty) when no page is free for the copies."""
        private_last = self.state_reads_next_token
        num_shared = (num_tokens - 1 if private_last and num_tokens else num_tokens) // self.page_size
        plans = [manager.fork_pages(table, num_tokens, private_last)
                 for manager, table in zip(self.managers, parent.page_tables)]
        needed = [len(copied) for _, copied in plans]
        if any(needed):
            try:
                self.make_room(needed)
            except OutOfPagesError:
                return False
        for group_index, (pool, (shared, copied)) in enumerate(zip(self.pools, plans)):
            pool.acquire([page for page in shared if page != NULL_PAGE], child.owner)
            child.page_tables[group_index].extend(shared)
            for source in copied:
                (copy,) = pool.allocate(1, child.owner)
                self.copy_page(group_index, source, copy)
                child.page_tables[group_index].append(copy)
        if self.prefix_cache is not None and parent.cache_path:
            child.cache_path = parent.cache_path[:num_shared]
            self.prefix_cache.lock(child.cache_path)
        return True

    def copy_page(self, group_id: int, source: int, destination: int) -> None:
        """One page of the group copied across every buffer (a COPY: ``PageExecutor.copy_page``)."""
        self.outbox.send(PageOperation(COPY, group_id, [source, destination]))

    def _poison_freed(self, group_id: int, pages: list[int]) -> None:
        if self.sanitizer.enabled and pages:
            self.outbox.send(PageOperation(POISON, group_id, list(pages)))

    # -- PD transfer ------------------------------------------------------------------------------
    def destination_tables(self, state: RequestState) -> list[list[int]]:
        """PD decode: the page tables a prefill server writes into, the sequence's own with null
        in place of every page the prefix cache holds (a hit here: shared, already final, never
        written by a transfer)."""
        return [[NULL_PAGE if page != NULL_PAGE and pool.holders(page)[CACHE_OWNER] > 0 else page
                 for page in table] for pool, table in zip(self.pools, state.page_tables)]

    def final_page_indices(self, state: RequestState, num_computed_tokens: int,
                           prompt_done: bool) -> list[list[int]]:
        """Per group: the page-table entries whose contents a PD receiver can take as final
        (the managers say which: whole computed pages, a recurrent working slot at the end)."""
        return [manager.final_page_indices(table, num_computed_tokens, prompt_done)
                for manager, table in zip(self.managers, state.page_tables)]

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
