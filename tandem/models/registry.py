"""Architecture name (``config.architectures[0]``) → model class."""
from __future__ import annotations

import importlib

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tandem.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tandem.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("tandem.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("tandem.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("tandem.models.qwen3_next", "Qwen3NextForCausalLM"),
    "NemotronHForCausalLM": ("tandem.models.nemotron_h", "NemotronHForCausalLM"),
    "DeepseekV3ForCausalLM": ("tandem.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("tandem.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("tandem.models.glm_moe_dsa", "GlmMoeDsaForCausalLM"),
    "Gemma3ForCausalLM": ("tandem.models.gemma3", "Gemma3ForCausalLM"),
}


def model_class_for(architecture: str):
    try:
        module_name, class_name = ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(f"model: architecture {architecture!r} is not supported "
                         f"(supported: {', '.join(sorted(ARCHITECTURES))})") from None
    return getattr(importlib.import_module(module_name), class_name)
