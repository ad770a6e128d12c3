"""The block pool and the radix prefix cache on hand-built page tables (no model): reference
counts and owner tags (I2, I6), the census the books rely on (I5), whole-page matching, locks,
LRU eviction of unlocked leaves only, duplicates kept by their inserter, and nodes that a lower
tier keeps when their device pages go."""
from __future__ import annotations

import pytest

from tandem.kv.block_pool import CACHE_OWNER, BlockPool, OutOfPagesError, SanitizerError
from tandem.kv.planner import NULL_PAGE
from tandem.kv.prefix_cache import PrefixCache

PAGE_SIZE = 4


def tokens(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def test_block_pool_references_owners_and_census():
    freed_pages = []
    pool = BlockPool(0, 9, on_free=lambda group, pages: freed_pages.extend(pages))
    assert pool.num_usable == 8 and pool.num_free == 8  # page 0 is the null page, never handed out
    pages = pool.allocate(3, "a#0")
    assert NULL_PAGE not in pages and len(set(pages)) == 3 and pool.num_free == 5
    pool.acquire(pages[:2], CACHE_OWNER)
    pool.acquire([NULL_PAGE, pages[0]], "inflight:save")  # the null page is never counted
    assert pool.refcount(pages[0]) == 3 and pool.refcount(NULL_PAGE) == 0
    assert pool.census() == {"free": 5, "used": 3, "cached": 0, "inflight": 0}

    assert pool.release(pages, "a#0") == [pages[2]]  # only the page nobody else holds is freed
    assert freed_pages == [pages[2]]  # handed to on_free (the sanitizer poisons it)
    assert pool.census() == {"free": 6, "used": 0, "cached": 2, "inflight": 0}
    assert pool.release([pages[0]], CACHE_OWNER) == []  # still in flight
    assert pool.census() == {"free": 6, "used": 0, "cached": 1, "inflight": 1}

    with pytest.raises(SanitizerError, match="double free"):
        pool.release([pages[0]], "a#0")
    with pytest.raises(SanitizerError, match="acquire of free page"):
        pool.acquire([pages[2]], "b#0")
    pool.check_owner("inflight:save", [pages[0], NULL_PAGE])
    with pytest.raises(SanitizerError, match="does not hold"):
        pool.check_owner("b#0", [pages[1]])
    with pytest.raises(OutOfPagesError, match="need 7 pages, 6 free"):
        pool.allocate(7, "b#0")
    assert pool.num_free == 6  # a refused allocation takes nothing

    pool.release([pages[0]], "inflight:save")
    pool.release([pages[1]], CACHE_OWNER)
    assert pool.num_free == pool.num_usable and pool.free_list_consistent()
    assert sorted(freed_pages) == sorted(pages)


def make_cache(num_pages: int = 17, keeps_below=None) -> tuple[PrefixCache, BlockPool]:
    pool = BlockPool(0, num_pages)
    cache = PrefixCache([pool], PAGE_SIZE)
    if keeps_below is not None:
        cache.keeps_below = keeps_below
    return cache, pool


def run_sequence(cache: PrefixCache, pool: BlockPool, owner: str, token_ids: list[int]) -> list:
    """A sequence computes ``token_ids`` into pages of its own and caches its whole pages, as the
    coordinator does (it keeps holding them until ``finish``)."""
    num_full = len(token_ids) // PAGE_SIZE
    table = pool.allocate(-(-len(token_ids) // PAGE_SIZE), owner)
    path = cache.insert(token_ids, [table], num_full, None, 0)
    cache.lock(path)
    return table, path


def finish(cache: PrefixCache, pool: BlockPool, owner: str, table: list[int], path: list) -> None:
    cache.unlock(path)
    pool.release(table, owner)


def test_match_insert_lock_and_duplicates():
    cache, pool = make_cache()
    prompt = tokens(100, 14)  # three whole pages and two tokens
    table, path = run_sequence(cache, pool, "a#0", prompt)
    assert [node.pages for node in path] == [(page,) for page in table[:3]]  # the partial page is not cached
    assert cache.num_nodes == 3 and all(pool.refcount(page) == 2 for page in table[:3])
    assert cache.unlocked_pages == [0]  # all three are locked by the sequence

    # Whole pages only, never past max_pages, and a differing page ends the match.
    assert cache.match(prompt, max_pages=10) == path
    assert cache.match(prompt, max_pages=2) == path[:2]
    assert cache.match(prompt[:11], max_pages=10) == path[:2]
    assert cache.match(prompt[:4] + [1] + prompt[5:], max_pages=10) == path[:1]
    assert cache.match(tokens(0, 12), max_pages=3) == []

    # A second sequence computed the same prompt into its own pages (no hit, e.g. prompt
    # logprobs wanted): the cache keeps its pages, the sequence keeps its duplicates.
    duplicate, same_path = run_sequence(cache, pool, "b#0", prompt)
    assert same_path == path and cache.num_nodes == 3
    assert all(pool.holders(page) == {"b#0": 1} for page in duplicate)
    finish(cache, pool, "b#0", duplicate, same_path)
    assert all(node.lock_count == 1 for node in path)

    # A branch: shares the first page's node, adds its own second node.
    branch_prompt = prompt[:4] + tokens(300, 4)
    branch_table, branch_path = run_sequence(cache, pool, "c#0", branch_prompt)
    assert branch_path[0] is path[0] and branch_path[1] is not path[1] and cache.num_nodes == 4
    assert path[0].lock_count == 2 and set(path[0].children) == {tuple(prompt[4:8]), tuple(tokens(300, 4))}

    finish(cache, pool, "a#0", table, path)
    finish(cache, pool, "c#0", branch_table, branch_path)
    assert cache.unlocked_pages == [4] and pool.census()["cached"] == 4
    with pytest.raises(AssertionError, match="unlock of an unlocked node"):
        cache.unlock(path[:1])
    assert cache.reset() == 4 and cache.num_nodes == 0
    assert pool.num_free == pool.num_usable and cache.unlocked_pages == [0]


def test_eviction_takes_unlocked_leaves_least_recently_used_first():
    cache, pool = make_cache()
    # Three two-page conversations under one shared first page: 1 + 3 * 1 = 4 nodes.
    shared = tokens(0, 4)
    conversations = {name: shared + tokens(first, 4) for name, first in (("a", 10), ("b", 20), ("c", 30))}
    leaves = {}
    for name, prompt in conversations.items():
        table, path = run_sequence(cache, pool, f"{name}#0", prompt)
        finish(cache, pool, f"{name}#0", table, path)
        leaves[name] = path[1]
    cache.match(conversations["a"], max_pages=2)  # "a" is now the most recently used

    # "c" is locked by a running sequence: of the unlocked leaves, "b" (older than "a") goes first.
    running = cache.match(conversations["c"], max_pages=2)
    cache.lock(running)
    assert cache.evict(1) == 1
    assert tuple(tokens(20, 4)) not in leaves["b"].parent.children and cache.num_nodes == 3
    # Then "a"; the shared parent is locked through "c" and stays, as does "c".
    assert cache.evict(10) == 1
    assert [node.tokens for node in cache.device_nodes()] == [tuple(shared), tuple(tokens(30, 4))]
    assert cache.unlocked_pages == [0] and pool.census() == {"free": 14, "used": 0, "cached": 2, "inflight": 0}

    # Unlocked, the leaf goes before its parent, and the parent right after (it became a leaf).
    cache.unlock(running)
    assert cache.evict(1) == 1 and [node.tokens for node in cache.device_nodes()] == [tuple(shared)]
    assert cache.evict(1) == 1 and cache.num_nodes == 0 and pool.num_free == pool.num_usable

    # is_short stops eviction as soon as the caller has room.
    for name, prompt in conversations.items():
        table, path = run_sequence(cache, pool, f"{name}#0", prompt)
        finish(cache, pool, f"{name}#0", table, path)
    assert cache.evict(10, is_short=lambda: pool.num_free < 14) == 2 and pool.num_free == 14


def test_a_node_a_lower_tier_keeps_stays_off_the_device():
    kept = set()
    cache, pool = make_cache(keeps_below=lambda node: node.tokens in kept)
    prompt = tokens(0, 12)
    table, path = run_sequence(cache, pool, "a#0", prompt)
    finish(cache, pool, "a#0", table, path)
    kept.add(tuple(prompt[4:8]))  # the host tier holds the middle page
    assert cache.evict(10) == 3 and pool.num_free == pool.num_usable
    # The leaf is gone; the middle node stays off the device, so its parent (a hollow node
    # nothing holds) stays as the path to it.
    assert cache.num_nodes == 2 and cache.device_nodes() == []
    remaining = cache.match(prompt, max_pages=3)
    assert [node.tokens for node in remaining] == [tuple(prompt[:4]), tuple(prompt[4:8])]
    assert all(not node.on_device for node in remaining) and cache.unlocked_pages == [0]

    # Computing the prompt again puts the sequence's pages into the existing nodes.
    table, path = run_sequence(cache, pool, "b#0", prompt)
    assert path[:2] == remaining and all(node.on_device for node in path) and cache.num_nodes == 3
    finish(cache, pool, "b#0", table, path)
    assert cache.unlocked_pages == [3]
    kept.clear()
    cache.reset()
    assert cache.num_nodes == 0 and pool.num_free == pool.num_usable
