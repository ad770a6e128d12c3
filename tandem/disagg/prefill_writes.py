"""The prefill side's page writes: each chunk's final pages posted to every rank's worker (rank
0's included: ``pd_ranks.RankFanOut``) as one write, its progress (one outcome per rank),
failure and cancellation, and the last write (rank 0's part of the last chunk's pages, the
metadata row and the completion notification, posted on rank 0's worker once every earlier
write is done and the other ranks' parts of the last pages landed: I7).

A mixin of :class:`tandem.disagg.prefill.PrefillSide`, which holds the transfers, the peers and
the view of every rank's agent (``ranks``) these methods use.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from tandem.disagg.transfers import PendingWrite, PrefillTransfer
from tandem.protocol import RequestDelta
from tandem.kv.block_pool import SanitizerError
from tandem.kv.planner import NULL_PAGE
from tandem.transfer.connector import WriteStatus
from tandem.transfer.messages import done_notification
from tandem.transfer.metadata import MetadataRow
from tandem.transfer.state import TransferState

logger = logging.getLogger("tandem.pd")

# NIXL sends a write's notification from the poll that finds its bytes landed
# (``notifies_on_poll``): while a last write is in flight the engine polls without pausing, for
# at most this long after posting it
LAST_WRITE_SPIN_SECONDS = 0.05




class PrefillWrites:
    """Posting and tracking a transfer's writes (see the module docstring)."""

    def final_pages(self, transfer: PrefillTransfer, prompt_done: bool) -> list[dict[int, int]]:
        """Per group: page-table index -> page, for every entry final after the last chunk."""
        state = transfer.sequence.state
        indices = self.coordinator.pd_tables.final_page_indices(state, transfer.sequence.num_computed_tokens,
                                                                prompt_done)
        return [{index: table[index] for index in group_indices}
                for group_indices, table in zip(indices, state.page_tables)]

    def hold_until_bound(self, transfer: PrefillTransfer, pages: list[dict[int, int]], prompt_done: bool) -> None:
        """The prompt is computed before the decode side named its destination: keep its final
        pages (held in flight, so they outlive the sequence) until ``bind`` writes them."""
        new = [[page for index, page in group.items() if index not in kept and page != NULL_PAGE]
               for group, kept in zip(pages, transfer.unsent)]
        for group, kept in zip(pages, transfer.unsent):
            kept.update(group)
        transfer.unsent_done = transfer.unsent_done or prompt_done
        if any(new):
            transfer.unsent_holds.append(self.coordinator.inflight.hold(
                f"pd-wait:{transfer.room}:{len(transfer.unsent_holds)}", new))

    def push_unsent(self, transfer: PrefillTransfer) -> None:
        """The destination came: write what was computed before it, then let those pages go."""
        if any(transfer.unsent):
            self.push_pages(transfer, transfer.unsent_done, transfer.unsent)
        self.release_unsent(transfer)

    def release_unsent(self, transfer: PrefillTransfer) -> None:
        for owner in transfer.unsent_holds:
            self.coordinator.inflight.release(owner)
        transfer.unsent_holds = []
        transfer.unsent = [{} for _ in transfer.unsent]

    def push_pages(self, transfer: PrefillTransfer, prompt_done: bool,
                   pages: Optional[list[dict[int, int]]] = None) -> None:
        """Write every page that became final since the last push (whole pages, coalesced);
        ``pages``: the final entries (index -> page per group), else the sequence's own now."""
        destination = transfer.destination
        pages = pages if pages is not None else self.final_pages(transfer, prompt_done)
        pairs_per_group, sources = [], []
        for group, (group_pages, target) in enumerate(zip(pages, destination.page_tables)):
            pairs = []
            for index, page in sorted(group_pages.items()):
                if index in transfer.sent[group]:
                    continue
                transfer.sent[group].add(index)
                if index >= len(target) or target[index] == NULL_PAGE:
                    continue  # the decode side does not need it (e.g. before a sliding window)
                if page == NULL_PAGE:
                    self.end(transfer, TransferState.FAILED,
                             f"page {index} of state group {group} was released before it was sent")
                    return
                pairs.append((page, target[index]))
            pairs_per_group.append(pairs)
            sources.append([source for source, _ in pairs])
        plan = transfer.peer.planner.plan(pairs_per_group)  # the peer's spans were worked out at the handshake
        self.touched |= plan.touched
        if not plan.descriptors:  # (every rank's shard has the same buffers: nothing to write anywhere)
            return
        owner = self.coordinator.inflight.hold(f"pd-send:{transfer.room}:{transfer.num_writes}", sources)
        transfer.num_writes += 1
        transfer.first_write_at = transfer.first_write_at or time.monotonic()
        for earlier in transfer.writes:  # (one final write per transfer; should a second come, the first goes alone)
            if earlier.final:
                earlier.final = False
                self.ranks.post_last(earlier.key, transfer.peer.identity, [], b"")
        # every rank writes its shard of the same pages (the owner names the write); rank 0
        # holds its part of the final pages for the last write
        self.ranks.post(owner, transfer.peer.identity, pairs_per_group, hold=prompt_done)
        transfer.writes.append(PendingWrite(owner, owner, final=prompt_done))
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
                transfer.first_token_at = time.monotonic()
        if deltas:
            self.progress(time.monotonic())
        return passed

    def progress(self, now: float) -> None:
        self.ranks.sync()  # every rank's writes: post what is new, learn what resolved
        for transfer in list(self.transfers.values()):
            self.progress_writes(transfer, now)
            if not transfer.status.terminal and transfer.first_delta is not None \
                    and transfer.destination is not None and all(write.final for write in transfer.writes) \
                    and transfer.metadata_write is None and not self.stalled():
                self.post_last(transfer)
            if transfer.status.terminal and not transfer.outstanding:
                self.retire(transfer)

    def progress_writes(self, transfer: PrefillTransfer, now: float) -> None:
        for write in list(transfer.writes):
            if transfer.status.terminal and not self.ranks.posted(write.key):
                self.ranks.cancel(write.key)  # never posted on rank 0: the other ranks' parts end now
            elif write.final:
                continue  # rank 0's part goes with the last write
            status = self.resolve(transfer, write, now)
            if status is None:
                continue
            self.coordinator.inflight.release(write.owner)
            transfer.writes.remove(write)
            if status is WriteStatus.DONE:
                transfer.bytes_written += write.num_bytes
            elif not transfer.status.terminal:
                self.end(transfer, TransferState.FAILED, f"a page write failed: {write.error}")
        write = transfer.metadata_write
        status = self.resolve(transfer, write, now) if write is not None else None
        if status is None:
            return
        transfer.metadata_write = None
        if write.owner is not None:
            self.coordinator.inflight.release(write.owner)
        if status is WriteStatus.DONE and not transfer.status.terminal:
            transfer.bytes_written += write.num_bytes
            transfer.status.advance(TransferState.DONE)
            transfer.ended_at = now
            self.metrics.record("done", transfer.bytes_written,
                                now - (transfer.first_write_at or transfer.bound_at), bandwidth=True)
            computed = transfer.first_token_at
            self.metrics.record_phases(compute=computed - transfer.created,
                                       destination_wait=max(transfer.bound_at - computed, 0.0),
                                       last_write=now - max(computed, transfer.bound_at))
            if not transfer.suppress_delta:
                self.outbox.append(transfer.first_delta)
        elif status is WriteStatus.ERROR and not transfer.status.terminal:
            self.end(transfer, TransferState.FAILED, f"the last write (pages and metadata row) failed: "
                                                     f"{write.error}")

    def resolve(self, transfer: PrefillTransfer, write: PendingWrite, now: float) -> Optional[WriteStatus]:
        """None while a rank's part of a write is pending (cancelled on every rank once its
        transfer ended more than ``drain_timeout`` ago), else its final status, the error and
        the bytes every rank moved kept on ``write``."""
        outcome = self.ranks.outcome(write.key)
        if outcome is None:
            if transfer.status.terminal and now - transfer.ended_at > self.config.drain_timeout:
                self.cancel(transfer, write)
            return None
        write.status, write.error, write.num_bytes = outcome
        return write.status

    def cancel(self, transfer: PrefillTransfer, write: PendingWrite) -> None:
        """A failed transfer's write did not finish within drain_timeout: cancel it on every rank.
        A rank that cannot cancel its posted part keeps it pending: its pages stay held (never
        freed under a reader, I2); the write resolves once every rank's part did."""
        if write.key not in self.ranks.cancelled:
            logger.warning("PD: cancelled a write of room %s that did not finish", transfer.room)
        self.ranks.cancel(write.key)

    def prepare_row(self, transfer: PrefillTransfer, output, index: int) -> None:
        """The step that samples the first token was launched (``output``: its sampler's output
        on the device, the token in row ``index``): fill a metadata row now, the token and the
        logprobs the request asked for copied into it on the device after the sampler
        (``MetadataBuffer.prepare``), so the last write, once the token is known on the host,
        carries them without filling a row on its path. Only where the destination is known (a
        row is not held while the decode side has not answered) and no draft model's hidden
        state goes with the row; otherwise ``post_last`` fills one as before."""
        sequence = transfer.sequence
        keep = sequence.params.logprobs
        if transfer.local_row is not None or transfer.destination is None or transfer.status.terminal \
                or self.core.speculator is not None \
                or keep and (output.top_token_ids is None or output.top_token_ids.shape[1] < keep):
            return
        row = self.metadata.allocate()
        if row is None:
            return
        token = output.token_ids[index:index + 1]
        logprobs, entries = None, 0
        if keep is not None:  # as ``token_rules.reported_logprobs`` reports them: the token, then the top ``keep``
            entries = 1 + keep
            logprobs = (torch.cat([token, output.top_token_ids[index, :keep]]),
                        torch.cat([output.logprobs[index:index + 1], output.top_logprobs[index, :keep]]),
                        output.ranks[index:index + 1]) if keep else \
                (token, output.logprobs[index:index + 1], output.ranks[index:index + 1])
        transfer.local_row, transfer.row_prepared = row, True
        transfer.row_ready = self.metadata.prepare(row, MetadataRow(
            room=transfer.room, first_token=0, num_cached_tokens=max(sequence.num_cached_tokens, 0),
            logprob_token_ids=(0,) * entries, logprobs=(0.0,) * entries), token, logprobs)

    def post_last(self, transfer: PrefillTransfer) -> None:
        """The last write: rank 0's part of the final pages (if any), the metadata row and the
        notification, in one write on rank 0's worker. Every other write of the transfer is done
        (the caller checked), and a backend delivers a write's notification only after all its
        bytes landed."""
        final = transfer.writes[0] if transfer.writes else None
        if final is not None:
            # The other ranks' parts of the last pages land before the notification goes out
            # (rank 0's go in the same write as the row): the decode side reads every rank's.
            errors = self.ranks.part_errors(final.key)
            if errors is None:
                return  # retried on the next poll, once the workers answered
            if errors:
                self.end(transfer, TransferState.FAILED, f"a page write failed: {errors}")
                return
        row = transfer.local_row if transfer.local_row is not None else self.metadata.allocate()
        if row is None:
            return  # all rows busy: retried on the next poll
        transfer.local_row = row
        delta, sequence, peer = transfer.first_delta, transfer.sequence, transfer.peer
        logprobs = delta.new_logprobs[0] if delta.new_logprobs else None
        speculator = self.core.speculator
        value = MetadataRow(
            room=transfer.room, first_token=delta.new_token_ids[0],
            num_cached_tokens=max(sequence.num_cached_tokens, 0),
            logprob_token_ids=tuple(logprobs.token_ids) if logprobs else (),
            logprobs=tuple(logprobs.logprobs) if logprobs else (), rank=logprobs.rank if logprobs else 0,
            hidden_states=speculator.metadata_hidden(sequence) if speculator is not None else ())
        if transfer.row_prepared:
            staged = transfer.row_ready
            if self.core.config.sanitizer_on and (held := self.metadata.settled(row)) != value:
                raise SanitizerError(f"PD: the metadata row of room {transfer.room} filled on the device holds "
                                     f"{held}, the request's first token gives {value}")
        else:
            staged = self.metadata.stage(row, value)
        destination = peer.metadata_address + transfer.destination.metadata_row * peer.row_bytes
        if final is not None:
            transfer.writes.remove(final)
            write = PendingWrite(final.key, final.owner, last=True, posted_at=time.monotonic())
        else:
            write = PendingWrite(f"pd-row:{transfer.room}", None, last=True, posted_at=time.monotonic())
        # (the row's copy to the device, if any, is not waited for here: the write waits on ``staged``)
        self.ranks.post_last(write.key, peer.identity, [(self.metadata.address(row), destination,
                                                         self.metadata.row_bytes)],
                             done_notification(transfer.room), ready=staged)
        transfer.metadata_write = write
        transfer.status.advance(TransferState.FINISHING)
