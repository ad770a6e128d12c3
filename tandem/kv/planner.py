"""The planner: sizes the page pools from a token count or a memory budget and allocates
every group's buffers into the registry.

Each group gets its own pool; page 0 of every pool is the null page (never allocated, always
finite) that padded page-table entries point at. Groups whose pages hold tokens share one size,
``num_pages``, set by the token count or by what the budget leaves; a group whose spec says its
pages are per sequence (``StateSpec.pages_per_sequence``, e.g. recurrent slots) gets
``max_num_seqs * pages_per_sequence + 1`` pages, taken off the budget first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.kv.registry import StateRegistry

NULL_PAGE = 0


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


def _group_bytes(group, page_size: int) -> int:
    return len(group.layer_names) * group.spec.page_bytes(page_size)


def bytes_per_page(registry: StateRegistry, page_size: int) -> int:
    """Bytes of one page across the token-paged groups."""
    return sum(_group_bytes(group, page_size) for group in registry.groups
               if group.spec.pages_per_sequence(False) is None)


def sequence_pools(registry: StateRegistry, page_size: int, max_num_seqs: int | None,
                   prefix_caching: bool, speculative: bool = False) -> tuple[tuple[tuple[int, int], ...], int]:
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
        total += num_pages * _group_bytes(group, page_size)
    return tuple(pools), total


def plan_pools(registry: StateRegistry, page_size: int, *, max_total_tokens: int | None,
               memory_budget_bytes: int | None, max_num_seqs: int | None = None,
               prefix_caching: bool = False, speculative: bool = False) -> PoolPlan:
    """Pages per group: ``max_total_tokens`` wins; otherwise as many as the budget holds."""
    page_bytes = bytes_per_page(registry, page_size)
    per_sequence, per_sequence_bytes = sequence_pools(registry, page_size, max_num_seqs, prefix_caching,
                                                      speculative)
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


def allocate_buffers(registry: StateRegistry, plan: PoolPlan, device: torch.device) -> None:
    """Allocate ``[num_pages, *page_shape]`` for every (group, layer, buffer kind)."""
    for group in registry.groups:
        for layer_name in group.layer_names:
            for layout in group.spec.buffer_layouts():
                tensor = torch.zeros((plan.pages_of(group.group_id), *layout.page_shape(plan.page_size)),
                                     dtype=layout.dtype, device=device)
                registry.attach_buffer(group.group_id, layer_name, layout, tensor)
