"""DeepSeek sparse attention: the lightning indexer's decode scores over paged keys, in Triton,
with its reference. The top-k over these scores picks the positions MLA decode attends to.

Key layout (one indexer layer, ``layers/sparse_indexer.py``): ``keys [pages, page_size, D]``,
either float32 (the unquantised mode) or FP8 e4m3 with ``key_scales [pages, page_size]`` float32
— the two regions of a page-major page, as views::

    page p:  | key 0 | key 1 | ... | key P-1 | scale 0 | ... | scale P-1 |

For decode row ``b`` (one query, ``H`` heads) and position ``t < context_lengths[b]``::

    score[b, t] = sum_h weights[b, h] * relu(softmax_scale * scale_t * (queries[b, h] . keys_t))

and ``-inf`` for ``t`` at or past the context length (those slots are never loaded: NaN poison
there stays out, a NaN in a visible slot propagates). The FP8 path multiplies in bfloat16 with
float32 sums: e4m3 keys, and queries that are e4m3 values times a power of two, are exact in
bfloat16, so only the order of the sums differs from float32 math.

    grid (row, key block); tile = the row's heads (BLOCK_H at a time) x BLOCK_N keys
    key blocks wholly past the row's context only write -inf

Outputs ``[B, W * page_size]`` (the page table's width): shapes only, no host synchronisation,
CUDA-graph capturable.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tandem.kernels.attention_device import MINIMUM_DOT_SIZE, _dot_operand
from tandem.kernels.paged_attention import _dot_precision, _upcast_dots
from tandem.kernels.triton_support import jit, tl, triton


@jit(do_not_specialize=["num_positions", "stride_table_row", "stride_out_row"])  # per-step values
def _index_decode_scores_kernel(
        queries_ptr, weights_ptr, keys_ptr, scales_ptr, page_table_ptr, context_lengths_ptr, out_ptr,
        softmax_scale, num_positions,
        stride_query_row, stride_query_head, stride_query_dim,
        stride_weight_row, stride_weight_head,
        stride_key_page, stride_key_slot, stride_key_dim,
        stride_scale_page, stride_scale_slot,
        stride_table_row, stride_out_row,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_SCALES: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr):
    """One (row, key block): the weighted relu scores of ``BLOCK_N`` positions."""
    row = tl.program_id(0)
    positions = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    context_length = tl.load(context_lengths_ptr + row)
    out_ptrs = out_ptr + row * stride_out_row + positions
    in_range = positions < num_positions
    if tl.program_id(1) * BLOCK_N >= context_length:
        tl.store(out_ptrs, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=in_range)
        return

    key_mask = positions < context_length
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    pages = tl.load(page_table_ptr + row * stride_table_row + positions // PAGE_SIZE, mask=key_mask,
                    other=0).to(tl.int64)
    slots = positions % PAGE_SIZE
    keys_transposed = tl.load(keys_ptr + (pages * stride_key_page + slots * stride_key_slot)[None, :]
                              + dims[:, None] * stride_key_dim, mask=key_mask[None, :] & dim_mask[:, None],
                              other=0.0)
    input_dtype = queries_ptr.dtype.element_ty
    keys_transposed = _dot_operand(keys_transposed, input_dtype, UPCAST_DOTS)
    key_scales = tl.zeros([BLOCK_N], tl.float32) + softmax_scale
    if HAS_SCALES:
        key_scales = key_scales * tl.load(scales_ptr + pages * stride_scale_page + slots * stride_scale_slot,
                                          mask=key_mask, other=0.0)

    totals = tl.zeros([BLOCK_N], tl.float32)
    for head_start in range(0, NUM_HEADS, BLOCK_H):
        heads = head_start + tl.arange(0, BLOCK_H)
        head_mask = heads < NUM_HEADS
        queries = tl.load(queries_ptr + row * stride_query_row + heads[:, None] * stride_query_head
                          + dims[None, :] * stride_query_dim, mask=head_mask[:, None] & dim_mask[None, :],
                          other=0.0)
        weights = tl.load(weights_ptr + row * stride_weight_row + heads * stride_weight_head, mask=head_mask,
                          other=0.0)
        products = tl.dot(_dot_operand(queries, input_dtype, UPCAST_DOTS), keys_transposed,
                          input_precision=DOT_PRECISION)
        totals += tl.sum(weights[:, None] * tl.maximum(products * key_scales[None, :], 0.0), 0)
    tl.store(out_ptrs, tl.where(key_mask, totals, float("-inf")), mask=in_range)


def _config(num_heads: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Interpreted (CPU) runs use small tiles so tiny shapes cross head and key blocks. On CUDA
    (64 heads x head dim 128, sm_90 per ptxas) 8 warps keep the tiles out of local memory
    (4 warps spill); float32 (the unquantised mode) keys are twice as wide, so half the block."""
    if device.type != "cuda":
        return dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1)
    block_h = min(64, max(MINIMUM_DOT_SIZE, triton.next_power_of_2(num_heads)))
    return dict(BLOCK_H=block_h, BLOCK_N=64 if dtype == torch.float32 else 128, num_warps=8, num_stages=2)


