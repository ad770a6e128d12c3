"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (RMSNorm on each query and
key head before rope) with softmax-routed experts (``layers/moe.py``: ``SoftmaxMoE``, no shared
expert) in place of the MLP.

Which layers are sparse, as the checkpoint's config says and transformers decides it: layer
``i`` is an MoE layer when ``i`` is not in ``mlp_only_layers``, ``num_experts > 0`` and
``(i + 1) % decoder_sparse_step == 0``; the others keep a dense MLP of ``intermediate_size``.

Under tensor parallelism attention shards by heads (as Qwen3; key/value heads fewer than the
ranks, 4 in the released models, are replicated), each expert by its intermediate size
(``FusedExperts``, as DeepSeek-V3's routed experts), and the router is replicated.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tandem.layers.moe import SoftmaxMoE, load_with_experts
from tandem.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaOptions
from tandem.parallel.shard import SINGLE, TensorShard


def is_sparse_layer(config, layer_index: int) -> bool:
    """transformers' rule (``Qwen3MoeDecoderLayer``) for an MoE layer."""
    return (layer_index not in (config.mlp_only_layers or ())
            and config.num_experts > 0 and (layer_index + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_index: int, options: LlamaOptions, shard: TensorShard) -> nn.Module:
        if is_sparse_layer(config, layer_index):
            return SoftmaxMoE(config, shard)
        return super().make_mlp(config, layer_index, options, shard)


def check_config(config) -> None:
    """Refuse what this implementation would otherwise compute differently from the checkpoint."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: Qwen3MoeForCausalLM supports 'silu', got {config.hidden_act!r}")
    if config.decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step: must be at least 1, got {config.decoder_sparse_step}")


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    options = LlamaOptions(qk_norm=True)
    decoder_layer = Qwen3MoeDecoderLayer

    def __init__(self, config, state_dtype: torch.dtype, max_positions: int,
                 tensor_shard: TensorShard = SINGLE) -> None:
        check_config(config)
        super().__init__(config, state_dtype, max_positions, tensor_shard)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name (experts per expert or fused); every parameter
        must be covered exactly once."""
        load_with_experts(self, weights, skip=lambda name: name.endswith("rotary_emb.inv_freq") or
                          (self.tie_word_embeddings and name == "lm_head.weight"))
