"""``deepseek_r1``: DeepSeek-R1 (and its distillations) always think first; its template opens the
block in the prompt (older ones let the model write ``<think>``). Output with no ``</think>`` is
all thinking."""
from __future__ import annotations

from tandem.entrypoints.openai.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    always_thinks = True
