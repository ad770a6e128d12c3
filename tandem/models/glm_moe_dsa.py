"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's architecture with interleaved rotary on the indexer
heads and cross-layer top-k sharing — ``config.indexer_types[i]`` is ``"full"`` (layer ``i`` runs
its own indexer, and has an indexer key cache) or ``"shared"`` (it reuses the selection of the
previous full layer and keeps no indexer state).
"""
from __future__ import annotations

from tandem.models.deepseek_v3 import DeepseekOptions, DeepseekV3ForCausalLM


class GlmMoeDsaForCausalLM(DeepseekV3ForCausalLM):
    options = DeepseekOptions(sparse_attention=True, indexer_rope_interleaved=True)
