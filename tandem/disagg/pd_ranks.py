"""PD under tensor parallelism: every rank moves its own shard, rank i to rank i.

Agents. Each rank of a PD engine (prefill or decode) has its own transfer agent over its own
state buffers: rank 0's is the PD side's (``tandem/disagg``), a worker's is its
``WorkerTransfers``, made once the worker's shard is built (right before its plan loop; rank 0
meets it from ``PDSide.__init__``, the last thing its engine builds). Rank 0 gathers the
workers' descriptions (``RankAgent``: backend metadata, buffer addresses, device) over the
control group; the decode side's ``Hello`` carries them (``Hello.ranks``, ranks 1 .. N-1; rank
0's are the Hello's own fields), and the prefill side hands decode rank i's to its worker i
(a PEER operation), which loads it into its agent and writes a few warm-up bytes to that
rank's scratch (connection setup is paid at handshake, as rank 0 does). Pairing is rank i with
rank i, so both engines must have the same group size: the handshake compares
``model.tensor_parallel_size`` of the layouts and refuses unequal sizes with an error naming it.

Writes. The prefill side's rank 0 decides everything as with one rank: which pages pair with
which (page ids are the same on every rank: one coordinator), when a chunk's pages are final,
when the transfer is done or failed. For each page write it posts its own and tells the
workers the same page pairs (a WRITE operation keyed by the write's in-flight owner); worker i
plans its own descriptors (its registry, decode rank i's buffer addresses) and writes its shard
to decode rank i. Operations travel in TRANSFER plans (no forward pass) that rank 0 sends from
the PD side's poll while it has operations to send or worker writes outstanding; every worker
answers each with the outcomes resolved since its last answer.

Completion (I7). A page write counts as done only when rank 0's write and every worker's have
resolved DONE (each landed in decode rank i's memory). The prefill side writes the metadata row
with its notification only after all of a transfer's page writes are done, as with one rank;
the last pages travel in the same write as the row on rank 0, so the workers' parts of them
must have resolved DONE before that write is posted (``post_last``). Decode rank 0, the only
rank that receives notifications, thus admits the request only after every rank's pages and the
row landed. The decode side's completion path does not change.

Failures. A worker's failed write fails its page write, hence the transfer, through the
single-rank path: source pages stay held until every rank's part resolved (I2), the decode side
gets ``TransferFailed`` (then ``Drained`` once every rank's writes resolved) and frees its pages,
the client gets the error. A write still pending ``drain_timeout`` after its transfer ended is
cancelled on every rank. A worker that dies ends the engine (``launcher.py``), never a hang.

Poison order on the decode side: freed pages are poisoned on the workers when rank 0's page
operations reach them (the next plan). Rank 0 sends them (``flush_pages``) before it hands
out destination pages, so no poison replayed late lands over pages a new transfer wrote.
"""
from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import msgspec

from tandem.disagg.agent_support import compute_done_event, warm_up_scratch
from tandem.parallel.control import exchange
from tandem.transfer.rank_operations import CANCEL, PEER, WRITE, TransferOperation, TransferReport, WriteOutcome
from tandem.transfer.connector import WriteStatus
from tandem.transfer.messages import RankAgent

logger = logging.getLogger("tandem.pd")

RECEIVER_PROGRESS_SECONDS = 0.002  # a decode worker's agent progresses this often
WARM_UP = "warm-up:"  # key prefix of a worker's warm-up write to a new decode engine


# -- rank 0 -------------------------------------------------------------------------------------------


