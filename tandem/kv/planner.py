"""The planner: sizes the page pools from a token count or a memory budget and allocates
every group's buffers into the registry.

Each group gets its own pool of ``num_pages`` pages; page 0 of every pool is the null page
(never allocated, always finite) that padded page-table entries point at.
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
    num_pages: int  # per group, including the null page
    bytes_per_page: int  # all groups together

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page


def bytes_per_page(registry: StateRegistry, page_size: int) -> int:
    return sum(len(group.layer_names) * group.spec.page_bytes(page_size) for group in registry.groups)


def plan_pools(registry: StateRegistry, page_size: int, *, max_total_tokens: int | None,
               memory_budget_bytes: int | None) -> PoolPlan:
    """Pages per group: ``max_total_tokens`` wins; otherwise as many as the budget holds."""
    page_bytes = bytes_per_page(registry, page_size)
    if max_total_tokens is not None:
        num_pages = math.ceil(max_total_tokens / page_size) + 1
    else:
        if memory_budget_bytes is None:
            raise ValueError("max_total_tokens: give a token count or a memory budget")
        num_pages = memory_budget_bytes // max(page_bytes, 1)
    if num_pages < 2:
        raise ValueError(
            f"max_total_tokens: the state pool must hold at least one page of {page_size} tokens "
            f"({page_bytes} bytes); the budget allows {num_pages - 1}")
    return PoolPlan(page_size=page_size, num_pages=num_pages, bytes_per_page=page_bytes)


def allocate_buffers(registry: StateRegistry, plan: PoolPlan, device: torch.device) -> None:
    """Allocate ``[num_pages, *page_shape]`` for every (group, layer, buffer kind)."""
    for group in registry.groups:
        for layer_name in group.layer_names:
            for layout in group.spec.buffer_layouts():
                tensor = torch.zeros((plan.num_pages, *layout.page_shape(plan.page_size)),
                                     dtype=layout.dtype, device=device)
                registry.attach_buffer(group.group_id, layer_name, layout, tensor)
