"""CUDA graphs for pure decode steps, captured at start-up per batch-size bucket.

Owner of the captured graphs, their shared memory pool and their static buffers. One runner
serves one network: the target model, or a speculative draft (a draft model or an MTP layer,
over its own state groups, with the hidden state it reads beside the tokens as one more static
input). A step whose every row is one token is a decode step; speculative decoding lays a
row of ``q`` tokens out as ``q`` single-token rows (``step_inputs.as_decode_rows``) when its
state is kept per token, so verification and a draft's catch-up replay these graphs too. A graph is
captured over static input tensors (token ids, positions; per state group the slot mapping, the
page table, the context lengths) and replayed after the step's values are copied into them
(page-table columns past the step's width hold the null page, as in an eager step). A step of
``n`` sequences replays the smallest captured size ``>= n``; rows past ``n`` are padding: context
length 0 (attention reads nothing and returns zeros; a recurrent layer reads the null page) and
slot -1 (nothing is written), so a padding row never touches a page.

The forward captured is the network's plus its logits head, so a replay ends with the output
hidden state and the logits of every row (under tensor parallelism the target's graphs end with
this rank's columns of them: the runner gathers the logits, or only what their greedy choice needs,
after the replay, as the step's plan says). Graphs apply only to models whose stateful layers all declare ``cuda_graph_safe``
(their reads and writes are tensor operations with no host synchronisation and no
data-dependent shapes); the others run eagerly.

Under tensor parallelism every rank holds a runner of the same sizes, captured in step (the
graphs contain the layers' collectives), and replays the size rank 0's plan names for the step
(``tandem/parallel/graphs.py``).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from tandem.kernels.triton_support import DEPENDENT_LAUNCH_MAX_TOKENS, early_launch
from tandem.layers.attention_metadata import AttentionMetadata
from tandem.worker.graph_choice import replayable, size_for
from tandem.worker.host_staging import copy_to_device
from tandem.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from tandem.layers.forward_context import ForwardContext
    from tandem.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def default_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 256, then every 32, capped at ``max_num_seqs``."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 513, 32))
    if max_num_seqs > sizes[-1]:
        return sizes
    return [size for size in sizes if size < max_num_seqs] + [max_num_seqs]


def decode_graph_sizes(config, rows: int) -> list[int]:
    """The decode graph sizes to capture for steps of up to ``rows`` rows: ``cuda_graph_sizes``
    (default ``default_graph_batch_sizes``) up to ``rows``."""
    return [size for size in config.cuda_graph_sizes or default_graph_batch_sizes(rows) if size <= rows]


def model_is_graph_safe(model: torch.nn.Module) -> bool:
    """True when every module that keeps state declares its forward capturable and no module
    declares it is not (``cuda_graph_safe = False``: a host synchronisation or data-dependent
    shapes on the decode path)."""
    stateful = [module for module in model.modules()
                if module is not model and callable(getattr(module, "state_specs", None))]
    return (bool(stateful) and all(getattr(module, "cuda_graph_safe", False) for module in stateful)
            and all(getattr(module, "cuda_graph_safe", True) for module in model.modules()))


class TargetNetwork:
    """The target model as a graph runner runs it: every state group, no hidden input."""

    hidden_input = None  # (size, dtype) of a hidden state read beside each token, or None

    def __init__(self, runner: "ModelRunner") -> None:
        self.runner = runner
        self.groups = list(range(runner.coordinator.num_groups))

    def forward(self, input_ids, hidden, positions, context) -> torch.Tensor:
        return self.runner.model(input_ids, positions, context)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits, under tensor parallelism this rank's columns: the runner gathers them, or
        what their greedy choice needs, after the replay (``ModelRunner.finish_logits``)."""
        return self.runner.column_logits(hidden)

    def context(self, metadata: list) -> "ForwardContext":
        return self.runner.forward_context(metadata)


def recover_from_failed_capture(device: torch.device) -> None:
    """Make the device usable again after a capture that failed. When a capture is invalidated
    (an operation it refuses), ending it raises before torch tells the device's random generator
    that capturing is over, and every later random draw on the device then fails ("Offset
    increment outside graph capture"): an empty capture, begun and ended, tells it."""
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        graph.capture_end()
    torch.cuda.synchronize(device)


