"""Rank 0's side of tensor parallelism: start the workers, join the group, hand every rank's
worker each step's message (rank 0's in process), watch the workers, stop them.

Owner: the engine core (rank 0) creates one ``MultiprocessExecutor`` (``executor.py``) before it
builds its model and closes it at shutdown. The workers are child processes (``python -m tandem.engine.ranks.worker``); each
dies with its parent (``PR_SET_PDEATHSIG``) and is killed at close. Lifecycle when a worker dies: a watcher thread notices
at once, kills the other workers and marks the group failed; rank 0's next (or pending)
collective then fails (gloo: the peer's sockets are closed), the engine's step raises, and an
engine process exits non-zero (``check`` also raises while the engine is idle). On CUDA, where an
NCCL collective may wait on a dead peer instead of failing, the watcher ends the process
(exit status 1) if it is still running a few seconds later.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import subprocess
import sys
import threading
import weakref
from dataclasses import replace
from typing import Optional

import msgspec
import torch

from tandem.config import EngineConfig
from tandem.kv.page_operations import Outbox
from tandem.kv.planner import PoolPlan
from tandem.models.loader import check_tensor_parallel
from tandem.parallel.control import exchange, smallest
from tandem.parallel.graphs import capture_mixed_on_every_rank, capture_on_every_rank
from tandem.parallel.group import join, open_store, rank_device
from tandem.engine.process import with_sleeping_openmp_threads
from tandem.engine.ranks.executor import Executor, RankContext, draft_plan, rank_call
from tandem.engine.ranks.plan import DISK, PAGES, RPC, STOP, TRANSFER, PlanChannel, StepPlan

logger = logging.getLogger("tandem.parallel")

STOP_TIMEOUT_SECONDS = 10.0  # how long workers may take to exit after a STOP plan
CUDA_HANG_GRACE_SECONDS = 5.0  # after a worker died: how long a stuck NCCL collective may wait


def agree_on_pages(plan: PoolPlan, control) -> PoolPlan:
    """Every rank's token-paged pools get the fewest pages any rank can hold (per-sequence pools
    are sized from ``max_num_seqs``: equal already)."""
    return replace(plan, num_pages=smallest(control, plan.num_pages))


class RankFailure(RuntimeError):
    """A rank died or rank 0's forward pass failed mid-step: the group cannot run another step
    (the engine core lets this one end the engine instead of failing only the step's requests)."""


def _stop_processes(processes: list[subprocess.Popen], closing: Optional[threading.Event] = None) -> None:
    if closing is not None:  # a deliberate stop: the watcher must not take it for a failure
        closing.set()
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        try:
            process.wait(timeout=STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            logger.error("tensor-parallel worker pid %d did not exit", process.pid)


def _wait_any(processes: list[subprocess.Popen]) -> subprocess.Popen:
    """Block until one of ``processes`` has exited; returns it."""
    descriptors = {os.pidfd_open(process.pid): process for process in processes}
    try:
        ready, _, _ = select.select(list(descriptors), [], [])
        return descriptors[ready[0]]
    finally:
        for descriptor in descriptors:
            os.close(descriptor)


class MultiprocessExecutor(Executor):
    """Ranks 1..N-1 as worker processes of this host (rank 0 is the engine core's process)."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        size = config.tensor_parallel_size
        self.world_size = size
        self.context: Optional[RankContext] = None
        check_tensor_parallel(config.model, size, max_model_len=config.max_model_len,
                              indexer_cache_dtype=config.indexer_cache_dtype, quantization=config.quantization)
        self.device = rank_device(device, 0)
        if self.device.type == "cuda":
            available = torch.cuda.device_count() - self.device.index
            if available < size:
                raise ValueError(f"tensor_parallel_size: {size} needs {size} GPUs from {self.device} on, "
                                 f"{available} available")
            torch.cuda.set_device(self.device)
        store, port = open_store(size)
        self.workers = [start_worker(config, rank, size, port) for rank in range(1, size)]
        self.failed: Optional[str] = None
        self._closing = threading.Event()
        # Whoever drops this object without closing it (a failed engine start) still stops the
        # workers; the watcher holds only a weak reference.
        self._finalizer = weakref.finalize(self, _stop_processes, list(self.workers), self._closing)
        self._watcher = threading.Thread(target=_watch, args=(weakref.ref(self), list(self.workers), self._closing),
                                         name="tandem-tp-watch", daemon=True)
        self._watcher.start()
        self.groups = join(0, size, self.device, store=store, custom_all_reduce=not config.disable_custom_all_reduce)
        self.shard = self.groups.shard
        self.channel = PlanChannel(self.groups.control, 0)
        self.outbox: Optional[Outbox] = None  # rank 0's coordinator's, once attached
        self.worker = None  # rank 0's Worker (worker.py), once attached
        self.graph_sizes: list[int] = []  # the decode graphs every rank captured (equal on all)

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> "MultiprocessExecutor":
        return cls(config, device)

    @property
    def worker_pids(self) -> list[int]:
        return [process.pid for process in self.workers]

    def agree_on_pages(self, plan: PoolPlan) -> PoolPlan:
        return agree_on_pages(plan, self.groups.control)

    def agree_on_count(self, count: int) -> int:
        return smallest(self.groups.control, count)

    def page_operations(self) -> list:
        """The page operations rank 0 applied since the last plan, for the next one."""
        return self.outbox.take() if self.outbox is not None else []

    def pages_pending(self) -> bool:
        return self.outbox is not None and self.outbox.pending()

    def flush(self) -> None:
        """Send the page operations recorded since the last plan now (an idle engine: its
        tiers' writes reach the other ranks' stores without waiting for the next step)."""
        self.check()
        if self.pages_pending():
            self.channel.send(StepPlan(PAGES, self.page_operations()))

    def send_transfer(self, operations: list) -> None:
        """A TRANSFER plan: the page operations so far and PD's transfer operations for the
        workers' own agents (``tandem/disagg/pd_ranks.py``); no forward pass."""
        self.check()
        self.channel.send(StepPlan(TRANSFER, self.page_operations(), transfer_operations=operations))

    def execute_draft(self, step, inputs_from_root: bool, input_ids: torch.Tensor,
                      hidden: Optional[torch.Tensor]) -> torch.Tensor:
        """A sharded draft's pass over ``step``'s rows: the DRAFT plan to the other ranks, then
        rank 0's worker runs it (``Worker.draft``: every rank the same pass; rank 0 broadcasts
        ``hidden`` and, ``inputs_from_root``, its device ``input_ids`` first)."""
        self.check()
        plan = draft_plan(step, inputs_from_root, hidden)
        self.channel.send(StepPlan.of_draft(plan, self.page_operations()))
        return self._on_rank_zero("draft pass", self.worker.draft, plan, input_ids, hidden)

    def agree_on_disk_reads(self, keys: list[bytes], count: int) -> int:
        """How many leading pages of ``keys`` every rank read from its own store (rank 0 read
        ``count``): a DISK plan (with the page operations so far) asks the others."""
        self.check()
        self.channel.send(StepPlan(DISK, self.page_operations(), disk_keys=list(keys)))
        return smallest(self.groups.control, count)

    def attach(self, coordinator, runner) -> None:
        """Record the page operations rank 0's coordinator applies (its outbox) for the other
        ranks; rank 0 answers its own calls with its coordinator and runner."""
        coordinator.outbox.record_for_other_ranks()
        self.outbox = coordinator.outbox
        self.context = RankContext(coordinator, runner)

    def attach_worker(self, worker) -> None:
        self.worker = worker

    def collective_rpc(self, method: str, *arguments) -> list:
        """An RPC plan (with the page operations so far) names the call; every rank answers
        it, rank 0 here, and the answers are gathered over the control group (msgpack)."""
        call = rank_call(method)
        if self.context is None:
            raise RuntimeError("collective_rpc: the executor is not attached to the engine's coordinator yet")
        self.check()
        self.channel.send(StepPlan(RPC, self.page_operations(), rpc_method=method,
                                   rpc_arguments=msgspec.msgpack.encode(list(arguments))))
        answers = exchange(self.groups.control, msgspec.msgpack.encode(call(self.context, *arguments)))
        return [msgspec.msgpack.decode(answer) for answer in answers]

    def execute_step(self, plan):
        """The STEP plan to the other ranks (after the page operations rank 0 applied since the
        last message), then rank 0's worker runs the same forward pass (``Worker.execute``)."""
        self.check()
        self.channel.send(StepPlan.of_forward(plan, self.page_operations()))
        return self._on_rank_zero("forward pass", self.worker.execute, plan)

    def sample(self, plan):
        """Rank 0's worker samples the step it ran last: the other ranks sample nothing and wait
        in no collective for it, so a failure here stops no rank."""
        return self.worker.sample(plan)

    def verify(self, plan):
        """Rank 0's worker verifies the step it ran last (like ``sample``: rank 0 alone)."""
        return self.worker.verify(plan)

    def _on_rank_zero(self, what: str, call, *arguments):
        """Rank 0's part of a message the other ranks already run: if it raises, they wait inside
        its collectives, so they are stopped (``fail``) and every later message raises."""
        try:
            return call(*arguments)
        except Exception as error:
            self.fail(f"rank 0's {what} failed ({type(error).__name__}: {error})")
            raise

    def capture_graphs(self, runner, batch_sizes: list[int], max_model_len: int, max_num_batched_tokens: int) -> None:
        """Rank 0's side of ``capture_on_every_rank`` (the workers run theirs at start-up)."""
        self.graph_sizes = capture_on_every_rank(runner, self.groups, batch_sizes, max_model_len,
                                                 max_num_batched_tokens)

    def capture_mixed_graphs(self, runner, token_sizes: list[int]) -> list[int]:
        """Rank 0's side of ``capture_mixed_on_every_rank``."""
        return capture_mixed_on_every_rank(runner, self.groups, token_sizes)

    def check(self) -> None:
        if self.failed is not None:
            raise RankFailure(self.failed)

    def fail(self, reason: str) -> None:
        """Rank 0 cannot finish a step the workers started (its forward pass raised): stop them;
        every later step raises ``RankFailure``."""
        if self.failed is None:
            self.failed = f"tensor_parallel_size: {reason}; the engine cannot continue"
            logger.error("%s", self.failed)
        _stop_processes(self.workers, self._closing)

    def close(self) -> None:
        """Stop the workers (a STOP plan, then kill what is left) and leave the group."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self.failed is None:
            try:
                self.channel.send(StepPlan(STOP, self.page_operations()))  # (the last page operations: disk writes)
                self.channel.settle()
            except RuntimeError:  # a worker died meanwhile: it is killed below
                logger.warning("tensor-parallel workers did not take the stop plan")
        for process in self.workers:
            try:
                process.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        self._finalizer()


def _watch(owner: "weakref.ref[MultiprocessExecutor]", workers: list[subprocess.Popen], closing: threading.Event) -> None:
    """The watcher thread: the first worker to exit, unless asked to, fails the group."""
    dead = _wait_any(workers)
    group = owner()
    if closing.is_set() or group is None:
        return
    group.failed = (f"tensor_parallel_size: rank {workers.index(dead) + 1} (pid {dead.pid}) exited "
                    f"with status {dead.wait()}; the engine cannot continue")
    logger.error("%s", group.failed)
    _stop_processes(workers)
    cuda = group.device.type == "cuda"
    del group
    if cuda and not closing.wait(CUDA_HANG_GRACE_SECONDS):
        logger.error("ending the engine process: a collective may be waiting on the dead rank")
        os._exit(1)


def start_worker(config: EngineConfig, rank: int, size: int, port: int) -> subprocess.Popen:
    """``python -m tandem.engine.ranks.worker``, the config on its standard input (JSON), its
    idle OpenMP threads asleep (``process.with_sleeping_openmp_threads``: the worker module loads
    torch first thing, so only its environment at start can say it)."""
    log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    process = subprocess.Popen([sys.executable, "-m", "tandem.engine.ranks.worker", str(rank), str(size), str(port),
                                log_level], stdin=subprocess.PIPE, env=with_sleeping_openmp_threads(os.environ))
    process.stdin.write(config_to_json(config))
    process.stdin.close()
    return process


def config_to_json(config: EngineConfig) -> bytes:
    """The config for a worker's standard input (a PD role's secret too, as hex: never in argv)."""
    fields = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    if config.transfer is not None:
        transfer = dataclasses.asdict(config.transfer)
        transfer["secret"] = config.transfer.secret.hex() if config.transfer.secret is not None else None
        fields["transfer"] = transfer
    return json.dumps(fields).encode()


def config_from_json(data: bytes) -> EngineConfig:
    from tandem.transfer.config import TransferConfig

    fields = json.loads(data)
    for name in ("cuda_graph_sizes", "mixed_step_graph_sizes"):
        if fields.get(name) is not None:
            fields[name] = tuple(fields[name])
    transfer = fields.get("transfer")
    if transfer is not None:
        secret = transfer.pop("secret")
        fields["transfer"] = TransferConfig(**transfer, secret=bytes.fromhex(secret) if secret is not None else None)
    return EngineConfig(**fields)
