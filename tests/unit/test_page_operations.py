"""One implementation of every page operation, for every rank: the books of one shard (a
hand-built coordinator and host tier) emit copies, poison and a swap to the host tier and back;
a second shard applies the operations its outbox recorded through its own executor (as a
worker rank applies a step message's), and the two shards end equal byte for byte, device
buffers and host blocks alike."""
from __future__ import annotations

import pytest
import torch

from tandem.kv.page_operations import COPY, FENCE, HOST_POISON, LOAD, POISON, SAVE, PageOperation
from tandem.kv.planner import NULL_PAGE
from tandem.kv.tiers.hierarchy import TieredState
from tandem.kv.tiers.tier_worker import TierWorker
from tests.support.books import FULL, RECURRENT, make_coordinator

SPECS = {"attention": FULL, "recurrent": RECURRENT}
HOST_PAGES = 12


def shard():
    coordinator = make_coordinator(SPECS, page_size=4, max_total_tokens=48, max_num_seqs=4)
    worker = TierWorker(coordinator, HOST_PAGES, torch.device("cpu"))
    coordinator.outbox.executor.attach_tiers(worker)
    return coordinator, worker


def write_pages(coordinator, tables: list[list[int]], seed: int) -> None:
    """What a forward pass would write into the pages (the same on both shards here)."""
    generator = torch.Generator().manual_seed(seed)
    for descriptor in coordinator.registry.buffers():
        for page in tables[descriptor.group_id]:
            if page != NULL_PAGE:
                row = descriptor.tensor[page]
                row.copy_(torch.randn(row.shape, generator=generator, dtype=row.dtype))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def shards_equal(books, books_worker, other, other_worker) -> bool:
    device = all(torch.equal(as_bytes(mine.tensor), as_bytes(theirs.tensor))
                 for mine, theirs in zip(books.registry.buffers(), other.registry.buffers()))
    host = all(torch.equal(mine, theirs) for mine, theirs in zip(books_worker.host.arrays, other_worker.host.arrays))
    return device and host


def test_recorded_page_operations_make_a_second_shard_equal():
    books, books_worker = shard()
    other, other_worker = shard()
    tiers = TieredState(books, books_worker, host_pages=HOST_PAGES, write_policy="write_through")
    books.outbox.record_for_other_ranks()
    parent, child = books.new_state("parent"), books.new_state("child")
    books.allocate(parent, 10)
    for coordinator in (books, other):  # the step's writes, on every rank
        write_pages(coordinator, parent.page_tables, seed=1)
    assert shards_equal(books, books_worker, other, other_worker)

    assert books.forks.fork(parent, child, 10)  # copies: the partial last page, the recurrent slot
    assert tiers.swap_out(parent, 10)  # a save, waited for, then its fence
    books.free(parent, keep_swapped=True)  # poison
    assert tiers.swap_in(parent)  # a layer-wise load into fresh pages
    tiers.drain()
    tiers.commit_swap_in(parent)  # its host pages freed: host poison
    books.free(child)
    operations = books.outbox.take()
    assert {operation.kind for operation in operations} == {COPY, POISON, SAVE, LOAD, FENCE, HOST_POISON}
    assert not shards_equal(books, books_worker, other, other_worker)  # (the check can fail)

    other.outbox.executor.apply_all(operations)  # as a worker rank applies a step message's
    other_worker.drain()
    assert shards_equal(books, books_worker, other, other_worker)
    books.free(parent)
    assert all(pool.num_free == pool.num_usable for pool in books.pools)
    tiers.check_idle()
    tiers.close()
    other_worker.close()


def test_unknown_operation_and_tierless_rank_are_refused():
    coordinator = make_coordinator(SPECS)
    with pytest.raises(RuntimeError, match="unknown kind 'shuffle'"):
        coordinator.outbox.send(PageOperation("shuffle", 0, []))
    with pytest.raises(RuntimeError, match=r"tier operation \(fence\) on a rank without a host tier"):
        coordinator.outbox.send(PageOperation(FENCE, -1, [0]))
    assert not coordinator.outbox.pending()  # one rank records nothing
