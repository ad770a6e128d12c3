"""Per-spec-type managers: how many pages a request needs, which it may drop, and what a
prefix hit means. The coordinator fans out over one manager per group; this package and the
registry are the only places that know state types apart.
"""
from __future__ import annotations

import math

from tandem.kv.block_pool import BlockPool
from tandem.kv.registry import StateGroup


class StateManager:
    def __init__(self, group: StateGroup, pool: BlockPool, page_size: int) -> None:
        self.group = group
        self.pool = pool
        self.page_size = page_size

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Page-table length needed to hold ``num_tokens`` tokens of a request."""
        return math.ceil(num_tokens / self.page_size)

    def num_new_pages(self, page_table: list[int], num_tokens: int) -> int:
        return max(0, self.pages_for_tokens(num_tokens) - len(page_table))

    def droppable_page_indices(self, page_table: list[int], num_computed_tokens: int) -> list[int]:
        """Indices of page-table entries no future step will read (none for full attention)."""
        return []

    def usable_prefix_pages(self, num_hit_pages: int) -> int:
        """How many leading cached pages a request may take on a prefix hit."""
        return num_hit_pages
