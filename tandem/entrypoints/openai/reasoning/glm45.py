"""``glm45``: GLM-4.5 / GLM-4.6 write ``<think>...</think>`` before the answer; with
``enable_thinking: false`` the template closes an empty block in the prompt."""
from __future__ import annotations

from tandem.entrypoints.openai.reasoning.base import ReasoningParser


class Glm45ReasoningParser(ReasoningParser):
    name = "glm45"
