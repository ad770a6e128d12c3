"""The tiers behind the prefix cache: host memory and disk, and preemption by swap.

Owner: the engine core holds one ``TieredState`` when a host tier is configured; it sits above
the coordinator, registered as its ``StateListener`` (``kv/state_events.py``): the coordinator
and its prefix hits feed it their events (a state freed, nodes cached, a path released) and ask
it the queries of a hit (``loading``, ``complete_path``, ``restore``, ``keeps_below``), knowing
that interface only, and it calls back into them (``make_room``, ``evictable_pages``). It keeps the
books — residency, the host LRU, the host pages' holders, copies in flight and their follow-ups,
statistics — and moves nothing itself: each copy, release, poison, disk read, write and install
is a page operation sent through the coordinator's outbox (``kv/page_operations.py``), which this
rank's ``TierWorker`` (``tier_worker.py``) applies at once and every other rank's applies from the
step message. It moves whole prefix-cache nodes (one page per group) and whole requests (every
page of every group) and knows nothing of what a group holds: the mover copies the registry's
buffers as byte ranges.

    device pool ──save (write policy)──▶ host pool ──write through──▶ disk store
        ▲                                   │  ▲                          │
        └──── restore on a hit, per layer ──┘  └──── read on a hit ───────┘

- **Residency.** A node's ``pages`` (device) and ``host_pages`` (host) are either set or None;
  disk residency is the store's index, keyed by the node's chain hash. Eviction moves device →
  host → disk → gone (``keeps_below`` tells the prefix cache whether a node survives leaving
  the device; host eviction writes a node to disk first when the store lacks it).
- **Write policies** (SGLang's names): ``write_through`` saves a node to the host when it is
  cached (and, if the host had no room then, when it leaves the device);
  ``write_through_selective`` when it is hit for the second time; ``write_back`` when it leaves
  the device (the eviction waits for the copy).
- **I2.** Every copy holds in-flight references on the device pages and host pages it reads or
  writes, released when its completion is observed (``poll``); a disk write copies its payload
  first, so it holds nothing.
- **I3.** A restore allocates device pages, issues the loads layer by layer and registers each
  layer's completion with ``PendingLoads``: the layer's first read waits for its own copy.
- **Swap.** A preempted sequence's pages go to host pages owned by ``swap:<sequence>`` and come
  back into fresh device pages, table order and null entries kept, with its computed-token count;
  the host copy is dropped only once the sequence is admitted again (``commit_swap_in``).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from tandem.kv.block_pool import CACHE_OWNER, SanitizerError
from tandem.kv.page_operations import FENCE, HOST_POISON, LOAD, SAVE, PageMove, PageOperation
from tandem.kv.planner import NULL_PAGE
from tandem.kv.prefix_cache import CacheNode
from tandem.kv.tiers.host_pool import HostPageBooks, layouts_of
from tandem.kv.tiers.disk_pages import DiskPages
from tandem.kv.tiers.prefetch import DiskPrefetch
from tandem.kv.tiers.page_mover import Transfer
from tandem.kv.request_state import SwappedState
from tandem.kv.tiers.swap import Swap

if TYPE_CHECKING:
    from tandem.kv.coordinator import StateCoordinator
    from tandem.kv.request_state import RequestState
    from tandem.kv.tiers.tier_worker import TierWorker

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SELECTIVE_HITS = 2  # write_through_selective: a node is saved on its second hit


@dataclass
class TierStats:
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    disk_hit_tokens_by_origin: dict[str, int] = field(default_factory=dict)  # who wrote them: prefill, decode, ...
    saved_pages: int = 0
    loaded_pages: int = 0
    d2h_bytes: int = 0
    d2h_seconds: float = 0.0
    h2d_bytes: int = 0
    h2d_seconds: float = 0.0
    swap_outs: int = 0
    swap_ins: int = 0
    swaps_refused: int = 0  # host tier full: recompute instead


@dataclass
class _Operation:
    op_id: int  # the copy id its SAVE / LOAD and FENCE name
    transfer: Transfer
    device_owner: Optional[str]
    host_owner: Optional[str]
    host_pages: list[list[int]]
    on_done: list[Callable[[], None]] = field(default_factory=list)


def leading_fit(rows: list[list[int]], limits: list[int]) -> tuple[int, list[int]]:
    """How many leading rows (pages per group) fit within ``limits`` together, and their sum."""
    kept, totals = 0, [0] * len(limits)
    for row in rows:
        if any(total + count > limit for total, count, limit in zip(totals, row, limits)):
            break
        totals = [total + count for total, count in zip(totals, row)]
        kept += 1
    return kept, totals


def pair_pages(sources: list[tuple[int, ...]], fresh: list[list[int]],
               to_host: bool) -> tuple[list[tuple[int, ...]], list[PageMove]]:
    """Give each node's non-null entry (one page per group, in ``sources``) the next fresh page
    of its group: the nodes' new entries, and the moves (device ⇄ host pairs per group)."""
    cursors = [iter(pages) for pages in fresh]
    moves = [PageMove(group, [], []) for group in range(len(fresh))]
    placed = []
    for entries in sources:
        new = []
        for group, page in enumerate(entries):
            if page == NULL_PAGE:
                new.append(NULL_PAGE)
                continue
            other = next(cursors[group])
            new.append(other)
            device, host = (page, other) if to_host else (other, page)
            moves[group].device_pages.append(device)
            moves[group].host_pages.append(host)
        placed.append(tuple(new))
    return placed, moves


