"""Verification on rank 0's worker: which drafts the target accepts, and the token it adds.

Runs a ``VerifyPlan`` (``verify_plan.py``) on the logits of the verification step's forward pass.
Each row is processed exactly as the sampler processes a plain step's row — penalties over the
outputs so far including the drafts before it, min_tokens bans counted from its position, the
grammar's mask after its drafts — so a row's distribution is the one the target would sample
from at that point (``tandem/spec_decode/verify.py`` states the acceptance rules).

- Greedy rows accept ``di`` while it equals the row's argmax; the token added is the argmax of
  the first row that disagrees (or of row ``k``).
- Sampled rows use rejection sampling: ``di``, drawn from the draft's ``q``, is accepted with
  probability ``min(1, p(di) / q(di))``; at the first rejection the token is drawn from
  ``max(0, p - q)`` normalised, and after ``k`` acceptances from row ``k``'s ``p``.

Draws use the sequence's own generator when it has a seed (else the sampler's), in a fixed order:
one uniform per draft row, then one draw per item. Acceptance, the target's token and the
logprobs are computed on the device; the host waits once, for one copy of them all.
"""
from __future__ import annotations

from typing import Optional

import torch

from tandem.worker.host_logprobs import HostLogprobs
from tandem.worker.host_staging import to_device
from tandem.worker.rank_sampling import RankSampling
from tandem.worker.sampler import Sampler, SamplingMetadata, compute_logprobs, greedy_mask
from tandem.worker.verify_plan import VerifyOutput, VerifyPlan


def verify(logits: torch.Tensor, plan: VerifyPlan, sampling: RankSampling) -> VerifyOutput:
    """The plan's verdicts from ``logits`` (the forward pass's sampled rows)."""
    return _Verification(logits, plan, sampling).run()


