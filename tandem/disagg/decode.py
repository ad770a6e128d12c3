"""The decode side of PD: admits a request only when it can finish it, allocates destination
pages for every group and a metadata row, sends their ids to the prefill engine, and on the
completion notification copies the row out (I4), checks the room (I7), commits and decodes.

Prefix cache: a prompt prefix this server's cache (or its tiers) holds is taken at binding and
sent as null destination entries, so the prefill server writes only the rest (a conversation
returning here moves only its new pages). Cached pages are never transfer destinations.

Tensor parallelism: every rank's shard of the pages is written by the prefill engine's same
rank; only this rank hears the notification, sent after every rank's writes landed
(``tandem/disagg/pd_ranks.py``).

Lifetimes: destination pages stay with the request until committed. A failed or aborted
transfer moves them to an in-flight hold released only on ``Drained``/``TransferFailed(drained)``,
or once the prefill engine is declared dead (no heartbeat for ``peer_timeout``). Freed pages are
poisoned in sanitizer mode (the block pool's on-free hook).
"""
from __future__ import annotations

import logging
import time
from collections import deque


from tandem.disagg.common import PDSide
from tandem.disagg.transfers import DecodeTransfer, PrefillLink
from tandem.protocol import PositionLogprobs, TransferParams
from tandem.kv.block_pool import OutOfPagesError
from tandem.kv.planner import NULL_PAGE
from tandem.scheduler.sequence import Sequence
from tandem.transfer.config import TransferConfig
from tandem.transfer.messages import (
    AbortTransfer,
    Destination,
    Drained,
    Heartbeat,
    Hello,
    HelloReply,
    TransferFailed,
    check_room,
    first_difference,
    room_of_notification,
)
from tandem.transfer.state import TransferState, TransferStatus
from tandem.step_context import StepContext

logger = logging.getLogger("tandem.pd")


