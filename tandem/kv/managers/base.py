"""Per-spec-type managers: how many pages a request needs, which it may drop, and what a
prefix hit means. The coordinator fans out over one manager per group; this package and the
registry are the only places that know state types apart.
"""
from __future__ import annotations

import math
from typing import Callable

from tandem.kv.block_pool import BlockPool
from tandem.kv.planner import NULL_PAGE
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

    # -- hooks with defaults for token-paged state (overridden by per-sequence state) -----------
    # A cache node may hold no page of this group (null); hits then land only where
    # ``usable_prefix_pages_on_path`` allows, and under page pressure the prefix hits
    # (``kv/prefix_hits.py``) may drop a node's page of this group (least recently used first)
    # while keeping the node.
    sparse_prefix_entries: bool = False
    # Whether the entries a PD transfer filled may be cached like computed ones. A sparse group
    # whose entries are not per-token pages (a recurrent checkpoint) says no: the transfer
    # brought the state at the prompt's end, not the checkpoints the cache would name.
    caches_transferred_entries: bool = True
    # Set by the coordinator: whether a prefix cache exists.
    prefix_caching: bool = False

    def max_tokens_per_request(self) -> int:
        """Most tokens one request's state can take from this group's pool."""
        return self.pool.num_usable * self.page_size

    def allocate(self, page_table: list[int], num_tokens: int, owner: str,
                 copy_page: Callable[[int, int], None]) -> None:
        """Grow ``page_table`` to hold ``num_tokens``; the coordinator has made room for
        ``num_new_pages`` and calls this only when some group needs a new page (so an override
        must change nothing when its ``num_new_pages`` is 0). ``copy_page(source, destination)``
        copies a page of this group."""
        count = self.num_new_pages(page_table, num_tokens)
        if count:
            page_table.extend(self.pool.allocate(count, owner))

    def fork_pages(self, page_table: list[int], num_tokens: int,
                   private_last: bool = False) -> tuple[list[int], list[int]]:
        """A forked child's (n > 1) share of its parent's ``num_tokens``: (pages it shares,
        pages it gets a private copy of, appended after the shared ones). Whole pages are
        shared; the partial last page, which both will write, is copied (with
        ``private_last``, the page holding the last token, even when whole)."""
        num_shared = (num_tokens - 1 if private_last and num_tokens else num_tokens) // self.page_size
        copied = page_table[num_shared:num_shared + 1] if num_tokens > num_shared * self.page_size else []
        return page_table[:num_shared], copied

    def usable_prefix_pages_on_path(self, pages: list[int]) -> int:
        """How many leading nodes of a matched path (this group's page in each) a hit may use."""
        return self.usable_prefix_pages(len(pages))

    def hit_page_table(self, pages: list[int]) -> list[int]:
        """The page-table entries a request takes from the hit path's pages of this group."""
        return pages

    def cache_entries(self, page_table: list[int], num_full_pages: int) -> list[int]:
        """This group's page for each of the first ``num_full_pages`` cache nodes (index i:
        the page holding tokens of page i; null where the group has nothing to cache)."""
        return page_table

    def after_cache_insert(self, page_table: list[int], owner: str) -> None:
        """Called after the prefix cache took references on the sequence's new nodes."""

    def final_page_indices(self, page_table: list[int], num_computed_tokens: int, prompt_done: bool) -> list[int]:
        """PD: the page-table entries whose contents are final for a receiver that continues
        after the prompt — whole pages of computed tokens, and once the prompt is done its
        partial last page too. The prefill server sends these (null entries are skipped)."""
        if prompt_done:
            count = self.pages_for_tokens(num_computed_tokens)
        else:
            count = num_computed_tokens // self.page_size
        return list(range(min(count, len(page_table))))

    # -- speculative decoding ------------------------------------------------------------------
    # A verification computes a sequence's known tokens plus drafts in one forward pass, then
    # keeps only the accepted ones; a draft model's chain of proposals runs ahead of what will
    # be kept. Token-paged state needs nothing set aside for either: speculative tokens land
    # in slots of their own, past the computed tokens, and are rewritten later.
    speculation_sets_aside: bool = False  # whether ``speculation_sources`` may name pages

    def speculation_sources(self, page_table: list[int]) -> list[int]:
        """Pages to copy aside before a speculative step (into slots the coordinator reserved)."""
        return []

    def set_aside_slots(self, num_tokens: int) -> int:
        """How many pages ``speculation_sources`` names for a table holding ``num_tokens``: the
        slots a sequence reserves with its pages while speculation runs."""
        return 0

    def chain_page_table(self, page_table: list[int], copies: list[int]) -> list[int]:
        """The table a draft's speculative chain reads and writes, given the copies set aside."""
        return page_table

    def rollback(self, page_table: list[int], copies: list[int], owner: str, num_valid: int, num_written: int,
                 copy_page: Callable[[int, int], None]) -> bool:
        """A verification wrote ``num_written`` tokens' state, of which the first ``num_valid``
        are accepted: drop what holds only rejected tokens. Returns whether the group now holds
        exactly ``num_valid`` tokens' state (False: the state from before the verification,
        restored from ``copies``). Token pages: those past ``num_valid`` are released."""
        keep = self.pages_for_tokens(num_valid)
        rejected = [page for page in page_table[keep:] if page != NULL_PAGE]
        if rejected:
            self.pool.release(rejected, owner)
        del page_table[keep:]
        return True
