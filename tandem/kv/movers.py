"""Movers that copy a request's state between the device pools and host memory.

A mover works on ``(group, page ids)`` lists and on the registry's buffer descriptors only; it
never knows what kind of state a buffer holds (docs/design.md, state system point 4). Every buffer
the registry holds is moved (I1): ``touched`` records which ones, for the I1 tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.kv.registry import StateRegistry


@dataclass
class HostCopy:
    """A request's state in host memory: buffer key → ``[num_pages, *page_shape]`` tensor."""
    page_counts: list[int]  # pages per group, in page-table order
    tensors: dict[tuple[int, str, str], torch.Tensor] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class HostMover:
    def __init__(self, registry: StateRegistry, pin_memory: bool = False) -> None:
        self.registry = registry
        self.pin_memory = pin_memory
        self.touched: set[tuple[int, str, str]] = set()

    def gather(self, page_tables: list[list[int]]) -> HostCopy:
        """Copy the pages of every group's table, in table order, to host memory."""
        copy = HostCopy(page_counts=[len(table) for table in page_tables])
        for descriptor in self.registry.buffers():
            pages = page_tables[descriptor.group_id]
            index = torch.tensor(pages, dtype=torch.long, device=descriptor.tensor.device)
            host = descriptor.tensor.index_select(0, index).to("cpu")
            copy.tensors[descriptor.key] = host.pin_memory() if self.pin_memory else host
            self.touched.add(descriptor.key)
        return copy

    def scatter(self, copy: HostCopy, page_tables: list[list[int]]) -> None:
        """Write a host copy into (freshly allocated) pages, table order matching the gather."""
        for descriptor in self.registry.buffers():
            pages = page_tables[descriptor.group_id]
            if len(pages) != copy.page_counts[descriptor.group_id]:
                raise ValueError(f"group {descriptor.group_id}: {len(pages)} pages for a copy of "
                                 f"{copy.page_counts[descriptor.group_id]}")
            index = torch.tensor(pages, dtype=torch.long, device=descriptor.tensor.device)
            source = copy.tensors[descriptor.key].to(descriptor.tensor.device, non_blocking=True)
            descriptor.tensor.index_copy_(0, index, source)
            self.touched.add(descriptor.key)
