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

``TANDEM_SIMULATE_ACCEPT_LEN=L`` (benchmarks on random weights only; it changes outputs)
accepts drafts as if the mean acceptance length were ``L``: per sequence a running credit of
``L - 1`` drafts per step decides how many are accepted, whatever they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tandem.protocol import PositionLogprobs
from tandem.scheduler.sequence import Sequence
from tandem.worker.host_staging import to_device
from tandem.worker.sampler import Sampler, SamplerOutput, SamplingMetadata, compute_logprobs, greedy_mask
from tandem.step_context import StepContext


@dataclass
class VerifyItem:
    sequence: Sequence
    row: int  # logits row after the sequence's last known token
    draft_token_ids: list[int]
    draft_probs: Optional[torch.Tensor] = None  # [drafts, vocab] what the drafts were drawn from (sampled)


@dataclass
class Verdict:
    token_ids: list[int]  # the accepted drafts, then the target's token
    num_accepted: int
    logprobs: list[Optional[PositionLogprobs]]  # per token


class Verifier:
    """Owned by the speculator; draws with the sampling worker's sampler (its generator for rows
    without a seed) and the sequences' own generators (``core.sampling``)."""

    def __init__(self, core: StepContext, simulate_accept_length: Optional[float] = None) -> None:
        self.core = core
        self.sampling = core.sampling
        self.sampler: Sampler = core.sampling.sampler
        self.device = core.device
        self.simulate_accept_length = simulate_accept_length

    def __call__(self, logits: torch.Tensor, items: list[VerifyItem]) -> list[Verdict]:
        """Acceptance, the target's token and the logprobs are computed on the device; the host
        waits once, for one copy of them all."""
        rows = _Rows(items)
        device = self.device
        raw = logits.index_select(0, to_device(rows.logits_rows, logits.device, torch.long))
        metadata = self._metadata(rows.row_items, rows.offsets)
        processed = Sampler.process_logits(raw.clone(), metadata)
        greedy_tokens = processed.argmax(dim=-1)
        probs = None if metadata.all_greedy else Sampler.probabilities(processed, metadata)
        item_of_row = to_device(rows.item_of_row, device, torch.long)
        offset_of_row = to_device(rows.offsets, device, torch.long)
        draft_of_row = to_device(rows.draft_of_row, device, torch.long)
        greedy = greedy_mask(metadata.temperature.to(device))
        accepted = self._accepted_counts(items, rows, greedy_tokens, probs, greedy, item_of_row, offset_of_row,
                                         draft_of_row)
        final_rows = to_device(rows.first_rows, device, torch.long) + accepted
        finals = self._final_tokens(items, rows, accepted, final_rows, greedy_tokens, probs, greedy)
        # Per row, the token it emits: its draft while accepted, the target's token right after.
        chosen = torch.where(offset_of_row < accepted.index_select(0, item_of_row), draft_of_row,
                             finals.index_select(0, item_of_row))
        columns = [chosen, accepted]
        num_top = max((item.sequence.params.logprobs or 0 for item in items), default=0)
        wants_logprobs = any(item.sequence.params.logprobs is not None for item in items)
        if wants_logprobs:
            values, ranks, top_ids, top_values = compute_logprobs(raw, chosen, num_top)
            columns += [values, ranks] + ([top_ids, top_values] if top_ids is not None else [])
        host = _one_copy_to_host(columns)  # the step's one wait for the device
        chosen_host, counts = host[0].long(), host[1].long().tolist()
        verdicts = []
        for index, (item, count) in enumerate(zip(items, counts)):
            first = rows.first_rows[index]
            token_ids = chosen_host[first:first + count + 1].tolist()
            logprobs = [None] * len(token_ids)
            if wants_logprobs:
                logprobs = self._logprobs(item, host, first, count + 1, num_top)
            verdicts.append(Verdict(token_ids, count, logprobs))
        return verdicts

    def _metadata(self, row_items: list[VerifyItem], ahead: list[int]) -> SamplingMetadata:
        penalised = any(item.sequence.params.uses_penalties for item in row_items)
        core = self.core
        return SamplingMetadata.build(
            [item.sequence.params for item in row_items],
            self.sampling.generators_of([item.sequence for item in row_items]),
            [item.sequence.prompt_token_ids if penalised else [] for item in row_items],
            [item.sequence.output_token_ids + item.draft_token_ids[:offset] if penalised else []
             for item, offset in zip(row_items, ahead)],
            [core.banned_tokens(item.sequence, offset) for item, offset in zip(row_items, ahead)], self.device,
            # the grammar's mask of each row: after the output and the row's drafts
            token_bitmask=core.structured.bitmask([item.sequence for item in row_items],
                                                  [item.draft_token_ids[:offset] for item, offset in
                                                   zip(row_items, ahead)]))

    def _accepted_counts(self, items, rows: "_Rows", greedy_tokens, probs, greedy, item_of_row, offset_of_row,
                         draft_of_row) -> torch.Tensor:
        """``[items]`` how many drafts each item accepts: the offset of its first rejected row
        (the row after its last draft always counts as rejected)."""
        if self.simulate_accept_length is not None:
            return to_device([self._simulated(item) for item in items], self.device, torch.long)
        is_draft = to_device(rows.is_draft, self.device, torch.bool)
        accept = greedy_tokens == draft_of_row
        if probs is not None:
            draft_rows = to_device(rows.draft_rows, self.device, torch.long)
            target = torch.zeros(len(rows.offsets), device=self.device)
            sampled = torch.zeros(len(rows.offsets), dtype=torch.bool, device=self.device)
            if rows.draft_rows:
                drafts = draft_of_row.index_select(0, draft_rows)
                target = probs.index_select(0, draft_rows).gather(1, drafts[:, None]).squeeze(1)
                draft = torch.cat([self._draft_probability(item) for item in items])
                uniform = self._uniforms(self.sampling.generators_of(
                    [item.sequence for item in items for _ in item.draft_token_ids]))
                sampled = sampled.index_copy(0, draft_rows, uniform * draft <= target)
            accept = torch.where(greedy, accept, sampled)
        rejected_at = torch.where(accept & is_draft, len(rows.offsets), offset_of_row)
        first_rejected = torch.full((len(items),), len(rows.offsets), dtype=torch.long, device=self.device)
        return first_rejected.scatter_reduce_(0, item_of_row, rejected_at, "amin")

    def _draft_probability(self, item: VerifyItem) -> torch.Tensor:
        """q(d_i) of each draft (1 for greedy requests, whose drafts are not drawn)."""
        count = len(item.draft_token_ids)
        if item.draft_probs is None:
            return torch.ones(count, device=self.device)
        drafts = torch.tensor(item.draft_token_ids, device=item.draft_probs.device)
        return item.draft_probs[:count].gather(1, drafts[:, None]).squeeze(1).to(self.device)

    def _uniforms(self, generators: list[Optional[torch.Generator]]) -> torch.Tensor:
        """One U[0, 1) draw per row, from the row's generator or the sampler's."""
        values = torch.empty(len(generators), device=self.device)
        shared = [row for row, generator in enumerate(generators) if generator is None]
        if shared:
            values[to_device(shared, self.device, torch.long)] = torch.rand(
                len(shared), device=self.device, generator=self.sampler.generator)
        for row, generator in enumerate(generators):
            if generator is not None:
                values[row] = torch.rand(1, device=self.device, generator=generator)[0]
        return values

    def _simulated(self, item: VerifyItem) -> int:
        state = item.sequence.speculation
        count = len(item.draft_token_ids)
        if not count:
            return 0
        state.simulated_credit = min(state.simulated_credit + self.simulate_accept_length - 1, count + 1)
        accepted = min(count, int(state.simulated_credit))
        state.simulated_credit -= accepted
        return accepted

    def _final_tokens(self, items, rows: "_Rows", accepted, final_rows, greedy_tokens, probs, greedy) -> torch.Tensor:
        """``[items]`` the target's token after the accepted drafts: the argmax for greedy rows;
        else a draw from the residual ``max(0, p - q)`` after a rejection, or from ``p``."""
        tokens = greedy_tokens.index_select(0, final_rows)
        if probs is None:
            return tokens
        distributions = probs.index_select(0, final_rows)
        with_probs = [index for index, item in enumerate(items) if item.draft_probs is not None
                      and item.draft_token_ids]
        if with_probs and self.simulate_accept_length is None:
            # q at each item's final row: its draft distribution there (a row of zeros where none).
            vocab = distributions.shape[1]
            stacked, starts, total = [], [], 0
            for index in with_probs:
                count = len(items[index].draft_token_ids)
                stacked.append(items[index].draft_probs[:count].to(self.device))
                starts.append(total)
                total += count
            flat_q = torch.cat(stacked + [distributions.new_zeros((1, vocab))])
            base = [total] * len(items)
            last = [0] * len(items)
            for index, start in zip(with_probs, starts):
                base[index], last[index] = start, len(items[index].draft_token_ids) - 1
            counts = to_device([len(item.draft_token_ids) for item in items], self.device, torch.long)
            last_row = to_device(last, self.device, torch.long)
            q_rows = to_device(base, self.device, torch.long) + torch.minimum(accepted, last_row)
            rejected = (accepted < counts) & (to_device(base, self.device, torch.long) < total)
            residual = (distributions - flat_q.index_select(0, q_rows)).clamp_(min=0)
            mass = residual.sum(dim=-1, keepdim=True)
            use = rejected[:, None] & (mass > 0)
            distributions = torch.where(use, residual / mass.clamp(min=1e-30), distributions)
        drawn = self.sampler.draw(distributions, self.sampling.generators_of([item.sequence for item in items]))
        return torch.where(greedy.index_select(0, final_rows), tokens, drawn)

    def _logprobs(self, item: VerifyItem, host: list[torch.Tensor], first: int, count: int,
                  num_top: int) -> list[Optional[PositionLogprobs]]:
        """The logprobs of an item's ``count`` emitted tokens (rows ``first...``) under the
        target's raw distribution, from the host copy."""
        if item.sequence.params.logprobs is None:
            return [None] * count
        rows = slice(first, first + count)
        top_ids = host[4][rows].long() if num_top > 0 else None
        top_values = host[5][rows].float() if num_top > 0 else None
        output = SamplerOutput(host[0][rows].long(), host[2][rows].float(), host[3][rows].long(), top_ids, top_values)
        return self.core.sampled_logprobs([item.sequence] * count, output)


