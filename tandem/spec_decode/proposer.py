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

The proposer keeps the books of a proposal (positions, page tables, set-asides, pages, grammars);
the draft's passes and draws run in rank 0's worker, one host-only message per pass
(``draft_pass_plan.py``, ``rank_drafts.py``), and the drafts come back as host ids when the
proposal ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tandem.scheduler.sequence import Sequence
from tandem.spec_decode.draft_batch import DraftNetwork
from tandem.spec_decode.draft_pass_plan import DraftPassPlan, DraftPassRow, ProposalEnd
from tandem.spec_decode.state import SpeculationState
from tandem.worker.sampler import GREEDY_TEMPERATURE_EPSILON
from tandem.step_context import StepContext


@dataclass
class HiddenRows:
    """Where the target's output rows of one chunk are in the step's hidden states (rank 0's
    worker keeps them): row ``row`` is position ``first``."""
    row: int
    first: int

    def at(self, start: int, end: int) -> tuple[int, int]:
        """The rows of positions ``[start, end)``."""
        if start < self.first:
            raise RuntimeError(f"speculation: the target's hidden state at position {start} is not at hand")
        return self.row + start - self.first, self.row + end - self.first


@dataclass
class DraftWork:
    """One sequence's draft work after a step (or before one: ``chunk_start`` None)."""
    sequence: Sequence
    chunk_start: Optional[int] = None  # where the step's chunk of the sequence started
    hidden: Optional[HiddenRows] = None  # where the target's output rows of that chunk are
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
    num_drawn: int = 0  # drafts drawn so far (on rank 0's worker until the proposal ends)
    host_drafts: list[int] = field(default_factory=list)  # the drafts so far, where a grammar needs them

    @property
    def key(self) -> int:
        return self.work.sequence.arrival_order


class Proposer:
    shift = 0

    def __init__(self, core: StepContext, network: DraftNetwork, num_speculative_tokens: int) -> None:
        self.core = core
        self.coordinator = core.coordinator
        self.network = network
        self.num_speculative_tokens = num_speculative_tokens
        self.chain_on_copies = self.coordinator.speculation.copies_needed(network.groups)
        self._begins = False  # the next pass is the first of a proposal

    # -- what a subclass says -----------------------------------------------------------------
    def row(self, plan: _Plan, start: int, end: int, tables: list[list[int]], wants_logits: bool) -> DraftPassRow:
        sequence = plan.work.sequence
        return DraftPassRow(plan.key, sequence.token_ids[start + self.shift:end + self.shift], start, tables,
                            wants_logits=wants_logits)

    def chain_row(self, plan: _Plan) -> DraftPassRow:
        return DraftPassRow(plan.key, [0], plan.known - self.shift + plan.num_drawn - 1, plan.tables,
                            wants_logits=True, chained=True)

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
        self._begins = True
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
            plan.state.num_computed, plan.state.carries_hidden = plan.computed, False
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
            self._chain([plan for plan in proposing if plan.num_drawn])
        finally:
            for plan in proposing:
                if plan.owner is not None:
                    self.coordinator.speculation.end_set_aside(plan.owner)
        output = self.core.executor.end_proposal(ProposalEnd([plan.key for plan in plans]))
        for plan, tokens, last_hidden in zip(plans, output.token_ids, output.last_hidden):
            plan.work.sequence.draft_token_ids = tokens
            plan.state.drafts_drawn = bool(tokens) and plan.work.sequence.params.temperature >= GREEDY_TEMPERATURE_EPSILON
            if last_hidden:
                plan.state.last_hidden = last_hidden

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
            plans = [plan for plan in plans if plan.num_drawn < plan.drafts]
            self._forward([(plan, self.chain_row(plan)) for plan in plans])

    def _forward(self, entries: list[tuple[_Plan, DraftPassRow]]) -> None:
        """One forward pass over the rows, on rank 0's worker; each row that wants logits draws
        a draft there (the argmax for greedy requests, else a draw under the request's
        parameters, its distribution kept for the verification)."""
        if not entries:
            return
        drawing = [plan for plan, row in entries if row.wants_logits]
        sequences = [plan.work.sequence for plan in drawing]
        bitmask = self._grammar_bitmask(drawing)
        constrained = any(sequence.grammar is not None for sequence in sequences)
        plan = DraftPassPlan([row for _, row in entries], [sequence.params for sequence in sequences],
                             [sequence.seed for sequence in sequences], bitmask, return_tokens=constrained,
                             begins=self._begins)
        self._begins = False
        tokens = self.core.executor.draft_pass(plan)
        for index, drawer in enumerate(drawing):
            drawer.num_drawn += 1
            if tokens is not None:
                drawer.host_drafts.append(tokens[index])

    def _grammar_bitmask(self, plans: list[_Plan]):
        """The grammar masks of the drawing rows, each after its request's output and its drafts
        so far, so that drafts are ones the target may accept (None: no request constrained)."""
        if all(plan.work.sequence.grammar is None for plan in plans):
            return None
        return self.core.structured.bitmask([plan.work.sequence for plan in plans],
                                            [list(plan.host_drafts) for plan in plans], count=False, on_host=True)


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
        # A prefill server sends the target's hidden state at the last prompt position (the
        # metadata row's): only there is it read back.
        transfer = core.config.transfer
        self.keeps_last_hidden = transfer is not None and transfer.role == "prefill"

    def can_propose(self, plan: _Plan) -> bool:
        return plan.computed == plan.known - 1 and plan.state.num_computed < plan.computed

    def row(self, plan, start, end, tables, wants_logits) -> DraftPassRow:
        row = super().row(plan, start, end, tables, wants_logits)
        state, position = plan.state, start
        if state.carries(start):
            row.carried = True
            position += 1
        if position < end:
            if plan.work.hidden is None:
                raise RuntimeError(f"speculation: no hidden state of the target at position {position}")
            row.target_rows = plan.work.hidden.at(position, end)
        row.keep_last_hidden = (self.keeps_last_hidden and plan.work.sampled and not plan.drafts
                                and end == plan.computed)
        return row

    def on_remote_prefill(self, sequence: Sequence, hidden: tuple[float, ...]) -> Optional[str]:
        if len(hidden) != self.hidden_size:
            return (f"the prefill server sent {len(hidden)} hidden values for the MTP layer, "
                    f"expected {self.hidden_size}")
        self.core.executor.keep_carried_hidden(sequence.arrival_order, hidden)
        sequence.speculation = SpeculationState(num_computed=sequence.num_computed_tokens - 1,
                                                carries_hidden=True, pending=True)
        return None
