"""What every tool-call parser shares: the parse result and the rules that keep streaming exact.

A parser is a pure function of the text generated so far: ``parse(text, final)``. Streaming calls
it on every longer text and sends the difference; a non-streamed answer calls it once with
``final=True``. For the streamed deltas to add up to the non-streamed answer, every parser keeps
one contract (checked by ``MessageStream`` and by the tests at every split point):

    for a text T and any extension T + U:
        parse(T).content is a prefix of parse(T + U).content (and of parse(T + U, final=True));
        parse(T).calls is a prefix of the longer calls list, call by call: the same name, and
        arguments that are a prefix of the longer arguments.

So a parser holds back what it cannot decide yet (the start of a marker, trailing whitespace, a
region that may still turn into a call) and commits to a call only once its name is complete.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from tandem.entrypoints.openai.text_markers import partial_marker_start


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments (as far as generated)


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: tuple[ParsedCall, ...] = ()


@dataclass(frozen=True)
class RegionScan:
    """What one marked region (``<tool_call>...``) holds so far: its calls, and ``end`` (the index
    after the region) once it is closed. A closed region without calls was not a tool call."""
    calls: tuple[ParsedCall, ...] = ()
    end: Optional[int] = None


def settle_content(content: str, has_calls: bool, final: bool) -> str:
    """Trailing whitespace waits for what follows it: dropped when calls come out (it separated
    them), kept at the end of a plain answer."""
    if final and not has_calls:
        return content
    return content.rstrip()


class ToolParser(ABC):
    """Turns generated text into content and tool calls (see the module docstring's contract).

    ``tools`` are the request's tool definitions (OpenAI's ``{"type": "function", "function":
    {...}}`` dicts); formats that write arguments as text use them to type the values.
    """

    name: ClassVar[str]
    # The strings that mark calls in the output: they must survive detokenization.
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: Optional[list[dict[str, Any]]] = None):
        self.tools = list(tools or [])

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Content and calls of ``text``; ``final``: the text is complete (nothing to hold back)."""

    def parameter_schema(self, function_name: str) -> dict[str, Any]:
        for tool in self.tools:
            function = tool.get("function", {})
            if function.get("name") == function_name:
                return function.get("parameters") or {}
        return {}


class RegionToolParser(ToolParser):
    """Formats whose calls sit in regions opened by ``start_marker``; text outside is content.

    A region that closes without a call (the model wrote the marker but no call) is content, as
    written; one still open at the end is content too unless it already produced a call.
    """

    start_marker: ClassVar[str]

    @abstractmethod
    def scan_region(self, text: str, begin: int, final: bool) -> RegionScan:
        """Read the region whose body starts at ``begin`` (just after the start marker)."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pieces: list[str] = []
        calls: list[ParsedCall] = []
        position = 0
        follows_call = False  # whitespace right after a call only separated it from what follows
        while True:
            start = text.find(self.start_marker, position)
            piece = text[position:] if start < 0 else text[position:start]
            if start < 0 and not final:
                piece = piece[:partial_marker_start(piece, self.start_marker)]
            pieces.append(piece.lstrip() if follows_call else piece)
            if start < 0:
                break
            region = self.scan_region(text, start + len(self.start_marker), final)
            calls.extend(region.calls)
            if region.end is None:
                if final and not region.calls:
                    pieces.append(text[start:])
                break
            if not region.calls:
                pieces.append(text[start:region.end])
            follows_call = bool(region.calls)
            position = region.end
        return ParsedOutput(settle_content("".join(pieces), bool(calls), final), tuple(calls))
