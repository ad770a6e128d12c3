"""Gemma 3 text models (``Gemma3ForCausalLM``, model type ``gemma3_text``).

Differences from Llama, following transformers' ``modeling_gemma3.py``:

- layers interleave local sliding-window attention and global full attention
  (``config.layer_types``); each kind has its own rope parameters (``rope_parameters`` keyed
  by layer type: a small base for local layers, a large, possibly scaled one for global ones);
- RMSNorm scales by ``1 + weight`` (computed in float32, cast after the product), on the
  input, after attention, before and after the MLP, on each query and key head, and at the end;
- the input embedding is multiplied by ``sqrt(hidden_size)`` (rounded to the weight dtype);
- attention scale ``query_pre_attn_scalar ** -0.5``; the MLP is ``gelu_pytorch_tanh``-gated;
- logits are soft-capped (``cap * tanh(logits / cap)``) when ``final_logit_softcapping`` is set.

``attn_logit_softcapping`` is read but, as in transformers' Gemma 3 (unlike Gemma 2), not
applied to the attention scores.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from tandem.kernels.activation import (gelu_and_mul, gelu_and_mul_reference, gelu_tanh_and_mul,
                                       gelu_tanh_and_mul_reference)
from tandem.kernels.norm import HeadNorm, rms_norm, rms_norm_reference
from tandem.layers.attention import Attention
from tandem.layers.linear import StackedLinear, load_by_name
from tandem.parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from tandem.parallel.shard import SINGLE, TensorShard
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.base import CausalLM
from tandem.layers.forward_context import ForwardContext

SLIDING = "sliding_attention"
FULL = "full_attention"
# hidden_activation -> gated activation ``[T, 2I] -> act(gate) * up``: (CUDA kernel, reference)
ACTIVATIONS = {"gelu_pytorch_tanh": (gelu_tanh_and_mul, gelu_tanh_and_mul_reference),
               "gelu": (gelu_and_mul, gelu_and_mul_reference)}


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` in float32, cast back to the input dtype (one kernel on
    CUDA, its bit-exact reference elsewhere)."""

    CONVENTION = dict(weight_offset=1.0, cast_before_weight=False)  # the kernels' names for (1 + weight) in float32

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """``norm(hidden)``; with ``residual``, ``(norm(hidden + residual), hidden + residual)``.
        ``hidden`` is ``[T, D]`` or ``[T, H, D]`` (per head)."""
        normalize = rms_norm if hidden.is_cuda else rms_norm_reference
        return normalize(hidden, self.weight, self.eps, residual=residual, **self.CONVENTION)

    def head_norm(self) -> HeadNorm:
        """This norm as a kernel applies it to each head of ``[T, H, D]`` itself."""
        return HeadNorm(self.weight, self.eps, **self.CONVENTION)


