"""From pages to bytes: the registry's buffers as memory regions, and page pairs as coalesced
(source address, destination address, length) writes.

Everything here iterates the state registry (I1): a buffer the registry holds is registered
with the backend, described at handshake, and written for every page pair of its group; there is
no per-family code. Page ``p`` of a buffer lies at ``tensor.data_ptr() + p * page_stride``
(``BufferDescriptor``); runs of pages that are consecutive on both sides become one write::

    source pages       4 5 6   9          one write of 3 pages (4..6 -> 12..14),
    destination pages 12 13 14 20         one of 1 page (9 -> 20), per buffer (layer-major)
                                          or per group (page-major: a page of every buffer
                                          of the group is one block, ``GroupPool``)

What is registered with a backend is each distinct allocation (a page-major group's pool once);
what a peer is told is one base address per registry buffer (``buffer_addresses``), from which
a page-major group's pool base is its first buffer's address less that buffer's offset.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from tandem.kv.planner import NULL_PAGE
from tandem.kv.registry import StateRegistry
from tandem.transfer.messages import BufferInfo, StateLayout

BufferKey = tuple[int, str, str]


@dataclass(frozen=True)
class MemoryRegion:
    """A registered region: ``device`` is -1 for host memory, else the CUDA device index;
    ``tensor``, where known, the tensor it was made from (a backend that shares device memory
    with peers, ``peer_memory.py``, needs its storage)."""
    address: int
    length: int
    device: int
    tensor: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    @property
    def memory_type(self) -> str:
        return "DRAM" if self.device < 0 else "VRAM"


def tensor_region(tensor: torch.Tensor) -> MemoryRegion:
    if not tensor.is_contiguous():
        raise ValueError("transfer: state buffers must be contiguous to be registered")
    device = tensor.device.index if tensor.device.type == "cuda" else -1
    return MemoryRegion(tensor.data_ptr(), tensor.numel() * tensor.element_size(), device if device is not None else 0,
                        tensor)


def buffer_regions(registry: StateRegistry) -> list[MemoryRegion]:
    """Every distinct state allocation as a region, in registry order: a layer-major buffer's
    tensor, a page-major group's pool (once)."""
    return [tensor_region(allocation) for allocation in registry.allocations()]


def buffer_addresses(registry: StateRegistry) -> list[int]:
    """Each registry buffer's base address (page 0), in registry order: what a peer plans
    writes into (``plan_page_writes``'s ``remote_addresses``)."""
    return [descriptor.tensor.data_ptr() for descriptor in registry.buffers()]


def describe_layout(registry: StateRegistry, *, architecture: str, model: dict[str, int], page_size: int,
                    metadata_row_bytes: int, quantization: str = "none") -> StateLayout:
    buffers = [BufferInfo(d.group_id, d.layer_name, d.kind, d.item_size, str(d.tensor.dtype), d.page_bytes,
                          d.page_stride, d.offset)
               for d in registry.buffers()]
    return StateLayout(architecture=architecture, model=dict(model), page_size=page_size,
                       num_groups=len(registry.groups), buffers=buffers, metadata_row_bytes=metadata_row_bytes,
                       kv_cache_layout=registry.kv_cache_layout, quantization=quantization)


