"""The step plan: what rank 0 sends the other ranks before each forward pass.

``ForwardPlan`` is one step's forward pass as every rank runs it, rank 0 included (``worker.py``'s
``Worker.execute``): the engine core plans it (``engine/step_planner.py``) and its executor hands it
to every rank's worker. ``DraftPlan`` is a pass of a sharded draft, likewise. ``StepPlan`` is the
message that carries either to ranks 1..N-1 over the control group.

A plan is the model runner's host-side inputs of one step (``StepInputs`` without the
scheduler's objects), the logits rows it computes (sampled rows, then each chunk's prompt
logprob rows: every rank must run the LM head's gather in the same order), the CUDA graph rank
0 replays for it (every rank replays its own of that size: the graphs hold collectives), and the
page operations the books emitted since the last plan (``kv/page_operations.py``: page copies,
sanitizer poison, tier saves and layer-wise loads, fences, host poison, disk reads, writes and
installs). Rank 0's executor applied them as they were emitted (its coordinator's outbox
recorded them); every other rank applies them, in order, through the same ``PageExecutor`` on its
own shard before the forward pass. Plans travel as msgpack over the control group: a length,
then the bytes (nothing is unpickled). A TRANSFER plan runs no forward pass: it carries page
operations and the PD transfer operations of each rank's own agent (``pd_ranks.py``). A DISK
plan runs none either: every rank counts how many leading pages of its ``disk_keys`` its own
store gave it, and they all take the smallest count (``kv/tiers/tier_worker.py``'s ``readable``
and ``keep``, as rank 0's books do with rank 0's). A PAGES plan carries page operations alone
(rank 0 sends what it recorded once it is idle; a STOP plan carries the last of them). An RPC
plan names a call every rank answers over the control group (``executor.py``'s
``collective_rpc``). A DRAFT plan is a pass of a sharded draft (an MTP module) over its rows:
rank 0 then broadcasts the rows' hidden inputs (and its device-resident input ids) before the pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import msgspec
import numpy as np
import torch

from tandem.kv.page_operations import PageOperation
from tandem.transfer.rank_operations import TransferOperation
from tandem.worker.host_logprobs import HostLogprobs
from tandem.worker.step_inputs import StepInputs

STEP, STOP, TRANSFER, DISK, DRAFT, PAGES, RPC = "step", "stop", "transfer", "disk", "draft", "pages", "rpc"


class Array(msgspec.Struct, array_like=True):
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, array: Optional[np.ndarray]) -> Optional["Array"]:
        if array is None:
            return None
        array = np.ascontiguousarray(array)
        return cls(array.dtype.str, tuple(array.shape), array.tobytes())

    def value(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape).copy()


@dataclass
class ForwardPlan:
    """One step's forward pass, as every rank runs it (``Worker.execute``): the runner's inputs
    (rank 0's carry the scheduled chunks; another rank's none), the rows whose logits the LM head
    computes after the sampled rows' (each chunk's prompt-logprob rows, in order: the head's gather
    is a collective), whether the input ids come from rank 0's device (tokens its worker sampled
    in the step before, still pending there), and the CUDA graph every rank replays (its rows; 0:
    eagerly). The graph is a pure function of the inputs and the captured sizes: each rank checks
    that it would choose it too.
    Rank 0's plan also says what its worker returns (``StepOutput``): the logprobs of each prompt
    range's target tokens, and whether the step's hidden states come back too."""
    inputs: StepInputs
    prompt_logit_ranges: list[tuple[int, int]]
    inputs_from_root: bool = False
    graph_size: int = 0
    # The rows the graph replays, as the planner derived them (rank 0's plan only; they never
    # travel): the rank that planned the step does not derive them again, the others check.
    graph_rows: Optional[StepInputs] = None
    # Rank 0's plan only (the other ranks return nothing): per prompt-logit range, the token each
    # row predicts and how many top logprobs it reports.
    prompt_targets: list[list[int]] = field(default_factory=list)
    prompt_top: list[int] = field(default_factory=list)
    # Rank 0's plan only: its worker keeps the step's hidden states (speculation's draft passes,
    # which it runs, read them).
    hidden_states: bool = False
    # Rank 0's plan only (the overlapped loop): input row ``pending_targets[i]`` reads row
    # ``pending_sources[i]`` of the tokens rank 0's worker sampled last, still on its device
    # (``inputs_from_root``: it then broadcasts the input ids to the other ranks).
    pending_targets: list[int] = field(default_factory=list)
    pending_sources: list[int] = field(default_factory=list)
    # Under tensor parallelism: every sampled row takes the greedy choice of the raw logits
    # (``worker/sampler.takes_greedy_choice``), so the ranks gather only what that choice needs
    # (``parallel/vocab_choice.py``), with ``choice_top`` candidates each for the most top
    # logprobs a row asks for, not the logits. Every rank's plan says it alike.
    vocab_choice: bool = False
    choice_top: int = 0


@dataclass
class StepOutput:
    """What rank 0's worker returns for a ``ForwardPlan``: host values (each prompt range's
    logprobs, in the plan's order; the sampled rows' logits, and the hidden states where the plan
    asked for them, stay with the worker, which samples, verifies and runs the draft's passes)."""
    prompt_logprobs: list[HostLogprobs]


@dataclass
class DraftPlan:
    """A pass of a sharded draft (an MTP module) over rows laid out as a step (``draft_batch.py``),
    as every rank runs it (``Worker.draft``): the hidden inputs' dtype ("": none) and whether the
    input ids come from rank 0's device; rank 0 broadcasts both before the pass."""
    inputs: StepInputs
    inputs_from_root: bool = False
    hidden_dtype: str = ""


