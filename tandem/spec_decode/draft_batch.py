"""One forward pass of a draft (an MTP layer or a draft model) over rows of several sequences.

A row is a run of consecutive positions of one sequence: a catch-up over the tokens the target
computed this step, a chain step of one draft token, or both at once. Rows are laid out like a
target step (``worker/step_inputs.layout_rows``: single-token rows first, by length) and read
and write only the draft's state groups, through the accessor (I3), with the page tables the
row names (a sequence's own, or the copies a speculative chain runs on).

With CUDA graphs captured for the draft (``network.graphs``), a pass whose rows are single
tokens — or, where the draft keeps its state per token, whose rows are laid out as single-token
rows (``step_inputs.as_decode_rows``) — replays them; any other pass runs eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from tandem.kv.block_pool import SanitizerError
from tandem.layers.forward_context import ForwardContext
from tandem.worker.host_staging import to_device
from tandem.worker.step_inputs import as_decode_rows, layout_rows


@dataclass
class DraftRow:
    token_ids: list[int]
    start: int  # position of the first token
    page_tables: list[list[int]]  # per state group (only the draft's groups are read)
    hidden: Optional[torch.Tensor] = None  # [len(token_ids), hidden] inputs beside the tokens (MTP)
    wants_logits: bool = False  # the last position's logits are wanted
    # The last token as drawn by the pass before, still on the device (0-d; ``token_ids[-1]`` is a
    # placeholder): a chain runs without waiting for its tokens on the host.
    last_token: Optional[torch.Tensor] = None


class DraftNetwork(Protocol):
    """What a proposer runs: ``forward`` gives the output hidden state of every row token,
    ``logits`` the vocabulary logits of some of them."""
    groups: list[int]
    graphs: Optional[object]  # worker/cuda_graphs.CudaGraphRunner over the network, or None

    def forward(self, input_ids: torch.Tensor, hidden: Optional[torch.Tensor], positions: torch.Tensor,
                context: ForwardContext) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def context(self, metadata: list) -> ForwardContext: ...


@dataclass
class DraftOutput:
    last_hidden: list[torch.Tensor]  # per row (given order): the output at its last position
    logits: list[Optional[torch.Tensor]]  # per row: [vocab] float32 where wanted, else None


@torch.inference_mode()
def run_rows(runner, network: DraftNetwork, rows: list[DraftRow], check_finite: bool,
             rows_as_decode: bool = False, executor=None) -> DraftOutput:
    """One forward pass of ``network`` over ``rows`` (see the module docstring).
    ``rows_as_decode``: the draft keeps its state per token (rows of several tokens may replay
    the graphs as single-token rows). A sharded draft under tensor parallelism runs on every
    rank: ``executor`` (the engine core's, ``engine/ranks/executor.py``) hands the pass to every
    rank's worker, rank 0's included, which all run ``run_planned_rows``."""
    order = sorted(range(len(rows)), key=lambda index: (len(rows[index].token_ids) > 1,
                                                        rows[index].start + len(rows[index].token_ids)))
    ordered = [rows[index] for index in order]
    ids = [token for row in ordered for token in row.token_ids]
    tables = [[row.page_tables[group] for row in ordered] if group in network.groups else None
              for group in range(runner.coordinator.num_groups)]
    step = layout_rows([], ids, [row.start for row in ordered], [len(row.token_ids) for row in ordered],
                       [0] * len(ordered), tables, runner.page_size)
    device = runner.device
    hidden_in = None
    if ordered and ordered[0].hidden is not None:
        hidden_in = torch.cat([row.hidden for row in ordered]).to(device)
    last_rows = to_device([end - 1 for end in step.query_starts[1:]], device, torch.long)
    wanted = [slot for slot, row in enumerate(ordered) if row.wants_logits]
    feed = _feed_last_tokens(ordered, step, device)
    planned = network.runs_on_every_rank and executor is not None and executor.world_size > 1  # sharded, under TP
    replayed = None if planned else _graph_rows(runner, network, step, rows_as_decode)
    if replayed is not None:
        output, all_logits = network.graphs.replay(replayed, feed, hidden_in=hidden_in)
        last_hidden = output.index_select(0, last_rows)
        logits = None
        if wanted:
            logits = all_logits.index_select(0, to_device([step.query_starts[slot + 1] - 1 for slot in wanted],
                                                          device, torch.long)).float()
    else:
        input_ids = to_device(step.input_ids, device)
        if feed is not None:
            feed(input_ids)
        if planned:
            output = executor.execute_draft(step, feed is not None, input_ids, hidden_in)
        else:
            output = _forward(runner, network, step, input_ids, hidden_in)
        last_hidden = output.index_select(0, last_rows)
        logits = None
        if wanted:
            logits = network.logits(last_hidden.index_select(0, to_device(wanted, device, torch.long))).float()
    if check_finite and logits is not None and not torch.isfinite(logits).all():
        raise SanitizerError("non-finite draft logits: a draft forward pass read poisoned (freed) state")
    result = DraftOutput([None] * len(rows), [None] * len(rows))
    for slot, index in enumerate(order):
        result.last_hidden[index] = last_hidden[slot]
    for position, slot in enumerate(wanted):
        result.logits[order[slot]] = logits[position]
    return result


def _forward(runner, network: DraftNetwork, step, input_ids: torch.Tensor,
             hidden_in: Optional[torch.Tensor]) -> torch.Tensor:
    """The network's eager pass over the step's rows, reading only its own state groups."""
    return network.forward(input_ids, hidden_in, to_device(step.positions, runner.device),
                           network.context(runner.group_metadata(step, network.groups)))


@torch.inference_mode()
def run_planned_rows(runner, network: DraftNetwork, step, inputs_from_root: bool, hidden_dtype: str,
                     input_ids: Optional[torch.Tensor] = None, hidden_in: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A sharded draft's pass over ``step``'s rows, as every rank runs it (its collectives): rank
    0 broadcasts its hidden inputs (``hidden_dtype`` "": none) and, ``inputs_from_root``, its
    device input ids; the other ranks pass neither and receive them. The output hidden state of
    every row token (rank 0 reads it; the others discard it)."""
    device = runner.device
    shard = runner.model.tensor_shard
    if input_ids is None:
        input_ids = to_device(step.input_ids, device)
    if hidden_dtype:
        if hidden_in is None:
            hidden_in = torch.empty((len(step.input_ids), network.hidden_input[0]), dtype=getattr(torch, hidden_dtype),
                                    device=device)
        else:
            hidden_in = hidden_in.contiguous()
        shard.broadcast(hidden_in)
    if inputs_from_root:
        shard.broadcast(input_ids)
    return _forward(runner, network, step, input_ids, hidden_in)


def _graph_rows(runner, network: DraftNetwork, step, rows_as_decode: bool):
    """The single-token rows the network's graphs replay for ``step``, or None (eager: also
    while a load of one of its layers is pending, which a replay cannot wait for layer by
    layer, I3)."""
    graphs = getattr(network, "graphs", None)
    if graphs is None or runner.pending_loads.any_for(network.layer_names):
        return None
    if step.num_decode != len(step.query_starts) - 1:
        if not rows_as_decode:
            return None
        step = as_decode_rows(step)
    return step if graphs.can_replay(step) else None


def _feed_last_tokens(ordered: list[DraftRow], step, device):
    """A function writing the rows' device-resident last tokens into the pass's input ids
    (None when no row has one)."""
    pending = [(step.query_starts[slot + 1] - 1, row.last_token) for slot, row in enumerate(ordered)
               if row.last_token is not None]
    if not pending:
        return None
    index = to_device([position for position, _ in pending], device, torch.long)
    tokens = torch.stack([token for _, token in pending])
    return lambda input_ids: input_ids.index_copy_(0, index, tokens)