def coalesce(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source page, destination page) pairs -> (source start, destination start, count) runs,
    null pages skipped, sorted by source page."""
    runs: list[list[int]] = []
    for source, destination in sorted((s, d) for s, d in pairs if s != NULL_PAGE and d != NULL_PAGE):
        if runs and runs[-1][0] + runs[-1][2] == source and runs[-1][1] + runs[-1][2] == destination:
            runs[-1][2] += 1
        else:
            runs.append([source, destination, 1])
    return [tuple(run) for run in runs]


@dataclass
class WritePlan:
    """The writes that move some pages of every group: ``descriptors`` are (source address,
    destination address, length); ``touched`` the registry buffers they cover (I1 tests)."""
    descriptors: list[tuple[int, int, int]] = field(default_factory=list)
    num_bytes: int = 0
    num_pages: int = 0
    touched: set[BufferKey] = field(default_factory=set)


@dataclass(frozen=True)
class BlockSpan:
    """Where one state group's pages lie in one allocation, on both sides: page ``p`` is
    ``length`` bytes at ``local + p * stride`` here and at ``remote + p * stride`` on the peer,
    so a run of ``n`` pages is one write of ``(n - 1) * stride + length`` bytes. Layer-major:
    one span per buffer; page-major: one per group (its pool's blocks, every buffer of the
    group), covering the registry buffers ``keys``."""
    group_id: int
    local: int
    remote: int
    stride: int
    length: int
    keys: tuple[BufferKey, ...]


def block_spans(registry: StateRegistry, remote_addresses: list[int]) -> list[BlockSpan]:
    """The spans of every registry buffer, in registry order, for a peer whose buffer bases are
    ``remote_addresses`` (registry order; the handshake checked that both registries list the
    same buffers with the same page sizes, strides and offsets, and the same
    ``kv_cache_layout``). A page-major group's pool is one span, made at its first buffer."""
    spans: list[BlockSpan] = []
    pool_span: dict[int, int] = {}  # group -> index of its pool's span
    for descriptor, remote_base in zip(registry.buffers(), remote_addresses, strict=True):
        if descriptor.pool is None:
            spans.append(BlockSpan(descriptor.group_id, descriptor.tensor.data_ptr(), remote_base,
                                   descriptor.page_stride, descriptor.page_bytes, (descriptor.key,)))
        elif descriptor.group_id in pool_span:
            index = pool_span[descriptor.group_id]
            span = spans[index]
            spans[index] = BlockSpan(span.group_id, span.local, span.remote, span.stride, span.length,
                                     span.keys + (descriptor.key,))
        else:
            pool_span[descriptor.group_id] = len(spans)
            spans.append(BlockSpan(descriptor.group_id, descriptor.pool.data_ptr(), remote_base - descriptor.offset,
                                   descriptor.page_stride, descriptor.page_stride, (descriptor.key,)))
    return spans


class WritePlanner:
    """Page writes to one peer, planned from (source page, destination page) pairs. Everything
    that depends only on the two registries (each allocation's base here and there, strides,
    block lengths, the buffers each covers) is worked out once, when the peer becomes known
    (``block_spans``); a write then costs only the coalescing of its page pairs and one
    descriptor per run and span: with page-major pools, a prompt's pages in a group are one
    descriptor (a 2,048-token Llama-8B prompt: one of 256 MiB)."""

    def __init__(self, registry: StateRegistry, remote_addresses: list[int]) -> None:
        self.spans = block_spans(registry, remote_addresses)

    def plan(self, pairs_per_group: list[list[tuple[int, int]]]) -> WritePlan:
        """Writes for ``pairs_per_group[g]`` (source page, destination page) in every buffer of
        group ``g``: one per run (``coalesce``) and span, in registry order."""
        plan = WritePlan()
        runs_per_group = [coalesce(pairs) for pairs in pairs_per_group]
        plan.num_pages = sum(count for runs in runs_per_group for _, _, count in runs)
        for span in self.spans:
            runs = runs_per_group[span.group_id]
            if not runs:
                continue
            plan.touched.update(span.keys)
            stride, length = span.stride, span.length
            for source, destination, count in runs:
                num_bytes = (count - 1) * stride + length
                plan.descriptors.append((span.local + source * stride, span.remote + destination * stride, num_bytes))
                plan.num_bytes += num_bytes
        return plan


def plan_page_writes(registry: StateRegistry, remote_addresses: list[int],
                     pairs_per_group: list[list[tuple[int, int]]]) -> WritePlan:
    """One write plan, spans worked out on the spot (``WritePlanner`` keeps them per peer).
    Layer-major: one write per run of pages and buffer; page-major: one per run and group,
    covering every buffer of the group."""
    return WritePlanner(registry, remote_addresses).plan(pairs_per_group)


def merge_adjacent(descriptors: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(source, destination, length) writes, sorted by source, with every run that continues on
    both sides merged into one: a buffer's page runs are already one write each
    (``plan_page_writes``), and buffers that lie back to back in memory on both sides (a layer's K
    and V, consecutive layers of one allocation) become one write too. Backends pay per
    descriptor, so fewer, larger writes run closer to the link's rate."""
    merged: list[list[int]] = []
    for source, destination, length in sorted(descriptors):
        if length <= 0:
            continue
        if merged and merged[-1][0] + merged[-1][2] == source and merged[-1][1] + merged[-1][2] == destination:
            merged[-1][2] += length
        else:
            merged.append([source, destination, length])
    return [tuple(run) for run in merged]
