"""Per-step attention metadata, one per state group, built by the model runner.

Token order in a step (index regions of the flattened batch):

    | decode tokens (one per decoding sequence) | prefill chunk 0 | prefill chunk 1 | ...
    0                                    num_decode_tokens

``slot_mapping[t]`` is where token ``t``'s new state is written: ``page * page_size + offset``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

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
    page_table: torch.Tensor  # [end - start, width_pages] long (null-page padded)
    valid: torch.Tensor  # [end - start, width_pages * page_size] bool
    # Windowed attention masks each row from ``context_length - window`` on and skips the pages
    # before the shortest row's window.
    context_lengths: Optional[torch.Tensor] = None  # [end - start] long
    min_context_length: int = 0


@dataclass
class AttentionMetadata:
    page_size: int
    slot_mapping: torch.Tensor  # [T] long
    num_decode_tokens: int = 0
    # Decode tokens in buckets of similar context length, so padding stays small.
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillSlice] = field(default_factory=list)
    # Zero gathered slots outside the valid region before the product. Needed only when freed
    # slots may hold NaN poison (sanitizer mode); otherwise stale slots are finite and masked.
    zero_invalid: bool = False
    # Per scheduled chunk, in token order (decode chunks first): where its tokens start in the
    # batch (plus the end), how many tokens its sequence had computed before it (0: the chunk
    # starts from a fresh state), and its page-table row. State kept per sequence rather than
    # per token (a recurrent slot) is found through the row.
    chunk_query_starts: list[int] = field(default_factory=list)  # [num_chunks + 1]
    chunk_start_positions: list[int] = field(default_factory=list)  # [num_chunks]
    page_table: Optional[torch.Tensor] = None  # [num_chunks, width] long (null-page padded)
