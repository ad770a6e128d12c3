"""Per-step attention metadata, one per state group, built by the model runner.

Token order in a step (index regions of the flattened batch):

    | decode tokens (one per decoding sequence) | prefill chunk 0 | prefill chunk 1 | ...
    0                                    num_decode_tokens

Rows (one per scheduled chunk) follow the same order: decode rows first, then prefill rows.

``slot_mapping[t]`` is where token ``t``'s new state is written: ``page * page_size + offset``
(-1: nothing is written, a padding row of a CUDA graph).

The tensors (``page_table``, ``context_lengths``, ``query_starts``) are what GPU kernels read;
they keep their shapes from step to step inside a CUDA graph, where they are static buffers
refilled before each replay. ``decode_buckets`` and ``prefills`` are per-chunk views for the
plain-PyTorch backends, built on first use only.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import numpy as np
import torch


@dataclass
class PrefillSlice:
    query_start: int
    query_end: int
    context_length: int  # tokens visible to the last query of the chunk (cached + new)
    pages: torch.Tensor  # [ceil(context_length / page_size)] page ids


@dataclass
class DecodeBucket:
    """Decode tokens ``start..end`` (sorted by context length), padded to a common width."""
    start: int
    end: int
    page_table: torch.Tensor  # [end - start, width_pages] (null-page padded)
    valid: torch.Tensor  # [end - start, width_pages * page_size] bool
    # Windowed attention masks each row from ``context_length - window`` on and skips the pages
    # before the shortest row's window.
    context_lengths: Optional[torch.Tensor] = None  # [end - start]
    min_context_length: int = 0


class AttentionMetadata:
    """What attention (and every other per-token state reader) of one group needs for a step.

    Built by the model runner and read-only for layers. Per scheduled chunk, in row order:
    ``chunk_query_starts`` (where its tokens start in the batch, plus the end),
    ``chunk_start_positions`` (tokens its sequence had computed before it; 0: a fresh state) and
    ``chunk_context_lengths`` (tokens visible to its last query). State kept per sequence rather
    than per token (a recurrent slot) is found through the row of ``page_table``.
    """

    def __init__(self, *, page_size: int, slot_mapping: torch.Tensor, page_table: torch.Tensor,
                 context_lengths: torch.Tensor, query_starts: torch.Tensor, num_decode_tokens: int,
                 chunk_query_starts: list[int], chunk_start_positions: list[int],
                 chunk_context_lengths: list[int], zero_invalid: bool = False,
                 decode_min_bucket: int = 8, host_page_table: Optional[np.ndarray] = None) -> None:
        self.page_size = page_size
        self.slot_mapping = slot_mapping  # [T] int64
        self.page_table = page_table  # [num_chunks, width] int32 (null-page padded)
        self.context_lengths = context_lengths  # [num_chunks] int32
        self.query_starts = query_starts  # [num_chunks + 1] int32
        self.num_decode_tokens = num_decode_tokens
        self.chunk_query_starts = chunk_query_starts
        self.chunk_start_positions = chunk_start_positions
        self.chunk_context_lengths = chunk_context_lengths
        self.max_prefill_query_len = max(
            (end - start for start, end in zip(chunk_query_starts[num_decode_tokens:],
                                               chunk_query_starts[num_decode_tokens + 1:])), default=0)
        # Zero gathered slots outside the valid region before the product. Needed only when freed
        # slots may hold NaN poison (sanitizer mode); otherwise stale slots are finite and masked.
        self.zero_invalid = zero_invalid
        self.decode_min_bucket = decode_min_bucket
        # ``page_table`` as the host built it (eager steps), for readers that need page ids as
        # numbers without reading them back from the device; None in a CUDA graph.
        self.host_page_table = host_page_table

    @property
    def num_rows(self) -> int:
        return len(self.chunk_start_positions)

    @cached_property
    def num_fresh_decode_rows(self) -> int:
        """Decode rows whose token is their sequence's first (start position 0). Decode rows are
        ordered by start position, so these come first."""
        return bisect.bisect_right(self.chunk_start_positions, 0, 0, self.num_decode_tokens)

    @property
    def num_prefills(self) -> int:
        return len(self.chunk_start_positions) - self.num_decode_tokens

    # Row regions for the kernels (views, no copies).
    @property
    def decode_page_table(self) -> torch.Tensor:
        return self.page_table[:self.num_decode_tokens]

    @property
    def decode_context_lengths(self) -> torch.Tensor:
        return self.context_lengths[:self.num_decode_tokens]

    @property
    def prefill_page_table(self) -> torch.Tensor:
        return self.page_table[self.num_decode_tokens:]

    @property
    def prefill_context_lengths(self) -> torch.Tensor:
        return self.context_lengths[self.num_decode_tokens:]

    @property
    def prefill_query_starts(self) -> torch.Tensor:
        """Offsets of the prefill chunks in the whole batch (they start at ``num_decode_tokens``)."""
        return self.query_starts[self.num_decode_tokens:]

    # Per-chunk views for the plain-PyTorch backends.
    @cached_property
    def decode_buckets(self) -> list[DecodeBucket]:
        """Decode rows in buckets of similar context length, so padding stays small."""
        page_size, device = self.page_size, self.page_table.device
        lengths = self.chunk_context_lengths[:self.num_decode_tokens]
        buckets = []
        for start, end in decode_bucket_bounds(lengths, min_bucket=self.decode_min_bucket):
            context_lengths = self.context_lengths[start:end].long()
            width = -(-lengths[end - 1] // page_size)
            valid = torch.arange(width * page_size, device=device)[None, :] < context_lengths[:, None]
            buckets.append(DecodeBucket(start, end, self.page_table[start:end, :width], valid,
                                        context_lengths, lengths[start]))
        return buckets

    @cached_property
    def prefills(self) -> list[PrefillSlice]:
        slices = []
        for row in range(self.num_decode_tokens, len(self.chunk_start_positions)):
            length = self.chunk_context_lengths[row]
            slices.append(PrefillSlice(self.chunk_query_starts[row], self.chunk_query_starts[row + 1], length,
                                       self.page_table[row, :-(-length // self.page_size)]))
        return slices


def decode_bucket_bounds(sorted_lengths: list[int], slack: float = 1.25,
                         min_bucket: int = 8) -> list[tuple[int, int]]:
    """Split ascending context lengths into runs whose longest is within ``slack`` of the
    shortest (runs of fewer than ``min_bucket`` are merged forward): bounded padding, few calls."""
    bounds, start = [], 0
    for index in range(1, len(sorted_lengths) + 1):
        at_end = index == len(sorted_lengths)
        if at_end or (index - start >= min_bucket and sorted_lengths[index] > slack * sorted_lengths[start]):
            bounds.append((start, index))
            start = index
    return bounds
