"""The tier mover: copies pages of every registry buffer between the device pools and the host
tier's blocks, on the tier stream.

It knows groups, pages and byte ranges only (docs/design.md, state system point 4): a group's host
block is its buffers' pages one after another (``GroupLayout``); buffers that continue on both
sides (a page-major device pool) move in one copy (``Span``). Saves (device → host) go in one
submission; loads (host → device) go layer by layer in the model's order, each layer's
completion registered with ``PendingLoads`` so that the layer's first read waits for exactly its
own copy (I3) while later layers are still loading. ``touched`` records the buffers moved (I1).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tandem.kernels.page_copy import copy_pages, copy_pages_reference
from tandem.kv.accessor import PendingLoads
from tandem.kv.page_operations import PageMove
from tandem.kv.registry import StateRegistry
from tandem.kv.tiers.copy_stream import Ticket, TierStream
from tandem.kv.tiers.host_pool import HostPages, Span

logger = logging.getLogger(__name__)


@dataclass
class Transfer:
    """One save or load: its last ticket, bytes, and when it was issued (for bandwidth)."""
    ticket: Ticket
    num_bytes: int
    direction: str  # "d2h" or "h2d"
    started: float
    start_event: object = None

    def seconds(self) -> float:
        """Seconds the transfer took (device events on CUDA; host wall time otherwise)."""
        end = getattr(self.ticket, "event", None)
        if self.start_event is not None and end is not None:
            return self.start_event.elapsed_time(end) / 1e3
        return time.perf_counter() - self.started


class TierMover:
    def __init__(self, registry: StateRegistry, host: HostPages, stream: TierStream, device: torch.device) -> None:
        self.registry = registry
        self.host = host
        self.stream = stream
        self.device = device
        self.use_kernel = device.type == "cuda"
        self.touched: set[tuple[int, str, str]] = set()

    # -- one buffer's pages ------------------------------------------------------------------
    def _indices(self, move: PageMove) -> torch.Tensor:
        """``[device pages, host pages]`` where the copy runs (one upload per move)."""
        index = torch.tensor([move.device_pages, move.host_pages], dtype=torch.long)
        if self.device.type != "cuda":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def _copy(self, source: torch.Tensor, destination: torch.Tensor, source_pages: torch.Tensor,
              destination_pages: torch.Tensor, source_offset: int, destination_offset: int, width: int) -> None:
        if self.device.type != "cuda":
            copy_pages_reference(source, destination, source_pages, destination_pages,
                                 source_offset, destination_offset, width)
            return
        if self.use_kernel:
            try:
                copy_pages(source, destination, source_pages, destination_pages, source_offset,
                           destination_offset, width)
                return
            except (RuntimeError, ValueError) as error:  # the kernel cannot address host memory here
                logger.warning("page-copy kernel unavailable (%s); tier copies fall back to one copy "
                               "per page", error)
                self.use_kernel = False
        for source_page, destination_page in zip(source_pages.tolist(), destination_pages.tolist()):
            destination[destination_page, destination_offset:destination_offset + width].copy_(
                source[source_page, source_offset:source_offset + width], non_blocking=True)

    def _save_span(self, span: Span, move: PageMove, index: torch.Tensor) -> None:
        self._copy(span.device_rows(), self.host.arrays[move.group], index[0], index[1], 0, span.offset, span.width)
        self.touched.update(segment.descriptor.key for segment in span.segments)

    def _load_span(self, span: Span, move: PageMove, index: torch.Tensor) -> None:
        self._copy(self.host.arrays[move.group], span.device_rows(), index[1], index[0], span.offset, 0, span.width)
        self.touched.update(segment.descriptor.key for segment in span.segments)

    def _bytes(self, moves: list[PageMove]) -> int:
        return sum(len(move.device_pages) * self.host.layouts[move.group].block_bytes for move in moves)

    # -- saves and loads -----------------------------------------------------------------------
    def save(self, moves: list[PageMove]) -> Transfer:
        """Device → host, every buffer of each move's group, in one submission."""
        moves = [move for move in moves if move.device_pages]
        start = self._start_event()

        def work() -> None:
            for move in moves:
                index = self._indices(move)
                for span in self.host.layouts[move.group].spans():
                    self._save_span(span, move, index)

        return Transfer(self.stream.submit(work), self._bytes(moves), "d2h", time.perf_counter(), start)

    def load(self, moves: list[PageMove], pending: PendingLoads) -> Transfer:
        """Host → device, one submission per layer in the model's order; each layer's ticket
        is registered with ``pending`` under the layer's name."""
        moves = [move for move in moves if move.device_pages]
        by_group = {move.group: move for move in moves}
        indices: dict[int, torch.Tensor] = {}
        start = self._start_event()
        ticket = None
        for layer_name in self.registry.layer_names():
            move = by_group.get(self.registry.group_of(layer_name))
            if move is None:
                continue
            spans = self.host.layouts[move.group].layer_spans(layer_name)

            def work(spans=spans, move=move) -> None:
                if move.group not in indices:  # uploaded once, on the tier stream
                    indices[move.group] = self._indices(move)
                for span in spans:
                    self._load_span(span, move, indices[move.group])

            ticket = self.stream.submit(work)
            pending.add(layer_name, ticket.order_reader)
        if ticket is None:
            ticket = self.stream.submit(lambda: None)
        return Transfer(ticket, self._bytes(moves), "h2d", time.perf_counter(), start)

    def _start_event(self):
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        self.stream.record_start(event)
        return event
