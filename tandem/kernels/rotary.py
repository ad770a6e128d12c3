"""Rotary position embedding, NeoX (``rotate_half``) style, for queries and keys in one launch.

Tables are ``[max_positions, rotary_dim]`` float32 in the ``cat(freqs, freqs)`` layout (see
``tandem.layers.rotary.RotaryEmbedding``); row ``p`` holds position ``p``. The first
``rotary_dim`` elements of every head are rotated, pairs ``(i, i + rotary_dim / 2)``::

    out[:half] = x[:half] * cos[:half] - x[half:rot] * sin[:half]
    out[half:rot] = x[half:rot] * cos[half:] + x[:half] * sin[half:]
    out[rot:] = x[rot:]                  (passed through when rotary_dim < head_dim)

cos and sin are cast to the input dtype before multiplying, and each product is rounded to it,
as the unfused ``x * cos.to(dtype) + rotate_half(x) * sin.to(dtype)`` does.
"""
from __future__ import annotations

import torch

from tandem.kernels.triton_support import (early_launch_arguments, jit, launch_dependents, tl, triton,
                                           wait_for_producer)

# Elements of one program's tile of heads at most.
ELEMENTS_PER_PROGRAM = 2048


@jit
def _rotate_heads(in_ptr, out_ptr, token, first_head, num_heads, token_stride, head_stride,
                  head_dim, rotary_dim, cos_first, cos_second, sin_first, sin_second,
                  HEADS: tl.constexpr, HALF_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr):
    """Rotates heads ``first_head .. first_head + HEADS`` of one token; ``out`` is dense
    ``[T, num_heads, head_dim]``."""
    dtype = in_ptr.dtype.element_ty
    heads = first_head + tl.arange(0, HEADS)
    half = rotary_dim // 2
    columns = tl.arange(0, HALF_BLOCK)
    mask = (heads < num_heads)[:, None] & (columns < half)[None, :]
    source = in_ptr + token.to(tl.int64) * token_stride + (heads * head_stride)[:, None]
    target = out_ptr + (token.to(tl.int64) * num_heads + heads)[:, None] * head_dim
    first = tl.load(source + columns[None, :], mask=mask, other=0.0).to(tl.float32)
    second = tl.load(source + half + columns[None, :], mask=mask, other=0.0).to(tl.float32)
    first_cos = (first * cos_first[None, :]).to(dtype).to(tl.float32)
    second_sin = (second * sin_first[None, :]).to(dtype).to(tl.float32)
    second_cos = (second * cos_second[None, :]).to(dtype).to(tl.float32)
    first_sin = (first * sin_second[None, :]).to(dtype).to(tl.float32)
    tl.store(target + columns[None, :], (first_cos - second_sin).to(dtype), mask=mask)
    tl.store(target + half + columns[None, :], (second_cos + first_sin).to(dtype), mask=mask)
    if TAIL_BLOCK > 0:
        tail = rotary_dim + tl.arange(0, TAIL_BLOCK)
        tail_mask = (heads < num_heads)[:, None] & (tail < head_dim)[None, :]
        tl.store(target + tail[None, :], tl.load(source + tail[None, :], mask=tail_mask), mask=tail_mask)


@jit
def _rotary_kernel(query_ptr, key_ptr, query_out_ptr, key_out_ptr, positions_ptr, cos_ptr, sin_ptr,
                   num_query_heads, num_key_heads, head_dim, rotary_dim, table_stride,
                   query_token_stride, query_head_stride, key_token_stride, key_head_stride,
                   HEADS: tl.constexpr, HALF_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program ``(token, block)``: blocks ``< cdiv(num_query_heads, HEADS)`` rotate query heads,
    the rest key heads. ``PDL``: launched early (``triton_support``)."""
    launch_dependents(PDL)
    wait_for_producer(PDL)
    token = tl.program_id(0)
    block = tl.program_id(1)
    dtype = query_ptr.dtype.element_ty
    half = rotary_dim // 2
    columns = tl.arange(0, HALF_BLOCK)
    row = tl.load(positions_ptr + token).to(tl.int64) * table_stride
    cos_first = tl.load(cos_ptr + row + columns, mask=columns < half, other=0.0).to(dtype).to(tl.float32)
    cos_second = tl.load(cos_ptr + row + half + columns, mask=columns < half, other=0.0).to(dtype).to(tl.float32)
    sin_first = tl.load(sin_ptr + row + columns, mask=columns < half, other=0.0).to(dtype).to(tl.float32)
    sin_second = tl.load(sin_ptr + row + half + columns, mask=columns < half, other=0.0).to(dtype).to(tl.float32)
    query_blocks = tl.cdiv(num_query_heads, HEADS)
    if block < query_blocks:
        _rotate_heads(query_ptr, query_out_ptr, token, block * HEADS, num_query_heads,
                      query_token_stride, query_head_stride, head_dim, rotary_dim,
                      cos_first, cos_second, sin_first, sin_second, HEADS, HALF_BLOCK, TAIL_BLOCK)
    else:
        _rotate_heads(key_ptr, key_out_ptr, token, (block - query_blocks) * HEADS, num_key_heads,
                      key_token_stride, key_head_stride, head_dim, rotary_dim,
                      cos_first, cos_second, sin_first, sin_second, HEADS, HALF_BLOCK, TAIL_BLOCK)


def _check(query: torch.Tensor, key: torch.Tensor, cos_table: torch.Tensor) -> int:
    """Validates shapes (metadata only, no synchronisation); returns ``rotary_dim``."""
    rotary_dim = cos_table.shape[-1]
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(f"apply_rotary: query {tuple(query.shape)} and key {tuple(key.shape)} must be "
                         "[T, Hq, D] and [T, Hkv, D]")
    if query.dtype != key.dtype or rotary_dim % 2 or rotary_dim > query.shape[2]:
        raise ValueError(f"apply_rotary: rotary_dim {rotary_dim} must be even and at most head_dim "
                         f"{query.shape[2]}; query {query.dtype} and key {key.dtype} must share a dtype")
    return rotary_dim


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


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
    half_block = triton.next_power_of_2(max(rotary_dim // 2, 1))
    tail_block = 0 if rotary_dim == head_dim else triton.next_power_of_2(head_dim - rotary_dim)
    heads = min(triton.next_power_of_2(max(num_query_heads, num_key_heads)),
                max(1, ELEMENTS_PER_PROGRAM // (2 * half_block)))
    grid = (num_tokens, triton.cdiv(num_query_heads, heads) + triton.cdiv(num_key_heads, heads))
    _rotary_kernel[grid](query, key, query_out, key_out, positions, cos_table, sin_table,
                         num_query_heads, num_key_heads, head_dim, rotary_dim, cos_table.stride(0),
                         query.stride(0), query.stride(1), key.stride(0), key.stride(1),
                         HEADS=heads, HALF_BLOCK=half_block, TAIL_BLOCK=tail_block,
                         num_warps=4 if heads * half_block >= 512 else 1, **early_launch_arguments(query, num_tokens))
    return query_out, key_out


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
