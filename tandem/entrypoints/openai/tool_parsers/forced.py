"""Calls a grammar forces (``tool_choice`` ``required`` or a named function), whatever the model's
own format: the output is JSON that the grammar built from the tools' schemas (see
``tool_choice.py``).

- ``required``: a JSON array of ``{"name": ..., "parameters": {...}}`` objects;
- a named function: the arguments object itself.
"""
from __future__ import annotations

from tandem.entrypoints.openai.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser
from tandem.entrypoints.openai.tool_parsers.json_calls import read_object_call
from tandem.entrypoints.openai.tool_parsers.json_prefix import skip_whitespace


class RequiredCallsParser(ToolParser):
    """The array of calls ``required`` produces. Output that is no such array (a grammar would not
    allow it) comes back as content rather than being lost."""
    name = "required"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        calls = tuple(self.read_calls(text))
        if final and not calls:
            return ParsedOutput(text)
        return ParsedOutput("", calls)

    @staticmethod
    def read_calls(text: str):
        position = skip_whitespace(text, 0)
        if not text.startswith("[", position):
            return
        position += 1
        while True:
            position = skip_whitespace(text, position)
            if not text.startswith("{", position):
                return
            read = read_object_call(text, position)
            if read.call is None:
                return
            yield read.call
            if read.end is None:
                return
            position = skip_whitespace(text, read.end)
            if not text.startswith(",", position):
                return
            position += 1


class NamedFunctionParser(ToolParser):
    """The output is the arguments of the one function named in ``tool_choice``."""
    name = "named"

    def __init__(self, function_name: str):
        super().__init__()
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", (ParsedCall(self.function_name, text.strip()),))
