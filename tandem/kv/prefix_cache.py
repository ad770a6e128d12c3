"""A radix prefix cache over whole pages, with LRU eviction and reference-counted locks.

Each node is one full page of tokens (its key is that page's token tuple under its parent) and
holds one page per state group. Owner: the cache holds one reference (tag ``"cache"``) on
every page of every node; it releases them only when it evicts the node. A sequence that uses
a node's pages locks the node (``lock_count``); only unlocked leaves are evicted, least
recently used first.

    root ─ [t0..t15] ─ [t16..t31] ─ [t32..t47]      one node = one page per group
                     └ [t16'..t31']                 siblings share the parent's pages

Tiers (``kv/tiers/``): a node's pages may also live in host memory (``host_pages``) and on disk
(keyed by ``hash``, the chain of its page's tokens under its ancestors'). Eviction from the
device drops a node's device pages (``pages`` becomes None); the node stays while some tier
below still holds it (the ``keeps_below`` hook says so), else it goes. Device-resident nodes
form a prefix-closed subtree: eviction takes device leaves first, and a hit that restores a
node restores its off-device ancestors with it.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

from tandem.kv.block_pool import CACHE_OWNER, BlockPool
from tandem.kv.planner import NULL_PAGE


@dataclass(eq=False)
class CacheNode:
    tokens: tuple[int, ...]
    pages: Optional[tuple[int, ...]]  # one device page per group; None: not on the device
    parent: Optional["CacheNode"]
    children: dict[tuple[int, ...], "CacheNode"] = field(default_factory=dict)
    lock_count: int = 0
    last_access: int = 0
    hash: bytes = b""  # chain hash of the page's tokens under its ancestors (tiers' key)
    host_pages: Optional[tuple[int, ...]] = None  # one host page per group; None: not on the host
    hits: int = 0  # prefix hits that used the node (write_through_selective)

    @property
    def on_device(self) -> bool:
        return self.pages is not None

    def device_children(self) -> bool:
        return any(child.pages is not None for child in self.children.values())


class PrefixCache:
    def __init__(self, pools: list[BlockPool], page_size: int,
                 chain_hash: Optional[Callable[[bytes, tuple[int, ...]], bytes]] = None) -> None:
        self.pools = pools
        self.page_size = page_size
        self.root = CacheNode(tokens=(), pages=(), parent=None)
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self._chain_hash = chain_hash
        # Pages per group of device-resident nodes nobody locks: what evicting can free. A
        # sequence locks a path from the root, so an unlocked node has no locked descendant.
        self.unlocked_pages = [0] * len(pools)
        # Tiers: called when a node leaves the device; True when a tier below keeps its pages
        # (the node stays, off the device), False when the node's contents are gone.
        self.keeps_below: Callable[[CacheNode], bool] = lambda node: False

    def touch(self) -> int:
        return next(self._clock)

    def add_child(self, parent: CacheNode, tokens: tuple[int, ...], pages: Optional[tuple[int, ...]]) -> CacheNode:
        """A new node under ``parent`` (the caller accounts for ``pages``' references)."""
        child = CacheNode(tokens=tokens, pages=pages, parent=parent,
                          hash=self._chain_hash(parent.hash, tokens) if self._chain_hash else b"")
        parent.children[tokens] = child
        self.num_nodes += 1
        return child

    def chain_hash(self, parent_hash: bytes, tokens: tuple[int, ...]) -> bytes:
        """The hash a child holding ``tokens`` under a node hashed ``parent_hash`` would have."""
        return self._chain_hash(parent_hash, tokens) if self._chain_hash else b""

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
            if node.lock_count == 0:
                self._count_unlocked(node, -1)
            node.lock_count += 1

    def unlock(self, nodes: list[CacheNode]) -> None:
        for node in nodes:
            if node.lock_count <= 0:
                raise AssertionError("prefix cache: unlock of an unlocked node")
            node.lock_count -= 1
            if node.lock_count == 0:
                self._count_unlocked(node, 1)

    def _count_unlocked(self, node: CacheNode, sign: int) -> None:
        if node.pages is not None:
            for group, page in enumerate(node.pages):
                if page != NULL_PAGE:
                    self.unlocked_pages[group] += sign

    def set_device_pages(self, node: CacheNode, pages: Optional[tuple[int, ...]]) -> None:
        """Change a node's device pages (the caller accounts for the references)."""
        if node.lock_count == 0:
            self._count_unlocked(node, -1)
        node.pages = pages
        if node.lock_count == 0:
            self._count_unlocked(node, 1)

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
            if child is None or child.pages is None:
                # A new node, or one whose pages left the device: the sequence's pages are it.
                pages = tuple(table[index] for table in page_tables)
                for pool, page in zip(self.pools, pages):
                    pool.acquire([page], CACHE_OWNER)
                if child is None:
                    child = self.add_child(node, keys[index], None)
                self.set_device_pages(child, pages)
            child.last_access = now
            path.append(child)
            node = child
        return path

    def _evictable_leaves(self) -> list[tuple[int, int, CacheNode]]:
        """Unlocked device leaves (device-resident, no device-resident child), LRU first."""
        heap, counter = [], itertools.count()
        for node in self.device_nodes():
            if node.lock_count == 0 and not node.device_children():
                heap.append((node.last_access, next(counter), node))
        heapq.heapify(heap)
        return heap

    def evict(self, num_pages: int, is_short: Optional[Callable[[], bool]] = None) -> int:
        """Evict LRU unlocked leaves until ``num_pages`` nodes are gone (or ``is_short()`` is
        False, or nothing is evictable). Returns how many nodes were evicted."""
        heap = self._evictable_leaves()
        counter = itertools.count(len(heap))
        evicted = 0
        while heap and evicted < num_pages and (is_short is None or is_short()):
            _, _, node = heapq.heappop(heap)
            self.evict_from_device(node)
            evicted += 1
            parent = node.parent
            if parent is not self.root and parent.pages is not None and parent.lock_count == 0 \
                    and not parent.device_children():
                heapq.heappush(heap, (parent.last_access, next(counter), parent))
        return evicted

    def evict_from_device(self, node: CacheNode) -> None:
        """Drop the node's device pages; the node stays if a tier below keeps them."""
        keep = self.keeps_below(node)
        pages = node.pages
        self.set_device_pages(node, None)
        for pool, page in zip(self.pools, pages):
            pool.release([page], CACHE_OWNER)
        if not keep:
            self.forget_if_hollow(node)

    def forget_if_hollow(self, node: CacheNode, resident_below: bool = False) -> None:
        """Remove ``node`` (and hollow ancestors) when no tier holds it and nothing hangs below."""
        while (node is not self.root and not node.children and node.pages is None
               and node.host_pages is None and not resident_below and node.lock_count == 0):
            parent = node.parent
            del parent.children[node.tokens]
            self.num_nodes -= 1
            node, resident_below = parent, False

    def reset(self) -> int:
        """Evict every unlocked node from the device; returns the number evicted."""
        return self.evict(self.num_nodes)

    def device_nodes(self) -> list[CacheNode]:
        """Device-resident nodes, parents before children. They form a prefix-closed subtree
        (a node on the device has its parent there), so the walk never enters a subtree that
        lives only in lower tiers."""
        nodes, stack = [], [child for child in self.root.children.values() if child.pages is not None]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(child for child in node.children.values() if child.pages is not None)
        return nodes

    def all_nodes(self) -> list[CacheNode]:
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes
