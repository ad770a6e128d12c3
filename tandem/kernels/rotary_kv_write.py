"""Rotary embedding of a step's queries and keys, and the keys and values written into their
pages, in one launch: ``apply_rotary`` (``rotary.py``) followed by ``write_kv`` (``kv_write.py``)
without the rotated keys' round trip through memory or the second launch.

Program ``(token, block)``; the blocks of a token, ``HEADS`` heads each::

    | query heads: rotated -> query_out | key heads: rotated -> key cache | value heads -> value cache |

The result is bit for bit that of the two kernels: a rotated key is rounded to the input dtype
(as ``apply_rotary`` stores it), then cast for the cache as ``write_kv`` casts it (FP8
saturated). A slot of ``-1`` (a CUDA graph's padding row) writes no key or value; its query is
rotated all the same. Heads wider than ``rotary_dim`` keep their tail, cast for the cache.

Given a ``query_norm`` / ``key_norm`` (``norm.HeadNorm``: Qwen3's and Gemma-3's per-head RMSNorm),
each query / key head is normalised first, over its whole ``head_dim``, as ``rms_norm`` would
normalise it, and rounded to the input dtype before it is rotated: the result is ``rms_norm``
then this kernel's, but for the order of the float32 sum of squares (within a step of the dtype).
"""
from __future__ import annotations

from typing import Optional

import torch

from tandem.kernels import kv_write, rotary
from tandem.kernels.kv_write import _last_contiguous, _slot_address, _write_heads
from tandem.kernels.norm import HeadNorm, head_norm_reference
from tandem.kernels.rotary import _normalize_and_rotate_heads, _table_rows
from tandem.kernels.triton_support import (early_launch_arguments, jit, launch_dependents, tl, triton,
                                           wait_for_producer)


@jit
def _rotary_kv_write_kernel(query_ptr, key_ptr, value_ptr, query_out_ptr, key_cache_ptr, value_cache_ptr,
                            positions_ptr, cos_ptr, sin_ptr, slot_mapping_ptr,
                            num_query_heads, num_key_heads, head_dim, rotary_dim, table_stride, page_size,
                            query_token_stride, query_head_stride, key_token_stride, key_head_stride,
                            value_token_stride, value_head_stride,
                            key_page_stride, key_offset_stride, key_cache_head_stride,
                            value_page_stride, value_offset_stride, value_cache_head_stride, limit,
                            query_norm_weight_ptr, query_norm_eps, query_norm_weight_offset,
                            key_norm_weight_ptr, key_norm_eps, key_norm_weight_offset,
                            HEADS: tl.constexpr, HALF_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                            BLOCK: tl.constexpr, SATURATE: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr,
                            QUERY_NORM: tl.constexpr, QUERY_CAST_BEFORE_WEIGHT: tl.constexpr,
                            KEY_NORM: tl.constexpr, KEY_CAST_BEFORE_WEIGHT: tl.constexpr, PDL: tl.constexpr):
    """Program ``(token, block)``: query blocks first, then key blocks, then value blocks (see
    the module's sketch). ``QUERY_NORM`` / ``KEY_NORM``: those heads are normalised before they
    are rotated (``_normalize_and_rotate_heads``). ``PDL``: launched early (``triton_support``)."""
    launch_dependents(PDL)
    wait_for_producer(PDL)
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    query_blocks = tl.cdiv(num_query_heads, HEADS)
    rotated_blocks = query_blocks + tl.cdiv(num_key_heads, HEADS)
    if block < rotated_blocks:
        cos_first, cos_second, sin_first, sin_second = _table_rows(
            cos_ptr, sin_ptr, positions_ptr, token, table_stride, rotary_dim, query_ptr.dtype.element_ty,
            HALF_BLOCK)
        if block < query_blocks:
            _normalize_and_rotate_heads(query_ptr + token * query_token_stride,
                                        query_out_ptr + token * num_query_heads * head_dim, block * HEADS,
                                        num_query_heads, query_head_stride, head_dim, head_dim, rotary_dim,
                                        cos_first, cos_second, sin_first, sin_second, 0.0,
                                        query_norm_weight_ptr, query_norm_eps, query_norm_weight_offset,
                                        HEADS, HALF_BLOCK, TAIL_BLOCK, False, False,
                                        QUERY_NORM, QUERY_CAST_BEFORE_WEIGHT)
        else:
            slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
            if slot >= 0:
                _normalize_and_rotate_heads(
                    key_ptr + token * key_token_stride,
                    _slot_address(key_cache_ptr, slot, page_size, key_page_stride, key_offset_stride),
                    (block - query_blocks) * HEADS, num_key_heads, key_head_stride, key_cache_head_stride,
                    head_dim, rotary_dim, cos_first, cos_second, sin_first, sin_second, limit,
                    key_norm_weight_ptr, key_norm_eps, key_norm_weight_offset, HEADS, HALF_BLOCK, TAIL_BLOCK,
                    SATURATE, ROUND_IN_SOFTWARE, KEY_NORM, KEY_CAST_BEFORE_WEIGHT)
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        heads = (block - rotated_blocks) * HEADS + tl.arange(0, HEADS)
        _write_heads(value_ptr, value_cache_ptr, token, slot, slot >= 0, heads, tl.arange(0, BLOCK),
                     num_key_heads, head_dim, value_token_stride, value_head_stride, page_size,
                     value_page_stride, value_offset_stride, value_cache_head_stride, limit, SATURATE,
                     ROUND_IN_SOFTWARE)


