"""Reasoning parsers, by their ``--reasoning-parser`` name (vLLM's names): the thinking goes to
``reasoning_content``, the rest is the answer (see ``base.py``)."""
from __future__ import annotations

from tandem.entrypoints.openai.reasoning.base import ReasoningBoundary, ReasoningParser, ReasoningSplit
from tandem.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from tandem.entrypoints.openai.reasoning.glm45 import Glm45ReasoningParser
from tandem.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, Glm45ReasoningParser)}

__all__ = ["REASONING_PARSERS", "ReasoningBoundary", "ReasoningParser", "ReasoningSplit"]
