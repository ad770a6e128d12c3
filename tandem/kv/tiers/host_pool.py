"""The host tier's pages: one pool per state group, page first.

A host page of a group is one contiguous block holding that page of every buffer of the group,
buffer after buffer in registry order (``GroupLayout``), so a page moves to disk as one object
and a layer's slice of many pages is a column range of the pool's ``[pages, block bytes]``
array. The array is pinned on CUDA machines (copies run asynchronously, and the page-copy
kernel reads and writes it directly).

Books: each group's pages have reference counts with owner tags, as the device pools do
(``BlockPool``): ``"cache"`` for a prefix-cache node's host copy, ``"swap:<sequence>"`` for a
preempted sequence's state, ``"inflight:<op>"`` for a copy that reads or writes the page (I2).
Page 0 is never handed out. Freed pages are poisoned in sanitizer mode (NaN in float buffers'
columns, a byte pattern elsewhere), so a load from a freed host page fails loudly (I6).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kv.block_pool import BlockPool
from tandem.kv.registry import BufferDescriptor, StateRegistry
from tandem.kv.sanitizer import poison_byte


@dataclass(frozen=True)
class Segment:
    """One buffer's slice of a group's host page block."""
    descriptor: BufferDescriptor
    offset: int

    @property
    def width(self) -> int:
        return self.descriptor.page_bytes

    def device_rows(self) -> torch.Tensor:
        """The device buffer as ``[pages, page bytes]`` (a view)."""
        tensor = self.descriptor.tensor
        return tensor.view(tensor.shape[0], -1).view(torch.uint8)


@dataclass(frozen=True)
class GroupLayout:
    group_id: int
    segments: tuple[Segment, ...]
    block_bytes: int

    @classmethod
    def of(cls, registry: StateRegistry, group_id: int) -> "GroupLayout":
        segments, offset = [], 0
        for descriptor in registry.buffers(group_id):
            segments.append(Segment(descriptor, offset))
            offset += descriptor.page_bytes
        return cls(group_id, tuple(segments), offset)

    def layer_segments(self, layer_name: str) -> list[Segment]:
        return [segment for segment in self.segments if segment.descriptor.layer_name == layer_name]


def layouts_of(registry: StateRegistry) -> list[GroupLayout]:
    return [GroupLayout.of(registry, group.group_id) for group in registry.groups]


def node_bytes(layouts: list[GroupLayout]) -> int:
    """Bytes of one page in every group (what one prefix-cache node holds at most)."""
    return sum(layout.block_bytes for layout in layouts)


class HostPool:
    """``num_pages`` host pages (plus the null page 0) in every group."""

    def __init__(self, layouts: list[GroupLayout], num_pages: int, *, pin: bool, sanitize: bool) -> None:
        self.layouts = layouts
        self.sanitize = sanitize
        self.arrays = []
        for layout in layouts:
            # Not zeroed (a page is written before it is read; sanitizer mode poisons it below).
            array = torch.empty((num_pages + 1, layout.block_bytes), dtype=torch.uint8, pin_memory=pin)
            array[0].zero_()
            self.arrays.append(array)
        self.pools = [BlockPool(layout.group_id, num_pages + 1, on_free=self._poison) for layout in layouts]
        for group in range(len(layouts)):
            self._poison(group, list(range(1, num_pages + 1)))

    @property
    def num_pages(self) -> int:
        return self.pools[0].num_usable if self.pools else 0

    def num_free(self, group: int) -> int:
        return self.pools[group].num_free

    def _poison(self, group: int, pages: list[int]) -> None:
        if not self.sanitize or not pages:
            return
        index = torch.tensor(pages, dtype=torch.long)
        array = self.arrays[group]
        for segment in self.layouts[group].segments:
            columns = array[:, segment.offset:segment.offset + segment.width]
            dtype = segment.descriptor.tensor.dtype
            if (dtype.is_floating_point and dtype.itemsize > 1 and segment.offset % dtype.itemsize == 0
                    and array.stride(0) % dtype.itemsize == 0):
                columns.view(dtype).index_fill_(0, index, float("nan"))
            else:
                columns.index_fill_(0, index, poison_byte(dtype))

    def payload(self, group: int, page: int) -> torch.Tensor:
        """One page block (a view of the pool)."""
        return self.arrays[group][page]

    def census(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for pool in self.pools:
            for key, value in pool.census().items():
                total[key] = total.get(key, 0) + value
        return total
