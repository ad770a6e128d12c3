"""Executors: what connects the engine core to the ranks that execute its steps.

    Executor               the interface, what every way of running the ranks implements
      InProcessExecutor    one rank: the engine core's process is the whole group
      MultiprocessExecutor one host: a worker process per further rank (``launcher.py``)
      RayExecutor          many hosts: a Ray actor per further rank (``ray_executor.py``)

Every rank runs one ``Worker`` (``worker.py``), rank 0 included: rank 0's lives in the engine
core's process (the books beside it), the others in the processes or actors the executor
started. The executor hands each step's message to all of them (``execute_step``: the forward
plan, ``plan.ForwardPlan``; the other ranks also get the page operations rank 0's outbox recorded
since the last message, which every rank applies through the same executor,
``kv/page_operations.py``) and runs rank 0's worker on it last, returning its result; then
rank 0's worker alone samples the step (``sample``: the sampling message, ``sampling_plan.py``)
or verifies its drafts (``verify``: the verification message, ``worker/verify_plan.py``) and
runs speculation's proposer's draft passes (``draft_pass``, ``end_proposal``: host-only messages,
``spec_decode/draft_pass_plan.py``; a sharded draft's passes go to every rank, ``execute_draft``); and named calls that every rank answers
(``collective_rpc``, answers in rank order). When rank 0's part of a step the other ranks
started fails, the executor stops them (they are inside the step's collectives): the engine
cannot go on. In vLLM's words: ``execute_step`` is ``execute_model``, ``check`` is
``check_health``, ``close`` is ``shutdown``; ``start`` brings the ranks up before the engine core
builds its model (every rank builds its shard in step).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Callable, Optional

import torch

from tandem.config import EngineConfig
from tandem.kv.planner import PoolPlan
from tandem.parallel.shard import SINGLE, TensorShard


@dataclass
class RankContext:
    """What a rank's calls read: its coordinator (its shard's pools and buffers) and its model
    runner. Rank 0's is the engine core's; a worker rank's its own."""
    coordinator: Any
    runner: Any


def pool_pages(rank: RankContext) -> list[int]:
    """Pages per state group (the null page included): equal on every rank by construction."""
    return [pool.num_pages for pool in rank.coordinator.pools]


def state_bytes(rank: RankContext) -> int:
    """Bytes of this rank's state buffers (its shard of every registry buffer)."""
    return sum(descriptor.tensor.numel() * descriptor.tensor.element_size()
               for descriptor in rank.coordinator.registry.buffers())


def sanitizer_on(rank: RankContext) -> bool:
    """Whether this rank's sanitizer is on (its pools poisoned when freed: I6), as rank 0's is."""
    return bool(rank.coordinator.sanitizer.enabled)


def moved_buffers(rank: RankContext) -> dict[str, list]:
    """I1 on this rank: the registry's buffer keys, and those its movers touched since the last
    call — the tier page mover's (``tiers``) and the sanitizer's poison (``poison``); both records
    start again."""
    coordinator = rank.coordinator
    tiers = coordinator.outbox.executor.tiers
    moved = {"registry": sorted(descriptor.key for descriptor in coordinator.registry.buffers()),
             "tiers": sorted(tiers.mover.touched) if tiers is not None else [],
             "poison": sorted(coordinator.sanitizer.touched)}
    if tiers is not None:
        tiers.mover.touched.clear()
    coordinator.sanitizer.touched.clear()
    return moved


def graph_replays(rank: RankContext) -> dict[str, int]:
    """How many steps this rank replayed from its decode graphs and from its mixed-step graphs."""
    runner = rank.runner
    return {"decode": runner.graphs.num_replays if runner.graphs is not None else 0,
            "mixed": runner.mixed_graphs.num_replays if runner.mixed_graphs is not None else 0}


# The calls ``collective_rpc`` may name (nothing else runs on a rank's say-so: a worker looks the
# name up here, it never resolves an attribute from a message).
RANK_CALLS: "MappingProxyType[str, Callable[..., Any]]" = MappingProxyType({
    "pool_pages": pool_pages,
    "state_bytes": state_bytes,
    "sanitizer_on": sanitizer_on,
    "moved_buffers": moved_buffers,
    "graph_replays": graph_replays,
})


