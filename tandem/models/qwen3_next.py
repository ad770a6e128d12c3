"""Qwen3-Next: gated DeltaNet layers interleaved with gated full attention (``layer_types``),
MoE with a shared expert (or a dense MLP where ``mlp_only_layers`` / ``decoder_sparse_step``
say so). Parameter names follow the Hugging Face checkpoint layout.

State: full-attention layers keep paged K/V (``FullAttentionSpec``); each DeltaNet layer keeps
a recurrent slot (``RecurrentSpec``): the causal-conv window over the mixed q/k/v channels and
the delta-rule state ``[value heads, key dim, value dim]`` in float32, as transformers keeps it.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kv.spec import RecurrentSpec
from tandem.layers.attention import Attention
from tandem.layers.linear import StackedLinear, mark_sharded
from tandem.layers.mlp import GatedMLP
from tandem.layers.moe import SoftmaxMoE, load_with_experts
from tandem.layers.recurrent import chunk_gated_delta_rule, gated_delta_rule_step
from tandem.layers.recurrent_slots import RecurrentSlots
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.base import CausalLM
from tandem.models.llama import rope_parameters_of
from tandem.parallel.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from tandem.parallel.shard import SINGLE, TensorShard
from tandem.layers.forward_context import ForwardContext


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight`` (weights stored centred on 0), computed in float32."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return (hidden * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * silu(gate)``: normalised before the gate."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        hidden = self.weight * hidden.to(dtype)
        return (hidden * F.silu(gate.float())).to(dtype)


class Qwen3NextAttention(nn.Module):
    """Full attention with q/k head norms, partial rope and a sigmoid output gate per head."""

    def __init__(self, config, layer_index: int, state_dtype: torch.dtype, rotary: RotaryEmbedding,
                 rotary_dim: int, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        # Tensor parallelism: each rank computes its share of the heads (a query head's gate rows
        # sit beside it in q_proj, so a rank's consecutive rows hold both).
        self.num_heads = shard.split(config.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = shard.split(config.num_key_value_heads, "num_key_value_heads")
        self.head_dim = config.head_dim
        self.rotary_dim = rotary_dim
        bias = config.attention_bias
        self.q_size = self.num_heads * self.head_dim * 2  # query and gate, interleaved per head
        self.kv_size = self.num_kv_heads * self.head_dim
        full_kv = config.num_key_value_heads * self.head_dim
        self.qkv_proj = StackedLinear(config.hidden_size, {"q_proj": config.num_attention_heads * self.head_dim * 2,
                                                           "k_proj": full_kv, "v_proj": full_kv},
                                      bias=bias, shard=shard)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
                                        shard=shard)
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(f"model.layers.{layer_index}.self_attn", self.num_heads, self.num_kv_heads,
                              self.head_dim, self.head_dim ** -0.5, state_dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        tokens = hidden.shape[0]
        query_gate, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query, gate = query_gate.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        query = self.q_norm(query)
        key = self.k_norm(key.reshape(tokens, self.num_kv_heads, self.head_dim))
        value = value.reshape(tokens, self.num_kv_heads, self.head_dim)
        rot = self.rotary_dim
        query_rot, key_rot = self.rotary(query[..., :rot], key[..., :rot], positions)
        query = torch.cat([query_rot, query[..., rot:]], dim=-1)
        key = torch.cat([key_rot, key[..., rot:]], dim=-1)
        output = self.attn(query, key, value, context).reshape(tokens, -1)
        output = output * torch.sigmoid(gate.reshape(tokens, -1))
        return self.o_proj(output)


class Qwen3NextGatedDeltaNet(nn.Module):
    cuda_graph_safe = True  # decode rows: one batched step over device-side slots (RecurrentSlots)

    def __init__(self, config, layer_index: int, state_dtype: torch.dtype, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        # Tensor parallelism: each rank keeps its share of the key heads and of the value heads
        # (and their recurrent state: conv channels and delta-rule state of those heads only).
        # in_proj_qkvz/ba are laid out per key-head group, so a rank's rows are consecutive; the
        # conv channels are [q | k | v] of all heads, so a rank takes its slice of each.
        self.num_v_heads = shard.split(config.linear_num_value_heads, "linear_num_value_heads")
        self.num_k_heads = shard.split(config.linear_num_key_heads, "linear_num_key_heads")
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.kernel_size = config.linear_conv_kernel_dim
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size, bias=False,
                                groups=self.conv_dim, padding=self.kernel_size - 1)
        full_key = self.head_k_dim * config.linear_num_key_heads
        full_value = self.head_v_dim * config.linear_num_value_heads
        mark_sharded(self.conv1d.weight, 0, shard, (full_key, full_key, full_value))
        self.in_proj_qkvz = ColumnParallelLinear(config.hidden_size, full_key * 2 + full_value * 2, shard=shard,
                                                 what="linear_num_key_heads")
        self.in_proj_ba = ColumnParallelLinear(config.hidden_size, config.linear_num_value_heads * 2, shard=shard,
                                               what="linear_num_key_heads")
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        mark_sharded(self.dt_bias, 0, shard, config.linear_num_value_heads)
        mark_sharded(self.A_log, 0, shard, config.linear_num_value_heads)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(full_value, config.hidden_size, shard=shard,
                                          what="linear_num_value_heads")
        spec = RecurrentSpec(conv_shape=(self.conv_dim, self.kernel_size - 1), conv_dtype=state_dtype,
                             ssm_shape=(self.num_v_heads, self.head_k_dim, self.head_v_dim),
                             ssm_dtype=torch.float32)
        self.slots = RecurrentSlots(f"model.layers.{layer_index}.linear_attn", spec, self.conv1d)

    def state_specs(self) -> dict:
        return {self.slots.layer_name: self.slots.state_spec}

    def _split(self, mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor):
        """Per key-head groups [q | k | v.. | z..] and [b.. | a..] → q, k, v, z, b, a."""
        tokens = mixed_qkvz.shape[0]
        ratio = self.num_v_heads // self.num_k_heads
        qkvz = mixed_qkvz.view(tokens, self.num_k_heads, -1)
        ba = mixed_ba.view(tokens, self.num_k_heads, -1)
        query, key, value, z = torch.split(
            qkvz, [self.head_k_dim, self.head_k_dim, ratio * self.head_v_dim, ratio * self.head_v_dim], dim=-1)
        b, a = torch.split(ba, [ratio, ratio], dim=-1)
        return (query.reshape(tokens, -1), key.reshape(tokens, -1), value.reshape(tokens, -1),
                z.reshape(tokens, self.num_v_heads, self.head_v_dim),
                b.reshape(tokens, self.num_v_heads), a.reshape(tokens, self.num_v_heads))

    def _heads(self, conv_out: torch.Tensor):
        tokens = conv_out.shape[0]
        query, key, value = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (query.reshape(tokens, -1, self.head_k_dim), key.reshape(tokens, -1, self.head_k_dim),
                value.reshape(tokens, -1, self.head_v_dim))

    def _scan(self, conv_out, extras, state):
        decay, beta = extras
        query, key, value = self._heads(conv_out)
        return chunk_gated_delta_rule(query, key, value, decay, beta, state)

    def _step(self, conv_out, extras, states):
        decay, beta = extras
        query, key, value = self._heads(conv_out)
        return gated_delta_rule_step(query, key, value, decay, beta, states)

    def forward(self, hidden: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        tokens = hidden.shape[0]
        query, key, value, z, b, a = self._split(self.in_proj_qkvz(hidden), self.in_proj_ba(hidden))
        mixed_qkv = torch.cat([query, key, value], dim=-1)
        beta = b.sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = self.slots.run(mixed_qkv, (decay, beta), context, self._scan, self._step)
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(tokens, self.value_dim))


class Qwen3NextSparseMoe(SoftmaxMoE):
    """Qwen3-MoE's routed experts plus a shared expert behind a sigmoid gate."""

    def __init__(self, config, shard: TensorShard = SINGLE) -> None:
        super().__init__(config, shard)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, shard=shard)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return super().forward(hidden) + shared


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int, state_dtype: torch.dtype, rotary: RotaryEmbedding,
                 rotary_dim: int, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.is_linear = config.layer_types[layer_index] == "linear_attention"
        if self.is_linear:
            self.linear_attn = Qwen3NextGatedDeltaNet(config, layer_index, state_dtype, shard)
        else:
            self.self_attn = Qwen3NextAttention(config, layer_index, state_dtype, rotary, rotary_dim, shard)
        sparse = (layer_index not in config.mlp_only_layers and config.num_experts > 0
                  and (layer_index + 1) % config.decoder_sparse_step == 0)
        self.mlp = Qwen3NextSparseMoe(config, shard) if sparse else GatedMLP(
            config.hidden_size, config.intermediate_size, shard=shard)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, positions, context):
        normed = self.input_layernorm(hidden)
        if self.is_linear:
            hidden = hidden + self.linear_attn(normed, context)
        else:
            hidden = hidden + self.self_attn(normed, positions, context)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextModel(nn.Module):
    def __init__(self, config, state_dtype: torch.dtype, max_positions: int, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        rope = rope_parameters_of(config)
        rotary_dim = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
        self.rotary_emb = RotaryEmbedding(rotary_dim, rope, max_positions)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(config, index, state_dtype, self.rotary_emb, rotary_dim, shard)
            for index in range(config.num_hidden_layers))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, context):
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, positions, context)
        return hidden


class Qwen3NextForCausalLM(CausalLM):
    engine_options = ("tensor_shard",)

    def __init__(self, config, state_dtype: torch.dtype, max_positions: int,
                 tensor_shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tensor_shard = tensor_shard
        self.model = Qwen3NextModel(config, state_dtype, max_positions, tensor_shard)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tensor_shard)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name; multi-token-prediction weights are not used."""
        load_with_experts(self, weights, skip=lambda name: name.startswith("mtp.") or
                          (self.tie_word_embeddings and name == "lm_head.weight"))
