"""Writing one row of values per token into a paged per-token buffer, skipping padding tokens.

``slot_mapping[t] = page * page_size + offset`` names the slot of token ``t``; ``-1`` skips the
token (the padding rows of a CUDA graph batch). Used for the states kept as one row per token
(MLA latents, the sparse indexer's keys and their scales)::

    cache[page, offset, :] = values[t].to(cache.dtype)

Slots must be distinct (two tokens writing one slot leave either value).
"""
from __future__ import annotations

import torch

from tandem.kernels.triton_support import jit, tl, triton


@jit
def _write_token_rows_kernel(values_ptr, cache_ptr, slot_mapping_ptr, width, page_size,
                             stride_values_token, stride_values_column,
                             stride_cache_page, stride_cache_slot, stride_cache_column,
                             BLOCK: tl.constexpr):
    """Program ``(token, column block)`` writes ``BLOCK`` columns of one token's row."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (slot >= 0) & (columns < width)
    row = tl.load(values_ptr + token * stride_values_token + columns * stride_values_column, mask=mask)
    target = (cache_ptr + (slot // page_size) * stride_cache_page + (slot % page_size) * stride_cache_slot
              + columns * stride_cache_column)
    tl.store(target, row.to(cache_ptr.dtype.element_ty), mask=mask)


def _check(values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Shapes only (metadata, no synchronisation)."""
    if (values.dim() != 2 or cache.dim() != 3 or cache.shape[-1] != values.shape[-1]
            or slot_mapping.shape != values.shape[:1]):
        raise ValueError(f"write_token_rows: values {tuple(values.shape)} must be [T, D], cache "
                         f"{tuple(cache.shape)} [pages, page_size, D], slot_mapping {tuple(slot_mapping.shape)} [T]")


def write_token_rows(values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The Triton kernel: writes ``values [T, D]`` in place into ``cache [pages, page_size, D]``
    (any strides, so views into a larger buffer work; values cast to the cache's dtype). Slots
    are not bounds-checked (no host synchronisation: capturable in a CUDA graph)."""
    _check(values, cache, slot_mapping)
    num_tokens, width = values.shape
    if num_tokens == 0:
        return
    block = min(triton.next_power_of_2(width), 1024)
    _write_token_rows_kernel[(num_tokens, triton.cdiv(width, block))](
        values, cache, slot_mapping, width, cache.shape[1], *values.stride(), *cache.stride(),
        BLOCK=block, num_warps=4 if block >= 512 else 1)


def write_token_rows_reference(values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """:func:`write_token_rows` in plain PyTorch (in place; selecting the kept tokens synchronises)."""
    _check(values, cache, slot_mapping)
    slots = slot_mapping.long()
    kept = slots >= 0
    page_size = cache.shape[1]
    cache[slots[kept] // page_size, slots[kept] % page_size] = values[kept].to(cache.dtype)
