"""Logprobs as host values: what rank 0's worker returns for the tokens of some positions.

The worker computes them from logits on its device (``compute``) and copies them to the host;
the engine core, which keeps no tensors, turns them into the protocol's ``PositionLogprobs``
(``positions``). The values are the ones ``compute_logprobs`` gives: the log-softmax of the raw
logits, each token's rank (1 + the tokens with a strictly greater logit) and the top ``num_top``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.protocol import PositionLogprobs
from tandem.worker.host_staging import to_device
from tandem.worker.sampler import compute_logprobs


@dataclass
class HostLogprobs:
    """The logprobs of one token per position, then each position's top tokens (host lists)."""
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]  # per position, most likely first (empty lists: none asked)
    top_logprobs: list[list[float]]

    @classmethod
    def compute(cls, logits: torch.Tensor, token_ids: list[int], num_top: int) -> "HostLogprobs":
        """``token_ids[i]``'s logprob under row ``i`` of ``logits`` ([positions, vocab]) and the
        row's top ``num_top`` (one copy to the host)."""
        targets = to_device(token_ids, logits.device, torch.long)
        chosen, ranks, top_ids, top_values = compute_logprobs(logits, targets, num_top)
        columns = [chosen[:, None].double(), ranks[:, None].double()]
        if top_ids is not None:
            columns += [top_ids.double(), top_values.double()]  # (float64 holds both exactly)
        host = torch.cat(columns, dim=1).cpu()
        width = 0 if top_ids is None else top_ids.shape[1]
        empty = [[] for _ in token_ids]
        return cls(list(token_ids), host[:, 0].float().tolist(), host[:, 1].long().tolist(),
                   host[:, 2:2 + width].long().tolist() if width else empty,
                   host[:, 2 + width:].float().tolist() if width else empty)

    def positions(self) -> list[PositionLogprobs]:
        """One ``PositionLogprobs`` per position: the token first, then the top ones."""
        return [PositionLogprobs([token] + top_ids, [value] + top_values, rank)
                for token, value, rank, top_ids, top_values in zip(self.token_ids, self.logprobs, self.ranks,
                                                                   self.top_token_ids, self.top_logprobs)]
