"""Sharded layers for tensor parallelism (Megatron-style).

- ``RowParallelLinear``: input features split by rank; the partial products are summed over
  the ranks (all-reduce), then the bias is added once; or, without a bias, left to the next
  norm to sum (``reduce=False``).
- ``VocabParallelEmbedding``: each rank holds a consecutive slice of the vocabulary's rows; ids
  outside it embed to zeros, and the sum over ranks is the full embedding.
- ``ParallelLMHead``: the same row slice as logits columns; the ranks' columns are gathered
  into full logits on every rank, or, for a step whose every sampled row takes the greedy
  choice, only what that choice needs of each slice (``choice``; ``vocab_choice.py``).

Column-parallel projections are ``StackedLinear`` with a shard (``layers/linear.py``). With the
one-rank shard every layer here computes exactly what its plain ``torch.nn`` counterpart does.
The vocabulary is padded up to a multiple of the group size; the padding rows are zero and
their logit columns are cut off after the gather.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.linear import Linear, dense_product, linear_product, mark_sharded
from tandem.parallel.shard import SINGLE, TensorShard
from tandem.parallel.vocab_choice import VocabChoice, shard_choice


class ColumnParallelLinear(Linear):
    """Output features split by rank (no collective: the output stays split). ``segments``: the
    checkpoint's output rows as consecutive segments, each split by rank (default: one)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, shard: TensorShard = SINGLE,
                 what: str = "the output features of a column-parallel projection", segments=None) -> None:
        segments = tuple(segments or (out_features,))
        super().__init__(in_features, sum(shard.split(size, what) for size in segments), bias=bias)
        mark_sharded(self.weight, 0, shard, segments)
        if bias:
            mark_sharded(self.bias, 0, shard, segments)


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, shard: TensorShard = SINGLE,
                 what: str = "the input features of a row-parallel projection") -> None:
        super().__init__(shard.split(in_features, what), out_features, bias=bias)
        self.shard = shard
        mark_sharded(self.weight, 1, shard, in_features)

    def forward(self, hidden: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The product summed over the ranks; with ``reduce=False`` this rank's partial product,
        which the caller sums (``RMSNorm(..., reduce_over=shard)``, fused with its add and
        norm). Only a projection without bias defers its sum (the bias is added once, after)."""
        if not self.shard.is_parallel:
            return linear_product(self, hidden)
        output = linear_product(self, hidden, with_bias=False)
        if not reduce:
            if self.bias is not None:
                raise ValueError("RowParallelLinear: a projection with a bias must sum its product itself")
            return output
        output = self.shard.all_reduce(output)
        return output if self.bias is None else output + self.bias


def vocabulary_slice(vocab_size: int, shard: TensorShard) -> tuple[int, int]:
    """(first id, rows per rank) of this rank's slice of a vocabulary padded to the group."""
    rows = -(-vocab_size // shard.size)
    return shard.rank * rows, rows


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.shard = shard
        self.first, rows = vocabulary_slice(vocab_size, shard)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        nn.init.normal_(self.weight)
        mark_sharded(self.weight, 0, shard, vocab_size)
        if shard.is_parallel:  # padding rows past the vocabulary stay zero
            self.weight.data[max(0, vocab_size - self.first):].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.shard.is_parallel:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first
        inside = (local >= 0) & (local < self.weight.shape[0])
        embedded = F.embedding(torch.where(inside, local, 0), self.weight)
        return self.shard.all_reduce(embedded * inside.unsqueeze(-1).to(embedded.dtype))


class ParallelLMHead(nn.Module):
    """Logits ``hidden @ weight.T`` over the whole vocabulary, on every rank. ``weight`` may be
    the embedding's (tied): both use the same slice. Inside ``local_columns()`` the head gives
    this rank's columns, which ``gather`` makes the full logits, or ``choice`` the greedy
    choice's parts every rank sends (``vocab_choice.py``; the engine core decides per step,
    ``ForwardPlan.vocab_choice``, so every rank makes the same collective)."""

    def __init__(self, hidden_size: int, vocab_size: int, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.shard = shard
        self.vocab_size = vocab_size
        self.first, rows = vocabulary_slice(vocab_size, shard)
        # every rank's columns short of the padding past the vocabulary
        self.rank_columns = [max(0, min(rows, vocab_size - rank * rows)) for rank in range(shard.size)]
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        mark_sharded(self.weight, 0, shard, vocab_size)
        self.local = False  # inside ``local_columns``: forward gives this rank's columns

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = dense_product(hidden, self.weight)
        if not self.shard.is_parallel or self.local:
            return logits
        return self.gather(logits)

    @contextmanager
    def local_columns(self):
        """Within: the head (and the model's ``compute_logits`` around it) gives this rank's
        columns of the logits, ``gather`` or ``choice`` to follow."""
        self.local = True
        try:
            yield
        finally:
            self.local = False

    def gather(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Every rank's columns (its ``local_columns`` logits) as the full logits."""
        return self.shard.all_gather(local_logits)[..., :self.vocab_size]

    def chooses(self, top: int) -> bool:
        """Whether ``choice`` serves rows asking for ``top`` logprobs: every rank has as many
        columns (else, with a vocabulary of a few tokens a rank, the logits are gathered)."""
        return top <= min(self.rank_columns)

    def choice(self, local_logits: torch.Tensor, top: int = 0) -> VocabChoice:
        """Every rank's greedy summaries of its columns, and its ``top`` largest logits where
        rows ask for top logprobs (``chooses(top)``), gathered (rank 0 merges them:
        ``VocabChoice.merge``)."""
        return shard_choice(local_logits, self.first, self.rank_columns[self.shard.rank], top, self.shard)
