"""The model runner: one rank's flattened forward pass over a step's host-side inputs.

Owner of the model (this rank's shard), the attention backend and the decode CUDA graphs. It
copies a step's input ids, positions and per-group attention metadata (``StepInputs``, built from
the scheduled chunks by the engine core: ``engine/step_planner.py``) to the device, runs the model
(replaying a graph or eagerly) and returns the hidden states, the sampled rows' logits (under
tensor parallelism, for a step planned so, only what their greedy choice needs: ``sampled_logits``) and
the logits of each prompt-logprob range (``run``). Every rank runs it through its ``Worker``
(``engine/ranks/worker.py``); the runner itself knows nothing of other ranks beyond its model's
shard (whose collectives the layers make).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tandem.protocol import PositionLogprobs
from tandem.kv.accessor import StateAccessor
from tandem.kv.coordinator import StateCoordinator
from tandem.layers.attention import AttentionBackend, TorchAttentionBackend
from tandem.layers.attention_metadata import AttentionMetadata
from tandem.worker.cuda_graphs import CudaGraphRunner, model_is_graph_safe, recover_from_failed_capture
from tandem.worker.graph_choice import GraphChoice
from tandem.worker.mixed_graphs import MixedStepGraphs, mixed_graphs_apply
from tandem.layers.forward_context import ForwardContext
from tandem.parallel.vocab_choice import VocabChoice
from tandem.worker.host_staging import to_device
from tandem.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

# Set to "1" (tests on a CPU): ``capture_graphs`` builds the graph runner's static buffers
# without capturing, on every rank (the tensor-parallel workers inherit the environment).
STATIC_BUFFERS_ON_CPU = "TANDEM_GRAPH_BUFFERS_ON_CPU"


@dataclass
class ForwardOutput:
    """What a step's forward pass gives (``ModelRunner.run``); only rank 0 reads it."""
    hidden: torch.Tensor  # [tokens, hidden] the model's output (a replayed graph's: valid until its next replay)
    # [sampled rows, vocab] model dtype (readers cast), in the order of ``StepInputs.sampling_rows``;
    # None where the step's choice was made per vocabulary shard (``choice`` instead)
    logits: Optional[torch.Tensor]
    prompt_logits: list[torch.Tensor]  # [rows, vocab] float32 per prompt-logit range, in the plan's order
    # Under tensor parallelism, a step planned with ``vocab_choice``: what every rank gathered of
    # its columns of the sampled rows' logits for the greedy choice (``parallel/vocab_choice.py``)
    choice: Optional[VocabChoice] = None