class _Verification:
    def __init__(self, logits: torch.Tensor, plan: VerifyPlan, sampling: RankSampling) -> None:
        self.logits, self.plan, self.sampling = logits, plan, sampling
        self.sampler: Sampler = sampling.sampler
        self.device = sampling.device
        self.rows = _Rows(plan)

    def run(self) -> VerifyOutput:
        plan, rows, device = self.plan, self.rows, self.device
        logits = self.logits
        raw = logits.index_select(0, to_device(rows.logits_rows, logits.device, torch.long)).float()
        metadata = self._metadata()
        processed = Sampler.process_logits(raw.clone(), metadata)
        greedy_tokens = processed.argmax(dim=-1)
        probs = None if metadata.all_greedy else Sampler.probabilities(processed, metadata)
        item_of_row = to_device(rows.item_of_row, device, torch.long)
        offset_of_row = to_device(rows.offsets, device, torch.long)
        draft_of_row = to_device(rows.draft_of_row, device, torch.long)
        greedy = greedy_mask(metadata.temperature.to(device))
        accepted = self._accepted_counts(greedy_tokens, probs, greedy, item_of_row, offset_of_row, draft_of_row)
        final_rows = to_device(rows.first_rows, device, torch.long) + accepted
        finals = self._final_tokens(accepted, final_rows, greedy_tokens, probs, greedy)
        # Per row, the token it emits: its draft while accepted, the target's token right after.
        chosen = torch.where(offset_of_row < accepted.index_select(0, item_of_row), draft_of_row,
                             finals.index_select(0, item_of_row))
        columns = [chosen, accepted]
        num_top = plan.num_top_logprobs
        if plan.wants_logprobs:
            values, ranks, top_ids, top_values = compute_logprobs(raw, chosen, num_top)
            columns += [values, ranks] + ([top_ids, top_values] if top_ids is not None else [])
        host = _one_copy_to_host(columns)  # the step's one wait for the device
        chosen_host, counts = host[0].long().tolist(), host[1].long().tolist()
        token_ids = [chosen_host[first:first + count + 1] for first, count in zip(rows.first_rows, counts)]
        logprobs = None
        if plan.wants_logprobs:
            logprobs = [self._logprobs(host, first, count + 1, num_top) for first, count in zip(rows.first_rows, counts)]
        return VerifyOutput(token_ids, counts, logprobs)

    def _generators(self, items: list[int]) -> list[Optional[torch.Generator]]:
        plan = self.plan
        return [self.sampling.generator(plan.keys[item], plan.seeds[item]) for item in items]

    def _metadata(self) -> SamplingMetadata:
        plan, rows = self.plan, self.rows
        empty = [[]] * len(rows.offsets)
        return SamplingMetadata.build(
            [plan.params[item] for item in rows.item_of_row], self._generators(rows.item_of_row),
            plan.prompt_token_ids or empty, plan.output_token_ids or empty, plan.banned_token_ids or empty,
            self.device, token_bitmask=self.sampling.bitmask_to_device(plan.token_bitmask))

    def _accepted_counts(self, greedy_tokens, probs, greedy, item_of_row, offset_of_row, draft_of_row) -> torch.Tensor:
        """``[items]`` how many drafts each item accepts: the offset of its first rejected row
        (the row after its last draft always counts as rejected)."""
        plan, rows, device = self.plan, self.rows, self.device
        if plan.simulated_accepted is not None:
            return to_device(plan.simulated_accepted, device, torch.long)
        is_draft = to_device(rows.is_draft, device, torch.bool)
        accept = greedy_tokens == draft_of_row
        if probs is not None:
            draft_rows = to_device(rows.draft_rows, device, torch.long)
            sampled = torch.zeros(len(rows.offsets), dtype=torch.bool, device=device)
            if rows.draft_rows:
                drafts = draft_of_row.index_select(0, draft_rows)
                target = probs.index_select(0, draft_rows).gather(1, drafts[:, None]).squeeze(1)
                draft = torch.cat([self._draft_probability(item) for item in range(plan.num_items)])
                uniform = self._uniforms(self._generators(
                    [item for item in range(plan.num_items) for _ in plan.draft_token_ids[item]]))
                sampled = sampled.index_copy(0, draft_rows, uniform * draft <= target)
            accept = torch.where(greedy, accept, sampled)
        rejected_at = torch.where(accept & is_draft, len(rows.offsets), offset_of_row)
        first_rejected = torch.full((plan.num_items,), len(rows.offsets), dtype=torch.long, device=device)
        return first_rejected.scatter_reduce_(0, item_of_row, rejected_at, "amin")

    def _draft_probs(self, item: int) -> Optional[torch.Tensor]:
        """The distributions the item's drafts were drawn from (None: not drawn, greedy)."""
        plan = self.plan
        return self.sampling.draft_probs(plan.keys[item]) if plan.drawn[item] else None

    def _draft_probability(self, item: int) -> torch.Tensor:
        """q(d_i) of each draft (1 for greedy requests, whose drafts are not drawn)."""
        drafts = self.plan.draft_token_ids[item]
        probs = self._draft_probs(item)
        if probs is None:
            return torch.ones(len(drafts), device=self.device)
        ids = torch.tensor(drafts, device=probs.device)
        return probs[:len(drafts)].gather(1, ids[:, None]).squeeze(1).to(self.device)

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

    def _final_tokens(self, accepted, final_rows, greedy_tokens, probs, greedy) -> torch.Tensor:
        """``[items]`` the target's token after the accepted drafts: the argmax for greedy rows;
        else a draw from the residual ``max(0, p - q)`` after a rejection, or from ``p``."""
        plan, device = self.plan, self.device
        tokens = greedy_tokens.index_select(0, final_rows)
        if probs is None:
            return tokens
        distributions = probs.index_select(0, final_rows)
        drafts = plan.draft_token_ids
        with_probs = [item for item in range(plan.num_items) if plan.drawn[item] and drafts[item]]
        if with_probs and plan.simulated_accepted is None:
            # q at each item's final row: its draft distribution there (a row of zeros where none).
            vocab = distributions.shape[1]
            stacked, starts, total = [], [], 0
            for item in with_probs:
                count = len(drafts[item])
                stacked.append(self._draft_probs(item)[:count].to(device))
                starts.append(total)
                total += count
            flat_q = torch.cat(stacked + [distributions.new_zeros((1, vocab))])
            base = [total] * plan.num_items
            last = [0] * plan.num_items
            for item, start in zip(with_probs, starts):
                base[item], last[item] = start, len(drafts[item]) - 1
            counts = to_device([len(ids) for ids in drafts], device, torch.long)
            last_row = to_device(last, device, torch.long)
            q_rows = to_device(base, device, torch.long) + torch.minimum(accepted, last_row)
            rejected = (accepted < counts) & (to_device(base, device, torch.long) < total)
            residual = (distributions - flat_q.index_select(0, q_rows)).clamp_(min=0)
            mass = residual.sum(dim=-1, keepdim=True)
            use = rejected[:, None] & (mass > 0)
            distributions = torch.where(use, residual / mass.clamp(min=1e-30), distributions)
        drawn = self.sampler.draw(distributions, self._generators(list(range(plan.num_items))))
        return torch.where(greedy.index_select(0, final_rows), tokens, drawn)

    @staticmethod
    def _logprobs(host: list[torch.Tensor], first: int, count: int, num_top: int) -> HostLogprobs:
        """The logprobs of an item's ``count`` emitted tokens (rows ``first...``) from the host copy."""
        rows = slice(first, first + count)
        empty = [[] for _ in range(count)]
        return HostLogprobs(host[0][rows].long().tolist(), host[2][rows].float().tolist(),
                            host[3][rows].long().tolist(),
                            host[4][rows].long().tolist() if num_top > 0 else empty,
                            host[5][rows].float().tolist() if num_top > 0 else empty)


class _Rows:
    """The verification's logits rows, item by item: item ``i`` has ``drafts_i + 1`` rows,
    offset ``j`` of them after its ``j`` first drafts (host lists, built once)."""

    def __init__(self, plan: VerifyPlan) -> None:
        self.logits_rows, self.offsets, self.item_of_row = [], [], []
        self.draft_of_row, self.is_draft, self.draft_rows, self.first_rows = [], [], [], []
        for item, (first, drafts) in enumerate(zip(plan.logits_rows, plan.draft_token_ids)):
            self.first_rows.append(len(self.offsets))
            for offset in range(len(drafts) + 1):
                if offset < len(drafts):
                    self.draft_rows.append(len(self.offsets))
                self.logits_rows.append(first + offset)
                self.offsets.append(offset)
                self.item_of_row.append(item)
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
