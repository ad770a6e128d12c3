"""Rank 0's worker's side of speculation's proposer: the draft's passes and draws.

Owner: rank 0's worker (``engine/ranks/worker.py``), which runs each ``DraftPassPlan`` the
proposer sends (``draft_pass_plan.py``) with the draft network of its rank, its model runner and
what it keeps for sampling (``worker/rank_sampling.py``: the sampler, the per-sequence generators,
the drafts' distributions the verification reads). Between the passes of one proposal it keeps,
per sequence key, the drafts drawn so far (0-d device tensors: a chain runs without waiting for
its tokens on the host), their distributions and the last output of the sequence's row; the end
of the proposal (``ProposalEnd``) reads the drafts back in one copy and leaves their
distributions for the verification. An MTP layer's carried hidden states (one per sequence whose
state a prefill server sent) are kept under the sequence's key until the proposal that reads
them ends, or the sequence does (``forget``, with its generators: the sanitizer checks
``live_keys``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from tandem.spec_decode.draft_batch import DraftNetwork, DraftRow, run_rows
from tandem.spec_decode.draft_pass_plan import DraftPassPlan, DraftPassRow, ProposalEnd, ProposalOutput
from tandem.structured.bitmask import apply_bitmask
from tandem.worker.rank_sampling import RankSampling
from tandem.worker.sampler import GREEDY_TEMPERATURE_EPSILON, Sampler, SamplingMetadata, greedy_mask


@dataclass
class _Drafting:
    """One sequence's proposal in progress."""
    tokens: list = field(default_factory=list)  # drafts: 0-d device tensors
    probs: list = field(default_factory=list)  # [vocab] the distributions drawn from (sampled rows)
    hidden: Optional[torch.Tensor] = None  # the last row's output at its last position (an MTP chain's input)
    last_hidden: Optional[torch.Tensor] = None  # [hidden] float32, the PD prefill's metadata row's


