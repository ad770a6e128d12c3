"""What both PD sides share: the base class that owns the control channel, the metadata rows,
the metrics and the view of every rank's transfer agent (``ranks``), and the calls the engine
core makes into a side.

Owner: ``EngineCore`` builds one side (``create_pd``) when its config has a ``transfer``
section, calls it at fixed points of a step (``poll`` first, ``after_computed`` after each
chunk, ``filter_deltas`` after sampling) and on aborts, and closes it (rank 0's agent, then the
channel). Every rank's worker moves its own shard with its own agent, rank i to rank i, rank 0's
included (``ranks``: ``tandem/disagg/pd_ranks.py``); one rank takes the same path.
"""
from __future__ import annotations

import logging
import time
import uuid

from tandem.disagg.metrics import TransferMetrics
from tandem.protocol import RequestDelta, TransferEndpoint, TransferParams, TransferStats
from tandem.disagg.pd_ranks import RankFanOut
from tandem.scheduler.sequence import Sequence
from tandem.transfer.config import TransferConfig
from tandem.transfer.control import ControlChannel
from tandem.transfer.descriptors import describe_layout
from tandem.transfer.metadata import MetadataBuffer
from tandem.step_context import StepContext

logger = logging.getLogger("tandem.pd")

# while writes or notifications are awaited (a notification is seen at the next poll: 0.25 ms
# of latency at most, for a few percent of a core while a transfer is in flight)
ACTIVE_POLL_MILLISECONDS = 0.25
IDLE_TICK_MILLISECONDS = 50  # otherwise (heartbeats, timeouts)
EXTRA_METADATA_ROWS = 16


def model_dimensions(core: StepContext) -> dict[str, int]:
    info = core.model_info
    speculator = core.speculator
    return {"vocab_size": int(info.vocab_size), "hidden_size": int(info.hidden_size),
            "num_state_layers": sum(len(group.layer_names) for group in core.registry.groups),
            # a draft's state crosses like the target's: both sides must hold the same draft
            "draft_state_layers": speculator.num_state_layers if speculator is not None else 0,
            # each rank's state is its shard: rank i pairs with rank i of an equal group
            "tensor_parallel_size": int(core.config.tensor_parallel_size)}


class PDSide:
    """What both sides share: rank 0's agent and the others', control channel, metadata rows, metrics."""

    role = ""

    def __init__(self, core: StepContext, config: TransferConfig) -> None:
        self.core = core
        self.config = config
        self.coordinator = core.coordinator
        self.scheduler = core.scheduler
        self.registry = core.registry
        self.engine_id = f"tandem-{config.role}-{uuid.uuid4().hex[:16]}"
        # rank 0's worker's transfer agent (every rank's worker holds its own: pd_ranks.py), named
        # with this engine's id: the sender its peers see on its notifications
        self.agent = core.executor.open_transfers(config, self.engine_id)
        self.device_index = self.agent.device_index
        # where each new pair's first (warm-up) write lands: beside the pages, so the connection
        # the pages take is the one set up at handshake (see PrefillSide.on_hello)
        memory = "cpu" if self.device_index < 0 else f"cuda:{self.device_index}"
        self.scratch = self.agent.scratch
        # the metadata rows sit beside the pages (device memory for device pools), so that the last
        # write of a transfer carries the last pages, the row and the notification in one request
        self.metadata = MetadataBuffer(core.config.max_num_seqs + EXTRA_METADATA_ROWS,
                                       hidden_size=int(core.model_info.hidden_size), device=memory,
                                       sanitize=core.config.sanitizer_on)
        self.agent.register_rows(self.metadata)
        self.layout = describe_layout(self.registry, architecture=core.model_info.architecture,
                                      model=model_dimensions(core), page_size=self.coordinator.page_size,
                                      metadata_row_bytes=self.metadata.row_bytes,
                                      quantization=core.model_info.quantization)
        # every rank's agent (rank 0's in process; the workers', each writing or receiving its own shard)
        self.ranks = RankFanOut(core.executor, self.agent)
        self.channel = ControlChannel(self.engine_id, config.bootstrap_address, config.control_secret())
        self.outbox: list[RequestDelta] = []
        self.metrics = TransferMetrics(config.role)
        self.last_poll = time.monotonic()
        self.stalled_batch = False  # the messages being handled queued up during a stall
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

    def idle_wait_milliseconds(self) -> float:
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

    def after_computed(self, chunk, sampled=None) -> None:
        pass

    def filter_deltas(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        return deltas

    def stats(self) -> TransferStats:
        return self.metrics.stats(self.queue_lengths(), self.channel.rejected)

    def close(self) -> None:
        try:
            self.core.executor.close_transfers()
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

    # -- shared helpers ---------------------------------------------------------------------------------
    def finish_sequence(self, sequence: Sequence, reason: str = "error") -> None:
        """End the sequence and release its references (pages held in flight stay)."""
        if not sequence.is_finished:
            self.scheduler.finish(sequence, reason)
        self.core.forget_if_done(sequence.request_id)

    def error_delta(self, sequence: Sequence, reason: str) -> RequestDelta:
        return RequestDelta(request_id=sequence.request_id, index=sequence.index, finish_reason="error",
                            error=reason, num_prompt_tokens=sequence.num_prompt_tokens)
