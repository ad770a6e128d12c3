"""Paged attention in Triton: split-KV decode and GQA-packed prefill/extend, with references.

Cache layout (one attention layer): ``key_cache`` and ``value_cache`` are
``[num_pages, page_size, num_kv_heads, head_dim]``; page 0 is the null page. Token position
``p`` of a sequence lives at page ``page_table[row, p // page_size]``, slot ``p % page_size``.
The step's new keys and values are already in the cache when these functions run. The caches
are in the query's dtype or FP8 (float8 e4m3, ``kv_cache_dtype="fp8"``): FP8 values are upcast
exactly for the dot products, which accumulate in fp32 either way. With FP8 pages and a 16-bit
query the products are taken in float16 (``FP16_DOTS``): e4m3 converts to float16 in one
instruction per pair of values (to bfloat16 it takes three), float16 holds every e4m3 value
exactly and keeps more of the query's and the probabilities' mantissa than bfloat16 does; the
query is clamped to float16's range (±65504) first.

Visibility: a query at position ``q`` sees key positions ``k <= q`` and, with a ``window``,
only ``k > q - window`` (transformers' sliding-window mask). ``softcap`` turns a scaled score
``s`` into ``softcap * tanh(s / softcap)`` before masking.

Sanitizer contract (docs/design.md I6): slots a query cannot see (past the sequence's length,
before its window, whole null pages) may hold NaN poison. The kernels never load them (masked
loads fill zeros) and mask their scores to -inf, so they never reach the output. A NaN in a
visible slot is a stale read and propagates to the output.

Decode (one query per row, ``context_lengths[b]`` keys visible, the query at position
``context_lengths[b] - 1``)::

    split kernel: grid (row from last to first, kv head, split); tile rows = the kv head's query heads
                  (padded to 16 for tl.dot); keys of the split in blocks of BLOCK_N
        row b keys  |--split 0--|--split 1--|--split 2--|   (in whole key blocks)
    combine kernel: grid (row, query head); merges the splits by log-sum-exp

A row with ``context_length == 0`` is padding: it reads nothing and its output is zeros. The
decode path has no host synchronisation and only shape-dependent temporaries, so it can be
captured in a CUDA graph.

Prefill/extend (chunks of queries, concatenated)::

    grid (chunk, query block, kv head); tile rows = BLOCK_M query tokens x the group's heads
    key blocks above the tile's causal diagonal or wholly before its window are skipped
"""
from __future__ import annotations

from typing import Optional

import torch

from tandem.kernels.attention_device import (  # noqa: F401  (device functions the kernels call)
    MINIMUM_DOT_SIZE, _accumulate_block, _attention_operand, _fp16_range, _load_keys_values, _scores_log2,
    _store_split_output)
from tandem.kernels.triton_support import (device_multiprocessors, early_launch_arguments, jit, launch_dependents,
                                           tl, triton, wait_for_producer)

MAXIMUM_DECODE_SPLITS = 64


# ----------------------------------------------------------------------------------------------
# Kernels


# Values that change from eager step to eager step are not specialised on (triton_support.jit).
@jit(do_not_specialize=["num_splits", "stride_table_row", "stride_partial_row", "stride_partial_head",
                        "stride_partial_split"],
     do_not_specialize_on_alignment=["page_table_ptr", "context_lengths_ptr"])
