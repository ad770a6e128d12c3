"""NemotronH: a stack of single-mixer blocks (``layers_block_type``): Mamba-2, attention (no
rope), squared-ReLU MLP and MoE (sigmoid router, non-gated experts, a shared expert). Parameter
names follow the Hugging Face checkpoint layout.

State: attention layers keep paged K/V (``FullAttentionSpec``); each Mamba-2 layer keeps a
recurrent slot (``RecurrentSpec``): the causal-conv window over x/B/C and the SSM state
``[heads, head dim, state size]`` in float32 (the checkpoints' ``mamba_ssm_cache_dtype``).

Tensor parallelism: a rank keeps its share of the attention heads, of the Mamba-2 heads and
groups (with their conv channels and SSM state), of every MLP's and expert's intermediate, and
of the vocabulary; the routers, the norms between blocks and MoE latent projections are whole
on every rank.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kv.spec import RecurrentSpec
from tandem.layers.attention import Attention
from tandem.layers.linear import StackedLinear, mark_sharded
from tandem.layers.moe import FusedExperts, load_with_experts
from tandem.layers.norm import RMSNorm
from tandem.layers.recurrent import mamba2_chunk_scan, mamba2_step
from tandem.layers.recurrent_slots import RecurrentSlots
from tandem.models.base import CausalLM
from tandem.parallel.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from tandem.parallel.shard import SINGLE, TensorShard
from tandem.layers.forward_context import ForwardContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class GroupedGatedRMSNorm(nn.Module):
    """``weight * rmsnorm_per_group(x * silu(gate))``: gated before normalising, per group."""

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        hidden = x.float() * F.silu(gate.float())
        grouped = hidden.view(*hidden.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view(hidden.shape).to(dtype)


class FloatRMSNorm(RMSNorm):
    """RMSNorm with the weight product in float32, cast back after it."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * hidden).to(dtype)


