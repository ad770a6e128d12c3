"""``glm45``: GLM-4.5 / GLM-4.6 calls, arguments as key/value pairs of text::

    <tool_call>NAME
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Values are stripped. A value whose parameter the tool declares as a string stays text; any other
is read as JSON (or a Python literal), falling back to text. The arguments are built as a JSON
object, ``{"city": "Paris", "days": 3}``, streamed as it grows: string values character by
character, other values once closed.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any, Optional

from tandem.entrypoints.openai.text_markers import partial_marker_start
from tandem.entrypoints.openai.tool_parsers.base import (
    ParsedCall,
    RegionScan,
    RegionToolParser,
)
from tandem.entrypoints.openai.tool_parsers.json_prefix import skip_whitespace

START = "<tool_call>"
END = "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
NAME_DELIMITERS = ("\n", KEY_OPEN, END)


@dataclass
class ArgumentsBuilder:
    """The JSON text of the arguments, written in order: only ever appended to."""
    text: str = "{"
    pairs: int = 0

    def key(self, key: str) -> None:
        self.text += (", " if self.pairs else "") + json.dumps(key, ensure_ascii=False) + ": "
        self.pairs += 1

    def close(self) -> str:
        return self.text + "}"


class Glm45ToolParser(RegionToolParser):
    name = "glm45"
    markers = (START, END, KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE)
    start_marker = START

    def scan_region(self, text: str, begin: int, final: bool) -> RegionScan:
        name, position = read_name(text, begin)
        if name is None:
            return RegionScan(end=None if position is None else position)
        arguments = ArgumentsBuilder()
        while True:
            position = skip_whitespace(text, position)
            if text.startswith(END, position):
                return RegionScan((ParsedCall(name, arguments.close()),), position + len(END))
            if not text.startswith(KEY_OPEN, position):
                return self.skip_to_next_pair(text, position, name, arguments)
            key_begin = position + len(KEY_OPEN)
            key_end = text.find(KEY_CLOSE, key_begin)
            if key_end < 0:
                return RegionScan((ParsedCall(name, arguments.text),))
            key = text[key_begin:key_end].strip()
            arguments.key(key)
            position, value_done = self.read_value(text, key_end + len(KEY_CLOSE), name, key, arguments)
            if not value_done:
                return RegionScan((ParsedCall(name, arguments.text),))

    def skip_to_next_pair(self, text: str, position: int, name: str, arguments: ArgumentsBuilder) -> RegionScan:
        """Text that is neither a pair nor the end: wait while it may be the start of one, else
        the call ends at its end marker (the stray text is dropped)."""
        rest = text[position:]
        if any(marker.startswith(rest) for marker in (KEY_OPEN, END)):
            return RegionScan((ParsedCall(name, arguments.text),))
        close = text.find(END, position)
        if close < 0:
            return RegionScan((ParsedCall(name, arguments.text),))
        return RegionScan((ParsedCall(name, arguments.close()),), close + len(END))

    def read_value(self, text: str, position: int, name: str, key: str,
                   arguments: ArgumentsBuilder) -> tuple[int, bool]:
        """Append the value of ``key``; return where reading goes on and whether the value closed."""
        position = skip_whitespace(text, position)
        if not text.startswith(VALUE_OPEN, position):
            return position, False
        value_begin = position + len(VALUE_OPEN)
        value_end = text.find(VALUE_CLOSE, value_begin)
        is_text = self.is_text_parameter(name, key)
        if value_end < 0:
            if is_text:
                visible = text[value_begin:]
                visible = visible[:partial_marker_start(visible, VALUE_CLOSE)].lstrip().rstrip()
                arguments.text += '"' + json_escape(visible)
            return len(text), False
        value = text[value_begin:value_end].strip()
        arguments.text += ('"' + json_escape(value) + '"') if is_text else json.dumps(
            read_literal(value), ensure_ascii=False)
        return value_end + len(VALUE_CLOSE), True

    def is_text_parameter(self, name: str, key: str) -> bool:
        declared = self.parameter_schema(name).get("properties", {}).get(key, {})
        return isinstance(declared, dict) and declared.get("type") == "string"


def read_name(text: str, begin: int) -> tuple[Optional[str], Optional[int]]:
    """The function name and where its arguments start; ``(None, None)`` while it is not complete,
    ``(None, end)`` for a region that closed with no usable name (the index after it)."""
    begin = skip_whitespace(text, begin)
    found = [(index, delimiter) for delimiter in NAME_DELIMITERS
             if (index := text.find(delimiter, begin)) >= 0]
    if not found:
        return None, None
    index, delimiter = min(found)
    name = text[begin:index].strip()
    if not name or "<" in name:
        close = text.find(END, begin)
        return None, None if close < 0 else close + len(END)
    return name, index + len(delimiter) if delimiter == "\n" else index


def json_escape(value: str) -> str:
    """The inside of a JSON string for ``value``: escaping works character by character, so the
    escapes of two pieces add up to the escape of the whole."""
    return json.dumps(value, ensure_ascii=False)[1:-1]


def read_literal(value: str) -> Any:
    """A non-string parameter's value: JSON, else a Python literal (``True``), else the text."""
    try:
        return json.loads(value, parse_constant=reject_constant)
    except ValueError:
        pass
    try:
        literal = ast.literal_eval(value)
        json.dumps(literal, allow_nan=False)
        return literal
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value


def reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")
