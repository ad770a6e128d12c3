"""Host-side inputs of one step, built once from the scheduled chunks.

Everything here is numpy on the host: the model runner copies it to the device (fresh tensors
for an eager step, the static buffers of a CUDA graph for a replayed one). Page tables are read,
never modified.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter
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
    wants_prompt_logprobs: bool = False  # some chunk computes prompt logprobs

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def order_chunks(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """Single-token chunks first (the batched decode path) by context length, then the rest."""
    decodes, others = [], []
    for chunk in chunks:
        (decodes if chunk.num_query_tokens == 1 else others).append(chunk)
    decodes.sort(key=attrgetter("start"))
    return decodes + others if others else decodes


class PageTableRows:
    """Numpy copies of sequences' page-table lists, converted again only when a list changed.

    Owned by the model runner. An entry is keyed by the list object and checked against a
    snapshot of the list taken at conversion (one C-level list comparison), so any change (a new
    page, an entry replaced or dropped, a cleared table) is seen. Entries not used by a step are
    dropped after it (``end_step``)."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[list[int], list[int], np.ndarray]] = {}
        self._used: dict[int, tuple[list[int], list[int], np.ndarray]] = {}

    def row(self, table: list[int]) -> np.ndarray:
        key = id(table)
        entry = self._rows.get(key)
        if entry is None or entry[0] is not table or entry[1] != table:
            entry = (table, list(table), np.array(table, dtype=np.int32))
        self._used[key] = entry
        return entry[2]

    def end_step(self) -> None:
        self._rows, self._used = self._used, {}