class StepPlan(msgspec.Struct, array_like=True):
    kind: str  # STEP, STOP or TRANSFER
    page_operations: list[PageOperation] = []
    num_decode: int = 0
    input_ids: Optional[Array] = None
    positions: Optional[Array] = None
    query_starts: list[int] = []
    start_positions: list[int] = []
    context_lengths: list[int] = []
    page_tables: list[Optional[Array]] = []
    slot_mappings: list[Optional[Array]] = []
    sampling_rows: list[int] = []
    prompt_logit_ranges: list[tuple[int, int]] = []  # (first row, rows) per prompt-logprob chunk
    inputs_from_root: bool = False  # rank 0 broadcasts the input ids (tokens pending on its device)
    graph_size: int = 0  # the CUDA graph (its rows) every rank replays for the step; 0: eagerly
    transfer_operations: list[TransferOperation] = []  # TRANSFER plans only
    rpc_method: str = ""  # RPC plans only: the rank call (``executor.RANK_CALLS``) every rank answers
    rpc_arguments: bytes = b""  # its arguments (a msgpack list)
    disk_keys: list[bytes] = []  # DISK plans only: the store pages every rank reads and counts
    hidden_dtype: str = ""  # DRAFT plans: the dtype of the hidden inputs rank 0 broadcasts ("": none)
    vocab_choice: bool = False  # STEP plans: the ranks gather the greedy choice's parts, not logits (``ForwardPlan``)
    choice_top: int = 0  # ... with this many top-logprob candidates each

    @classmethod
    def of_step(cls, step: StepInputs, prompt_logit_ranges: list[tuple[int, int]],
                page_operations: list[PageOperation], inputs_from_root: bool, graph_size: int = 0) -> "StepPlan":
        return cls(STEP, page_operations, step.num_decode, Array.of(step.input_ids), Array.of(step.positions),
                   list(step.query_starts), list(step.start_positions), list(step.context_lengths),
                   [Array.of(table) for table in step.page_tables],
                   [Array.of(slots) for slots in step.slot_mappings], list(step.sampling_rows),
                   prompt_logit_ranges, inputs_from_root, graph_size)

    @classmethod
    def of_forward(cls, plan: ForwardPlan, page_operations: list[PageOperation]) -> "StepPlan":
        """A STEP plan: ``plan`` for the other ranks, after the page operations before it."""
        message = cls.of_step(plan.inputs, plan.prompt_logit_ranges, page_operations, plan.inputs_from_root,
                              plan.graph_size)
        message.vocab_choice, message.choice_top = plan.vocab_choice, plan.choice_top
        return message

    @classmethod
    def of_draft(cls, plan: DraftPlan, page_operations: list[PageOperation]) -> "StepPlan":
        """A DRAFT plan: ``plan`` for the other ranks, after the page operations before it."""
        message = cls.of_step(plan.inputs, [], page_operations, plan.inputs_from_root)
        message.kind = DRAFT
        message.hidden_dtype = plan.hidden_dtype
        return message

    def forward_plan(self) -> ForwardPlan:
        """A STEP plan as the forward pass this rank runs."""
        return ForwardPlan(self.step_inputs(), [tuple(rows) for rows in self.prompt_logit_ranges],
                           self.inputs_from_root, self.graph_size, vocab_choice=self.vocab_choice,
                           choice_top=self.choice_top)

    def draft_plan(self) -> DraftPlan:
        """A DRAFT plan as the draft pass this rank runs."""
        return DraftPlan(self.step_inputs(), self.inputs_from_root, self.hidden_dtype)

    def step_inputs(self) -> StepInputs:
        """The plan as the runner's inputs on ranks 1..N-1 (no scheduled chunks: rank 0's worker samples)."""
        value = lambda array: None if array is None else array.value()
        return StepInputs([], self.num_decode, value(self.input_ids), value(self.positions),
                          self.query_starts, self.start_positions, self.context_lengths,
                          [value(table) for table in self.page_tables],
                          [value(slots) for slots in self.slot_mappings], self.sampling_rows,
                          bool(self.prompt_logit_ranges))


class PlanChannel:
    """Rank 0 ``send``s plans; the others ``receive`` them, over the control group.

    A send does not wait for the other ranks to take the plan: the group's broadcasts complete
    only once every rank has posted its receive, which a rank does after it has launched the
    step before, so waiting there held rank 0's host in lockstep with the slowest rank's
    launches (a fifth of rank 0's time in TP=2 prefill steps, eagerly launched). The broadcasts
    are left in flight (their buffers with them) and waited for at the next send or ``settle``;
    rank 0 thus runs at most one plan ahead of the others' receives. A failed broadcast raises
    there, one plan later (the executor's watcher notices a dead rank meanwhile)."""

    def __init__(self, control, rank: int) -> None:
        self.control = control
        self.rank = rank
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(StepPlan)
        self.in_flight: list[tuple[object, torch.Tensor]] = []  # the last plan's broadcasts and their buffers

    def send(self, plan: StepPlan) -> None:
        self.settle()
        payload = self.encoder.encode(plan)
        length = torch.tensor([len(payload)], dtype=torch.int64)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.in_flight = [(self.control.broadcast(length, 0), length), (self.control.broadcast(data, 0), data)]

    def settle(self) -> None:
        """Wait until every rank has taken the last plan sent (raises if a broadcast failed)."""
        pending, self.in_flight = self.in_flight, []
        for work, _buffer in pending:
            work.wait()

    def receive(self) -> StepPlan:
        length = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(length, 0).wait()
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self.control.broadcast(payload, 0).wait()
        return self.decoder.decode(payload.numpy().tobytes())
