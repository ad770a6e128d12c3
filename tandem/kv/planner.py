"""The planner: sizes the page pools from a token count or a memory budget and allocates
every group's buffers into the registry.

Each group gets its own pool; page 0 of every pool is the null page (never allocated, always
finite) that padded page-table entries point at. Groups whose pages hold tokens share one size,
``num_pages``, set by the token count or by what the budget leaves; a group whose spec says its
pages are per sequence (``StateSpec.pages_per_sequence``, e.g. recurrent slots) gets
``max_num_seqs * pages_per_sequence + 1`` pages, taken off the budget first.

Two layouts (``--kv-cache-layout``). Layer-major: one tensor ``[num_pages, *page_shape]`` per
(group, layer, buffer kind). Page-major: one ``[num_pages, block_bytes]`` uint8 allocation per
group, a page of it holding that page of every buffer of the group, buffer after buffer in
registry order at offsets aligned to ``PAGE_MAJOR_ALIGNMENT``; each buffer is a view of its
column range with the same shape and dtype as layer-major, only its ``stride(0)`` differs::

    row p of a group's pool:  | L0 key p | L0 value p | L1 key p | L1 value p | ... | pad |
                              ^ offset 0  ^ aligned offsets                  block_bytes ^

so a run of pages is one run of memory (one PD write per run and group).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.kv.registry import LAYER_MAJOR, PAGE_MAJOR, GroupPool, StateRegistry

NULL_PAGE = 0
PAGE_MAJOR_ALIGNMENT = 256  # bytes: every buffer's offset in a page-major block, and the block


@dataclass(frozen=True)
class PoolPlan:
    page_size: int
    num_pages: int  # per token-paged group, including the null page
    bytes_per_page: int  # token-paged groups together
    # Pools sized in sequences: (group id, pages including the null page), and their bytes.
    sequence_pools: tuple[tuple[int, int], ...] = ()
    sequence_pool_bytes: int = 0

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page + self.sequence_pool_bytes

    def pages_of(self, group_id: int) -> int:
        """Pages (including the null page) of one group's pool."""
        return dict(self.sequence_pools).get(group_id, self.num_pages)


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // PAGE_MAJOR_ALIGNMENT) * PAGE_MAJOR_ALIGNMENT


def _group_bytes(group, page_size: int, layout: str = LAYER_MAJOR) -> int:
    if layout == PAGE_MAJOR:  # the group's block: every buffer's page at an aligned offset
        return len(group.layer_names) * sum(_aligned(buffer.page_bytes(page_size))
                                            for buffer in group.spec.buffer_layouts())
    return len(group.layer_names) * group.spec.page_bytes(page_size)


def bytes_per_page(registry: StateRegistry, page_size: int, layout: str = LAYER_MAJOR) -> int:
    """Bytes of one page across the token-paged groups."""
    return sum(_group_bytes(group, page_size, layout) for group in registry.groups
               if group.spec.pages_per_sequence(False) is None)


def sequence_pools(registry: StateRegistry, page_size: int, max_num_seqs: int | None,
                   prefix_caching: bool, speculative: bool = False,
                   layout: str = LAYER_MAJOR) -> tuple[tuple[tuple[int, int], ...], int]:
    """Pools sized in sequences: ((group id, pages incl. the null page), ...) and their bytes."""
    pools, total = [], 0
    for group in registry.groups:
        per_sequence = group.spec.pages_per_sequence(prefix_caching, speculative)
        if per_sequence is None:
            continue
        if max_num_seqs is None:
            raise ValueError("max_num_seqs: needed to size per-sequence state pools")
        num_pages = max_num_seqs * per_sequence + 1
        pools.append((group.group_id, num_pages))
        total += num_pages * _group_bytes(group, page_size, layout)
    return tuple(pools), total