class RankFanOut:
    """Rank 0's side: the workers' agents, the operations for the next TRANSFER plan, and each
    WRITE's outcomes per worker. Owner: the PD side of a tensor-parallel engine (rank 0)."""

    def __init__(self, parallel) -> None:
        self.parallel = parallel
        decoder = msgspec.msgpack.Decoder(RankAgent)
        self.agents: list[RankAgent] = [decoder.decode(data) for data in exchange(parallel.groups.control, b"")[1:]]
        self.num_workers = parallel.groups.size - 1
        self.operations: list[TransferOperation] = []
        self.outcomes: dict[str, list[WriteOutcome]] = {}  # key -> outcomes so far (one per worker)
        self.cancelled: set[str] = set()
        self.report_decoder = msgspec.msgpack.Decoder(TransferReport)

    def add_peer(self, identity: str, agents: list[RankAgent]) -> Optional[str]:
        """Load a decode engine's ranks 1 .. N-1 into the workers' agents; an error, or None."""
        if len(agents) != self.num_workers:
            return (f"tensor_parallel_size: the prefill server has {self.num_workers + 1} ranks, the decode "
                    f"server described {len(agents) + 1}")
        self.operations.append(TransferOperation(PEER, identity, agents=list(agents)))
        self.outcomes[identity] = []
        # each worker's warm-up write, polled until it resolves: awaited from the start, as it may
        # resolve in the very report that answers the peer (a write that completes when posted)
        self.outcomes[WARM_UP + identity] = []
        self.sync()
        outcomes = self.outcomes.pop(identity, [])
        failed = [outcome.error for outcome in outcomes if not outcome.done]
        if len(outcomes) < self.num_workers or failed:
            self.outcomes.pop(WARM_UP + identity, None)
            return ("a prefill rank cannot load the decode engine's transfer metadata: "
                    f"{'; '.join(failed) or 'no answer'}")
        return None

    def post(self, key: str, identity: str, pairs_per_group: list[list[tuple[int, int]]]) -> None:
        """Every worker writes ``pairs_per_group`` of its shard to the decode engine's same rank."""
        self.operations.append(TransferOperation(WRITE, key, peer=identity, pairs=pairs_per_group))
        self.outcomes[key] = []

    def cancel(self, key: str) -> None:
        if key in self.outcomes and key not in self.cancelled:
            self.cancelled.add(key)
            self.operations.append(TransferOperation(CANCEL, key))

    def outcome(self, key: str) -> Optional[tuple[WriteStatus, str, int]]:
        """None while a worker's part of write ``key`` is pending; else DONE, or ERROR and why, and
        the bytes the workers moved (the key is forgotten then)."""
        outcomes = self.outcomes.get(key)
        if outcomes is None:
            return WriteStatus.DONE, "", 0
        if len(outcomes) < self.num_workers:
            return None
        del self.outcomes[key]
        self.cancelled.discard(key)
        errors = [outcome.error for outcome in outcomes if not outcome.done]
        num_bytes = sum(outcome.num_bytes for outcome in outcomes)
        return (WriteStatus.ERROR, "; ".join(errors), num_bytes) if errors else (WriteStatus.DONE, "", num_bytes)

    def errors(self, key: str) -> Optional[str]:
        """Without forgetting the key: None while a worker's part of write ``key`` is pending,
        else the workers' errors ("" when every part is DONE)."""
        outcomes = self.outcomes.get(key)
        if outcomes is None:
            return ""
        if len(outcomes) < self.num_workers:
            return None
        return "; ".join(outcome.error for outcome in outcomes if not outcome.done)

    def pending(self) -> bool:
        return bool(self.operations) or any(len(outcomes) < self.num_workers for outcomes in self.outcomes.values())

    def sync(self, force: bool = False) -> None:
        """Send the workers a TRANSFER plan (the page operations and transfer operations since the
        last plan) and collect their outcomes; only when something is to send or awaited."""
        if not (force or self.pending()):
            return
        parallel = self.parallel
        operations, self.operations = self.operations, []
        parallel.send_transfer(operations)
        for data in exchange(parallel.groups.control, b"")[1:]:
            for outcome in self.report_decoder.decode(data).outcomes:
                if outcome.key in self.outcomes:
                    self.outcomes[outcome.key].append(outcome)
        for key in [key for key, outcomes in self.outcomes.items()
                    if key.startswith(WARM_UP) and len(outcomes) == self.num_workers]:
            for outcome in self.outcomes.pop(key):  # only the log cares
                if not outcome.done:
                    logger.warning("PD: warm-up write to decode engine %s failed: %s", key[len(WARM_UP):],
                                   outcome.error)

    def flush_pages(self) -> None:
        """Send rank 0's pending page operations (poison of freed pages) to the workers now."""
        if self.parallel.pages_pending():
            self.sync(force=True)


@dataclass
class RankWrite:
    """A worker's part of one page write: posted (``handle``) once ``ready`` (a CUDA event recorded
    after this rank's forward pass was launched) completed; None in host memory."""
    descriptors: list
    ready: Any
    agent: str
    device: int
    handle: Any = None


# -- workers ------------------------------------------------------------------------------------------