class _Rows:
    """The verification's logits rows, item by item: item ``i`` has ``drafts_i + 1`` rows,
    offset ``j`` of them after its ``j`` first drafts (host lists, built once)."""

    def __init__(self, items: list[VerifyItem]) -> None:
        self.logits_rows, self.row_items, self.offsets, self.item_of_row = [], [], [], []
        self.draft_of_row, self.is_draft, self.draft_rows, self.first_rows = [], [], [], []
        for index, item in enumerate(items):
            self.first_rows.append(len(self.offsets))
            drafts = item.draft_token_ids
            for offset in range(len(drafts) + 1):
                if offset < len(drafts):
                    self.draft_rows.append(len(self.offsets))
                self.logits_rows.append(item.row + offset)
                self.row_items.append(item)
                self.offsets.append(offset)
                self.item_of_row.append(index)
                self.draft_of_row.append(drafts[offset] if offset < len(drafts) else 0)
                self.is_draft.append(offset < len(drafts))


def _one_copy_to_host(columns: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the host after one copy (as float64, which holds token ids, counts and
    float32 values exactly); each comes back flattened to ``[rows, ...]`` as it went."""
    flat = torch.cat([column.double().reshape(-1) for column in columns]).cpu()
    result, position = [], 0
    for column in columns:
        size = column.numel()
        result.append(flat[position:position + size].view(column.shape))
        position += size
    return result
