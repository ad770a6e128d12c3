"""Qwen2: Llama blocks with a bias on the q/k/v projections."""
from __future__ import annotations

from tandem.models.llama import LlamaForCausalLM, LlamaOptions


class Qwen2ForCausalLM(LlamaForCausalLM):
    options = LlamaOptions(qkv_bias=True)
