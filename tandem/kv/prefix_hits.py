"""Prefix hits: the prefix cache's use by the books.

A sequence's first admission takes the longest cached prefix of its prompt (``match``): whole
pages, at least one token left to compute, as far as every group's manager can use the path (a
sliding window's pages before the window stay null, a recurrent group needs a checkpoint at the
hit's end). With a listener (``state_events.py``: the tiers), the path is completed from the
tiers below the device (disk reads off the engine loop first: ``loading``), and nodes off the
device are restored, their loads issued layer by layer (I3). As a sequence computes whole pages they are inserted
(``cache_computed_pages``). When the pools run short, the cache gives way (``evictable_pages``,
``give_way``): sparse groups' entries first (recurrent checkpoints; their nodes stay), then the
least recently used unlocked leaves.

Owner: the ``StateCoordinator`` (``coordinator.prefix_hits``), which owns the pools, the managers
and the prefix cache (``kv/prefix_cache.py``, the radix tree); this class is their use. The
scheduler and PD's decode side call ``loading``, ``match`` and ``cache_computed_pages``; the
coordinator asks it to give way when it makes room, to let go of a sequence's path when it frees
the sequence (``release``), and to share a parent's path with a fork (``share_path``). Like the
coordinator, it fans out over the groups and never knows what kind of state a group holds.
"""
from __future__ import annotations

from typing import Optional

from tandem.kv.block_pool import CACHE_OWNER, BlockPool, any_short
from tandem.kv.inflight import InflightHolds
from tandem.kv.planner import NULL_PAGE
from tandem.kv.prefix_cache import CacheNode, PrefixCache
from tandem.kv.request_state import RequestState
from tandem.kv.state_events import StateListener


