"""DeepSeek-V3.2: DeepSeek-V3 (MLA + DeepSeek-MoE) with DeepSeek sparse attention — every layer
runs a lightning indexer (half-split rotary on its heads) whose top-k selection restricts the
layer's attention (``layers/sparse_indexer.py``). The indexer's key cache is its own state group.
"""
from __future__ import annotations

from tandem.models.deepseek_v3 import DeepseekOptions, DeepseekV3ForCausalLM


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    options = DeepseekOptions(sparse_attention=True, indexer_rope_interleaved=False)
