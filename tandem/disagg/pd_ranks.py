"""PD's page writes on every rank: each rank's worker moves its own shard, rank i to rank i.

Agents. Every rank of a PD engine (prefill or decode), rank 0 included, has its own transfer
agent over its own state buffers, held by its ``Worker`` (``RankTransfers``). A worker (ranks
1 .. N-1) makes it once its shard is built (right before its plan loop) and announces it to
rank 0 over the control group; rank 0's worker makes its own when the PD side asks (the last
thing rank 0's engine builds), named with the engine's id (the sender of its notifications)
and registering the PD side's metadata rows beside the pages. The PD side gathers every rank's
description (``RankAgent``: backend metadata, buffer addresses, device, scratch); the decode
side's ``Hello`` carries them (rank 0's as the Hello's own fields, ranks 1 .. N-1 as
``Hello.ranks``), and the prefill side hands decode rank i's to its rank i (a PEER operation),
which loads it into its agent and writes a few warm-up bytes to that rank's scratch (connection
setup is paid at handshake). Pairing is rank i with rank i, so both engines must have the same
group size: the handshake compares ``model.tensor_parallel_size`` of the layouts and refuses
unequal sizes with an error naming it. With one rank the same path runs: rank 0's worker's
agent is the engine's only one, and no TRANSFER plan is ever sent.

Writes. The PD side (``RankFanOut``; the books in ``prefill.py``, ``prefill_writes.py``) decides
everything once, for every rank: which pages pair with which (page ids are the same on every
rank: one coordinator), when a chunk's pages are final, when the transfer is done or failed.
For each page write it posts one WRITE operation (keyed by the write's in-flight owner) to every
rank; rank i plans its own descriptors (its registry, decode rank i's buffer addresses) and
writes its shard to decode rank i once its device computed the pages. Rank 0's worker gets its
operations in process, at once (its executor holds it); the workers' travel in TRANSFER plans
(no forward pass) that rank 0 sends from the PD side's poll while it has operations to send or
worker parts outstanding; every worker answers each with the outcomes resolved since its last
answer. The PD side keeps one outcome per rank per write; a write resolves once every rank's did.

Completion (I7). What belongs to rank 0 alone goes through rank 0's worker's agent: the decode
side's notifications (only decode rank 0 receives them) and the last write. A transfer's last
pages are posted to the workers at once, but rank 0's part is held (WRITE with ``hold``); once
every earlier write is done and the workers' parts of the last pages resolved DONE, the PD side
writes the metadata row and sends rank 0 a LAST operation: rank 0 posts its held part, the row
and the completion notification as ONE write, and a backend delivers a write's notification only
after all its bytes landed. Decode rank 0 thus admits the request only after every rank's pages
and the row landed. The decode side's completion path does not change.

Failures. A rank's failed write fails its page write, hence the transfer: source pages stay
held until every rank's part resolved (I2), the decode side gets ``TransferFailed`` (then
``Drained`` once every rank's writes resolved) and frees its pages, the client gets the error.
A write still pending ``drain_timeout`` after its transfer ended is cancelled on every rank (a
rank that cannot cancel a posted write keeps it pending: its pages stay held); one whose rank 0
part was never posted when its transfer ended is cancelled at once. A worker that dies ends the
engine (``launcher.py``), never a hang.

Poison order on the decode side: freed pages are poisoned on the workers when rank 0's page
operations reach them (the next plan). Rank 0 sends them (``flush_pages``) before it hands
out destination pages, so no poison replayed late lands over pages a new transfer wrote.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Optional

import msgspec

from tandem.disagg.agent_support import compute_done_event, warm_up_scratch
from tandem.parallel.control import exchange
from tandem.transfer.rank_operations import (CANCEL, LAST, PEER, WRITE, TransferOperation, TransferReport,
                                             WriteOutcome)
from tandem.transfer.connector import WriteStatus
from tandem.transfer.messages import RankAgent

logger = logging.getLogger("tandem.pd")

RECEIVER_PROGRESS_SECONDS = 0.002  # a decode worker's agent progresses this often
WARM_UP = "warm-up:"  # key prefix of a rank's warm-up write to a new decode engine


# -- the PD side (rank 0) ----------------------------------------------------------------------------


class RankFanOut:
    """The PD side's view of every rank's agent: rank 0's (its worker's, in process) and the
    workers' (through TRANSFER plans), the operations for the next plan, and each write's
    outcome per rank. Owner: the PD side (``common.py``), with one rank or several."""

    def __init__(self, parallel, local: "RankTransfers") -> None:
        self.parallel = parallel
        self.local = local  # rank 0's worker's agent
        self.num_ranks = parallel.world_size
        decoder = msgspec.msgpack.Decoder(RankAgent)
        workers = ([decoder.decode(data) for data in exchange(parallel.groups.control, b"")[1:]]
                   if self.num_ranks > 1 else [])
        self.agents: list[RankAgent] = [local.describe()] + workers  # rank r's at entry r
        self.operations: list[TransferOperation] = []  # for the workers' next TRANSFER plan
        self.outcomes: dict[str, dict[int, WriteOutcome]] = {}  # key -> rank -> its outcome
        self.expected: dict[str, set[int]] = {}  # key -> the ranks with a part of it
        self.cancelled: set[str] = set()
        self.report_decoder = msgspec.msgpack.Decoder(TransferReport)

    @property
    def workers(self) -> set[int]:
        return set(range(1, self.num_ranks))

    def send(self, operation: TransferOperation, ranks: set[int]) -> None:
        """Rank 0's part at once (in process); the workers' with the next TRANSFER plan."""
        if operation.kind != CANCEL:
            self.outcomes.setdefault(operation.key, {})
            self.expected.setdefault(operation.key, set()).update(ranks)
        if ranks - {0}:
            self.operations.append(operation)
        if 0 in ranks:
            self.record(0, self.local.apply([operation]))

    def record(self, rank: int, outcomes: list[WriteOutcome]) -> None:
        for outcome in outcomes:
            if outcome.key in self.outcomes:
                self.outcomes[outcome.key][rank] = outcome

    def add_peer(self, identity: str, agents: list[RankAgent]) -> Optional[str]:
        """Load a decode engine's ranks into every rank's agent (rank r takes ``agents[r]``), each
        then warming its connection up; an error, or None."""
        if len(agents) != self.num_ranks:
            return (f"tensor_parallel_size: the prefill server has {self.num_ranks} ranks, the decode "
                    f"server described {len(agents)}")
        ranks = set(range(self.num_ranks))
        # each rank's warm-up write, polled until it resolves: awaited from the start, as it may
        # resolve in the very answer to the peer (a write that completes when posted)
        self.outcomes[WARM_UP + identity], self.expected[WARM_UP + identity] = {}, set(ranks)
        self.send(TransferOperation(PEER, identity, agents=list(agents)), ranks)
        self.sync()
        outcomes = self.outcomes.pop(identity, {})
        self.expected.pop(identity, None)
        failed = [outcome.error for outcome in outcomes.values() if not outcome.done]
        if len(outcomes) < self.num_ranks or failed:
            self.outcomes.pop(WARM_UP + identity, None)
            self.expected.pop(WARM_UP + identity, None)
            self.local.remove_peer(identity)  # (the workers that loaded it keep a peer nothing is written to)
            return f"cannot load the decode engine's transfer metadata: {'; '.join(failed) or 'no answer'}"
        return None

    def post(self, key: str, identity: str, pairs_per_group: list[list[tuple[int, int]]], hold: bool) -> None:
        """Every rank writes ``pairs_per_group`` of its shard to the decode engine's same rank;
        ``hold``: rank 0's part waits for ``post_last`` (the workers' parts go at once)."""
        operation = TransferOperation(WRITE, key, peer=identity, pairs=pairs_per_group)
        self.send(operation, self.workers)
        self.send(TransferOperation(WRITE, key, peer=identity, pairs=pairs_per_group, hold=hold), {0})

    def post_last(self, key: str, identity: str, row: list[tuple[int, int, int]], notification: bytes,
                  ready=None) -> None:
        """Rank 0 posts its held part of write ``key`` (if any) with ``row`` and ``notification``
        in one write (I7: the notification is delivered once all its bytes landed); ``ready``: the
        CUDA event after the row's copy to the device (``MetadataBuffer.stage``), which the
        write's reads wait for."""
        self.local.row_ready[key] = ready
        self.send(TransferOperation(LAST, key, peer=identity, row=row, notification=notification), {0})

    def cancel(self, key: str) -> None:
        if key in self.outcomes and key not in self.cancelled:
            self.cancelled.add(key)
            self.send(TransferOperation(CANCEL, key), set(range(self.num_ranks)))

    def posted(self, key: str) -> bool:
        """Whether rank 0's part of write ``key`` was posted (or resolved)."""
        return self.local.posted(key)

    def unresolved(self, key: str, ranks: Optional[set[int]] = None) -> set[int]:
        expected = self.expected.get(key, set()) if ranks is None else self.expected.get(key, set()) & ranks
        return expected - set(self.outcomes.get(key, {}))

    def outcome(self, key: str) -> Optional[tuple[WriteStatus, str, int]]:
        """None while a rank's part of write ``key`` is pending; else DONE, or ERROR and why, and
        the bytes every rank moved (the key is forgotten then)."""
        outcomes = self.outcomes.get(key)
        if outcomes is None:
            return WriteStatus.DONE, "", 0
        if self.unresolved(key):
            return None
        del self.outcomes[key]
        self.expected.pop(key, None)
        self.cancelled.discard(key)
        errors = [outcome.error for outcome in outcomes.values() if not outcome.done]
        num_bytes = sum(outcome.num_bytes for outcome in outcomes.values())
        return (WriteStatus.ERROR, "; ".join(errors), num_bytes) if errors else (WriteStatus.DONE, "", num_bytes)

    def part_errors(self, key: str) -> Optional[str]:
        """Without forgetting the key: None while a worker's part of write ``key`` is pending,
        else the errors of every part resolved so far ("" when each is DONE)."""
        if self.unresolved(key, self.workers):
            return None
        outcomes = self.outcomes.get(key, {})
        return "; ".join(outcome.error for _, outcome in sorted(outcomes.items()) if not outcome.done)

    def workers_pending(self) -> bool:
        return bool(self.operations) or any(self.unresolved(key, self.workers) for key in self.expected)

    def pending(self) -> bool:
        """A rank's part of a write (or a warm-up) is still out."""
        return bool(self.operations) or any(self.unresolved(key) for key in self.expected)

    def sync(self, force: bool = False) -> None:
        """Poll rank 0's writes; send the workers a TRANSFER plan (the page operations and
        transfer operations since the last plan) and collect their outcomes, only when something
        is to send or awaited there."""
        self.record(0, self.local.apply([]))
        if self.num_ranks > 1 and (force or self.workers_pending()):
            parallel = self.parallel
            operations, self.operations = self.operations, []
            parallel.send_transfer(operations)
            for rank, data in enumerate(exchange(parallel.groups.control, b"")[1:], start=1):
                self.record(rank, self.report_decoder.decode(data).outcomes)
        for key in [key for key in self.outcomes if key.startswith(WARM_UP) and not self.unresolved(key)]:
            self.expected.pop(key, None)
            for outcome in self.outcomes.pop(key).values():  # only the log cares
                if not outcome.done:
                    logger.warning("PD: warm-up write to decode engine %s failed: %s", key[len(WARM_UP):],
                                   outcome.error)

    def flush_pages(self) -> None:
        """Send rank 0's pending page operations (poison of freed pages) to the workers now."""
        if self.num_ranks > 1 and self.parallel.pages_pending():
            self.sync(force=True)