def _page_table(rows: list[np.ndarray], width: int) -> np.ndarray:
    """Ragged rows → ``[len(rows), width]`` int32, null-page (0) padded."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = max(width, int(lengths.max()))
    table = np.zeros((len(rows), width), dtype=np.int32)
    table[np.arange(width)[None, :] < lengths[:, None]] = np.concatenate(rows)
    return table


def build_step_inputs(chunks: list[ScheduledChunk], num_groups: int, page_size: int,
                      page_table_rows: Optional[PageTableRows] = None) -> StepInputs:
    """A chunk's rows are its known tokens, then its draft tokens (speculative decoding); a
    sampling chunk's logits are wanted at its last known token and at each draft. Page tables
    go through ``page_table_rows`` (kept across steps by the caller) when given."""
    chunks = order_chunks(chunks)
    if chunks and chunks[-1].num_query_tokens == 1:  # single-token rows only (a decode step)
        ids = [chunk.sequence.token_ids[chunk.start] for chunk in chunks]
        lengths = [1] * len(chunks)
        num_sampled = [1 if chunk.samples else 0 for chunk in chunks]
    else:
        ids: list[int] = []
        lengths, num_sampled = [], []
        for chunk in chunks:
            ids.extend(chunk.sequence.token_ids[chunk.start:chunk.start + chunk.num_new_tokens])
            if chunk.num_draft_tokens:
                ids.extend(chunk.sequence.draft_token_ids[:chunk.num_draft_tokens])
            lengths.append(chunk.num_query_tokens)
            num_sampled.append(1 + chunk.num_draft_tokens if chunk.samples else 0)
    tables = [[chunk.sequence.state.page_tables[group] for chunk in chunks] for group in range(num_groups)]
    step = layout_rows(chunks, ids, [chunk.start for chunk in chunks], lengths, num_sampled, tables, page_size,
                       page_table_rows)
    if page_table_rows is not None:
        page_table_rows.end_step()
    return step


def layout_rows(chunks: list, ids: list[int], start_positions: list[int], lengths: list[int],
                num_sampled: list[int], tables: list[Optional[list[list[int]]]], page_size: int,
                page_table_rows: Optional[PageTableRows] = None) -> StepInputs:
    """Flatten rows (single-token rows first, as ``order_chunks`` orders them): row ``i`` has
    ``lengths[i]`` tokens (in ``ids``, concatenated) from position ``start_positions[i]`` on and
    its last ``num_sampled[i]`` rows' logits are wanted; ``tables[group][i]`` is its page table
    in that group (a group given as None gets no table and no slots: the forward reads none)."""
    rows_cache = page_table_rows or PageTableRows()
    num_rows = len(lengths)
    num_decode = sum(1 for length in lengths if length == 1)
    context_lengths = [start + length for start, length in zip(start_positions, lengths)]
    if num_decode == num_rows:  # one token per row: rows and tokens coincide
        query_starts = list(range(num_rows + 1))
        sampling_rows = [row for row, sampled in enumerate(num_sampled) if sampled]
        row_of_token = np.arange(num_rows)
        positions = np.asarray(start_positions, dtype=np.int64)
    else:
        query_starts = [0]
        sampling_rows: list[int] = []
        for length, sampled in zip(lengths, num_sampled):
            query_starts.append(query_starts[-1] + length)
            sampling_rows.extend(range(query_starts[-1] - sampled, query_starts[-1]))
        counts = np.asarray(lengths, dtype=np.int64)
        row_of_token = np.repeat(np.arange(num_rows), counts)
        positions = (np.arange(len(ids), dtype=np.int64) - np.asarray(query_starts[:-1], dtype=np.int64)[row_of_token]
                     + np.asarray(start_positions, dtype=np.int64)[row_of_token])
    needed_width = -(-max(context_lengths) // page_size)
    page_tables, slot_mappings = [], []
    for rows in tables:
        if rows is None:
            page_tables.append(None)
            slot_mappings.append(None)
            continue
        table = _page_table([rows_cache.row(row) for row in rows], needed_width)
        page_tables.append(table)
        slot_mappings.append(table[row_of_token, positions // page_size].astype(np.int64) * page_size
                             + positions % page_size)
    return StepInputs(chunks, num_decode, np.asarray(ids, dtype=np.int64), positions, query_starts,
                      start_positions, context_lengths, page_tables, slot_mappings, sampling_rows,
                      any(chunk.prompt_logprobs for chunk in chunks))


@dataclass
class PendingTokens:
    """The rows the step in flight sampled (overlapped engine loop), whose tokens are still on
    rank 0's device (its worker kept them): host data only.

    Row ``row``'s token stands as ``PENDING_TOKEN`` at the end of ``sequences[row]``'s
    ``token_ids``."""
    sequences: list  # the sampled sequences, in row order

    @cached_property
    def row_of(self) -> dict[int, int]:
        return {id(sequence): row for row, sequence in enumerate(self.sequences)}

    def rows(self, step: StepInputs) -> tuple[list[int], list[int]]:
        """``(targets, sources)``: input row ``targets[i]`` of ``step`` reads sampled row
        ``sources[i]`` (empty lists when the step reads none). Only a decode chunk reads a
        pending token: its one input (``targets`` ascend)."""
        targets = np.flatnonzero(step.input_ids[:step.num_decode] == PENDING_TOKEN).tolist()
        if not targets:
            return [], []
        row_of, chunks = self.row_of, step.chunks
        return targets, [row_of[id(chunks[row].sequence)] for row in targets]


def feed_pending(token_ids: torch.Tensor, targets: list[int],
                 sources: list[int]) -> Optional[Callable[[torch.Tensor], None]]:
    """A function writing sampled ``token_ids`` (on the device) into a step's device input ids:
    input row ``targets[i]`` gets ``token_ids[sources[i]]`` (None when no row reads one). Where
    the rows are every sampled row in order (a steady decode batch) it is one slice copy."""
    if not targets:
        return None
    count = len(targets)
    if count == token_ids.shape[0] and targets[-1] == count - 1 and sources == targets:  # (targets ascend)
        return lambda input_ids: input_ids[:count].copy_(token_ids)
    indices = to_device([targets, sources], token_ids.device, torch.long)
    return lambda input_ids: input_ids.index_copy_(0, indices[0], token_ids.index_select(0, indices[1]))


def as_decode_rows(step: StepInputs) -> StepInputs:
    """The step with each token as a row of its own (the rows the CUDA graphs replay): token
    ``t`` of a row starting at position ``s`` reads its row's page table up to position ``t``
    (context ``t + 1``) after the step has written every token's state, which is causal
    attention over the row. Valid only where state is kept per token (attention, MLA, indexer
    keys): a recurrent state advanced by one row would be read by the next."""
    if step.num_decode == step.num_tokens:
        return step
    lengths = np.diff(np.asarray(step.query_starts, dtype=np.int64))
    row_of_token = np.repeat(np.arange(len(lengths)), lengths)
    count = step.num_tokens
    positions = step.positions.tolist()
    return StepInputs(step.chunks, count, step.input_ids, step.positions, list(range(count + 1)), positions,
                      [position + 1 for position in positions],
                      [table[row_of_token] if table is not None else None for table in step.page_tables],
                      step.slot_mappings, step.sampling_rows, step.wants_prompt_logprobs)
