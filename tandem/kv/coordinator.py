"""The coordinator: one entry point for a request's state across every group.

Owner of the block pools, the managers and the prefix cache. Sequences own a ``RequestState``
(their page tables, one per group); the coordinator allocates into it and frees from it. All
methods fan out over the groups; none knows what kind of state a group holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch

from tandem.kv.block_pool import CACHE_OWNER, INFLIGHT_PREFIX, BlockPool, OutOfPagesError
from tandem.kv.managers import manager_class_for
from tandem.kv.planner import NULL_PAGE, PoolPlan
from tandem.kv.prefix_cache import CacheNode, PrefixCache
from tandem.kv.registry import StateRegistry
from tandem.kv.sanitizer import Sanitizer


@dataclass
class RequestState:
    """A sequence's state handle. ``owner`` tags every page reference it holds."""
    owner: str
    page_tables: list[list[int]]
    cache_path: list[CacheNode] = field(default_factory=list)  # locked prefix-cache nodes

    @classmethod
    def empty(cls, owner: str, num_groups: int) -> "RequestState":
        return cls(owner=owner, page_tables=[[] for _ in range(num_groups)])


class StateCoordinator:
    def __init__(self, registry: StateRegistry, plan: PoolPlan, *, enable_prefix_caching: bool,
                 sanitize: bool) -> None:
        self.registry = registry
        self.plan = plan
        self.page_size = plan.page_size
        self.sanitizer = Sanitizer(registry, sanitize)
        self.pools = [BlockPool(group.group_id, plan.pages_of(group.group_id), on_free=self.sanitizer.poison)
                      for group in registry.groups]
        self.managers = [manager_class_for(group.spec.manager_kind)(group, pool, plan.page_size)
                         for group, pool in zip(registry.groups, self.pools)]
        self.prefix_cache = PrefixCache(self.pools, plan.page_size) if enable_prefix_caching else None
        for manager in self.managers:
            manager.prefix_caching = self.prefix_cache is not None
        self._inflight: dict[str, list[list[int]]] = {}
        # Set when some layer's state at a position depends on the token after it (an MTP draft
        # layer's): the last slot of a page is then not final until the next token is known, so
        # a prefix hit leaves its last page to be recomputed into pages of the request's own, and
        # a fork copies the page holding the last token instead of sharing it.
        self.state_reads_next_token = False

    @property
    def num_groups(self) -> int:
        return len(self.pools)

    def new_state(self, owner: str) -> RequestState:
        return RequestState.empty(owner, self.num_groups)

    # -- capacity --------------------------------------------------------------------------
    def max_tokens_per_request(self) -> int:
        return min((manager.max_tokens_per_request() for manager in self.managers), default=1 << 62)

    def pages_needed(self, state: RequestState, num_tokens: int) -> list[int]:
        return [manager.num_new_pages(table, num_tokens)
                for manager, table in zip(self.managers, state.page_tables)]

    def can_allocate(self, state: RequestState, num_tokens: int) -> bool:
        return self._fits(self.pages_needed(state, num_tokens))

    def _fits(self, needed: list[int]) -> bool:
        """Whether ``needed`` pages per group are free, or can be freed by evicting cache."""
        if all(pool.num_free >= n for pool, n in zip(self.pools, needed)):
            return True
        evictable = self._evictable_pages()
        return all(pool.num_free + e >= n for pool, e, n in zip(self.pools, evictable, needed))

    def _evictable_pages(self) -> list[int]:
        """Per group: the pages evicting would free. A node that is unlocked with no locked
        descendant frees its page in each group; a sparse group's entry can be dropped from
        any node, freeing the page where the cache is its only holder."""
        counts = [0] * self.num_groups
        if self.prefix_cache is None:
            return counts
        root = self.prefix_cache.root
        order, stack = [], [root]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        evictable: dict[int, bool] = {}
        for node in reversed(order):
            evictable[id(node)] = node.lock_count == 0 and all(evictable[id(c)] for c in node.children.values())
            if node is root:
                continue
            for group_index, (manager, pool, page) in enumerate(zip(self.managers, self.pools, node.pages)):
                if page == NULL_PAGE:
                    continue
                if manager.sparse_prefix_entries:
                    counts[group_index] += pool.refcount(page) == 1
                elif evictable[id(node)]:
                    counts[group_index] += 1
        return counts

    def _drop_sparse_entries(self, needed: list[int]) -> None:
        """Where a sparse group's pool has fewer than ``needed`` free pages, drop the cache's
        pages of that group (least recently used nodes first), keeping the nodes: they stay
        usable up to their remaining entries."""
        short = [index for index, (manager, pool, count) in enumerate(zip(self.managers, self.pools, needed))
                 if manager.sparse_prefix_entries and pool.num_free < count]
        if not short:
            return
        nodes = sorted(self.prefix_cache.all_nodes(), key=lambda node: node.last_access)
        for group_index in short:
            pool, count = self.pools[group_index], needed[group_index]
            for node in nodes:
                if pool.num_free >= count:
                    break
                page = node.pages[group_index]
                if page != NULL_PAGE:
                    node.pages = node.pages[:group_index] + (NULL_PAGE,) + node.pages[group_index + 1:]
                    self.pools[group_index].release([page], CACHE_OWNER)

    def try_allocate(self, state: RequestState, num_tokens: int) -> bool:
        """``allocate`` when ``can_allocate``, computing the pages needed once (the scheduler's
        per-step call for every running sequence); False, with nothing changed, otherwise."""
        needed = self.pages_needed(state, num_tokens)
        if not any(needed):  # managers allocate nothing when they need no new page
            return True
        if not self._fits(needed):
            return False
        self._make_room(needed)
        self._grow(state, num_tokens)
        return True

    def allocate(self, state: RequestState, num_tokens: int) -> None:
        """Grow every page table to hold ``num_tokens``; evicts cached pages if needed."""
        self._make_room(self.pages_needed(state, num_tokens))
        self._grow(state, num_tokens)

    def _grow(self, state: RequestState, num_tokens: int) -> None:
        for group_index, (manager, table) in enumerate(zip(self.managers, state.page_tables)):
            manager.allocate(table, num_tokens, state.owner,
                             lambda source, destination, group=group_index: self.copy_page(group, source, destination))

    def _make_room(self, needed: list[int]) -> None:
        def short() -> bool:
            return any(pool.num_free < n for pool, n in zip(self.pools, needed))
        if short() and self.prefix_cache is not None:
            self._drop_sparse_entries(needed)
        if short() and self.prefix_cache is not None:
            self.prefix_cache.evict(1 << 62, is_short=short)
        if short():
            raise OutOfPagesError(f"need {needed} pages, free {[p.num_free for p in self.pools]}")

    def free(self, state: RequestState) -> None:
        """Release every reference the sequence holds and unlock its cache path."""
        for pool, table in zip(self.pools, state.page_tables):
            pool.release([page for page in table if page != NULL_PAGE], state.owner)
            table.clear()
        if self.prefix_cache is not None and state.cache_path:
            self.prefix_cache.unlock(state.cache_path)
        state.cache_path = []

    def drop_unneeded_pages(self, state: RequestState, num_computed_tokens: int) -> None:
        """Release pages the managers say no future step reads (e.g. outside a window)."""
        for manager, pool, table in zip(self.managers, self.pools, state.page_tables):
            for index in manager.droppable_page_indices(table, num_computed_tokens):
                if table[index] != NULL_PAGE:
                    pool.release([table[index]], state.owner)
                    table[index] = NULL_PAGE

    # -- prefix cache ------------------------------------------------------------------------
    def match_prefix(self, state: RequestState, token_ids: list[int]) -> int:
        """Take the longest cached prefix (whole pages, leaving at least one token to compute).

        Returns the number of tokens hit. The sequence gets its own reference on each page and
        locks the nodes."""
        if self.prefix_cache is None or any(state.page_tables):
            return 0
        max_pages = (len(token_ids) - 1) // self.page_size
        path = self.prefix_cache.match(token_ids, max_pages)
        if self.state_reads_next_token:
            path = path[:-1]
        usable = min(manager.usable_prefix_pages_on_path([node.pages[group_index] for node in path])
                     for group_index, manager in enumerate(self.managers)) if path else 0
        path = path[:usable]
        if not path:
            return 0
        self.prefix_cache.lock(path)
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
                    node.pages = node.pages[:group_index] + (page,) + node.pages[group_index + 1:]

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
                self._make_room(needed)
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
        """Mover: copy one page across every buffer of the group (iterates the registry)."""
        for descriptor in self.registry.buffers(group_id):
            descriptor.tensor[destination].copy_(descriptor.tensor[source])

    # -- PD transfer ------------------------------------------------------------------------------
    def final_page_indices(self, state: RequestState, num_computed_tokens: int,
                           prompt_done: bool) -> list[list[int]]:
        """Per group: the page-table entries whose contents a PD receiver can take as final
        (the managers say which: whole computed pages, a recurrent working slot at the end)."""
        return [manager.final_page_indices(table, num_computed_tokens, prompt_done)
                for manager, table in zip(self.managers, state.page_tables)]

    # -- speculative decoding ----------------------------------------------------------------------
    def speculation_copies(self, groups: Iterable[int]) -> bool:
        """Whether a speculative step in ``groups`` needs copies set aside (the managers say)."""
        return any(self.managers[group].speculation_sets_aside for group in groups)

    def set_aside(self, state: RequestState, groups: Iterable[int]) -> Optional[str]:
        """Copy aside, in ``groups``, the pages the managers say a speculative step may have to
        restore or run a draft chain on (a recurrent working slot). The copies are held in flight
        under the returned owner until ``release_inflight``; None when nothing needed copying."""
        wanted = set(groups)
        sources = [manager.speculation_sources(table) if index in wanted else []
                   for index, (manager, table) in enumerate(zip(self.managers, state.page_tables))]
        if not any(sources):
            return None
        self._make_room([len(pages) for pages in sources])
        owner = f"{INFLIGHT_PREFIX}speculation:{state.owner}"
        copies = []
        for group_index, (pool, pages) in enumerate(zip(self.pools, sources)):
            destinations = pool.allocate(len(pages), owner) if pages else []
            for source, destination in zip(pages, destinations):
                self.copy_page(group_index, source, destination)
            copies.append(destinations)
        self._inflight[owner] = copies
        return owner

    def chain_page_tables(self, state: RequestState, owner: Optional[str]) -> list[list[int]]:
        """Per group, the table a draft's speculative chain reads and writes (the managers say:
        the sequence's own, or the copies ``set_aside`` made)."""
        copies = self._inflight[owner] if owner is not None else [[] for _ in self.managers]
        return [manager.chain_page_table(table, group_copies)
                for manager, table, group_copies in zip(self.managers, state.page_tables, copies)]

    def roll_back(self, state: RequestState, owner: Optional[str], groups: Iterable[int], *, num_valid: int,
                  num_written: int) -> bool:
        """After a verification that wrote ``num_written`` tokens' state of which ``num_valid``
        are accepted, in ``groups`` (those ``set_aside`` was given): every group drops what holds
        only rejected tokens. Returns whether each holds exactly ``num_valid`` tokens' state;
        False when some group had to restore the state from before the verification."""
        copies = self._inflight[owner] if owner is not None else [[] for _ in self.managers]
        exact = True
        for group_index in groups:
            exact &= self.managers[group_index].rollback(
                state.page_tables[group_index], copies[group_index], state.owner, num_valid, num_written,
                lambda source, destination, group=group_index: self.copy_page(group, source, destination))
        return exact

    # -- in-flight operations (I2) ---------------------------------------------------------------
    def hold_inflight(self, operation: str, page_tables: list[list[int]]) -> str:
        owner = f"inflight:{operation}"
        live = [[page for page in pages if page != NULL_PAGE] for pages in page_tables]
        for pool, pages in zip(self.pools, live):
            pool.acquire(pages, owner)
        self._inflight[owner] = live
        return owner

    def release_inflight(self, owner: str) -> None:
        for pool, pages in zip(self.pools, self._inflight.pop(owner)):
            pool.release(pages, owner)

    def inflight_references(self, group_index: int) -> Iterator[tuple[str, list[int]]]:
        for owner, tables in self._inflight.items():
            yield owner, tables[group_index]

    # -- accounting ----------------------------------------------------------------------------------
    def pages_used(self) -> int:
        return sum(pool.num_usable - pool.num_free for pool in self.pools)

    def pages_total(self) -> int:
        return sum(pool.num_usable for pool in self.pools)

    def page_table_tensor(self, tables: list[list[int]], device: torch.device) -> torch.Tensor:
        width = max((len(t) for t in tables), default=0) or 1
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.long, device=device)
