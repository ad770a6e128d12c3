"""Host-side inputs of one step, built once from the scheduled chunks.

Everything here is numpy on the host: the model runner copies it to the device (fresh tensors
for an eager step, the static buffers of a CUDA graph for a replayed one). Page tables are read,
never modified.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from tandem.scheduler.scheduler import ScheduledChunk
from tandem.scheduler.sequence import PENDING_TOKEN
from tandem.worker.host_staging import to_device


@dataclass
class StepInputs:
    chunks: list[ScheduledChunk]  # decode chunks first (see ``order_chunks``)
    num_decode: int
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    query_starts: list[int]  # [N + 1]
    start_positions: list[int]  # [N]: tokens computed before the chunk
    context_lengths: list[int]  # [N]: tokens visible to the chunk's last query
    page_tables: list[Optional[np.ndarray]]  # per group: [N, width] int32, null-page (0) padded
    slot_mappings: list[Optional[np.ndarray]]  # per group: [T] int64
    sampling_rows: list[int]  # token rows whose logits are sampled, in chunk order (a sampling
    # chunk with drafts has one per draft after its last known token's)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_pure_decode(self) -> bool:
        """One sampled token per chunk, no prompt logprobs: the shape a CUDA graph replays."""
        return (self.num_decode == len(self.chunks) and len(self.sampling_rows) == len(self.chunks)
                and not any(chunk.prompt_logprobs for chunk in self.chunks))


def order_chunks(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """Single-token chunks first (the batched decode path) by context length, then the rest."""
    decodes = sorted((c for c in chunks if c.num_query_tokens == 1), key=lambda c: c.start)
    return decodes + [c for c in chunks if c.num_query_tokens > 1]


def build_step_inputs(chunks: list[ScheduledChunk], num_groups: int, page_size: int) -> StepInputs:
    """A chunk's rows are its known tokens, then its draft tokens (speculative decoding); a
    sampling chunk's logits are wanted at its last known token and at each draft."""
    chunks = order_chunks(chunks)
    ids: list[int] = []
    lengths, num_sampled = [], []
    for chunk in chunks:
        ids.extend(chunk.sequence.token_ids[chunk.start:chunk.start + chunk.num_new_tokens])
        if chunk.num_draft_tokens:
            ids.extend(chunk.sequence.draft_token_ids[:chunk.num_draft_tokens])
        lengths.append(chunk.num_query_tokens)
        num_sampled.append(1 + chunk.num_draft_tokens if chunk.samples else 0)
    tables = [[chunk.sequence.state.page_tables[group] for chunk in chunks] for group in range(num_groups)]
    return layout_rows(chunks, ids, [chunk.start for chunk in chunks], lengths, num_sampled, tables, page_size)


def layout_rows(chunks: list, ids: list[int], start_positions: list[int], lengths: list[int],
                num_sampled: list[int], tables: list[Optional[list[list[int]]]], page_size: int) -> StepInputs:
    """Flatten rows (single-token rows first, as ``order_chunks`` orders them): row ``i`` has
    ``lengths[i]`` tokens (in ``ids``, concatenated) from position ``start_positions[i]`` on and
    its last ``num_sampled[i]`` rows' logits are wanted; ``tables[group][i]`` is its page table
    in that group (a group given as None gets no table and no slots: the forward reads none)."""
    num_decode = sum(1 for length in lengths if length == 1)
    query_starts = [0]
    sampling_rows: list[int] = []
    for length, sampled in zip(lengths, num_sampled):
        query_starts.append(query_starts[-1] + length)
        sampling_rows.extend(range(query_starts[-1] - sampled, query_starts[-1]))
    context_lengths = [start + length for start, length in zip(start_positions, lengths)]
    counts = np.asarray(lengths, dtype=np.int64)
    row_of_token = np.repeat(np.arange(len(lengths)), counts)
    positions = (np.arange(len(ids), dtype=np.int64) - np.asarray(query_starts[:-1], dtype=np.int64)[row_of_token]
                 + np.asarray(start_positions, dtype=np.int64)[row_of_token])
    needed_width = max(-(-length // page_size) for length in context_lengths)
    page_tables, slot_mappings = [], []
    for rows in tables:
        if rows is None:
            page_tables.append(None)
            slot_mappings.append(None)
            continue
        table = np.zeros((len(rows), max(needed_width, max(map(len, rows)))), dtype=np.int32)
        for index, row in enumerate(rows):
            table[index, :len(row)] = row
        page_tables.append(table)
        slot_mappings.append(table[row_of_token, positions // page_size].astype(np.int64) * page_size
                             + positions % page_size)
    return StepInputs(chunks, num_decode, np.asarray(ids, dtype=np.int64), positions, query_starts,
                      start_positions, context_lengths, page_tables, slot_mappings, sampling_rows)


@dataclass
class PendingTokens:
    """Tokens sampled by the step in flight, still on the device (overlapped engine loop).

    ``token_ids[row_of[id(sequence)]]`` is the token that stands as ``PENDING_TOKEN`` at the
    end of that sequence's ``token_ids``."""
    token_ids: torch.Tensor  # [rows] int64, on the device
    row_of: dict[int, int]

    def feed(self, step: StepInputs, device: torch.device) -> Optional[Callable[[torch.Tensor], None]]:
        """A function writing the step's pending input tokens into its device input ids (None
        when the step reads none). Only a decode chunk reads a pending token: its one input."""
        targets, sources = [], []
        for row, chunk in enumerate(step.chunks[:step.num_decode]):
            if chunk.sequence.token_ids[chunk.start] == PENDING_TOKEN:
                targets.append(row)
                sources.append(self.row_of[id(chunk.sequence)])
        if not targets:
            return None
        indices = to_device([targets, sources], device, torch.long)
        return lambda input_ids: input_ids.index_copy_(0, indices[0], self.token_ids.index_select(0, indices[1]))
