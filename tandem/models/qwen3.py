"""Qwen3: Llama blocks with RMSNorm on each query and key head before rope."""
from __future__ import annotations

from tandem.models.llama import LlamaForCausalLM, LlamaOptions


class Qwen3ForCausalLM(LlamaForCausalLM):
    options = LlamaOptions(qk_norm=True)
