"""Proposers: after each step, a draft network catches up with what the target computed and
then chains up to ``k`` draft tokens for the next step to verify.

Positions are draft positions: a draft row at position ``p`` consumes the token at
``p + shift`` — a draft model (``shift`` 0) the token at ``p``, an MTP layer (``shift`` 1) the
token at ``p + 1`` together with the target's hidden state at ``p``. With ``D`` the draft's
computed positions, ``C`` the target's and ``L`` the known tokens (``C == L - 1`` after a
plain step)::

    catch-up      [D, C)           the sequence's own pages; afterwards D == C
    ahead         [C, L - shift)   known tokens the target has not computed: a draft model's
                                   last token (or more after a recurrent rollback); an MTP
                                   layer has none (it needs the target's hidden states)
    chain         L - shift, ...   one draft token per forward pass, k - 1 of them

The first draft token comes from the last of these rows that exists. Rows past ``C`` are
speculative: where the draft's state kind lets a speculative chain write in place (token
slots, rewritten later) the catch-up and the ahead rows are one forward pass; where it does not
(recurrent state), the ahead rows and the chain run on copies of the draft's state set aside by
the coordinator (``set_aside``, into slots the sequence reserved with its pages). Every proposal
allocates the pages the next verification needs (``L + k`` tokens, those slots included); a
sequence whose pages cannot be had proposes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from tandem.scheduler.sequence import Sequence
from tandem.spec_decode.draft_batch import DraftNetwork, DraftRow, run_rows
from tandem.spec_decode.state import SpeculationState
from tandem.structured.bitmask import apply_bitmask
from tandem.worker.sampler import GREEDY_TEMPERATURE_EPSILON, Sampler, SamplingMetadata, greedy_mask
from tandem.step_context import StepContext


@dataclass
class HiddenRows:
    """The target's output rows of one chunk: row ``row`` of ``tensor`` is position ``first``."""
    tensor: torch.Tensor
    row: int
    first: int

    def at(self, start: int, end: int) -> torch.Tensor:
        if start < self.first:
            raise RuntimeError(f"speculation: the target's hidden state at position {start} is not at hand")
        return self.tensor[self.row + start - self.first:self.row + end - self.first]


@dataclass
class DraftWork:
    """One sequence's draft work after a step (or before one: ``chunk_start`` None)."""
    sequence: Sequence
    chunk_start: Optional[int] = None  # where the step's chunk of the sequence started
    hidden: Optional[HiddenRows] = None  # the target's output rows of that chunk
    propose: bool = False  # the sequence goes on: propose drafts for its next step
    sampled: bool = False  # the step gave it a token


@dataclass
class _Plan:
    work: DraftWork
    state: SpeculationState
    computed: int  # the target's computed tokens
    known: int  # the sequence's known tokens
    drafts: int  # how many to propose (0: catch-up only)
    tables: list[list[int]] = field(default_factory=list)  # where the chain runs
    owner: Optional[str] = None  # copies set aside for the chain
    tokens: list = field(default_factory=list)  # drafts: 0-d device tensors while chaining, then ints
    probs: list[torch.Tensor] = field(default_factory=list)
    hidden: Optional[torch.Tensor] = None  # the last draft row's output (an MTP chain's input)