class PrefixHits:
    def __init__(self, managers: list, pools: list[BlockPool], page_size: int, cache: Optional[PrefixCache],
                 inflight: InflightHolds) -> None:
        self._managers = managers
        self._pools = pools
        self._page_size = page_size
        self._cache = cache  # None: prefix caching is off, and every method here does nothing
        self._inflight = inflight  # cached pages only in-flight holds keep are not evictable
        self._listener: Optional[StateListener] = None  # the tiers: fed the cache's events
        # Set through the coordinator (``state_reads_next_token``): a hit then leaves its last
        # page to be recomputed into pages of the sequence's own.
        self.state_reads_next_token = False

    def attach_listener(self, listener: StateListener) -> None:
        self._listener = listener
        if self._cache is not None:
            self._cache.keeps_below = listener.keeps_below

    # -- hits ----------------------------------------------------------------------------------------
    def loading(self, state: RequestState, token_ids: list[int], idle: bool = False) -> bool:
        """Whether the sequence must wait before ``match``: pages its match would take from the
        tiers below are still being fetched (the listener's ``loading``). ``idle``: nothing else
        can run meanwhile."""
        if self._cache is None or self._listener is None or any(state.page_tables):
            return False
        max_pages = (len(token_ids) - 1) // self._page_size
        return self._listener.loading(state.owner, token_ids, max_pages, idle)

    def match(self, state: RequestState, token_ids: list[int]) -> int:
        """Take the longest cached prefix (whole pages, leaving at least one token to compute).

        Returns the number of tokens hit. The sequence gets its own reference on each page and
        locks the nodes. With a listener, nodes off the device are restored first (their loads are
        issued here and land layer by layer before the layers read them, I3)."""
        if self._cache is None or any(state.page_tables):
            return 0
        max_pages = (len(token_ids) - 1) // self._page_size
        path = self._cache.match(token_ids, max_pages)
        if self._listener is None:
            if self.state_reads_next_token:
                path = path[:-1]
            path = path[:self._usable_pages(path)]
            self._cache.lock(path)
        else:
            # Locked while it is completed and restored: making room must not evict it.
            path = self._listener.complete_path(path, token_ids, max_pages)
            if self.state_reads_next_token:
                path = self._truncate_locked(path, max(len(path) - 1, 0))
            path = self._truncate_locked(path, self._usable_pages(path))
            path = self._truncate_locked(path, self._listener.restore(path))
            path = self._truncate_locked(path, self._usable_pages(path))
        if not path:
            return 0
        state.cache_path = path
        num_hit_tokens = len(path) * self._page_size
        for group_index, (pool, manager) in enumerate(zip(self._pools, self._managers)):
            pages = [node.pages[group_index] for node in path]
            # Entries no future step reads (e.g. before a sliding window) stay null.
            for index in manager.droppable_page_indices(pages, num_hit_tokens):
                pages[index] = NULL_PAGE
            pages = manager.hit_page_table(pages)
            pool.acquire([page for page in pages if page != NULL_PAGE], state.owner)
            state.page_tables[group_index].extend(pages)
        return num_hit_tokens

    def _truncate_locked(self, path: list[CacheNode], length: int) -> list[CacheNode]:
        self._cache.unlock(path[length:])
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
                   for group_index, manager in enumerate(self._managers))

    # -- the sequence's path ---------------------------------------------------------------------------
    def cache_computed_pages(self, state: RequestState, token_ids: list[int], num_computed_tokens: int) -> None:
        """Insert the sequence's newly completed whole pages into the prefix cache."""
        if self._cache is None:
            return
        num_full = num_computed_tokens // self._page_size
        start = len(state.cache_path)
        if num_full <= start:
            return
        entries = [manager.cache_entries(table, num_full)
                   for manager, table in zip(self._managers, state.page_tables)]
        remote_pages = state.remote_tokens // self._page_size
        for entry, manager in zip(entries, self._managers):
            if not manager.caches_transferred_entries:  # a transfer brought the state, not these entries
                entry[:remote_pages] = [NULL_PAGE] * len(entry[:remote_pages])
        # Insert only pages the sequence still holds in every group: a node never holds null,
        # except in groups whose entries are sparse by design (recurrent checkpoints).
        for index in range(start, num_full):
            if any(entry[index] == NULL_PAGE for entry, manager in zip(entries, self._managers)
                   if not manager.sparse_prefix_entries):
                num_full = index
                break
        if num_full <= start:
            return
        parent = state.cache_path[-1] if state.cache_path else None
        new_nodes = self._cache.insert(token_ids, entries, num_full, parent, start)
        self._fill_sparse_entries(new_nodes, entries, start)
        self._cache.lock(new_nodes)
        state.cache_path.extend(new_nodes)
        if self._listener is not None:
            self._listener.on_cached(new_nodes)
        for manager, table in zip(self._managers, state.page_tables):
            manager.after_cache_insert(table, state.owner)

    def _fill_sparse_entries(self, nodes: list[CacheNode], entries: list[list[int]], start: int) -> None:
        """Where a node that already existed holds no page of a sparse group and the sequence
        has one for it, the node takes it (the cache's reference)."""
        for group_index, (manager, pool) in enumerate(zip(self._managers, self._pools)):
            if not manager.sparse_prefix_entries:
                continue
            for index, node in enumerate(nodes, start):
                page = entries[group_index][index]
                if node.pages[group_index] == NULL_PAGE and page != NULL_PAGE:
                    pool.acquire([page], CACHE_OWNER)
                    self._cache.set_device_pages(
                        node, node.pages[:group_index] + (page,) + node.pages[group_index + 1:])

    def share_path(self, parent: RequestState, child: RequestState, num_pages: int) -> None:
        """A fork: the child takes (and locks) the parent's path up to ``num_pages`` nodes, the
        pages they share."""
        if self._cache is not None and parent.cache_path:
            child.cache_path = parent.cache_path[:num_pages]
            self._cache.lock(child.cache_path)

    def release(self, state: RequestState) -> None:
        """The sequence is freed: its path is unlocked, and a disk read started for its hit is
        no longer wanted."""
        if self._listener is not None:
            self._listener.on_path_released(state.owner)
        if self._cache is not None and state.cache_path:
            self._cache.unlock(state.cache_path)
        state.cache_path = []

    # -- eviction --------------------------------------------------------------------------------------
    def evictable_pages(self) -> list[int]:
        """Per group: the pages evicting would free. A node that is unlocked with no locked
        descendant frees its page in each group; a sparse group's entry can be dropped from
        any node, freeing the page where the cache is its only holder."""
        counts = [0] * len(self._pools)
        if self._cache is None:
            return counts
        sparse = [index for index, manager in enumerate(self._managers) if manager.sparse_prefix_entries]
        for group_index in range(len(self._pools)):
            if group_index not in sparse:
                counts[group_index] = (self._cache.unlocked_pages[group_index]
                                       - self._inflight.held_cached_pages(group_index))
        if sparse:  # a sparse entry can be dropped from any node where the cache alone holds it
            for node in self._cache.device_nodes():
                for group_index in sparse:
                    page = node.pages[group_index]
                    counts[group_index] += page != NULL_PAGE and self._pools[group_index].refcount(page) == 1
        return counts

    def give_way(self, needed: list[int]) -> None:
        """Evict until every pool has ``needed`` free pages, as far as the cache can: sparse
        groups' entries first, then the least recently used unlocked leaves, a little past the
        need (1/64 of each pool: one walk over the cache serves the next allocations too)."""
        if self._cache is None:
            return
        if any_short(self._pools, needed):
            self._drop_sparse_entries(needed)
        if any_short(self._pools, needed):
            slack = [n + max(1, pool.num_usable // 64) for pool, n in zip(self._pools, needed)]
            self._cache.evict(1 << 62, is_short=lambda: any_short(self._pools, slack))

    def _drop_sparse_entries(self, needed: list[int]) -> None:
        """Where a sparse group's pool has fewer than ``needed`` free pages, drop the cache's
        pages of that group (least recently used nodes first), keeping the nodes: they stay
        usable up to their remaining entries."""
        short = [index for index, (manager, pool, count) in enumerate(zip(self._managers, self._pools, needed))
                 if manager.sparse_prefix_entries and pool.num_free < count]
        if not short:
            return
        nodes = sorted(self._cache.device_nodes(), key=lambda node: node.last_access)
        for group_index in short:
            pool, count = self._pools[group_index], needed[group_index]
            for node in nodes:
                if pool.num_free >= count:
                    break
                if node.pages is None:
                    continue
                page = node.pages[group_index]
                if page != NULL_PAGE:
                    self._cache.set_device_pages(
                        node, node.pages[:group_index] + (NULL_PAGE,) + node.pages[group_index + 1:])
                    pool.release([page], CACHE_OWNER)

    def reset(self) -> int:
        """Evict every unlocked node from the device; returns how many went."""
        return self._cache.reset() if self._cache is not None else 0
