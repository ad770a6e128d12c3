"""PD's page tables: where a prefill server writes a sequence's state, and which entries it
may write.

The decode side names its destination pages before the prompt is computed (``destination_tables``:
the sequence's own tables, null where a prefix hit here shares a cached page, which is final and
never written by a transfer); both sides ask which entries are final (``final_page_indices``: the
managers say, e.g. whole computed pages, a recurrent working slot once the prompt is done, never
a checkpoint slot).

Owner: the ``StateCoordinator`` (``coordinator.pd_tables``); called by ``disagg/decode.py`` and
``disagg/prefill_writes.py``. It reads the books and changes nothing.
"""
from __future__ import annotations

from tandem.kv.block_pool import CACHE_OWNER, BlockPool
from tandem.kv.planner import NULL_PAGE
from tandem.kv.request_state import RequestState


class PDPageTables:
    def __init__(self, managers: list, pools: list[BlockPool]) -> None:
        self._managers = managers
        self._pools = pools

    def destination_tables(self, state: RequestState) -> list[list[int]]:
        """PD decode: the page tables a prefill server writes into, the sequence's own with null
        in place of every page the prefix cache holds (a hit here: shared, already final, never
        written by a transfer)."""
        return [[NULL_PAGE if page != NULL_PAGE and pool.holders(page)[CACHE_OWNER] > 0 else page
                 for page in table] for pool, table in zip(self._pools, state.page_tables)]

    def final_page_indices(self, state: RequestState, num_computed_tokens: int,
                           prompt_done: bool) -> list[list[int]]:
        """Per group: the page-table entries whose contents a PD receiver can take as final
        (the managers say which: whole computed pages, a recurrent working slot at the end)."""
        return [manager.final_page_indices(table, num_computed_tokens, prompt_done)
                for manager, table in zip(self._managers, state.page_tables)]