def rank_call(method: str) -> Callable[..., Any]:
    try:
        return RANK_CALLS[method]
    except KeyError:
        raise ValueError(f"collective_rpc: unknown rank call {method!r} (known: {sorted(RANK_CALLS)})") from None


def draft_plan(step, inputs_from_root: bool, hidden: Optional[torch.Tensor]):
    """The ``plan.DraftPlan`` of a sharded draft's pass over ``step``'s rows (with ``hidden``
    inputs, which rank 0 broadcasts, or none)."""
    from tandem.engine.ranks.plan import DraftPlan

    dtype = str(hidden.dtype).removeprefix("torch.") if hidden is not None else ""
    return DraftPlan(step, inputs_from_root, dtype)


class Executor(abc.ABC):
    """The ranks of one model replica, at every size (one rank: ``InProcessExecutor``). Owner:
    the engine core, which starts one before it builds its model (``start_executor``) and closes
    it at shutdown. It is rank 0's ``RankGroup`` in ``build.py``."""

    world_size: int
    device: torch.device  # rank 0's
    shard: TensorShard  # rank 0's place in the group (what its model is built with)
    graph_sizes: list[int]  # the decode graphs every rank captured (equal on all; empty: eager)

    @classmethod
    @abc.abstractmethod
    def start(cls, config: EngineConfig, device: torch.device) -> "Executor":
        """Bring up every rank other than rank 0 (they build their shards as rank 0 builds its own)."""

    @abc.abstractmethod
    def attach(self, coordinator, runner) -> None:
        """Rank 0's coordinator and model runner, once built: their page operations and steps
        are handed on from now on, and rank 0 answers its own calls with them."""

    @abc.abstractmethod
    def agree_on_pages(self, plan: PoolPlan) -> PoolPlan:
        """The pool plan every rank can hold (each rank proposes its own)."""

    @abc.abstractmethod
    def agree_on_count(self, count: int) -> int:
        """The smallest ``count`` any rank proposes."""

    @abc.abstractmethod
    def capture_graphs(self, runner, batch_sizes: list[int], max_model_len: int,
                       max_num_batched_tokens: int) -> list[int]:
        """Capture rank 0's decode graphs, in step with every other rank's; the sizes captured
        (``graph_sizes`` from then on; empty: eager)."""

    @abc.abstractmethod
    def capture_mixed_graphs(self, runner, token_sizes: list[int]) -> list[int]:
        """Capture rank 0's mixed-step graphs (``worker/mixed_graphs.py``), in step with every
        other rank's; the sizes captured (empty: steps with a prompt chunk run eagerly)."""

    @abc.abstractmethod
    def agree_on_disk_reads(self, keys: list[bytes], count: int) -> int:
        """How many leading pages of ``keys`` every rank read from its own disk store (rank 0
        read ``count``)."""

    @abc.abstractmethod
    def attach_worker(self, worker) -> None:
        """Rank 0's ``Worker``, once built: it runs every step and draft message from now on."""

    @abc.abstractmethod
    def execute_step(self, plan):
        """Hand this step's message (``plan.ForwardPlan``) to every rank's worker, rank 0's last
        (it writes its tokens still pending on its device into the rows the plan names); rank
        0's ``plan.StepOutput``."""

    @abc.abstractmethod
    def sample(self, plan):
        """Rank 0's worker samples ``plan`` (``sampling_plan.SamplingPlan``) from the logits of the
        step it ran last (the other ranks sample nothing) and keeps the token ids on its device;
        the handle of their copy to the host (``HostSamplerOutput``; None for a plan without rows)."""

    @abc.abstractmethod
    def verify(self, plan):
        """Rank 0's worker verifies ``plan`` (``worker/verify_plan.VerifyPlan``: a speculating
        step's drafts) on the logits of the step it ran last; its ``VerifyOutput`` (host values)."""

    # -- rank 0's worker alone, on host arguments (every executor holds rank 0's ``worker``) ---------
    worker: Any

    def draft_pass(self, plan):
        """Rank 0's worker runs one of speculation's proposer's draft passes
        (``spec_decode/draft_pass_plan.DraftPassPlan``; a sharded draft's on every rank, through
        ``execute_draft``); the drawn ids where the plan asks (host), else None."""
        return self.worker.draft_pass(plan, self)

    def end_proposal(self, plan):
        """Rank 0's worker ends a proposal (``ProposalEnd``): its ``ProposalOutput`` (host values)."""
        return self.worker.end_proposal(plan)

    def open_transfers(self, transfer, name: str):
        """Rank 0's worker's PD transfer agent (``tandem/disagg/pd_ranks.py``), opened now."""
        return self.worker.open_transfers(transfer, name)

    def close_transfers(self) -> None:
        self.worker.close_transfers()

    def keep_carried_hidden(self, key: int, values) -> None:
        """Rank 0's worker keeps the hidden state a prefill server sent for sequence ``key`` (MTP)."""
        self.worker.keep_carried_hidden(key, list(values))

    def skip_first_draw(self, key: int, seed) -> None:
        """Rank 0's worker's generator of sequence ``key`` skips the prefill engine's first draw."""
        self.worker.skip_first_draw(key, seed)

    @abc.abstractmethod
    def execute_draft(self, step, inputs_from_root: bool, input_ids: torch.Tensor,
                      hidden: Optional[torch.Tensor]) -> torch.Tensor:
        """A sharded draft's pass over ``step``'s rows on every rank's worker, rank 0's last (its
        device ``input_ids`` and ``hidden`` inputs, broadcast to the others); rank 0's output."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Hand the other ranks the page operations made since the last message now (an idle
        engine's tier writes); raise if a rank has failed."""

    @abc.abstractmethod
    def collective_rpc(self, method: str, *arguments) -> list:
        """Every rank's answer to the named call (``RANK_CALLS``), in rank order."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise if a rank has failed (the engine cannot go on)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every rank other than rank 0."""


