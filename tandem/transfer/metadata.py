"""The PD metadata rows: a fixed pool of byte rows, registered with the transfer backend.

The prefill server fills one of its own rows with what the decode server needs besides the pages
— the first token, its logprobs, the prefix-cache hit, a slot for a draft model's hidden states
and the room id — and writes it into the row the decode server reserved. The decode server copies
the row out (``read`` returns plain Python values, never a view: I4) before releasing it, and
checks the room id before committing.

Row layout (little endian)::

    room          16 bytes    the 128-bit room id
    first_token   int64
    cached_tokens int64       prompt tokens the prefill server had in its prefix cache
    rank          int64       rank of first_token in the raw distribution (0: no logprobs)
    num_logprobs  int64       entries below that are valid (first_token first, then the top-k)
    token_ids     int64[MAX_LOGPROB_ENTRIES]
    logprobs      float32[MAX_LOGPROB_ENTRIES]
    hidden_len    int64       valid floats below (0 until a draft model needs them)
    hidden        float32[hidden_size]

Owner: the PD side of one engine. ``allocate`` hands out a row; ``release`` returns it (and, in
sanitizer mode, poisons it so a stale read cannot pass the room check). The rows lie beside the
pages (host or device memory), so a transfer's last write carries pages and row together. In
device memory every row access runs on a stream of its own and is waited for: it never queues
behind the engine's forward passes, and it is complete before the row is sent or reused.
"""
from __future__ import annotations

import struct
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tandem.transfer.messages import room_from_bytes, room_to_bytes

MAX_LOGPROB_ENTRIES = 21  # the chosen token plus up to 20 top logprobs
POISON_BYTE = 0xA5
_HEADER = struct.Struct(f"<16sqqqq{MAX_LOGPROB_ENTRIES}q{MAX_LOGPROB_ENTRIES}fq")
# where ``prepare`` writes the fields the device computes (byte offsets in a row; see the layout)
_FIRST_TOKEN, _RANK, _TOKEN_IDS = 16, 32, 48
_LOGPROBS = _TOKEN_IDS + 8 * MAX_LOGPROB_ENTRIES


@dataclass(frozen=True)
class MetadataRow:
    room: str
    first_token: int
    num_cached_tokens: int = 0
    logprob_token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    rank: int = 0
    hidden_states: tuple[float, ...] = ()

    @property
    def has_logprobs(self) -> bool:
        return bool(self.logprob_token_ids)


class RowPoolExhausted(RuntimeError):
    pass


