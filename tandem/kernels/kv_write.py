"""Writing a step's keys and values into the paged cache, both in one launch.

``slot_mapping[t] = page * page_size + offset`` names the cache slot of token ``t``; a slot of
``-1`` skips the token (the padding rows of a CUDA graph batch). Values are cast to the
cache's dtype. Slots must be distinct (two tokens writing one slot leave either value).

    key_cache[page, offset, :, :] = cast_for_cache(key[t], key_cache.dtype)      (likewise value)

An FP8 cache (float8 e4m3) stores values at scale 1.0, saturated: a value beyond the format's
largest finite value (448) is stored as +-448, never as NaN, so an outlier costs precision, not
the sequence. Reads upcast the stored value exactly (e4m3 is a subset of bf16, fp16 and fp32).
"""
from __future__ import annotations

import torch

from tandem.kernels.triton_support import (early_launch_arguments, jit, launch_dependents, tl, triton,
                                           wait_for_producer)

# Elements of one program's tile of heads at most.
ELEMENTS_PER_PROGRAM = 4096


FP8_CACHE_DTYPE = torch.float8_e4m3fn  # the one 8-bit cache format


def saturation_limit(cache_dtype: torch.dtype) -> float | None:
    """The largest finite value of an FP8 cache (values are clamped to it: 448), or None for
    caches of 16 or 32 bits (plain casts)."""
    if cache_dtype == FP8_CACHE_DTYPE:
        return float(torch.finfo(cache_dtype).max)
    if cache_dtype.itemsize == 1:
        raise ValueError(f"KV cache dtype {cache_dtype} is not supported (8-bit caches are {FP8_CACHE_DTYPE})")
    return None


