"""What a chat request's ``tools`` and ``tool_choice`` ask for, and the grammar that enforces it.

- ``none``: the tools are shown to the template, the output is read as text;
- ``auto``: the model may call tools in its own format, read by the server's
  ``--tool-call-parser`` (needs ``--enable-auto-tool-choice``, as in vLLM);
- ``required`` and a named function: the output must be calls, on any model. The request's
  ``structured_outputs`` carries a JSON Schema built here (``required_calls_schema``,
  ``named_function_schema``) and the grammar engine enforces it; ``tool_parsers/forced.py``
  reads the result.

Without ``tool_choice``, a request with tools means ``auto`` (OpenAI's default).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser
from tandem.entrypoints.openai.tool_parsers.forced import NamedFunctionParser, RequiredCallsParser

DEFINITION_KEYS = ("$defs", "definitions")
ROOT_ONLY_KEYS = ("$schema", "$id")
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolCallingOptions:
    """The server's settings (``tandem serve`` flags of the same names)."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None


@dataclass(frozen=True)
class ToolPlan:
    """How one request's output is read for calls. ``tools`` are OpenAI-shaped dicts (what chat
    templates get); ``choice`` is ``none``, ``auto``, ``required`` or ``named``."""
    tools: Optional[list[dict[str, Any]]] = None
    choice: str = "none"
    function_name: Optional[str] = None
    parallel: bool = True
    parser_name: Optional[str] = None

    @property
    def schema(self) -> Optional[dict[str, Any]]:
        """The JSON Schema the output must match (``required`` and named choices only)."""
        if self.choice == "required":
            return required_calls_schema(self.tools or [], self.parallel)
        if self.choice == "named":
            return named_function_schema(find_tool(self.tools or [], self.function_name))
        return None

    def tool_parser(self) -> Optional[ToolParser]:
        if self.choice == "auto":
            return TOOL_PARSERS[self.parser_name](self.tools)
        if self.choice == "required":
            return RequiredCallsParser(self.tools)
        if self.choice == "named":
            return NamedFunctionParser(self.function_name)
        return None

    @property
    def max_calls(self) -> Optional[int]:
        """``parallel_tool_calls: false``: at most one call comes back."""
        return None if self.parallel else 1


def plan_tools(options: ToolCallingOptions, tools, tool_choice, parallel_tool_calls: bool) -> ToolPlan:
    """Check the request's tool fields against each other and the server; 400 naming the field."""
    tool_dicts = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
    choice = tool_choice if tool_choice is not None else ("auto" if tool_dicts else "none")
    if not tool_dicts:
        if choice != "none":
            raise OpenAIError(400, "tool_choice: needs tools (only \"none\" may be given without them)",
                              "tool_choice")
        return ToolPlan()
    check_unique_names(tool_dicts)
    if isinstance(choice, str):
        if choice == "auto" and not (options.enable_auto_tool_choice and options.tool_call_parser):
            raise OpenAIError(400, 'tool_choice: "auto" tool choice requires the server to run with '
                                   "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")
        return ToolPlan(tool_dicts, choice, None, parallel_tool_calls,
                        options.tool_call_parser if choice == "auto" else None)
    name = choice.function.name
    if find_tool(tool_dicts, name) is None:
        known = ", ".join(repr(tool["function"]["name"]) for tool in tool_dicts)
        raise OpenAIError(400, f"tool_choice: function {name!r} is not among the tools ({known})", "tool_choice")
    return ToolPlan(tool_dicts, "named", name, parallel_tool_calls)


def check_unique_names(tools: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            raise OpenAIError(400, f"tools[{index}].function.name: {name!r} is defined twice",
                              f"tools[{index}].function.name")
        seen.add(name)


def find_tool(tools: list[dict[str, Any]], name: Optional[str]) -> Optional[dict[str, Any]]:
    return next((tool for tool in tools if tool["function"]["name"] == name), None)


def named_function_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The output is the named function's arguments: its parameters schema (any object without one)."""
    return copy.deepcopy(tool["function"].get("parameters") or ANY_OBJECT)


def required_calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A non-empty JSON array of ``{"name": ..., "parameters": ...}``, each a call of one of the
    tools with arguments valid for it (one call at most without parallel calls).

    Each tool's ``$defs`` move to the root under ``tool<index>.<name>`` and its ``$ref``s follow,
    since references resolve against the root of the combined schema.
    """
    definitions: dict[str, Any] = {}
    alternatives = []
    for index, tool in enumerate(tools):
        parameters = hoist_definitions(tool["function"].get("parameters") or ANY_OBJECT, f"tool{index}", definitions)
        alternatives.append({"type": "object",
                             "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                            "parameters": parameters},
                             "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def hoist_definitions(parameters: dict[str, Any], prefix: str, definitions: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``parameters`` without its own definitions, which go into ``definitions``; its
    references (``#/$defs/X``, ``#/definitions/X``, and ``#`` for the parameters themselves) are
    rewritten to point there."""
    parameters = copy.deepcopy(parameters)
    for key in ROOT_ONLY_KEYS:  # they belong to a schema's root; this one becomes a part
        parameters.pop(key, None)
    renamed: dict[str, str] = {"#": f"#/$defs/{prefix}"}
    for key in DEFINITION_KEYS:
        for name, definition in (parameters.pop(key, None) or {}).items():
            renamed[f"#/{key}/{name}"] = f"#/$defs/{prefix}.{name}"
            definitions[f"{prefix}.{name}"] = definition
    if not any(key.startswith("#/") for key in renamed) and not uses_root_reference(parameters):
        return parameters
    rewritten = rewrite_references(parameters, renamed)
    for name in [name for name in definitions if name.startswith(prefix + ".")]:
        definitions[name] = rewrite_references(definitions[name], renamed)
    if uses_root_reference(parameters):
        definitions[prefix] = rewritten
    return rewritten


def uses_root_reference(schema: Any) -> bool:
    if isinstance(schema, dict):
        return schema.get("$ref") == "#" or any(uses_root_reference(value) for value in schema.values())
    if isinstance(schema, list):
        return any(uses_root_reference(value) for value in schema)
    return False


def rewrite_references(schema: Any, renamed: dict[str, str]) -> Any:
    if isinstance(schema, list):
        return [rewrite_references(value, renamed) for value in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: rewrite_references(value, renamed) for key, value in schema.items()}
    reference = result.get("$ref")
    if isinstance(reference, str):
        result["$ref"] = rewrite_reference(reference, renamed)
    return result


def rewrite_reference(reference: str, renamed: dict[str, str]) -> str:
    if reference in renamed:
        return renamed[reference]
    for old, new in renamed.items():
        if old != "#" and reference.startswith(old + "/"):
            return new + reference[len(old):]
    return reference
