"""Planning a step and reading its result: the engine core's side of a forward pass.

The engine core (rank 0's process) turns the scheduled chunks into the step message every rank
runs (``ForwardPlan``, ``engine/ranks/plan.py``): the runner's host-side inputs (``StepInputs``),
the CUDA graph every rank replays (``worker/graph_choice.py``: a pure function of the inputs, what
rank 0's worker said it captured, given once at start-up, and the coordinator's pending loads;
every rank's worker checks the choice against its own), each prompt-logprob chunk's logits rows with the tokens they predict and the top
logprobs the request asks for, and whether the input ids come from rank 0's device (tokens still
pending there: the overlapped loop; the plan names the row of rank 0's worker's last sampled
tokens each reads). Its executor hands the plan to every rank's worker, rank 0's included; rank
0's worker checks its logits (the sanitizer) and returns the prompt logprobs as
host values (``engine/ranks/plan.py``'s ``StepOutput``), which come back here as the protocol's
``PositionLogprobs``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tandem.engine.ranks.plan import ForwardPlan, StepOutput
from tandem.kv.coordinator import StateCoordinator
from tandem.protocol import PositionLogprobs
from tandem.scheduler.scheduler import ScheduledChunk
from tandem.worker.graph_choice import GraphChoice
from tandem.worker.sampler import takes_greedy_choice
from tandem.worker.step_inputs import PageTableRows, PendingTokens, StepInputs, build_step_inputs


@dataclass
class ExecuteResult:
    """A step's result as the engine core reads it (host values): the sampled rows' chunks (rank
    0's worker samples or verifies them from the logits it kept) and each prompt-logprob chunk's
    logprobs."""
    sampling_chunks: list[ScheduledChunk]  # in the order of the logits rows
    prompt_logprobs: dict[int, list[PositionLogprobs]]  # id(chunk) -> logprobs of its prompt tokens
    step: Optional[StepInputs] = None  # the step's rows (chunk order, query starts)


@dataclass
class PlannedStep:
    """A step's plan, and what rank 0 keeps beside it to read the result."""
    plan: ForwardPlan
    prompt_rows: list[tuple[ScheduledChunk, int, int]]  # (chunk, first row, rows) per prompt-logit range


class StepPlanner:
    """Owner of the step inputs' host-side caches (page-table rows kept across steps). Chooses
    each step's graph with ``graphs``, what rank 0's worker captured (given at start-up), and
    the coordinator's pending loads."""

    def __init__(self, coordinator: StateCoordinator, graphs: GraphChoice) -> None:
        self.coordinator = coordinator
        self.graphs = graphs
        self.page_table_rows = PageTableRows()  # host copies of page tables, kept across steps

    def plan(self, chunks: list[ScheduledChunk], pending: Optional[PendingTokens] = None,
             hidden_states: bool = False, samples: bool = True) -> PlannedStep:
        """The step message of ``chunks``. A chunk whose input token is still pending (sampled by
        the step before, which may still be running) reads it from the tokens rank 0's worker
        sampled last, on its device: the plan names the row of ``pending`` it reads.
        ``hidden_states``: rank 0's worker keeps the step's hidden states (the draft's passes).
        ``samples``: the sampled rows go to a sampling message (not a verification); where each
        takes the greedy choice alone, the plan says so (``ForwardPlan.vocab_choice``)."""
        coordinator = self.coordinator
        sanitizer = coordinator.sanitizer
        if sanitizer.enabled:
            for chunk in chunks:
                sanitizer.check_owner(coordinator, chunk.sequence.state.owner, chunk.sequence.state.page_tables)
        step = build_step_inputs(chunks, coordinator.num_groups, coordinator.page_size, self.page_table_rows)
        targets, sources = pending.rows(step) if pending is not None else ([], [])
        prompt_rows = prompt_logit_rows(step)
        graph_size, graph_rows = self.graphs.size_and_rows(step, coordinator.pending_loads)
        choice, choice_top = vocab_choice(step.chunks) if samples else (False, 0)
        plan = ForwardPlan(step, [(start, count) for _, start, count in prompt_rows], bool(targets),
                           graph_size, graph_rows, [prompt_targets(chunk, count) for chunk, _, count in prompt_rows],
                           [chunk.sequence.params.prompt_logprobs for chunk, _, _ in prompt_rows], hidden_states,
                           targets, sources, vocab_choice=choice, choice_top=choice_top)
        return PlannedStep(plan, prompt_rows)

    def result(self, planned: PlannedStep, output: StepOutput) -> ExecuteResult:
        """Rank 0's result of the step (its worker checked the logits): each prompt-logprob
        chunk's logprobs, from the host values its range came back with."""
        step = planned.plan.inputs
        sampling_chunks = [chunk for chunk in step.chunks if chunk.samples]
        prompt_logprobs = {id(chunk): [] for chunk in step.chunks if chunk.prompt_logprobs}
        for (chunk, _, _), logprobs in zip(planned.prompt_rows, output.prompt_logprobs):
            prompt_logprobs[id(chunk)] = logprobs.positions()
        return ExecuteResult(sampling_chunks, prompt_logprobs, step)


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


def prompt_targets(chunk: ScheduledChunk, count: int) -> list[int]:
    """The prompt tokens ``start+1 .. start+count`` the chunk's ``count`` prompt-logit rows predict."""
    return chunk.sequence.token_ids[chunk.start + 1:chunk.start + 1 + count]


def vocab_choice(chunks: list[ScheduledChunk]) -> tuple[bool, int]:
    """``(vocab_choice, choice_top)`` of a step's plan: whether it samples some row and every
    sampled row takes the greedy choice of the raw logits alone (``takes_greedy_choice``; a fork
    at the end of a prompt samples its parent's row with the parent's parameters), and then the
    most top logprobs a row asks for."""
    sampled = [chunk.sequence.params for chunk in chunks if chunk.samples]
    if not sampled or not all(takes_greedy_choice(params) for params in sampled):
        return False, 0
    return True, max(params.logprobs or 0 for params in sampled)
