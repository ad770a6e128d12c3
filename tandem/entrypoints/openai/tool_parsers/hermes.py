"""``hermes``: Qwen2.5 / Qwen3 / Hermes calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
any number of them, with free text around them."""
from __future__ import annotations

from tandem.entrypoints.openai.tool_parsers.base import RegionScan, RegionToolParser
from tandem.entrypoints.openai.tool_parsers.json_calls import read_object_call
from tandem.entrypoints.openai.tool_parsers.json_prefix import skip_whitespace

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(RegionToolParser):
    name = "hermes"
    markers = (START, END)
    start_marker = START

    def scan_region(self, text: str, begin: int, final: bool) -> RegionScan:
        body = skip_whitespace(text, begin)
        if body == len(text):
            return RegionScan()
        if text[body] != "{":
            return RegionScan(end=region_end(text, begin))
        read = read_object_call(text, body)
        calls = (read.call,) if read.call is not None else ()
        if read.scan.end is not None:
            return RegionScan(calls, region_end(text, read.scan.end))
        if read.scan.malformed_at is not None:
            return RegionScan(calls, region_end(text, read.scan.malformed_at))
        return RegionScan(calls)


def region_end(text: str, search_from: int):
    """The index after the first end marker at or after ``search_from`` (None: not written yet)."""
    close = text.find(END, search_from)
    return None if close < 0 else close + len(END)