class DecodeSide(PDSide):
    role = "decode"

    def __init__(self, core: StepContext, config: TransferConfig) -> None:
        super().__init__(core, config)
        self.transfers: dict[str, DecodeTransfer] = {}  # live: waiting or bound
        self.by_request: dict[str, DecodeTransfer] = {}
        self.queue: deque[DecodeTransfer] = deque()  # waiting for admission, FIFO
        self.draining: dict[str, DecodeTransfer] = {}  # failed; pages held until the prefill side drains
        self.links: dict[str, PrefillLink] = {}
        self.next_heartbeat = 0.0
        own = self.ranks.agents[0]  # rank 0's worker's agent (the metadata rows registered)
        self.hello = Hello(sender=self.engine_id, layout=self.layout, backend=config.backend,
                           backend_metadata=own.backend_metadata, buffer_addresses=list(own.buffer_addresses),
                           device=own.device, metadata_address=self.metadata.address(0),
                           num_metadata_rows=self.metadata.num_rows, scratch_address=own.scratch_address,
                           page_counts=list(own.page_counts), ranks=self.ranks.agents[1:])

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
            elif message.drained:
                self.release_drained(message.room, address)
        elif isinstance(message, Drained):
            self.release_drained(message.room, address)

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
                    self.metrics.record_held_back()
                return
            sequence = transfer.sequence
            if self.coordinator.prefix_hits.loading(sequence.state, sequence.token_ids):
                return  # a prefix this server's disk store holds is being read (off the engine loop)
            if not self.bind(transfer, now):
                if not transfer.held_back:
                    transfer.held_back = True
                    self.metrics.record_held_back()
                return
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
        evictable = self.coordinator.prefix_hits.evictable_pages()  # the prefix cache gives way
        return all(pool.num_free + spare - held >= count
                   for pool, spare, held, count in zip(self.coordinator.pools, evictable, reserved, needed))

    def bind(self, transfer: DecodeTransfer, now: float) -> bool:
        """Allocate the prompt's pages (a prefix this server's cache holds is taken from it, not
        transferred) and send the prefill server their ids, null where the cache holds them.
        False (nothing held) when the pages cannot be had yet."""
        sequence = transfer.sequence
        transfer.row = self.metadata.allocate()
        self.match_prefix(sequence)
        try:
            self.coordinator.allocate(sequence.state, sequence.num_prompt_tokens)
        except OutOfPagesError:
            # Admission counts cached pages as evictable that cannot go yet (the prefix just
            # matched is locked; pages under in-flight offload copies are held): wait for pages.
            self.coordinator.free(sequence.state)
            self.metadata.release(transfer.row)
            transfer.row = None
            return False
        self.coordinator.drop_unneeded_pages(sequence.state, sequence.num_prompt_tokens)
        sequence.state.remote_tokens = sequence.num_prompt_tokens
        self.queue.remove(transfer)
        transfer.status.advance(TransferState.BOUND)
        transfer.bound_at = now
        tables = self.coordinator.pd_tables.destination_tables(sequence.state)
        self.ranks.flush_pages()  # freed pages are poisoned on every rank before they are written again
        # every rank receives its shard of the pages (the shards are equal in size)
        transfer.num_bytes = self.destination_bytes(sequence, tables) * self.core.config.tensor_parallel_size \
            + self.metadata.row_bytes
        self.channel.send_to_address(transfer.address, Destination(
            room=transfer.room, page_tables=tables, metadata_row=transfer.row,
            num_prompt_tokens=sequence.num_prompt_tokens))
        return True

    def match_prefix(self, sequence: Sequence) -> None:
        """Take the longest prefix this server's cache (and its tiers) holds for the prompt."""
        scheduler = self.scheduler
        hit = self.coordinator.prefix_hits.match(sequence.state, sequence.token_ids)
        scheduler.prefix_hit_tokens += hit
        scheduler.prefix_query_tokens += sequence.num_prompt_tokens
        if hit and self.scheduler.tiers is not None:
            self.scheduler.tiers.count_hit(sequence.state.cache_path)

    def destination_bytes(self, sequence: Sequence, tables: list[list[int]]) -> int:
        """Bytes the prefill side writes: the destination pages that are final once the prompt
        is computed (the managers say which: not a recurrent group's checkpoint slot), in every
        buffer (a page-major group's block whole, as ``plan_page_writes`` writes it)."""
        final = self.coordinator.pd_tables.final_page_indices(sequence.state, sequence.num_prompt_tokens,
                                                              prompt_done=True)
        live = [sum(index < len(table) and table[index] != NULL_PAGE for index in indices)
                for indices, table in zip(final, tables)]
        total, pooled = 0, set()
        for descriptor in self.registry.buffers():
            if descriptor.pool is None:
                total += descriptor.page_bytes * live[descriptor.group_id]
            elif descriptor.group_id not in pooled:  # a page-major block moves whole, padding included
                pooled.add(descriptor.group_id)
                total += descriptor.page_stride * live[descriptor.group_id]
        return total

    # -- completion ---------------------------------------------------------------------------------------
    def progress(self, now: float) -> None:
        for agent, message in self.agent.notifications():  # decode rank 0 alone receives them
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
        sequence.num_computed_tokens = sequence.num_prompt_tokens
        speculator = self.core.speculator
        problem = speculator.on_remote_prefill(sequence, row.hidden_states) if speculator is not None else None
        if problem is not None:
            self.end(transfer, TransferState.FAILED, problem, hold=False)
            return
        transfer.status.advance(TransferState.DONE)
        self.forget(transfer)
        self.metrics.record("done", transfer.num_bytes, now - transfer.bound_at)
        self.metrics.record_phases(admission_wait=transfer.bound_at - transfer.created, receive=now - transfer.bound_at)
        sequence.num_cached_tokens = row.num_cached_tokens
        self.skip_first_draw(sequence)
        self.scheduler.release_remote(sequence, running=True)
        self.outbox.append(self.core.append_first_token(sequence, row.first_token, logprobs))

    def skip_first_draw(self, sequence: Sequence) -> None:
        """A seeded request continues its random stream where the prefill engine left it: the
        sampler draws one vocabulary-sized Exp(1) vector per sampled step from a row's own
        generator (``Sampler.exponential_noise``), and the prefill engine made that draw for the
        first token."""
        if sequence.seed is not None and not sequence.params.is_greedy:  # (rank 0's worker owns the generator)
            self.core.executor.skip_first_draw(sequence.arrival_order, sequence.seed)

    # -- failure ------------------------------------------------------------------------------------------
    def give_up(self, transfer: DecodeTransfer, state: TransferState, reason: str) -> None:
        """This side ends the transfer: tell the prefill side; bound pages wait for its drain."""
        bound = transfer.status.state is TransferState.BOUND
        self.end(transfer, state, reason, hold=bound)
        link = self.links.get(transfer.address)
        if link is not None and link.ready:  # else the prefill engine never got a destination
            self.channel.send_to_address(transfer.address, AbortTransfer(room=transfer.room, reason=reason))

    def end(self, transfer: DecodeTransfer, state: TransferState, reason: str, *, hold: bool) -> None:
        if not transfer.status.end(state, reason):
            return
        logger.info("PD: room %s %s: %s", transfer.room, state.name.lower(), reason)
        self.metrics.record("aborted" if state is TransferState.ABORTED else "failed")
        self.forget(transfer)
        sequence = transfer.sequence
        if hold:
            transfer.hold_owner = self.coordinator.inflight.hold(f"pd-recv:{transfer.room}", sequence.state.page_tables)
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

    def release_drained(self, room: str, address: str) -> None:
        """The prefill engine at ``address`` says it will write no more to ``room``: release the
        held pages, but only if that engine is the one writing them (I7)."""
        transfer = self.draining.get(room)
        if transfer is None:
            return
        if transfer.address != address:
            logger.warning("PD: drain of room %s from %s ignored (its writer is %s)", room, address, transfer.address)
            return
        self.release_hold(transfer)

    def release_hold(self, transfer: DecodeTransfer) -> None:
        """The prefill side will write no more (or is dead): free the pages (poisoned) and row."""
        self.draining.pop(transfer.room, None)
        if transfer.hold_owner is not None:
            self.coordinator.inflight.release(transfer.hold_owner)
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
                                             f"within {config.connect_timeout:g} s (is it reachable, and do both "
                                             f"servers share the PD secret, --pd-secret-file or $TANDEM_PD_SECRET?)")
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
