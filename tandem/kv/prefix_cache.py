"""A radix prefix cache over whole pages, with LRU eviction and reference-counted locks.

Each node is one full page of tokens (its key is that page's token tuple under its parent) and
holds one page per state group. Owner: the cache holds one reference (tag ``"cache"``) on
every page of every node; it releases them only when it evicts the node. A sequence that uses
a node's pages locks the node (``lock_count``); only unlocked leaves are evicted, least
recently used first.

    root ─ [t0..t15] ─ [t16..t31] ─ [t32..t47]      one node = one page per group
                     └ [t16'..t31']                 siblings share the parent's pages
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

from tandem.kv.block_pool import CACHE_OWNER, BlockPool


@dataclass(eq=False)
class CacheNode:
    tokens: tuple[int, ...]
    pages: tuple[int, ...]  # one per group
    parent: Optional["CacheNode"]
    children: dict[tuple[int, ...], "CacheNode"] = field(default_factory=dict)
    lock_count: int = 0
    last_access: int = 0


class PrefixCache:
    def __init__(self, pools: list[BlockPool], page_size: int) -> None:
        self.pools = pools
        self.page_size = page_size
        self.root = CacheNode(tokens=(), pages=(), parent=None)
        self._clock = itertools.count(1)
        self.num_nodes = 0

    def _page_keys(self, token_ids: list[int], num_pages: int) -> list[tuple[int, ...]]:
        size = self.page_size
        return [tuple(token_ids[i * size:(i + 1) * size]) for i in range(num_pages)]

    def match(self, token_ids: list[int], max_pages: int) -> list[CacheNode]:
        """The longest cached path of whole pages for ``token_ids`` (at most ``max_pages``)."""
        path: list[CacheNode] = []
        node = self.root
        now = next(self._clock)
        for key in self._page_keys(token_ids, max_pages):
            node = node.children.get(key)
            if node is None:
                break
            node.last_access = now
            path.append(node)
        return path

    def lock(self, nodes: list[CacheNode]) -> None:
        for node in nodes:
            node.lock_count += 1

    def unlock(self, nodes: list[CacheNode]) -> None:
        for node in nodes:
            if node.lock_count <= 0:
                raise AssertionError("prefix cache: unlock of an unlocked node")
            node.lock_count -= 1

    def insert(self, token_ids: list[int], page_tables: list[list[int]], num_pages: int,
               start_node: Optional[CacheNode], start_index: int) -> list[CacheNode]:
        """Insert pages ``start_index..num_pages-1`` below ``start_node`` (the path so far).

        Where a node for those tokens exists already, the cache keeps its own page and the
        caller keeps its duplicate. Returns the nodes on the path from ``start_index`` on.
        """
        node = start_node or self.root
        now = next(self._clock)
        path = []
        keys = self._page_keys(token_ids, num_pages)
        for index in range(start_index, num_pages):
            child = node.children.get(keys[index])
            if child is None:
                pages = tuple(table[index] for table in page_tables)
                for pool, page in zip(self.pools, pages):
                    pool.acquire([page], CACHE_OWNER)
                child = CacheNode(tokens=keys[index], pages=pages, parent=node)
                node.children[keys[index]] = child
                self.num_nodes += 1
            child.last_access = now
            path.append(child)
            node = child
        return path

    def _evictable_leaves(self) -> list[tuple[int, int, CacheNode]]:
        heap, counter = [], itertools.count()
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and not node.children and node.lock_count == 0:
                heap.append((node.last_access, next(counter), node))
        heapq.heapify(heap)
        return heap

    def num_evictable_pages(self) -> int:
        """Nodes that evicting leaf-first could remove: unlocked nodes with no locked
        descendant (each frees one page per group)."""
        order, stack = [], [self.root]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        evictable: dict[int, bool] = {}
        count = 0
        for node in reversed(order):
            ok = node.lock_count == 0 and all(evictable[id(c)] for c in node.children.values())
            evictable[id(node)] = ok
            count += ok and node is not self.root
        return count

    def evict(self, num_pages: int, is_short: Optional[Callable[[], bool]] = None) -> int:
        """Evict LRU unlocked leaves until ``num_pages`` nodes are gone (or ``is_short()`` is
        False, or nothing is evictable). Returns how many nodes were evicted."""
        heap = self._evictable_leaves()
        counter = itertools.count(len(heap))
        evicted = 0
        while heap and evicted < num_pages and (is_short is None or is_short()):
            _, _, node = heapq.heappop(heap)
            self._remove(node)
            evicted += 1
            parent = node.parent
            if parent is not self.root and not parent.children and parent.lock_count == 0:
                heapq.heappush(heap, (parent.last_access, next(counter), parent))
        return evicted

    def _remove(self, node: CacheNode) -> None:
        del node.parent.children[node.tokens]
        self.num_nodes -= 1
        for pool, page in zip(self.pools, node.pages):
            pool.release([page], CACHE_OWNER)

    def reset(self) -> int:
        """Evict every unlocked node; returns the number evicted."""
        return self.evict(self.num_nodes)

    def all_nodes(self) -> list[CacheNode]:
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes
