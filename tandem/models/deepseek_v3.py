"""DeepSeek-V3: multi-head latent attention (``layers/mla.py``) and DeepSeek-MoE
(``layers/moe.py``: grouped top-k routing, routed scaling, shared experts); the first
``first_k_dense_replace`` layers (or those ``mlp_layer_types`` marks dense) use a dense MLP.

DeepSeek-V3.2 (``deepseek_v32.py``) and GLM-5 (``glm_moe_dsa.py``) reuse these blocks with
DeepSeek sparse attention switched on through ``DeepseekOptions``.

Multi-token prediction (MTP) modules: checkpoints keep them as ``model.layers.{N + k}`` (``N``
decoder layers): a decoder block plus ``enorm``, ``hnorm``, ``eh_proj``, ``embed_tokens`` and
``shared_head``. They are loaded and kept in ``model.mtp_layers``; the target forward pass does
not run them. Speculative decoding (``tandem/spec_decode``, ``speculative_method="mtp"``) runs
the first one as a draft and registers its state (MLA latent, indexer keys) beside the
target's. A checkpoint without them loads too (the modules are then dropped).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from tandem.layers.mla import LatentRotary, MLAAttention
from tandem.layers.moe import GatedMLP, MoE, load_with_experts
from tandem.layers.norm import RMSNorm
from tandem.layers.sparse_indexer import TopKSelection
from tandem.models.base import CausalLM
from tandem.parallel.layers import ParallelLMHead, VocabParallelEmbedding
from tandem.parallel.shard import SINGLE, TensorShard
from tandem.layers.forward_context import ForwardContext


@dataclass(frozen=True)
class DeepseekOptions:
    sparse_attention: bool = False  # DSA: a lightning indexer per layer (or shared, GLM-5)
    indexer_rope_interleaved: bool = False  # GLM-5 rotates indexer heads pairwise; V3.2 half-split


def num_mtp_modules(config) -> int:
    return int(getattr(config, "num_nextn_predict_layers", None) or getattr(config, "num_mtp_layers", None) or 0)


def is_moe_layer(config, layer_index: int) -> bool:
    layer_types = getattr(config, "mlp_layer_types", None)
    if layer_types is not None and layer_index < len(layer_types):
        return layer_types[layer_index] == "sparse"
    return layer_index >= (getattr(config, "first_k_dense_replace", 0) or 0)


def indexer_kind(config, options: DeepseekOptions, layer_index: int) -> Optional[str]:
    """``"full"``, ``"shared"`` (GLM-5: reuse the previous full layer's top-k) or None."""
    if not options.sparse_attention:
        return None
    kinds = getattr(config, "indexer_types", None)
    return kinds[layer_index] if kinds is not None and layer_index < len(kinds) else "full"


class DeepseekDecoderLayer(nn.Module):
    # A dense layer's second norm is read by its MLP's gate_up_proj alone (the residual is added
    # outside it), so it may write FP8 for it (``tandem.layers.quantized_input``); an MoE layer's
    # MLP has no such projection (its router reads the norm too), and the first norm feeds MLA's
    # two down-projections: neither is linked.
    quantized_input_pairs = {"post_attention_layernorm": "mlp.gate_up_proj"}

    def __init__(self, config, layer_index: int, options: DeepseekOptions, state_dtype: torch.dtype,
                 rotary: LatentRotary, indexer_quantized: bool, *, moe: bool, indexer: Optional[str],
                 shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.self_attn = MLAAttention(config, f"model.layers.{layer_index}.self_attn", state_dtype, rotary,
                                      indexer=indexer, indexer_rope_interleaved=options.indexer_rope_interleaved,
                                      indexer_quantized=indexer_quantized, shard=shard)
        self.mlp = MoE(config, shard) if moe else GatedMLP(config.hidden_size, config.intermediate_size, shard=shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, context: ForwardContext,
                selection: Optional[TopKSelection]) -> tuple[torch.Tensor, Optional[TopKSelection]]:
        attention, selection = self.self_attn(self.input_layernorm(hidden), positions, context, selection)
        hidden = hidden + attention
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), selection


class SharedHead(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """One MTP module: ``eh_proj([enorm(embed(next token)), hnorm(hidden)])`` through a decoder
    block, then ``shared_head``. ``hidden`` is the target's output after its final norm (or, for
    a chained step, this module's own normalised output), as SGLang and vLLM feed it."""

    def __init__(self, config, layer_index: int, options: DeepseekOptions, state_dtype: torch.dtype,
                 rotary: LatentRotary, indexer_quantized: bool, shard: TensorShard = SINGLE) -> None:
        # Under tensor parallelism the decoder block is sharded as the target's are (every rank
        # runs the draft's passes); the projections, embedding and head around it are replicated.
        super().__init__(config, layer_index, options, state_dtype, rotary, indexer_quantized, moe=True,
                         indexer="full" if options.sparse_attention else None, shard=shard)
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.shared_head = SharedHead(config)

    def draft_forward(self, input_ids: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor,
                      context: ForwardContext) -> torch.Tensor:
        """Token ``t + 1`` and the hidden state at ``t`` in, the normalised hidden state at ``t``
        out (its logits predict token ``t + 2``; it is the next chained step's input)."""
        hidden = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(input_ids)),
                                         self.hnorm(previous_hidden.to(self.eh_proj.weight.dtype))], dim=-1))
        hidden, _ = super().forward(hidden, positions, context, None)
        return self.shared_head.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(hidden)


