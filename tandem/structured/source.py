"""What a request's output must match, as a hashable source the compiler caches by.

A ``GrammarSource`` is derived from ``StructuredOutputsParams`` alone (the same constraint gives
the same source in every process: frontend, prefill and decode engines). ``check`` parses it
without a tokenizer, which is cheap, so an invalid schema, regex or grammar is the client's 400
before the request reaches an engine.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tandem.sampling_params import StructuredOutputsParams

# JSON Schema of "any JSON object" (json_object): compiled as a schema so that its whitespace
# is bounded like any other JSON constraint's.
ANY_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class GrammarSource:
    kind: str  # "json" (a JSON Schema, also for json_object), "regex" or "grammar" (EBNF; also choice)
    text: str
    any_whitespace: bool  # JSON only: any whitespace between tokens, or none beyond single spaces

    @classmethod
    def of(cls, params: StructuredOutputsParams) -> "GrammarSource":
        any_whitespace = not params.disable_any_whitespace
        kind = params.kind
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                schema = _parse_schema_text(schema)
            # the properties keep their order: a JSON answer writes its keys in the schema's order
            return cls("json", json.dumps(schema, ensure_ascii=False), any_whitespace)
        if kind == "json_object":
            return cls("json", ANY_OBJECT_SCHEMA, any_whitespace)
        if kind == "regex":
            return cls("regex", params.regex, False)
        if kind == "choice":
            return cls("grammar", choice_grammar(params.choice), False)
        return cls("grammar", params.grammar, False)


def _parse_schema_text(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"structured_outputs.json: not valid JSON: {error}") from None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def field_of(params: StructuredOutputsParams) -> str:
    return f"structured_outputs.{params.kind}"


def check(params: StructuredOutputsParams, field: str | None = None) -> GrammarSource:
    """The source of ``params``; raises ``ValueError("field: ...")`` when the schema, regex or
    grammar does not parse (``field`` defaults to ``structured_outputs.<kind>``)."""
    import xgrammar

    field = field or field_of(params)
    try:
        source = GrammarSource.of(params)
    except ValueError as error:
        raise ValueError(f"{field}: {str(error).split(': ', 1)[-1]}") from None
    try:
        if source.kind == "json":
            xgrammar.Grammar.from_json_schema(source.text, any_whitespace=source.any_whitespace)
        elif source.kind == "regex":
            xgrammar.Grammar.from_regex(source.text)
        else:
            xgrammar.Grammar.from_ebnf(source.text)
    except Exception as error:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError of its own
        raise ValueError(f"{field}: invalid {_what(params.kind)}: {_first_line(error)}") from None
    return source


# xgrammar 0.2.8 writes the characters of a JSON string as negated classes that let through raw
# control characters (length-bounded strings; JSON forbids them: RFC 8259, section 7) and UTF-16
# surrogates (U+D800..U+DFFF: no UTF-8 text holds them). JSON schemas are compiled through their
# EBNF with both classes replaced by the characters JSON strings may hold unescaped.
_LOOSE_STRING_CHARACTERS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_STRING_CHARACTER = r'[ !#-\[\]-\ud7ff\ue000-\U0010ffff]'


# xgrammar prints code points below 256 as ``\xHH``, which its parser reads greedily ("\xe9a" is
# U+0E9A): re-printed as ``\u00HH`` (always four digits), the text means what was printed.
_HEX_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9a-fA-F]{2})")


def json_schema_ebnf(source: GrammarSource) -> str:
    """The EBNF grammar of a JSON Schema source, its strings holding only characters JSON allows
    unescaped (no control characters, no surrogates)."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(source.text, any_whitespace=source.any_whitespace)
    text = str(grammar)
    for loose in _LOOSE_STRING_CHARACTERS:
        text = text.replace(loose, _STRING_CHARACTER)
    return _HEX_ESCAPE.sub(r"\1\\u00\2", text)


def _what(kind: str) -> str:
    return {"json": "JSON Schema", "json_object": "JSON Schema", "regex": "regular expression",
            "choice": "choice", "grammar": "EBNF grammar"}[kind]


# xgrammar's messages start with where in its C++ sources they were raised.
_SOURCE_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return _SOURCE_LOCATION.sub("", text.splitlines()[0])[:500]
