"""Reading a JSON object of which only a prefix has been generated yet.

A model writes a tool call's JSON a token at a time. ``scan_object`` reads as far as the text goes
and reports, per top-level key, where its value starts and (once it has) where it ends, so a parser
can hand out the name as soon as it is complete and the arguments as raw text while they grow.
The scan only moves forward: what it reports for a prefix stays true for every extension of it.

Values are delimited, not validated (a string's escapes, a number's digits are not checked); the
caller decodes what it needs (``json.loads`` of a complete span).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

WHITESPACE = " \t\n\r"
NUMBER_CHARACTERS = frozenset("+-0123456789.eE")
LITERALS = ("true", "false", "null")
# The characters a scan must stop at (the regular expressions skip everything else at C speed:
# a long argument is rescanned each time a streamed call grows).
COMPLETE_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
CONTAINER_STOPS = re.compile(r'["{}\[\]]')


class Incomplete(Exception):
    """The text ends inside the value being read."""


class Malformed(Exception):
    """The text cannot continue into valid JSON at ``position``."""

    def __init__(self, position: int):
        super().__init__(position)
        self.position = position


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in WHITESPACE:
        position += 1
    return position


def string_end(text: str, position: int) -> int:
    """``text[position]`` is ``"``: the index after the closing quote."""
    found = COMPLETE_STRING.match(text, position)
    if found is None:
        raise Incomplete  # the body so far is only characters and escapes: the quote is still to come
    return found.end()


def container_end(text: str, position: int) -> int:
    """``text[position]`` opens an object or array: the index after its closing bracket."""
    depth = 0
    index = position
    while True:
        found = CONTAINER_STOPS.search(text, index)
        if found is None:
            raise Incomplete
        index = found.start()
        character = text[index]
        if character == '"':
            index = string_end(text, index)
            continue
        depth += 1 if character in "{[" else -1
        index += 1
        if depth == 0:
            return index


def value_end(text: str, position: int) -> int:
    """The index after the JSON value starting at ``position`` (which is not whitespace)."""
    character = text[position]
    if character == '"':
        return string_end(text, position)
    if character in "{[":
        return container_end(text, position)
    if character in NUMBER_CHARACTERS:
        index = position
        while index < len(text) and text[index] in NUMBER_CHARACTERS:
            index += 1
        if index == len(text):
            raise Incomplete  # more digits may follow
        return index
    for literal in LITERALS:
        written = text[position:position + len(literal)]
        if literal.startswith(written):
            if len(written) < len(literal):
                raise Incomplete
            return position + len(literal)
    raise Malformed(position)


@dataclass
class ValueSpan:
    """Where one key's value is in the text; ``end`` is None while the value is still being written."""
    begin: int
    end: Optional[int]

    def text(self, source: str) -> str:
        return source[self.begin:self.end if self.end is not None else len(source)]


@dataclass
class ObjectScan:
    """What a prefix of a JSON object shows: its keys' values (the first of a repeated key), and
    ``end`` (after ``}``) once it is closed, or ``malformed_at`` once it cannot be valid JSON."""
    values: dict[str, ValueSpan] = field(default_factory=dict)
    end: Optional[int] = None
    malformed_at: Optional[int] = None

    @property
    def settled(self) -> bool:
        """Nothing later in the text can change this object any more."""
        return self.end is not None or self.malformed_at is not None

    def complete_value(self, source: str, key: str) -> Optional[str]:
        span = self.values.get(key)
        return span.text(source) if span is not None and span.end is not None else None


def scan_object(text: str, position: int) -> ObjectScan:
    """Read the object whose ``{`` is at ``position`` as far as ``text`` goes."""
    scan = ObjectScan()
    try:
        scan_members(text, position + 1, scan)
    except Incomplete:
        pass
    except Malformed as error:
        scan.malformed_at = error.position
    return scan


def scan_members(text: str, index: int, scan: ObjectScan) -> None:
    while True:
        index = expect_more(text, index)
        if text[index] == "}" and not scan.values:
            scan.end = index + 1
            return
        if text[index] != '"':
            raise Malformed(index)
        key_end = string_end(text, index)
        key = decode_string(text[index:key_end], index)
        index = expect_more(text, key_end)
        if text[index] != ":":
            raise Malformed(index)
        index = expect_more(text, index + 1)
        span = scan.values.setdefault(key, ValueSpan(index, None))
        end = value_end(text, index)
        if span.begin == index:
            span.end = end
        index = expect_more(text, end)
        if text[index] == "}":
            scan.end = index + 1
            return
        if text[index] != ",":
            raise Malformed(index)
        index += 1


def expect_more(text: str, index: int) -> int:
    """Skip whitespace; the text must go on."""
    index = skip_whitespace(text, index)
    if index == len(text):
        raise Incomplete
    return index


def decode_string(literal: str, position: int) -> str:
    try:
        return json.loads(literal)
    except ValueError:
        raise Malformed(position) from None
