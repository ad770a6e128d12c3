"""The assistant message of one choice, read out of its generated text: the thinking (with a
reasoning parser), the answer, and the tool calls (with a tool-call parser), whole or as
streamed deltas.

Both parsers are pure functions of the text (their contract: ``tool_parsers/base.py``), so a
stream sends, each time the text grows, what the new parse adds to what was sent; the deltas
add up to the non-streamed message.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from tandem.entrypoints.openai.reasoning import ReasoningParser
from tandem.entrypoints.openai.tool_parsers import ParsedCall, ToolParser


@dataclass(frozen=True)
class ParsedMessage:
    reasoning: Optional[str]
    content: str
    calls: tuple[ParsedCall, ...] = ()


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class AssistantOutputParser:
    """Reads one choice's text: the thinking first, then the calls out of the answer.
    ``max_calls`` keeps only the first calls (``parallel_tool_calls: false``)."""

    def __init__(self, reasoning: Optional[ReasoningParser], tools: Optional[ToolParser],
                 max_calls: Optional[int] = None):
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls

    def parse(self, text: str, final: bool) -> ParsedMessage:
        reasoning: Optional[str] = None
        if self.reasoning is not None:
            split = self.reasoning.split(text, final)
            reasoning, text = split.reasoning, split.content
        if self.tools is None:
            return ParsedMessage(reasoning, text)
        parsed = self.tools.parse(text, final)
        calls = parsed.calls if self.max_calls is None else parsed.calls[:self.max_calls]
        return ParsedMessage(reasoning, parsed.content, calls)


def message_dict(message: ParsedMessage, with_reasoning: bool) -> dict[str, Any]:
    """The non-streamed ``message``: content null when only calls came out."""
    result: dict[str, Any] = {"role": "assistant",
                              "content": message.content if message.content or not message.calls else None}
    if with_reasoning:
        result["reasoning_content"] = message.reasoning or None
    if message.calls:
        result["tool_calls"] = [{"id": new_tool_call_id(), "type": "function",
                                 "function": {"name": call.name, "arguments": call.arguments}}
                                for call in message.calls]
    return result


@dataclass
class StreamedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class MessageStream:
    """What one streamed choice has sent so far; ``delta`` parses its newer text and returns what
    that adds. A tool call's first delta carries its id, type and name (once); later ones only
    arguments."""
    parser: AssistantOutputParser
    reasoning: str = ""
    content: str = ""
    calls: list[StreamedCall] = field(default_factory=list)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        message = self.parser.parse(text, final)
        result: dict[str, Any] = {}
        reasoning = self.advance("reasoning", message.reasoning or "")
        if reasoning:
            result["reasoning_content"] = reasoning
        content = self.advance("content", message.content)
        if content:
            result["content"] = content
        call_deltas = self.call_deltas(message.calls)
        if call_deltas:
            result["tool_calls"] = call_deltas
        return result

    def advance(self, name: str, text: str) -> str:
        sent = getattr(self, name)
        if not text.startswith(sent):
            raise RuntimeError(f"output parsing took back streamed {name}: {sent!r} -> {text!r}")
        setattr(self, name, text)
        return text[len(sent):]

    def call_deltas(self, calls: tuple[ParsedCall, ...]) -> list[dict[str, Any]]:
        if len(calls) < len(self.calls):
            raise RuntimeError("output parsing took back a streamed tool call")
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self.calls):
                self.calls.append(StreamedCall(new_tool_call_id(), call.name))
                deltas.append({"index": index, "id": self.calls[index].id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            streamed = self.calls[index]
            if call.name != streamed.name or not call.arguments.startswith(streamed.arguments):
                raise RuntimeError(f"output parsing changed streamed tool call {index}")
            added = call.arguments[len(streamed.arguments):]
            if added:
                streamed.arguments = call.arguments
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += added
                else:
                    deltas.append({"index": index, "function": {"arguments": added}})
        return deltas
