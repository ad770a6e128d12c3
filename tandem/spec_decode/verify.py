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

from tandem.engine.protocol import PositionLogprobs
from tandem.scheduler.sequence import Sequence
from tandem.worker.host_staging import to_device
from tandem.worker.sampler import Sampler, SamplerOutput, SamplingMetadata, compute_logprobs, greedy_mask


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
    """Owned by the speculator; draws with the engine's sampler (its generator for rows without
    a seed)."""

    def __init__(self, core, simulate_accept_length: Optional[float] = None) -> None:
        self.core = core
        self.sampler: Sampler = core.sampler
        self.device = core.device
        self.simulate_accept_length = simulate_accept_length

    def __call__(self, logits: torch.Tensor, items: list[VerifyItem]) -> list[Verdict]:
        rows, row_items, ahead = [], [], []
        for item in items:
            for offset in range(len(item.draft_token_ids) + 1):
                rows.append(item.row + offset)
                row_items.append(item)
                ahead.append(offset)
        raw = logits.index_select(0, to_device(rows, logits.device, torch.long))
        metadata = self._metadata(row_items, ahead)
        processed = Sampler.process_logits(raw.clone(), metadata)
        greedy_tokens = processed.argmax(dim=-1)
        probs = None if metadata.all_greedy else Sampler.probabilities(processed, metadata)
        first_rows = [0]
        for item in items:
            first_rows.append(first_rows[-1] + len(item.draft_token_ids) + 1)
        accepted = self._accepted_counts(items, first_rows, greedy_tokens, probs, metadata)
        final_rows = [first + count for first, count in zip(first_rows, accepted)]
        finals = self._final_tokens(items, accepted, final_rows, greedy_tokens, probs, metadata)
        tokens = [item.draft_token_ids[:count] + [final] for item, count, final in zip(items, accepted, finals)]
        logprobs = self._logprobs(items, tokens, first_rows, raw)
        return [Verdict(token_ids, count, entries) for token_ids, count, entries in zip(tokens, accepted, logprobs)]

    def _metadata(self, row_items: list[VerifyItem], ahead: list[int]) -> SamplingMetadata:
        penalised = any(item.sequence.params.uses_penalties for item in row_items)
        core = self.core
        return SamplingMetadata.build(
            [item.sequence.params for item in row_items], [item.sequence.generator for item in row_items],
            [item.sequence.prompt_token_ids if penalised else [] for item in row_items],
            [item.sequence.output_token_ids + item.draft_token_ids[:offset] if penalised else []
             for item, offset in zip(row_items, ahead)],
            [core._banned_tokens(item.sequence, offset) for item, offset in zip(row_items, ahead)], self.device)

    def _accepted_counts(self, items, first_rows, greedy_tokens, probs, metadata) -> list[int]:
        """Per item, how many drafts are accepted (one device-to-host copy for all)."""
        draft_rows = [first + offset for item, first in zip(items, first_rows)
                      for offset in range(len(item.draft_token_ids))]
        if not draft_rows:
            return [0] * len(items)
        if self.simulate_accept_length is not None:
            return [self._simulated(item) for item in items]
        index = to_device(draft_rows, self.device, torch.long)
        drafts = to_device([token for item in items for token in item.draft_token_ids], self.device, torch.long)
        accept = greedy_tokens.index_select(0, index) == drafts
        if probs is not None:
            target = probs.index_select(0, index).gather(1, drafts[:, None]).squeeze(1)
            draft = torch.cat([self._draft_probability(item) for item in items])
            uniform = self._uniforms([item.sequence.generator for item in items
                                      for _ in item.draft_token_ids])
            sampled = uniform * draft <= target
            greedy = greedy_mask(metadata.temperature.to(self.device)).index_select(0, index)
            accept = torch.where(greedy, accept, sampled)
        flags = accept.tolist()
        counts, position = [], 0
        for item in items:
            count = 0
            while count < len(item.draft_token_ids) and flags[position + count]:
                count += 1
            counts.append(count)
            position += len(item.draft_token_ids)
        return counts

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

    def _final_tokens(self, items, accepted, final_rows, greedy_tokens, probs, metadata) -> list[int]:
        """The target's token after the accepted drafts: the argmax for greedy rows; else a draw
        from the residual ``max(0, p - q)`` after a rejection, or from ``p``."""
        tokens = greedy_tokens.index_select(0, to_device(final_rows, self.device, torch.long))
        if probs is not None:
            greedy = greedy_mask(metadata.temperature.to(self.device))
            distributions = []
            for item, count, row in zip(items, accepted, final_rows):
                distribution = probs[row]
                rejected = count < len(item.draft_token_ids) and self.simulate_accept_length is None
                if rejected and item.draft_probs is not None:
                    residual = (distribution - item.draft_probs[count].to(self.device)).clamp_(min=0)
                    total = residual.sum()
                    distribution = torch.where(total > 0, residual / total.clamp(min=1e-30), distribution)
                distributions.append(distribution)
            index = to_device(final_rows, self.device, torch.long)
            drawn = self.sampler.draw(torch.stack(distributions), [item.sequence.generator for item in items])
            tokens = torch.where(greedy.index_select(0, index), tokens, drawn)
        return tokens.tolist()

    def _logprobs(self, items, tokens, first_rows, raw) -> list[list[Optional[PositionLogprobs]]]:
        """Each emitted token's logprobs under the target's raw distribution at its row."""
        if all(item.sequence.params.logprobs is None for item in items):
            return [[None] * len(token_ids) for token_ids in tokens]
        rows = [first + offset for first, token_ids in zip(first_rows, tokens) for offset in range(len(token_ids))]
        flat = [token for token_ids in tokens for token in token_ids]
        sequences = [item.sequence for item, token_ids in zip(items, tokens) for _ in token_ids]
        num_top = max((s.params.logprobs or 0 for s in sequences), default=0)
        chosen_rows = raw.index_select(0, to_device(rows, raw.device, torch.long))
        chosen = to_device(flat, raw.device, torch.long)
        values, ranks, top_ids, top_values = compute_logprobs(chosen_rows, chosen, num_top)
        entries = self.core._sampled_logprobs(sequences, SamplerOutput(chosen, values, ranks, top_ids,
                                                                       top_values).to_host())
        result, position = [], 0
        for token_ids in tokens:
            result.append(entries[position:position + len(token_ids)])
            position += len(token_ids)
        return result
