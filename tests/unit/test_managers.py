"""The per-kind state managers, alone and through the coordinator, on hand-built page tables
(no model): pages per token count, forks, PD's final pages and speculation's rollback for full
attention; the sliding window's drops and prefix hits against a brute-force reading of the
window; the recurrent slot's checkpoints, copy on write, forks and rollback. The sanitizer is
on: freed pages read as poison, the books balance after each operation, and everything is free
at the end."""
from __future__ import annotations

import itertools
import math

from tandem.kv.planner import NULL_PAGE
from tests.support.books import FULL, RECURRENT, SLIDING, check_books, make_coordinator, page_holds, write_page

PAGE_SIZE = 4
NAN = float("nan")


def test_full_attention_pages_forks_final_pages_and_rollback():
    coordinator = make_coordinator({"attention": FULL})
    manager = coordinator.managers[0]
    assert [manager.pages_for_tokens(n) for n in (0, 1, 4, 5, 9)] == [0, 1, 1, 2, 3]
    assert manager.droppable_page_indices([5, 6, 7], 12) == [] and manager.usable_prefix_pages(3) == 3

    parent = coordinator.new_state("a#0")
    coordinator.allocate(parent, 10)
    table = parent.page_tables[0]
    assert len(table) == 3 and manager.num_new_pages(table, 12) == 0 and manager.num_new_pages(table, 13) == 1
    for value, page in enumerate(table, 1):
        write_page(coordinator, 0, page, float(value))

    # Forks share whole pages and copy the partial last one (with private_last, the page
    # holding the last token even when whole).
    assert manager.fork_pages(table, 10) == (table[:2], table[2:3])
    assert manager.fork_pages(table, 8) == (table[:2], [])
    assert manager.fork_pages(table, 8, private_last=True) == (table[:1], table[1:2])
    child = coordinator.new_state("a#1")
    assert coordinator.forks.fork(parent, child, 10)
    copy = child.page_tables[0][2]
    assert child.page_tables[0][:2] == table[:2] and copy not in table
    assert page_holds(coordinator, 0, copy, 3.0)  # every buffer of the group copied
    assert [coordinator.pools[0].refcount(page) for page in table] == [2, 2, 1]
    check_books(coordinator, [parent, child])

    # PD: whole computed pages, and the partial last one once the prompt is done.
    assert manager.final_page_indices(table, 10, prompt_done=False) == [0, 1]
    assert manager.final_page_indices(table, 10, prompt_done=True) == [0, 1, 2]
    assert manager.final_page_indices(table, 20, prompt_done=True) == [0, 1, 2]

    # A verification wrote 10 tokens, 5 accepted: the page holding only rejected ones goes.
    rejected = table[2]
    assert manager.rollback(table, [], "a#0", num_valid=5, num_written=10, copy_page=None)
    assert len(table) == 2 and page_holds(coordinator, 0, rejected, NAN)
    check_books(coordinator, [parent, child])
    coordinator.free(parent)
    coordinator.free(child)
    coordinator.sanitizer.check_all_free(coordinator)


def window_reads(position: int, window: int) -> range:
    """The key positions a query at ``position`` reads."""
    return range(max(0, position - window + 1), position + 1)