def _decode_split_kernel(
        query_ptr, key_cache_ptr, value_cache_ptr, page_table_ptr, context_lengths_ptr,
        out_ptr, partial_out_ptr, partial_lse_ptr,
        scale, window, softcap, num_splits,
        stride_query_row, stride_query_head, stride_query_dim,
        stride_key_page, stride_key_slot, stride_key_head, stride_key_dim,
        stride_value_page, stride_value_slot, stride_value_head, stride_value_dim,
        stride_table_row,
        stride_out_row, stride_out_head, stride_out_dim,
        stride_partial_row, stride_partial_head, stride_partial_split,
        GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WRITE_FINAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr, FP16_DOTS: tl.constexpr, PDL: tl.constexpr):
    """One (row, kv head, split): attention of the group's query heads over the split's keys.

    With ``WRITE_FINAL`` (one split) the normalised output goes straight to ``out``; otherwise
    the split's normalised output and log2-sum-exp go to the partial buffers (an empty split
    writes zeros and -inf). ``PDL``: launched early (``triton_support``)."""
    launch_dependents(PDL)
    wait_for_producer(PDL)
    # Rows go last to first: decode rows come sorted by context length (worker/step_inputs.py),
    # so the longest start first and the short ones fill the tail (5% at 256 rows of 1,000 to
    # 2,000 FP8 keys, 3% at 160 rows of 200 to 2,000 bf16 keys; benchmarks/kernels_attention.py).
    row = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_length = tl.load(context_lengths_ptr + row)

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < GROUP_SIZE
    dim_mask = dims < HEAD_DIM
    query_heads = kv_head * GROUP_SIZE + heads
    query = tl.load(query_ptr + row * stride_query_row + query_heads[:, None] * stride_query_head
                    + dims[None, :] * stride_query_dim,
                    mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    input_dtype = query_ptr.dtype.element_ty
    query = _attention_operand(_fp16_range(query, FP16_DOTS), input_dtype, UPCAST_DOTS, FP16_DOTS)

    # The visible keys [first_key, context_length) in whole key blocks, dealt out to the splits.
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(context_length - window, 0)
    first_block = first_key // BLOCK_N
    num_blocks = tl.cdiv(context_length, BLOCK_N) - first_block
    blocks_per_split = tl.cdiv(num_blocks, num_splits)
    block_begin = first_block + split * blocks_per_split
    block_end = tl.minimum(block_begin + blocks_per_split, first_block + num_blocks)

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_H], tl.float32)
    accumulator = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    page_table_row_ptr = page_table_ptr + row * stride_table_row
    for block in range(block_begin, block_end):
        positions = block * BLOCK_N + tl.arange(0, BLOCK_N)
        key_mask = (positions >= first_key) & (positions < context_length)
        keys_transposed, values = _load_keys_values(
            key_cache_ptr, value_cache_ptr, page_table_row_ptr, positions, key_mask, kv_head, dims,
            dim_mask, stride_key_page, stride_key_slot, stride_key_head, stride_key_dim,
            stride_value_page, stride_value_slot, stride_value_head, stride_value_dim, PAGE_SIZE)
        keys_transposed = _attention_operand(keys_transposed, input_dtype, UPCAST_DOTS, FP16_DOTS)
        scores = _scores_log2(query, keys_transposed, scale, softcap, HAS_SOFTCAP, DOT_PRECISION)
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        # Every block holds at least one visible key, so the new maximum is finite.
        running_max, running_sum, accumulator = _accumulate_block(
            scores, values, running_max, running_sum, accumulator, input_dtype, UPCAST_DOTS, FP16_DOTS,
            DOT_PRECISION, False)

    _store_split_output(accumulator, running_max, running_sum, row, split, query_heads, head_mask, dims, dim_mask,
                        out_ptr, stride_out_row, stride_out_head, stride_out_dim, partial_out_ptr, partial_lse_ptr,
                        stride_partial_row, stride_partial_head, stride_partial_split, BLOCK_D, WRITE_FINAL)


