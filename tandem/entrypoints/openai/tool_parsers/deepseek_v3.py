"""``deepseek_v3``: DeepSeek-V3 / R1-0528 calls, one section of calls after the text::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"arguments": ...}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

The name is complete at its newline; the arguments are the raw text between the ```json fence and
the closing fence.
"""
from __future__ import annotations

from typing import Optional

from tandem.entrypoints.openai.text_markers import partial_marker_start
from tandem.entrypoints.openai.tool_parsers.base import (
    ParsedCall,
    RegionScan,
    RegionToolParser,
)
from tandem.entrypoints.openai.tool_parsers.json_prefix import skip_whitespace

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEPARATOR = "<｜tool▁sep｜>"
FENCE_OPEN = "```json"
FENCE_CLOSE = "\n```"


class DeepSeekV3ToolParser(RegionToolParser):
    name = "deepseek_v3"
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEPARATOR)
    start_marker = CALLS_BEGIN

    def scan_region(self, text: str, begin: int, final: bool) -> RegionScan:
        calls: list[ParsedCall] = []
        position = begin
        while True:
            position = skip_whitespace(text, position)
            if text.startswith(CALLS_END, position):
                return RegionScan(tuple(calls), position + len(CALLS_END))
            call_begin = text.find(CALL_BEGIN, position)
            section_end = text.find(CALLS_END, position)
            if call_begin < 0 or (0 <= section_end < call_begin):
                # no further call: the section ends at its end marker (text in between is dropped)
                return RegionScan(tuple(calls), None if section_end < 0 else section_end + len(CALLS_END))
            call, position = read_call(text, call_begin + len(CALL_BEGIN))
            if call is not None:
                calls.append(call)
            if position is None:
                return RegionScan(tuple(calls))


def read_call(text: str, begin: int) -> tuple[Optional[ParsedCall], Optional[int]]:
    """The call whose body starts at ``begin`` and the index after its end marker (None: open)."""
    separator = text.find(SEPARATOR, begin)
    if separator < 0:
        return None, None
    name_begin = separator + len(SEPARATOR)
    name_end = text.find("\n", name_begin)
    if name_end < 0:
        return None, None
    name = text[name_begin:name_end].strip()
    if not name:
        return None, skip_past(text, name_end, CALL_END)
    fence = text.find(FENCE_OPEN, name_end)
    if fence < 0:
        return ParsedCall(name, ""), skip_past(text, name_end, CALL_END)
    arguments_begin = fence + len(FENCE_OPEN)
    if text.startswith("\n", arguments_begin):
        arguments_begin += 1
    elif arguments_begin == len(text):
        return ParsedCall(name, ""), None
    close = text.find(FENCE_CLOSE, arguments_begin)
    if close < 0:
        rest = text[arguments_begin:]
        return ParsedCall(name, rest[:partial_marker_start(rest, FENCE_CLOSE)]), None
    return ParsedCall(name, text[arguments_begin:close]), skip_past(text, close + len(FENCE_CLOSE), CALL_END)


def skip_past(text: str, position: int, marker: str) -> Optional[int]:
    found = text.find(marker, position)
    return None if found < 0 else found + len(marker)
