"""The attention front: a layer that declares its state spec and calls a backend.

The backend interface is ``AttentionBackend.forward(query, key, value, buffers, metadata,
scale, window=None, rotary=None, positions=None, query_norm=None, key_norm=None)``: given a
``query_norm`` / ``key_norm`` (a per-head norm module, ``HeadNormModule``) it first normalises
each query / key head, given a ``rotary`` embedding it then rotates the query and key at
``positions``; it writes the new keys/values into the paged buffers and returns the attention
output. With a ``window``, a query at position ``p`` reads only keys at positions
``p - window + 1 .. p`` (transformers' sliding-window mask: ``key > p - window``); page-table
entries before that may be the null page. ``TorchAttentionBackend`` is plain PyTorch and runs
on CPU and CUDA; ``TritonAttentionBackend`` runs the kernels of ``tandem/kernels`` on CUDA.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.kv_write import cast_for_cache
from tandem.kernels.norm import HeadNorm
from tandem.kv.spec import FullAttentionSpec, SlidingWindowSpec
from tandem.layers.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from tandem.layers.forward_context import ForwardContext
    from tandem.layers.rotary import RotaryEmbedding


def gather_pages(buffer: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``buffer[pages]`` for any shape of ``pages``, as one ``index_select`` over whole pages
    (about twice as fast as advanced indexing on CPU)."""
    flat = buffer.view(buffer.shape[0], -1).index_select(0, pages.reshape(-1))
    return flat.view(*pages.shape, *buffer.shape[1:])


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``rows [T, *row]`` (in the cache's dtype) into the token slots ``slots`` of ``cache
    [pages, page_size, *row]`` (each page contiguous), copied as bytes: CPU ``index_copy_`` has
    no FP8 kernel, and bytes are bytes for every dtype. A contiguous (layer-major) cache is one
    ``[slots, row bytes]`` view; a page-major view is indexed by (page, slot in the page)."""
    num_pages, page_size = cache.shape[:2]
    row_bytes = cache[0, 0].numel() * cache.element_size()
    source = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], row_bytes)
    if cache.is_contiguous():
        cache.view(torch.uint8).view(-1, row_bytes).index_copy_(0, slots, source)
        return
    cache.view(torch.uint8).view(num_pages, page_size, row_bytes).index_put_(
        (slots // page_size, slots % page_size), source)


class HeadNormModule(Protocol):
    """A per-head norm (Qwen3's and Gemma-3's q_norm/k_norm): called on ``[T, H, D]`` it
    normalises each head; ``head_norm()`` gives its parameters to a kernel that applies it on
    the way (``kernels/rotary_kv_write.py``), with the same result but for the order of a sum."""

    def __call__(self, heads: torch.Tensor) -> torch.Tensor: ...

    def head_norm(self) -> HeadNorm: ...


def normalize_heads(query: torch.Tensor, key: torch.Tensor, query_norm: Optional[HeadNormModule],
                    key_norm: Optional[HeadNormModule]) -> tuple[torch.Tensor, torch.Tensor]:
    """The query and key through their norm modules, where given."""
    return (query if query_norm is None else query_norm(query)), (key if key_norm is None else key_norm(key))


class AttentionBackend:
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                buffers: dict[str, torch.Tensor], metadata: AttentionMetadata,
                scale: float, window: Optional[int] = None, rotary: Optional["RotaryEmbedding"] = None,
                positions: Optional[torch.Tensor] = None, query_norm: Optional[HeadNormModule] = None,
                key_norm: Optional[HeadNormModule] = None) -> torch.Tensor:
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain PyTorch: batched for decode tokens, per chunk for prefills.

    Slots past a sequence's length may hold poison (NaN) in sanitizer mode, so there gathered
    keys and values are zeroed outside the valid region before the product — a NaN inside the
    valid region (a stale read) still propagates and fails loudly.
    """

    def forward(self, query, key, value, buffers, metadata, scale, window=None, rotary=None, positions=None,
                query_norm=None, key_norm=None):
        query, key = normalize_heads(query, key, query_norm, key_norm)
        if rotary is not None:
            query, key = rotary(query, key, positions)
        key_cache, value_cache = buffers["key"], buffers["value"]
        slots = metadata.slot_mapping
        write_slots(key_cache, slots, cast_for_cache(key, key_cache.dtype))
        write_slots(value_cache, slots, cast_for_cache(value, value_cache.dtype))
        output = torch.empty_like(query)
        for bucket in metadata.decode_buckets:
            output[bucket.start:bucket.end] = self._decode(
                query[bucket.start:bucket.end], key_cache, value_cache, bucket, metadata.zero_invalid, scale,
                window)
        for chunk in metadata.prefills:
            output[chunk.query_start:chunk.query_end] = self._prefill(
                query[chunk.query_start:chunk.query_end], key_cache, value_cache, chunk, scale, window)
        return output

    @staticmethod
    def _decode(query, key_cache, value_cache, bucket, zero_invalid, scale, window=None):
        table = bucket.page_table
        page_size, num_kv_heads, head_dim = key_cache.shape[1:]
        valid = bucket.valid
        if window is not None:
            # Skip the pages before the shortest row's window; mask each row to its own window
            # (longer rows' older entries may be null: masked, and zeroed under the sanitizer).
            first_page = max(0, bucket.min_context_length - window) // page_size
            table = table[:, first_page:]
            key_positions = torch.arange(first_page * page_size, valid.shape[1], device=valid.device)
            valid = valid[:, first_page * page_size:] & (
                key_positions[None, :] >= bucket.context_lengths[:, None] - window)
        batch, num_pages = table.shape
        keys = gather_pages(key_cache, table).view(batch, num_pages * page_size, num_kv_heads, head_dim)
        values = gather_pages(value_cache, table).view(batch, num_pages * page_size, num_kv_heads, head_dim)
        if zero_invalid:
            mask = valid[:, :, None, None]
            keys, values = torch.where(mask, keys, 0), torch.where(mask, values, 0)
        keys = keys.transpose(1, 2).to(query.dtype)
        values = values.transpose(1, 2).to(query.dtype)
        out = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values,
                                             attn_mask=valid[:, None, None, :], scale=scale,
                                             enable_gqa=True)
        return out.squeeze(2)

    @staticmethod
    def _prefill(query, key_cache, value_cache, chunk, scale, window=None):
        page_size, num_kv_heads, head_dim = key_cache.shape[1:]
        length = chunk.context_length
        num_queries = query.shape[0]
        # With a window, start at the page of the first query's oldest key (earlier entries
        # may be null).
        first_page = 0 if window is None else max(0, length - num_queries - window + 1) // page_size
        first = first_page * page_size
        pages = chunk.pages[first_page:]
        keys = gather_pages(key_cache, pages).view(-1, num_kv_heads, head_dim)[:length - first]
        values = gather_pages(value_cache, pages).view(-1, num_kv_heads, head_dim)[:length - first]
        query_positions = torch.arange(length - num_queries, length, device=query.device)
        key_positions = torch.arange(first, length, device=query.device)
        mask = key_positions[None, :] <= query_positions[:, None]
        if window is not None:
            mask &= key_positions[None, :] > query_positions[:, None] - window
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0).to(query.dtype),
            values.transpose(0, 1).unsqueeze(0).to(query.dtype), attn_mask=mask[None, None],
            scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through the Triton kernels (CUDA): one launch writes the step's keys and
    values into their pages (given a ``rotary`` embedding, the same launch rotates the queries
    and keys first, and normalises their heads before that given norms:
    ``kernels/rotary_kv_write.py``), one decode launch serves every decode row (split-KV), one
    prefill launch every prefill chunk. No host synchronisation: capturable in a CUDA graph."""

    def forward(self, query, key, value, buffers, metadata, scale, window=None, rotary=None, positions=None,
                query_norm=None, key_norm=None):
        from tandem.kernels.kv_write import write_kv
        from tandem.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
        from tandem.kernels.rotary_kv_write import rotate_and_write_kv

        key_cache, value_cache = buffers["key"], buffers["value"]
        if rotary is None:
            query, key = normalize_heads(query, key, query_norm, key_norm)
            write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        else:
            query = rotate_and_write_kv(query, key, value, positions, rotary.cos_table, rotary.sin_table,
                                        key_cache, value_cache, metadata.slot_mapping,
                                        query_norm=None if query_norm is None else query_norm.head_norm(),
                                        key_norm=None if key_norm is None else key_norm.head_norm())
        output = torch.empty_like(query)
        num_decode = metadata.num_decode_tokens
        if num_decode:
            paged_decode_attention(query[:num_decode], key_cache, value_cache, metadata.decode_page_table,
                                   metadata.decode_context_lengths, scale, window=window,
                                   out=output[:num_decode])
        if metadata.num_prefills:
            paged_prefill_attention(query, key_cache, value_cache, metadata.prefill_page_table,
                                    metadata.prefill_query_starts, metadata.prefill_context_lengths, scale,
                                    max_query_len=metadata.max_prefill_query_len, window=window, out=output)
        return output


class Attention(nn.Module):
    """Causal attention over the paged state of one layer: full, or over the last
    ``sliding_window`` tokens when that is given (its spec then lets pages before the window go)."""

    cuda_graph_safe = True  # the backends' reads and writes are shape-static tensor operations
    # Mixed-step graphs run it eagerly between their segments (worker/mixed_graphs.py): its
    # tensor arguments (positions included) are indexed by token first, its output too, and
    # nothing else reads the context.
    mixed_graph_boundary = True

    def __init__(self, layer_name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, state_dtype: torch.dtype, sliding_window: Optional[int] = None) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.state_spec = (FullAttentionSpec(num_kv_heads, head_dim, state_dtype) if sliding_window is None
                           else SlidingWindowSpec(num_kv_heads, head_dim, state_dtype, sliding_window))

    def state_specs(self) -> dict:
        return {self.layer_name: self.state_spec}

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                context: "ForwardContext", rotary: Optional["RotaryEmbedding"] = None,
                positions: Optional[torch.Tensor] = None, query_norm: Optional[HeadNormModule] = None,
                key_norm: Optional[HeadNormModule] = None) -> torch.Tensor:
        """query ``[T, Hq, D]``, key/value ``[T, Hkv, D]`` → ``[T, Hq, D]``. Given ``query_norm``
        / ``key_norm``, each query / key head is normalised first; given ``rotary``, the query
        and key are then rotated at ``positions [T]``; both by the backend (the Triton one does
        them in the launch that writes the keys and values into their pages)."""
        buffers = context.state.layer(self.layer_name)
        metadata = context.attention_metadata[context.state.group_of(self.layer_name)]
        return context.attention_backend.forward(query, key, value, buffers, metadata, self.scale,
                                                 window=self.sliding_window, rotary=rotary, positions=positions,
                                                 query_norm=query_norm, key_norm=key_norm)