def test_sliding_window_drops_and_hits_match_a_brute_force_window():
    window = SLIDING.window
    coordinator = make_coordinator({"local": SLIDING})
    manager = coordinator.managers[0]
    assert manager.max_pages_held() == math.ceil((window - 1) / PAGE_SIZE) + 1

    # A sequence decoding token by token: after each step, exactly the pages the next query
    # cannot read are gone, they form a prefix of the table, and at most max_pages_held remain.
    state = coordinator.new_state("a#0")
    for computed in range(1, 41):
        coordinator.allocate(state, computed)
        coordinator.drop_unneeded_pages(state, computed)
        table = state.page_tables[0]
        needed = {position // PAGE_SIZE for position in window_reads(computed, window)}
        held = [index for index, page in enumerate(table) if page != NULL_PAGE]
        assert held == list(range(min(needed), len(table))), computed
        assert len(held) <= manager.max_pages_held(), computed
        check_books(coordinator, [state])
    coordinator.free(state)

    # Prefix hits: on every pattern of null entries along a 6-page path, the deepest usable hit
    # is the deepest whose next query finds every page it reads.
    for mask in itertools.product((True, False), repeat=6):
        pages = [10 + index if present else NULL_PAGE for index, present in enumerate(mask)]
        expected = max((hit for hit in range(1, 7)
                        if all(pages[position // PAGE_SIZE] != NULL_PAGE
                               for position in window_reads(hit * PAGE_SIZE, window) if position < hit * PAGE_SIZE)),
                       default=0)
        assert manager.usable_prefix_pages_on_path(pages) == expected, mask
        if expected:
            taken = manager.hit_page_table(pages[:expected])
            start = manager.window_start_index(expected)
            assert taken == [NULL_PAGE] * start + pages[start:expected] and NULL_PAGE not in taken[start:]
    coordinator.sanitizer.check_all_free(coordinator)


def test_sliding_window_pages_are_cached_sparse_and_hit_again():
    """With full and sliding groups (Gemma 3's shape), a sequence whose pages before its window
    are gone (a PD decode server never receives them) still caches every page it holds: the
    nodes hold null in the sliding group there, and a later prompt hits the whole length."""
    coordinator = make_coordinator({"global": FULL, "local": SLIDING}, prefix_caching=True)
    prompt = list(range(100, 124))  # six pages
    first = coordinator.new_state("a#0")
    coordinator.allocate(first, len(prompt))
    coordinator.drop_unneeded_pages(first, len(prompt))
    assert first.page_tables[1][:4] == [NULL_PAGE] * 4 and NULL_PAGE not in first.page_tables[0]
    coordinator.prefix_hits.cache_computed_pages(first, prompt, len(prompt))
    assert [node.pages[1] == NULL_PAGE for node in first.cache_path] == [True] * 4 + [False] * 2
    coordinator.free(first)
    check_books(coordinator, [])

    second = coordinator.new_state("b#0")
    assert coordinator.prefix_hits.match(second, prompt + [7, 8, 9]) == 24  # the window's pages are there
    local = second.page_tables[1]
    start = coordinator.managers[1].window_start_index(6)
    assert local == [NULL_PAGE] * start + [node.pages[1] for node in second.cache_path[start:]] and start == 4
    check_books(coordinator, [second])
    coordinator.free(second)

    # A request for every page: the cache's sliding entries are dropped and its nodes evicted.
    evictable = coordinator.prefix_hits.evictable_pages()
    assert evictable == [6, 2]
    everything = coordinator.new_state("c#0")
    assert coordinator.try_allocate(everything, coordinator.pools[0].num_usable * PAGE_SIZE)
    assert coordinator.prefix_cache.num_nodes == 0 and all(pool.num_free == 0 for pool in coordinator.pools)
    check_books(coordinator, [everything])
    coordinator.free(everything)
    coordinator.sanitizer.check_all_free(coordinator)


def test_recurrent_slots_checkpoints_copy_on_write_forks_and_rollback():
    coordinator = make_coordinator({"attention": FULL, "mamba": RECURRENT}, prefix_caching=True, max_num_seqs=4)
    recurrent = coordinator.managers[1]
    assert recurrent.sparse_prefix_entries and not recurrent.caches_transferred_entries
    assert [recurrent.pages_for_tokens(n) for n in (0, 1, 1000)] == [0, 2, 2]  # working + checkpoint

    prompt = list(range(50, 59))  # two whole pages and one token
    first = coordinator.new_state("a#0")
    coordinator.allocate(first, len(prompt))
    working, checkpoint = first.page_tables[1]
    write_page(coordinator, 1, working, 1.0)
    write_page(coordinator, 1, checkpoint, 2.0)  # the state after token 8 (a page boundary)
    coordinator.prefix_hits.cache_computed_pages(first, prompt, 8)
    # The cache took the checkpoint (on the last whole page's node, null on the other); the
    # sequence handed its slot over and gets a fresh one at its next allocation.
    nodes = first.cache_path
    assert [node.pages[1] for node in nodes] == [NULL_PAGE, checkpoint] and first.page_tables[1] == [working]
    assert recurrent.num_new_pages(first.page_tables[1], 9) == 1
    check_books(coordinator, [first])

    # A hit lands at the checkpoint; the first write copies it into a private working slot.
    second = coordinator.new_state("b#0")
    assert coordinator.prefix_hits.match(second, prompt) == 8
    assert second.page_tables[1] == [checkpoint]
    assert recurrent.num_new_pages(second.page_tables[1], 9) == 2  # copy on write + a checkpoint slot
    coordinator.allocate(second, 9)
    private = second.page_tables[1][0]
    assert private != checkpoint and page_holds(coordinator, 1, private, 2.0)
    assert coordinator.pools[1].holders(checkpoint) == {"cache": 1}

    # No checkpoint on the path, no hit: the state at the first page boundary is not known.
    third = coordinator.new_state("c#0")
    assert coordinator.prefix_hits.match(third, prompt[:4] + [1, 2, 3, 4, 5]) == 0 and not any(third.page_tables)

    # A fork copies the working slot; nothing is shared.
    child = coordinator.new_state("a#1")
    assert coordinator.forks.fork(first, child, 9)
    assert child.page_tables[1][0] != working and page_holds(coordinator, 1, child.page_tables[1][0], 1.0)

    # Rollback: with a token rejected, the copy set aside before the verification comes back.
    aside = coordinator.pools[1].allocate(1, "inflight:aside")
    write_page(coordinator, 1, aside[0], 5.0)
    copy_into = coordinator.copy_page
    assert recurrent.rollback(first.page_tables[1], aside, "a#0", num_valid=9, num_written=9,
                              copy_page=lambda s, d: copy_into(1, s, d))
    assert page_holds(coordinator, 1, working, 1.0)
    assert not recurrent.rollback(first.page_tables[1], aside, "a#0", num_valid=9, num_written=11,
                                  copy_page=lambda s, d: copy_into(1, s, d))
    assert page_holds(coordinator, 1, working, 5.0)
    coordinator.pools[1].release(aside, "inflight:aside")

    check_books(coordinator, [first, second, third, child])
    for state in (first, second, third, child):
        coordinator.free(state)
    assert coordinator.prefix_hits.reset() == 2
    coordinator.sanitizer.check_all_free(coordinator)
    assert page_holds(coordinator, 1, working, NAN) and page_holds(coordinator, 1, checkpoint, NAN)
