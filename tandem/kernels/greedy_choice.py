"""The greedy choice of each row of logits, with its logprob and rank, in two small launches.

For logits ``[B, V]`` (any float dtype, computed in float32)::

    token[r]   = argmax_t logits[r, t]          the first index of the maximum, as torch.argmax
    logprob[r] = max_r - (log(sum_t exp(logits[r, t] - max_r)) + max_r)
                                                 logits[r, token] - logsumexp, as the sampler has it
    rank[r]    = 1                               no logit is greater than the maximum

This is what the sampler computes when every row is greedy and nothing changes the logits
(no penalty, grammar mask or banned id) and no row asks for top logprobs: there it took eight
launches (a float32 copy and a clone of the logits, the argmax, the log-sum-exp's reductions,
the rank's comparison and count, the packing for the host). Here::

    partial kernel: grid (row, part); each part's lanes keep a running maximum, the first index
                    where it occurred and a sum of exponentials relative to it, merged at the end
                    into the part's *summary* (``greedy_summaries``: ``[B, 3, parts]`` float32,
                    the index as int32 bits)
    final kernel:   grid (row); merges the parts, writes the token, logprob and rank, and the
                    same three as float64 in the ``[B, 3]`` layout the host copy takes
                    (``merge_summaries``)

Summaries of slices of a vocabulary, each indexed from its slice's first token, concatenated
along the parts merge into the whole vocabulary's choice: under tensor parallelism each rank
summarises its own columns of the logits and only the summaries travel
(``parallel/vocab_choice.py``).

A NaN logit makes the row's logprob NaN (the token is then the largest of the other logits;
torch's argmax would name the NaN). No host synchronisation; shape-dependent temporaries only.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from tandem.kernels.triton_support import jit, tl, triton

# Logits one part of a row reads, in tiles of PART_BLOCK: a 128k vocabulary is 32 parts of one
# tile each, every load of a part in flight at once.
PART_SIZE = 4096
PART_BLOCK = 4096
NO_INDEX_VALUE = 2147483647  # larger than any logit's index: loses every first-index tie
NO_INDEX = tl.constexpr(NO_INDEX_VALUE)


class GreedyChoice(NamedTuple):
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    ranks: torch.Tensor  # [B] int64 (all 1)
    packed: torch.Tensor  # [B, 3] float64: token, logprob, rank (what the host copy takes)


@jit
def _merge(best, best_index, total, other, other_index, other_total):
    """Two (maximum, first index, sum of exp(x - maximum)) summaries merged elementwise; the
    earlier index wins a tie. An empty summary is (-inf, any, 0)."""
    maximum = tl.maximum(best, other)
    safe = tl.where(maximum == float("-inf"), 0.0, maximum)
    total = total * tl.exp(best - safe) + other_total * tl.exp(other - safe)
    take_other = (other > best) | ((other == best) & (other_index < best_index))
    return maximum, tl.where(take_other, other_index, best_index), total


@jit
def _summary(best, best_index, total):
    """Lanes of (maximum, first index, sum of exp(x - maximum)) summaries merged into one:
    ``(maximum, first index where it occurs, sum of exp(x - maximum))``."""
    maximum = tl.max(best, 0)
    safe = tl.where(maximum == float("-inf"), 0.0, maximum)
    index = tl.min(tl.where(best == maximum, best_index, NO_INDEX), 0)
    return maximum, index, tl.sum(total * tl.exp(best - safe), 0)


@jit
def _partial_kernel(logits_ptr, summary_ptr, columns, stride_row, num_parts, index_base,
                    PART: tl.constexpr, BLOCK: tl.constexpr):
    """Part ``part`` of row ``row`` (its first ``columns`` logits) summarised at ``summary[row,
    :, part]``: maximum, first index (plus ``index_base``, as int32 bits) and sum of exponentials."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    offsets_in_block = tl.arange(0, BLOCK)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], NO_INDEX, tl.int32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(part * PART, part * PART + PART, BLOCK):
        offsets = start + offsets_in_block
        values = tl.load(base + offsets, mask=offsets < columns, other=float("-inf")).to(tl.float32)
        best, best_index, total = _merge(best, best_index, total, values, offsets, 1.0)
    maximum, index, total = _summary(best, best_index, total)
    out = summary_ptr + row * 3 * num_parts + part
    tl.store(out, maximum)
    tl.store(out + num_parts, (index + index_base).to(tl.float32, bitcast=True))
    tl.store(out + 2 * num_parts, total)


@jit
def _final_kernel(summary_ptr, token_ptr, logprob_ptr, rank_ptr, packed_ptr, num_parts,
                  BLOCK_PARTS: tl.constexpr):
    row = tl.program_id(0)
    parts = tl.arange(0, BLOCK_PARTS)
    mask = parts < num_parts
    first = summary_ptr + row * 3 * num_parts + parts
    maxima = tl.load(first, mask=mask, other=float("-inf"))
    indices = tl.load(first + num_parts, mask=mask, other=0.0).to(tl.int32, bitcast=True)
    indices = tl.where(mask, indices, NO_INDEX)
    totals = tl.load(first + 2 * num_parts, mask=mask, other=0.0)
    maximum, token, total = _summary(maxima, indices, totals)
    logprob = maximum - (tl.log(total) + maximum)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, logprob)
    tl.store(rank_ptr + row, tl.full([], 1, tl.int64))
    tl.store(packed_ptr + row * 3, token.to(tl.float64))
    tl.store(packed_ptr + row * 3 + 1, logprob.to(tl.float64))
    tl.store(packed_ptr + row * 3 + 2, tl.full([], 1.0, tl.float64))