@dataclass
class RankWrite:
    """A rank's part of one write: posted (``handle``) once ``ready`` (a CUDA event recorded
    after this rank's forward pass was launched) completed and it is not ``held``; None ready
    in host memory."""
    descriptors: list
    ready: Any
    agent: str
    device: int
    handle: Any = None
    held: bool = False  # rank 0's part of a transfer's last pages: posted by LAST
    cancelled: bool = False  # asked to cancel, the backend could not yet
    notification: bytes = b""
    row_ready: Any = None  # LAST: the event after the metadata row's copy to the device (the write waits on it)


# -- every rank's worker ------------------------------------------------------------------------------


class RankTransfers:
    """A rank's own transfer agent over its shard's buffers, driven by transfer operations
    (rank 0's in process, a worker's by TRANSFER plans). Owner: the rank's ``Worker``; closed
    with it (rank 0's when the PD side closes)."""

    def __init__(self, transfer, rank: int, registry, name: str) -> None:
        from tandem.transfer.config import failure_seed_from_environment
        from tandem.transfer.backends import create_backend
        from tandem.transfer.control import advertised_host
        from tandem.transfer.descriptors import buffer_regions, tensor_region

        self.rank, self.registry = rank, registry
        self.backend = create_backend(transfer.backend, name,
                                      failure_probability=transfer.injected_failure_probability,
                                      seed=failure_seed_from_environment() + self.rank,
                                      progress_thread=transfer.progress_thread,
                                      host=advertised_host(transfer.bootstrap_address),
                                      connect_timeout=transfer.connect_timeout, timeout=transfer.transfer_timeout)
        regions = buffer_regions(registry)
        self.device_index = regions[0].device if regions else -1
        # the first write of each new pair (connection setup) goes here, at handshake
        self.scratch = warm_up_scratch(transfer.role, self.device_index)
        self.backend.register(regions + [tensor_region(self.scratch)])
        # decode engine id -> (agent name, its rank's agent, the planner of writes into its pages)
        self.peers: dict[str, tuple[str, RankAgent, Any]] = {}
        self.writes: dict[str, RankWrite] = {}
        self.outcomes: list[WriteOutcome] = []
        self.rows: list[int] = []  # rank 0: its metadata rows, [address, row bytes, number of rows]
        self.row_ready: dict[str, Any] = {}  # rank 0: a LAST's row event, by key, until the LAST is applied
        self.encoder = msgspec.msgpack.Encoder()
        self.closed = threading.Event()
        self.pump = None
        # Decode rank 0's agent progresses in its engine loop (the PD side reads its notifications)
        if transfer.role == "decode" and not transfer.progress_thread and rank > 0:
            self.pump = threading.Thread(target=self.progress_receiver, name="tandem-pd-rank-progress", daemon=True)
            self.pump.start()

    def register(self, regions: list) -> None:
        """More memory the peers may write into; before ``describe``."""
        self.backend.register(regions)

    def register_rows(self, metadata) -> None:
        """Rank 0: the PD side's metadata rows (a ``MetadataBuffer``), registered and described
        to peers; before ``describe``."""
        from tandem.transfer.descriptors import tensor_region

        self.backend.register([tensor_region(metadata.tensor)])
        self.rows = [metadata.address(0), metadata.row_bytes, metadata.num_rows]

    def describe(self) -> RankAgent:
        from tandem.transfer.descriptors import buffer_addresses

        return RankAgent(self.backend.local_metadata(), buffer_addresses(self.registry), self.device_index,
                         self.scratch.data_ptr(), page_counts(self.registry), list(self.rows))

    def announce(self, control) -> None:
        """A worker's description, to rank 0 over the control group (``RankFanOut`` gathers them)."""
        exchange(control, self.encoder.encode(self.describe()))

    def notifications(self):
        """The notifications this agent received (decode rank 0: completions)."""
        return self.backend.notifications()

    def progress_receiver(self) -> None:
        """A receiving rank's agent must make progress for its peers' connections to form (rank
        0 does it in its engine loop; a worker waits in the control group between plans). The
        notifications it drains are not used: rank 0 hears the transfer's one notification."""
        while not self.closed.wait(RECEIVER_PROGRESS_SECONDS):
            self.backend.notifications()

    def serve(self, operations: list[TransferOperation], control) -> None:
        """A worker: apply one TRANSFER plan's operations, answer rank 0."""
        exchange(control, self.encoder.encode(TransferReport(self.apply(operations))))

    def apply(self, operations: list[TransferOperation]) -> list[WriteOutcome]:
        """Apply operations, poll the writes; the outcomes resolved since the last call."""
        for operation in operations:
            if operation.kind == PEER:
                self.add_peer(operation)
            elif operation.kind == WRITE:
                self.write(operation)
            elif operation.kind == LAST:
                self.last(operation)
            elif operation.kind == CANCEL:
                self.cancel(operation.key)
        self.poll()
        outcomes, self.outcomes = self.outcomes, []
        return outcomes

    def posted(self, key: str) -> bool:
        write = self.writes.get(key)
        return write is None or write.handle is not None

    def add_peer(self, operation: TransferOperation) -> None:
        from tandem.transfer.descriptors import WritePlanner

        agent = operation.agents[self.rank]
        try:
            name = self.backend.add_peer(agent.backend_metadata)
        except Exception as error:  # noqa: BLE001
            self.outcomes.append(WriteOutcome(operation.key, False, f"rank {self.rank}: {error}"))
            return
        planner = WritePlanner(self.registry, list(agent.buffer_addresses))
        self.peers[operation.key] = (name, agent, planner)
        self.backend.prepare(name, block_runs(self.registry, planner, agent, self.rows), self.device_index,
                             agent.device)
        self.outcomes.append(WriteOutcome(operation.key, True))
        if agent.scratch_address:
            self.writes[WARM_UP + operation.key] = RankWrite(
                [(self.scratch.data_ptr(), agent.scratch_address, self.scratch.numel())], None, name, agent.device)

    def remove_peer(self, key: str) -> None:
        """Forget a decode engine whose handshake failed (its warm-up write first, if it can go)."""
        self.cancel(WARM_UP + key)
        self.outcomes = [outcome for outcome in self.outcomes if outcome.key != WARM_UP + key]
        peer = self.peers.get(key)
        if peer is not None and not any(write.agent == peer[0] for write in self.writes.values()):
            del self.peers[key]
            self.backend.remove_peer(peer[0])

    def write(self, operation: TransferOperation) -> None:
        peer = self.peers.get(operation.peer)
        if peer is None:
            self.outcomes.append(WriteOutcome(operation.key, False,
                                              f"rank {self.rank} has no agent of decode engine {operation.peer}"))
            return
        plan = peer[2].plan(operation.pairs)
        if not plan.descriptors and not operation.hold:
            self.outcomes.append(WriteOutcome(operation.key, True))
            return
        self.writes[operation.key] = RankWrite(plan.descriptors, compute_done_event(self.device_index), peer[0],
                                               peer[1].device, held=operation.hold)

    def last(self, operation: TransferOperation) -> None:
        """Post the held write ``key`` (a new one without pages) with the row and notification."""
        row_ready = self.row_ready.pop(operation.key, None)
        write = self.writes.get(operation.key)
        if write is None and not operation.row:
            return  # nothing held (its part resolved when it was posted)
        if write is None:
            peer = self.peers.get(operation.peer)
            if peer is None:
                self.outcomes.append(WriteOutcome(operation.key, False,
                                                  f"rank {self.rank} has no agent of decode engine {operation.peer}"))
                return
            write = self.writes[operation.key] = RankWrite([], None, peer[0], peer[1].device, held=True)
        write.descriptors = write.descriptors + [tuple(descriptor) for descriptor in operation.row]
        write.notification, write.held, write.row_ready = operation.notification, False, row_ready

    def cancel(self, key: str) -> None:
        write = self.writes.get(key)
        if write is None:
            return
        write.cancelled = True
        # a posted write the backend cannot cancel stays pending (its pages stay held); tried
        # again at each poll until it resolves
        if write.handle is None or self.backend.release(write.handle):
            del self.writes[key]
            self.outcomes.append(WriteOutcome(key, False, f"rank {self.rank}: cancelled"))

    def poll(self) -> None:
        for key, write in list(self.writes.items()):
            if write.handle is None:
                # pages wait for their forward pass here, on the host, never as ``ready`` (a wait on
                # a pair's stream would hold every later write of that pair, another transfer's
                # row among them, behind this forward pass); the row's copy is microseconds
                if write.held or (write.ready is not None and not write.ready.query()):
                    continue
                write.handle = self.backend.write(write.agent, write.descriptors, local_device=self.device_index,
                                                  remote_device=write.device, notification=write.notification,
                                                  ready=write.row_ready)
                write.descriptors, write.ready, write.row_ready = [], None, None
            handle = write.handle
            status = self.backend.poll(handle)
            if status is WriteStatus.PENDING:
                if write.cancelled:
                    self.cancel(key)
                continue
            self.backend.release(handle)
            del self.writes[key]
            error = "" if status is WriteStatus.DONE else f"rank {self.rank}: {handle.error}"
            self.outcomes.append(WriteOutcome(key, status is WriteStatus.DONE, error, handle.num_bytes))

    def close(self) -> None:
        self.closed.set()
        if self.pump is not None:
            self.pump.join()
        self.backend.close()


