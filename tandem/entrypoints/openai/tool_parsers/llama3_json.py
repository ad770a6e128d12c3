"""``llama3_json``: Llama 3.1/3.2/3.3 JSON calls. The whole answer is either calls or text: calls
start the output (after an optional ``<|python_tag|>``) as ``{"name": ..., "parameters": {...}}``
objects separated by ``;``. An answer that does not start with ``{`` is plain content; so is a
first object that turns out not to be a call, and whatever follows the last call."""
from __future__ import annotations

from tandem.entrypoints.openai.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser, settle_content
from tandem.entrypoints.openai.tool_parsers.json_calls import read_object_call
from tandem.entrypoints.openai.tool_parsers.json_prefix import skip_whitespace

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = self.calls_start(text, final)
        if start is None:
            return ParsedOutput("")
        if start < 0:
            return ParsedOutput(settle_content(text, False, final))
        calls: list[ParsedCall] = []
        position = start
        while True:
            read = read_object_call(text, position)
            if read.call is None:
                # not (yet) a call: what starts here is content once that is sure
                settled = read.rejected or final
                if not calls:
                    return ParsedOutput(settle_content(text, False, final) if settled else "")
                return ParsedOutput(settle_content(text[position:], True, final) if settled else "",
                                    tuple(calls))
            calls.append(read.call)
            if read.end is None:
                return ParsedOutput("", tuple(calls))
            position, content = self.next_object(text, read.end)
            if position is None:
                return ParsedOutput(settle_content(content, True, final), tuple(calls))

    @staticmethod
    def calls_start(text: str, final: bool):
        """Where the first call object starts; -1: the answer is plain text; None: undecided."""
        position = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, position):
            position = skip_whitespace(text, position + len(PYTHON_TAG))
        elif PYTHON_TAG.startswith(text[position:]) and not final:
            return None
        if position == len(text):
            return -1 if final else None
        return position if text[position] == "{" else -1

    @staticmethod
    def next_object(text: str, after: int):
        """After a call: ``(start of the next object, "")``, or ``(None, content after the calls)``."""
        position = skip_whitespace(text, after)
        if position == len(text):
            return None, ""
        if text[position] != SEPARATOR:
            return None, text[position:]
        following = skip_whitespace(text, position + 1)
        if following == len(text):
            return None, ""
        if text[following] != "{":
            return None, text[position:]
        return following, ""
