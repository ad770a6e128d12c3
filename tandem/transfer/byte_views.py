"""Registered memory as byte tensors, and how a write's descriptors become tensor sends.

The connector API speaks of addresses; a backend that moves tensors (NCCL, gloo through
``torch.distributed``) needs tensors. ``RegionViews`` keeps one byte view per registered region
(no copy: host memory through ctypes, device memory through ``__cuda_array_interface__``) and
answers any (address, length) inside one of them with a view, refusing anything outside: a
peer can only ever write into memory this side registered.

Owner: the backend that registered the regions; the views alias the engine's state tensors and
stay valid while those do (for the engine's lifetime).

A write's descriptors (already merged, ``descriptors.merge_adjacent``) become a list of
segments, each one tensor send; writer and reader compute the same list from the same lengths
(the writer's ``direct_bytes`` and ``staging_bytes`` travel in the write's header)::

    lengths   256M 16K                          at most FEW_RUNS runs (a page-major write: a run
    segments [256M] [16K]                       per state group, and the metadata row): each in place

    lengths   96M  4M 4M 4M 4M 4M 4M 4M 4M 4M   4M 64K    >= direct_bytes (or > staging_bytes):
    segments [96M] [4M 4M 4M 4M 4M 4M 4M 4M]  [4M 4M 64K]  sent in place; smaller: packed into
                   gathered into staging, one send        staging buffers of <= staging_bytes

A write whose staged segments fit the staging area at once goes as one batch (between GPUs, one
group of point-to-point operations); otherwise the staged ones take turns in the slots of the
staging area, pipelined (``nccl_sendrecv.SendReceive.move``): the gather of one overlaps the
send of the one before. Point-to-point operations pay a fixed cost each (host and device), so a PD write of many
page runs goes as a few large sends.
"""
from __future__ import annotations

import bisect
import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from tandem.transfer.descriptors import MemoryRegion

DIRECT_BYTES = 64 << 20  # a run this long is sent from (received into) the pages themselves
STAGING_BYTES = 32 << 20  # shorter runs are packed into staged segments of at most this size
FEW_RUNS = 4  # a write of at most this many runs sends each in place (one batch)


class _DeviceBytes:
    """A device allocation described to ``torch.as_tensor`` (CUDA array interface, version 3)."""

    def __init__(self, address: int, length: int) -> None:
        self.__cuda_array_interface__ = {"shape": (length,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def region_view(region: MemoryRegion) -> torch.Tensor:
    """A uint8 tensor over a registered region (no copy)."""
    if region.length == 0:
        return torch.empty(0, dtype=torch.uint8)
    if region.device < 0:
        return torch.frombuffer((ctypes.c_uint8 * region.length).from_address(region.address), dtype=torch.uint8)
    with torch.cuda.device(region.device):
        return torch.as_tensor(_DeviceBytes(region.address, region.length), device=f"cuda:{region.device}")


class RegionViews:
    """Byte views of registered regions, looked up by address."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[tuple[MemoryRegion, torch.Tensor]] = []

    def add(self, region: MemoryRegion) -> None:
        self.add_view(region, region_view(region))

    def add_view(self, region: MemoryRegion, view: torch.Tensor) -> None:
        """Answer addresses inside ``region`` with slices of ``view`` (its bytes as this process
        reaches them: a peer's memory opened here is looked up by the peer's addresses)."""
        index = bisect.bisect(self._starts, region.address)
        self._starts.insert(index, region.address)
        self._regions.insert(index, (region, view))

    @property
    def regions(self) -> list[MemoryRegion]:
        return [region for region, _ in self._regions]

    @property
    def device(self) -> int:
        """Where the regions live: -1 host memory, else the CUDA device (the first region's)."""
        return self._regions[0][0].device if self._regions else -1

    def check(self, addresses: list[int], lengths: list[int]) -> None:
        """Refuse (ValueError) unless every (address, length) lies inside one registered region
        (all at once: what ``view`` checks one by one)."""
        if not addresses:
            return
        starts = np.asarray(self._starts, dtype=np.int64)
        ends = starts + np.asarray([region.length for region, _ in self._regions], dtype=np.int64)
        wanted, sizes = np.asarray(addresses, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        index = np.searchsorted(starts, wanted, side="right") - 1
        inside = (index >= 0) & (sizes >= 0) & (wanted + sizes <= ends[np.maximum(index, 0)])
        if not inside.all():
            first = int(np.argmin(inside))
            raise ValueError(f"transfer: {lengths[first]} bytes at {addresses[first]:#x} lie outside the registered "
                             f"memory")

    def view(self, address: int, length: int) -> torch.Tensor:
        index = bisect.bisect(self._starts, address) - 1
        if index >= 0:
            region, view = self._regions[index]
            offset = address - region.address
            if offset + length <= region.length:
                return view[offset:offset + length]
        raise ValueError(f"transfer: {length} bytes at {address:#x} lie outside the registered memory")


@dataclass(frozen=True)
class Segment:
    """One tensor send: descriptors ``first`` .. ``last - 1``; ``direct`` when it is a single
    run sent in place, else packed into a staging buffer of ``num_bytes``."""
    first: int
    last: int
    num_bytes: int
    direct: bool


def plan_segments(lengths: list[int], direct_bytes: int = DIRECT_BYTES,
                  staging_bytes: int = STAGING_BYTES) -> list[Segment]:
    """The sends of a write of runs of ``lengths`` bytes (see the module docstring): every run in
    place when there are at most FEW_RUNS (a gather and a scatter would cost more than the few
    extra operations in one group), else runs of at least ``direct_bytes`` (or longer than
    ``staging_bytes``) in place and the others packed, in order, into staged segments of at most
    ``staging_bytes``."""
    if len(lengths) <= FEW_RUNS:
        return [Segment(index, index + 1, length, True) for index, length in enumerate(lengths)]
    segments: list[Segment] = []
    start, packed = 0, 0
    for index, length in enumerate(lengths):
        direct = length >= direct_bytes or length > staging_bytes
        if direct or packed + length > staging_bytes:
            if index > start:
                segments.append(Segment(start, index, packed, False))
            start, packed = index, 0
        if direct:
            segments.append(Segment(index, index + 1, length, True))
            start = index + 1
            continue
        packed += length
    if len(lengths) > start:
        segments.append(Segment(start, len(lengths), packed, False))
    return segments


def widest_element(addresses: list[int], lengths: list[int]) -> torch.dtype:
    """The widest integer type every address and length is a multiple of (copies of wide
    elements run faster than byte copies)."""
    combined = 0
    for value in (*addresses, *lengths):
        combined |= value
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if combined % size == 0:
            return dtype
    return torch.uint8


def pack(views: list[torch.Tensor], staging: torch.Tensor) -> torch.Tensor:
    """Gather ``views`` back to back into ``staging``; returns the filled part."""
    parts = split_like(views, staging)
    torch._foreach_copy_(parts, views)
    return staging[:sum(view.numel() for view in views)]


def unpack(staging: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Scatter ``staging`` (packed as ``pack`` did) into ``views``."""
    torch._foreach_copy_(views, split_like(views, staging))


def split_like(views: list[torch.Tensor], staging: torch.Tensor) -> list[torch.Tensor]:
    sizes = [view.numel() for view in views]
    return list(torch.split(staging[:sum(sizes)], sizes))
