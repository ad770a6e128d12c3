"""Absorbed-latent paged MLA decode (DeepSeek-V3, V3.2, GLM-5) in Triton, with its reference.

Cache layout (one MLA layer, ``MLASpec``): ``latent_cache [num_pages, page_size, R + P]``, per
token ``| c (R = kv_lora_rank) | k_rope (P = rope_dim) |``; page 0 is the null page. Token
position ``p`` of a sequence lives at page ``page_table[row, p // page_size]``, slot
``p % page_size``. The step's new latents are already in the cache when this runs.

The queries are absorbed: ``q_latent[b, h] = W_uk[h]^T q_nope[b, h]`` (``[B, H, R]``) and the
rotated ``q_rope [B, H, P]``. Every head reads the same latent per token, so::

    score[b, h, t] = scale * (q_latent[b, h] . c_t + q_rope[b, h] . k_rope_t)
    out[b, h]      = sum_t softmax_t(score[b, h, :]) c_t                          [R]

(the layer applies ``W_uv`` afterwards). Keys ``t`` are the positions ``0 .. context_lengths[b]
- 1`` (dense) or, with ``topk_indices [B, K]`` (DSA), the row's listed positions (``-1`` and
positions at or past the row's context length are skipped; listed positions must be distinct).

    split kernel: grid (row, head block, split); tile rows = BLOCK_H heads (tensor cores),
                  one latent tile [BLOCK_N, R] per key block serves as keys and as values
        row b entries  |--split 0--|--split 1--|--split 2--|   (whole key blocks)
        (entries: positions 0..L-1, or the K slots of topk_indices[b])
    combine kernel: grid (row, head); merges the splits by log-sum-exp

A row with ``context_length == 0`` is padding: it reads nothing and its output is zeros. Slots a
row cannot see (past its length, unselected, null pages) are never loaded, so NaN poison there
(sanitizer mode, docs/design.md I6) never reaches the output; a NaN in a visible slot does. No host
synchronisation and only shape-dependent temporaries: capturable in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional

import torch

from tandem.kernels.attention_device import MINIMUM_DOT_SIZE, _dot_operand, _store_split_output
from tandem.kernels.paged_attention import _dot_precision, _upcast_dots, decode_num_splits
from tandem.kernels.triton_support import jit, tl, triton


# ----------------------------------------------------------------------------------------------
# Kernels


@jit
def _load_latents(cache_ptr, page_table_row_ptr, positions, key_mask, rank_dims, rank_mask, rope_dims,
                  rope_mask, stride_cache_page, stride_cache_slot, stride_cache_dim,
                  RANK: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Latents ``[BLOCK_N, BLOCK_R]`` and rotary keys transposed ``[BLOCK_P, BLOCK_N]`` at
    ``positions``; slots outside ``key_mask`` are not read and come back as zeros."""
    pages = tl.load(page_table_row_ptr + positions // PAGE_SIZE, mask=key_mask, other=0).to(tl.int64)
    slots = positions % PAGE_SIZE
    offsets = pages * stride_cache_page + slots * stride_cache_slot
    latents = tl.load(cache_ptr + offsets[:, None] + rank_dims[None, :] * stride_cache_dim,
                      mask=key_mask[:, None] & rank_mask[None, :], other=0.0)
    rope_keys_transposed = tl.load(cache_ptr + offsets[None, :] + (RANK + rope_dims[:, None]) * stride_cache_dim,
                                   mask=key_mask[None, :] & rope_mask[:, None], other=0.0)
    return latents, rope_keys_transposed


@jit(do_not_specialize=["num_selected", "num_splits", "stride_table_row", "stride_topk_row", "stride_partial_row",
                        "stride_partial_head", "stride_partial_split"])  # per-step values (triton_support.jit)
def _mla_decode_split_kernel(
        q_latent_ptr, q_rope_ptr, cache_ptr, page_table_ptr, context_lengths_ptr, topk_ptr,
        out_ptr, partial_out_ptr, partial_lse_ptr,
        scale, num_heads, num_selected, num_splits,
        stride_latent_row, stride_latent_head, stride_latent_dim,
        stride_rope_row, stride_rope_head, stride_rope_dim,
        stride_cache_page, stride_cache_slot, stride_cache_dim,
        stride_table_row, stride_topk_row,
        stride_out_row, stride_out_head, stride_out_dim,
        stride_partial_row, stride_partial_head, stride_partial_split,
        RANK: tl.constexpr, ROPE_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
        SPARSE: tl.constexpr, WRITE_FINAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
        UPCAST_DOTS: tl.constexpr):
    """One (row, head block, split): the heads' attention over the split's entries.

    With ``WRITE_FINAL`` (one split) the normalised output goes straight to ``out``; otherwise
    the split's normalised output and log2-sum-exp go to the partial buffers (an empty split
    writes zeros and -inf)."""
    log2_e = 1.4426950408889634
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    context_length = tl.load(context_lengths_ptr + row)

    head_mask = heads < num_heads
    rank_dims = tl.arange(0, BLOCK_R)
    rank_mask = rank_dims < RANK
    rope_dims = tl.arange(0, BLOCK_P)
    rope_mask = rope_dims < ROPE_DIM
    input_dtype = q_latent_ptr.dtype.element_ty
    q_latent = tl.load(q_latent_ptr + row * stride_latent_row + heads[:, None] * stride_latent_head
                       + rank_dims[None, :] * stride_latent_dim, mask=head_mask[:, None] & rank_mask[None, :],
                       other=0.0)
    q_rope = tl.load(q_rope_ptr + row * stride_rope_row + heads[:, None] * stride_rope_head
                     + rope_dims[None, :] * stride_rope_dim, mask=head_mask[:, None] & rope_mask[None, :],
                     other=0.0)
    q_latent = _dot_operand(q_latent, input_dtype, UPCAST_DOTS)
    q_rope = _dot_operand(q_rope, input_dtype, UPCAST_DOTS)

    # The row's entries (positions, or slots of its top-k list) in whole blocks, dealt to splits.
    if SPARSE:
        num_entries = tl.where(context_length > 0, num_selected, 0)
    else:
        num_entries = context_length
    num_blocks = tl.cdiv(num_entries, BLOCK_N)
    blocks_per_split = tl.cdiv(num_blocks, num_splits)
    block_begin = split * blocks_per_split
    block_end = tl.minimum(block_begin + blocks_per_split, num_blocks)

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_H], tl.float32)
    accumulator = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    page_table_row_ptr = page_table_ptr + row * stride_table_row
    for block in range(block_begin, block_end):
        entries = block * BLOCK_N + tl.arange(0, BLOCK_N)
        if SPARSE:
            positions = tl.load(topk_ptr + row * stride_topk_row + entries, mask=entries < num_entries, other=-1)
            key_mask = (positions >= 0) & (positions < context_length)
        else:
            positions = entries
            key_mask = positions < context_length
        latents, rope_keys_transposed = _load_latents(
            cache_ptr, page_table_row_ptr, positions, key_mask, rank_dims, rank_mask, rope_dims, rope_mask,
            stride_cache_page, stride_cache_slot, stride_cache_dim, RANK, PAGE_SIZE)
        latents = _dot_operand(latents, input_dtype, UPCAST_DOTS)
        scores = tl.dot(q_latent, tl.trans(latents), input_precision=DOT_PRECISION)
        scores += tl.dot(q_rope, _dot_operand(rope_keys_transposed, input_dtype, UPCAST_DOTS),
                         input_precision=DOT_PRECISION)
        scores = tl.where(key_mask[None, :], scores * (scale * log2_e), float("-inf"))
        # A sparse block may hold no visible key: keep the exponents finite (0 instead of -inf).
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probabilities = tl.exp2(scores - safe_max[:, None])
        correction = tl.exp2(running_max - safe_max)
        running_sum = running_sum * correction + tl.sum(probabilities, 1)
        accumulator = accumulator * correction[:, None] + tl.dot(
            _dot_operand(probabilities, input_dtype, UPCAST_DOTS), latents, input_precision=DOT_PRECISION)
        running_max = new_max

    _store_split_output(accumulator, running_max, running_sum, row, split, heads, head_mask, rank_dims, rank_mask,
                        out_ptr, stride_out_row, stride_out_head, stride_out_dim, partial_out_ptr, partial_lse_ptr,
                        stride_partial_row, stride_partial_head, stride_partial_split, BLOCK_R, WRITE_FINAL)


