"""Tool-call parsers, by their ``--tool-call-parser`` name (vLLM's names).

Each reads the calls a model writes in its own format out of the generated text; ``base.py``
states the contract that makes streamed calls add up to the non-streamed ones.
"""
from __future__ import annotations

from tandem.entrypoints.openai.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser
from tandem.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from tandem.entrypoints.openai.tool_parsers.glm45 import Glm45ToolParser
from tandem.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from tandem.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, DeepSeekV3ToolParser,
                                       Glm45ToolParser)}

__all__ = ["TOOL_PARSERS", "ParsedCall", "ParsedOutput", "ToolParser"]
