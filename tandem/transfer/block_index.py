"""Writes of whole blocks as indices into descriptor lists prepared once per peer.

A backend that can prepare descriptor lists ahead of time (NIXL: ``prep_xfer_dlist`` at pairing,
then ``make_prepped_xfer`` with indices per write) is told, per peer, the blocks writes will move
(``BlockRuns``: a state group's pages on both sides, the metadata rows): each side's list holds
every block of every run, back to back::

    local list    [ run 0: blocks 0 .. n0-1 ][ run 1: blocks 0 .. n1-1 ] ...
    remote list   [ run 0: blocks 0 .. m0-1 ][ run 1: blocks 0 .. m1-1 ] ...

A write descriptor (source, destination, length) that covers whole blocks of one run on both
sides becomes the indices of those blocks (consecutive blocks: consecutive indices, which the
backend merges back into one transfer). Anything else (a descriptor that is not whole blocks,
crosses runs or lies outside them) maps to None: the backend then describes the write afresh.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import bisect

import numpy as np

FEW_DESCRIPTORS = 16  # a write of at most this many descriptors is mapped in plain Python (numpy's
# per-call cost is tens of microseconds; a page-major write is a run per group and a row)
MAX_PREPARED_BLOCKS = 1 << 20  # per side: more is not prepared (layer-major pools of a large pool)


@dataclass(frozen=True)
class Blocks:
    """``count`` blocks of ``length`` bytes, ``stride`` bytes apart, from ``address``."""
    address: int
    stride: int
    length: int
    count: int

    def rows(self, device: int) -> np.ndarray:
        """The blocks as (address, length, device) rows."""
        table = np.empty((self.count, 3), dtype=np.uint64)
        table[:, 0] = self.address + self.stride * np.arange(self.count, dtype=np.uint64)
        table[:, 1] = self.length
        table[:, 2] = device
        return table


@dataclass(frozen=True)
class BlockRuns:
    """The same blocks on both sides of a pair: ``local`` here, ``remote`` on the peer (equal
    stride and length; the counts may differ, as the pools do)."""
    local: Blocks
    remote: Blocks


class BlockIndex:
    """Maps a write's descriptors to (local indices, remote indices) of the prepared lists."""

    def __init__(self, runs: list[BlockRuns]) -> None:
        for run in runs:
            if run.local.stride != run.remote.stride or run.local.length != run.remote.length:
                raise ValueError("block runs: both sides' blocks must have the same stride and length")
        order = sorted(range(len(runs)), key=lambda index: runs[index].local.address)
        first_local = np.cumsum([0] + [run.local.count for run in runs])[:-1]
        first_remote = np.cumsum([0] + [run.remote.count for run in runs])[:-1]

        def column(values) -> np.ndarray:
            return np.asarray([values[index] for index in order], dtype=np.int64)

        self.local_address = column([run.local.address for run in runs])
        self.remote_address = column([run.remote.address for run in runs])
        self.stride = column([run.local.stride for run in runs])
        self.length = column([run.local.length for run in runs])
        self.local_count = column([run.local.count for run in runs])
        self.remote_count = column([run.remote.count for run in runs])
        self.local_first = column(list(first_local))
        self.remote_first = column(list(first_remote))
        # the same columns as Python lists, for ``few_indices``
        self.columns = [column.tolist() for column in (self.local_address, self.remote_address, self.stride,
                                                       self.length, self.local_count, self.remote_count,
                                                       self.local_first, self.remote_first)]

    def indices(self, descriptors: list[tuple[int, int, int]]) -> Optional[tuple]:
        """Local and remote indices (lists, or int32 arrays for many descriptors) of every block
        the descriptors cover, in descriptor order; None unless every descriptor is whole blocks
        of one run on both sides."""
        if not descriptors or not len(self.stride):
            return None
        if len(descriptors) <= FEW_DESCRIPTORS:
            return self.few_indices(descriptors)
        return self.many_indices(descriptors)

    def few_indices(self, descriptors: list[tuple[int, int, int]]) -> Optional[tuple[list[int], list[int]]]:
        """``indices`` one descriptor at a time."""
        addresses, remote_addresses, strides, lengths, local_counts, remote_counts, local_firsts, remote_firsts = \
            self.columns
        local: list[int] = []
        remote: list[int] = []
        for source, destination, length in descriptors:
            run = bisect.bisect_right(addresses, source) - 1
            if run < 0:
                return None
            stride, extra = strides[run], length - lengths[run]
            local_offset, remote_offset = source - addresses[run], destination - remote_addresses[run]
            if extra < 0 or extra % stride or local_offset % stride or remote_offset < 0 or remote_offset % stride:
                return None
            count, local_block, remote_block = extra // stride + 1, local_offset // stride, remote_offset // stride
            if local_block + count > local_counts[run] or remote_block + count > remote_counts[run]:
                return None
            local.extend(range(local_firsts[run] + local_block, local_firsts[run] + local_block + count))
            remote.extend(range(remote_firsts[run] + remote_block, remote_firsts[run] + remote_block + count))
        return local, remote

    def many_indices(self, descriptors: list[tuple[int, int, int]]) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """``indices`` of many descriptors at once (int32 arrays)."""
        table = np.asarray(descriptors, dtype=np.int64).reshape(-1, 3)
        source, destination, length = table[:, 0], table[:, 1], table[:, 2]
        run = np.searchsorted(self.local_address, source, side="right") - 1
        if (run < 0).any():
            return None
        stride, block = self.stride[run], self.length[run]
        local_offset, remote_offset = source - self.local_address[run], destination - self.remote_address[run]
        extra = length - block
        whole = (extra >= 0) & (extra % stride == 0) & (local_offset % stride == 0) & (remote_offset >= 0) \
            & (remote_offset % stride == 0)
        if not whole.all():
            return None
        blocks = extra // stride + 1
        local_block, remote_block = local_offset // stride, remote_offset // stride
        if ((local_block + blocks > self.local_count[run]) | (remote_block + blocks > self.remote_count[run])).any():
            return None
        step = np.arange(int(blocks.sum()), dtype=np.int64) - np.repeat(np.cumsum(blocks) - blocks, blocks)
        local = np.repeat(self.local_first[run] + local_block, blocks) + step
        remote = np.repeat(self.remote_first[run] + remote_block, blocks) + step
        return local.astype(np.int32), remote.astype(np.int32)
