"""The model runner: turns a step's scheduled chunks into one flattened forward pass.

Owner of the model and the attention backend. It builds input ids, positions and per-group
attention metadata from the sequences' page tables (read, never modified), runs the model, and
returns the logits rows that the engine samples from, plus prompt logprobs where asked.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.protocol import PositionLogprobs
from tandem.kv.accessor import PendingLoads, StateAccessor
from tandem.kv.coordinator import StateCoordinator
from tandem.layers.attention import AttentionBackend, TorchAttentionBackend
from tandem.layers.attention_metadata import AttentionMetadata, DecodeBucket, PrefillSlice
from tandem.scheduler.scheduler import ScheduledChunk
from tandem.worker.forward_context import ForwardContext
from tandem.worker.sampler import compute_logprobs


@dataclass
class ExecuteResult:
    sampling_chunks: list[ScheduledChunk]  # in the order of ``logits`` rows
    logits: torch.Tensor  # [len(sampling_chunks), vocab] float32
    prompt_logprobs: dict[int, list[PositionLogprobs]]  # id(chunk) -> logprobs of its prompt tokens


class ModelRunner:
    def __init__(self, model: torch.nn.Module, coordinator: StateCoordinator, device: torch.device,
                 backend: AttentionBackend | None = None) -> None:
        self.model = model
        self.coordinator = coordinator
        self.device = device
        self.page_size = coordinator.page_size
        self.pending_loads = PendingLoads()
        self.accessor = StateAccessor(coordinator.registry, self.pending_loads)
        self.backend = backend or TorchAttentionBackend()
        # On CPU, buckets of similar lengths save gathered bytes; on a GPU every bucket costs
        # kernel launches in every layer, which outweighs the padding: one bucket there.
        self.decode_min_bucket = 8 if device.type == "cpu" else 1 << 30

    @staticmethod
    def order_chunks(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Single-token chunks first (the batched decode path) by context length, then the rest."""
        decodes = sorted((c for c in chunks if c.num_new_tokens == 1), key=lambda c: c.start)
        return decodes + [c for c in chunks if c.num_new_tokens > 1]

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> ExecuteResult:
        chunks = self.order_chunks(chunks)
        sanitizer = self.coordinator.sanitizer
        for chunk in chunks:
            sanitizer.check_owner(self.coordinator, chunk.sequence.state.owner,
                                  chunk.sequence.state.page_tables)
        input_ids, positions = self._inputs(chunks)
        metadata = [self._group_metadata(chunks, group_index, positions)
                    for group_index in range(self.coordinator.num_groups)]
        context = ForwardContext(self.accessor, metadata, self.backend)
        hidden = self.model(input_ids, positions, context)
        return self._outputs(chunks, hidden, sanitizer.enabled)

    def _inputs(self, chunks):
        ids, positions = [], []
        for chunk in chunks:
            end = chunk.start + chunk.num_new_tokens
            ids.extend(chunk.sequence.token_ids[chunk.start:end])
            positions.extend(range(chunk.start, end))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)
        return as_tensor(ids), as_tensor(positions)

    def _group_metadata(self, chunks, group_index: int, positions: torch.Tensor) -> AttentionMetadata:
        page_size = self.page_size
        tables = [chunk.sequence.state.page_tables[group_index] for chunk in chunks]
        context_lengths = [chunk.start + chunk.num_new_tokens for chunk in chunks]
        width = max(max(-(-length // page_size) for length in context_lengths), max(map(len, tables)))
        padded = [table[:width] + [0] * (width - len(table[:width])) for table in tables]
        table_tensor = torch.tensor(padded, dtype=torch.long, device=self.device)
        row_of_token = torch.repeat_interleave(
            torch.arange(len(chunks), device=self.device),
            torch.tensor([chunk.num_new_tokens for chunk in chunks], device=self.device))
        pages = table_tensor[row_of_token, positions // page_size]
        metadata = AttentionMetadata(page_size=page_size, slot_mapping=pages * page_size + positions % page_size,
                                     zero_invalid=self.coordinator.sanitizer.enabled)
        metadata.chunk_query_starts = [0]
        for chunk in chunks:
            metadata.chunk_query_starts.append(metadata.chunk_query_starts[-1] + chunk.num_new_tokens)
        metadata.chunk_start_positions = [chunk.start for chunk in chunks]
        metadata.page_table = table_tensor
        num_decode = sum(1 for chunk in chunks if chunk.num_new_tokens == 1)
        metadata.num_decode_tokens = num_decode
        for start, end in decode_bucket_bounds(context_lengths[:num_decode], min_bucket=self.decode_min_bucket):
            lengths = torch.tensor(context_lengths[start:end], device=self.device)
            width = -(-context_lengths[end - 1] // page_size)
            valid = torch.arange(width * page_size, device=self.device)[None, :] < lengths[:, None]
            metadata.decode_buckets.append(DecodeBucket(start, end, table_tensor[start:end, :width], valid,
                                                        lengths, context_lengths[start]))
        query_start = num_decode
        for chunk, length, row in zip(chunks[num_decode:], context_lengths[num_decode:],
                                      range(num_decode, len(chunks))):
            query_end = query_start + chunk.num_new_tokens
            metadata.prefills.append(PrefillSlice(query_start, query_end, length,
                                                  table_tensor[row, :-(-length // page_size)]))
            query_start = query_end
        return metadata

    def _outputs(self, chunks, hidden, check_finite: bool) -> ExecuteResult:
        sampling_rows, sampling_chunks, prompt_rows = [], [], {}
        row = 0
        for chunk in chunks:
            end = row + chunk.num_new_tokens
            if chunk.samples:
                sampling_rows.append(end - 1)
                sampling_chunks.append(chunk)
            if chunk.prompt_logprobs:
                prompt_rows[id(chunk)] = (chunk, row, end)
            row = end
        logits = self.model.compute_logits(hidden[sampling_rows]).float() if sampling_rows else \
            hidden.new_zeros((0, 0), dtype=torch.float32)
        if check_finite and not torch.isfinite(logits).all():
            from tandem.kv.block_pool import SanitizerError
            raise SanitizerError("non-finite logits: a forward pass read poisoned (freed) state")
        prompt_logprobs = {key: self._prompt_logprobs(hidden, *value) for key, value in prompt_rows.items()}
        return ExecuteResult(sampling_chunks, logits, prompt_logprobs)

    def _prompt_logprobs(self, hidden, chunk: ScheduledChunk, row_start: int, row_end: int):
        """Logprobs of prompt tokens ``start+1 .. min(end, prompt_len)-1`` from this chunk's rows."""
        sequence = chunk.sequence
        last_position = min(chunk.start + chunk.num_new_tokens, sequence.num_prompt_tokens - 1)
        count = last_position - chunk.start
        if count <= 0:
            return []
        logits = self.model.compute_logits(hidden[row_start:row_start + count]).float()
        targets = torch.tensor(sequence.token_ids[chunk.start + 1:chunk.start + 1 + count],
                               dtype=torch.long, device=logits.device)
        chosen, ranks, top_ids, top_logprobs = compute_logprobs(logits, targets, sequence.params.prompt_logprobs)
        return to_position_logprobs(targets, chosen, ranks, top_ids, top_logprobs)


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


def to_position_logprobs(token_ids, chosen, ranks, top_ids, top_logprobs) -> list[PositionLogprobs]:
    token_ids, chosen, ranks = token_ids.tolist(), chosen.tolist(), ranks.tolist()
    top_ids = top_ids.tolist() if top_ids is not None else [[] for _ in token_ids]
    top_logprobs = top_logprobs.tolist() if top_logprobs is not None else [[] for _ in token_ids]
    return [PositionLogprobs([token] + ids, [value] + values, rank)
            for token, value, rank, ids, values in zip(token_ids, chosen, ranks, top_ids, top_logprobs)]