class RankDrafts:
    def __init__(self, runner, network: DraftNetwork, sampling: RankSampling, rows_as_decode: bool) -> None:
        self.runner = runner
        self.network = network
        self.sampling = sampling
        self.rows_as_decode = rows_as_decode  # the draft keeps its state per token (see ``run_rows``)
        self._drafting: dict[int, _Drafting] = {}
        self._carried: dict[int, torch.Tensor] = {}  # sequence key -> [hidden] float32 (MTP, PD decode)

    # -- per-sequence state ------------------------------------------------------------------------
    def keep_carried_hidden(self, key: int, values: Sequence[float]) -> None:
        """The hidden state a prefill server sent for the sequence's last prompt position."""
        self._carried[key] = torch.tensor(list(values), dtype=torch.float32, device=self.runner.device)

    def forget(self, keys: Sequence[int]) -> None:
        for key in keys:
            self._carried.pop(key, None)
            self._drafting.pop(key, None)

    def live_keys(self) -> set[int]:
        return set(self._carried) | set(self._drafting)

    # -- a proposal ----------------------------------------------------------------------------------
    def run_pass(self, plan: DraftPassPlan, target_hidden: Optional[torch.Tensor], executor=None) -> Optional[list[int]]:
        """One forward pass over the plan's rows; the rows that want logits draw their next draft.
        ``target_hidden``: the last step's hidden states (an MTP row reads its rows of them)."""
        if plan.begins:
            self._drafting.clear()
        rows = [self._row(row, target_hidden) for row in plan.rows]
        output = run_rows(self.runner, self.network, rows, self.runner.coordinator.sanitizer.enabled,
                          rows_as_decode=self.rows_as_decode, executor=executor)
        drawing = []
        for row, hidden, logits in zip(plan.rows, output.last_hidden, output.logits):
            self._drafting[row.key].hidden = hidden
            if logits is not None:
                drawing.append((row.key, logits))
        if not drawing:
            return [] if plan.return_tokens else None
        tokens = self._draw([key for key, _ in drawing], plan, torch.stack([logits for _, logits in drawing]))
        return [int(token) for token in tokens] if plan.return_tokens else None

    def end(self, plan: ProposalEnd) -> ProposalOutput:
        """The drafts of ``plan.keys`` as host ids (one copy), their distributions kept for the
        verification; what the proposal kept on the device goes, and so do the carried states."""
        drafting = [self._drafting.pop(key, None) or _Drafting() for key in plan.keys]
        self._drafting.clear()
        drawn = [token for entry in drafting for token in entry.tokens]
        last = [entry.last_hidden for entry in drafting if entry.last_hidden is not None]
        host = torch.stack(drawn).tolist() if drawn else []  # the chain's one wait for the device
        host_last = [tuple(values) for values in torch.stack(last).tolist()] if last else []
        token_ids, last_hidden = [], []
        for key, entry in zip(plan.keys, drafting):
            count = len(entry.tokens)
            token_ids.append(host[:count])
            host = host[count:]
            last_hidden.append(host_last.pop(0) if entry.last_hidden is not None else ())
            self.sampling.keep_draft_probs(key, torch.stack(entry.probs) if entry.probs else None)
            self._carried.pop(key, None)
        return ProposalOutput(token_ids, last_hidden)

    def _row(self, row: DraftPassRow, target_hidden: Optional[torch.Tensor]) -> DraftRow:
        drafting = self._drafting.setdefault(row.key, _Drafting())
        draft_row = DraftRow(list(row.token_ids), row.start, row.page_tables, wants_logits=row.wants_logits)
        if row.chained:
            draft_row.last_token = drafting.tokens[-1]
            if self.network.hidden_input is not None:
                draft_row.hidden = drafting.hidden[None]
            return draft_row
        if row.carried or row.target_rows is not None:
            draft_row.hidden = self._target_hidden(row, target_hidden)
            if row.keep_last_hidden:
                drafting.last_hidden = draft_row.hidden[-1].float().clone()
        return draft_row

    def _target_hidden(self, row: DraftPassRow, target_hidden: Optional[torch.Tensor]) -> torch.Tensor:
        """An MTP row's hidden inputs: the carried state at its first position where it reads
        one, then the target's hidden states (after its final norm) at the rest."""
        parts = []
        if row.carried:
            parts.append(self._carried[row.key][None])
        if row.target_rows is not None:
            first, end = row.target_rows
            parts.append(self.network.target_hidden(target_hidden[first:end]))
        dtype = parts[-1].dtype
        return torch.cat([part.to(dtype) for part in parts])

    def _draw(self, keys: list[int], plan: DraftPassPlan, logits: torch.Tensor) -> list[torch.Tensor]:
        """Each row's next draft: the argmax for greedy requests, else a draw from the draft's
        distribution under the request's temperature, top-k, top-p and min-p (kept: the
        verification's rejection sampling needs it)."""
        if plan.token_bitmask is not None:
            logits = apply_bitmask(logits.clone(), self.sampling.bitmask_to_device(plan.token_bitmask))
        tokens = logits.argmax(dim=-1)
        probs = None
        if any(params.temperature >= GREEDY_TEMPERATURE_EPSILON for params in plan.params):
            empty = [[] for _ in keys]
            metadata = SamplingMetadata.build(plan.params, self.sampling.generators(keys, plan.seeds), empty, empty,
                                              empty, logits.device)
            probs = Sampler.probabilities(logits.clone(), metadata)
            drawn = self.sampling.sampler.draw(probs, metadata.generators)
            tokens = torch.where(greedy_mask(metadata.temperature.to(logits.device)), tokens, drawn)
        drawn_tokens = tokens.unbind(0)
        for index, (key, params, token) in enumerate(zip(keys, plan.params, drawn_tokens)):
            drafting = self._drafting[key]
            drafting.tokens.append(token)  # on the device until the proposal ends
            if probs is not None and params.temperature >= GREEDY_TEMPERATURE_EPSILON:
                drafting.probs.append(probs[index])
        return list(drawn_tokens)