class Proposer:
    shift = 0

    def __init__(self, core: StepContext, network: DraftNetwork, num_speculative_tokens: int) -> None:
        self.core = core
        self.coordinator = core.coordinator
        self.network = network
        self.num_speculative_tokens = num_speculative_tokens
        self.chain_on_copies = self.coordinator.speculation.copies_needed(network.groups)

    # -- what a subclass says -----------------------------------------------------------------
    def row(self, plan: _Plan, start: int, end: int, tables: list[list[int]], wants_logits: bool) -> DraftRow:
        sequence = plan.work.sequence
        return DraftRow(sequence.token_ids[start + self.shift:end + self.shift], start, tables,
                        wants_logits=wants_logits)

    def chain_row(self, plan: _Plan) -> DraftRow:
        return DraftRow([0], plan.known - self.shift + len(plan.tokens) - 1, plan.tables, wants_logits=True,
                        last_token=plan.tokens[-1])

    def can_propose(self, plan: _Plan) -> bool:
        return True

    def on_remote_prefill(self, sequence: Sequence, hidden: tuple[float, ...]) -> Optional[str]:
        """The sequence's prompt state arrived from a prefill server: propose before its first
        step. Returns an error, or None."""
        sequence.speculation = SpeculationState(num_computed=sequence.num_computed_tokens, pending=True)
        return None

    # -- the work ------------------------------------------------------------------------------
    def drafts_allowed(self, sequence: Sequence) -> int:
        """Drafts the sequence may take: the tokens it may still generate, less the target's own."""
        left = min(sequence.max_tokens - sequence.num_output_tokens,
                   self.core.model_info.max_model_len - sequence.num_tokens)
        return max(0, min(self.num_speculative_tokens, left - 1))

    def run(self, works: list[DraftWork]) -> None:
        plans = [self._plan(work) for work in works]
        if not plans:
            return
        sanitizer = self.coordinator.sanitizer
        for plan in plans:
            sanitizer.check_owner(self.coordinator, plan.work.sequence.state.owner,
                                  plan.work.sequence.state.page_tables)
        merged = not self.chain_on_copies
        first = []
        for plan in plans:
            end = plan.known - self.shift if plan.drafts and merged else plan.computed
            if end > plan.state.num_computed:
                first.append((plan, self.row(plan, plan.state.num_computed, end,
                                             plan.work.sequence.state.page_tables, end == plan.known - self.shift
                                             and plan.drafts > 0)))
        self._forward(first)
        for plan in plans:
            plan.state.num_computed, plan.state.carried_hidden = plan.computed, None
        proposing = [plan for plan in plans if plan.drafts]
        for plan in proposing:
            if merged:
                plan.tables = plan.work.sequence.state.page_tables
            else:
                plan.owner = self.coordinator.speculation.set_aside(plan.work.sequence.state, self.network.groups)
                plan.tables = self.coordinator.speculation.chain_page_tables(plan.work.sequence.state, plan.owner)
        if not merged:
            self._forward([(plan, self.row(plan, plan.computed, plan.known - self.shift, plan.tables, True))
                           for plan in proposing if plan.known - self.shift > plan.computed])
        try:
            self._chain([plan for plan in proposing if plan.tokens])
        finally:
            for plan in proposing:
                if plan.owner is not None:
                    self.coordinator.speculation.end_set_aside(plan.owner)
        drawn = [token for plan in plans for token in plan.tokens]
        host = torch.stack(drawn).tolist() if drawn else []  # the chain's one wait for the device
        for plan in plans:
            plan.tokens, host = host[:len(plan.tokens)], host[len(plan.tokens):]
            sequence = plan.work.sequence
            sequence.draft_token_ids = plan.tokens
            plan.state.drafts_drawn = bool(plan.probs)
            self.core.sampling.keep_draft_probs(sequence.arrival_order, torch.stack(plan.probs) if plan.probs else None)

    def _plan(self, work: DraftWork) -> _Plan:
        sequence = work.sequence
        if sequence.speculation is None:
            sequence.speculation = SpeculationState(num_computed=work.chunk_start or 0)
        state = sequence.speculation
        state.pending = False
        if work.chunk_start is not None:
            state.align(work.chunk_start)
        plan = _Plan(work, state, sequence.num_computed_tokens, sequence.num_tokens,
                     self.drafts_allowed(sequence) if work.propose else 0)
        if plan.drafts and not (self.can_propose(plan)
                                and self.coordinator.try_allocate(sequence.state, plan.known + plan.drafts)):
            plan.drafts = 0
        return plan

    def _chain(self, plans: list[_Plan]) -> None:
        while plans:
            plans = [plan for plan in plans if len(plan.tokens) < plan.drafts]
            self._forward([(plan, self.chain_row(plan)) for plan in plans])

    def _forward(self, entries: list[tuple[_Plan, DraftRow]]) -> None:
        """One forward pass over the rows; draw a draft for each row that wants logits."""
        if not entries:
            return
        output = run_rows(self.core.runner, self.network, [row for _, row in entries],
                          self.coordinator.sanitizer.enabled, rows_as_decode=not self.chain_on_copies,
                          executor=self.core.executor)
        drawing = []
        for (plan, _), hidden, logits in zip(entries, output.last_hidden, output.logits):
            plan.hidden = hidden
            if logits is not None:
                drawing.append((plan, logits))
        if drawing:
            self._draw([plan for plan, _ in drawing], torch.stack([logits for _, logits in drawing]))

    def _draw(self, plans: list[_Plan], logits: torch.Tensor) -> None:
        """Each plan's next draft: the argmax for greedy requests, else a draw from the draft's
        distribution under the request's temperature, top-k, top-p and min-p (kept: the
        verification's rejection sampling needs it)."""
        sequences = [plan.work.sequence for plan in plans]
        logits = self._under_grammars(plans, logits)
        tokens = logits.argmax(dim=-1)
        probs = None
        if any(s.params.temperature >= GREEDY_TEMPERATURE_EPSILON for s in sequences):
            empty = [[] for _ in sequences]
            metadata = SamplingMetadata.build([s.params for s in sequences],
                                              self.core.sampling.generators_of(sequences), empty, empty, empty,
                                              logits.device)
            probs = Sampler.probabilities(logits.clone(), metadata)
            drawn = self.core.sampling.sampler.draw(probs, metadata.generators)
            tokens = torch.where(greedy_mask(metadata.temperature.to(logits.device)), tokens, drawn)
        for index, (plan, token) in enumerate(zip(plans, tokens.unbind(0))):
            plan.tokens.append(token)  # on the device until the chain ends
            if probs is not None and plan.work.sequence.params.temperature >= GREEDY_TEMPERATURE_EPSILON:
                plan.probs.append(probs[index])


    def _under_grammars(self, plans: list[_Plan], logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits masked by each constrained request's grammar after its output and
        its drafts so far, so that drafts are ones the target may accept (the drafts so far are
        read back for that: only when some request is constrained)."""
        if all(plan.work.sequence.grammar is None for plan in plans):
            return logits
        drafts = [[int(token) for token in plan.tokens] for plan in plans]
        bitmask = self.core.structured.bitmask([plan.work.sequence for plan in plans], drafts, count=False)
        return logits if bitmask is None else apply_bitmask(logits.clone(), bitmask)


class DraftModelProposer(Proposer):
    """A draft model: rows consume tokens at their own positions (``shift`` 0)."""


class MTPProposer(Proposer):
    """An MTP layer: a row at position ``p`` consumes the token at ``p + 1`` and the target's
    hidden state at ``p`` (after the target's final norm); a chain step consumes the draft token
    and the MTP layer's own output at the position before. It proposes only when the target
    computed every known token but the last (its hidden states are needed)."""

    shift = 1

    def __init__(self, core: StepContext, network: DraftNetwork, num_speculative_tokens: int, hidden_size: int) -> None:
        super().__init__(core, network, num_speculative_tokens)
        self.hidden_size = hidden_size

    def can_propose(self, plan: _Plan) -> bool:
        return plan.computed == plan.known - 1 and plan.state.num_computed < plan.computed

    def row(self, plan, start, end, tables, wants_logits) -> DraftRow:
        row = super().row(plan, start, end, tables, wants_logits)
        row.hidden = self._target_hidden(plan, start, end)
        if plan.work.sampled and not plan.drafts and end == plan.computed:
            plan.state.last_hidden = row.hidden[-1].float().clone()  # the PD metadata row's
        return row

    def chain_row(self, plan) -> DraftRow:
        row = super().chain_row(plan)
        row.hidden = plan.hidden[None]
        return row

    def _target_hidden(self, plan: _Plan, start: int, end: int) -> torch.Tensor:
        parts, position = [], start
        state = plan.state
        if state.carries(start):
            parts.append(state.carried_hidden[None])
            position += 1
        if position < end:
            if plan.work.hidden is None:
                raise RuntimeError(f"speculation: no hidden state of the target at position {position}")
            parts.append(self.network.target_hidden(plan.work.hidden.at(position, end)))
        dtype = parts[-1].dtype
        return torch.cat([part.to(dtype) for part in parts])

    def on_remote_prefill(self, sequence: Sequence, hidden: tuple[float, ...]) -> Optional[str]:
        if len(hidden) != self.hidden_size:
            return (f"the prefill server sent {len(hidden)} hidden values for the MTP layer, "
                    f"expected {self.hidden_size}")
        carried = torch.tensor(hidden, dtype=torch.float32, device=self.core.device)
        sequence.speculation = SpeculationState(num_computed=sequence.num_computed_tokens - 1,
                                                carried_hidden=carried, pending=True)
        return None
