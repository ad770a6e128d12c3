"""Prefill/decode disaggregation inside one engine: the prefill side and the decode side.

Owner: ``EngineCore`` builds one ``PrefillSide`` or ``DecodeSide`` when its config has a
``transfer`` section, and calls it at fixed points of a step (``poll`` first, ``after_computed``
after each chunk, ``filter_deltas`` after sampling) and on aborts. Both sides own a transfer
backend with every registry buffer and the metadata rows registered, and a control channel.

A request's two legs meet in a room (its 128-bit id)::

    prefill engine                                         decode engine
    ---------------                                        -------------
    request (max_tokens 1), held            Hello/Reply    request held; link to the prefill
                                          <------------->  engine (handshake: layouts equal)
                                            Destination    admitted when it can finish: pages
    scheduled once the destination is known <------------  for every group + a metadata row
    after each chunk: its final pages -----  page writes  ---> (whole pages, coalesced)
      (source pages held in flight: I2)
    first token sampled, writes drained:
      metadata row (token, logprobs, room) - row write + notification "done:<room>" -->
                                                           row copied out (I4), room checked,
    held delta released                                    commit: computed = prompt length,
                                                           first token appended, decodes on

Failure and abort travel both ways (``TransferFailed``/``Drained`` to the decode side,
``AbortTransfer`` to the prefill side). Lifetimes:

* prefill: each write holds its source pages in flight until the backend reports it done or
  failed (or, after ``drain_timeout``, cancelled); then, if the decode side waits for it,
  ``Drained`` is sent.
* decode: destination pages stay with the request until committed. A failed or aborted transfer
  moves them to an in-flight hold released only on ``Drained``/``TransferFailed(drained)``, or
  once the prefill engine is declared dead (no heartbeat for ``peer_timeout``). Freed pages are
  poisoned in sanitizer mode (the block pool's on-free hook).

Nothing here knows model families: pages come from the coordinator (``final_page_indices``,
answered by the managers) and bytes from the registry (``transfer/descriptors.py``).
"""
from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from tandem.engine.protocol import (
    HistogramSnapshot,
    PositionLogprobs,
    RequestDelta,
    TransferEndpoint,
    TransferParams,
    TransferStats,
)
from tandem.kv.planner import NULL_PAGE
from tandem.scheduler.sequence import Sequence
from tandem.transfer.config import TransferConfig, failure_seed_from_environment
from tandem.transfer.connector import TransferBackend, WriteHandle, WriteStatus, create_backend
from tandem.transfer.control import ControlChannel
from tandem.transfer.descriptors import buffer_regions, describe_layout, plan_page_writes, tensor_region
from tandem.transfer.messages import (
    AbortTransfer,
    Destination,
    Drained,
    Heartbeat,
    Hello,
    HelloReply,
    TransferFailed,
    check_room,
    done_notification,
    first_difference,
    room_of_notification,
)
from tandem.transfer.metadata import MetadataBuffer, MetadataRow
from tandem.transfer.state import TransferState, TransferStatus

logger = logging.getLogger("tandem.pd")

SIZE_BUCKETS = tuple(float(1 << shift) for shift in range(12, 33, 2))  # 4 KiB .. 4 GiB
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BANDWIDTH_BUCKETS = (1e6, 1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 5e10, 1e11)
ACTIVE_POLL_MILLISECONDS = 1  # while writes or notifications are awaited
IDLE_TICK_MILLISECONDS = 50  # otherwise (heartbeats, timeouts)
EXTRA_METADATA_ROWS = 16


def create_pd(core, config: TransferConfig) -> "PDSide":
    return (PrefillSide if config.role == "prefill" else DecodeSide)(core, config)


class Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        self.counts[index] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        cumulative, running = [], 0
        for count in self.counts:
            running += count
            cumulative.append(running)
        return HistogramSnapshot(bounds=list(self.bounds), counts=cumulative, total=self.total)


@dataclass
class PendingWrite:
    """A posted write and the in-flight reference holding its source pages (None for the row)."""
    handle: WriteHandle
    owner: Optional[str]


def model_dimensions(core) -> dict[str, int]:
    info = core.model_info
    return {"vocab_size": int(info.vocab_size), "hidden_size": int(info.hidden_size),
            "num_state_layers": sum(len(group.layer_names) for group in core.registry.groups)}


