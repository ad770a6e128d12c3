"""The step plan: what rank 0 sends the other ranks before each forward pass.

A plan is the model runner's host-side inputs of one step (``StepInputs`` without the
scheduler's objects), the logits rows it computes (sampled rows, then each chunk's prompt
logprob rows: every rank must run the LM head's gather in the same order), the CUDA graph rank
0 replays for it (every rank replays its own of that size: the graphs hold collectives), and the page
operations rank 0's coordinator and host tier applied since the last plan (page copies, sanitizer
poison, tier saves and layer-wise loads, fences, host poison), which each rank replays on its own
shard before the forward pass (``worker_tiers.py`` for the tier's). Plans travel as msgpack over the
control group: a length, then the bytes (nothing is unpickled). A TRANSFER plan runs no forward
pass: it carries page operations and the PD transfer operations of each rank's own agent
(``pd_ranks.py``). A DISK plan runs none either: every rank counts how many leading pages of its
``disk_keys`` its own store gave it, and they all take the smallest count (``worker_tiers.py``).
A PAGES plan carries page operations alone (rank 0 sends what it journaled once it is idle; a
STOP plan carries the last of them). An RPC plan names a call every rank answers over the
control group (``executor.py``'s ``collective_rpc``). A DRAFT plan is a pass of a sharded draft (an MTP module) over its rows: rank 0 then broadcasts
the rows' hidden inputs (and its device-resident input ids) before the pass.
"""
from __future__ import annotations

from typing import Optional

import msgspec
import numpy as np
import torch

from tandem.transfer.rank_operations import TransferOperation
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


COPY, POISON = "copy", "poison"
SAVE, LOAD, FENCE, HOST_POISON = "save", "load", "fence", "host_poison"  # the host tier's
DISK_PREFETCH, DISK_WRITE, DISK_INSTALL = "disk_prefetch", "disk_write", "disk_install"  # the disk tier's


class PageOperation(msgspec.Struct, array_like=True):
    """COPY: pages == [source, destination]; POISON / HOST_POISON: the device / host pages poisoned;
    SAVE / LOAD: device pages then as many host pages (device → host / host → device); FENCE (no
    group, no pages): rank 0 released device pages a tier copy held; DISK_PREFETCH: ``keys`` being
    read; DISK_WRITE / DISK_INSTALL: the host pages (one per group, 0 where absent) of ``keys[0]``
    written to the store / filled from it."""
    kind: str
    group_id: int
    pages: list[int]
    keys: list[bytes] = []


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

    @classmethod
    def of_step(cls, step: StepInputs, prompt_logit_ranges: list[tuple[int, int]],
                page_operations: list[PageOperation], inputs_from_root: bool, graph_size: int = 0) -> "StepPlan":
        return cls(STEP, page_operations, step.num_decode, Array.of(step.input_ids), Array.of(step.positions),
                   list(step.query_starts), list(step.start_positions), list(step.context_lengths),
                   [Array.of(table) for table in step.page_tables],
                   [Array.of(slots) for slots in step.slot_mappings], list(step.sampling_rows),
                   prompt_logit_ranges, inputs_from_root, graph_size)

    def step_inputs(self) -> StepInputs:
        """The plan as the runner's inputs (no scheduled chunks: a worker samples nothing)."""
        value = lambda array: None if array is None else array.value()
        return StepInputs([], self.num_decode, value(self.input_ids), value(self.positions),
                          self.query_starts, self.start_positions, self.context_lengths,
                          [value(table) for table in self.page_tables],
                          [value(slots) for slots in self.slot_mappings], self.sampling_rows,
                          bool(self.prompt_logit_ranges))


class PageJournal:
    """Rank 0's record of its coordinator's page operations since the last plan (installed as
    the coordinator's ``mirror``); ``take`` hands them to the next plan."""

    def __init__(self) -> None:
        self._operations: list[PageOperation] = []

    def copy_page(self, group_id: int, source: int, destination: int) -> None:
        self._operations.append(PageOperation(COPY, group_id, [source, destination]))

    def poison(self, group_id: int, pages: list[int]) -> None:
        self._operations.append(PageOperation(POISON, group_id, list(pages)))

    def tier_copy(self, load: bool, group_id: int, device_pages: list[int], host_pages: list[int]) -> None:
        self._operations.append(PageOperation(LOAD if load else SAVE, group_id, [*device_pages, *host_pages]))

    def tier_fence(self) -> None:
        self._operations.append(PageOperation(FENCE, -1, []))

    def poison_host(self, group_id: int, pages: list[int]) -> None:
        self._operations.append(PageOperation(HOST_POISON, group_id, list(pages)))

    def disk_prefetch(self, keys: list[bytes]) -> None:
        self._operations.append(PageOperation(DISK_PREFETCH, -1, [], list(keys)))

    def disk_write(self, key: bytes, host_pages: list[int]) -> None:
        self._operations.append(PageOperation(DISK_WRITE, -1, list(host_pages), [key]))

    def disk_install(self, key: bytes, host_pages: list[int]) -> None:
        self._operations.append(PageOperation(DISK_INSTALL, -1, list(host_pages), [key]))

    def pending(self) -> bool:
        return bool(self._operations)

    def take(self) -> list[PageOperation]:
        operations, self._operations = self._operations, []
        return operations


def replay(operations: list[PageOperation], coordinator, tiers=None) -> None:
    """Apply rank 0's page operations to this rank's shard, through the same movers (``tiers``:
    this rank's host tier, ``worker_tiers.WorkerTiers``, for the tier's operations)."""
    for operation in operations:
        if operation.kind == COPY:
            coordinator.copy_page(operation.group_id, *operation.pages)
        elif operation.kind == POISON:
            coordinator.sanitizer.poison(operation.group_id, operation.pages)
        elif tiers is None:
            raise RuntimeError(f"tensor parallelism: rank 0 sent a host-tier operation ({operation.kind}) "
                               "to a rank without a host tier")
        else:
            tiers.replay(operation)


class PlanChannel:
    """Rank 0 ``send``s plans; the others ``receive`` them, over the control group."""

    def __init__(self, control, rank: int) -> None:
        self.control = control
        self.rank = rank
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(StepPlan)

    def send(self, plan: StepPlan) -> None:
        payload = self.encoder.encode(plan)
        self.control.broadcast(torch.tensor([len(payload)], dtype=torch.int64), 0).wait()
        self.control.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0).wait()

    def receive(self) -> StepPlan:
        length = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(length, 0).wait()
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self.control.broadcast(payload, 0).wait()
        return self.decoder.decode(payload.numpy().tobytes())
