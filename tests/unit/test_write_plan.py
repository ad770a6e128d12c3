"""How a PD write is planned, on hand-built page tables: page pairs become runs consecutive on
both sides (``coalesce``, one pure function), a run becomes one descriptor per span
(``WritePlanner``: a page-major group's pool is one span, a layer-major buffer one; the spans are
worked out once per peer), and the NCCL backend sends a write of a few runs in place, one send
per run (``plan_segments``; writer and reader compute the same list from the header's lengths)."""
from __future__ import annotations

import pytest
import torch

from tandem.kv.planner import NULL_PAGE, allocate_buffers, plan_pools
from tandem.kv.registry import StateRegistry
from tandem.kv.spec import FullAttentionSpec, RecurrentSpec
from tandem.transfer.byte_views import FEW_RUNS, Segment, plan_segments
from tandem.transfer.descriptors import WritePlanner, buffer_addresses, coalesce, plan_page_writes

MiB = 1 << 20


def registry_of(layout: str) -> StateRegistry:
    """Two attention layers (group 0: four buffers, K and V of each) and a recurrent layer
    (group 1: two buffers), pools in ``layout``, in host memory."""
    registry = StateRegistry()
    attention = FullAttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32)
    for layer in ("a", "b"):
        registry.register(layer, attention)
    registry.register("r", RecurrentSpec(conv_shape=(3, 5), ssm_shape=(2, 3), conv_dtype=torch.float32,
                                         ssm_dtype=torch.float32))
    registry.finalize()
    plan = plan_pools(registry, 4, max_total_tokens=32, memory_budget_bytes=None, max_num_seqs=2, layout=layout)
    allocate_buffers(registry, plan, torch.device("cpu"), layout)
    return registry


def test_pairs_become_runs_consecutive_on_both_sides():
    pairs = [(7, 22), (4, 12), (5, 13), (6, 14), (8, 30), (9, 31), (11, 32)]
    # a run ends where either side jumps (7 -> 22 after 6 -> 14; 11 after 9), whatever the pairs' order
    assert coalesce(pairs) == [(4, 12, 3), (7, 22, 1), (8, 30, 2), (11, 32, 1)]
    assert coalesce(list(reversed(pairs))) == coalesce(pairs)
    assert coalesce([(1, 5), (3, 6)]) == [(1, 5, 1), (3, 6, 1)]  # destinations consecutive, sources not
    assert coalesce([(1, 6), (2, 5)]) == [(1, 6, 1), (2, 5, 1)]  # destinations backwards
    # null pages on either side are skipped (the decode side does not need them, or holds them cached)
    assert coalesce([(1, 10), (2, NULL_PAGE), (3, 12), (NULL_PAGE, 13), (4, 13)]) == [(1, 10, 1), (3, 12, 2)]
    assert coalesce([]) == [] and coalesce([(NULL_PAGE, 3), (4, NULL_PAGE)]) == []


@pytest.mark.parametrize("layout", ["page-major", "layer-major"])
def test_a_run_is_one_descriptor_per_span(layout):
    local, remote = registry_of(layout), registry_of(layout)
    planner = WritePlanner(local, buffer_addresses(remote))
    keys = [[d.key for d in local.buffers(group)] for group in range(2)]
    if layout == "page-major":  # one span per group: its pool, whole blocks, covering every buffer of the group
        assert [span.keys for span in planner.spans] == [tuple(keys[0]), tuple(keys[1])]
        for span, group in zip(planner.spans, range(2)):
            pool, theirs = local.group_pool(group).tensor, remote.group_pool(group).tensor
            assert (span.local, span.remote, span.stride, span.length) == \
                (pool.data_ptr(), theirs.data_ptr(), pool.shape[1], pool.shape[1])
    else:  # one span per buffer: its own allocation, a page after the page
        assert [span.keys for span in planner.spans] == [(key,) for key in keys[0] + keys[1]]
        for span, mine, theirs in zip(planner.spans, local.buffers(), remote.buffers()):
            assert (span.local, span.remote, span.stride, span.length) == \
                (mine.tensor.data_ptr(), theirs.tensor.data_ptr(), mine.page_bytes, mine.page_bytes)
    pairs = [[(1, 3), (2, 4), (3, 5), (6, 1)], [(2, 1)]]  # group 0: runs of 3 and 1 pages; group 1: one page
    plan = planner.plan(pairs)
    spans_per_group = [1, 1] if layout == "page-major" else [len(keys[0]), len(keys[1])]
    assert len(plan.descriptors) == 2 * spans_per_group[0] + spans_per_group[1]
    first = planner.spans[0]
    assert plan.descriptors[:2] == [  # the first span's two runs
        (first.local + 1 * first.stride, first.remote + 3 * first.stride, 2 * first.stride + first.length),
        (first.local + 6 * first.stride, first.remote + 1 * first.stride, first.length)]
    assert plan.num_pages == 5 and plan.touched == set(keys[0] + keys[1])
    assert plan.num_bytes == sum(length for _, _, length in plan.descriptors)
    assert plan == plan_page_writes(local, buffer_addresses(remote), pairs)  # the same as planned on the spot
    only_recurrent = planner.plan([[], [(2, 1)]])  # a group without pairs: no descriptor, nothing touched
    assert len(only_recurrent.descriptors) == spans_per_group[1] and only_recurrent.touched == set(keys[1])
    with pytest.raises(ValueError):  # a peer that lists other buffers (the handshake refuses it first)
        WritePlanner(local, buffer_addresses(remote)[:-1])


def test_a_write_of_few_runs_is_one_send_per_run():
    # a page-major prompt (one run per group) and the last write (its pages and the metadata row)
    assert plan_segments([256 * MiB]) == [Segment(0, 1, 256 * MiB, True)]
    assert plan_segments([64 * MiB, 16 << 10]) == [Segment(0, 1, 64 * MiB, True), Segment(1, 2, 16 << 10, True)]
    few = [1] * FEW_RUNS
    assert plan_segments(few, direct_bytes=4, staging_bytes=3) == [Segment(i, i + 1, 1, True) for i in range(FEW_RUNS)]
    # more runs than that: short ones packed into staged sends, long ones in place
    assert plan_segments(few + [5], direct_bytes=4, staging_bytes=3) == [
        Segment(0, 3, 3, False), Segment(3, 4, 1, False), Segment(4, 5, 5, True)]
