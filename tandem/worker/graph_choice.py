"""The choice between a decode CUDA graph and an eager pass for a step.

A pure function of the step's host-side inputs, the pending loads and what a rank captured at
start-up (``GraphChoice``: the sizes, the page-table width of the static tables, the layers the
graphs read, whether verification replays as single-token rows). Rank 0's worker gives its
``GraphChoice`` to the engine core once, at start-up; the core's step planner
(``engine/step_planner.py``) chooses with it and the coordinator's pending loads, and names the
graph in the step's message. Every rank's worker makes the same choice with its own
``GraphChoice`` and its own pending loads (``ModelRunner.planned_graph_step``) and refuses a
plan that names another graph: the graphs hold the layers' collectives, so every rank must
replay the same one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from tandem.worker.step_inputs import StepInputs, as_decode_rows


class PendingLoads(Protocol):
    """What the choice reads of the pending loads (``kv/pending_loads.py``)."""

    def any_for(self, layers) -> bool: ...


@dataclass(frozen=True)
class GraphChoice:
    """What a rank captured, as the graph choice reads it (host values only)."""
    batch_sizes: tuple[int, ...] = ()  # the captured sizes, ascending (empty: every step runs eagerly)
    max_width: int = 0  # page-table columns the graphs' static tables hold
    layers: frozenset[str] = frozenset()  # the layers the graphs read (a pending load on one: eager)
    verify_as_decode_rows: bool = False  # a verification step replays as single-token rows

    def rows(self, step: StepInputs, pending_loads: PendingLoads) -> Optional[StepInputs]:
        """The rows a graph replays for this step (None: it runs eagerly): a pure decode step, or
        a verification step laid out as single-token rows. Pending loads must be waited for layer
        by layer (I3): a replay cannot, so a step with any pending on a layer the graphs read runs
        eagerly (a draft's layers are the draft pass's concern)."""
        if not self.batch_sizes or step.wants_prompt_logprobs or pending_loads.any_for(self.layers):
            return None
        if len(step.sampling_rows) != step.num_tokens:  # a replay gives the logits of every row
            return None
        if step.num_decode != len(step.query_starts) - 1:  # (rows, not chunks: a worker's plan has none)
            if not self.verify_as_decode_rows:
                return None
            step = as_decode_rows(step)
        return step if replayable(step, self.batch_sizes[-1], self.max_width) else None

    def size_and_rows(self, step: StepInputs, pending_loads: PendingLoads) -> tuple[int, Optional[StepInputs]]:
        """The size of the graph that replays this step (0: it runs eagerly) and the rows it replays."""
        replayed = self.rows(step, pending_loads)
        return (size_for(self.batch_sizes, replayed.num_tokens), replayed) if replayed is not None else (0, None)


def replayable(step: StepInputs, largest: int, max_width: int) -> bool:
    """A step of single-token rows that fits graphs of up to ``largest`` rows and ``max_width``
    page-table columns, whose every row continues a sequence (a first token starts from no state:
    recurrent layers scan it eagerly), with no prompt logprobs."""
    return (step.num_decode == len(step.query_starts) - 1 == step.num_tokens
            and step.num_tokens <= largest and not step.wants_prompt_logprobs
            and min(step.start_positions, default=0) > 0
            and all(table.shape[1] <= max_width for table in step.page_tables if table is not None))


def size_for(batch_sizes, rows: int) -> int:
    """The captured size ``rows`` rows replay: the smallest that fits."""
    return next(size for size in batch_sizes if size >= rows)
