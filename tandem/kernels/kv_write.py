"""Writing a step's keys and values into the paged cache, both in one launch.

``slot_mapping[t] = page * page_size + offset`` names the cache slot of token ``t``; a slot of
``-1`` skips the token (the padding rows of a CUDA graph batch). Values are cast to the
cache's dtype. Slots must be distinct (two tokens writing one slot leave either value).

    key_cache[page, offset, :, :] = key[t].to(key_cache.dtype)      (likewise value)
"""
from __future__ import annotations

import torch

from tandem.kernels.triton_support import jit, tl, triton

# Elements of one program's tile of heads at most.
ELEMENTS_PER_PROGRAM = 4096


@jit
def _write_heads(source_ptr, cache_ptr, token, slot, valid, heads, columns, num_heads, head_dim,
                 token_stride, head_stride, page_size, page_stride, offset_stride, cache_head_stride):
    mask = valid & (heads < num_heads)[:, None] & (columns < head_dim)[None, :]
    source = source_ptr + token * token_stride + (heads * head_stride)[:, None] + columns[None, :]
    target = (cache_ptr + (slot // page_size) * page_stride + (slot % page_size) * offset_stride
              + (heads * cache_head_stride)[:, None] + columns[None, :])
    tl.store(target, tl.load(source, mask=mask).to(cache_ptr.dtype.element_ty), mask=mask)


@jit
def _write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                     num_heads, head_dim, page_size,
                     key_token_stride, key_head_stride, value_token_stride, value_head_stride,
                     key_page_stride, key_offset_stride, key_cache_head_stride,
                     value_page_stride, value_offset_stride, value_cache_head_stride,
                     HEADS: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(token, block)`` writes heads ``block * HEADS ..`` of one token's key and value."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    valid = slot >= 0
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    columns = tl.arange(0, BLOCK)
    _write_heads(key_ptr, key_cache_ptr, token, slot, valid, heads, columns, num_heads, head_dim,
                 key_token_stride, key_head_stride, page_size,
                 key_page_stride, key_offset_stride, key_cache_head_stride)
    _write_heads(value_ptr, value_cache_ptr, token, slot, valid, heads, columns, num_heads, head_dim,
                 value_token_stride, value_head_stride, page_size,
                 value_page_stride, value_offset_stride, value_cache_head_stride)


def _check(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    """Shapes only (metadata, no synchronisation)."""
    if (key.dim() != 3 or key.shape != value.shape or key_cache.dim() != 4 or key_cache.shape != value_cache.shape
            or tuple(key_cache.shape[2:]) != tuple(key.shape[1:]) or slot_mapping.shape != key.shape[:1]):
        raise ValueError(f"write_kv: key/value {tuple(key.shape)}/{tuple(value.shape)} must be [T, Hkv, D], "
                         f"caches {tuple(key_cache.shape)}/{tuple(value_cache.shape)} [pages, page_size, Hkv, D], "
                         f"slot_mapping {tuple(slot_mapping.shape)} [T]")


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """The Triton kernel: writes in place into ``key_cache``/``value_cache`` (whose last
    dimension must be contiguous; other strides are honoured, so views into a larger buffer
    work). ``key``/``value`` are read through their strides. Slots are not bounds-checked (no
    host synchronisation: capturable in a CUDA graph)."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("write_kv: the caches' last dimension must be contiguous")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _last_contiguous(key), _last_contiguous(value)
    block = triton.next_power_of_2(head_dim)
    heads = min(triton.next_power_of_2(num_heads), max(1, ELEMENTS_PER_PROGRAM // block))
    _write_kv_kernel[(num_tokens, triton.cdiv(num_heads, heads))](
        key, value, key_cache, value_cache, slot_mapping, num_heads, head_dim, key_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HEADS=heads, BLOCK=block, num_warps=4 if heads * block >= 1024 else 1)


def write_kv_reference(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``write_kv`` in plain PyTorch (in place; selecting the kept tokens synchronises)."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    slots = slot_mapping.long()
    kept = slots >= 0
    page_size = key_cache.shape[1]
    pages, offsets = slots[kept] // page_size, slots[kept] % page_size
    key_cache[pages, offsets] = key[kept].to(key_cache.dtype)
    value_cache[pages, offsets] = value[kept].to(value_cache.dtype)
