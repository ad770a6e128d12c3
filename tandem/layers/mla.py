"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache.

Per token the cache keeps one row of ``kv_lora_rank + rope_dim`` values (``MLASpec``):

    | c = kv_a_layernorm(latent)  (kv_lora_rank) | k_rope, rotated (rope_dim) |

Every head's key is ``[W_uk[h] c, k_rope]`` and its value ``W_uv[h] c``, where ``kv_b_proj``'s
weight viewed ``[heads, qk_nope_head_dim + v_head_dim, kv_lora_rank]`` holds ``W_uk`` then
``W_uv``. Decode tokens attend in latent space (``W_uk`` absorbed into the query, ``W_uv``
applied after the weighted sum: ``kv_lora_rank + rope_dim`` values read per past token);
prefill chunks expand their context's latents into keys and values. Both read the latents only
through ``context.state.layer(name)`` (I3).

With DeepSeek sparse attention, a ``TopKSelection`` from the lightning indexer
(``layers/sparse_indexer.py``) further restricts which past tokens each query attends to.

Two backends: ``TorchMLABackend`` (plain PyTorch, per decode bucket and prefill chunk; the CPU
path) and ``TritonMLABackend`` (CUDA: one absorbed-latent kernel launch for every decode row,
the indexer's decode top-k as positions; prefill chunks as in PyTorch).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kv.spec import MLASpec
from tandem.layers.attention import write_slots
from tandem.layers.attention_metadata import AttentionMetadata
from tandem.layers.linear import Linear
from tandem.layers.norm import RMSNorm
from tandem.layers.sparse_indexer import LightningIndexer, TopKSelection
from tandem.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tandem.parallel.shard import SINGLE, TensorShard

if TYPE_CHECKING:
    from tandem.layers.forward_context import ForwardContext


def rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default") or "default")
    return params


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config) -> float:
    """``1/sqrt(qk_head_dim)``, times ``mscale(factor, mscale_all_dim)**2`` under YaRN scaling."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        mscale = yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


class LatentRotary(nn.Module):
    """Rotary tables for the ``qk_rope_head_dim`` part of MLA heads and indexer heads.

    ``interleaved`` rotates pairs ``(x0, x1), (x2, x3), ...`` and returns the rotated evens then
    the rotated odds (the layout the reference uses, identical for queries and keys);
    ``half_split`` rotates ``(x_i, x_{i + d/2})`` pairs. Tables are indexed by absolute position.
    """

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        dim = config.qk_rope_head_dim
        params = rope_parameters(config)
        if params["rope_type"] == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            attention_scaling = 1.0
        elif params["rope_type"] in ("dynamic", "longrope"):
            raise ValueError(f"rope_parameters.rope_type: {params['rope_type']!r} is not supported for MLA")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        self.register_buffer("cos_half", freqs.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin_half", freqs.sin() * attention_scaling, persistent=False)

    def interleaved(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x ``[T, heads, dim]``."""
        cos = self.cos_half[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin_half[positions].unsqueeze(1).to(x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)

    def half_split(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x ``[T, heads, dim]``."""
        cos = self.cos_half[positions].unsqueeze(1)
        sin = self.sin_half[positions].unsqueeze(1)
        cos, sin = torch.cat([cos, cos], dim=-1).to(x.dtype), torch.cat([sin, sin], dim=-1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class TorchMLABackend:
    """MLA over the paged latent cache in plain PyTorch (CPU and CUDA).

    Slots past a sequence's length may hold NaN poison in sanitizer mode; decode zeroes them
    before the product (a NaN inside the valid region still propagates and fails loudly).
    Reads the indexer's selection as per-bucket masks (``TopKSelection.decode``).
    """

    uses_kernels = False  # the indexer feeding it runs in plain PyTorch too

    def forward(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                cache: torch.Tensor, metadata: AttentionMetadata, kv_b_weight: torch.Tensor,
                scale: float, selection: Optional[TopKSelection]) -> torch.Tensor:
        """q_nope ``[T, H, dn]``, q_rope ``[T, H, dr]``, latent ``[T, r + dr]`` (written at
        ``slot_mapping``), kv_b_weight ``[H, dn + dv, r]`` → ``[T, H, dv]``."""
        write_slots(cache, metadata.slot_mapping, latent.to(cache.dtype))
        num_heads, head_size, rank = kv_b_weight.shape
        value_dim = head_size - q_nope.shape[-1]
        output = q_nope.new_empty(q_nope.shape[0], num_heads, value_dim)
        for index, bucket in enumerate(metadata.decode_buckets):
            rows = slice(bucket.start, bucket.end)
            output[rows] = self._decode(q_nope[rows], q_rope[rows], cache, bucket, metadata.zero_invalid,
                                        kv_b_weight, scale, selection.decode[index] if selection else None)
        return self._prefills(output, q_nope, q_rope, cache, metadata, kv_b_weight, scale, selection)

    def _prefills(self, output, q_nope, q_rope, cache, metadata, kv_b_weight, scale, selection):
        """Each prefill chunk's rows of ``output`` (eager on every backend); returns ``output``."""
        for index, chunk in enumerate(metadata.prefills):
            rows = slice(chunk.query_start, chunk.query_end)
            output[rows] = self._prefill(q_nope[rows], q_rope[rows], cache, chunk, kv_b_weight, scale,
                                         selection.prefills[index] if selection else None)
        return output

    @staticmethod
    def _decode(q_nope, q_rope, cache, bucket, zero_invalid, kv_b_weight, scale, selected):
        table = bucket.page_table
        batch, num_pages = table.shape
        page_size, width = cache.shape[1:]
        rank, nope_dim = kv_b_weight.shape[-1], q_nope.shape[-1]
        valid = bucket.valid
        latents = cache[table].view(batch, num_pages * page_size, width)
        if zero_invalid:
            latents = torch.where(valid[:, :, None], latents, 0)
        latents = latents.to(q_nope.dtype)
        compressed, key_rope = latents[..., :rank], latents[..., rank:]
        query_latent = torch.einsum("bhd,hdr->bhr", q_nope, kv_b_weight[:, :nope_dim])
        scores = (query_latent @ compressed.transpose(1, 2) + q_rope @ key_rope.transpose(1, 2)) * scale
        mask = valid if selected is None else valid & selected
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q_nope.dtype)
        return torch.einsum("bhr,hvr->bhv", probs @ compressed, kv_b_weight[:, nope_dim:])

    @staticmethod
    def _prefill(q_nope, q_rope, cache, chunk, kv_b_weight, scale, selected):
        width = cache.shape[-1]
        num_heads, head_size, rank = kv_b_weight.shape
        nope_dim, rope_dim = q_nope.shape[-1], q_rope.shape[-1]
        length, num_queries = chunk.context_length, q_nope.shape[0]
        latents = cache[chunk.pages].view(-1, width)[:length].to(q_nope.dtype)
        expanded = F.linear(latents[:, :rank], kv_b_weight.reshape(-1, rank)).view(length, num_heads, head_size)
        key_rope = latents[:, None, rank:].expand(length, num_heads, rope_dim)
        keys = torch.cat([expanded[..., :nope_dim], key_rope], dim=-1)
        values = expanded[..., nope_dim:]
        queries = torch.cat([q_nope, q_rope], dim=-1)
        query_positions = torch.arange(length - num_queries, length, device=q_nope.device)
        mask = torch.arange(length, device=q_nope.device)[None, :] <= query_positions[:, None]
        if selected is not None:
            mask = mask & selected
        out = F.scaled_dot_product_attention(queries.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                             values.transpose(0, 1)[None], attn_mask=mask[None, None],
                                             scale=scale)
        return out[0].transpose(0, 1)


class TritonMLABackend(TorchMLABackend):
    """MLA with the Triton kernels (CUDA): the step's latents written by the row writer (slots of
    -1, CUDA-graph padding, skipped), every decode row in one absorbed-latent launch
    (``kernels/mla_decode.py``; with DSA over ``TopKSelection.decode_indices``), prefill chunks
    as ``TorchMLABackend``. The decode path has no host synchronisation."""

    uses_kernels = True  # the indexer feeding it selects decode positions with its kernels

    def forward(self, q_nope, q_rope, latent, cache, metadata, kv_b_weight, scale, selection):
        from tandem.kernels.token_write import write_token_rows

        write_token_rows(latent, cache, metadata.slot_mapping)
        num_heads, head_size, rank = kv_b_weight.shape
        output = q_nope.new_empty(q_nope.shape[0], num_heads, head_size - q_nope.shape[-1])
        num_decode = metadata.num_decode_tokens
        if num_decode:
            output[:num_decode] = self._decode_rows(q_nope[:num_decode], q_rope[:num_decode], cache, metadata,
                                                    kv_b_weight, scale, selection)
        return self._prefills(output, q_nope, q_rope, cache, metadata, kv_b_weight, scale, selection)

    @staticmethod
    def _decode_rows(q_nope, q_rope, cache, metadata, kv_b_weight, scale, selection):
        """Decode rows ``[n, H, dn]`` → ``[n, H, dv]``: ``W_uk`` absorbed into the queries, the
        kernel's weighted latents expanded by ``W_uv``."""
        from tandem.kernels.mla_decode import mla_decode_attention

        if selection is not None and selection.decode_indices is None:
            raise ValueError("TritonMLABackend: the top-k selection carries no decode positions")
        nope_dim = q_nope.shape[-1]
        q_latent = torch.einsum("bhd,hdr->bhr", q_nope, kv_b_weight[:, :nope_dim])
        latents = mla_decode_attention(q_latent, q_rope, cache, metadata.decode_page_table,
                                       metadata.decode_context_lengths, scale,
                                       topk_indices=None if selection is None else selection.decode_indices)
        return torch.einsum("bhr,hvr->bhv", latents, kv_b_weight[:, nope_dim:])


def default_mla_backend(device: torch.device) -> TorchMLABackend:
    """Triton kernels on CUDA; plain PyTorch elsewhere."""
    return TritonMLABackend() if device.type == "cuda" else TorchMLABackend()


class MLAAttention(nn.Module):
    """DeepSeek-V3 attention block: projections, rotary, latent cache, optional DSA indexer.

    ``indexer`` is ``"full"`` (this layer runs a lightning indexer), ``"shared"`` (it reuses the
    selection of the previous full layer, GLM-5) or None (dense attention). Parameter names
    follow the Hugging Face checkpoints (``self_attn.q_a_proj``, ``self_attn.indexer.wk``, ...).

    Under tensor parallelism each rank computes its share of the heads (q / q_b, kv_b and o
    projections split by head); the latent cache, the low-rank down projections and the indexer
    (its key cache included) are replicated: every rank writes and reads the same latents.
    """

    # On CUDA the decode rows run through the kernels (latent writes, absorbed decode, the
    # indexer's scoring and top-k as positions): tensor operations with shapes from shapes only.
    cuda_graph_safe = True

    def __init__(self, config, layer_name: str, state_dtype: torch.dtype, rotary: LatentRotary, *,
                 indexer: Optional[str] = None, indexer_rope_interleaved: bool = False,
                 indexer_quantized: bool = True, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = shard.split(config.num_attention_heads, "num_attention_heads")
        full_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.value_dim = config.v_head_dim
        self.rank = config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        head_size = self.nope_dim + self.rope_dim
        by_head = dict(shard=shard, what="num_attention_heads")
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, full_heads * head_size, **by_head)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, full_heads * head_size, **by_head)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank)
        self.kv_b_proj = ColumnParallelLinear(self.rank, full_heads * (self.nope_dim + self.value_dim), **by_head)
        # Read as a matrix by the absorbed attention (never through its product): an FP8
        # checkpoint's kv_b_proj is dequantized once at load.
        self.kv_b_proj.quantizable = False
        self.o_proj = RowParallelLinear(full_heads * self.value_dim, hidden, bias=bias, **by_head)
        self.rope_interleave = bool(getattr(config, "rope_interleave", True))
        self.scale = softmax_scale(config)
        self.rotary = rotary  # shared by every layer (one table per model)
        self.shares_selection = indexer == "shared"
        if indexer == "full":
            if self.q_lora_rank is None:
                raise ValueError("model: the sparse-attention indexer needs q_lora_rank")
            self.indexer = LightningIndexer(config, f"{layer_name}.indexer", rotary,
                                            rope_interleaved=indexer_rope_interleaved,
                                            quantized=indexer_quantized)
        else:
            self.indexer = None
        self.state_spec = MLASpec(self.rank, self.rope_dim, state_dtype)
        self.backend: Optional[TorchMLABackend] = None  # None: default_mla_backend(device) on first use

    def state_specs(self) -> dict:
        specs = {self.layer_name: self.state_spec}
        if self.indexer is not None:
            specs[self.indexer.layer_name] = self.indexer.state_spec
        return specs

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.rotary.interleaved(x, positions) if self.rope_interleave else self.rotary.half_split(x, positions)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, context: "ForwardContext",
                selection: Optional[TopKSelection] = None) -> tuple[torch.Tensor, Optional[TopKSelection]]:
        """hidden ``[T, H]`` → (output ``[T, H]``, the top-k selection later shared layers reuse)."""
        tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q_resid, query = None, self.q_proj(hidden)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
            query = self.q_b_proj(q_resid)
        query = query.view(tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = query.split([self.nope_dim, self.rope_dim], dim=-1)
        compressed, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope_dim], dim=-1)
        compressed = self.kv_a_layernorm(compressed)
        q_rope = self._rotate(q_rope, positions)
        k_rope = self._rotate(k_rope.unsqueeze(1), positions).squeeze(1)
        if self.backend is None:
            self.backend = default_mla_backend(hidden.device)
        if self.indexer is not None:
            selection = self.indexer(hidden, q_resid, positions, context, use_kernels=self.backend.uses_kernels)
        elif self.shares_selection and selection is None:
            raise ValueError(f"{self.layer_name}: a layer that shares top-k indices follows no indexer layer")
        elif not self.shares_selection:
            selection = None
        cache = context.state.layer(self.layer_name)["latent"]
        metadata = context.attention_metadata[context.state.group_of(self.layer_name)]
        kv_b_weight = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.value_dim, self.rank)
        output = self.backend.forward(q_nope, q_rope, torch.cat([compressed, k_rope], dim=-1), cache,
                                      metadata, kv_b_weight, self.scale, selection)
        return self.o_proj(output.reshape(tokens, self.num_heads * self.value_dim)), selection
