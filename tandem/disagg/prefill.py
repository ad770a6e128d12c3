"""The prefill side of PD: computes a prompt whose destination pages the decode side chose,
writes every group's final pages as chunks complete them, and holds the first-token delta
until the last write landed: the pages of the prompt's last chunk, the metadata row (first
token) and the completion notification travel in that one write, posted once every earlier
write is done (so the notification means every page and the row landed: I7).

Every write is carried out by every rank's worker with its own transfer agent, rank 0's
included, one rank or several (``tandem/disagg/pd_ranks.py``); this side keeps the books.
Lifetimes: each write holds its source pages in flight until every rank reports its part done
or failed (or, after ``drain_timeout``, cancelled); then, if the decode side waits for it,
``Drained`` is sent. Nothing here knows model families: pages come from the coordinator
(``final_page_indices``, answered by the managers) and bytes from the registry
(``transfer/descriptors.py``).
"""
from __future__ import annotations

import logging
import time

from tandem.disagg.common import PDSide
from tandem.disagg.prefill_writes import LAST_WRITE_SPIN_SECONDS, PrefillWrites
from tandem.disagg.transfers import DecodePeer, PrefillTransfer
from tandem.protocol import TransferParams
from tandem.scheduler.sequence import Sequence
from tandem.transfer.config import TransferConfig
from tandem.transfer.descriptors import WritePlanner
from tandem.transfer.messages import (
    AbortTransfer,
    Destination,
    Drained,
    Heartbeat,
    Hello,
    HelloReply,
    RankAgent,
    TransferFailed,
    check_room,
    first_difference,
)
from tandem.transfer.state import TransferState, TransferStatus
from tandem.step_context import StepContext

logger = logging.getLogger("tandem.pd")



