"""DeepSeek sparse attention (DSA): the lightning indexer picks, for every query, the
``index_topk`` past tokens its attention may read (DeepSeek-V3.2, GLM-5).

Scoring, as the reference computes it (``q`` from the query latent, ``k`` one key per token):

    index[s, t] = sum_h  w[s, h] * relu(q[s, h] . k[t] / sqrt(head_dim)),   w = weights_proj(x) / sqrt(heads)

then the top ``min(index_topk, context)`` causal positions are selected. The indexer's key cache
is its own state group (``IndexerSpec``), read only through ``context.state.layer(name)`` (I3),
in one of two modes:

- float32: keys as computed (exact; tests compare against the reference with it);
- FP8: as production deployments store them. Queries and keys are rotated by a Walsh-Hadamard
  matrix (orthogonal: ``Hq . Hk = q . k``; it spreads outliers before quantising), then cast to
  FP8 e4m3 with one power-of-two FP32 scale per key (and per query head), ``amax / 448`` rounded
  up. A cache page is ``page_size * head_dim`` key bytes followed by ``page_size`` FP32 scales::

      page p:  | key 0 | key 1 | ... | key P-1 | scale 0 | scale 1 | ... | scale P-1 |
               0       D       2D          P*D                              P*D + 4P
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kv.spec import IndexerSpec
from tandem.layers.attention import write_slots
from tandem.layers.attention_metadata import AttentionMetadata, DecodeBucket
from tandem.layers.linear import Linear

if TYPE_CHECKING:
    from tandem.layers.forward_context import ForwardContext

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-4


@dataclass
class TopKSelection:
    """Which past positions each query of a step may attend to (True = selected).

    ``decode[b]``: ``[bucket tokens, bucket width * page_size]`` for decode bucket ``b`` (the
    shape of ``DecodeBucket.valid``); ``prefills[i]``: ``[queries, context]`` for prefill chunk
    ``i``. Positions are token positions in the sequence, the same in every state group (the
    runner builds the same buckets for every group), so the latent cache reads them through its
    own page tables.

    With the kernels (``use_kernels``) the decode rows are given instead as ``decode_indices``
    ``[num_decode_tokens, min(index_topk, width * page_size)]`` int32: the selected positions
    of each decode row, -1 where fewer are visible (the shape depends on shapes only).
    """
    decode: list[torch.Tensor] = field(default_factory=list)
    prefills: list[torch.Tensor] = field(default_factory=list)
    decode_indices: Optional[torch.Tensor] = None


def hadamard_matrix(dim: int) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard matrix (Sylvester construction); ``dim`` a power of two."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"index_head_dim: the FP8 indexer needs a power of two, got {dim}")
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < dim:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / dim ** 0.5


def quantize_fp8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``values`` (last dim) → (e4m3 values, float32 power-of-two scale per row)."""
    values = values.float()
    amax = values.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    return (values / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.squeeze(-1)


def index_scores(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                 softmax_scale: float) -> torch.Tensor:
    """queries ``[B, S, H, D]``, weights ``[B, S, H]``, keys ``[B, L, D]`` → ``[B, S, L]``:
    ``sum_h weights[h] * relu(softmax_scale * queries[h] . key)``, in the reference's order."""
    scores = F.relu(torch.matmul(queries, keys.transpose(-1, -2).unsqueeze(1)) * softmax_scale)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


class Float32IndexKeys:
    """Unquantised indexer keys: buffer ``[pages, page_size, head_dim]`` float32."""

    def write(self, buffer: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, page_size: int) -> None:
        write_slots(buffer, slots, keys.float())

    def write_kernel(self, buffer: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, page_size: int) -> None:
        """:meth:`write` through the row-writer kernel: slots of -1 are skipped."""
        from tandem.kernels.token_write import write_token_rows

        write_token_rows(keys.float(), buffer, slots)

    def gather(self, buffer: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
        """pages ``[..., n]`` → keys ``[..., n * page_size, head_dim]`` float32."""
        return buffer[pages].flatten(-3, -2)

    def queries(self, queries: torch.Tensor) -> torch.Tensor:
        return queries.float()

    def decode_operands(self, buffer: torch.Tensor, page_size: int, queries: torch.Tensor) -> tuple:
        """``(queries, keys, key_scales)`` as ``index_decode_scores`` reads them (``queries`` as
        :meth:`queries` returned them): float32 keys, no scales."""
        return queries, buffer, None


class Fp8PageMajorIndexKeys:
    """FP8 keys + FP32 scales, page-major in a ``[pages, page_size * (head_dim + 4)]`` byte buffer."""

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim
        self.hadamard = hadamard_matrix(head_dim)
        self._hadamard_by_device: dict[torch.device, torch.Tensor] = {}

    def _views(self, buffer: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        key_bytes = page_size * self.head_dim
        keys = buffer[:, :key_bytes].view(buffer.shape[0], page_size, self.head_dim)
        scales = buffer[:, key_bytes:].view(torch.float32)  # [pages, page_size]
        return keys, scales

    def _rotate(self, values: torch.Tensor) -> torch.Tensor:
        matrix = self._hadamard_by_device.get(values.device)
        if matrix is None:
            matrix = self._hadamard_by_device.setdefault(values.device,
                                                         self.hadamard.to(values.device, torch.float32))
        return values.float() @ matrix

    def write(self, buffer: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, page_size: int) -> None:
        key_view, scale_view = self._views(buffer, page_size)
        quantized, scale = quantize_fp8(self._rotate(keys))
        pages, offsets = slots // page_size, slots % page_size
        key_view[pages, offsets] = quantized.view(torch.uint8)
        scale_view[pages, offsets] = scale

    def write_kernel(self, buffer: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, page_size: int) -> None:
        """:meth:`write` through the row-writer kernel: slots of -1 are skipped."""
        from tandem.kernels.token_write import write_token_rows

        key_view, scale_view = self._views(buffer, page_size)
        quantized, scale = quantize_fp8(self._rotate(keys))
        write_token_rows(quantized.view(torch.uint8), key_view, slots)
        write_token_rows(scale[:, None], scale_view[:, :, None], slots)

    def gather(self, buffer: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
        key_view, scale_view = self._views(buffer, page_size)
        keys = key_view[pages].view(FP8_DTYPE).float() * scale_view[pages].unsqueeze(-1)
        return keys.flatten(-3, -2)

    def queries(self, queries: torch.Tensor) -> torch.Tensor:
        quantized, scale = quantize_fp8(self._rotate(queries))
        return quantized.float() * scale.unsqueeze(-1)

    def decode_operands(self, buffer: torch.Tensor, page_size: int, queries: torch.Tensor) -> tuple:
        """``(queries, keys, key_scales)`` as ``index_decode_scores`` reads them (``queries`` as
        :meth:`queries` returned them): the queries in bfloat16 (e4m3 values times a power of
        two: exact), the FP8 key region and the FP32 scale region of the page-major buffer."""
        key_view, scale_view = self._views(buffer, page_size)
        return queries.to(torch.bfloat16), key_view.view(FP8_DTYPE), scale_view


class LightningIndexer(nn.Module):
    """The DSA indexer of one layer: projections, its key cache, and top-k selection."""

    def __init__(self, config, layer_name: str, rotary, *, rope_interleaved: bool, quantized: bool) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.wq_b = Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        # The head weights are computed in float32 whatever the model dtype (as the reference).
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False, dtype=torch.float32)
        self.softmax_scale = self.head_dim ** -0.5
        self.rotary = rotary
        self.rope_interleaved = rope_interleaved
        self.state_spec = IndexerSpec(self.head_dim, quantized)
        self.keys = Fp8PageMajorIndexKeys(self.head_dim) if quantized else Float32IndexKeys()

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary on the first ``rope_dim`` values of each head (x ``[T, heads, head_dim]``)."""
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        rotate = self.rotary.interleaved if self.rope_interleaved else self.rotary.half_split
        return torch.cat([rotate(rot, positions), rest], dim=-1)

    def forward(self, hidden: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor,
                context: "ForwardContext", *, use_kernels: bool = False) -> TopKSelection:
        """The step's selection: decode rows per bucket as masks or, with ``use_kernels``, all
        at once as positions (``decode_indices``; keys then written by the kernel, which skips
        padding slots); prefill chunks as masks."""
        tokens = hidden.shape[0]
        queries = self._rotate(self.wq_b(q_resid).view(tokens, self.num_heads, self.head_dim), positions)
        keys = self._rotate(self.k_norm(self.wk(hidden)).unsqueeze(1), positions).squeeze(1)
        weights = self.weights_proj(hidden.to(torch.float32)).float() * self.num_heads ** -0.5
        buffer = context.state.layer(self.layer_name)["index_key"]
        metadata: AttentionMetadata = context.attention_metadata[context.state.group_of(self.layer_name)]
        page_size = metadata.page_size
        queries = self.keys.queries(queries)
        selection = TopKSelection()
        if use_kernels:
            self.keys.write_kernel(buffer, metadata.slot_mapping, keys, page_size)
            num_decode = metadata.num_decode_tokens
            if num_decode:
                selection.decode_indices = self._decode_positions(queries[:num_decode], weights[:num_decode],
                                                                  buffer, metadata)
        else:
            self.keys.write(buffer, metadata.slot_mapping, keys, page_size)
            for bucket in metadata.decode_buckets:
                rows = slice(bucket.start, bucket.end)
                selection.decode.append(self._decode(queries[rows], weights[rows], buffer, bucket, metadata))
        for chunk in metadata.prefills:
            rows = slice(chunk.query_start, chunk.query_end)
            selection.prefills.append(self._prefill(queries[rows], weights[rows], buffer, chunk, page_size))
        return selection

    def _select(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices
        return torch.zeros_like(visible).scatter_(-1, top, True) & visible

    def _decode(self, queries, weights, buffer, bucket: DecodeBucket, metadata: AttentionMetadata) -> torch.Tensor:
        valid = bucket.valid
        keys = self.keys.gather(buffer, bucket.page_table, metadata.page_size)  # [B, L, D]
        if metadata.zero_invalid:
            keys = torch.where(valid[:, :, None], keys, 0)
        scores = index_scores(queries[:, None], weights[:, None], keys, self.softmax_scale)[:, 0]
        return self._select(scores, valid)

    def _decode_positions(self, queries, weights, buffer, metadata: AttentionMetadata) -> torch.Tensor:
        """Every decode row at once over the whole page-table width (``index_decode_scores``) →
        ``[n, k]`` int32 positions (-1 where fewer than ``k`` are visible). Shapes depend on
        shapes only (no host synchronisation)."""
        from tandem.kernels.indexer_decode import index_decode_scores

        page_table, context_lengths = metadata.decode_page_table, metadata.decode_context_lengths
        queries, keys, key_scales = self.keys.decode_operands(buffer, metadata.page_size, queries)
        scores = index_decode_scores(queries, weights, keys, key_scales, page_table, context_lengths,
                                     self.softmax_scale)
        visible = torch.arange(scores.shape[1], device=scores.device)[None, :] < context_lengths[:, None]
        return self._top_positions(scores, visible)

    def _top_positions(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The ``min(topk, width)`` best visible positions per row, -1 for picks not visible."""
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices
        return torch.where(visible.gather(1, top), top, -1).to(torch.int32)

    def _prefill(self, queries, weights, buffer, chunk, page_size: int) -> torch.Tensor:
        length, num_queries = chunk.context_length, queries.shape[0]
        keys = self.keys.gather(buffer, chunk.pages, page_size)[:length]
        scores = index_scores(queries[None], weights[None], keys[None], self.softmax_scale)[0]
        query_positions = torch.arange(length - num_queries, length, device=queries.device)
        causal = torch.arange(length, device=queries.device)[None, :] <= query_positions[:, None]
        return self._select(scores, causal)
