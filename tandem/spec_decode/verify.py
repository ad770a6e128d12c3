"""Verification: which drafts a target forward pass accepts, and the token it adds.

A sequence with drafts ``d1..dk`` has ``k + 1`` logits rows in the verification step: row
``i`` is the target's distribution for the token after ``d1..di`` (row 0: after its last known
token). Each row is processed exactly as the sampler processes a plain step's row — penalties
over the outputs so far including the drafts before it, min_tokens bans counted from its
position — so a row's distribution is the one the target would sample from at that point.

- Greedy rows accept ``di`` while it equals the row's argmax; the token added is the argmax of
  the first row that disagrees (or of row ``k``): the output is the target's greedy output.
- Sampled rows use rejection sampling (Leviathan et al., 2023): ``di``, drawn from the draft's
  ``q``, is accepted with probability ``min(1, p(di) / q(di))``; at the first rejection the
  token is drawn from ``max(0, p - q)`` normalised, and after ``k`` acceptances from row
  ``k``'s ``p``. Each output token is then distributed exactly as the target's ``p``.

A structured output's grammar masks each row as the sampler would after the output and the
row's drafts: a draft the grammar forbids has probability 0 under its row, so it is rejected.

Rows without drafts (a prompt's first token, forked siblings) go through the same code and
draw exactly as ``Sampler`` does. Draws use the request's own generator when it has a seed.

The engine core's side (here) builds the verification message from the books — host data only
(``worker/verify_plan.py``) — and books the verdicts; rank 0's worker runs it on the logits it
kept from the step's forward pass (``worker/rank_verification.py``), with the sampler, the
generators and the drafts' distributions it owns, and returns host values (one copy).

``TANDEM_SIMULATE_ACCEPT_LEN=L`` (benchmarks on random weights only; it changes outputs)
accepts drafts as if the mean acceptance length were ``L``: per sequence a running credit of
``L - 1`` drafts per step decides how many are accepted, whatever they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tandem.protocol import PositionLogprobs
from tandem.scheduler.sequence import Sequence
from tandem.step_context import StepContext
from tandem.worker.host_logprobs import HostLogprobs
from tandem.worker.verify_plan import VerifyPlan


@dataclass
class VerifyItem:
    sequence: Sequence
    row: int  # logits row after the sequence's last known token
    draft_token_ids: list[int]
    drawn: bool = False  # the drafts were drawn (rank 0's worker keeps their distributions); else greedy


@dataclass
class Verdict:
    token_ids: list[int]  # the accepted drafts, then the target's token
    num_accepted: int
    logprobs: list[Optional[PositionLogprobs]]  # per token


class Verifier:
    """Owned by the speculator: builds each speculating step's verification message and reads
    the verdicts rank 0's worker returns (``core.executor.verify``)."""

    def __init__(self, core: StepContext, simulate_accept_length: Optional[float] = None) -> None:
        self.core = core
        self.simulate_accept_length = simulate_accept_length

    def __call__(self, items: list[VerifyItem]) -> list[Verdict]:
        output = self.core.executor.verify(self.plan(items))
        verdicts = []
        for index, (item, token_ids, count) in enumerate(zip(items, output.token_ids, output.num_accepted)):
            logprobs = [None] * len(token_ids)
            if output.logprobs is not None:
                logprobs = _kept_logprobs(item.sequence, output.logprobs[index])
            verdicts.append(Verdict(token_ids, count, logprobs))
        return verdicts

    def plan(self, items: list[VerifyItem]) -> VerifyPlan:
        """The verification message of ``items``: per item its drafts, parameters, key and seed;
        per row (item by item, one after each prefix of its drafts) what the sampler reads —
        penalties' token ids, min_tokens' bans counted from the row's position, the grammar's
        mask after the output and the row's drafts."""
        core = self.core
        sequences = [item.sequence for item in items]
        row_items = [(item, offset) for item in items for offset in range(len(item.draft_token_ids) + 1)]
        penalised = any(sequence.params.uses_penalties for sequence in sequences)
        row_sequences = [item.sequence for item, _ in row_items]
        row_drafts = [item.draft_token_ids[:offset] for item, offset in row_items]
        empty = [[]] * len(row_items)
        return VerifyPlan(
            keys=[sequence.arrival_order for sequence in sequences], params=[s.params for s in sequences],
            seeds=[sequence.seed for sequence in sequences], logits_rows=[item.row for item in items],
            draft_token_ids=[list(item.draft_token_ids) for item in items], drawn=[item.drawn for item in items],
            prompt_token_ids=[s.prompt_token_ids for s in row_sequences] if penalised else empty,
            output_token_ids=[item.sequence.output_token_ids + drafts for (item, _), drafts in zip(row_items, row_drafts)]
            if penalised else empty,
            banned_token_ids=[core.banned_tokens(item.sequence, offset) for item, offset in row_items],
            token_bitmask=core.structured.bitmask(row_sequences, row_drafts, on_host=True),
            simulated_accepted=[self._simulated(item) for item in items]
            if self.simulate_accept_length is not None else None,
            num_top_logprobs=max((sequence.params.logprobs or 0 for sequence in sequences), default=0),
            wants_logprobs=any(sequence.params.logprobs is not None for sequence in sequences))

    def _simulated(self, item: VerifyItem) -> int:
        state = item.sequence.speculation
        count = len(item.draft_token_ids)
        if not count:
            return 0
        state.simulated_credit = min(state.simulated_credit + self.simulate_accept_length - 1, count + 1)
        accepted = min(count, int(state.simulated_credit))
        state.simulated_credit -= accepted
        return accepted


def _kept_logprobs(sequence: Sequence, logprobs: HostLogprobs) -> list[Optional[PositionLogprobs]]:
    """Each emitted token's logprobs, as many top ones as the sequence asked for (None if none)."""
    keep = sequence.params.logprobs
    if keep is None:
        return [None] * len(logprobs.token_ids)
    return [PositionLogprobs(entry.token_ids[:1 + keep], entry.logprobs[:1 + keep], entry.rank)
            for entry in logprobs.positions()]
