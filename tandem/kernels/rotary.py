"""Rotary position embedding, NeoX (``rotate_half``) style, for queries and keys in one launch.

Tables are ``[max_positions, rotary_dim]`` float32 in the ``cat(freqs, freqs)`` layout (see
``tandem.layers.rotary.RotaryEmbedding``); row ``p`` holds position ``p``. The first
``rotary_dim`` elements of every head are rotated, pairs ``(i, i + rotary_dim / 2)``::

    out[:half] = x[:half] * cos[:half] - x[half:rot] * sin[:half]
    out[half:rot] = x[half:rot] * cos[half:] + x[:half] * sin[half:]
    out[rot:] = x[rot:]                  (passed through when rotary_dim < head_dim)

cos and sin are cast to the input dtype before multiplying, and each product is rounded to it,
as the unfused ``x * cos.to(dtype) + rotate_half(x) * sin.to(dtype)`` does. The rotation of a
token's heads (``_rotate_heads``) also serves ``rotary_kv_write.py``, which stores the rotated keys
straight into their cache slots, and may normalise each head first (``_normalize_and_rotate_heads``:
Qwen3's and Gemma-3's query/key norms).
"""
from __future__ import annotations

import torch

from tandem.kernels.kv_write import _last_contiguous, _store_for_cache
from tandem.kernels.triton_support import (early_launch_arguments, jit, launch_dependents, tl, triton,
                                           wait_for_producer)

# Elements of one program's tile of heads at most.
ELEMENTS_PER_PROGRAM = 2048