@jit(do_not_specialize=["num_splits", "stride_partial_row", "stride_partial_head", "stride_partial_split"])
def _mla_decode_combine_kernel(
        partial_out_ptr, partial_lse_ptr, out_ptr, num_splits,
        stride_partial_row, stride_partial_head, stride_partial_split,
        stride_out_row, stride_out_head, stride_out_dim,
        RANK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    """One (row, head): the splits' outputs weighted by their share of the softmax sum, one
    split at a time (a latent row is wide). When every split is empty the output is zeros."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    base = row * stride_partial_row + head * stride_partial_head
    splits = tl.arange(0, BLOCK_S)
    log_sums = tl.load(partial_lse_ptr + base + splits * stride_partial_split, mask=splits < num_splits,
                       other=float("-inf"))
    largest = tl.max(log_sums, 0)
    largest = tl.where(largest == float("-inf"), 0.0, largest)
    total = tl.sum(tl.exp2(log_sums - largest), 0)
    rank_dims = tl.arange(0, BLOCK_R)
    output = tl.zeros([BLOCK_R], tl.float32)
    for split in range(0, num_splits):
        offset = base + split * stride_partial_split
        weight = tl.exp2(tl.load(partial_lse_ptr + offset) - largest)
        output += weight * tl.load(partial_out_ptr + offset * BLOCK_R + rank_dims)
    output = output / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_out_row + head * stride_out_head + rank_dims * stride_out_dim,
             output.to(out_ptr.dtype.element_ty), mask=rank_dims < RANK)


# ----------------------------------------------------------------------------------------------
# Launch configuration


def _block_size(dim: int) -> int:
    return max(MINIMUM_DOT_SIZE, triton.next_power_of_2(dim))


def _decode_config(num_heads: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Heads per tile, key block and launch options of the split kernel. Interpreted (CPU) runs
    use small key blocks so tiny test shapes still cross block and page boundaries. On CUDA
    (rank 512, sm_90 per ptxas): 16-bit tiles of 32 heads x 32 keys with 8 warps hold the
    [heads, rank] accumulator without spilling (4 warps spill); float32 (exactness runs) tiles
    are twice as wide in bytes, so 16 x 16."""
    if device.type != "cuda":
        return dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_H=16, BLOCK_N=16, num_warps=8, num_stages=1)
    block_h = min(32, max(MINIMUM_DOT_SIZE, triton.next_power_of_2(num_heads)))
    return dict(BLOCK_H=block_h, BLOCK_N=32, num_warps=8, num_stages=2)