def layer_rope_parameters(config, layer_type: str) -> dict:
    """Rope parameters of one layer kind (transformers 5 keys them by layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:
        return dict(params[layer_type])
    # Older flat configs: ``rope_theta`` for global layers, ``rope_local_base_freq`` for local.
    flat = {key: value for key, value in params.items() if key not in (SLIDING, FULL)}
    if layer_type == SLIDING:
        return {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    flat.setdefault("rope_theta", getattr(config, "rope_theta", 1_000_000.0))
    return flat


def layer_types_of(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:
        pattern = getattr(config, "sliding_window_pattern", 6)
        types = [SLIDING if (index + 1) % pattern else FULL for index in range(config.num_hidden_layers)]
    unknown = set(types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"layer_types: {sorted(unknown)} not supported (supported: {SLIDING}, {FULL})")
    return list(types)


class Gemma3AttentionBlock(nn.Module):
    def __init__(self, config, layer_index: int, layer_type: str, state_dtype: torch.dtype,
                 rotary: RotaryEmbedding, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        # Tensor parallelism: each rank computes its share of the query and key/value heads.
        self.num_heads = shard.split(config.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = shard.split(config.num_key_value_heads, "num_key_value_heads")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        full_q, full_kv = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.qkv_proj = StackedLinear(hidden, {"q_proj": full_q, "k_proj": full_kv, "v_proj": full_kv},
                                      bias=bias, shard=shard)
        self.o_proj = RowParallelLinear(full_q, hidden, bias=bias, shard=shard)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary  # shared by every layer of this kind
        window = config.sliding_window if layer_type == SLIDING else None
        self.attn = Attention(f"model.layers.{layer_index}.self_attn", self.num_heads, self.num_kv_heads,
                              self.head_dim, config.query_pre_attn_scalar ** -0.5, state_dtype,
                              sliding_window=window)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor,
                context: ForwardContext) -> torch.Tensor:
        tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.reshape(tokens, self.num_heads, self.head_dim)
        key = key.reshape(tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(tokens, self.num_kv_heads, self.head_dim)
        # Normalised and rotated by the attention backend (on CUDA in the launch that writes the
        # keys and values).
        output = self.attn(query, key, value, context, rotary=self.rotary, positions=positions,
                           query_norm=self.q_norm, key_norm=self.k_norm)
        return self.o_proj(output.reshape(tokens, self.q_size))


class Gemma3MLP(nn.Module):
    def __init__(self, config, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if activation not in ACTIVATIONS:
            raise ValueError(f"hidden_activation: {activation!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        self.activation, self.activation_reference = ACTIVATIONS[activation]
        self.intermediate_size = shard.split(config.intermediate_size, "intermediate_size")
        self.gate_up_proj = StackedLinear(config.hidden_size, {"gate_proj": config.intermediate_size,
                                                               "up_proj": config.intermediate_size}, bias=False,
                                          shard=shard)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, shard=shard,
                                           what="intermediate_size")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)
        activate = self.activation if gate_up.is_cuda else self.activation_reference
        return self.down_proj(activate(gate_up))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int, layer_type: str, state_dtype: torch.dtype,
                 rotary: RotaryEmbedding, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3AttentionBlock(config, layer_index, layer_type, state_dtype, rotary, shard)
        self.mlp = Gemma3MLP(config, shard)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, hidden, residual, positions, context):
        """``(hidden, residual)`` in and out; the layer's output is their sum, which the next
        norm forms fused with itself. The first layer gets ``residual=None``."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        attended = self.post_attention_layernorm(self.self_attn(hidden, positions, context))
        hidden, residual = self.pre_feedforward_layernorm(attended, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3TextModel(nn.Module):
    def __init__(self, config, state_dtype: torch.dtype, max_positions: int, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        # Kept in float32 and rounded to the weight dtype at use, as transformers does
        # (bf16: sqrt(3072) -> 55.5).
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32),
                             persistent=False)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layer_types = layer_types_of(config)
        # One rope table per layer kind (different bases); buffers only, no parameters.
        self.rotary_emb = nn.ModuleDict({
            layer_type: RotaryEmbedding(head_dim, layer_rope_parameters(config, layer_type), max_positions)
            for layer_type in sorted(set(layer_types))})
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, index, layer_type, state_dtype, self.rotary_emb[layer_type], shard)
            for index, layer_type in enumerate(layer_types))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, context):
        """The last layer's output before the final norm (``compute_logits`` applies it to the
        rows it samples)."""
        hidden = self.embed_tokens(input_ids) * self.embed_scale.to(self.embed_tokens.weight.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, context)
        return hidden + residual


class Gemma3ForCausalLM(CausalLM):
    # Gemma norms scale by (1 + weight): random ("dummy") weights keep them near zero.
    dummy_norm_weight = 0.0
    engine_options = ("tensor_shard",)

    def __init__(self, config, state_dtype: torch.dtype, max_positions: int,
                 tensor_shard: TensorShard = SINGLE) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("model: Gemma 3 with use_bidirectional_attention is not supported")
        if getattr(config, "sliding_window", None) is None and SLIDING in layer_types_of(config):
            raise ValueError("model: sliding_attention layers need config.sliding_window")
        self.config = config
        self.tensor_shard = tensor_shard
        self.model = Gemma3TextModel(config, state_dtype, max_positions, tensor_shard)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tensor_shard)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name; every parameter must be covered exactly once."""
        load_by_name(self, weights, skip=lambda name: name.endswith("inv_freq") or
                     (self.tie_word_embeddings and name == "lm_head.weight"))