class ModelRunner:
    """Owner of the model's forward pass for a step (see the module docstring).

    On CUDA, attention runs through the Triton kernels and, unless ``enforce_eager``, pure
    decode steps replay CUDA graphs captured at start-up (``capture_graphs``); everything else
    runs eagerly.
    """

    def __init__(self, model: torch.nn.Module, coordinator: StateCoordinator, device: torch.device,
                 backend: AttentionBackend | None = None) -> None:
        self.model = model
        self.coordinator = coordinator
        self.device = device
        self.page_size = coordinator.page_size
        self.pending_loads = coordinator.pending_loads
        self.accessor = StateAccessor(coordinator.registry, self.pending_loads)
        # The layers the model's forward (and its graphs) read: every registered layer but a draft's.
        self.graph_layers: frozenset[str] = frozenset(coordinator.registry.layer_names())
        self.backend = backend or default_backend(device)
        # On CPU, buckets of similar lengths save gathered bytes; on a GPU every bucket costs
        # kernel launches in every layer, which outweighs the padding: one bucket there.
        self.decode_min_bucket = 8 if device.type == "cpu" else 1 << 30
        self.graphs: Optional[CudaGraphRunner] = None
        self.mixed_graphs: Optional[MixedStepGraphs] = None  # steps with a prompt chunk (mixed_graphs.py)
        # A step whose every token is sampled (speculative verification: a known token and its
        # drafts per sequence) replays the decode graphs with each token as a row of its own;
        # set by the speculator when every target group keeps its state per token.
        self.verify_as_decode_rows = False

    def capture_graphs(self, batch_sizes: list[int], max_model_len: int, max_num_batched_tokens: int) -> list[int]:
        """Capture decode graphs at these batch sizes (CUDA only, graph-safe models only), after
        one eager prefill of a full token budget. Returns the sizes captured (empty when graphs
        do not apply)."""
        if not batch_sizes or not model_is_graph_safe(self.model):
            return []
        max_width = -(-max_model_len // self.page_size) + 1
        if self.device.type != "cuda":
            if os.environ.get(STATIC_BUFFERS_ON_CPU) != "1":
                return []
            # Tests without a GPU: nothing is captured; a "replay" runs the same forward eagerly
            # over the static buffers, so the graph path's choices and copies run on a CPU.
            self.graphs = CudaGraphRunner(self, batch_sizes, max_width)
            return self.graphs.batch_sizes
        shard = self.model.tensor_shard
        if shard.is_parallel:
            # NCCL creates a communicator at its first collective (device allocations, streams),
            # which a capture must not contain: one eager all-reduce makes it now, on every rank.
            shard.create_communicator(self.device)
            torch.cuda.synchronize(self.device)
        self._warm_up_prefill(min(max_num_batched_tokens, max_model_len))
        self.graphs = CudaGraphRunner(self, batch_sizes, max_width)
        self.graphs.capture()
        return self.graphs.batch_sizes

    def wants_mixed_graphs(self, token_sizes: list[int]) -> bool:
        """Whether ``capture_mixed_graphs`` would make graphs here: sizes asked for, decode graphs
        captured (or their static buffers on a CPU) and a model whose stateful layers are all
        boundaries."""
        return bool(token_sizes) and self.graphs is not None and mixed_graphs_apply(self.model)

    def capture_mixed_graphs(self, token_sizes: list[int], agree=None) -> list[int]:
        """Capture graphs for steps with a prompt chunk of up to the largest of ``token_sizes``
        tokens (``mixed_graphs.py``; after ``capture_graphs``). Returns the sizes captured (empty:
        such steps run eagerly). A capture that fails leaves them eager, with a warning. Under
        tensor parallelism every rank calls this with the same sizes and ``agree``, the collective
        after each size (``parallel/graphs.py``'s ``capture_mixed_on_every_rank``)."""
        if not self.wants_mixed_graphs(token_sizes):
            return []
        graphs = MixedStepGraphs(self, token_sizes)
        if self.device.type == "cuda":
            try:
                graphs.capture(agree)
            except Exception as error:  # (a host synchronisation, an op capture refuses: stay eager)
                logger.warning("mixed-step CUDA graphs not captured (%s: %s); steps with a prompt chunk run "
                               "eagerly", type(error).__name__, error)
                graphs.release()
                recover_from_failed_capture(self.device)
                return []
        self.mixed_graphs = graphs
        return graphs.token_sizes

    def release_graphs(self) -> None:
        """Destroy the captured graphs now. Under tensor parallelism they hold NCCL collectives,
        and NCCL will not destroy a communicator while a graph that captured its operations is
        alive: left to the garbage collector, the process group may go first and its
        destruction waits forever. So the graphs go before the group does."""
        if self.mixed_graphs is not None:
            self.mixed_graphs.release()
            self.mixed_graphs = None
        if self.graphs is None:
            return
        self.graphs.release()
        self.graphs = None

    @torch.inference_mode()
    def _warm_up_prefill(self, num_tokens: int) -> None:
        """One eager forward of ``num_tokens`` prompt tokens that writes no page (slots -1;
        reads go to the null page): kernels compile and the allocator grows to a full step's
        activations at start-up, not in the first requests."""
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        hidden = self.model(ids, positions, self.forward_context(self.padding_metadata(num_tokens)))
        self.model.compute_logits(hidden[-1:]).float()
        torch.cuda.synchronize(self.device)

    def padding_metadata(self, num_tokens: int) -> list[AttentionMetadata]:
        """Every group's metadata for one prompt chunk of ``num_tokens`` tokens that writes no page
        (slots -1) and reads the null page: warm-ups and captures."""
        width = -(-num_tokens // self.page_size)
        return [AttentionMetadata(
            page_size=self.page_size, slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            page_table=torch.zeros((1, width), dtype=torch.int32, device=self.device),
            context_lengths=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            query_starts=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            num_decode_tokens=0, chunk_query_starts=[0, num_tokens], chunk_start_positions=[0],
            chunk_context_lengths=[num_tokens], host_page_table=np.zeros((1, width), dtype=np.int32))
            for _ in range(self.coordinator.num_groups)]

    def forward_context(self, metadata: list[AttentionMetadata]) -> ForwardContext:
        return ForwardContext(self.accessor, metadata, self.backend)

    @torch.inference_mode()
    def run(self, step: StepInputs, graph_size: int, prompt_logit_ranges: list[tuple[int, int]], feed=None,
            broadcast_inputs: bool = False, graph_rows: Optional[StepInputs] = None, vocab_choice: bool = False,
            choice_top: int = 0) -> ForwardOutput:
        """One step's forward pass, as every rank runs it (``engine/ranks/worker.py``'s ``Worker``):
        replayed from this rank's graph of ``graph_size`` rows (0: eagerly), then the LM head over
        each of ``prompt_logit_ranges`` (first row, rows), in order. Both hold collectives under
        tensor parallelism, so every rank makes the same calls in the same order. ``feed`` writes
        tokens still pending on this rank's device into the input ids (rank 0); with
        ``broadcast_inputs`` rank 0's input ids then go to every rank. ``graph_rows``: the replayed
        rows as the plan names them; else derived and checked here (``planned_graph_step``).
        ``vocab_choice`` (tensor parallelism): the ranks gather what the sampled rows' greedy
        choice needs, with ``choice_top`` candidates each for top logprobs, instead of their
        logits (``ForwardOutput.choice``)."""
        choice = None
        if graph_size:
            rows = graph_rows if graph_rows is not None else self.planned_graph_step(step, graph_size)
            hidden, logits = self.graphs.replay(rows, feed, broadcast_inputs=broadcast_inputs)
            if self.model.tensor_shard.is_parallel:  # (the graph holds this rank's columns)
                logits, choice = self.finish_logits(logits, vocab_choice, choice_top)
        else:
            hidden, logits, choice = self.forward(step, feed, broadcast_inputs, vocab_choice, choice_top)
        prompt_logits = [self.model.compute_logits(hidden[start:start + count]).float()
                         for start, count in prompt_logit_ranges]
        return ForwardOutput(hidden, logits, prompt_logits, choice)

    def sampled_logits(self, hidden: torch.Tensor, vocab_choice: bool = False, choice_top: int = 0):
        """``(logits, choice)`` of the sampled rows' hidden states: the logits (choice None), or
        under tensor parallelism with ``vocab_choice`` the gathered ``VocabChoice`` (logits None)."""
        local = self.column_logits(hidden)
        if not self.model.tensor_shard.is_parallel:
            return local, None
        return self.finish_logits(local, vocab_choice, choice_top)

    def column_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of ``hidden``; under tensor parallelism this rank's columns of them, which
        ``finish_logits`` gathers (or gathers what their greedy choice needs of)."""
        with self.model.lm_head.local_columns():
            return self.model.compute_logits(hidden)

    def finish_logits(self, local: torch.Tensor, vocab_choice: bool, choice_top: int = 0):
        """``(logits, choice)`` from this rank's columns of the logits (tensor parallelism: a
        collective every rank makes alike)."""
        head = self.model.lm_head
        if vocab_choice and head.chooses(choice_top):
            return None, head.choice(local, choice_top)
        return head.gather(local), None

    def forward(self, step: StepInputs, feed=None, broadcast_inputs: bool = False, vocab_choice: bool = False,
                choice_top: int = 0):
        """The model over the step's tokens and the logits of its sampled rows: ``(hidden,
        logits, choice)`` (``sampled_logits``). Under tensor parallelism every rank runs this with the same step; with
        ``broadcast_inputs`` rank 0's device input ids (pending tokens filled in) go to all."""
        metadata = [self._group_metadata(step, group) for group in range(self.coordinator.num_groups)]
        context = self.forward_context(metadata)
        if self.mixed_graphs is not None and self.mixed_graphs.fits(step.num_tokens):
            hidden = self.mixed_graphs.replay(step.input_ids, step.positions, context, feed, broadcast_inputs)
        else:
            input_ids, positions = self._to_device(step.input_ids), self._to_device(step.positions)
            if feed is not None:
                feed(input_ids)
            if broadcast_inputs:
                self.model.tensor_shard.broadcast(input_ids)
            hidden = self.model(input_ids, positions, context)
        if not step.sampling_rows:
            return hidden, hidden.new_zeros((0, 0)), None
        rows = to_device(step.sampling_rows, self.device, torch.long)
        return (hidden, *self.sampled_logits(hidden.index_select(0, rows), vocab_choice, choice_top))

    def graph_choice(self) -> GraphChoice:
        """What this rank captured, as the graph choice reads it (host values): rank 0's worker
        gives it to the engine core's step planner at start-up; every rank checks a plan with its own."""
        if self.graphs is None:
            return GraphChoice(layers=self.graph_layers)
        return GraphChoice(tuple(self.graphs.batch_sizes), self.graphs.max_width, self.graph_layers,
                           self.verify_as_decode_rows)

    def planned_graph_step(self, step: StepInputs, graph_size: int) -> StepInputs:
        """The rows this rank replays for a step planned to replay the graph of ``graph_size``
        rows. The graphs hold the layers' collectives, so every rank must replay the same one
        (another would wait forever on NCCL): raises unless this rank has that graph and makes
        the same choice for the step (``graph_choice.py``: a pure function of the step's inputs,
        the sizes and the pending loads)."""
        sizes = self.graphs.batch_sizes if self.graphs is not None else []
        if graph_size not in sizes:
            raise RuntimeError(f"tensor parallelism: rank 0 replays its CUDA graph of {graph_size} rows, "
                               f"but this rank has graphs of {sizes or 'no'} rows")
        chosen, replayed = self.graph_choice().size_and_rows(step, self.pending_loads)
        if chosen != graph_size:
            raise RuntimeError(f"tensor parallelism: rank 0 replays its CUDA graph of {graph_size} rows for a "
                               f"step of {step.num_tokens} tokens, but this rank would "
                               + (f"replay its graph of {chosen} rows" if chosen else "run it eagerly"))
        return replayed

    def group_metadata(self, step: StepInputs, groups) -> list[Optional[AttentionMetadata]]:
        """Attention metadata of ``groups`` (None for the others) for a step's rows."""
        wanted = set(groups)
        return [self._group_metadata(step, group) if group in wanted else None
                for group in range(self.coordinator.num_groups)]

    def _to_device(self, array) -> torch.Tensor:
        return to_device(array, self.device)

    def _group_metadata(self, step: StepInputs, group: int) -> AttentionMetadata:
        as_int32 = lambda values: to_device(values, self.device, torch.int32)
        return AttentionMetadata(
            page_size=self.page_size, slot_mapping=self._to_device(step.slot_mappings[group]),
            page_table=self._to_device(step.page_tables[group]),
            context_lengths=as_int32(step.context_lengths), query_starts=as_int32(step.query_starts),
            num_decode_tokens=step.num_decode, chunk_query_starts=step.query_starts,
            chunk_start_positions=step.start_positions, chunk_context_lengths=step.context_lengths,
            zero_invalid=self.coordinator.sanitizer.enabled, decode_min_bucket=self.decode_min_bucket,
            host_page_table=step.page_tables[group])


def default_backend(device: torch.device) -> AttentionBackend:
    """Triton kernels on CUDA; plain PyTorch (the kernels' references' semantics) elsewhere."""
    if device.type == "cuda":
        from tandem.layers.attention import TritonAttentionBackend

        return TritonAttentionBackend()
    return TorchAttentionBackend()


def to_position_logprobs(token_ids, chosen, ranks, top_ids, top_logprobs) -> list[PositionLogprobs]:
    token_ids, chosen, ranks = token_ids.tolist(), chosen.tolist(), ranks.tolist()
    top_ids = top_ids.tolist() if top_ids is not None else [[] for _ in token_ids]
    top_logprobs = top_logprobs.tolist() if top_logprobs is not None else [[] for _ in token_ids]
    return [PositionLogprobs([token] + ids, [value] + values, rank)
            for token, value, rank, ids, values in zip(token_ids, chosen, ranks, top_ids, top_logprobs)]
