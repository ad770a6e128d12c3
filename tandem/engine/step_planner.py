"""Planning a step and reading its result: the engine core's side of a forward pass.

The engine core (rank 0's process) turns the scheduled chunks into the step message every rank
runs (``ForwardPlan``, ``engine/ranks/plan.py``): the runner's host-side inputs (``StepInputs``),
the CUDA graph every rank replays (a pure function of the inputs, the sizes captured and the
pending loads: ``ModelRunner.graph_size_and_rows`` on rank 0's runner, which every rank checks against
its own), each prompt-logprob chunk's logits rows, and whether the input ids come from rank 0's
device (tokens still pending there: the overlapped loop). Its executor hands the plan to every
rank's worker, rank 0's included; rank 0's result comes back here, where the sanitizer checks it
and the prompt logprobs are computed from the returned logits (no collective).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tandem.engine.ranks.plan import ForwardPlan
from tandem.kv.block_pool import SanitizerError
from tandem.kv.coordinator import StateCoordinator
from tandem.protocol import PositionLogprobs
from tandem.scheduler.scheduler import ScheduledChunk
from tandem.worker.model_runner import ForwardOutput, ModelRunner, to_position_logprobs
from tandem.worker.sampler import compute_logprobs
from tandem.worker.step_inputs import PageTableRows, PendingTokens, StepInputs, build_step_inputs


@dataclass
class ExecuteResult:
    """A step's result as the engine core reads it: the sampled rows' chunks (rank 0's worker
    samples them from the logits it kept) or, while speculating, the logits verification reads."""
    sampling_chunks: list[ScheduledChunk]  # in the order of ``logits`` rows
    logits: torch.Tensor  # [sampling rows, vocab] float32: one per sampling chunk, 1 + drafts with drafts
    prompt_logprobs: dict[int, list[PositionLogprobs]]  # id(chunk) -> logprobs of its prompt tokens
    step: Optional[StepInputs] = None  # the step's rows (chunk order, query starts)
    hidden: Optional[torch.Tensor] = None  # [tokens, hidden] the model's output (a replayed graph's: valid
    # until its next replay)


@dataclass
class PlannedStep:
    """A step's plan, and what rank 0 keeps beside it to read the result."""
    plan: ForwardPlan
    feed: Optional[Callable[[torch.Tensor], None]]  # writes the pending input tokens on rank 0's device
    prompt_rows: list[tuple[ScheduledChunk, int, int]]  # (chunk, first row, rows) per prompt-logit range


class StepPlanner:
    """Owner of the step inputs' host-side caches (page-table rows kept across steps). Reads
    rank 0's runner for the graph choice only (its captured sizes, pending loads, graph layers)."""

    def __init__(self, coordinator: StateCoordinator, runner: ModelRunner) -> None:
        self.coordinator = coordinator
        self.runner = runner
        self.device = runner.device
        self.page_table_rows = PageTableRows()  # host copies of page tables, kept across steps

    def plan(self, chunks: list[ScheduledChunk], pending: Optional[PendingTokens] = None) -> PlannedStep:
        """The step message of ``chunks``. A chunk whose input token is still pending (sampled by
        the step before, which may still be running) reads it from ``pending`` on the device."""
        coordinator = self.coordinator
        sanitizer = coordinator.sanitizer
        if sanitizer.enabled:
            for chunk in chunks:
                sanitizer.check_owner(coordinator, chunk.sequence.state.owner, chunk.sequence.state.page_tables)
        step = build_step_inputs(chunks, coordinator.num_groups, coordinator.page_size, self.page_table_rows)
        feed = pending.feed(step, self.device) if pending is not None else None
        prompt_rows = prompt_logit_rows(step)
        graph_size, graph_rows = self.runner.graph_size_and_rows(step)
        plan = ForwardPlan(step, [(start, count) for _, start, count in prompt_rows], feed is not None,
                           graph_size, graph_rows)
        return PlannedStep(plan, feed, prompt_rows)

    def result(self, planned: PlannedStep, output: ForwardOutput) -> ExecuteResult:
        """Rank 0's result of the step: non-finite logits are a sanitizer error (a forward pass
        read poisoned, freed, state); prompt logprobs from each range's logits."""
        step = planned.plan.inputs
        if self.coordinator.sanitizer.enabled and not torch.isfinite(output.logits).all():
            raise SanitizerError("non-finite logits: a forward pass read poisoned (freed) state")
        sampling_chunks = [chunk for chunk in step.chunks if chunk.samples]
        prompt_logprobs = {id(chunk): [] for chunk in step.chunks if chunk.prompt_logprobs}
        for (chunk, _, count), logits in zip(planned.prompt_rows, output.prompt_logits):
            prompt_logprobs[id(chunk)] = chunk_prompt_logprobs(chunk, count, logits)
        return ExecuteResult(sampling_chunks, output.logits, prompt_logprobs, step, output.hidden)


def prompt_logit_rows(step: StepInputs) -> list[tuple[ScheduledChunk, int, int]]:
    """(chunk, first row, rows) of each chunk whose prompt logprobs this step computes: the
    rows of prompt tokens ``start .. min(end, prompt_len - 1) - 1`` (each predicts the next)."""
    rows = []
    if not step.wants_prompt_logprobs:
        return rows
    for row, chunk in enumerate(step.chunks):
        if not chunk.prompt_logprobs:
            continue
        last_position = min(chunk.start + chunk.num_new_tokens, chunk.sequence.num_prompt_tokens - 1)
        if last_position - chunk.start > 0:
            rows.append((chunk, step.query_starts[row], last_position - chunk.start))
    return rows


def chunk_prompt_logprobs(chunk: ScheduledChunk, count: int, logits: torch.Tensor) -> list[PositionLogprobs]:
    """Logprobs of prompt tokens ``start+1 .. start+count`` from the logits of this chunk's rows."""
    sequence = chunk.sequence
    targets = torch.tensor(sequence.token_ids[chunk.start + 1:chunk.start + 1 + count],
                           dtype=torch.long, device=logits.device)
    chosen, ranks, top_ids, top_logprobs = compute_logprobs(logits, targets, sequence.params.prompt_logprobs)
    return to_position_logprobs(targets, chosen, ranks, top_ids, top_logprobs)