class NemotronHMamba2Mixer(nn.Module):
    cuda_graph_safe = True  # decode rows: one batched step over device-side slots (RecurrentSlots)

    def __init__(self, config, layer_index: int, state_dtype: torch.dtype, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        # Tensor parallelism: a rank keeps its share of the heads and of the groups (B and C);
        # in_proj's rows [gate | x | B | C | dt] and the conv channels [x | B | C] are each
        # split by rank, so a rank's heads read its own groups (heads per group unchanged).
        self.num_heads = shard.split(config.mamba_num_heads, "mamba_num_heads")
        self.head_dim = config.mamba_head_dim
        self.ssm_state_size = config.ssm_state_size
        self.n_groups = shard.split(config.n_groups, "n_groups")
        self.chunk_size = config.chunk_size
        self.intermediate_size = self.num_heads * self.head_dim
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.ssm_state_size
        self.time_step_limit = (config.time_step_min, float("inf"))
        full_heads = config.mamba_num_heads
        full_inner = full_heads * self.head_dim
        full_groups = config.n_groups * self.ssm_state_size
        kernel = config.conv_kernel
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, bias=config.use_conv_bias,
                                groups=self.conv_dim, padding=kernel - 1)
        mark_sharded(self.conv1d.weight, 0, shard, (full_inner, full_groups, full_groups))
        if config.use_conv_bias:
            mark_sharded(self.conv1d.bias, 0, shard, (full_inner, full_groups, full_groups))
        self.in_proj = ColumnParallelLinear(config.hidden_size, 2 * full_inner + 2 * full_groups + full_heads,
                                            bias=config.use_bias, shard=shard, what="mamba_num_heads and n_groups",
                                            segments=(full_inner, full_inner, full_groups, full_groups, full_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        for per_head in (self.dt_bias, self.A_log, self.D):
            mark_sharded(per_head, 0, shard, full_heads)
        self.norm = GroupedGatedRMSNorm(self.intermediate_size, full_inner // config.n_groups,
                                        config.layer_norm_epsilon)
        mark_sharded(self.norm.weight, 0, shard, full_inner)
        self.out_proj = RowParallelLinear(full_inner, config.hidden_size, bias=config.use_bias, shard=shard,
                                          what="mamba_num_heads")
        ssm_dtype = DTYPES.get(str(getattr(config, "mamba_ssm_cache_dtype", "float32")), torch.float32)
        spec = RecurrentSpec(conv_shape=(self.conv_dim, kernel - 1), conv_dtype=state_dtype,
                             ssm_shape=(self.num_heads, self.head_dim, self.ssm_state_size), ssm_dtype=ssm_dtype)
        self.slots = RecurrentSlots(f"model.layers.{layer_index}.mixer", spec, self.conv1d)

    def state_specs(self) -> dict:
        return {self.slots.layer_name: self.slots.state_spec}

    def _split(self, conv_out: torch.Tensor):
        tokens = conv_out.shape[0]
        groups_size = self.n_groups * self.ssm_state_size
        hidden, B, C = torch.split(conv_out, [self.intermediate_size, groups_size, groups_size], dim=-1)
        return (hidden.reshape(tokens, self.num_heads, self.head_dim),
                B.reshape(tokens, self.n_groups, self.ssm_state_size),
                C.reshape(tokens, self.n_groups, self.ssm_state_size))

    def _scan(self, conv_out, extras, state):
        (dt,) = extras
        hidden, B, C = self._split(conv_out)
        A = -torch.exp(self.A_log.float())
        return mamba2_chunk_scan(hidden, dt, A, B, C, self.D, self.dt_bias, state, self.chunk_size,
                                 self.time_step_limit)

    def _step(self, conv_out, extras, states):
        (dt,) = extras
        hidden, B, C = self._split(conv_out)
        A = -torch.exp(self.A_log.float())
        return mamba2_step(hidden, dt, A, B, C, self.D, self.dt_bias, states)

    def forward(self, hidden: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        dtype = hidden.dtype
        gate, xBC, dt = self.in_proj(hidden).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        scan_output = self.slots.run(xBC, (dt,), context, self._scan, self._step)
        scan_output = self.norm(scan_output.reshape(hidden.shape[0], -1), gate)
        return self.out_proj(scan_output.to(dtype))


class NemotronHAttention(nn.Module):
    """Causal attention without positional encoding (the Mamba layers carry position)."""

    def __init__(self, config, layer_index: int, state_dtype: torch.dtype, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.num_heads = shard.split(config.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = shard.split(config.num_key_value_heads, "num_key_value_heads")
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        full_q, full_kv = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.qkv_proj = StackedLinear(config.hidden_size, {"q_proj": full_q, "k_proj": full_kv, "v_proj": full_kv},
                                      bias=False, shard=shard)
        self.o_proj = RowParallelLinear(full_q, config.hidden_size, bias=False, shard=shard)
        self.attn = Attention(f"model.layers.{layer_index}.mixer", self.num_heads, self.num_kv_heads,
                              self.head_dim, self.head_dim ** -0.5, state_dtype)

    def forward(self, hidden: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        output = self.attn(query.reshape(tokens, self.num_heads, self.head_dim),
                           key.reshape(tokens, self.num_kv_heads, self.head_dim),
                           value.reshape(tokens, self.num_kv_heads, self.head_dim), context)
        return self.o_proj(output.reshape(tokens, self.q_size))


class NemotronHMLP(nn.Module):
    def __init__(self, config, intermediate_size: int, shard: TensorShard = SINGLE,
                 what: str = "intermediate_size") -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(config.hidden_size, intermediate_size, bias=config.mlp_bias, shard=shard,
                                            what=what)
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, bias=config.mlp_bias, shard=shard,
                                           what=what)

    def forward(self, hidden: torch.Tensor, context: ForwardContext = None) -> torch.Tensor:
        return self.down_proj(relu_squared(self.up_proj(hidden)))


class NemotronHRouter(nn.Module):
    """Sigmoid scores; top-k among the best groups by (scores + correction bias); weights are
    the plain scores of the chosen experts, normalised and scaled."""

    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.num_groups = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        # A buffer in transformers, stored in checkpoints; loaded by name, never trained.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, hidden: torch.Tensor):
        scores = F.linear(hidden.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        group_scores = choice.view(-1, self.num_groups, self.num_experts // self.num_groups).topk(2, dim=-1)[0].sum(-1)
        group_index = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_index, 1)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, self.num_groups, self.num_experts // self.num_groups)
        choice = choice.masked_fill(~expert_mask.reshape(-1, self.num_experts).bool(), float("-inf"))
        experts = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts


class NemotronHMoE(nn.Module):
    def __init__(self, config, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        latent = getattr(config, "moe_latent_size", None)
        self.gate = NemotronHRouter(config)
        # Non-gated squared-ReLU experts whose weighted sum adds in float32 (the routing
        # weights' dtype); checkpoints name them per expert (``experts.{e}.up_proj`` ...).
        self.experts = FusedExperts(config.n_routed_experts, latent or config.hidden_size,
                                    config.moe_intermediate_size, activation="relu2",
                                    accumulate_dtype=torch.float32, shard=shard)
        self.shared_experts = NemotronHMLP(config, config.moe_shared_expert_intermediate_size, shard,
                                           "moe_shared_expert_intermediate_size")
        if latent is not None:
            self.fc1_latent_proj = nn.Linear(config.hidden_size, latent, bias=config.mlp_bias)
            self.fc2_latent_proj = nn.Linear(latent, config.hidden_size, bias=config.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, hidden: torch.Tensor, context: ForwardContext = None) -> torch.Tensor:
        weights, experts = self.gate(hidden)
        routed = hidden if self.fc1_latent_proj is None else self.fc1_latent_proj(hidden)
        routed = self.experts(routed, experts, weights)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(hidden)


class NemotronHBlock(nn.Module):
    def __init__(self, config, layer_index: int, state_dtype: torch.dtype, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        block_type = config.layers_block_type[layer_index]
        self.norm = FloatRMSNorm(config.hidden_size, config.layer_norm_epsilon)
        if block_type == "linear_attention":
            self.mixer = NemotronHMamba2Mixer(config, layer_index, state_dtype, shard)
        elif block_type == "full_attention":
            self.mixer = NemotronHAttention(config, layer_index, state_dtype, shard)
        elif block_type == "moe":
            self.mixer = NemotronHMoE(config, shard)
        elif block_type == "mlp":
            self.mixer = NemotronHMLP(config, config.intermediate_size, shard)
        else:
            raise ValueError(f"model: NemotronH block type {block_type!r} is not supported")

    def forward(self, hidden, context):
        return hidden + self.mixer(self.norm(hidden), context)


class NemotronHModel(nn.Module):
    def __init__(self, config, state_dtype: torch.dtype, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        self.layers = nn.ModuleList(NemotronHBlock(config, index, state_dtype, shard)
                                    for index in range(len(config.layers_block_type)))
        self.norm_f = FloatRMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids, positions, context):
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, context)
        return hidden


class NemotronHForCausalLM(CausalLM):
    final_norm_name = "norm_f"
    engine_options = ("tensor_shard",)

    def __init__(self, config, state_dtype: torch.dtype, max_positions: int,
                 tensor_shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tensor_shard = tensor_shard
        self.model = NemotronHModel(config, state_dtype, tensor_shard)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tensor_shard)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embeddings.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name (``backbone.`` as the checkpoints name the
        ``model.`` prefix); multi-token-prediction weights are not used."""
        renamed = (("model." + name[len("backbone."):] if name.startswith("backbone.") else name, tensor)
                   for name, tensor in weights)
        load_with_experts(self, renamed, skip=lambda name: name.startswith("mtp.") or
                          (self.tie_word_embeddings and name == "lm_head.weight"))