class MetadataBuffer:
    def __init__(self, num_rows: int, hidden_size: int = 0, device: torch.device | str = "cpu",
                 sanitize: bool = False) -> None:
        self.num_rows = num_rows
        self.hidden_size = hidden_size
        self.row_bytes = _HEADER.size + 4 * hidden_size
        self.sanitize = sanitize
        self.tensor = torch.zeros((num_rows, self.row_bytes), dtype=torch.uint8, device=device)
        self._free = list(range(num_rows - 1, -1, -1))
        self._stream = torch.cuda.Stream(self.tensor.device) if self.tensor.is_cuda else None
        # where ``write`` fills a row: the rows themselves in host memory; in device memory a pinned
        # host copy of them, so a row goes to the device as one DMA that only its stream waits for
        self._staging = torch.zeros((num_rows, self.row_bytes), dtype=torch.uint8, pin_memory=True) \
            if self.tensor.is_cuda else self.tensor
        self._staging_rows = self._staging.numpy()
        # device rows: each row's views and the event of its last copy (a row's copy is made once
        # per transfer, on its last write's path: what it needs is made here, not there)
        self._copies = [(self.tensor[row], self._staging[row], torch.cuda.Event()) for row in range(num_rows)] \
            if self._stream is not None else []

    def _access(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()

    def _finish(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def address(self, row: int) -> int:
        return self.tensor.data_ptr() + row * self.row_bytes

    def allocate(self) -> Optional[int]:
        return self._free.pop() if self._free else None

    def release(self, row: int) -> None:
        if row in self._free:
            raise RuntimeError(f"metadata row {row} released twice")
        if self.sanitize:
            if self._copies:  # (after the row's last copy, which may run on another stream: ``prepare``)
                self._stream.wait_event(self._copies[row][2])
            with self._access():
                self.tensor[row].fill_(POISON_BYTE)
            self._finish()
        self._free.append(row)

    def write(self, row: int, value: MetadataRow) -> None:
        """Fill ``row`` with ``value``; in device memory the row has landed on the device when
        this returns (a backend may send it at once)."""
        copied = self.stage(row, value)
        if copied is not None:
            copied.synchronize()

    def stage(self, row: int, value: MetadataRow) -> Optional[torch.cuda.Event]:
        """Fill ``row`` with ``value`` without waiting for the device. Host memory: done when this
        returns (None). Device memory: the row's copy from its pinned host row is queued on the
        rows' own stream (nothing else runs there), and the returned CUDA event follows it: a
        write that carries the row passes it as ``ready`` (``TransferBackend.write``), so the
        host never waits for the copy. The pinned row is refilled only once its last copy
        finished."""
        if self._copies:  # (a row never copied: its event was never recorded, nothing to wait for)
            self._copies[row][2].synchronize()  # (long finished in practice: the row's transfer ended since)
        entries = len(value.logprob_token_ids)
        if entries > MAX_LOGPROB_ENTRIES or len(value.logprobs) != entries:
            raise ValueError(f"metadata row: {entries} logprob entries (at most {MAX_LOGPROB_ENTRIES})")
        hidden_count = len(value.hidden_states)
        if hidden_count > self.hidden_size:
            raise ValueError(f"metadata row: {hidden_count} hidden values, slot holds {self.hidden_size}")
        pad = MAX_LOGPROB_ENTRIES - entries
        staged = self._staging_rows[row]
        _HEADER.pack_into(staged, 0, room_to_bytes(value.room), value.first_token, value.num_cached_tokens, value.rank,
                          entries, *value.logprob_token_ids, *([0] * pad), *value.logprobs, *([0.0] * pad),
                          hidden_count)
        if self.hidden_size:  # (the slot is thousands of floats: written as an array, not packed)
            hidden = staged[_HEADER.size:].view("<f4")
            hidden[:hidden_count] = value.hidden_states
            hidden[hidden_count:] = 0.0
        if self._stream is None:
            return None
        destination, source, copied = self._copies[row]
        with self._access():
            destination.copy_(source, non_blocking=True)
            copied.record(self._stream)
        return copied

    def prepare(self, row: int, value: MetadataRow, token: torch.Tensor,
                logprobs: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
                ) -> Optional[torch.cuda.Event]:
        """Fill ``row`` with ``value`` ahead of its first token, which the device is still
        computing: ``token`` (one integer) and, where the row carries logprobs, ``logprobs`` =
        (entries' token ids, their logprobs, the token's rank), on the rows' device. The row is
        filled as ``stage`` fills it (``value``'s first token, entries and rank are placeholders;
        its entry count is the one kept), then those tensors are copied into it in the order of
        the current stream, where the sampler produced them. Nothing waits for the device. The
        returned CUDA event (None in host memory: done) follows every copy; a write that carries
        the row passes it as ``ready``. So the last write's path, once the token is known on the
        host, has no row to fill."""
        static = self.stage(row, value)
        fields = [(_FIRST_TOKEN, token, torch.int64)]
        if logprobs is not None:
            token_ids, values, rank = logprobs
            fields += [(_RANK, rank, torch.int64), (_TOKEN_IDS, token_ids, torch.int64),
                       (_LOGPROBS, values, torch.float32)]
        stream = torch.cuda.current_stream(self.tensor.device) if static is not None else None
        if stream is not None:
            stream.wait_event(static)  # (the row's bytes land before the device's fields do)
        for offset, field_values, dtype in fields:
            # (a dense copy in the row's type first: the source may be a strided column of another type)
            data = field_values.new_empty(field_values.numel(), dtype=dtype).copy_(field_values.reshape(-1))
            data = data.view(torch.uint8)
            self.tensor[row, offset:offset + data.numel()].copy_(data, non_blocking=stream is not None)
        if stream is None:
            return None
        static.record(stream)  # the row's last copy (``stage`` waits for it before refilling the row)
        return static

    def settled(self, row: int) -> MetadataRow:
        """What ``row`` holds once its copies finished (read back: a check, not a path)."""
        if self._copies:
            self._copies[row][2].synchronize()
        return self.read(row)

    def read(self, row: int) -> MetadataRow:
        """Copy the row out and decode it (plain values: nothing refers to the row afterwards)."""
        with self._access():
            data = self.tensor[row].cpu().numpy().tobytes()
        fields = _HEADER.unpack_from(data)
        room, first_token, cached, rank, entries = fields[:5]
        token_ids = fields[5:5 + MAX_LOGPROB_ENTRIES]
        logprobs = fields[5 + MAX_LOGPROB_ENTRIES:5 + 2 * MAX_LOGPROB_ENTRIES]
        hidden_len = fields[-1]
        entries = max(0, min(entries, MAX_LOGPROB_ENTRIES))
        hidden_len = max(0, min(hidden_len, self.hidden_size))
        hidden = np.frombuffer(data, dtype="<f4", count=hidden_len, offset=_HEADER.size).tolist()
        return MetadataRow(room=room_from_bytes(room), first_token=first_token, num_cached_tokens=cached,
                           logprob_token_ids=tuple(token_ids[:entries]), logprobs=tuple(logprobs[:entries]),
                           rank=rank, hidden_states=tuple(hidden))
