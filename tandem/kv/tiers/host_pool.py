"""The host tier's pages: one pool per state group, page first.

A host page of a group is one contiguous block holding that page of every buffer of the group,
buffer after buffer in registry order (``GroupLayout``), so a page moves to disk as one object
and a layer's slice of many pages is a column range of the pool's ``[pages, block bytes]``
array. The block is the same whatever the device layout (``--kv-cache-layout``); where the
device pool is page-major, buffers that continue on both sides are copied as one ``Span``. The array is pinned on CUDA machines (copies run asynchronously, and the page-copy
kernel reads and writes it directly).

Books (``HostPageBooks``, kept by the tiers' books; the blocks themselves, ``HostPages``, by each
rank's ``TierWorker``): each group's pages have reference counts with owner tags, as the device pools do
(``BlockPool``): ``"cache"`` for a prefix-cache node's host copy, ``"swap:<sequence>"`` for a
preempted sequence's state, ``"inflight:<op>"`` for a copy that reads or writes the page (I2).
Page 0 is never handed out. Freed pages are poisoned in sanitizer mode (NaN in float buffers'
columns, a byte pattern elsewhere), so a load from a freed host page fails loudly (I6).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

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
        """The device buffer as ``[pages, page bytes]`` (a view; rows ``page_stride`` apart)."""
        return self.descriptor.page_rows()


@dataclass(frozen=True)
class Span:
    """Segments that lie back to back both in the host block and in the device rows (a
    page-major group's buffers at offsets without padding between them): one copy moves them."""
    segments: tuple[Segment, ...]

    @property
    def offset(self) -> int:
        return self.segments[0].offset

    @property
    def width(self) -> int:
        return sum(segment.width for segment in self.segments)

    def device_rows(self) -> torch.Tensor:
        """The span's columns of the device pages, ``[pages, width]`` uint8 (a view)."""
        first = self.segments[0].descriptor
        if len(self.segments) == 1:
            return self.segments[0].device_rows()
        return first.pool[:, first.offset:first.offset + self.width]

    @staticmethod
    def continues(previous: Segment, segment: Segment) -> bool:
        before, after = previous.descriptor, segment.descriptor
        return (before.pool is not None and after.pool is before.pool
                and after.offset == before.offset + before.page_bytes
                and segment.offset == previous.offset + previous.width)


def spans_of(segments) -> list[Span]:
    """``segments`` (in block order) joined where they continue on both sides."""
    runs: list[list[Segment]] = []
    for segment in segments:
        if runs and Span.continues(runs[-1][-1], segment):
            runs[-1].append(segment)
        else:
            runs.append([segment])
    return [Span(tuple(run)) for run in runs]


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

    def spans(self) -> list[Span]:
        """The group's segments as few copies as the device layout allows (page-major: one per
        group when no buffer's page needs alignment padding; layer-major: one per buffer)."""
        return self._spans

    def layer_spans(self, layer_name: str) -> list[Span]:
        return self._layer_spans.get(layer_name, [])

    # (every save and load asks; the layout never changes: joined once)
    @cached_property
    def _spans(self) -> list[Span]:
        return spans_of(self.segments)

    @cached_property
    def _layer_spans(self) -> dict[str, list[Span]]:
        names = dict.fromkeys(segment.descriptor.layer_name for segment in self.segments)
        return {name: spans_of(self.layer_segments(name)) for name in names}


def layouts_of(registry: StateRegistry) -> list[GroupLayout]:
    return [GroupLayout.of(registry, group.group_id) for group in registry.groups]


def node_bytes(layouts: list[GroupLayout]) -> int:
    """Bytes of one page in every group (what one prefix-cache node holds at most)."""
    return sum(layout.block_bytes for layout in layouts)


class HostPages:
    """A rank's host page blocks: ``num_pages`` pages (plus the null page 0) in every group,
    each holding this rank's shard of the page (the tensors; the books are ``HostPageBooks``).
    Owner: the rank's ``TierWorker``."""

    def __init__(self, layouts: list[GroupLayout], num_pages: int, *, pin: bool, sanitize: bool) -> None:
        self.layouts = layouts
        self.sanitize = sanitize
        self.arrays = []
        for layout in layouts:
            # Not zeroed (a page is written before it is read; sanitizer mode poisons it below).
            array = torch.empty((num_pages + 1, layout.block_bytes), dtype=torch.uint8, pin_memory=pin)
            array[0].zero_()
            self.arrays.append(array)
        for group in range(len(layouts)):
            self.poison(group, list(range(1, num_pages + 1)))

    def poison(self, group: int, pages: list[int]) -> None:
        """Sanitizer mode: fill the pages with a poison value (NaN in float buffers)."""
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


class HostPageBooks:
    """The host pages' books (``num_pages`` per group, the null page 0 never handed out), kept by
    the tiers' books (``TieredState``); ``on_free`` is told of each group's freed pages."""

    def __init__(self, num_groups: int, num_pages: int, on_free: Callable[[int, list[int]], None]) -> None:
        self.pools = [BlockPool(group, num_pages + 1, on_free=on_free) for group in range(num_groups)]

    @property
    def num_pages(self) -> int:
        return self.pools[0].num_usable if self.pools else 0

    def num_free(self, group: int) -> int:
        return self.pools[group].num_free

    def census(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for pool in self.pools:
            for key, value in pool.census().items():
                total[key] = total.get(key, 0) + value
        return total
