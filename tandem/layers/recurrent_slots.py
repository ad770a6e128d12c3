"""The state front of a recurrent layer: runs its recurrence (``recurrent.py``) over a step's
batch, reading and writing the layer's slots (``conv``, ``ssm``) through the accessor (I3).

A sequence's page table in a recurrent group is ``[working]`` or ``[working, checkpoint]`` (see
``kv/managers/recurrent.py``). Rows of a step (decode rows first, by start position)::

    | decode rows, fresh | decode rows, continuing          | prefill chunks ...          |
    0            num_fresh_decode_rows              num_decode_tokens               rows
      scanned one by one   one batched step, on the device    scanned one by one

- **Continuing decode rows** (one token, state already in the working slot) go through one
  batched step whose slots, checkpoint decisions and padding come from the device tensors
  (``page_table``, ``context_lengths``): no host synchronisation and shapes that depend on the
  row count only, so a decode step replays in a CUDA graph. A row of length 0 is graph padding:
  it reads the null page and writes nothing. Where the token completes a page
  (``context_length % page_size == 0``) and the row has a checkpoint slot, the new state is
  written there too.
- **Scans** (prefill chunks and first tokens) run eagerly, one chunk at a time, from zeros or
  from the working slot, with slot ids from the host's copy of the page table. A chunk crossing
  a page boundary also writes the state at the last boundary it crosses to its checkpoint slot::

      chunk:      start ........ b ...... end        b = the last multiple of page_size <= end
      scan:       [start, b) -> state_b -> [b, end)  state_b also goes to the checkpoint slot

The null page (slot 0) is never written: a row with no slot (the start-up warm-up, graph
padding) leaves every slot as it was.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

from tandem.kv.planner import NULL_PAGE
from tandem.kv.spec import RecurrentSpec
from tandem.layers.attention_metadata import AttentionMetadata
from tandem.layers.recurrent import causal_conv1d_scan, causal_conv1d_step

if TYPE_CHECKING:
    from tandem.layers.forward_context import ForwardContext

WORKING_COLUMN, CHECKPOINT_COLUMN = 0, 1

ScanFn = Callable[[torch.Tensor, tuple, Optional[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
StepFn = Callable[[torch.Tensor, tuple, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Scan:
    query_start: int
    query_end: int
    slot: int
    fresh: bool
    checkpoint_slot: int  # 0: none
    checkpoint_offset: int  # tokens of the chunk before the checkpoint boundary (0: none)


def _scans(metadata: AttentionMetadata) -> list[_Scan]:
    """The chunks scanned one at a time (fresh decode rows and prefill chunks), with their slots
    from the host's page table."""
    rows = [*range(metadata.num_fresh_decode_rows), *range(metadata.num_decode_tokens, metadata.num_rows)]
    if not rows:
        return []
    table = metadata.host_page_table
    if table is None:
        raise ValueError("recurrent layer: a step with chunks to scan needs the host's page table")
    page_size, scans = metadata.page_size, []
    for row in rows:
        start = metadata.chunk_start_positions[row]
        query_start, query_end = metadata.chunk_query_starts[row:row + 2]
        slot = int(table[row, WORKING_COLUMN])
        checkpoint = int(table[row, CHECKPOINT_COLUMN]) if table.shape[1] > CHECKPOINT_COLUMN else NULL_PAGE
        boundary = (start + query_end - query_start) // page_size * page_size
        offset = boundary - start if checkpoint != NULL_PAGE and boundary > start else 0
        scans.append(_Scan(query_start, query_end, slot, start == 0, checkpoint if offset else NULL_PAGE, offset))
    return scans


def write_slot_rows(buffer: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor, use_kernels: bool) -> None:
    """``buffer[targets[i]] = rows[i]`` where ``targets[i] >= 0`` (-1: skipped), without host
    synchronisation. With ``use_kernels`` through the row-writer kernel (nothing is written for a
    skipped row); otherwise a skipped row rewrites the null page with its own contents."""
    rows = rows.to(buffer.dtype)
    if use_kernels:
        from tandem.kernels.token_write import write_token_rows

        write_token_rows(rows.reshape(rows.shape[0], -1), buffer.view(buffer.shape[0], 1, -1), targets)
        return
    safe = targets.clamp(min=NULL_PAGE)
    kept = (targets >= 0).view(-1, *[1] * (rows.dim() - 1))
    buffer.index_copy_(0, safe, torch.where(kept, rows, buffer.index_select(0, safe)))