class PDSide:
    """What both sides share: backend, control channel, metadata rows, metrics."""

    role = ""

    def __init__(self, core, config: TransferConfig) -> None:
        self.core = core
        self.config = config
        self.coordinator = core.coordinator
        self.scheduler = core.scheduler
        self.registry = core.registry
        self.engine_id = f"tandem-{config.role}-{uuid.uuid4().hex[:16]}"
        self.metadata = MetadataBuffer(core.config.max_num_seqs + EXTRA_METADATA_ROWS,
                                       hidden_size=int(core.model_info.hidden_size),
                                       sanitize=core.config.sanitizer_on)
        self.backend: TransferBackend = create_backend(config.backend, self.engine_id,
                                                       failure_probability=config.injected_failure_probability,
                                                       seed=failure_seed_from_environment(),
                                                       progress_thread=config.progress_thread)
        regions = buffer_regions(self.registry)
        self.device_index = regions[0].device if regions else -1
        self.backend.register(regions + [tensor_region(self.metadata.tensor)])
        self.layout = describe_layout(self.registry, architecture=core.model_info.architecture,
                                      model=model_dimensions(core), page_size=self.coordinator.page_size,
                                      metadata_row_bytes=self.metadata.row_bytes)
        self.channel = ControlChannel(self.engine_id, config.bootstrap_address)
        self.outbox: list[RequestDelta] = []
        self.outcomes: dict[str, int] = {"done": 0, "failed": 0, "aborted": 0}
        self.bytes_total = 0
        self.sizes = Histogram(SIZE_BUCKETS)
        self.durations = Histogram(DURATION_BUCKETS)
        self.bandwidths = Histogram(BANDWIDTH_BUCKETS)
        self._stats_version = 0
        self._stats_cache: Optional[tuple[int, tuple, TransferStats]] = None
        self.last_poll = time.monotonic()
        self.stalled_batch = False  # the messages being handled queued up during a stall
        self.num_held_back = 0
        logger.info("PD %s engine %s: control channel %s, backend %s, %d state buffers",
                    config.role, self.engine_id, self.channel.address, config.backend, len(self.layout.buffers))

    # -- what the engine core calls -----------------------------------------------------------------
    def endpoint(self) -> TransferEndpoint:
        return TransferEndpoint(role=self.config.role, backend=self.config.backend,
                                bootstrap_address=self.channel.address, layout=self.layout)

    def has_work(self) -> bool:
        """Always: heartbeats and timeouts need the loop to come by."""
        return True

    def wakeup_sockets(self) -> list:
        return self.channel.sockets()

    def idle_wait_milliseconds(self) -> int:
        if self.scheduler.has_runnable():
            return 0
        return ACTIVE_POLL_MILLISECONDS if self.awaiting_backend() else IDLE_TICK_MILLISECONDS

    def poll(self) -> list[RequestDelta]:
        now = time.monotonic()
        stall = now - self.last_poll
        self.last_poll = now
        if stall > self.config.peer_timeout:
            self.after_stall(stall)
        for identity, address, message in self.channel.receive():
            self.handle(identity, address, message, now)
        self.stalled_batch = False
        self.progress(now)
        self.check_timeouts(now)
        deltas, self.outbox = self.outbox, []
        return deltas

    def after_computed(self, chunk) -> None:
        pass

    def filter_deltas(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        return deltas

    def close(self) -> None:
        try:
            self.backend.close()
        finally:
            self.channel.close()

    # -- per side ---------------------------------------------------------------------------------------
    def add(self, sequence: Sequence, params: TransferParams) -> None:
        raise NotImplementedError

    def on_abort_request(self, request_id: str) -> None:
        raise NotImplementedError

    def handle(self, identity, address, message, now: float) -> None:
        raise NotImplementedError

    def progress(self, now: float) -> None:
        pass

    def after_stall(self, seconds: float) -> None:
        """This engine did not poll for longer than ``peer_timeout`` (a long step, a pause): its
        peers may have declared it dead and released what they held for it."""
        logger.warning("PD: this engine stalled for %.1f s (peer_timeout %.1f s)", seconds, self.config.peer_timeout)

    def check_timeouts(self, now: float) -> None:
        pass

    def awaiting_backend(self) -> bool:
        return False

    def busy(self) -> bool:
        """Transfers or in-flight holds are live (the engine is not idle)."""
        raise NotImplementedError

    def queue_lengths(self) -> dict[str, int]:
        raise NotImplementedError

    # -- metrics ----------------------------------------------------------------------------------------
    def record(self, outcome: str, num_bytes: int = 0, seconds: float = 0.0, bandwidth: bool = False) -> None:
        """Count a transfer's outcome; for a done one its bytes and duration, and (on the side
        that writes, timing its writes only) its bandwidth."""
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome == "done":
            self.bytes_total += num_bytes
            self.sizes.observe(num_bytes)
            self.durations.observe(seconds)
            if bandwidth and seconds > 0:
                self.bandwidths.observe(num_bytes / seconds)
        self._stats_version += 1

    def stats(self) -> TransferStats:
        queues = self.queue_lengths()
        key = tuple(sorted(queues.items()))
        if self._stats_cache is None or self._stats_cache[:2] != (self._stats_version, key):
            stats = TransferStats(role=self.config.role, outcomes=dict(self.outcomes), bytes_total=self.bytes_total,
                                  size_bytes=self.sizes.snapshot(), duration_seconds=self.durations.snapshot(),
                                  bandwidth_bytes_per_second=self.bandwidths.snapshot(), queues=queues,
                                  num_held_back=self.num_held_back)
            self._stats_cache = (self._stats_version, key, stats)
        return self._stats_cache[2]

    # -- shared helpers ---------------------------------------------------------------------------------
    def finish_sequence(self, sequence: Sequence, reason: str = "error") -> None:
        """End the sequence and release its references (pages held in flight stay)."""
        if not sequence.is_finished:
            self.scheduler.finish(sequence, reason)
        self.core._forget_if_done(sequence.request_id)

    def error_delta(self, sequence: Sequence, reason: str) -> RequestDelta:
        return RequestDelta(request_id=sequence.request_id, index=sequence.index, finish_reason="error",
                            error=reason, num_prompt_tokens=sequence.num_prompt_tokens)


# =====================================================================================================
# Prefill side
# =====================================================================================================


@dataclass
class DecodePeer:
    """A decode engine that said hello: where its pages and metadata rows are."""
    identity: str
    agent: str
    addresses: list[int]
    device: int
    metadata_address: int
    row_bytes: int
    num_rows: int
    last_seen: float
    dead: bool = False


@dataclass(eq=False)
class PrefillTransfer:
    room: str
    sequence: Sequence
    status: TransferStatus
    created: float
    peer: Optional[DecodePeer] = None
    destination: Optional[Destination] = None
    sent: list[set[int]] = field(default_factory=list)
    writes: list[PendingWrite] = field(default_factory=list)
    metadata_write: Optional[PendingWrite] = None
    local_row: Optional[int] = None
    first_delta: Optional[RequestDelta] = None
    bound_at: float = 0.0
    first_write_at: float = 0.0
    ended_at: float = 0.0
    bytes_written: int = 0
    num_writes: int = 0
    notify_drained: bool = False  # the decode side waits for Drained once writes resolve
    suppress_delta: bool = False  # the frontend aborted the request: no delta goes out

    @property
    def outstanding(self) -> bool:
        return bool(self.writes) or self.metadata_write is not None


class PrefillSide(PDSide):
    role = "prefill"

    def __init__(self, core, config: TransferConfig) -> None:
        super().__init__(core, config)
        self.transfers: dict[str, PrefillTransfer] = {}  # room -> transfer, until drained
        self.by_request: dict[str, PrefillTransfer] = {}
        self.peers: dict[str, DecodePeer] = {}
        self.early_destinations: dict[str, tuple[str, Destination, float]] = {}  # room -> (peer, message, time)
        self.aborted_rooms: dict[str, float] = {}  # rooms the decode side aborted before the request came
        self.touched: set[tuple[int, str, str]] = set()  # registry buffers written so far (I1 tests)

    # -- requests -----------------------------------------------------------------------------------------
    def add(self, sequence: Sequence, params: TransferParams) -> None:
        room = check_room(params.room)
        if room in self.transfers:
            raise ValueError(f"kv_transfer_params: room {room} is already in use on this prefill server")
        sequence.max_tokens = 1  # the prefill leg computes the prompt and samples the first token
        transfer = PrefillTransfer(room=room, sequence=sequence, status=TransferStatus(room), created=time.monotonic(),
                                   sent=[set() for _ in range(self.coordinator.num_groups)])
        self.transfers[room] = transfer
        self.by_request[sequence.request_id] = transfer
        self.scheduler.add_remote(sequence)
        if room in self.aborted_rooms:
            del self.aborted_rooms[room]
            self.end(transfer, TransferState.ABORTED, "the decode server aborted this request")
            transfer.notify_drained = False
            return
        early = self.early_destinations.pop(room, None)
        if early is not None:
            self.bind(transfer, early[0], early[1])

    def on_abort_request(self, request_id: str) -> None:
        transfer = self.by_request.get(request_id)
        if transfer is not None and not transfer.status.terminal:
            transfer.suppress_delta = True
            self.end(transfer, TransferState.ABORTED, "the request was aborted on the prefill server")

    def after_stall(self, seconds: float) -> None:
        """A decode engine that heard nothing from us for ``peer_timeout`` has released the
        destination pages of our transfers: writing them now could land in another request's
        pages. Fail every bound transfer, and refuse destinations that queued up meanwhile."""
        super().after_stall(seconds)
        reason = (f"the prefill engine stalled for {seconds:.1f} s, longer than peer_timeout "
                  f"({self.config.peer_timeout:g} s); its decode peer has given up")
        for transfer in list(self.transfers.values()):
            if transfer.peer is not None and not transfer.status.terminal:
                self.end(transfer, TransferState.FAILED, reason)
        self.stalled_batch = True

    def stalled(self) -> bool:
        """Checked right before any write: a step that ran past peer_timeout may have outlived
        the decode side's patience."""
        seconds = time.monotonic() - self.last_poll
        if seconds > self.config.peer_timeout:
            self.after_stall(seconds)
            self.stalled_batch = False
            return True
        return False

    # -- control messages ---------------------------------------------------------------------------------
    def handle(self, identity, address, message, now: float) -> None:
        if identity is None:
            return
        peer = self.peers.get(identity)
        if peer is not None:
            peer.last_seen = now
            peer.dead = False
        if isinstance(message, Hello):
            self.on_hello(identity, message, now)
        elif isinstance(message, Heartbeat):
            if peer is None:
                self.channel.send_to_identity(identity, HelloReply(sender=self.engine_id, accepted=False,
                                                                   error="unknown peer: say hello first"))
            else:
                self.channel.send_to_identity(identity, Heartbeat(sender=self.engine_id))
        elif isinstance(message, Destination):
            self.on_destination(identity, message, now)
        elif isinstance(message, AbortTransfer):
            self.on_abort_transfer(identity, message, now)

    def on_hello(self, identity: str, hello: Hello, now: float) -> None:
        difference = first_difference(self.layout, hello.layout, "the prefill server", "the decode server")
        if difference is None and hello.backend != self.config.backend:
            difference = (f"transfer backend: the prefill server uses {self.config.backend!r}, "
                          f"the decode server {hello.backend!r}")
        if difference is not None:
            error = f"PD handshake failed: {difference}"
            logger.error("%s (decode engine %s)", error, identity)
            self.channel.send_to_identity(identity, HelloReply(sender=self.engine_id, accepted=False, error=error,
                                                               layout=self.layout))
            return
        existing = self.peers.get(identity)
        if existing is not None:  # the same engine reconnected (its memory is where it was)
            existing.last_seen, existing.dead = now, False
            self.channel.send_to_identity(identity, HelloReply(sender=self.engine_id, accepted=True,
                                                               layout=self.layout))
            return
        try:
            agent = self.backend.add_peer(hello.backend_metadata)
        except Exception as error:  # noqa: BLE001
            self.channel.send_to_identity(identity, HelloReply(
                sender=self.engine_id, accepted=False, error=f"PD handshake failed: cannot load the decode "
                                                             f"engine's transfer metadata: {error}"))
            return
        self.peers[identity] = DecodePeer(identity=identity, agent=agent, addresses=list(hello.buffer_addresses),
                                          device=hello.device, metadata_address=hello.metadata_address,
                                          row_bytes=hello.layout.metadata_row_bytes,
                                          num_rows=hello.num_metadata_rows, last_seen=now)
        logger.info("PD: decode engine %s connected", identity)
        self.channel.send_to_identity(identity, HelloReply(sender=self.engine_id, accepted=True, layout=self.layout))

    def on_destination(self, identity: str, message: Destination, now: float) -> None:
        peer = self.peers.get(identity)
        if peer is None:
            self.channel.send_to_identity(identity, TransferFailed(room=message.room, drained=True,
                                                                   reason="destination from an unknown peer"))
            return
        if self.stalled_batch:
            self.channel.send_to_identity(identity, TransferFailed(
                room=message.room, drained=True, reason="the destination arrived while the prefill engine stalled"))
            transfer = self.transfers.get(message.room)
            if transfer is not None:
                self.end(transfer, TransferState.FAILED, "the destination arrived while the prefill engine stalled",
                         tell_peer=False)
            return
        transfer = self.transfers.get(message.room)
        if transfer is None:
            self.early_destinations[message.room] = (identity, message, now)
            return
        if transfer.status.state is not TransferState.WAITING:
            logger.warning("PD: second destination for room %s ignored", message.room)
            return
        self.bind(transfer, identity, message)

    def bind(self, transfer: PrefillTransfer, identity: str, message: Destination) -> None:
        peer = self.peers.get(identity)
        sequence = transfer.sequence
        problem = None
        if peer is None or peer.dead:
            problem = "the decode engine that sent the destination is gone"
        elif len(message.page_tables) != self.coordinator.num_groups:
            problem = f"destination has {len(message.page_tables)} page tables, expected {self.coordinator.num_groups}"
        elif message.num_prompt_tokens != sequence.num_prompt_tokens:
            problem = (f"the decode server has a {message.num_prompt_tokens}-token prompt, "
                       f"the prefill server {sequence.num_prompt_tokens} tokens")
        elif not 0 <= message.metadata_row < peer.num_rows:
            problem = f"metadata row {message.metadata_row} out of range"
        transfer.peer, transfer.destination = peer, message
        if problem is not None:
            self.end(transfer, TransferState.FAILED, f"bad destination: {problem}")
            return
        transfer.status.advance(TransferState.BOUND)
        transfer.bound_at = time.monotonic()
        self.scheduler.release_remote(sequence, running=False)

    def on_abort_transfer(self, identity: str, message: AbortTransfer, now: float) -> None:
        self.early_destinations.pop(message.room, None)
        transfer = self.transfers.get(message.room)
        if transfer is None or (transfer.peer is not None and transfer.peer.identity != identity):
            if transfer is None:
                self.aborted_rooms[message.room] = now
            self.channel.send_to_identity(identity, Drained(room=message.room))
            return
        transfer.notify_drained = True
        if transfer.peer is None:
            transfer.peer = self.peers.get(identity)
        self.end(transfer, TransferState.ABORTED, f"the decode server aborted the transfer: {message.reason}",
                 tell_peer=False)

    # -- the transfer -------------------------------------------------------------------------------------
    def after_computed(self, chunk) -> None:
        sequence = chunk.sequence
        transfer = self.by_request.get(sequence.request_id)
        if transfer is None or transfer.status.terminal or transfer.destination is None or self.stalled():
            return
        self.push_pages(transfer, prompt_done=sequence.num_computed_tokens >= sequence.num_prompt_tokens)

    def push_pages(self, transfer: PrefillTransfer, prompt_done: bool) -> None:
        """Write every page that became final since the last push (whole pages, coalesced)."""
        sequence, destination = transfer.sequence, transfer.destination
        indices = self.coordinator.final_page_indices(sequence.state, sequence.num_computed_tokens, prompt_done)
        pairs_per_group, sources = [], []
        for group, (group_indices, table, target) in enumerate(
                zip(indices, sequence.state.page_tables, destination.page_tables)):
            pairs = []
            for index in group_indices:
                if index in transfer.sent[group]:
                    continue
                transfer.sent[group].add(index)
                if index >= len(target) or target[index] == NULL_PAGE:
                    continue  # the decode side does not need it (e.g. before a sliding window)
                if table[index] == NULL_PAGE:
                    self.end(transfer, TransferState.FAILED,
                             f"page {index} of state group {group} was released before it was sent")
                    return
                pairs.append((table[index], target[index]))
            pairs_per_group.append(pairs)
            sources.append([source for source, _ in pairs])
        plan = plan_page_writes(self.registry, transfer.peer.addresses, pairs_per_group)
        self.touched |= plan.touched
        if not plan.descriptors:
            return
        owner = self.coordinator.hold_inflight(f"pd-send:{transfer.room}:{transfer.num_writes}", sources)
        transfer.num_writes += 1
        transfer.first_write_at = transfer.first_write_at or time.monotonic()
        handle = self.backend.write(transfer.peer.agent, plan.descriptors, local_device=self.device_index,
                                    remote_device=transfer.peer.device)
        transfer.writes.append(PendingWrite(handle, owner))
        if transfer.status.state is TransferState.BOUND:
            transfer.status.advance(TransferState.SENDING)

    def filter_deltas(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """Hold each PD request's first-token delta until its transfer is done."""
        passed = []
        for delta in deltas:
            transfer = self.by_request.get(delta.request_id)
            if transfer is None or transfer.status.terminal:
                passed.append(delta)
            elif delta.finish_reason in ("error", "abort"):
                reason = f"the prefill engine failed: {delta.error or delta.finish_reason}"
                self.end(transfer, TransferState.FAILED, reason, emit=False)
                passed.append(delta)
            else:
                transfer.first_delta = delta
        if deltas:
            self.progress(time.monotonic())
        return passed

    def progress(self, now: float) -> None:
        for transfer in list(self.transfers.values()):
            self.progress_writes(transfer, now)
            if not transfer.status.terminal and transfer.first_delta is not None and not transfer.writes \
                    and transfer.metadata_write is None and not self.stalled():
                self.post_metadata(transfer)
            if transfer.status.terminal and not transfer.outstanding:
                self.retire(transfer)

    def progress_writes(self, transfer: PrefillTransfer, now: float) -> None:
        for write in list(transfer.writes):
            status = self.backend.poll(write.handle)
            if status is WriteStatus.PENDING:
                if transfer.status.terminal and now - transfer.ended_at > self.config.drain_timeout:
                    self.cancel(transfer, write)
                continue
            self.backend.release(write.handle)
            self.coordinator.release_inflight(write.owner)
            transfer.writes.remove(write)
            if status is WriteStatus.DONE:
                transfer.bytes_written += write.handle.num_bytes
            elif not transfer.status.terminal:
                self.end(transfer, TransferState.FAILED, f"a page write failed: {write.handle.error}")
        write = transfer.metadata_write
        if write is None:
            return
        status = self.backend.poll(write.handle)
        if status is WriteStatus.PENDING:
            if transfer.status.terminal and now - transfer.ended_at > self.config.drain_timeout:
                self.cancel(transfer, write)
            return
        self.backend.release(write.handle)
        transfer.metadata_write = None
        if status is WriteStatus.DONE and not transfer.status.terminal:
            transfer.bytes_written += write.handle.num_bytes
            transfer.status.advance(TransferState.DONE)
            transfer.ended_at = now
            self.record("done", transfer.bytes_written, now - (transfer.first_write_at or transfer.bound_at),
                        bandwidth=True)
            if not transfer.suppress_delta:
                self.outbox.append(transfer.first_delta)
        elif status is WriteStatus.ERROR and not transfer.status.terminal:
            self.end(transfer, TransferState.FAILED, f"the metadata row write failed: {write.handle.error}")

    def cancel(self, transfer: PrefillTransfer, write: PendingWrite) -> None:
        """A failed transfer's write did not finish within drain_timeout: cancel it. If the backend
        cannot, its pages stay held (never freed under a reader, I2)."""
        if not self.backend.release(write.handle):
            return
        logger.warning("PD: cancelled a write of room %s that did not finish", transfer.room)
        if write.owner is not None:
            self.coordinator.release_inflight(write.owner)
            transfer.writes.remove(write)
        else:
            transfer.metadata_write = None

    def post_metadata(self, transfer: PrefillTransfer) -> None:
        row = self.metadata.allocate()
        if row is None:
            return  # all rows busy: retried on the next poll
        delta, sequence, peer = transfer.first_delta, transfer.sequence, transfer.peer
        logprobs = delta.new_logprobs[0] if delta.new_logprobs else None
        self.metadata.write(row, MetadataRow(
            room=transfer.room, first_token=delta.new_token_ids[0],
            num_cached_tokens=max(sequence.num_cached_tokens, 0),
            logprob_token_ids=tuple(logprobs.token_ids) if logprobs else (),
            logprobs=tuple(logprobs.logprobs) if logprobs else (), rank=logprobs.rank if logprobs else 0))
        transfer.local_row = row
        destination = peer.metadata_address + transfer.destination.metadata_row * peer.row_bytes
        handle = self.backend.write(peer.agent, [(self.metadata.address(row), destination, self.metadata.row_bytes)],
                                    notification=done_notification(transfer.room))
        transfer.metadata_write = PendingWrite(handle, None)
        transfer.status.advance(TransferState.FINISHING)

    def end(self, transfer: PrefillTransfer, state: TransferState, reason: str, *, emit: bool = True,
            tell_peer: bool = True) -> None:
        if not transfer.status.end(state, reason):
            return
        transfer.ended_at = time.monotonic()
        logger.info("PD: room %s %s: %s", transfer.room, state.name.lower(), reason)
        self.record("aborted" if state is TransferState.ABORTED else "failed")
        sequence = transfer.sequence
        self.finish_sequence(sequence)
        if emit and not transfer.suppress_delta:
            self.outbox.append(self.error_delta(sequence, reason))
        if tell_peer and transfer.peer is not None:  # best effort: a dead peer never reads it
            drained = not transfer.outstanding
            self.channel.send_to_identity(transfer.peer.identity,
                                          TransferFailed(room=transfer.room, reason=reason, drained=drained))
            transfer.notify_drained = not drained

    def retire(self, transfer: PrefillTransfer) -> None:
        """Every write resolved: say so if the decode side waits, free the row, forget the room."""
        if transfer.notify_drained and transfer.peer is not None:
            self.channel.send_to_identity(transfer.peer.identity, Drained(room=transfer.room))
        if transfer.local_row is not None:
            self.metadata.release(transfer.local_row)
            transfer.local_row = None
        self.transfers.pop(transfer.room, None)
        if self.by_request.get(transfer.sequence.request_id) is transfer:
            del self.by_request[transfer.sequence.request_id]

    # -- time ---------------------------------------------------------------------------------------------------
    def check_timeouts(self, now: float) -> None:
        config = self.config
        for peer in self.peers.values():
            if not peer.dead and now - peer.last_seen > config.peer_timeout:
                peer.dead = True
                logger.warning("PD: decode engine %s is dead (no heartbeat for %.1f s)", peer.identity,
                               config.peer_timeout)
                for transfer in list(self.transfers.values()):
                    if transfer.peer is peer:
                        self.end(transfer, TransferState.FAILED,
                                 f"the decode server stopped responding (no heartbeat for {config.peer_timeout:g} s)")
        for transfer in list(self.transfers.values()):
            if transfer.status.state is TransferState.WAITING and now - transfer.created > config.bootstrap_timeout:
                self.end(transfer, TransferState.FAILED,
                         f"no decode server sent destination pages within {config.bootstrap_timeout:g} s")
            elif not transfer.status.terminal and transfer.bound_at \
                    and now - transfer.bound_at > config.transfer_timeout:
                self.end(transfer, TransferState.FAILED, f"the transfer took longer than {config.transfer_timeout:g} s")
        for room, (identity, _, received) in list(self.early_destinations.items()):
            if now - received > config.bootstrap_timeout:
                del self.early_destinations[room]
                self.channel.send_to_identity(identity, TransferFailed(
                    room=room, drained=True, reason="the prefill server never received this request"))
        for room, moment in list(self.aborted_rooms.items()):
            if now - moment > config.bootstrap_timeout:
                del self.aborted_rooms[room]

    def awaiting_backend(self) -> bool:
        return any(transfer.outstanding or transfer.first_delta is not None for transfer in self.transfers.values())

    def busy(self) -> bool:
        return bool(self.transfers or self.outbox)

    def queue_lengths(self) -> dict[str, int]:
        counts = {"waiting_for_destination": 0, "sending": 0, "draining": 0}
        for transfer in self.transfers.values():
            if transfer.status.state is TransferState.WAITING:
                counts["waiting_for_destination"] += 1
            elif transfer.status.terminal:
                counts["draining"] += 1
            else:
                counts["sending"] += 1
        return counts


# =====================================================================================================
# Decode side
# =====================================================================================================


@dataclass
class PrefillLink:
    """This engine's connection to one prefill engine."""
    address: str
    since: float
    last_seen: float
    ready: bool = False
    agent: str = ""  # the prefill engine's agent name (the sender of its notifications)


@dataclass(eq=False)
class DecodeTransfer:
    room: str
    sequence: Sequence
    address: str
    status: TransferStatus
    created: float
    row: Optional[int] = None
    bound_at: float = 0.0
    hold_owner: Optional[str] = None  # in-flight hold of the destination pages after a failure
    drain_deadline: float = 0.0
    num_bytes: int = 0
    suppress_delta: bool = False
    held_back: bool = False  # it waited for admission at least once


class DecodeSide(PDSide):
    role = "decode"

    def __init__(self, core, config: TransferConfig) -> None:
        super().__init__(core, config)
        self.transfers: dict[str, DecodeTransfer] = {}  # live: waiting or bound
        self.by_request: dict[str, DecodeTransfer] = {}
        self.queue: deque[DecodeTransfer] = deque()  # waiting for admission, FIFO
        self.draining: dict[str, DecodeTransfer] = {}  # failed; pages held until the prefill side drains
        self.links: dict[str, PrefillLink] = {}
        self.next_heartbeat = 0.0
        self.hello = Hello(sender=self.engine_id, layout=self.layout, backend=config.backend,
                           backend_metadata=self.backend.local_metadata(),
                           buffer_addresses=[region.address for region in buffer_regions(self.registry)],
                           device=self.device_index, metadata_address=self.metadata.address(0),
                           num_metadata_rows=self.metadata.num_rows)

    # -- requests ---------------------------------------------------------------------------------------
    def add(self, sequence: Sequence, params: TransferParams) -> None:
        room = check_room(params.room)
        if not params.prefill_address:
            raise ValueError("kv_transfer_params: prefill_address is required on a decode server")
        if room in self.transfers or room in self.draining:
            raise ValueError(f"kv_transfer_params: room {room} is already in use on this decode server")
        transfer = DecodeTransfer(room=room, sequence=sequence, address=params.prefill_address,
                                  status=TransferStatus(room), created=time.monotonic())
        self.transfers[room] = transfer
        self.by_request[sequence.request_id] = transfer
        self.scheduler.add_remote(sequence)
        self.queue.append(transfer)
        self.ensure_link(params.prefill_address)

    def on_abort_request(self, request_id: str) -> None:
        transfer = self.by_request.get(request_id)
        if transfer is not None and not transfer.status.terminal:
            transfer.suppress_delta = True
            self.give_up(transfer, TransferState.ABORTED, "the request was aborted on the decode server")

    # -- links --------------------------------------------------------------------------------------------
    def ensure_link(self, address: str) -> None:
        if address in self.links:
            return
        now = time.monotonic()
        self.links[address] = PrefillLink(address=address, since=now, last_seen=now)
        self.channel.connect(address)
        self.channel.send_to_address(address, self.hello)

    def fail_link(self, address: str, reason: str) -> None:
        """The link is unusable (rejected handshake, no answer, peer dead): end everything on it."""
        logger.warning("PD: prefill engine at %s: %s", address, reason)
        for transfer in list(self.transfers.values()):
            if transfer.address == address:
                self.end(transfer, TransferState.FAILED, reason, hold=False)
        for transfer in list(self.draining.values()):
            if transfer.address == address:
                self.release_hold(transfer)
        self.links.pop(address, None)
        self.channel.disconnect(address)

    # -- control messages ---------------------------------------------------------------------------------
    def handle(self, identity, address, message, now: float) -> None:
        if address is None:
            return
        link = self.links.get(address)
        if link is None:
            return
        link.last_seen = now
        if isinstance(message, HelloReply):
            self.on_hello_reply(link, message)
        elif isinstance(message, TransferFailed):
            transfer = self.transfers.get(message.room)
            if transfer is not None and transfer.address == address:
                self.end(transfer, TransferState.FAILED, f"the prefill server failed the transfer: {message.reason}",
                         hold=transfer.status.state is TransferState.BOUND and not message.drained)
            elif message.drained and message.room in self.draining:
                self.release_hold(self.draining[message.room])
        elif isinstance(message, Drained):
            transfer = self.draining.get(message.room)
            if transfer is not None and transfer.address == address:
                self.release_hold(transfer)

    def on_hello_reply(self, link: PrefillLink, reply: HelloReply) -> None:
        if not reply.accepted:
            self.fail_link(link.address, reply.error or "the prefill server refused the connection")
            return
        difference = first_difference(self.layout, reply.layout, "the decode server", "the prefill server") \
            if reply.layout is not None else "the prefill server sent no layout"
        if difference is not None:
            self.fail_link(link.address, f"PD handshake failed: {difference}")
            return
        link.ready, link.agent = True, reply.sender
        logger.info("PD: connected to prefill engine %s at %s", reply.sender, link.address)

    # -- admission ----------------------------------------------------------------------------------------
    def admit(self, now: float) -> None:
        """Bind waiting transfers in arrival order while each can finish (pages for its prompt
        and every token it may generate, beyond what admitted sequences may still take)."""
        reserved = None
        for transfer in list(self.queue):
            link = self.links.get(transfer.address)
            if link is None or not link.ready:
                continue
            if reserved is None:
                reserved = self.reserved_pages()
            if not self.can_admit(transfer, reserved):
                if not transfer.held_back:
                    transfer.held_back = True
                    self.num_held_back += 1
                    self._stats_version += 1
                return
            self.bind(transfer, now)
            reserved = None

    def reserved_pages(self) -> list[int]:
        """Per group: pages the live sequences may still allocate until they finish."""
        reserved = [0] * self.coordinator.num_groups
        for sequence in self.scheduler.running + list(self.scheduler.waiting) + self.bound_sequences():
            for group, count in enumerate(self.coordinator.pages_needed(
                    sequence.state, sequence.num_prompt_tokens + sequence.max_tokens)):
                reserved[group] += count
        return reserved

    def bound_sequences(self) -> list[Sequence]:
        return [t.sequence for t in self.transfers.values() if t.status.state is TransferState.BOUND]

    def can_admit(self, transfer: DecodeTransfer, reserved: list[int]) -> bool:
        if self.metadata.num_free == 0:
            return False
        live = len(self.scheduler.running) + len(self.scheduler.waiting) + len(self.bound_sequences())
        if live >= self.core.config.max_num_seqs:
            return False
        sequence = transfer.sequence
        needed = self.coordinator.pages_needed(sequence.state, sequence.num_prompt_tokens + sequence.max_tokens)
        return all(pool.num_free - held >= count
                   for pool, held, count in zip(self.coordinator.pools, reserved, needed))

    def bind(self, transfer: DecodeTransfer, now: float) -> None:
        sequence = transfer.sequence
        transfer.row = self.metadata.allocate()
        self.coordinator.allocate(sequence.state, sequence.num_prompt_tokens)
        self.coordinator.drop_unneeded_pages(sequence.state, sequence.num_prompt_tokens)
        self.queue.remove(transfer)
        transfer.status.advance(TransferState.BOUND)
        transfer.bound_at = now
        transfer.num_bytes = self.destination_bytes(sequence) + self.metadata.row_bytes
        self.channel.send_to_address(transfer.address, Destination(
            room=transfer.room, page_tables=[list(table) for table in sequence.state.page_tables],
            metadata_row=transfer.row, num_prompt_tokens=sequence.num_prompt_tokens))

    def destination_bytes(self, sequence: Sequence) -> int:
        """Bytes the prefill side writes at most: every live destination page of every buffer."""
        tables = sequence.state.page_tables
        return sum(descriptor.page_bytes * sum(page != NULL_PAGE for page in tables[descriptor.group_id])
                   for descriptor in self.registry.buffers())

    # -- completion ---------------------------------------------------------------------------------------
    def progress(self, now: float) -> None:
        for agent, message in self.backend.notifications():
            room = room_of_notification(message)
            transfer = self.transfers.get(room) if room is not None else None
            if transfer is None or transfer.status.state is not TransferState.BOUND:
                continue  # late (aborted or failed); Drained releases its pages
            link = self.links.get(transfer.address)
            if link is None or agent != link.agent:
                logger.warning("PD: completion of room %s from %s ignored (expected %s)", room, agent,
                               link.agent if link else "no link")
                continue
            self.commit(transfer, now)
        self.admit(now)

    def commit(self, transfer: DecodeTransfer, now: float) -> None:
        """The writes landed: copy the row out (I4), check the room (I7), continue decoding."""
        row = self.metadata.read(transfer.row)
        self.metadata.release(transfer.row)
        transfer.row = None
        sequence = transfer.sequence
        if row.room != transfer.room:
            self.end(transfer, TransferState.FAILED,
                     f"the metadata row carries room {row.room}, expected {transfer.room}", hold=False)
            return
        if not 0 <= row.first_token < self.core.model_info.vocab_size:
            self.end(transfer, TransferState.FAILED, f"the first token {row.first_token} is outside the vocabulary",
                     hold=False)
            return
        logprobs = None
        if sequence.params.logprobs is not None:
            if not row.has_logprobs:
                self.end(transfer, TransferState.FAILED, "the prefill server sent no logprobs", hold=False)
                return
            keep = 1 + sequence.params.logprobs
            logprobs = PositionLogprobs(list(row.logprob_token_ids[:keep]), list(row.logprobs[:keep]), row.rank)
        transfer.status.advance(TransferState.DONE)
        self.forget(transfer)
        self.record("done", transfer.num_bytes, now - transfer.bound_at)
        sequence.num_computed_tokens = sequence.num_prompt_tokens
        sequence.num_cached_tokens = row.num_cached_tokens
        self.skip_first_draw(sequence)
        self.scheduler.release_remote(sequence, running=True)
        self.outbox.append(self.core._append_token(sequence, row.first_token, logprobs))

    def skip_first_draw(self, sequence: Sequence) -> None:
        """A seeded request continues its random stream where the prefill engine left it: the
        sampler draws one vocabulary-sized Exp(1) vector per sampled step from a row's own
        generator (``Sampler.exponential_noise``), and the prefill engine made that draw for the
        first token."""
        generator = sequence.generator
        if generator is not None and not sequence.params.is_greedy:
            torch.empty(self.core.model_info.vocab_size, device=generator.device).exponential_(generator=generator)

    # -- failure ------------------------------------------------------------------------------------------
    def give_up(self, transfer: DecodeTransfer, state: TransferState, reason: str) -> None:
        """This side ends the transfer: tell the prefill side; bound pages wait for its drain."""
        bound = transfer.status.state is TransferState.BOUND
        self.end(transfer, state, reason, hold=bound)
        if transfer.address in self.links:
            self.channel.send_to_address(transfer.address, AbortTransfer(room=transfer.room, reason=reason))

    def end(self, transfer: DecodeTransfer, state: TransferState, reason: str, *, hold: bool) -> None:
        if not transfer.status.end(state, reason):
            return
        logger.info("PD: room %s %s: %s", transfer.room, state.name.lower(), reason)
        self.record("aborted" if state is TransferState.ABORTED else "failed")
        self.forget(transfer)
        sequence = transfer.sequence
        if hold:
            transfer.hold_owner = self.coordinator.hold_inflight(f"pd-recv:{transfer.room}", sequence.state.page_tables)
            transfer.drain_deadline = time.monotonic() + self.config.peer_timeout + self.config.drain_timeout
            self.draining[transfer.room] = transfer
        elif transfer.row is not None:
            self.metadata.release(transfer.row)
            transfer.row = None
        self.finish_sequence(sequence)
        if not transfer.suppress_delta:
            self.outbox.append(self.error_delta(sequence, reason))

    def forget(self, transfer: DecodeTransfer) -> None:
        self.transfers.pop(transfer.room, None)
        if transfer in self.queue:
            self.queue.remove(transfer)
        if self.by_request.get(transfer.sequence.request_id) is transfer:
            del self.by_request[transfer.sequence.request_id]

    def release_hold(self, transfer: DecodeTransfer) -> None:
        """The prefill side will write no more (or is dead): free the pages (poisoned) and row."""
        self.draining.pop(transfer.room, None)
        if transfer.hold_owner is not None:
            self.coordinator.release_inflight(transfer.hold_owner)
            transfer.hold_owner = None
        if transfer.row is not None:
            self.metadata.release(transfer.row)
            transfer.row = None

    # -- time -----------------------------------------------------------------------------------------------
    def check_timeouts(self, now: float) -> None:
        config = self.config
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + config.heartbeat_interval
            for address in self.links:
                self.channel.send_to_address(address, Heartbeat(sender=self.engine_id))
        for link in list(self.links.values()):
            if not link.ready and now - link.since > config.connect_timeout:
                self.fail_link(link.address, f"no handshake reply from the prefill server at {link.address} "
                                             f"within {config.connect_timeout:g} s")
            elif link.ready and now - link.last_seen > config.peer_timeout:
                self.fail_link(link.address, f"the prefill server at {link.address} stopped responding "
                                             f"(no heartbeat for {config.peer_timeout:g} s)")
        for transfer in list(self.transfers.values()):
            if transfer.status.state is TransferState.BOUND and now - transfer.bound_at > config.transfer_timeout:
                self.give_up(transfer, TransferState.FAILED,
                             f"the transfer took longer than {config.transfer_timeout:g} s")
            elif transfer.status.state is TransferState.WAITING and now - transfer.created > config.bootstrap_timeout:
                self.give_up(transfer, TransferState.FAILED,
                             f"not admitted within {config.bootstrap_timeout:g} s (the decode pool stayed full)")
        for transfer in list(self.draining.values()):
            if now > transfer.drain_deadline:
                logger.warning("PD: room %s: the prefill server never confirmed its writes drained; "
                               "releasing the pages", transfer.room)
                self.release_hold(transfer)

    def awaiting_backend(self) -> bool:
        return any(t.status.state is TransferState.BOUND for t in self.transfers.values())

    def busy(self) -> bool:
        return bool(self.transfers or self.draining or self.outbox)

    def queue_lengths(self) -> dict[str, int]:
        bound = sum(t.status.state is TransferState.BOUND for t in self.transfers.values())
        return {"waiting_for_admission": len(self.queue), "receiving": bound, "draining": len(self.draining)}
