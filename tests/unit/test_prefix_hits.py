"""Prefix hits (``tandem/kv/prefix_hits.py``, ``coordinator.prefix_hits``) on hand-built books
(no model): a whole hit shares the cached pages, a hit stops at the last whole page it may take
(a page boundary, one token left to compute, one page fewer when a layer's state reads the next
token), eviction gives way least recently used leaves first and never a locked path, and a
recurrent group's hit needs its checkpoint: under pressure its checkpoints go first (least
recently used), the nodes stay. The sanitizer is on: the books balance after each step, and
everything is free at the end."""
from __future__ import annotations

from tandem.kv.planner import NULL_PAGE
from tests.support.books import FULL, RECURRENT, check_books, make_coordinator, page_holds, write_page

PAGE_SIZE = 4


def cached_sequence(coordinator, owner: str, prompt: list[int]):
    """A sequence that computed ``prompt`` (its pages written with their index + 1) and cached
    its whole pages."""
    state = coordinator.new_state(owner)
    coordinator.allocate(state, len(prompt))
    for value, page in enumerate(state.page_tables[0], 1):
        write_page(coordinator, 0, page, float(value))
    coordinator.prefix_hits.cache_computed_pages(state, prompt, len(prompt))
    return state


def test_hits_share_whole_pages_stop_at_a_page_boundary_and_evict_least_recently_used_leaves():
    coordinator = make_coordinator({"attention": FULL}, prefix_caching=True)
    hits, pool = coordinator.prefix_hits, coordinator.pools[0]
    prompt = list(range(100, 110))  # two whole pages and two tokens
    first = cached_sequence(coordinator, "a#0", prompt)
    assert len(first.page_tables[0]) == 3 and len(first.cache_path) == 2
    whole = first.page_tables[0][:2]

    # A hit: the two whole pages, shared (the first sequence, the cache, the hit each hold them).
    second = coordinator.new_state("b#0")
    assert hits.match(second, prompt) == 8
    assert second.page_tables[0] == whole and second.cache_path == first.cache_path
    assert all(dict(pool.holders(page)) == {"a#0": 1, "cache": 1, "b#0": 1} for page in whole)
    assert page_holds(coordinator, 0, whole[1], 2.0)
    check_books(coordinator, [first, second])

    # Partial hits stop at a page boundary: a prompt that differs inside the second page takes
    # the first; one that ends on a boundary takes one page fewer (a token is left to compute).
    diverging = coordinator.new_state("c#0")
    assert hits.match(diverging, prompt[:6] + [1, 2, 3, 4]) == 4 and diverging.page_tables[0] == whole[:1]
    boundary = coordinator.new_state("d#0")
    assert hits.match(boundary, prompt[:8]) == 4 and boundary.page_tables[0] == whole[:1]
    assert hits.match(boundary, prompt) == 0  # a sequence with pages already takes no hit
    # A layer's state reads the next token (an MTP draft's): the last page is recomputed.
    coordinator.state_reads_next_token = True
    reads_next = coordinator.new_state("e#0")
    assert hits.match(reads_next, prompt) == 4 and reads_next.page_tables[0] == whole[:1]
    coordinator.state_reads_next_token = False
    check_books(coordinator, [first, second, diverging, boundary, reads_next])
    for state in (first, second, diverging, boundary, reads_next):
        coordinator.free(state)

    # Eviction: three branches, unlocked ``x`` (two nodes) and ``y``, and ``z`` locked by a live
    # sequence; ``y`` is used after ``x``. Evicting two pages takes ``x``'s leaf, then ``x``'s
    # first node (a leaf now, older than ``y``): least recently used leaves first, parents
    # after their children; ``z`` is never evictable.
    assert hits.reset() == 2
    x = [1] * 4 + [2] * 4 + [0]
    y = [3] * 4 + [0]
    z = [4] * 4 + [0]
    for owner, tokens in (("x#0", x), ("y#0", y)):
        coordinator.free(cached_sequence(coordinator, owner, tokens))
    live = cached_sequence(coordinator, "z#0", z)
    used = coordinator.new_state("y#1")
    assert hits.match(used, y) == 4  # ``y`` is now the most recently used
    coordinator.free(used)
    assert coordinator.prefix_cache.num_nodes == 4 and hits.evictable_pages() == [3]
    free_before = pool.num_free
    hits.give_way([free_before + 1])  # evicts one past the need (the slack)
    assert pool.num_free == free_before + 2 and coordinator.prefix_cache.num_nodes == 2
    assert hits.match(coordinator.new_state("x#1"), x) == 0
    again = coordinator.new_state("y#2")
    assert hits.match(again, y) == 4 and hits.evictable_pages() == [0]
    coordinator.free(again)
    hits.give_way([pool.num_usable])  # more than can be had: everything unlocked goes, ``z`` stays
    assert coordinator.prefix_cache.num_nodes == 1 and live.cache_path[0].pages is not None
    check_books(coordinator, [live])
    coordinator.free(live)
    assert hits.reset() == 1
    coordinator.sanitizer.check_all_free(coordinator)


def test_recurrent_hits_need_a_checkpoint_and_checkpoints_give_way_first():
    coordinator = make_coordinator({"attention": FULL, "mamba": RECURRENT}, prefix_caching=True, max_num_seqs=4)
    hits, recurrent_pool = coordinator.prefix_hits, coordinator.pools[1]
    older, newer = [5] * 8 + [0], [6] * 8 + [0]
    checkpoints = []
    for owner, prompt in (("a#0", older), ("b#0", newer)):
        state = coordinator.new_state(owner)
        coordinator.allocate(state, len(prompt))
        checkpoints.append(state.page_tables[1][1])
        coordinator.prefix_hits.cache_computed_pages(state, prompt, 8)  # the checkpoint after token 8
        coordinator.free(state)
    assert [dict(recurrent_pool.holders(page)) for page in checkpoints] == [{"cache": 1}] * 2
    # The hit rule: only where a checkpoint is, at a page boundary (the state there is known).
    assert hits.match(coordinator.new_state("c#0"), older[:4] + [1, 2, 3, 4, 5]) == 0
    assert hits.evictable_pages()[1] == 2  # both checkpoints, held by the cache alone

    # The recurrent pool runs one page short: the least recently used checkpoint (``older``'s)
    # is dropped, no node is evicted, and the other prompt still hits.
    num_nodes = coordinator.prefix_cache.num_nodes
    hits.give_way([0, recurrent_pool.num_free + 1])
    assert coordinator.prefix_cache.num_nodes == num_nodes and page_holds(coordinator, 1, checkpoints[0], float("nan"))
    assert hits.match(coordinator.new_state("d#0"), older) == 0
    hit = coordinator.new_state("e#0")
    assert hits.match(hit, newer) == 8 and hit.page_tables[1] == [checkpoints[1]]
    assert hit.page_tables[0] == [node.pages[0] for node in hit.cache_path] and NULL_PAGE not in hit.page_tables[0]
    check_books(coordinator, [hit])
    coordinator.free(hit)
    assert hits.reset() == num_nodes
    coordinator.sanitizer.check_all_free(coordinator)