@jit(do_not_specialize=["num_splits", "stride_partial_row", "stride_partial_head", "stride_partial_split"])
def _decode_combine_kernel(
        partial_out_ptr, partial_lse_ptr, out_ptr, num_splits,
        stride_partial_row, stride_partial_head, stride_partial_split,
        stride_out_row, stride_out_head, stride_out_dim,
        HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One (row, query head): the splits' outputs weighted by their share of the softmax sum.
    When every split is empty (a padding row) the output is zeros. ``PDL``: launched early
    (``triton_support``)."""
    launch_dependents(PDL)
    wait_for_producer(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    offsets = row * stride_partial_row + head * stride_partial_head + splits * stride_partial_split
    log_sums = tl.load(partial_lse_ptr + offsets, mask=split_mask, other=float("-inf"))
    largest = tl.max(log_sums, 0)
    largest = tl.where(largest == float("-inf"), 0.0, largest)
    weights = tl.exp2(log_sums - largest)
    total = tl.sum(weights, 0)
    outputs = tl.load(partial_out_ptr + offsets[:, None] * BLOCK_D + dims[None, :],
                      mask=split_mask[:, None], other=0.0)
    output = tl.sum(outputs * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_out_row + head * stride_out_head + dims * stride_out_dim,
             output.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


# The page table, starts and lengths are views from row ``num_decode_tokens`` on: their alignment
# changes from step to step, as does the page table's width.
@jit(do_not_specialize=["stride_table_row"],
     do_not_specialize_on_alignment=["page_table_ptr", "query_starts_ptr", "context_lengths_ptr"])
def _prefill_kernel(
        query_ptr, key_cache_ptr, value_cache_ptr, page_table_ptr, query_starts_ptr,
        context_lengths_ptr, out_ptr,
        scale, window, softcap,
        stride_query_token, stride_query_head, stride_query_dim,
        stride_key_page, stride_key_slot, stride_key_head, stride_key_dim,
        stride_value_page, stride_value_slot, stride_value_head, stride_value_dim,
        stride_table_row,
        stride_out_token, stride_out_head, stride_out_dim,
        GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
        UPCAST_DOTS: tl.constexpr, FP16_DOTS: tl.constexpr):
    """One (chunk, query block, kv head): tile row ``r`` is query token ``r // BLOCK_G`` of the
    block and query head ``r % BLOCK_G`` of the kv head's group."""
    chunk = tl.program_id(0)
    # The last query blocks see the most keys: start them first (shorter tail).
    query_block = tl.num_programs(1) - 1 - tl.program_id(1)
    kv_head = tl.program_id(2)
    query_start = tl.load(query_starts_ptr + chunk)
    query_length = tl.load(query_starts_ptr + chunk + 1) - query_start
    if query_block * BLOCK_M >= query_length:
        return
    context_length = tl.load(context_lengths_ptr + chunk)

    rows = tl.arange(0, BLOCK_M * BLOCK_G)
    tokens = query_block * BLOCK_M + rows // BLOCK_G
    heads = rows % BLOCK_G
    dims = tl.arange(0, BLOCK_D)
    row_mask = (tokens < query_length) & (heads < GROUP_SIZE)
    dim_mask = dims < HEAD_DIM
    query_heads = kv_head * GROUP_SIZE + heads
    query = tl.load(query_ptr + (query_start + tokens)[:, None] * stride_query_token
                    + query_heads[:, None] * stride_query_head + dims[None, :] * stride_query_dim,
                    mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    input_dtype = query_ptr.dtype.element_ty
    query = _attention_operand(_fp16_range(query, FP16_DOTS), input_dtype, UPCAST_DOTS, FP16_DOTS)
    query_positions = context_length - query_length + tokens

    # Keys any query of the tile sees: [key_begin, key_end).
    first_position = context_length - query_length + query_block * BLOCK_M
    key_end = tl.minimum(first_position + BLOCK_M, context_length)
    key_begin = 0
    if HAS_WINDOW:
        key_begin = tl.maximum(first_position - window + 1, 0)

    running_max = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    accumulator = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    page_table_row_ptr = page_table_ptr + chunk * stride_table_row
    first_block = (key_begin // BLOCK_N) * BLOCK_N
    # Key blocks every row of the tile sees whole (no window: keys up to the tile's first query
    # position) go first, without the causal mask; the blocks on the diagonal (and, with a
    # window, every block) after them, masked.
    whole_end = first_block
    if not HAS_WINDOW:
        whole_end = ((first_position + 1) // BLOCK_N) * BLOCK_N
    for block_start in range(first_block, whole_end, BLOCK_N):
        positions = block_start + tl.arange(0, BLOCK_N)
        keys_transposed, values = _load_keys_values(
            key_cache_ptr, value_cache_ptr, page_table_row_ptr, positions, positions < key_end, kv_head, dims,
            dim_mask, stride_key_page, stride_key_slot, stride_key_head, stride_key_dim,
            stride_value_page, stride_value_slot, stride_value_head, stride_value_dim, PAGE_SIZE)
        keys_transposed = _attention_operand(keys_transposed, input_dtype, UPCAST_DOTS, FP16_DOTS)
        scores = _scores_log2(query, keys_transposed, scale, softcap, HAS_SOFTCAP, DOT_PRECISION)
        running_max, running_sum, accumulator = _accumulate_block(
            scores, values, running_max, running_sum, accumulator, input_dtype, UPCAST_DOTS, FP16_DOTS,
            DOT_PRECISION, False)
    for block_start in range(whole_end, key_end, BLOCK_N):
        positions = block_start + tl.arange(0, BLOCK_N)
        key_mask = (positions >= key_begin) & (positions < key_end)
        keys_transposed, values = _load_keys_values(
            key_cache_ptr, value_cache_ptr, page_table_row_ptr, positions, key_mask, kv_head, dims,
            dim_mask, stride_key_page, stride_key_slot, stride_key_head, stride_key_dim,
            stride_value_page, stride_value_slot, stride_value_head, stride_value_dim, PAGE_SIZE)
        keys_transposed = _attention_operand(keys_transposed, input_dtype, UPCAST_DOTS, FP16_DOTS)
        scores = _scores_log2(query, keys_transposed, scale, softcap, HAS_SOFTCAP, DOT_PRECISION)
        visible = key_mask[None, :] & (positions[None, :] <= query_positions[:, None])
        if HAS_WINDOW:
            visible = visible & (positions[None, :] > query_positions[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        # A row may see nothing in this block yet: its exponents are kept finite.
        running_max, running_sum, accumulator = _accumulate_block(
            scores, values, running_max, running_sum, accumulator, input_dtype, UPCAST_DOTS, FP16_DOTS,
            DOT_PRECISION, True)

    output = accumulator / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    tl.store(out_ptr + (query_start + tokens)[:, None] * stride_out_token
             + query_heads[:, None] * stride_out_head + dims[None, :] * stride_out_dim,
             output.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Launch configuration


def _dot_precision(dtype: torch.dtype) -> str:
    """Exact fp32 products for fp32 inputs; tensor cores (the default) for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _fp16_dots(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """FP8 pages under a 16-bit query: dot products in float16 (see the module's docstring)."""
    return key_cache.element_size() == 1 and query.dtype in (torch.bfloat16, torch.float16)


def _upcast_dots(query: torch.Tensor) -> bool:
    """Off CUDA the kernels run interpreted, where 16-bit dots must be done in fp32."""
    return query.device.type != "cuda" and query.dtype != torch.float32


def _block_d(head_dim: int) -> int:
    return max(MINIMUM_DOT_SIZE, triton.next_power_of_2(head_dim))


# FP8 pages and at least this many programs a multiprocessor (rows x kv heads x splits): the
# one-warp launch of ``_decode_config`` (about ten of its programs fit an SM, so this is more
# than a wave of them).
ONE_WARP_PROGRAMS_PER_SM = 12


def _decode_config(head_dim: int, device: torch.device, programs: int = 0, fp8_pages: bool = False) -> dict:
    """Key block and launch options of the decode split kernel for ``programs`` (rows x kv
    heads x splits) over FP8 pages or not. Interpreted (CPU) runs use small blocks so tiny test
    shapes still cross block and page boundaries."""
    if device.type != "cuda":
        return dict(BLOCK_N=32, num_warps=4, num_stages=1)
    # Measured on an H100 (benchmarks/kernels_attention.py --sweep, head_dim 128, GQA 32/8): 128-key
    # blocks of four warps read bf16 pages at 0.95-0.99 of the copy bandwidth, and FP8 pages
    # at 0.73 (160 rows of 200 to 2,000 keys) to 0.80 (256 rows of 1,500), 15% faster than
    # 64-key blocks (an FP8 block holds half the bytes, so it needs twice the keys in flight);
    # float16 products: 404 -> 332 us at 256 x 1,500. There, with 2,048 programs, 32-key blocks
    # of one warp read FP8 pages at 0.87-0.88 (297-299 against 323-331 us, pages in random or
    # in prompt order alike), about ten programs an SM; inside the 8B batch-256 workload the
    # kernel's share of a decode step went from 10.7 to 9.7 ms. At 160 rows (1,280 programs, one
    # wave of them: the longest rows set the time) they lose, and bf16 pages gain nothing (526
    # against 529 us).
    if (fp8_pages and _block_d(head_dim) <= 128
            and programs >= ONE_WARP_PROGRAMS_PER_SM * device_multiprocessors(device.index or 0)):
        return dict(BLOCK_N=32, num_warps=1, num_stages=3)
    return dict(BLOCK_N=128 if _block_d(head_dim) <= 128 else 32, num_warps=4, num_stages=3)


def _prefill_config(group_size: int, head_dim: int, device: torch.device) -> dict:
    """Tile shape of the prefill kernel: ``BLOCK_M`` tokens x ``BLOCK_G`` heads rows."""
    block_g = triton.next_power_of_2(group_size)
    if device.type != "cuda":
        rows, block_n, options = 32, 32, dict(num_warps=4, num_stages=1)
    elif _block_d(head_dim) <= 128:
        rows, block_n, options = 128, 64, dict(num_warps=8, num_stages=2)
    else:
        rows, block_n, options = 64, 32, dict(num_warps=8, num_stages=2)
    rows = max(rows, block_g)
    return dict(BLOCK_M=rows // block_g, BLOCK_G=block_g, BLOCK_N=block_n, **options)


def _splits_for(batch: int, num_kv_heads: int, max_pages: int, num_processors: int) -> int:
    """About two programs per processor when ``batch * num_kv_heads`` alone cannot fill the
    device, one split when it can; never more splits than pages (or MAXIMUM_DECODE_SPLITS)."""
    programs = max(1, batch * num_kv_heads)
    if programs >= num_processors:
        return 1
    return max(1, min(-(-2 * num_processors // programs), max_pages, MAXIMUM_DECODE_SPLITS))


def decode_num_splits(batch: int, num_kv_heads: int, max_pages: int, device) -> int:
    """Default number of KV splits for decode: depends on shapes only (never on context
    lengths), so a captured CUDA graph stays valid. One split off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    num_processors = device_multiprocessors(device.index or 0)
    return _splits_for(batch, num_kv_heads, max_pages, num_processors)


def default_decode_splits(query: torch.Tensor, key_cache: torch.Tensor, page_table: torch.Tensor) -> int:
    """The splits :func:`paged_decode_attention` uses when none are given:
    :func:`decode_num_splits`, capped at the key blocks a page-table row can hold (splits are
    cut in whole key blocks, so more would stay empty)."""
    batch, width = page_table.shape
    num_kv_heads, head_dim = key_cache.shape[2:]
    splits = decode_num_splits(batch, num_kv_heads, width, query.device)
    block_n = _decode_config(head_dim, query.device, batch * num_kv_heads * splits,
                             key_cache.element_size() == 1)["BLOCK_N"]
    max_blocks = max(1, -(-width * key_cache.shape[1] // block_n))
    return min(splits, max_blocks)


def _check_cache(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple:
    """``(page_size, num_kv_heads, group_size, head_dim)`` after checking the shapes agree."""
    num_query_heads, head_dim = query.shape[-2:]
    page_size, num_kv_heads, cache_head_dim = key_cache.shape[1:]
    if value_cache.shape != key_cache.shape or cache_head_dim != head_dim:
        raise ValueError(f"cache shapes {tuple(key_cache.shape)}, {tuple(value_cache.shape)} do not "
                         f"match head_dim {head_dim}")
    if num_query_heads % num_kv_heads:
        raise ValueError(f"{num_query_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    return page_size, num_kv_heads, num_query_heads // num_kv_heads, head_dim


# ----------------------------------------------------------------------------------------------
# Entry points


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           page_table: torch.Tensor, context_lengths: torch.Tensor, scale: float, *,
                           window: Optional[int] = None, softcap: Optional[float] = None,
                           num_splits: Optional[int] = None,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of one query token per row over its paged keys (split-KV).

    ``query [B, Hq, D]``, ``page_table [B, W]`` int32, ``context_lengths [B]`` int32 (keys
    visible to the row's query, its own included; 0 marks a padding row, whose output is
    zeros). Returns ``out`` (allocated when not given), ``[B, Hq, D]`` in the query's dtype.
    ``num_splits`` defaults to :func:`decode_num_splits` (capped at the number of key blocks
    the page table can hold). No host synchronisation; CUDA-graph capturable."""
    page_size, num_kv_heads, group_size, head_dim = _check_cache(query, key_cache, value_cache)
    batch, num_query_heads = query.shape[:2]
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = default_decode_splits(query, key_cache, page_table)
    config = _decode_config(head_dim, query.device, batch * num_kv_heads * num_splits,
                            key_cache.element_size() == 1)
    block_d = _block_d(head_dim)
    write_final = num_splits == 1
    if write_final:  # the partial buffers are not touched; pass ``out`` in their place
        partial_out, partial_lse = out, out
        partial_strides = (0, 0, 0)
    else:
        partial_out = torch.empty(batch, num_query_heads, num_splits, block_d,
                                  dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(batch, num_query_heads, num_splits, dtype=torch.float32,
                                  device=query.device)
        partial_strides = partial_lse.stride()
    early = early_launch_arguments(query, batch)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, key_cache, value_cache, page_table, context_lengths, out, partial_out, partial_lse,
        scale, window or 0, softcap or 0.0, num_splits,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), page_table.stride(0),
        *out.stride(), *partial_strides,
        GROUP_SIZE=group_size, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_H=max(MINIMUM_DOT_SIZE, triton.next_power_of_2(group_size)), BLOCK_D=block_d,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, WRITE_FINAL=write_final,
        DOT_PRECISION=_dot_precision(query.dtype), UPCAST_DOTS=_upcast_dots(query),
        FP16_DOTS=_fp16_dots(query, key_cache), **config, **early)
    if not write_final:
        _decode_combine_kernel[(batch, num_query_heads)](
            partial_out, partial_lse, out, num_splits, *partial_lse.stride(), *out.stride(),
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            num_warps=4, **early)
    return out


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            page_table: torch.Tensor, query_starts: torch.Tensor,
                            context_lengths: torch.Tensor, scale: float, *, max_query_len: int,
                            window: Optional[int] = None, softcap: Optional[float] = None,
                            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of N chunks of queries over their paged keys (prefill and extend).

    ``query [T, Hq, D]`` concatenates the chunks; ``query_starts [N+1]`` int32 cumulative
    offsets; ``page_table [N, W]`` int32; ``context_lengths [N]`` int32 = keys visible to the
    chunk's last query (cached prefix + new tokens), so query ``i`` of a chunk of ``q`` queries
    sits at position ``context_length - q + i``. ``max_query_len`` (a Python int, at least the
    longest chunk) sizes the grid. Returns ``out`` ``[T, Hq, D]`` in the query's dtype; rows of
    ``out`` outside every chunk are not written."""
    page_size, num_kv_heads, group_size, head_dim = _check_cache(query, key_cache, value_cache)
    if out is None:
        out = torch.empty_like(query)
    num_chunks = query_starts.shape[0] - 1
    if num_chunks <= 0 or max_query_len <= 0 or query.shape[0] == 0:
        return out
    config = _prefill_config(group_size, head_dim, query.device)
    grid = (num_chunks, triton.cdiv(max_query_len, config["BLOCK_M"]), num_kv_heads)
    _prefill_kernel[grid](
        query, key_cache, value_cache, page_table, query_starts, context_lengths, out,
        scale, window or 0, softcap or 0.0,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), page_table.stride(0),
        *out.stride(),
        GROUP_SIZE=group_size, HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_D=_block_d(head_dim),
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        DOT_PRECISION=_dot_precision(query.dtype), UPCAST_DOTS=_upcast_dots(query),
        FP16_DOTS=_fp16_dots(query, key_cache), **config)
    return out


# The references (plain PyTorch, float32 math) live beside the kernels, in their own module.
from tandem.kernels.paged_attention_reference import (  # noqa: E402,F401
    paged_decode_attention_reference, paged_prefill_attention_reference)
