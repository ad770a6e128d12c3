"""Which producers write their output already quantized for an FP8 projection
(``tandem/layers/quantized_input.py``, linked by ``tandem/quantization/input_links.py``), and in
which layout per token count. Models are built on the meta device (no weights); the fused
kernels themselves are compared with the unfused path in ``tests/kernels/test_kernels_fp8_fused.py``
and the engine's outputs, fused against unfused, in ``tests/gpu/test_gpu_fp8.py``."""
from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig, Qwen3MoeConfig

from tandem.kernels.fp8_gemm import PER_TOKEN_LAYOUT
from tandem.kernels.fp8_activation import ActivationLayout, quantize_reference
from tandem.kernels.fp8_weight_only import MAX_TOKENS
from tandem.models.deepseek_v3 import DeepseekV3ForCausalLM
from tandem.models.llama import LlamaForCausalLM
from tandem.models.qwen3_moe import Qwen3MoeForCausalLM
from tandem.quantization.config import QuantizationConfig
from tandem.quantization.convert import convert_model, plan_conversion

CUDA_DEVICE = torch.device("cuda")  # asked about, never used: the weights are on the meta device
PER_CHANNEL = QuantizationConfig("fp8-online", "channel")
BLOCKS = QuantizationConfig("fp8", "block", (16, 16))
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=128, max_position_embeddings=256)


def build(model_class, config, quantization=None, ignored=()):
    with torch.device("meta"):
        model = model_class(config, torch.bfloat16, 256)
    if quantization is not None:
        if ignored:
            quantization = QuantizationConfig(quantization.method, quantization.weight_strategy,
                                              quantization.weight_block, ignored)
        convert_model(model, quantization, plan_conversion(model, quantization, None))
    return model


def linked(model) -> dict[str, object]:
    return {name: module.output_quantization for name, module in model.named_modules()
            if getattr(module, "output_quantization", None) is not None}


def test_each_norm_and_activation_feeding_one_fp8_projection_is_linked():
    model = build(LlamaForCausalLM, LlamaConfig(**SMALL), PER_CHANNEL)
    assert sorted(linked(model)) == sorted(f"model.layers.{layer}.{producer}" for layer in range(2) for producer in
                                           ("input_layernorm", "post_attention_layernorm", "mlp.activation"))
    layer = model.model.layers[0]
    # every linked producer asks the projection that reads its output
    assert linked(model)["model.layers.0.input_layernorm"]._consumer is layer.self_attn.qkv_proj
    assert linked(model)["model.layers.0.mlp.activation"]._consumer is layer.mlp.down_proj
    # the consumer is held outside the module tree: no parameter appears twice
    assert len(dict(model.named_parameters())) == len(list(model.parameters()))
    assert "model.layers.0.input_layernorm._consumer" not in dict(model.named_modules())


def test_producers_stay_16_bit_without_an_fp8_consumer():
    assert not linked(build(LlamaForCausalLM, LlamaConfig(**SMALL)))  # a bf16 model
    # a projection kept 16-bit (modules_to_not_convert): its producer too, the others linked
    model = build(LlamaForCausalLM, LlamaConfig(**SMALL), BLOCKS, ignored=("model.layers.1.mlp.down_proj",))
    assert "model.layers.1.mlp.activation" not in linked(model) and "model.layers.0.mlp.activation" in linked(model)
    # Qwen3-MoE: the sparse layers' MLP has no gate_up_proj (experts are not linked), the
    # per-head query/key norms and the final norm never are
    config = Qwen3MoeConfig(**SMALL, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                            decoder_sparse_step=2, head_dim=16)
    names = sorted(linked(build(Qwen3MoeForCausalLM, config, BLOCKS)))
    assert names == ["model.layers.0.input_layernorm", "model.layers.0.mlp.activation",
                     "model.layers.0.post_attention_layernorm", "model.layers.1.input_layernorm"]


def test_deepseek_links_the_dense_mlp_norm_and_every_gated_mlp_activation():
    """DeepSeek-V3: the dense layer's second norm feeds its MLP alone; the first norm feeds MLA's
    two down-projections and an MoE layer's second norm its router and experts (never linked);
    the shared experts' and the MTP layer's SiLU·mul feed their down_proj alone."""
    config = DeepseekV3Config(**{**SMALL, "num_key_value_heads": 4}, kv_lora_rank=32, q_lora_rank=None,
                              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                              first_k_dense_replace=1, n_group=1, topk_group=1)
    model = build(DeepseekV3ForCausalLM, config, BLOCKS)
    assert sorted(linked(model)) == ["model.layers.0.mlp.activation", "model.layers.0.post_attention_layernorm",
                                     "model.layers.1.mlp.shared_experts.activation",
                                     "model.mtp_layers.0.mlp.shared_experts.activation"]
    dense = model.model.layers[0]
    assert linked(model)["model.layers.0.post_attention_layernorm"]._consumer is dense.mlp.gate_up_proj


@pytest.mark.parametrize("quantization, weight_only, layout", [
    (PER_CHANNEL, MAX_TOKENS, PER_TOKEN_LAYOUT),
    # 16x16 blocks: not cuBLASLt's 128x128 block-wise mode, the Triton block GEMM's groups
    (BLOCKS, MAX_TOKENS, ActivationLayout(group=16)),
])
def test_layout_by_token_count(quantization, weight_only, layout):
    link = linked(build(LlamaForCausalLM, LlamaConfig(**SMALL), quantization))["model.layers.0.mlp.activation"]
    assert link.layout(1, CUDA_DEVICE) is None and link.layout(weight_only, CUDA_DEVICE) is None  # weight-only
    assert link.layout(weight_only + 1, CUDA_DEVICE) == layout and link.layout(4096, CUDA_DEVICE) == layout
    assert link.layout(4096, torch.device("cpu")) is None  # a CPU product takes 16-bit activations


def test_an_fp8_product_refuses_an_activation_in_another_layout():
    model = build(LlamaForCausalLM, LlamaConfig(**SMALL), PER_CHANNEL)
    down_proj = model.model.layers[0].mlp.down_proj
    activation = quantize_reference(torch.randn(32, 96), ActivationLayout(group=16))
    with pytest.raises(ValueError, match="layout"):
        down_proj(activation)
