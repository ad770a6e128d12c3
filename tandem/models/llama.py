"""Llama (incl. Llama-3.1 rope scaling). Parameter names follow the Hugging Face checkpoint
layout so weights load by name. Qwen2 and Qwen3 reuse these blocks with their differences
switched on through ``LlamaOptions``; Qwen3-MoE also swaps the decoder layer's MLP
(``LlamaDecoderLayer.make_mlp``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from tandem.layers.attention import Attention
from tandem.layers.linear import StackedLinear, load_by_name
from tandem.layers.mlp import GatedMLP
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.base import CausalLM
from tandem.parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from tandem.parallel.shard import SINGLE, TensorShard
from tandem.layers.forward_context import ForwardContext


@dataclass(frozen=True)
class LlamaOptions:
    qkv_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def rope_parameters_of(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class LlamaAttentionBlock(nn.Module):
    def __init__(self, config, layer_index: int, options: LlamaOptions, state_dtype: torch.dtype,
                 rotary: RotaryEmbedding, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        # Tensor parallelism: each rank computes its share of the query and key/value heads; with
        # fewer key/value heads than ranks, each is replicated on ``kv_replicas`` ranks (one head a rank).
        kv_replicas = shard.replicas(num_kv_heads)
        self.num_heads = shard.split(num_heads, "num_attention_heads")
        self.num_kv_heads = shard.split(num_kv_heads * kv_replicas, "num_key_value_heads")
        bias = options.qkv_bias or getattr(config, "attention_bias", False)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = StackedLinear(hidden, {"q_proj": num_heads * self.head_dim,
                                               "k_proj": num_kv_heads * self.head_dim,
                                               "v_proj": num_kv_heads * self.head_dim}, bias=bias, shard=shard,
                                      replicas={"k_proj": kv_replicas, "v_proj": kv_replicas})
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden,
                                        bias=options.output_bias or getattr(config, "attention_bias", False),
                                        shard=shard)
        self.qk_norm = options.qk_norm
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary  # shared by every layer (one table per model)
        self.attn = Attention(f"model.layers.{layer_index}.self_attn", self.num_heads,
                              self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, state_dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, context: ForwardContext,
                reduce: bool = True) -> torch.Tensor:
        """The block's output; with ``reduce=False`` this rank's partial sum of it (the output
        projection's sum over ranks is left to the caller)."""
        tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.reshape(tokens, self.num_heads, self.head_dim)
        key = key.reshape(tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(tokens, self.num_kv_heads, self.head_dim)
        # Normalised (Qwen3's per-head q/k norms: RMSNorm, whose head_norm a kernel applies)
        # and rotated by the attention backend (on CUDA in the launch that writes the keys and values).
        norms = {"query_norm": self.q_norm, "key_norm": self.k_norm} if self.qk_norm else {}
        output = self.attn(query, key, value, context, rotary=self.rotary, positions=positions, **norms)
        return self.o_proj(output.reshape(tokens, self.num_heads * self.head_dim), reduce=reduce)


class LlamaDecoderLayer(nn.Module):
    # Each norm's output is read by one projection alone (the residual is the norm's other
    # output); a pair whose consumer is absent (an MoE layer's MLP) is not linked.
    quantized_input_pairs = {"input_layernorm": "self_attn.qkv_proj",
                             "post_attention_layernorm": "mlp.gate_up_proj"}

    def __init__(self, config, layer_index: int, options: LlamaOptions, state_dtype: torch.dtype,
                 rotary: RotaryEmbedding, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.self_attn = LlamaAttentionBlock(config, layer_index, options, state_dtype, rotary, shard)
        self.mlp = self.make_mlp(config, layer_index, options, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Under tensor parallelism the attention and MLP outputs may stay partial sums, summed
        # by the norm after them (one kernel with the add and the norm on the peer path).
        # ``LlamaModel`` sets ``deferred`` to the shard when every layer can, else None.
        self.can_defer = (shard.is_parallel and self.self_attn.o_proj.bias is None
                          and getattr(self.mlp, "defers_reduction", False))
        self.deferred = None

    def make_mlp(self, config, layer_index: int, options: LlamaOptions, shard: TensorShard) -> nn.Module:
        """The feed-forward block of layer ``layer_index`` (``hidden -> hidden``); families with
        sparse layers override it."""
        return GatedMLP(config.hidden_size, config.intermediate_size,
                        bias=options.mlp_bias or getattr(config, "mlp_bias", False), shard=shard)

    def forward(self, hidden, residual, positions, context):
        """``(hidden, residual)`` in and out; the layer's output is their sum, which the next
        norm forms fused with itself. The first layer gets ``residual=None`` (and a whole
        ``hidden``); with ``deferred`` set, the ``hidden`` a layer gets from the one before and
        the one it returns are this rank's partial sums."""
        deferred = self.deferred
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual, reduce_over=deferred)
        hidden = self.self_attn(hidden, positions, context, reduce=deferred is None)
        hidden, residual = self.post_attention_layernorm(hidden, residual, reduce_over=deferred)
        if deferred is None:
            return self.mlp(hidden), residual
        return self.mlp(hidden, reduce=False), residual


class LlamaModel(nn.Module):
    def __init__(self, config, options: LlamaOptions, state_dtype: torch.dtype, max_positions: int,
                 shard: TensorShard = SINGLE, decoder_layer: type = LlamaDecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(head_dim, rope_parameters_of(config), max_positions)
        self.layers = nn.ModuleList(
            decoder_layer(config, index, options, state_dtype, self.rotary_emb, shard)
            for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.deferred = shard if self.layers and all(layer.can_defer for layer in self.layers) else None
        for layer in self.layers:
            layer.deferred = self.deferred

    def forward(self, input_ids, positions, context):
        """The last layer's output before the final norm (``compute_logits`` applies it to the
        rows it samples)."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, context)
        if self.deferred is not None:  # the last layer's MLP output is still a partial sum
            hidden = self.deferred.all_reduce(hidden)
        return hidden + residual


class LlamaForCausalLM(CausalLM):
    options = LlamaOptions()
    decoder_layer = LlamaDecoderLayer
    engine_options = ("tensor_shard",)

    def __init__(self, config, state_dtype: torch.dtype, max_positions: int,
                 tensor_shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tensor_shard = tensor_shard
        self.model = LlamaModel(config, self.options, state_dtype, max_positions, tensor_shard, self.decoder_layer)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tensor_shard)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name; every parameter must be covered exactly once."""
        load_by_name(self, weights, skip=lambda name: name.endswith("rotary_emb.inv_freq") or
                     (self.tie_word_embeddings and name == "lm_head.weight"))
