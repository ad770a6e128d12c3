"""Plain-PyTorch references of the paged attention kernels in ``paged_attention.py`` (float32
math, same signatures): the oracle of the kernel tests and the semantics the CPU path follows.
Caches of any dtype, FP8 included, are read as float32."""
from __future__ import annotations

from typing import Optional

import torch


def _gather_positions(cache: torch.Tensor, page_table_row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[len(positions), Hkv, D]``: the cache entries of one sequence at ``positions``."""
    page_size = cache.shape[1]
    pages = page_table_row[positions // page_size].long()
    return cache[pages, positions % page_size]


def _attend_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      page_table_row: torch.Tensor, query_positions: torch.Tensor, scale: float,
                      window: Optional[int], softcap: Optional[float]) -> torch.Tensor:
    """Attention of ``query [Q, Hq, D]`` at ``query_positions`` over one sequence, in float32.
    Only keys some query sees are gathered (null pages before the window are never read)."""
    first = 0 if window is None else max(0, int(query_positions[0]) - window + 1)
    key_positions = torch.arange(first, int(query_positions[-1]) + 1, device=query.device)
    keys = _gather_positions(key_cache, page_table_row, key_positions).float()
    values = _gather_positions(value_cache, page_table_row, key_positions).float()
    group_size = query.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group_size, dim=1)
    values = values.repeat_interleave(group_size, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    visible = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        visible &= key_positions[None, :] > query_positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probabilities, values)


def paged_decode_attention_reference(query, key_cache, value_cache, page_table, context_lengths, scale, *,
                                     window=None, softcap=None, num_splits=None, out=None) -> torch.Tensor:
    """Plain-PyTorch :func:`paged_decode_attention` (``num_splits`` is accepted and ignored)."""
    output = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for row, length in enumerate(context_lengths.tolist()):
        if length > 0:
            position = torch.tensor([length - 1], device=query.device)
            output[row] = _attend_reference(query[row:row + 1], key_cache, value_cache, page_table[row],
                                            position, scale, window, softcap)[0]
    if out is None:
        return output.to(query.dtype)
    return out.copy_(output)


def paged_prefill_attention_reference(query, key_cache, value_cache, page_table, query_starts, context_lengths,
                                      scale, *, max_query_len, window=None, softcap=None, out=None) -> torch.Tensor:
    """Plain-PyTorch :func:`paged_prefill_attention`; rows outside every chunk are zeros
    (when ``out`` is not given) or left as they were."""
    output = torch.zeros(query.shape, dtype=query.dtype, device=query.device) if out is None else out
    starts = query_starts.tolist()
    for chunk, length in enumerate(context_lengths.tolist()):
        start, end = starts[chunk], starts[chunk + 1]
        if end > start:
            positions = torch.arange(length - (end - start), length, device=query.device)
            output[start:end] = _attend_reference(query[start:end], key_cache, value_cache, page_table[chunk],
                                                  positions, scale, window, softcap).to(output.dtype)
    return output