def _check(query, key, value, cos_table, key_cache, value_cache, slot_mapping, positions,
           norms: dict[str, Optional[HeadNorm]]) -> int:
    """Both kernels' checks and the norms' (metadata only, no synchronisation); returns
    ``rotary_dim``."""
    rotary_dim = rotary._check(query, key, cos_table, caller="rotate_and_write_kv")
    kv_write._check(key, value, key_cache, value_cache, slot_mapping, caller="rotate_and_write_kv")
    kv_write._check_kernel_caches(key_cache, value_cache, caller="rotate_and_write_kv")
    if positions.shape != query.shape[:1]:
        raise ValueError(f"rotate_and_write_kv: positions {tuple(positions.shape)} must be [T] "
                         f"for query {tuple(query.shape)}")
    _check_norms(norms, query.shape[2], query.device)
    return rotary_dim


def _check_norms(norms: dict[str, Optional[HeadNorm]], head_dim: int, device: torch.device,
                 caller: str = "rotate_and_write_kv") -> None:
    """Each given norm's weight is ``[head_dim]`` on ``device``; errors name the argument."""
    for name, norm in norms.items():
        if norm is None:
            continue
        if not isinstance(norm, HeadNorm):
            raise TypeError(f"{caller}: {name} must be a HeadNorm, got {type(norm).__name__}")
        if norm.weight.shape != (head_dim,) or norm.weight.device != device:
            raise ValueError(f"{caller}: {name} weight {tuple(norm.weight.shape)} on {norm.weight.device} must "
                             f"be [{head_dim}] (head_dim) on {device}")


def _norm_arguments(kind: str, norm: Optional[HeadNorm], placeholder: torch.Tensor) -> dict:
    """The kernel's arguments for the ``kind`` ("query" or "key") heads' norm; without one,
    ``placeholder`` (a tensor at hand, passed as it is: made contiguous, a strided query or key
    would be copied) stands for the weight pointer nothing reads."""
    present = norm is not None
    norm = HeadNorm(norm.weight.contiguous(), *norm[1:]) if present else HeadNorm(placeholder, 0.0)
    return {f"{kind}_norm_weight_ptr": norm.weight, f"{kind}_norm_eps": float(norm.eps),
            f"{kind}_norm_weight_offset": float(norm.weight_offset), f"{kind.upper()}_NORM": present,
            f"{kind.upper()}_CAST_BEFORE_WEIGHT": bool(norm.cast_before_weight)}


def rotate_and_write_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                        cos_table: torch.Tensor, sin_table: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                        query_norm: Optional[HeadNorm] = None, key_norm: Optional[HeadNorm] = None) -> torch.Tensor:
    """The Triton kernel: returns the rotated query (a new contiguous tensor) and writes the
    rotated key and the value of every token with a slot into ``key_cache``/``value_cache`` in
    place. Arguments as ``apply_rotary`` and ``write_kv`` take them: ``query [T, Hq, D]``,
    ``key``/``value [T, Hkv, D]`` read through their strides (views into a fused qkv output are
    fine), caches ``[pages, page_size, Hkv, D]`` with a contiguous last dimension (other strides
    honoured: page-major views work). ``query_norm`` / ``key_norm``: each query / key head is
    normalised first (the module's docstring). Positions and slots are not bounds-checked (no
    host synchronisation: capturable in a CUDA graph)."""
    rotary_dim = _check(query, key, value, cos_table, key_cache, value_cache, slot_mapping, positions,
                        {"query_norm": query_norm, "key_norm": key_norm})
    query, key, value = _last_contiguous(query), _last_contiguous(key), _last_contiguous(value)
    cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, num_query_heads, head_dim = query.shape
    num_key_heads = key.shape[1]
    if num_tokens == 0:
        return query_out
    half_block, tail_block, heads = rotary._tile(rotary_dim, head_dim, num_query_heads, num_key_heads)
    key_blocks = triton.cdiv(num_key_heads, heads)
    grid = (num_tokens, triton.cdiv(num_query_heads, heads) + 2 * key_blocks)
    _rotary_kv_write_kernel[grid](
        query, key, value, query_out, key_cache, value_cache, positions, cos_table, sin_table, slot_mapping,
        num_query_heads, num_key_heads, head_dim, rotary_dim, cos_table.stride(0), key_cache.shape[1],
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        **_norm_arguments("query", query_norm, query), **_norm_arguments("key", key_norm, key),
        HEADS=heads, HALF_BLOCK=half_block, TAIL_BLOCK=tail_block, BLOCK=triton.next_power_of_2(head_dim),
        num_warps=rotary._num_warps(heads, half_block), **kv_write._saturation(key, key_cache.dtype),
        **early_launch_arguments(query, num_tokens))
    return query_out


def rotate_and_write_kv_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                                  key_cache: torch.Tensor, value_cache: torch.Tensor,
                                  slot_mapping: torch.Tensor, *, query_norm: Optional[HeadNorm] = None,
                                  key_norm: Optional[HeadNorm] = None) -> torch.Tensor:
    """``rotate_and_write_kv`` in plain PyTorch, any device: the norms' ``rms_norm_reference``
    where given, then ``apply_rotary_reference``, then ``write_kv_reference`` of the rotated key
    (which checks the caches)."""
    rotary._check(query, key, cos_table, caller="rotate_and_write_kv_reference")
    _check_norms({"query_norm": query_norm, "key_norm": key_norm}, query.shape[2], query.device,
                 caller="rotate_and_write_kv_reference")
    if query_norm is not None:
        query = head_norm_reference(query, query_norm)
    if key_norm is not None:
        key = head_norm_reference(key, key_norm)
    query_out, key_out = rotary.apply_rotary_reference(query, key, positions, cos_table, sin_table)
    kv_write.write_kv_reference(key_out, value, key_cache, value_cache, slot_mapping)
    return query_out