@jit
def _table_rows(cos_ptr, sin_ptr, positions_ptr, token, table_stride, rotary_dim, dtype: tl.constexpr,
                HALF_BLOCK: tl.constexpr):
    """Token ``token``'s cos and sin, each as its two halves, rounded to ``dtype`` (then held in
    float32): ``(cos_first, cos_second, sin_first, sin_second)``."""
    half = rotary_dim // 2
    columns = tl.arange(0, HALF_BLOCK)
    mask = columns < half
    row = tl.load(positions_ptr + token).to(tl.int64) * table_stride
    cos_first = tl.load(cos_ptr + row + columns, mask=mask, other=0.0).to(dtype).to(tl.float32)
    cos_second = tl.load(cos_ptr + row + half + columns, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin_first = tl.load(sin_ptr + row + columns, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin_second = tl.load(sin_ptr + row + half + columns, mask=mask, other=0.0).to(dtype).to(tl.float32)
    return cos_first, cos_second, sin_first, sin_second


@jit
def _rotate_heads(source_ptr, target_ptr, first_head, num_heads, head_stride, target_head_stride,
                  head_dim, rotary_dim, cos_first, cos_second, sin_first, sin_second, limit,
                  HEADS: tl.constexpr, HALF_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                  SATURATE: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr):
    """Rotates heads ``first_head .. first_head + HEADS`` of one token: head ``h`` is read at
    ``source_ptr + h * head_stride`` and written at ``target_ptr + h * target_head_stride`` (the
    token's row of a dense output, or its slot of a paged cache). Each result is rounded to the
    source's dtype, then stored as ``_store_for_cache`` casts it for the target (``SATURATE``:
    an FP8 cache; otherwise a plain cast, none for a dense output of the source's dtype)."""
    _normalize_and_rotate_heads(source_ptr, target_ptr, first_head, num_heads, head_stride, target_head_stride,
                                head_dim, rotary_dim, cos_first, cos_second, sin_first, sin_second, limit,
                                source_ptr, 0.0, 0.0, HEADS, HALF_BLOCK, TAIL_BLOCK, SATURATE, ROUND_IN_SOFTWARE,
                                False, True)


@jit
def _normalize_and_rotate_heads(source_ptr, target_ptr, first_head, num_heads, head_stride, target_head_stride,
                                head_dim, rotary_dim, cos_first, cos_second, sin_first, sin_second, limit,
                                norm_weight_ptr, norm_eps, norm_weight_offset,
                                HEADS: tl.constexpr, HALF_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                                SATURATE: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr, NORM: tl.constexpr,
                                CAST_BEFORE_WEIGHT: tl.constexpr):
    """``_rotate_heads``, each head first normalised where ``NORM``: an RMSNorm over the whole
    head (both rotated halves and the tail) as ``norm.py``'s kernel takes it (weight ``[D]`` at
    ``norm_weight_ptr``, ``norm_eps``, ``norm_weight_offset``, ``CAST_BEFORE_WEIGHT``), its
    result rounded to the source's dtype and rotated as if it had been read from memory, so
    that only the float32 sum of squares (its order) differs from ``rms_norm`` then this. The
    tail past ``rotary_dim`` is normalised too (and not rotated)."""
    dtype = source_ptr.dtype.element_ty
    heads = first_head + tl.arange(0, HEADS)
    half = rotary_dim // 2
    columns = tl.arange(0, HALF_BLOCK)
    mask = (heads < num_heads)[:, None] & (columns < half)[None, :]
    source = source_ptr + (heads * head_stride)[:, None]
    target = target_ptr + (heads * target_head_stride)[:, None]
    first = tl.load(source + columns[None, :], mask=mask, other=0.0).to(tl.float32)
    second = tl.load(source + half + columns[None, :], mask=mask, other=0.0).to(tl.float32)
    if TAIL_BLOCK > 0:
        tail = rotary_dim + tl.arange(0, TAIL_BLOCK)
        tail_mask = (heads < num_heads)[:, None] & (tail < head_dim)[None, :]
        tail_values = tl.load(source + tail[None, :], mask=tail_mask, other=0.0)
    if NORM:
        squares = tl.sum(first * first, axis=1) + tl.sum(second * second, axis=1)
        if TAIL_BLOCK > 0:
            tail_float = tail_values.to(tl.float32)
            squares += tl.sum(tail_float * tail_float, axis=1)
        inverse_rms = tl.math.rsqrt(squares / head_dim + norm_eps)
        first = _normalized(first, inverse_rms, norm_weight_ptr, columns, columns < half, norm_weight_offset,
                            dtype, CAST_BEFORE_WEIGHT)
        second = _normalized(second, inverse_rms, norm_weight_ptr + half, columns, columns < half,
                             norm_weight_offset, dtype, CAST_BEFORE_WEIGHT)
        if TAIL_BLOCK > 0:
            tail_values = _normalized(tail_float, inverse_rms, norm_weight_ptr, tail, tail < head_dim,
                                      norm_weight_offset, dtype, CAST_BEFORE_WEIGHT).to(dtype)
    first_cos = (first * cos_first[None, :]).to(dtype).to(tl.float32)
    second_sin = (second * sin_first[None, :]).to(dtype).to(tl.float32)
    second_cos = (second * cos_second[None, :]).to(dtype).to(tl.float32)
    first_sin = (first * sin_second[None, :]).to(dtype).to(tl.float32)
    _store_for_cache(target + columns[None, :], (first_cos - second_sin).to(dtype), mask, limit,
                     SATURATE, ROUND_IN_SOFTWARE)
    _store_for_cache(target + half + columns[None, :], (second_cos + first_sin).to(dtype), mask, limit,
                     SATURATE, ROUND_IN_SOFTWARE)
    if TAIL_BLOCK > 0:
        _store_for_cache(target + tail[None, :], tail_values, tail_mask, limit, SATURATE, ROUND_IN_SOFTWARE)


@jit
def _normalized(piece, inverse_rms, weight_ptr, columns, column_mask, weight_offset, dtype: tl.constexpr,
                CAST_BEFORE_WEIGHT: tl.constexpr):
    """Columns ``columns`` of heads ``piece [HEADS, columns]`` (float32) normalised as
    ``norm.py``'s kernel does, given each head's ``rsqrt(mean square + eps)``: rounded to
    ``dtype`` (held in float32)."""
    scale = tl.load(weight_ptr + columns, mask=column_mask, other=0.0).to(tl.float32) + weight_offset
    hidden = piece * inverse_rms[:, None]
    if CAST_BEFORE_WEIGHT:
        hidden = hidden.to(dtype).to(tl.float32)
    return (hidden * scale[None, :]).to(dtype).to(tl.float32)


@jit
def _rotary_kernel(query_ptr, key_ptr, query_out_ptr, key_out_ptr, positions_ptr, cos_ptr, sin_ptr,
                   num_query_heads, num_key_heads, head_dim, rotary_dim, table_stride,
                   query_token_stride, query_head_stride, key_token_stride, key_head_stride,
                   HEADS: tl.constexpr, HALF_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program ``(token, block)``: blocks ``< cdiv(num_query_heads, HEADS)`` rotate query heads,
    the rest key heads. ``PDL``: launched early (``triton_support``)."""
    launch_dependents(PDL)
    wait_for_producer(PDL)
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cos_first, cos_second, sin_first, sin_second = _table_rows(
        cos_ptr, sin_ptr, positions_ptr, token, table_stride, rotary_dim, query_ptr.dtype.element_ty, HALF_BLOCK)
    query_blocks = tl.cdiv(num_query_heads, HEADS)
    if block < query_blocks:
        _rotate_heads(query_ptr + token * query_token_stride, query_out_ptr + token * num_query_heads * head_dim,
                      block * HEADS, num_query_heads, query_head_stride, head_dim, head_dim, rotary_dim,
                      cos_first, cos_second, sin_first, sin_second, 0.0, HEADS, HALF_BLOCK, TAIL_BLOCK,
                      False, False)
    else:
        _rotate_heads(key_ptr + token * key_token_stride, key_out_ptr + token * num_key_heads * head_dim,
                      (block - query_blocks) * HEADS, num_key_heads, key_head_stride, head_dim, head_dim,
                      rotary_dim, cos_first, cos_second, sin_first, sin_second, 0.0, HEADS, HALF_BLOCK,
                      TAIL_BLOCK, False, False)


def _check(query: torch.Tensor, key: torch.Tensor, cos_table: torch.Tensor, caller: str = "apply_rotary") -> int:
    """Validates shapes (metadata only, no synchronisation); returns ``rotary_dim``. Errors name
    ``caller``."""
    rotary_dim = cos_table.shape[-1]
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(f"{caller}: query {tuple(query.shape)} and key {tuple(key.shape)} must be "
                         "[T, Hq, D] and [T, Hkv, D]")
    if query.dtype != key.dtype or rotary_dim % 2 or rotary_dim > query.shape[2]:
        raise ValueError(f"{caller}: rotary_dim {rotary_dim} must be even and at most head_dim "
                         f"{query.shape[2]}; query {query.dtype} and key {key.dtype} must share a dtype")
    return rotary_dim


def apply_rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                 cos_table: torch.Tensor, sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel: ``(query_out, key_out)``, new contiguous tensors (inputs untouched).

    ``query [T, Hq, D]`` and ``key [T, Hkv, D]`` are read through their strides (views into a
    fused qkv output are fine); ``positions [T]`` integer, each within the tables (not
    checked: no host synchronisation, capturable in a CUDA graph)."""
    rotary_dim = _check(query, key, cos_table)
    query, key = _last_contiguous(query), _last_contiguous(key)
    cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    num_tokens, num_query_heads, head_dim = query.shape
    num_key_heads = key.shape[1]
    if num_tokens == 0:
        return query_out, key_out
    half_block, tail_block, heads = _tile(rotary_dim, head_dim, num_query_heads, num_key_heads)
    grid = (num_tokens, triton.cdiv(num_query_heads, heads) + triton.cdiv(num_key_heads, heads))
    _rotary_kernel[grid](query, key, query_out, key_out, positions, cos_table, sin_table,
                         num_query_heads, num_key_heads, head_dim, rotary_dim, cos_table.stride(0),
                         query.stride(0), query.stride(1), key.stride(0), key.stride(1),
                         HEADS=heads, HALF_BLOCK=half_block, TAIL_BLOCK=tail_block,
                         num_warps=_num_warps(heads, half_block), **early_launch_arguments(query, num_tokens))
    return query_out, key_out


def _tile(rotary_dim: int, head_dim: int, num_query_heads: int, num_key_heads: int) -> tuple[int, int, int]:
    """``(HALF_BLOCK, TAIL_BLOCK, HEADS)``: a program's columns of each rotated half, of the
    passed-through tail (0: none), and its heads (at most ``ELEMENTS_PER_PROGRAM`` rotated)."""
    half_block = triton.next_power_of_2(max(rotary_dim // 2, 1))
    tail_block = 0 if rotary_dim == head_dim else triton.next_power_of_2(head_dim - rotary_dim)
    heads = min(triton.next_power_of_2(max(num_query_heads, num_key_heads)),
                max(1, ELEMENTS_PER_PROGRAM // (2 * half_block)))
    return half_block, tail_block, heads


def _num_warps(heads: int, half_block: int) -> int:
    return 4 if heads * half_block >= 512 else 1


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)
    rotated = _rotate_reference(x[..., :rotary_dim], cos, sin)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def apply_rotary_reference(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                           cos_table: torch.Tensor, sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary`` in plain PyTorch: the same contract, any device. With
    ``rotary_dim == head_dim`` it is, bit for bit, ``x * cos + rotate_half(x) * sin``."""
    cos = cos_table[positions].unsqueeze(1)
    sin = sin_table[positions].unsqueeze(1)
    return _rotate_reference(query, cos, sin), _rotate_reference(key, cos, sin)