def _check(queries, weights, keys, key_scales, page_table, context_lengths) -> None:
    """Shapes only (metadata, no synchronisation)."""
    batch, num_heads, head_dim = queries.shape
    if (weights.shape != (batch, num_heads) or keys.dim() != 3 or keys.shape[-1] != head_dim
            or page_table.dim() != 2 or page_table.shape[0] != batch or context_lengths.shape != (batch,)
            or (key_scales is not None and key_scales.shape != keys.shape[:2])):
        raise ValueError(f"index_decode_scores: queries {tuple(queries.shape)} [B, H, D], weights "
                         f"{tuple(weights.shape)} [B, H], keys {tuple(keys.shape)} [pages, page_size, D], "
                         f"key_scales {None if key_scales is None else tuple(key_scales.shape)} [pages, page_size], "
                         f"page_table {tuple(page_table.shape)} [B, W], context_lengths "
                         f"{tuple(context_lengths.shape)} [B]")


def index_decode_scores(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                        key_scales: Optional[torch.Tensor], page_table: torch.Tensor,
                        context_lengths: torch.Tensor, softmax_scale: float, *,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Indexer scores of one query per row over its paged keys.

    ``queries [B, H, D]`` (float32, or bfloat16 holding exact FP8-quantised values), ``weights
    [B, H]`` float32, ``keys [pages, page_size, D]`` (float32, or float8_e4m3fn with
    ``key_scales [pages, page_size]`` float32; any strides, so views into the page-major
    buffer work), ``page_table [B, W]`` int32, ``context_lengths [B]`` int32. Returns ``out``
    (allocated when not given), ``[B, W * page_size]`` float32, ``-inf`` past each row's context
    (all of a padding row). No host synchronisation; CUDA-graph capturable."""
    _check(queries, weights, keys, key_scales, page_table, context_lengths)
    batch, num_heads, head_dim = queries.shape
    num_positions = page_table.shape[1] * keys.shape[1]
    if out is None:
        out = torch.empty(batch, num_positions, dtype=torch.float32, device=queries.device)
    if batch == 0 or num_positions == 0:
        return out
    config = _config(num_heads, queries.device, queries.dtype)
    has_scales = key_scales is not None
    scale_strides = key_scales.stride() if has_scales else (0, 0)
    _index_decode_scores_kernel[(batch, triton.cdiv(num_positions, config["BLOCK_N"]))](
        queries, weights, keys, key_scales if has_scales else keys, page_table, context_lengths, out,
        softmax_scale, num_positions,
        *queries.stride(), *weights.stride(), *keys.stride(), *scale_strides, page_table.stride(0), out.stride(0),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, PAGE_SIZE=keys.shape[1],
        BLOCK_D=max(MINIMUM_DOT_SIZE, triton.next_power_of_2(head_dim)), HAS_SCALES=has_scales,
        DOT_PRECISION=_dot_precision(queries.dtype), UPCAST_DOTS=_upcast_dots(queries), **config)
    return out


def index_decode_scores_reference(queries, weights, keys, key_scales, page_table, context_lengths, softmax_scale, *,
                                  out=None) -> torch.Tensor:
    """Plain-PyTorch :func:`index_decode_scores` (float32 math, the indexer's order: relu of the
    scaled products, then the weighted sum over heads)."""
    _check(queries, weights, keys, key_scales, page_table, context_lengths)
    pages = page_table.long()
    gathered = keys[pages].float()  # [B, W, page_size, D]
    if key_scales is not None:
        gathered = gathered * key_scales[pages].unsqueeze(-1)
    gathered = gathered.flatten(1, 2)
    visible = torch.arange(gathered.shape[1], device=gathered.device)[None, :] < context_lengths[:, None]
    gathered = torch.where(visible[:, :, None], gathered, 0)
    scores = F.relu(torch.einsum("bhd,btd->bht", queries.float(), gathered) * softmax_scale)
    scores = torch.einsum("bh,bht->bt", weights.float(), scores).masked_fill(~visible, float("-inf"))
    return scores if out is None else out.copy_(scores)