class CudaGraphRunner:
    def __init__(self, runner: "ModelRunner", batch_sizes: list[int], max_width: int, network=None) -> None:
        self.runner = runner
        self.network = network or TargetNetwork(runner)
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_width = max_width
        device = runner.device
        size = self.batch_sizes[-1]
        num_groups = runner.coordinator.num_groups
        groups = set(self.network.groups)
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.hidden_in = None
        if self.network.hidden_input is not None:
            width, dtype = self.network.hidden_input
            self.hidden_in = torch.zeros((size, width), dtype=dtype, device=device)
        # Per state group the network reads (None for the others: its forward reads none).
        self.slot_mappings = [torch.full((size,), -1, dtype=torch.long, device=device) if group in groups else None
                              for group in range(num_groups)]
        self.page_tables = [torch.zeros((size, max_width), dtype=torch.int32, device=device) if group in groups
                            else None for group in range(num_groups)]
        self.context_lengths = [torch.zeros(size, dtype=torch.int32, device=device) if group in groups else None
                                for group in range(num_groups)]
        # Per group, the page-table columns the last replay filled: past them every entry is the
        # null page, as in an eager step's table (a reader may look past the columns it needs:
        # a recurrent row's checkpoint column).
        self.written_widths = [0] * num_groups
        self.query_starts = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # size -> (hidden, logits)
        self.pool = None
        self.num_replays = 0  # steps run through the static buffers (replayed, or eagerly where never captured)

    def _metadata(self, batch_size: int) -> list[Optional[AttentionMetadata]]:
        """Static tensors; the per-chunk lists are placeholders saying "decode rows that continue
        a sequence" (``can_replay`` admits no other), which is all a graph-safe layer reads."""
        rows = list(range(batch_size))
        return [AttentionMetadata(
            page_size=self.runner.page_size, slot_mapping=self.slot_mappings[group][:batch_size],
            page_table=self.page_tables[group][:batch_size],
            context_lengths=self.context_lengths[group][:batch_size],
            query_starts=self.query_starts[:batch_size + 1], num_decode_tokens=batch_size,
            chunk_query_starts=rows + [batch_size], chunk_start_positions=[1] * batch_size,
            chunk_context_lengths=[1] * batch_size, zero_invalid=True) if self.page_tables[group] is not None else None
            for group in range(len(self.page_tables))]

    def _forward(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        network = self.network
        context = network.context(self._metadata(batch_size))
        hidden_in = self.hidden_in[:batch_size] if self.hidden_in is not None else None
        hidden = network.forward(self.input_ids[:batch_size], hidden_in, self.positions[:batch_size], context)
        return hidden, network.logits(hidden)  # (model dtype: the sampler reads it as it is)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller ones reuse its memory pool. On a
        capture stream of the runner's device: ``torch.cuda.graph``'s default one is made once
        per process, on the device current then, and capturing on it makes that device current
        (a second engine of the process on another GPU would launch its kernels there)."""
        stream = torch.cuda.Stream(self.runner.device)
        for batch_size in reversed(self.batch_sizes):
            # A batch-1 or -2 step on one GPU is a chain of small kernels: each launched before
            # the one before it finishes, where the GPU allows (``triton_support.early_launch``;
            # not yet beside tensor parallelism's collectives).
            early = batch_size <= DEPENDENT_LAUNCH_MAX_TOKENS and not self.runner.model.tensor_shard.is_parallel
            with early_launch(early, self.runner.device):
                self._forward(batch_size)  # warm-up: kernel compilation and autotuning stay outside
                torch.cuda.synchronize(self.runner.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[batch_size] = self._forward(batch_size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch_size] = graph
        torch.cuda.synchronize(self.runner.device)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    def can_replay(self, step: StepInputs) -> bool:
        """Whether a step fits these graphs (``graph_choice.replayable``)."""
        return replayable(step, self.batch_sizes[-1], self.max_width)

    def release(self) -> None:
        """Destroy the captured graphs and their outputs (after the device finished with them);
        the static buffers stay until this object goes."""
        if self.graphs:  # (captured: a CUDA device)
            torch.cuda.synchronize(self.runner.device)
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def size_for(self, step: StepInputs) -> int:
        """The captured size a step (one ``can_replay`` admits) replays: the smallest that fits."""
        return size_for(self.batch_sizes, step.num_tokens)

    def replay(self, step: StepInputs, feed=None, hidden_in: Optional[torch.Tensor] = None,
               broadcast_inputs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the step into the static buffers, replay, and return the ``[n, hidden]`` output
        and ``[n, vocab]`` logits (model dtype) of its ``n`` rows (views of static buffers: valid until the
        next replay of this runner). ``feed`` writes pending input tokens (still on the device)
        into the static ids; ``hidden_in`` is the hidden input of a network that reads one.
        Under tensor parallelism ``broadcast_inputs`` sends rank 0's static ids (pending tokens
        filled in) to every rank before the replay (an eager collective, outside the graph)."""
        count = step.num_tokens
        batch_size = self.size_for(step)
        copy = copy_to_device
        copy(self.input_ids[:count], step.input_ids)
        copy(self.positions[:count], step.positions)
        if feed is not None:
            feed(self.input_ids[:count])
        if broadcast_inputs:
            self.runner.model.tensor_shard.broadcast(self.input_ids[:count])
        if self.hidden_in is not None:
            self.hidden_in[:count].copy_(hidden_in)
        lengths = np.asarray(step.context_lengths, dtype=np.int32)
        for group, table in enumerate(step.page_tables):
            if self.page_tables[group] is None:
                continue
            copy(self.slot_mappings[group][:count], step.slot_mappings[group])
            width = table.shape[1]
            copy(self.page_tables[group][:count, :width], table)
            if self.written_widths[group] > width:  # columns a wider step wrote read as the null page again
                self.page_tables[group][:, width:self.written_widths[group]].zero_()
            self.written_widths[group] = width
            copy(self.context_lengths[group][:count], lengths)
            if batch_size > count:
                self.slot_mappings[group][count:batch_size].fill_(-1)
                self.context_lengths[group][count:batch_size].fill_(0)
        self.num_replays += 1
        if not self.graphs:  # never captured (CPU tests): the same forward, eagerly, over the static buffers
            hidden, logits = self._forward(batch_size)
        else:
            self.graphs[batch_size].replay()
            hidden, logits = self.outputs[batch_size]
        return hidden[:count], logits[:count]