class PrefillSide(PrefillWrites, PDSide):
    role = "prefill"

    def __init__(self, core: StepContext, config: TransferConfig) -> None:
        super().__init__(core, config)
        self.transfers: dict[str, PrefillTransfer] = {}  # room -> transfer, until drained
        self.by_request: dict[str, PrefillTransfer] = {}
        self.peers: dict[str, DecodePeer] = {}
        self.early_destinations: dict[str, tuple[str, Destination, float]] = {}  # room -> (peer, message, time)
        # rooms ended before their request came (the decode side aborted, or this side refused the
        # destination): room -> (time, state, reason); the request fails on arrival
        self.ended_rooms: dict[str, tuple[float, TransferState, str]] = {}
        self.touched: set[tuple[int, str, str]] = set()  # registry buffers written so far (I1 tests)

    # -- requests -----------------------------------------------------------------------------------------
    def add(self, sequence: Sequence, params: TransferParams) -> None:
        room = check_room(params.room)
        if room in self.transfers:
            raise ValueError(f"kv_transfer_params: room {room} is already in use on this prefill server")
        sequence.max_tokens = 1  # the prefill leg computes the prompt and samples the first token
        num_groups = self.coordinator.num_groups
        transfer = PrefillTransfer(room=room, sequence=sequence, status=TransferStatus(room), created=time.monotonic(),
                                   sent=[set() for _ in range(num_groups)], unsent=[{} for _ in range(num_groups)])
        self.transfers[room] = transfer
        self.by_request[sequence.request_id] = transfer
        # computed at once: the decode side's destination comes meanwhile (pages computed before
        # it are held for it, ``hold_until_bound``), so its round trip is off the critical path
        self.scheduler.add(sequence)
        ended = self.ended_rooms.pop(room, None)
        if ended is not None:
            self.end(transfer, ended[1], ended[2])
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
        pages. Fail every bound transfer and every destination that came before its request (that
        request fails when it comes), and refuse destinations that queued up meanwhile."""
        super().after_stall(seconds)
        reason = (f"the prefill engine stalled for {seconds:.1f} s, longer than peer_timeout "
                  f"({self.config.peer_timeout:g} s); its decode peer has given up")
        for transfer in list(self.transfers.values()):
            if transfer.peer is not None and not transfer.status.terminal:
                self.end(transfer, TransferState.FAILED, reason)
        now = time.monotonic()
        for room, (identity, _, _) in list(self.early_destinations.items()):
            self.refuse(identity, room, reason, now)
        self.early_destinations.clear()
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
        # every rank (rank 0 included) loads its decode rank's agent and warms the connection up
        # with a few bytes to that rank's scratch, from and to the pages' memory, so that
        # connection setup (14.5 ms measured for NIXL between two GPUs) is paid now, not by the
        # first request; a warm-up's outcome only matters to the log
        own = RankAgent(hello.backend_metadata, list(hello.buffer_addresses), hello.device, hello.scratch_address,
                        list(hello.page_counts),
                        [hello.metadata_address, hello.layout.metadata_row_bytes, hello.num_metadata_rows])
        problem = self.ranks.add_peer(identity, [own] + list(hello.ranks))
        if problem is not None:  # (ranks that loaded it keep a peer nothing is written to)
            self.channel.send_to_identity(identity, HelloReply(sender=self.engine_id, accepted=False,
                                                               error=f"PD handshake failed: {problem}"))
            return
        self.peers[identity] = DecodePeer(identity=identity,
                                          planner=WritePlanner(self.registry, list(hello.buffer_addresses)),
                                          metadata_address=hello.metadata_address,
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
            reason = "the destination arrived while the prefill engine stalled"
            transfer = self.transfers.get(message.room)
            if transfer is None:
                self.refuse(identity, message.room, reason, now)
                return
            self.channel.send_to_identity(identity, TransferFailed(room=message.room, drained=True, reason=reason))
            self.end(transfer, TransferState.FAILED, reason, tell_peer=False)
            return
        transfer = self.transfers.get(message.room)
        if transfer is None:
            self.early_destinations[message.room] = (identity, message, now)
            return
        if transfer.status.state is not TransferState.WAITING:
            logger.warning("PD: second destination for room %s ignored", message.room)
            return
        self.bind(transfer, identity, message)

    def refuse(self, identity: str, room: str, reason: str, now: float) -> None:
        """Refuse a destination whose request has not come: nothing was written to it, so the
        decode side may release it; the request fails when it comes."""
        self.channel.send_to_identity(identity, TransferFailed(room=room, drained=True, reason=reason))
        self.ended_rooms[room] = (now, TransferState.FAILED, reason)

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
        if not self.stalled():
            self.push_unsent(transfer)

    def on_abort_transfer(self, identity: str, message: AbortTransfer, now: float) -> None:
        self.early_destinations.pop(message.room, None)
        transfer = self.transfers.get(message.room)
        if transfer is None or (transfer.peer is not None and transfer.peer.identity != identity):
            if transfer is None:
                self.ended_rooms[message.room] = (now, TransferState.ABORTED, "the decode server aborted this request")
            self.channel.send_to_identity(identity, Drained(room=message.room))
            return
        transfer.notify_drained = True
        if transfer.peer is None:
            transfer.peer = self.peers.get(identity)
        self.end(transfer, TransferState.ABORTED, f"the decode server aborted the transfer: {message.reason}",
                 tell_peer=False)

    # -- the transfer -------------------------------------------------------------------------------------
    def after_computed(self, chunk, sampled=None) -> None:
        """``chunk`` was launched: send the pages it completed. ``sampled(sequence)``: where the
        same step sampled a sequence's token, ``(SamplerOutput on the device, row)``, or None."""
        sequence = chunk.sequence
        transfer = self.by_request.get(sequence.request_id)
        if transfer is None or transfer.status.terminal:
            return
        prompt_done = sequence.num_computed_tokens >= sequence.num_prompt_tokens
        if transfer.destination is None:
            self.hold_until_bound(transfer, self.final_pages(transfer, prompt_done), prompt_done)
        elif not self.stalled():
            self.push_pages(transfer, prompt_done)
        where = sampled(sequence) if prompt_done and sampled is not None else None
        if where is not None:
            self.prepare_row(transfer, *where)

    def end(self, transfer: PrefillTransfer, state: TransferState, reason: str, *, emit: bool = True,
            tell_peer: bool = True) -> None:
        if not transfer.status.end(state, reason):
            return
        transfer.ended_at = time.monotonic()
        self.release_unsent(transfer)
        logger.info("PD: room %s %s: %s", transfer.room, state.name.lower(), reason)
        self.metrics.record("aborted" if state is TransferState.ABORTED else "failed")
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
        for room, (moment, _, _) in list(self.ended_rooms.items()):
            if now - moment > config.bootstrap_timeout:
                del self.ended_rooms[room]

    def idle_wait_milliseconds(self) -> float:
        now = time.monotonic()
        if self.agent.backend.notifies_on_poll and any(transfer.metadata_write is not None and not transfer.status.terminal
               and now - transfer.metadata_write.posted_at < LAST_WRITE_SPIN_SECONDS
               for transfer in self.transfers.values()):
            return 0
        return super().idle_wait_milliseconds()

    def awaiting_backend(self) -> bool:
        return any(transfer.outstanding or transfer.first_delta is not None for transfer in self.transfers.values()) \
            or self.ranks.pending()

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