class TieredState(DiskPages, Swap):
    def __init__(self, coordinator: "StateCoordinator", local: "TierWorker", *, host_pages: int,
                 write_policy: str) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"host_cache_write_policy: must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.coordinator = coordinator
        self.registry = coordinator.registry
        self.page_size = coordinator.page_size
        self.layouts = layouts_of(self.registry)
        self.host = HostPageBooks(len(self.layouts), host_pages, on_free=self._host_freed)
        # This rank's side of the tiers: it applies what the books send (and under tensor
        # parallelism every rank's does); the books read its completions and its disk reads.
        self.local = local
        self.outbox = coordinator.outbox
        self.policy = write_policy
        self.disk = local.disk  # this rank's store: its index is the disk residency
        self._ops: list[_Operation] = []
        self._op_ids = itertools.count()
        self._swapped: dict[str, SwappedState] = {}
        self._host_lru: "OrderedDict[CacheNode, None]" = OrderedDict()  # host-resident nodes, LRU first
        self._read_from_disk_now: dict[int, str] = {}  # node -> the origin of its stored page
        self.restored_now: dict[int, str] = {}  # the latest match's restored nodes -> "host"/"disk"
        self.restored_origin: dict[int, str] = {}  # the latest match's disk nodes -> who wrote them
        self.stats = TierStats()
        self.prefetch = DiskPrefetch(self) if self.disk is not None else None
        self.peers = None  # tensor parallelism: the other ranks' agreement on disk reads (disk_pages.py)
        coordinator.attach_listener(self)  # fed the coordinator's events (kv/state_events.py)

    def _host_freed(self, group: int, pages: list[int]) -> None:
        if self.coordinator.sanitizer.enabled and pages:  # (I6: a load from a freed page fails loudly)
            self.outbox.send(PageOperation(HOST_POISON, group, list(pages)))

    @property
    def _cache(self):
        return self.coordinator.prefix_cache

    @property
    def num_groups(self) -> int:
        return len(self.layouts)

    # -- operations in flight (I2) ----------------------------------------------------------------
    def _start(self, moves: list[PageMove], load: bool, device_tables: Optional[list[list[int]]],
               host_tables: list[list[int]]) -> _Operation:
        op_id = next(self._op_ids)
        device_owner = self.coordinator.inflight.hold(f"tier{op_id}", device_tables) if device_tables else None
        host_owner = f"inflight:tier{op_id}"
        for pool, pages in zip(self.host.pools, host_tables):
            pool.acquire(pages, host_owner)
        moves = [move for move in moves if move.device_pages]
        transfer = self.outbox.send(PageOperation(LOAD if load else SAVE, -1, [op_id], moves=moves))
        op = _Operation(op_id, transfer, device_owner, host_owner, host_tables)
        self._ops.append(op)
        return op

    def poll(self) -> None:
        """Observe completed copies: release what they held, then run their follow-ups."""
        finished = [op for op in self._ops if op.transfer.ticket.done()]
        if not finished:
            return
        self._ops = [op for op in self._ops if op not in finished]
        for op in finished:
            seconds = op.transfer.seconds()
            if op.transfer.direction == "d2h":
                self.stats.d2h_bytes += op.transfer.num_bytes
                self.stats.d2h_seconds += seconds
            else:
                self.stats.h2d_bytes += op.transfer.num_bytes
                self.stats.h2d_seconds += seconds
            # Before the pages can be reused, every rank's own copy must be done too.
            self.outbox.send(PageOperation(FENCE, -1, [op.op_id]))
            if op.device_owner is not None:
                self.coordinator.inflight.release(op.device_owner)
            for pool, pages in zip(self.host.pools, op.host_pages):
                pool.release(pages, op.host_owner)
            for follow_up in op.on_done:
                follow_up()
        if self.disk is not None:
            self.disk.poll()

    def _wait(self, op: _Operation) -> None:
        op.transfer.ticket.wait()
        self.poll()

    @property
    def copies_in_flight(self) -> int:
        return len(self._ops)

    @property
    def offloads_in_flight(self) -> int:
        """Device→host copies and store writes issued and not yet complete."""
        return len(self._ops) + (self.disk.writes_in_flight if self.disk is not None else 0)

    def drain(self) -> None:
        """Wait for every copy and disk write of this rank; release what they held."""
        for op in self._ops:
            op.transfer.ticket.wait()
        self.poll()
        self.local.drain()

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
        self.drain()
        self.local.close()

    # -- host pages --------------------------------------------------------------------------------
    def _allocate_host(self, counts: list[int], owner: str) -> Optional[list[list[int]]]:
        if not self._make_host_room(counts):
            return None
        return [pool.allocate(count, owner) if count else [] for pool, count in zip(self.host.pools, counts)]

    def _make_host_room(self, counts: list[int]) -> bool:
        pools = self.host.pools

        def short() -> bool:
            return any(pool.num_free < count for pool, count in zip(pools, counts))

        if not short():
            return True
        if any(count > pool.num_usable for pool, count in zip(pools, counts)) or self._cache is None:
            return False
        # Least recently used host copies first, leaves before their parents (a parent whose
        # child is still on the host is passed over while the walk can find others).
        for leaves_only in (True, False):
            for node in list(self._host_lru):
                if not short():
                    return True
                if (leaves_only and not self._host_leaf(node)) or not self._host_evictable(node):
                    continue
                self._evict_from_host(node)
        return not short()

    def _host_evictable(self, node: CacheNode) -> bool:
        """No copy reads or writes its host pages (only the cache holds them), and a hit is not
        about to restore it (locked off the device; a locked node on the device is in use there,
        and its host copy is only a backup)."""
        if node.lock_count and node.pages is None:
            return False
        return all(page == NULL_PAGE or dict(pool.holders(page)) == {CACHE_OWNER: 1}
                   for pool, page in zip(self.host.pools, node.host_pages))

    @staticmethod
    def _host_leaf(node: CacheNode) -> bool:
        return not any(child.host_pages is not None for child in node.children.values())

    def _host_resident(self, node: CacheNode) -> None:
        """The node's host copy exists or was just used: most recently used now."""
        self._host_lru[node] = None
        self._host_lru.move_to_end(node)

    def _evict_from_host(self, node: CacheNode) -> None:
        """Host → disk (when the store lacks the node) → gone from the host."""
        on_disk = False
        if self.disk is not None:
            on_disk = self.disk.contains(node.hash) or self._write_to_disk(node)
        pages, node.host_pages = node.host_pages, None
        del self._host_lru[node]
        for pool, page in zip(self.host.pools, pages):
            if page != NULL_PAGE:
                pool.release([page], CACHE_OWNER)
        self._cache.forget_if_hollow(node, resident_below=on_disk)

    # -- saves ---------------------------------------------------------------------------------------
    def on_cached(self, nodes: list[CacheNode]) -> None:
        """Nodes a sequence just cached (or made device-resident again)."""
        if self.policy == "write_through":
            self._save_nodes(nodes)

    def count_hit(self, path: list[CacheNode]) -> None:
        """A sequence's first admission took ``path``: count the tokens each tier supplied."""
        for node in path:
            tier = self.restored_now.get(id(node))
            if tier == "host":
                self.stats.host_hit_tokens += self.page_size
            elif tier == "disk":
                self.stats.disk_hit_tokens += self.page_size
                origin = self.restored_origin.get(id(node), "unknown")
                by_origin = self.stats.disk_hit_tokens_by_origin
                by_origin[origin] = by_origin.get(origin, 0) + self.page_size

    def on_hit(self, nodes: list[CacheNode]) -> None:
        for node in nodes:
            node.hits += 1
        if self.policy == "write_through_selective":
            self._save_nodes([node for node in nodes if node.hits >= SELECTIVE_HITS])

    def _save_nodes(self, nodes: list[CacheNode]) -> Optional[_Operation]:
        nodes = [node for node in nodes if node.pages is not None and node.host_pages is None]
        if not nodes:
            return None
        counts = [[int(node.pages[group] != NULL_PAGE) for group in range(self.num_groups)] for node in nodes]
        totals = [sum(column) for column in zip(*counts)]
        if not self._make_host_room(totals):
            # Save the leading nodes that fit (parents come before children) in what room
            # eviction can make.
            self._make_host_room([min(total, pool.num_usable) for total, pool in zip(totals, self.host.pools)])
            kept, totals = leading_fit(counts, [pool.num_free for pool in self.host.pools])
            nodes = nodes[:kept]
            if not nodes:
                return None
        host = [pool.allocate(total, CACHE_OWNER) if total else [] for pool, total in zip(self.host.pools, totals)]
        placed, moves = pair_pages([node.pages for node in nodes], host, to_host=True)
        for node, host_pages in zip(nodes, placed):
            node.host_pages = host_pages
            self._host_resident(node)
        self.stats.saved_pages += len(nodes)
        op = self._start(moves, False, [move.device_pages for move in moves], [move.host_pages for move in moves])
        if self.disk is not None:
            op.on_done.append(lambda nodes=nodes: self._write_nodes_to_disk(nodes))
        return op

    def keeps_below(self, node: CacheNode) -> bool:
        """The prefix cache drops ``node``'s device pages: whether a tier below holds them."""
        # write_back saves here; so does write_through for a node its insertion could not save
        # (the host was full of copies in flight then). write_through_selective leaves it.
        if node.host_pages is None and self.policy != "write_through_selective":
            op = self._save_nodes([node])
            if op is not None:
                self._wait(op)
        if node.host_pages is not None:
            return True
        return self.disk is not None and self.disk.contains(node.hash)

    # -- the coordinator's events (kv/state_events.StateListener) -------------------------------------
    def on_freed(self, state: "RequestState") -> None:
        """A sequence is freed for good: its swapped-out copy on the host goes."""
        if state.swapped is not None:
            self.drop_swapped(state)

    def on_path_released(self, owner: str) -> None:
        """A disk read started for ``owner``'s hit is no longer wanted."""
        if self.prefetch is not None:
            self.prefetch.forget(owner)

    def loading(self, owner: str, token_ids: list[int], max_pages: int, idle: bool) -> bool:
        """Whether pages ``owner``'s match would take from the disk store are still being read
        off the engine loop (``prefetch.py``)."""
        return self.prefetch is not None and self.prefetch.pending(owner, token_ids, max_pages, idle)

    # -- hits ----------------------------------------------------------------------------------------
    def complete_path(self, path: list[CacheNode], token_ids: list[int], max_pages: int) -> list[CacheNode]:
        """The matched path, every node resident in some tier (disk pages are read into the
        host here), extended past the tree's end by pages the disk holds. Returned locked."""
        cache = self._cache
        result: list[CacheNode] = []
        now = cache.touch()
        for node in path:
            if node.pages is None and node.host_pages is None and (
                    self.disk is None or not self._read_from_disk(node)):
                break
            cache.lock([node])
            if node.host_pages is not None:
                self._host_resident(node)
            result.append(node)
        if self.disk is not None and len(result) == len(path):
            parent = result[-1] if result else cache.root
            size = self.page_size
            for index in range(len(result), max_pages):
                tokens = tuple(token_ids[index * size:(index + 1) * size])
                child = parent.children.get(tokens)
                if child is None:
                    child = cache.add_child(parent, tokens, None)
                if child.pages is None and child.host_pages is None and not (
                        self.disk.contains(child.hash) and self._read_from_disk(child)):
                    cache.forget_if_hollow(child)
                    break
                child.last_access = now
                cache.lock([child])
                if child.host_pages is not None:
                    self._host_resident(child)
                result.append(child)
                parent = child
        return result

    def disk_keys_to_read(self, token_ids: list[int], max_pages: int) -> list[bytes]:
        """The store keys of the pages a match of ``token_ids`` would read from disk, in order:
        nodes of the tree on no tier above it, then past the tree's end while the store holds
        the chain (``complete_path``'s walk, without reading)."""
        cache, size = self._cache, self.page_size
        path = cache.match(token_ids, max_pages)
        keys = []
        for node in path:
            if node.pages is None and node.host_pages is None:
                if not self.disk.contains(node.hash):
                    return keys
                keys.append(node.hash)
        key = path[-1].hash if path else cache.root.hash
        for index in range(len(path), max_pages):
            key = cache.chain_hash(key, tuple(token_ids[index * size:(index + 1) * size]))
            if not self.disk.contains(key):
                break
            keys.append(key)
        return keys

    def install_chain(self, token_ids: list[int], max_pages: int, keys: list[bytes]) -> int:
        """Put the pages of ``keys`` read from the store (as far as every rank has them) into host
        pages of the nodes along ``token_ids`` that need them (nodes past the tree's end are
        made), up to the first node without one; returns how many were installed."""
        cache, size = self._cache, self.page_size
        node, installed = cache.root, []
        entries = self._agree_on_reads(keys)
        for index in range(max_pages):
            tokens = tuple(token_ids[index * size:(index + 1) * size])
            child = node.children.get(tokens)
            if child is not None and (child.pages is not None or child.host_pages is not None):
                node = child
                continue
            made = child is None
            if made:
                child = cache.add_child(node, tokens, None)
            entry = entries.get(child.hash)
            if entry is None or not self._install_payload(child, *entry):
                if made:
                    cache.forget_if_hollow(child)
                break
            cache.lock([child])  # (not evicted to make host room for the rest of the chain)
            installed.append(child)
            node = child
        cache.unlock(installed)
        return len(installed)

    def restore(self, path: list[CacheNode]) -> int:
        """Make the path's nodes device-resident, as many as the device pool allows; returns how
        many leading nodes are on the device. Loads are issued per layer (I3)."""
        self.restored_now, self.restored_origin = {}, {}
        first = next((index for index, node in enumerate(path) if node.pages is None), len(path))
        todo = path[first:]
        self.on_hit(path[:first])
        if not todo:
            self._read_from_disk_now.clear()
            return len(path)
        rows = [[int(page != NULL_PAGE) for page in node.host_pages] for node in todo]
        available = [pool.num_free for pool in self.coordinator.pools]
        if any(need > free for need, free in zip(map(sum, zip(*rows)), available)):
            evictable = self.coordinator.prefix_hits.evictable_pages()
            available = [free + spare for free, spare in zip(available, evictable)]
        kept, totals = leading_fit(rows, available)
        todo = todo[:kept]
        if not todo:
            self._read_from_disk_now.clear()
            return first
        self.coordinator.make_room(totals)
        device = [pool.allocate(total, CACHE_OWNER) if total else []
                  for pool, total in zip(self.coordinator.pools, totals)]
        placed, moves = pair_pages([node.host_pages for node in todo], device, to_host=False)
        for node, pages in zip(todo, placed):
            self._cache.set_device_pages(node, pages)
            origin = self._read_from_disk_now.get(id(node))
            self.restored_now[id(node)] = "host" if origin is None else "disk"
            if origin is not None:
                self.restored_origin[id(node)] = origin
        self._read_from_disk_now.clear()
        self.stats.loaded_pages += len(todo)
        self._start(moves, True, [move.device_pages for move in moves], [move.host_pages for move in moves])
        return first + kept

    # -- books (I5 across tiers) -----------------------------------------------------------------------
    def check_books(self) -> None:
        """Every host page's holders are exactly the cache nodes' host copies, the swapped
        sequences and the copies in flight."""
        from collections import Counter

        nodes = self._cache.all_nodes() if self._cache is not None else []
        for group, pool in enumerate(self.host.pools):
            expected = [Counter() for _ in range(pool.num_pages)]
            for node in nodes:
                if node.host_pages is not None and node.host_pages[group] != NULL_PAGE:
                    expected[node.host_pages[group]][CACHE_OWNER] += 1
            for swapped in self._swapped.values():
                for page in swapped.host_tables[group]:
                    if page != NULL_PAGE:
                        expected[page][swapped.owner] += 1
            for op in self._ops:
                for page in op.host_pages[group]:
                    expected[page][op.host_owner] += 1
            for page in range(1, pool.num_pages):
                if +expected[page] != +pool.holders(page):
                    raise SanitizerError(
                        f"host tier books unbalanced in group {group}, page {page}: holders "
                        f"{dict(pool.holders(page))}, accounted for {dict(expected[page])}")
            if not pool.free_list_consistent():
                raise SanitizerError(f"host tier free list inconsistent in group {group}")

    def check_idle(self) -> None:
        """Idle: nothing in flight, nothing swapped; host pages are free or cached."""
        if self._ops or self._swapped:
            raise SanitizerError(f"tiers not idle: {len(self._ops)} copies in flight, "
                                 f"{len(self._swapped)} sequences swapped out")
        self.check_books()