def cast_for_cache(values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``values`` as the cache stores them: a plain cast, saturated to +-limit for FP8 (NaN
    stays NaN)."""
    limit = saturation_limit(cache_dtype)
    if limit is not None:
        values = values.float().clamp(-limit, limit)
    return values.to(cache_dtype)


@jit
def _round_to_e4m3(values):
    """``values`` (float32, within +-448) rounded to the nearest e4m3 value, ties to even, in
    float32 arithmetic: the step is 2**(exponent - 3) for normal e4m3 values and 2**-9 below
    2**-6 (subnormals); ``magnitude / step`` is exact and ``+ 1.5 * 2**23 - 1.5 * 2**23`` rounds
    it to an integer by the float32 rounding rule. Interpreted runs use it before the cast,
    which is then exact: the interpreter's own float32 -> e4m3 conversion mis-rounds values that
    round up into the next binade (1.97 becomes 1.0)."""
    bits = values.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    step = ((tl.maximum(exponent, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)
    rounded = ((tl.abs(values) / step + 12582912.0) - 12582912.0) * step
    return tl.where(bits < 0, -rounded, rounded)


@jit
def _slot_address(cache_ptr, slot, page_size, page_stride, offset_stride):
    """Where token slot ``slot`` (``page * page_size + offset``) starts in ``cache [pages,
    page_size, heads, head_dim]``: its heads follow at the cache's head stride."""
    return cache_ptr + (slot // page_size) * page_stride + (slot % page_size) * offset_stride


@jit
def _store_for_cache(target, values, mask, limit, SATURATE: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr):
    """Stores ``values`` cast to ``target``'s dtype as ``cast_for_cache`` casts them: with
    ``SATURATE`` (FP8) clamped to +-``limit`` in float32 first (and, with ``ROUND_IN_SOFTWARE``,
    rounded by ``_round_to_e4m3``); otherwise a plain cast."""
    if SATURATE:
        values = tl.clamp(values.to(tl.float32), -limit, limit)
        if ROUND_IN_SOFTWARE:
            values = _round_to_e4m3(values)
    tl.store(target, values.to(target.dtype.element_ty), mask=mask)


@jit
def _write_heads(source_ptr, cache_ptr, token, slot, valid, heads, columns, num_heads, head_dim,
                 token_stride, head_stride, page_size, page_stride, offset_stride, cache_head_stride,
                 limit, SATURATE: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr):
    mask = valid & (heads < num_heads)[:, None] & (columns < head_dim)[None, :]
    source = source_ptr + token * token_stride + (heads * head_stride)[:, None] + columns[None, :]
    target = (_slot_address(cache_ptr, slot, page_size, page_stride, offset_stride)
              + (heads * cache_head_stride)[:, None] + columns[None, :])
    _store_for_cache(target, tl.load(source, mask=mask), mask, limit, SATURATE, ROUND_IN_SOFTWARE)


@jit
def _write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                     num_heads, head_dim, page_size,
                     key_token_stride, key_head_stride, value_token_stride, value_head_stride,
                     key_page_stride, key_offset_stride, key_cache_head_stride,
                     value_page_stride, value_offset_stride, value_cache_head_stride, limit,
                     HEADS: tl.constexpr, BLOCK: tl.constexpr, SATURATE: tl.constexpr,
                     ROUND_IN_SOFTWARE: tl.constexpr, PDL: tl.constexpr):
    """Program ``(token, block)`` writes heads ``block * HEADS ..`` of one token's key and value.
    ``PDL``: launched early (``triton_support``)."""
    launch_dependents(PDL)
    wait_for_producer(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    valid = slot >= 0
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    columns = tl.arange(0, BLOCK)
    _write_heads(key_ptr, key_cache_ptr, token, slot, valid, heads, columns, num_heads, head_dim,
                 key_token_stride, key_head_stride, page_size,
                 key_page_stride, key_offset_stride, key_cache_head_stride, limit, SATURATE,
                 ROUND_IN_SOFTWARE)
    _write_heads(value_ptr, value_cache_ptr, token, slot, valid, heads, columns, num_heads, head_dim,
                 value_token_stride, value_head_stride, page_size,
                 value_page_stride, value_offset_stride, value_cache_head_stride, limit, SATURATE,
                 ROUND_IN_SOFTWARE)


def _check(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           slot_mapping: torch.Tensor, caller: str = "write_kv") -> None:
    """Shapes only (metadata, no synchronisation); errors name ``caller``."""
    if (key.dim() != 3 or key.shape != value.shape or key_cache.dim() != 4 or key_cache.shape != value_cache.shape
            or tuple(key_cache.shape[2:]) != tuple(key.shape[1:]) or slot_mapping.shape != key.shape[:1]):
        raise ValueError(f"{caller}: key/value {tuple(key.shape)}/{tuple(value.shape)} must be [T, Hkv, D], "
                         f"caches {tuple(key_cache.shape)}/{tuple(value_cache.shape)} [pages, page_size, Hkv, D], "
                         f"slot_mapping {tuple(slot_mapping.shape)} [T]")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"{caller}: key cache {key_cache.dtype} and value cache {value_cache.dtype} differ")


def _check_kernel_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, caller: str = "write_kv") -> None:
    """What the kernels need beyond ``_check``: each cache row's last dimension contiguous."""
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError(f"{caller}: the caches' last dimension must be contiguous")


def _saturation(key: torch.Tensor, cache_dtype: torch.dtype) -> dict:
    """The kernels' cast for the cache: ``limit`` and the ``SATURATE``/``ROUND_IN_SOFTWARE``
    flags of ``_store_for_cache`` (software rounding where Triton interprets: off CUDA)."""
    limit = saturation_limit(cache_dtype)
    return dict(limit=limit or 0.0, SATURATE=limit is not None,
                ROUND_IN_SOFTWARE=limit is not None and key.device.type != "cuda")


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """The Triton kernel: writes in place into ``key_cache``/``value_cache`` (whose last
    dimension must be contiguous; other strides are honoured, so views into a larger buffer
    work). ``key``/``value`` are read through their strides. Slots are not bounds-checked (no
    host synchronisation: capturable in a CUDA graph)."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    _check_kernel_caches(key_cache, value_cache)
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
        HEADS=heads, BLOCK=block, num_warps=4 if heads * block >= 1024 else 1,
        **_saturation(key, key_cache.dtype), **early_launch_arguments(key, num_tokens))


def write_kv_reference(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``write_kv`` in plain PyTorch (in place; selecting the kept tokens synchronises)."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    slots = slot_mapping.long()
    kept = slots >= 0
    page_size = key_cache.shape[1]
    pages, offsets = slots[kept] // page_size, slots[kept] % page_size
    key_cache[pages, offsets] = cast_for_cache(key[kept], key_cache.dtype)
    value_cache[pages, offsets] = cast_for_cache(value[kept], value_cache.dtype)