def plan_pools(registry: StateRegistry, page_size: int, *, max_total_tokens: int | None,
               memory_budget_bytes: int | None, max_num_seqs: int | None = None,
               prefix_caching: bool = False, speculative: bool = False, layout: str = LAYER_MAJOR) -> PoolPlan:
    """Pages per group: ``max_total_tokens`` wins; otherwise as many as the budget holds."""
    page_bytes = bytes_per_page(registry, page_size, layout)
    per_sequence, per_sequence_bytes = sequence_pools(registry, page_size, max_num_seqs, prefix_caching,
                                                      speculative, layout)
    if max_total_tokens is not None:
        num_pages = math.ceil(max_total_tokens / page_size) + 1
    else:
        if memory_budget_bytes is None:
            raise ValueError("max_total_tokens: give a token count or a memory budget")
        if per_sequence_bytes > memory_budget_bytes:
            raise ValueError(f"max_num_seqs: the per-sequence state of {max_num_seqs} sequences "
                             f"({per_sequence_bytes} bytes) exceeds the memory budget "
                             f"({memory_budget_bytes} bytes)")
        num_pages = (memory_budget_bytes - per_sequence_bytes) // max(page_bytes, 1)
    if num_pages < 2:
        raise ValueError(
            f"max_total_tokens: the state pool must hold at least one page of {page_size} tokens "
            f"({page_bytes} bytes); the budget allows {num_pages - 1}")
    return PoolPlan(page_size=page_size, num_pages=num_pages, bytes_per_page=page_bytes,
                    sequence_pools=per_sequence, sequence_pool_bytes=per_sequence_bytes)


def allocate_buffers(registry: StateRegistry, plan: PoolPlan, device: torch.device,
                     layout: str = LAYER_MAJOR) -> None:
    """Every (group, layer, buffer kind) as ``[num_pages, *page_shape]``: its own tensor
    (layer-major) or a view of the group's one pool (page-major)."""
    if layout not in (LAYER_MAJOR, PAGE_MAJOR):
        raise ValueError(f"kv_cache_layout: must be {LAYER_MAJOR!r} or {PAGE_MAJOR!r}, got {layout!r}")
    registry.kv_cache_layout = layout
    for group in registry.groups:
        num_pages = plan.pages_of(group.group_id)
        if layout == PAGE_MAJOR:
            _allocate_group_pool(registry, group, num_pages, plan.page_size, device)
            continue
        for layer_name in group.layer_names:
            for buffer_layout in group.spec.buffer_layouts():
                tensor = torch.zeros((num_pages, *buffer_layout.page_shape(plan.page_size)),
                                     dtype=buffer_layout.dtype, device=device)
                registry.attach_buffer(group.group_id, layer_name, buffer_layout, tensor)


def _allocate_group_pool(registry: StateRegistry, group, num_pages: int, page_size: int,
                         device: torch.device) -> None:
    buffers = [(layer_name, buffer_layout) for layer_name in group.layer_names
               for buffer_layout in group.spec.buffer_layouts()]
    pool, views, offsets = page_major_views(
        num_pages, [(layout.page_shape(page_size), layout.dtype) for _, layout in buffers], device)
    group_pool = GroupPool(group.group_id, pool)
    for (layer_name, buffer_layout), view, offset in zip(buffers, views, offsets):
        registry.attach_buffer(group.group_id, layer_name, buffer_layout, view, group_pool, offset)


def page_major_views(num_pages: int, page_layouts: list[tuple[tuple[int, ...], torch.dtype]],
                     device: torch.device | str = "cpu") -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """One zeroed ``[num_pages, block_bytes]`` uint8 pool and, for each (page shape, dtype), its
    ``[num_pages, *page_shape]`` view (buffers one after another in each row, at aligned offsets),
    with those offsets."""
    offsets, offset = [], 0
    for shape, dtype in page_layouts:
        offsets.append(offset)
        offset += _aligned(math.prod(shape) * dtype.itemsize)
    pool = torch.zeros((num_pages, offset), dtype=torch.uint8, device=device)
    views = [pool[:, start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(num_pages, *shape)
             for (shape, dtype), start in zip(page_layouts, offsets)]
    return pool, views, offsets
