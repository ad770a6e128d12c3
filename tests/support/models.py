"""The tiny test models: the dense families every engine scenario runs, and the options each
family's checkpoint is made with (``make_model``), so each family's variations are exercised."""
from __future__ import annotations

ARCHS = ("llama", "qwen2", "qwen3")

# Per-architecture variations so each family's options are exercised:
# llama with Llama-3.1 rope scaling, qwen2 with tied embeddings (and qkv bias), qwen3 with q/k norm.
ARCH_OPTIONS = {
    "llama": dict(rope_scaling="llama3", max_position_embeddings=4096),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(),
    # gemma3: local, global, local (window 24, see make_model). Untied: with a tied head the
    # sqrt(hidden)-scaled embedding dominates and greedy repeats one token (test_gemma3 covers tied).
    "gemma3": dict(num_layers=3),
    # DeepSeek family (MLA + MoE; layer 0 dense, the rest MoE; see make_model for the shapes):
    # deepseek_v3 without a query LoRA; glm_moe_dsa with 3 layers so that the middle one reuses
    # the first one's top-k (indexer_types full, shared, full).
    "deepseek_v3": dict(num_layers=2),
    "deepseek_v32": dict(num_layers=2),
    # Recurrent hybrids: qwen3_next DeltaNet, attention, DeltaNet (dense MLP on layer 0, MoE
    # after); nemotron_h Mamba-2, attention, MLP, MoE, Mamba-2. Two recurrent layers each.
    "qwen3_next": dict(num_layers=3),
    "nemotron_h": dict(num_layers=5),
    "glm_moe_dsa": dict(num_layers=3),
    # Qwen3-MoE: MoE, dense MLP (mlp_only_layers), MoE; 8 experts, 2 per token.
    "qwen3_moe": dict(num_layers=3),
}
