"""In-flight holds (I2, ``tandem/kv/inflight.py``) on hand-built pools: a hold keeps its pages
off the free list until released, the books see it, and cached pages only holds keep are not
counted as evictable."""
from __future__ import annotations

from tandem.kv.block_pool import CACHE_OWNER, BlockPool
from tandem.kv.inflight import InflightHolds
from tandem.kv.planner import NULL_PAGE


def test_holds_keep_pages_until_released_and_count_in_the_books():
    freed = []
    pools = [BlockPool(0, 8, on_free=lambda group, pages: freed.extend(pages)), BlockPool(1, 4)]
    holds = InflightHolds(pools)
    table = pools[0].allocate(3, "seq-a")
    other = pools[1].allocate(1, "seq-a")
    assert not holds.any()
    owner = holds.hold("pd-send:7", [[NULL_PAGE, *table], other])
    assert owner == "inflight:pd-send:7" and holds.any()
    assert dict(holds.references(0)) == {owner: table} and dict(holds.references(1)) == {owner: other}
    pools[0].release(table, "seq-a")  # the sequence ends while its pages are still being sent
    assert freed == [] and all(pools[0].refcount(page) == 1 for page in table)
    pools[0].acquire(table[:1], CACHE_OWNER)  # one of them is also in the prefix cache
    assert holds.held_cached_pages(0) == 1 and holds.held_cached_pages(1) == 0
    holds.release(owner)
    assert not holds.any() and sorted(freed) == sorted(table[1:])  # the cached page stays cached
    assert holds.held_cached_pages(0) == 0 and list(holds.references(0)) == []
    assert pools[0].holders(table[0])[CACHE_OWNER] == 1
