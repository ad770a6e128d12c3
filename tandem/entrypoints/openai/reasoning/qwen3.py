"""``qwen3``: Qwen3 writes ``<think>...</think>`` itself when thinking is on; the thinking-only
models' templates open the block in the prompt; ``enable_thinking: false`` closes an empty one
in the prompt, so the output is all answer."""
from __future__ import annotations

from tandem.entrypoints.openai.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