class WorkerTransfers:
    """A worker's own transfer agent over its shard's buffers, driven by TRANSFER plans.
    Owner: the worker's plan loop (``worker.py``); closed when the loop ends."""

    def __init__(self, config, groups, registry) -> None:
        from tandem.transfer.config import failure_seed_from_environment
        from tandem.transfer.backends import create_backend
        from tandem.transfer.control import advertised_host
        from tandem.transfer.descriptors import buffer_addresses, buffer_regions, tensor_region

        transfer = config.transfer
        self.rank, self.registry = groups.rank, registry
        self.control = groups.control
        name = f"tandem-{transfer.role}-{uuid.uuid4().hex[:16]}-rank{self.rank}"
        self.backend = create_backend(transfer.backend, name,
                                      failure_probability=transfer.injected_failure_probability,
                                      seed=failure_seed_from_environment() + self.rank,
                                      progress_thread=transfer.progress_thread,
                                      host=advertised_host(transfer.bootstrap_address),
                                      connect_timeout=transfer.connect_timeout, timeout=transfer.transfer_timeout)
        regions = buffer_regions(registry)
        self.device_index = regions[0].device if regions else -1
        # the first write of each new pair (connection setup) goes here, at handshake (as rank 0's)
        self.scratch = warm_up_scratch(transfer.role, self.device_index)
        self.backend.register(regions + [tensor_region(self.scratch)])
        # decode engine id -> (agent name, its rank's agent, the planner of writes into its pages)
        self.peers: dict[str, tuple[str, RankAgent, Any]] = {}
        self.writes: dict[str, RankWrite] = {}
        self.outcomes: list[WriteOutcome] = []
        self.encoder = msgspec.msgpack.Encoder()
        agent = RankAgent(self.backend.local_metadata(), buffer_addresses(registry), self.device_index,
                          self.scratch.data_ptr())
        exchange(self.control, self.encoder.encode(agent))
        self.closed = threading.Event()
        self.pump = None
        if transfer.role == "decode" and not transfer.progress_thread:
            self.pump = threading.Thread(target=self.progress_receiver, name="tandem-pd-rank-progress", daemon=True)
            self.pump.start()

    def progress_receiver(self) -> None:
        """A receiving rank's agent must make progress for its peers' connections to form (rank
        0 does it in its engine loop; a worker waits in the control group between plans). The
        notifications it drains are not used: rank 0 hears the transfer's one notification."""
        while not self.closed.wait(RECEIVER_PROGRESS_SECONDS):
            self.backend.notifications()

    def serve(self, operations: list[TransferOperation]) -> None:
        """Apply one TRANSFER plan's operations, poll the writes, answer rank 0."""
        for operation in operations:
            if operation.kind == PEER:
                self.add_peer(operation)
            elif operation.kind == WRITE:
                self.write(operation)
            elif operation.kind == CANCEL:
                self.cancel(operation.key)
        self.poll()
        outcomes, self.outcomes = self.outcomes, []
        exchange(self.control, self.encoder.encode(TransferReport(outcomes)))

    def add_peer(self, operation: TransferOperation) -> None:
        from tandem.transfer.descriptors import WritePlanner

        agent = operation.agents[self.rank - 1]
        try:
            name = self.backend.add_peer(agent.backend_metadata)
        except Exception as error:  # noqa: BLE001
            self.outcomes.append(WriteOutcome(operation.key, False, f"rank {self.rank}: {error}"))
            return
        self.peers[operation.key] = (name, agent, WritePlanner(self.registry, list(agent.buffer_addresses)))
        self.outcomes.append(WriteOutcome(operation.key, True))
        if agent.scratch_address:
            self.writes[WARM_UP + operation.key] = RankWrite(
                [(self.scratch.data_ptr(), agent.scratch_address, self.scratch.numel())], None, name, agent.device)

    def write(self, operation: TransferOperation) -> None:
        peer = self.peers.get(operation.peer)
        if peer is None:
            self.outcomes.append(WriteOutcome(operation.key, False,
                                              f"rank {self.rank} has no agent of decode engine {operation.peer}"))
            return
        plan = peer[2].plan(operation.pairs)
        if not plan.descriptors:
            self.outcomes.append(WriteOutcome(operation.key, True))
            return
        self.writes[operation.key] = RankWrite(plan.descriptors, compute_done_event(self.device_index), peer[0],
                                               peer[1].device)

    def cancel(self, key: str) -> None:
        write = self.writes.get(key)
        if write is None:
            return
        if write.handle is None or self.backend.release(write.handle):  # else it stays pending: its pages stay held
            del self.writes[key]
            self.outcomes.append(WriteOutcome(key, False, f"rank {self.rank}: cancelled"))

    def poll(self) -> None:
        for key, write in list(self.writes.items()):
            if write.handle is None:
                if write.ready is not None and not write.ready.query():
                    continue
                write.handle = self.backend.write(write.agent, write.descriptors, local_device=self.device_index,
                                                  remote_device=write.device)
            handle = write.handle
            status = self.backend.poll(handle)
            if status is WriteStatus.PENDING:
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