class DeepseekModel(nn.Module):
    def __init__(self, config, options: DeepseekOptions, state_dtype: torch.dtype, max_positions: int,
                 indexer_quantized: bool, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        self.rotary_emb = LatentRotary(config, max_positions)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, index, options, state_dtype, self.rotary_emb, indexer_quantized,
                                 moe=is_moe_layer(config, index), indexer=indexer_kind(config, options, index),
                                 shard=shard)
            for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mtp_layers = nn.ModuleList(
            DeepseekMTPLayer(config, config.num_hidden_layers + index, options, state_dtype, self.rotary_emb,
                             indexer_quantized, shard)
            for index in range(num_mtp_modules(config)))

    def forward(self, input_ids, positions, context):
        hidden = self.embed_tokens(input_ids)
        selection = None
        for layer in self.layers:
            hidden, selection = layer(hidden, positions, context, selection)
        return hidden


class DeepseekV3ForCausalLM(CausalLM):
    options = DeepseekOptions()
    engine_options = ("indexer_cache_dtype", "tensor_shard")

    def __init__(self, config, state_dtype: torch.dtype, max_positions: int,
                 indexer_cache_dtype: str = "fp8", tensor_shard: TensorShard = SINGLE) -> None:
        super().__init__()
        if indexer_cache_dtype not in ("fp8", "float32"):
            raise ValueError(f"indexer_cache_dtype: must be 'fp8' or 'float32', got {indexer_cache_dtype!r}")
        self.config = config
        self.tensor_shard = tensor_shard
        self.model = DeepseekModel(config, self.options, state_dtype, max_positions,
                                   indexer_quantized=indexer_cache_dtype == "fp8", shard=tensor_shard)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tensor_shard)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def next_n_layers(self) -> list:
        """The checkpoint's MTP modules (speculative decoding's draft)."""
        return list(self.model.mtp_layers)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's output after its final norm: what an MTP module reads."""
        return self.model.norm(hidden)

    def state_specs(self) -> dict:
        """Target layers only: speculative decoding registers the MTP module it runs."""
        specs = {}
        for layer in self.model.layers:
            specs.update(layer.self_attn.state_specs())
        return specs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name; every parameter must be covered exactly once.

        MTP tensors (``model.layers.{N + k}.*``) are set aside during the main pass and then
        loaded into ``model.mtp_layers[k]`` with the same strictness; with none, the MTP
        modules are dropped."""
        num_layers = self.config.num_hidden_layers
        layer_prefix = re.compile(r"^model\.layers\.(\d+)\.")
        mtp_weights: list[tuple[str, torch.Tensor]] = []

        def target_weights():
            for name, tensor in weights:
                match = layer_prefix.match(name)
                if match and int(match.group(1)) >= num_layers:
                    module = int(match.group(1)) - num_layers
                    if module < len(self.model.mtp_layers):  # modules past the config's count: not kept
                        mtp_weights.append((f"{module}.{name[match.end():]}", tensor))
                    continue
                yield name, tensor

        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        load_with_experts(self, target_weights(), skip=lambda name: name.endswith("rotary_emb.inv_freq") or
                          (tied and name == "lm_head.weight") or name.startswith("model.mtp_layers."))
        if mtp_weights:
            load_with_experts(self.model.mtp_layers, mtp_weights)
        else:
            self.model.mtp_layers = nn.ModuleList()
