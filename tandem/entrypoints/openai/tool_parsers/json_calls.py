"""Calls written as JSON objects, ``{"name": "f", "arguments": {...}}`` (hermes, llama3_json, and
the array a ``required`` tool choice produces): the name once its string is complete, the
arguments as the raw JSON text the model wrote, growing with it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from tandem.entrypoints.openai.tool_parsers.base import ParsedCall
from tandem.entrypoints.openai.tool_parsers.json_prefix import ObjectScan, scan_object

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ObjectCall:
    """A JSON object read as a call: ``call`` once the name is known; ``rejected`` once it is sure
    the object is not a call (the name is not a non-empty string, or the object ended without one)."""
    scan: ObjectScan
    call: Optional[ParsedCall]
    rejected: bool

    @property
    def end(self) -> Optional[int]:
        return self.scan.end


def read_object_call(text: str, position: int) -> ObjectCall:
    """Read the object whose ``{`` is at ``position`` as a call, as far as the text goes."""
    scan = scan_object(text, position)
    name_text = scan.complete_value(text, "name")
    if name_text is None:
        return ObjectCall(scan, None, rejected=scan.settled)
    try:
        name = json.loads(name_text)
    except ValueError:
        name = None
    if not isinstance(name, str) or not name:
        return ObjectCall(scan, None, rejected=True)
    return ObjectCall(scan, ParsedCall(name, arguments_text(text, scan)), rejected=False)


def arguments_text(text: str, scan: ObjectScan) -> str:
    """The raw text of the arguments value (the first argument key written wins); ``{}`` when the
    object closed without one."""
    spans = [scan.values[key] for key in ARGUMENT_KEYS if key in scan.values]
    if spans:
        return min(spans, key=lambda span: span.begin).text(text)
    return "{}" if scan.end is not None else ""
