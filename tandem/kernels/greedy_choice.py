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
    final kernel:   grid (row); merges the parts, writes the token, logprob and rank, and the
                    same three as float64 in the ``[B, 3]`` layout the host copy takes

A NaN logit makes the row's logprob NaN (the token is then the largest of the other logits;
torch's argmax would name the NaN). No host synchronisation; shape-dependent temporaries only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from tandem.kernels.triton_support import jit, tl, triton

# Logits one part of a row reads, in tiles of PART_BLOCK: a 128k vocabulary is 32 parts of one
# tile each, every load of a part in flight at once.
PART_SIZE = 4096
PART_BLOCK = 4096
NO_INDEX = tl.constexpr(2147483647)  # larger than any logit's index: loses every first-index tie


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
def _partial_kernel(logits_ptr, maxima_ptr, indices_ptr, totals_ptr, vocab_size, stride_row, num_parts,
                    PART: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    columns = tl.arange(0, BLOCK)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], NO_INDEX, tl.int32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(part * PART, part * PART + PART, BLOCK):
        offsets = start + columns
        values = tl.load(base + offsets, mask=offsets < vocab_size, other=float("-inf")).to(tl.float32)
        best, best_index, total = _merge(best, best_index, total, values, offsets, 1.0)
    maximum, index, total = _summary(best, best_index, total)
    out = row * num_parts + part
    tl.store(maxima_ptr + out, maximum)
    tl.store(indices_ptr + out, index)
    tl.store(totals_ptr + out, total)


@jit
def _final_kernel(maxima_ptr, indices_ptr, totals_ptr, token_ptr, logprob_ptr, rank_ptr, packed_ptr, num_parts,
                  BLOCK_PARTS: tl.constexpr):
    row = tl.program_id(0)
    parts = tl.arange(0, BLOCK_PARTS)
    mask = parts < num_parts
    maxima = tl.load(maxima_ptr + row * num_parts + parts, mask=mask, other=float("-inf"))
    indices = tl.load(indices_ptr + row * num_parts + parts, mask=mask, other=NO_INDEX)
    totals = tl.load(totals_ptr + row * num_parts + parts, mask=mask, other=0.0)
    maximum, token, total = _summary(maxima, indices, totals)
    logprob = maximum - (tl.log(total) + maximum)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, logprob)
    tl.store(rank_ptr + row, tl.full([], 1, tl.int64))
    tl.store(packed_ptr + row * 3, token.to(tl.float64))
    tl.store(packed_ptr + row * 3 + 1, logprob.to(tl.float64))
    tl.store(packed_ptr + row * 3 + 2, tl.full([], 1.0, tl.float64))


def greedy_choice(logits: torch.Tensor) -> GreedyChoice:
    """The Triton kernels over ``logits [B, V]`` (last dimension contiguous)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"greedy_choice: logits must be [B, V] with a contiguous last dimension, "
                         f"not {tuple(logits.shape)} with strides {logits.stride()}")
    batch, vocab_size = logits.shape
    device = logits.device
    num_parts = triton.cdiv(vocab_size, PART_SIZE)
    maxima = torch.empty(batch, num_parts, dtype=torch.float32, device=device)
    indices = torch.empty(batch, num_parts, dtype=torch.int32, device=device)
    totals = torch.empty(batch, num_parts, dtype=torch.float32, device=device)
    packed = torch.empty(batch, 3, dtype=torch.float64, device=device)
    token_ids = torch.empty(batch, dtype=torch.int64, device=device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=device)
    ranks = torch.empty(batch, dtype=torch.int64, device=device)
    if batch:
        _partial_kernel[(batch, num_parts)](logits, maxima, indices, totals, vocab_size, logits.stride(0), num_parts,
                                            PART=PART_SIZE, BLOCK=PART_BLOCK, num_warps=8)
        _final_kernel[(batch,)](maxima, indices, totals, token_ids, logprobs, ranks, packed, num_parts,
                                BLOCK_PARTS=max(16, triton.next_power_of_2(num_parts)), num_warps=1)
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