class RecurrentSlots:
    """The state front of one recurrent layer: declares its spec and runs the recurrence over a
    step's batch (see the module docstring). ``use_kernels`` (None: on CUDA) writes slots with
    the row-writer kernel."""

    def __init__(self, layer_name: str, spec: RecurrentSpec, conv: torch.nn.Conv1d) -> None:
        self.layer_name = layer_name
        self.state_spec = spec
        self._conv = conv  # the layer's depthwise conv (weight [C, 1, K]); not owned here
        self.use_kernels: Optional[bool] = None

    @property
    def _conv_weight(self) -> torch.Tensor:
        return self._conv.weight.squeeze(1)

    @property
    def _conv_bias(self) -> Optional[torch.Tensor]:
        return self._conv.bias

    def run(self, conv_inputs: torch.Tensor, extras: tuple, context: "ForwardContext",
            scan: ScanFn, step: StepFn) -> torch.Tensor:
        """``conv_inputs [T, C]`` go through the causal conv; ``scan(conv_out, extras, state)``
        and ``step(conv_out, extras, states)`` run the recurrence on the conv outputs (``extras``:
        per-token tensors, sliced alike). Returns the recurrence outputs, token-major."""
        buffers = context.state.layer(self.layer_name)
        conv_buffer, ssm_buffer = buffers["conv"], buffers["ssm"]
        metadata = context.attention_metadata[context.state.group_of(self.layer_name)]
        first, end = metadata.num_fresh_decode_rows, metadata.num_decode_tokens
        scans = _scans(metadata)
        pieces: list[tuple[int, int, torch.Tensor]] = []  # (first token, end token, rows)
        if end > first:
            rows = self._step(conv_inputs[first:end], tuple(x[first:end] for x in extras), metadata, first, end,
                              conv_buffer, ssm_buffer, step)
            if not scans:
                return rows  # a step of decode rows only (every CUDA graph's)
            pieces.append((first, end, rows))
        for chunk in scans:
            pieces.append((chunk.query_start, chunk.query_end,
                           self._scan(conv_inputs, extras, chunk, conv_buffer, ssm_buffer, scan)))
        dtype = pieces[0][2].dtype
        for _, _, rows in pieces:
            dtype = torch.promote_types(dtype, rows.dtype)
        result = pieces[0][2].new_empty((conv_inputs.shape[0], *pieces[0][2].shape[1:]), dtype=dtype)
        for begin, stop, rows in pieces:
            result[begin:stop] = rows.to(dtype)
        return result

    def _step(self, conv_inputs, extras, metadata: AttentionMetadata, first: int, end: int,
              conv_buffer, ssm_buffer, step) -> torch.Tensor:
        """Decode rows ``first .. end`` (tokens likewise) in one batch, driven by device tensors."""
        use_kernels = conv_inputs.is_cuda if self.use_kernels is None else self.use_kernels
        table = metadata.page_table[first:end]
        lengths = metadata.context_lengths[first:end]
        live = lengths > 0
        slots = torch.where(live, table[:, WORKING_COLUMN].long(), NULL_PAGE)
        conv_states, ssm_states = conv_buffer.index_select(0, slots), ssm_buffer.index_select(0, slots)
        conv_out, conv_states = causal_conv1d_step(conv_inputs, conv_states, self._conv_weight, self._conv_bias)
        rows, ssm_states = step(conv_out, extras, ssm_states)
        working = torch.where(live, slots, -1)
        write_slot_rows(conv_buffer, working, conv_states, use_kernels)
        write_slot_rows(ssm_buffer, working, ssm_states, use_kernels)
        if table.shape[1] > CHECKPOINT_COLUMN:
            checkpoint = table[:, CHECKPOINT_COLUMN].long()
            completes_page = live & (lengths % metadata.page_size == 0) & (checkpoint != NULL_PAGE)
            targets = torch.where(completes_page, checkpoint, -1)
            write_slot_rows(conv_buffer, targets, conv_states, use_kernels)
            write_slot_rows(ssm_buffer, targets, ssm_states, use_kernels)
        return rows

    def _scan(self, conv_inputs, extras, chunk: _Scan, conv_buffer, ssm_buffer, scan):
        begin, end = chunk.query_start, chunk.query_end
        if chunk.fresh:
            conv_state = conv_buffer.new_zeros(conv_buffer.shape[1:])
            ssm_state = None
        else:
            conv_state, ssm_state = conv_buffer[chunk.slot], ssm_buffer[chunk.slot]
        conv_out, history = causal_conv1d_scan(conv_inputs[begin:end], conv_state,
                                               self._conv_weight, self._conv_bias)
        window = history.shape[-1] - (end - begin)
        pieces = []
        split = chunk.checkpoint_offset
        for piece_start, piece_end in ((0, split), (split, end - begin)):
            if piece_end <= piece_start:
                continue
            rows, ssm_state = scan(conv_out[piece_start:piece_end],
                                   tuple(x[begin + piece_start:begin + piece_end] for x in extras), ssm_state)
            pieces.append(rows)
            if piece_end == split:
                self._write(conv_buffer, ssm_buffer, chunk.checkpoint_slot,
                            history[:, split:split + window], ssm_state)
        self._write(conv_buffer, ssm_buffer, chunk.slot, history[:, history.shape[-1] - window:], ssm_state)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    @staticmethod
    def _write(conv_buffer, ssm_buffer, slot: int, conv_state, ssm_state) -> None:
        if slot == NULL_PAGE:
            return  # no slot: the warm-up's rows
        conv_buffer[slot].copy_(conv_state)
        ssm_buffer[slot].copy_(ssm_state)