def greedy_choice(logits: torch.Tensor, kernels: Optional[bool] = None) -> GreedyChoice:
    """The Triton kernels over ``logits [B, V]`` (last dimension contiguous); ``kernels`` as
    ``greedy_summaries``."""
    return merge_summaries(greedy_summaries(logits, kernels=kernels), kernels=kernels)


def greedy_summaries(logits: torch.Tensor, index_base: int = 0, columns: Optional[int] = None,
                     kernels: Optional[bool] = None) -> torch.Tensor:
    """``[B, 3, parts]`` float32: per part of each row of ``logits [B, V]`` (its first
    ``columns``, default all; last dimension contiguous) the maximum, the first index where it
    occurs plus ``index_base`` (int32 bits: ``summary[:, 1].view(torch.int32)``) and the sum of
    exponentials relative to the maximum. Summaries of a vocabulary's slices, each with its
    first index as the base, concatenated along the last dimension merge (``merge_summaries``)
    into the whole vocabulary's choice. ``kernels``: the Triton kernel (default: on CUDA; a test
    runs it on a CPU under Triton's interpreter), else ``greedy_summaries_reference`` (one part
    a row)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"greedy_choice: logits must be [B, V] with a contiguous last dimension, "
                         f"not {tuple(logits.shape)} with strides {logits.stride()}")
    columns = logits.shape[1] if columns is None else columns
    if not (logits.is_cuda if kernels is None else kernels):
        return greedy_summaries_reference(logits[:, :columns], index_base)
    batch = logits.shape[0]
    # (parts of the whole width, not of ``columns``: every rank's summaries of its equally wide
    # slice have the same shape, whatever its padding; a part past ``columns`` summarises nothing)
    num_parts = max(1, triton.cdiv(logits.shape[1], PART_SIZE))
    summary = torch.empty(batch, 3, num_parts, dtype=torch.float32, device=logits.device)
    if batch:
        _partial_kernel[(batch, num_parts)](logits, summary, columns, logits.stride(0), num_parts, index_base,
                                            PART=PART_SIZE, BLOCK=PART_BLOCK, num_warps=8)
    return summary


def merge_summaries(summary: torch.Tensor, kernels: Optional[bool] = None) -> GreedyChoice:
    """The greedy choice of each row from its parts' summaries (``greedy_summaries``'s layout;
    ``kernels`` as there)."""
    if not (summary.is_cuda if kernels is None else kernels):
        return merge_summaries_reference(summary)
    batch, _, num_parts = summary.shape
    summary = summary.contiguous()
    device = summary.device
    packed = torch.empty(batch, 3, dtype=torch.float64, device=device)
    token_ids = torch.empty(batch, dtype=torch.int64, device=device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=device)
    ranks = torch.empty(batch, dtype=torch.int64, device=device)
    if batch:
        _final_kernel[(batch,)](summary, token_ids, logprobs, ranks, packed, num_parts,
                                BLOCK_PARTS=max(16, triton.next_power_of_2(num_parts)), num_warps=1)
    return GreedyChoice(token_ids, logprobs, ranks, packed)


def greedy_summaries_reference(logits: torch.Tensor, index_base: int = 0) -> torch.Tensor:
    """``greedy_summaries`` in plain PyTorch, one part a row: ``[B, 3, 1]``."""
    values = logits.float()
    maximum = values.max(dim=-1).values if values.shape[1] else values.new_full((values.shape[0],), float("-inf"))
    safe = torch.where(maximum == float("-inf"), torch.zeros_like(maximum), maximum)
    first = values.argmax(dim=-1) if values.shape[1] else torch.zeros_like(maximum, dtype=torch.long)
    index = (first + index_base).to(torch.int32).view(torch.float32)
    total = torch.exp(values - safe[:, None]).sum(dim=-1)
    return torch.stack([maximum, index, total], dim=1)[:, :, None]


def summaries_log_normaliser(summary: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's log-sum-exp over the parts its summaries cover."""
    maxima, totals = summary[:, 0], summary[:, 2]
    maximum = maxima.max(dim=-1).values
    safe = torch.where(maximum == float("-inf"), torch.zeros_like(maximum), maximum)
    return torch.log((totals * torch.exp(maxima - safe[:, None])).sum(dim=-1)) + safe


def merge_summaries_reference(summary: torch.Tensor) -> GreedyChoice:
    """``merge_summaries`` in plain PyTorch."""
    maxima = summary[:, 0]
    indices = summary[:, 1].contiguous().view(torch.int32).long()
    maximum = maxima.max(dim=-1).values
    token_ids = torch.where(maxima == maximum[:, None], indices, torch.full_like(indices, NO_INDEX_VALUE)).min(-1).values
    logprobs = maximum - summaries_log_normaliser(summary)
    ranks = torch.ones_like(token_ids)
    packed = torch.stack([token_ids.double(), logprobs.double(), ranks.double()], dim=1)
    return GreedyChoice(token_ids, logprobs, ranks, packed)


def greedy_choice_reference(logits: torch.Tensor) -> GreedyChoice:
    """``greedy_choice`` in plain PyTorch, as the sampler's general path computes it."""
    values = logits.float()
    token_ids = values.argmax(dim=-1)
    normaliser = torch.logsumexp(values, dim=-1)
    logprobs = values.gather(1, token_ids[:, None]).squeeze(1) - normaliser
    ranks = (values > values.gather(1, token_ids[:, None])).sum(dim=-1) + 1
    packed = torch.stack([token_ids.double(), logprobs.double(), ranks.double()], dim=1)
    return GreedyChoice(token_ids, logprobs, ranks, packed)