def page_counts(registry) -> list[int]:
    """Pages of each registry buffer, in registry order (a peer's ``RankAgent.page_counts``)."""
    return [int(descriptor.tensor.shape[0]) for descriptor in registry.buffers()]


def block_runs(registry, planner, agent: RankAgent, rows: list[int]) -> list:
    """What writes to ``agent`` move, as runs of blocks on both sides (``block_index``): each span
    of ``planner`` (a state group's pool, or a layer-major buffer) and, from rank 0, the metadata
    rows. Empty where the peer did not say its pools' sizes."""
    from tandem.transfer.block_index import BlockRuns, Blocks

    if len(agent.page_counts) != len(agent.buffer_addresses):
        return []
    index_of = {descriptor.key: index for index, descriptor in enumerate(registry.buffers())}
    local_counts = page_counts(registry)
    runs = [BlockRuns(Blocks(span.local, span.stride, span.length, local_counts[index_of[span.keys[0]]]),
                      Blocks(span.remote, span.stride, span.length, agent.page_counts[index_of[span.keys[0]]]))
            for span in planner.spans]
    if rows and len(agent.rows) == 3 and agent.rows[1] == rows[1]:
        runs.append(BlockRuns(Blocks(rows[0], rows[1], rows[1], rows[2]),
                              Blocks(agent.rows[0], agent.rows[1], agent.rows[1], agent.rows[2])))
    return runs
