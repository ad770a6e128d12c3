"""Sliding-window attention: a query at position ``p`` reads keys ``p - window + 1 .. p`` only.

Page-table entries stay indexed by position (entry ``i`` covers tokens ``i * page_size ..``);
an entry whose tokens all lie before the next query's window is released and becomes the null
page. Dropped entries always form a prefix of the table:

    table:  [ NULL | NULL | p7 | p9 | p4 ]      page_size 4, window 6, 19 tokens computed
    tokens:   0..3   4..7   8..11 ...  16..19   next query 19 reads 14..19: entries >= 3
                                                (entry 2 goes once 20 tokens are computed)

Prefix cache: a node may hold the null page in this group (sparse entries): a request whose
pages before its window are gone (dropped while it decoded, or never received: a PD decode
server gets only the window's pages of a long prompt) still caches the pages it holds, so a
decode server's completed pages reach the tiers and a later turn hits them. A hit of ``k``
pages needs only the pages holding the last window before token ``k * page_size``:

    node entries:  [ NULL | NULL | p7 | p9 | p4 ]   page_size 4, window 6
    hit of 5 pages (20 tokens): the next query (20) reads 15..19 -> entries 3, 4: usable
    hit of 4 pages (16 tokens): the next query (16) reads 11..15 -> entries 2, 3: usable

The request takes references on those pages only and leaves the earlier entries null.
"""
from __future__ import annotations

from tandem.kv.managers.base import StateManager
from tandem.kv.planner import NULL_PAGE


class SlidingWindowManager(StateManager):
    def __init__(self, group, pool, page_size: int) -> None:
        super().__init__(group, pool, page_size)
        self.window = group.spec.window

    def first_needed_position(self, num_computed_tokens: int) -> int:
        """The oldest key the next query (at position ``num_computed_tokens``) reads."""
        return max(0, num_computed_tokens - self.window + 1)

    def droppable_page_indices(self, page_table: list[int], num_computed_tokens: int) -> list[int]:
        """Entries whose every token precedes the next query's window and that are not null yet.

        Scans back from the last droppable entry to the first null one (dropped entries form
        a prefix), so a long decode costs O(1) per step, not O(length)."""
        num_droppable = min(len(page_table), self.first_needed_position(num_computed_tokens) // self.page_size)
        indices = []
        index = num_droppable - 1
        while index >= 0 and page_table[index] != NULL_PAGE:
            indices.append(index)
            index -= 1
        indices.reverse()
        return indices

    sparse_prefix_entries = True

    def window_start_index(self, num_hit_pages: int) -> int:
        """The first page-table entry the next query after a hit of ``num_hit_pages`` reads."""
        return self.first_needed_position(num_hit_pages * self.page_size) // self.page_size

    def usable_prefix_pages_on_path(self, pages: list[int]) -> int:
        """The deepest hit whose window's entries are all present on the path."""
        for num_hit_pages in range(len(pages), 0, -1):
            window = pages[self.window_start_index(num_hit_pages):num_hit_pages]
            if all(page != NULL_PAGE for page in window):
                return num_hit_pages
        return 0

    def hit_page_table(self, pages: list[int]) -> list[int]:
        """The window's pages; every entry before it null (dropped entries form a prefix)."""
        start = self.window_start_index(len(pages))
        return [NULL_PAGE] * start + pages[start:]

    def max_pages_held(self) -> int:
        """Most non-null entries a request holds between steps (after its drop): the pages
        covering the last ``window - 1`` computed tokens, plus one where they straddle a page
        boundary. During a step, the chunk being computed adds its own pages on top."""
        return -(-(self.window - 1) // self.page_size) + 1