class InProcessExecutor(Executor):
    """One rank: the engine core's own process. Nothing is handed on; calls run here."""

    world_size = 1
    shard = SINGLE

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.context: Optional[RankContext] = None
        self.worker = None  # rank 0's Worker, once attached
        self.graph_sizes: list[int] = []

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> "InProcessExecutor":
        if config.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size: the in-process executor runs 1 rank, not "
                             f"{config.tensor_parallel_size}")
        return cls(device)

    def attach(self, coordinator, runner) -> None:
        self.context = RankContext(coordinator, runner)

    def agree_on_pages(self, plan: PoolPlan) -> PoolPlan:
        return replace(plan)

    def agree_on_count(self, count: int) -> int:
        return count

    def capture_graphs(self, runner, batch_sizes, max_model_len, max_num_batched_tokens) -> list[int]:
        self.graph_sizes = runner.capture_graphs(batch_sizes, max_model_len, max_num_batched_tokens)
        return self.graph_sizes

    def capture_mixed_graphs(self, runner, token_sizes: list[int]) -> list[int]:
        return runner.capture_mixed_graphs(token_sizes)

    def agree_on_disk_reads(self, keys, count) -> int:
        return count

    def attach_worker(self, worker) -> None:
        self.worker = worker

    def execute_step(self, plan):
        return self.worker.execute(plan)

    def sample(self, plan):
        return self.worker.sample(plan)

    def verify(self, plan):
        return self.worker.verify(plan)

    def execute_draft(self, step, inputs_from_root, input_ids, hidden):
        return self.worker.draft(draft_plan(step, inputs_from_root, hidden), input_ids, hidden)

    def flush(self) -> None:
        return None

    def collective_rpc(self, method: str, *arguments) -> list:
        call = rank_call(method)
        if self.context is None:
            raise RuntimeError("collective_rpc: the executor is not attached to the engine's coordinator yet")
        return [call(self.context, *arguments)]

    def check(self) -> None:
        return None

    def close(self) -> None:
        return None