def mla_decode_num_splits(batch: int, num_heads: int, max_entries: int, device,
                          dtype: torch.dtype = torch.bfloat16) -> int:
    """Default number of KV splits: :func:`decode_num_splits` with the head blocks in place of
    kv heads, capped at the key blocks ``max_entries`` (page-table width x page size, or the
    top-k width) fills. Shapes only (never context lengths): a captured CUDA graph stays valid."""
    device = torch.device(device)
    config = _decode_config(num_heads, device, dtype)
    head_blocks = triton.cdiv(num_heads, config["BLOCK_H"])
    max_blocks = max(1, triton.cdiv(max_entries, config["BLOCK_N"]))
    return min(decode_num_splits(batch, head_blocks, max_blocks, device), max_blocks)


def _check(q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor, page_table: torch.Tensor,
           context_lengths: torch.Tensor, topk_indices: Optional[torch.Tensor]) -> None:
    """Shapes only (metadata, no synchronisation)."""
    batch, num_heads, rank = q_latent.shape
    rope_dim = q_rope.shape[-1]
    problems = []
    if q_rope.shape[:2] != (batch, num_heads):
        problems.append(f"q_rope {tuple(q_rope.shape)} is not [B, H, P] with q_latent {tuple(q_latent.shape)}")
    if latent_cache.dim() != 3 or latent_cache.shape[-1] != rank + rope_dim:
        problems.append(f"latent_cache {tuple(latent_cache.shape)} is not [pages, page_size, {rank + rope_dim}]")
    if page_table.dim() != 2 or page_table.shape[0] != batch or context_lengths.shape != (batch,):
        problems.append(f"page_table {tuple(page_table.shape)} / context_lengths {tuple(context_lengths.shape)} "
                        f"do not have {batch} rows")
    if topk_indices is not None and (topk_indices.dim() != 2 or topk_indices.shape[0] != batch
                                     or topk_indices.stride(-1) != 1):
        problems.append(f"topk_indices {tuple(topk_indices.shape)} is not [B, K] with contiguous rows")
    if problems:
        raise ValueError("mla_decode_attention: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------
# Entry point


def mla_decode_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                         page_table: torch.Tensor, context_lengths: torch.Tensor, scale: float, *,
                         topk_indices: Optional[torch.Tensor] = None, num_splits: Optional[int] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Absorbed-latent attention of one query token per row over its paged latents (split-KV).

    ``q_latent [B, H, R]``, ``q_rope [B, H, P]`` (one dtype), ``latent_cache [pages, page_size,
    R + P]``, ``page_table [B, W]`` int32, ``context_lengths [B]`` int32 (0: a padding row, whose
    output is zeros), optional ``topk_indices [B, K]`` int32 (positions each row attends to;
    -1 = none). Returns ``out`` (allocated when not given), ``[B, H, R]`` in the query's dtype:
    the softmax-weighted latents. ``num_splits`` defaults to :func:`mla_decode_num_splits`.
    No host synchronisation; CUDA-graph capturable."""
    _check(q_latent, q_rope, latent_cache, page_table, context_lengths, topk_indices)
    batch, num_heads, rank = q_latent.shape
    rope_dim = q_rope.shape[-1]
    if out is None:
        out = torch.empty_like(q_latent)
    if batch == 0:
        return out
    config = _decode_config(num_heads, q_latent.device, q_latent.dtype)
    sparse = topk_indices is not None
    num_selected = topk_indices.shape[1] if sparse else 0
    if num_splits is None:
        max_entries = num_selected if sparse else page_table.shape[1] * latent_cache.shape[1]
        num_splits = mla_decode_num_splits(batch, num_heads, max_entries, q_latent.device, q_latent.dtype)
    block_r = _block_size(rank)
    write_final = num_splits == 1
    if write_final:  # the partial buffers are not touched; pass ``out`` in their place
        partial_out, partial_lse, partial_strides = out, out, (0, 0, 0)
    else:
        partial_out = torch.empty(batch, num_heads, num_splits, block_r, dtype=torch.float32, device=out.device)
        partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=out.device)
        partial_strides = partial_lse.stride()
    grid = (batch, triton.cdiv(num_heads, config["BLOCK_H"]), num_splits)
    _mla_decode_split_kernel[grid](
        q_latent, q_rope, latent_cache, page_table, context_lengths, topk_indices if sparse else page_table,
        out, partial_out, partial_lse,
        scale, num_heads, num_selected, num_splits,
        *q_latent.stride(), *q_rope.stride(), *latent_cache.stride(), page_table.stride(0),
        topk_indices.stride(0) if sparse else 0, *out.stride(), *partial_strides,
        RANK=rank, ROPE_DIM=rope_dim, PAGE_SIZE=latent_cache.shape[1], BLOCK_R=block_r,
        BLOCK_P=_block_size(rope_dim), SPARSE=sparse, WRITE_FINAL=write_final,
        DOT_PRECISION=_dot_precision(q_latent.dtype), UPCAST_DOTS=_upcast_dots(q_latent), **config)
    if not write_final:
        _mla_decode_combine_kernel[(batch, num_heads)](
            partial_out, partial_lse, out, num_splits, *partial_strides, *out.stride(),
            RANK=rank, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_R=block_r, num_warps=4)
    return out


# ----------------------------------------------------------------------------------------------
# Reference (plain PyTorch, float32 math): the oracle of the tests.


def _row_positions(length: int, selected: Optional[torch.Tensor]) -> torch.Tensor:
    """The positions one row attends to: ``0 .. length - 1``, or its listed ones below ``length``."""
    if selected is None:
        return torch.arange(length)
    selected = selected.long().cpu()
    return selected[(selected >= 0) & (selected < length)]


def mla_decode_attention_reference(q_latent, q_rope, latent_cache, page_table, context_lengths, scale, *,
                                   topk_indices=None, num_splits=None, out=None) -> torch.Tensor:
    """Plain-PyTorch :func:`mla_decode_attention` (``num_splits`` is accepted and ignored)."""
    _check(q_latent, q_rope, latent_cache, page_table, context_lengths, topk_indices)
    rank, page_size = q_latent.shape[-1], latent_cache.shape[1]
    output = torch.zeros(q_latent.shape, dtype=torch.float32, device=q_latent.device)
    for row, length in enumerate(context_lengths.tolist()):
        positions = _row_positions(length, None if topk_indices is None else topk_indices[row])
        if length == 0 or positions.numel() == 0:
            continue
        positions = positions.to(latent_cache.device)
        pages = page_table[row, positions // page_size].long()
        latents = latent_cache[pages, positions % page_size].float()  # [n, R + P]
        scores = (q_latent[row].float() @ latents[:, :rank].T + q_rope[row].float() @ latents[:, rank:].T) * scale
        output[row] = torch.softmax(scores, dim=-1) @ latents[:, :rank]
    if out is None:
        return output.to(q_latent.dtype)
    return out.copy_(output)
