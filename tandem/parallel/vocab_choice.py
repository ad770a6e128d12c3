"""The greedy choice under tensor parallelism, made per vocabulary shard: no logits gathered.

Each rank's LM head gives its slice of the vocabulary's columns (``layers.ParallelLMHead``).
Gathering a step's logits costs (at batch 64 of a 128k vocabulary in bf16, 8 MB a rank: ~60 µs
of a 3.5 ms decode step on two H200s), and a step whose every sampled row takes the greedy
choice of the raw logits needs none of it. Each rank instead sends, per row:

- its greedy summaries (``kernels/greedy_choice.greedy_summaries``: per part of its columns the
  maximum, its first index in the whole vocabulary and the sum of exponentials): ``[rows, 3,
  parts]``, gathered along the parts;
- where rows ask for top logprobs, its ``k`` largest logits and their ids: ``[rows, 2, k]`` (the
  ids as int32 bits), gathered along ``k`` (a step whose ``k`` is more than some rank's columns,
  a vocabulary of a few tokens a rank, gathers the logits instead: ``ParallelLMHead``).

Rank 0 merges them (``VocabChoice.merge``): the token (bit for bit the full logits' argmax, its
first index on ties), its logprob, and the top ``k`` over every rank's candidates (the global
top ``k`` are among them), each less the log-sum-exp the summaries give — equal to the sampler's
general path up to float32 rounding (its sums grouped by other parts).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch

from tandem.kernels.greedy_choice import GreedyChoice, greedy_summaries, merge_summaries, summaries_log_normaliser


class VocabChoice(NamedTuple):
    """What every rank gathered of a step's sampled rows (rank 0 merges it)."""
    summaries: torch.Tensor  # [rows, 3, parts of every rank]
    tops: Optional[torch.Tensor]  # [rows, 2, ranks * k]: candidates' logits and ids (int32 bits); None: k = 0
    top: int = 0  # k: the candidates each rank sent

    def rows(self, index: Union[Sequence[int], torch.Tensor]) -> "VocabChoice":
        return self._replace(summaries=self.summaries[index], tops=None if self.tops is None else self.tops[index])

    def finite(self) -> bool:
        """Whether the summaries' maxima and sums are finite (the sanitizer's check of logits)."""
        return bool(torch.isfinite(self.summaries[:, 0::2]).all())

    def merge(self, num_top: int) -> tuple[GreedyChoice, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(choice, top ids, top logprobs)``: the tops ``[rows, num_top]`` (int64, float32),
        most likely first, as ``sampler.compute_logprobs`` gives them; None for ``num_top`` 0.
        The candidates must have been gathered for at least ``num_top``."""
        choice = merge_summaries(self.summaries)
        if num_top <= 0:
            return choice, None, None
        if num_top > self.top:
            raise ValueError(f"vocabulary-shard choice: {num_top} top logprobs asked, {self.top} gathered a rank")
        values, order = self.tops[:, 0].topk(num_top, dim=-1)
        ids = self.tops[:, 1].contiguous().view(torch.int32).gather(1, order).long()
        return choice, ids, values - summaries_log_normaliser(self.summaries)[:, None]


def shard_choice(local_logits: torch.Tensor, first: int, columns: int, top: int, shard) -> VocabChoice:
    """Every rank's part of a ``VocabChoice``, gathered over ``shard`` (every rank calls it
    alike): ``local_logits`` are this rank's columns, starting at token ``first``, of which the
    first ``columns`` lie inside the vocabulary (the padding past it left out); ``top`` the most
    top logprobs a row asks for, at most every rank's ``columns``."""
    local_logits = local_logits.contiguous()
    summaries = shard.all_gather(greedy_summaries(local_logits, index_base=first, columns=columns))
    if top <= 0:
        return VocabChoice(summaries, None)
    values, ids = local_logits[:, :columns].topk(top, dim=-1)  # (in the logits' dtype: float32 holds it exactly)
    ids = (ids + first).to(torch.int32).view(torch.float32)
    tops = shard.all_gather(torch.stack([values.float(), ids], dim=1))
    return VocabChoice(summaries, tops, top)
