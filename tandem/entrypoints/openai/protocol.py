"""Pydantic models of the OpenAI-compatible requests and responses.

The request models carry every constraint the server enforces that JSON Schema can state, once:
the same annotation (``Range``, ``NonEmpty``, ``Text``) both checks a value (a 400 naming the
field) and writes the bound into ``/openapi.json``. Bounds that depend on the served model
(token ids below the vocabulary size, lengths below the context length, the served model names)
are marked with ``LIMIT_KEY`` and filled in per server by ``openapi.server_openapi``; the route
handlers enforce them. Rules that relate two fields or depend on the tokenized prompt are stated in
``CROSS_FIELD_RULES`` (and in the schema's descriptions): JSON Schema cannot express them.

Unknown fields are ignored, as OpenAI-compatible servers usually do. Responses are built as plain
dicts; ``responses.py`` documents them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import jsonschema

from pydantic import AfterValidator, AllowInfNan, BaseModel, BeforeValidator, ConfigDict, Field, Strict
from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler, StrictBool, StrictInt, StrictStr
from pydantic_core import core_schema
from typing_extensions import Annotated

from tandem.sampling_params import SamplingParams, StructuredOutputsParams

ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]

# Integers every JSON parser reads exactly (RFC 8259 section 6); schema validators compare in floats.
MAX_SAFE_INTEGER = (1 << 53) - 1
INT32_MAX = (1 << 31) - 1
MAX_N = 128  # choices per prompt (OpenAI's limit)
MAX_LOGPROBS = 20  # SamplingParams' limit for logprobs and prompt_logprobs
# Keys of ``chat_template_kwargs`` that would change how the template is called rather than what it sees.
RESERVED_TEMPLATE_KWARGS = ("add_generation_prompt", "chat_template", "continue_final_message", "conversation",
                            "conversations", "documents", "max_length", "messages", "padding",
                            "return_assistant_tokens_mask", "return_dict", "return_tensors",
                            "sanitize_control_tokens", "tokenize", "tokenizer_kwargs", "tools", "truncation")
# Where the served model sets a bound: ``{LIMIT_KEY: "token_id"}`` -> maximum vocab_size - 1;
# "generation_length" -> maximum max_model_len - 1; "model" -> one of the served names.
LIMIT_KEY = "x-tandem-limit"
CROSS_FIELD_RULES = (
    "the prompt (after the chat template, for chat) plus max_tokens (or max_completion_tokens) must fit "
    "max_model_len; with max_tokens absent, the prompt must leave at least one token to generate "
    "(400 naming prompt, messages, max_tokens or max_completion_tokens)",
    "min_tokens must not exceed max_tokens, or what the prompt leaves of max_model_len when max_tokens is "
    "absent (400 naming min_tokens)",
    "completions: best_of, when given, must equal n (400 naming best_of)",
    "chat: top_logprobs needs logprobs true (stated in the schema as well; 400 naming top_logprobs)",
    "chat: a named tool_choice must name one of the tools, and tool names must be unique (400 naming "
    "tool_choice or tools[i].function.name)",
    "chat and tokenize: tools[i].function.parameters must be a valid JSON Schema, and "
    "messages[i].tool_calls[j].function.arguments JSON text (400 naming the field)",
)


def describe_range(low, high, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    return f"{'<' if high_open else '<='} {high}"


@dataclass(frozen=True)
class Range:
    """A numeric bound, checked (``ValueError("must be ...")``) and written into the JSON schema."""
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def __get_pydantic_core_schema__(self, source, handler: GetCoreSchemaHandler):
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema, handler: GetJsonSchemaHandler):
        json_schema = handler(schema)
        if self.low is not None:
            json_schema["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            json_schema["exclusiveMaximum" if self.high_open else "maximum"] = self.high
        return json_schema

    def check(self, value):
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        if not (above and below):
            raise ValueError(f"must be {describe_range(self.low, self.high, self.low_open, self.high_open)}, "
                             f"got {value!r}")
        return value


@dataclass(frozen=True)
class NonEmpty:
    """At least one character or item (``minLength``/``minItems`` 1)."""

    def __get_pydantic_core_schema__(self, source, handler: GetCoreSchemaHandler):
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema, handler: GetJsonSchemaHandler):
        json_schema = handler(schema)
        json_schema["minLength" if json_schema.get("type") == "string" else "minItems"] = 1
        return json_schema

    @staticmethod
    def check(value):
        if len(value) == 0:
            raise ValueError("must not be empty")
        return value


def check_unicode(value: str) -> str:
    """JSON may carry lone surrogates (``"\\ud800"``); no tokenizer can encode them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"must be valid Unicode text (lone surrogate at position {error.start})") from None
    return value


@dataclass(frozen=True)
class ValidUnicode:
    """No lone surrogates (a JSON schema cannot say so; the server answers 400)."""

    def __get_pydantic_core_schema__(self, source, handler: GetCoreSchemaHandler):
        return core_schema.no_info_after_validator_function(check_unicode, handler(source))


def integral(value):
    """JSON Schema counts ``2.0`` as an integer; so does the server (``2.5``, ``true`` and ``"2"`` are not)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def limited(name: str) -> Any:
    """Mark a bound that the served model sets (see ``LIMIT_KEY``)."""
    return Field(json_schema_extra={LIMIT_KEY: name})


Integer = Annotated[StrictInt, BeforeValidator(integral)]
Text = Annotated[StrictStr, ValidUnicode()]
NonEmptyText = Annotated[StrictStr, ValidUnicode(), NonEmpty()]
Number = Annotated[float, Strict(), AllowInfNan(False)]  # a JSON number (an integer is one too), finite
TokenId = Annotated[Integer, Range(0), limited("token_id")]
GenerationLength = Annotated[Integer, Range(1), limited("generation_length")]
ModelName = Annotated[Optional[Text], limited("model")]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool = False


class TransferParamsModel(OpenAIBaseModel):
    """A PD leg, set by ``tandem router`` (``role`` must equal the server's)."""
    room: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{32}$")]
    role: Literal["prefill", "decode"]
    prefill_address: Optional[Text] = None


# Rules of the structured-outputs fields JSON Schema cannot state (each field's description).
STRUCTURED_OUTPUTS_RULE = (
    "structured_outputs sets exactly one of json, json_object (true), regex, choice, grammar; the JSON "
    "Schema, regex or EBNF grammar must parse; response_format json_schema needs json_schema.schema; "
    "response_format (other than text) and structured_outputs exclude each other, and either excludes "
    "ignore_eos and min_tokens > 0 (400 naming the field)")


class JsonSchemaFormat(OpenAIBaseModel):
    name: Text = "response"
    description: Optional[Text] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="the JSON Schema the answer must match")
    strict: Optional[StrictBool] = Field(None, description="the schema is enforced exactly either way")


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON matching a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = Field(None, description="with type json_schema (required there)")


class StructuredOutputsModel(OpenAIBaseModel):
    """vLLM's ``structured_outputs``: exactly one of json, json_object, regex, choice, grammar."""
    json_: Optional[Union[dict[str, Any], Text]] = Field(None, alias="json", description="a JSON Schema")
    json_object: Optional[StrictBool] = None
    regex: Optional[NonEmptyText] = None
    choice: Optional[Annotated[list[NonEmptyText], NonEmpty()]] = None
    grammar: Optional[NonEmptyText] = Field(None, description="an EBNF grammar (GBNF style; root rule: root)")
    disable_any_whitespace: StrictBool = Field(True, description="JSON: bounded whitespace between tokens "
                                                                 "(false: any whitespace)")


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""
    model: ModelName = Field(None, description="one of the served model names; absent, null or empty: the first")
    n: Annotated[Integer, Range(1, MAX_N)] = 1
    temperature: Optional[Annotated[Number, Range(0)]] = None
    top_p: Optional[Annotated[Number, Range(0, 1, low_open=True)]] = None
    top_k: Optional[Annotated[Integer, Range(-1, INT32_MAX)]] = Field(None, description="-1 or 0: off")
    min_p: Optional[Annotated[Number, Range(0, 1)]] = None
    seed: Optional[Annotated[Integer, Range(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER)]] = None
    stop: Optional[Union[NonEmptyText, list[NonEmptyText]]] = None
    stop_token_ids: Optional[list[TokenId]] = None
    presence_penalty: Annotated[Number, Range(-2, 2)] = 0.0
    frequency_penalty: Annotated[Number, Range(-2, 2)] = 0.0
    repetition_penalty: Annotated[Number, Range(0, low_open=True)] = 1.0
    ignore_eos: StrictBool = False
    min_tokens: Annotated[Integer, Range(0), limited("generation_length")] = Field(
        0, description="at most max_tokens (or what the prompt leaves of the context)")
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    return_token_ids: StrictBool = False
    user: Optional[Text] = None
    # Prefill/decode disaggregation: set by ``tandem router`` on each leg; clients never send it.
    # A colocated server accepts only null (its schema says so).
    kv_transfer_params: Optional[TransferParamsModel] = Field(
        None, description="set by tandem router on prefill/decode servers; clients never send it")
    # Structured outputs (either, not both): OpenAI's response_format, vLLM's structured_outputs.
    response_format: Optional[ResponseFormat] = Field(None, description=STRUCTURED_OUTPUTS_RULE)
    structured_outputs: Optional[StructuredOutputsModel] = Field(None, description=STRUCTURED_OUTPUTS_RULE)

    def sampling_params(self, max_tokens: int, logprobs: Optional[int], prompt_logprobs: Optional[int]) -> SamplingParams:
        """Build (and so validate) the engine's parameters; raises ``ValueError("field: ...")``."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_constraint(),
        )

    def structured_constraint(self) -> Optional[StructuredOutputsParams]:
        """The constraint ``response_format`` or ``structured_outputs`` asks for, its grammar
        checked; raises ``ValueError("field: ...")`` naming the field at fault."""
        from tandem.structured.source import check

        response_format = self.response_format
        wants_format = response_format is not None and response_format.type != "text"
        if wants_format and self.structured_outputs is not None:
            raise ValueError("structured_outputs: cannot be combined with response_format (give one of them)")
        if wants_format:
            if response_format.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if response_format.json_schema is None or response_format.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema: a schema is required with type json_schema")
            constraint = StructuredOutputsParams(json=response_format.json_schema.schema_)
            check(constraint, "response_format.json_schema.schema")
            return constraint
        fields = self.structured_outputs
        if fields is None:
            return None
        constraint = StructuredOutputsParams(json=fields.json_, json_object=bool(fields.json_object),
                                             regex=fields.regex, choice=fields.choice, grammar=fields.grammar,
                                             disable_any_whitespace=fields.disable_any_whitespace)
        check(constraint)
        return constraint

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


CompletionPrompt = Union[NonEmptyText, Annotated[list[NonEmptyText], NonEmpty()],
                         Annotated[list[TokenId], NonEmpty()],
                         Annotated[list[Annotated[list[TokenId], NonEmpty()]], NonEmpty()]]


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"description": "Rules JSON Schema cannot state: "
                                                 + "; ".join(CROSS_FIELD_RULES[:3]) + "."})
    prompt: CompletionPrompt = Field(description="a string, strings, token ids, or lists of token ids; none empty")
    max_tokens: Optional[GenerationLength] = Field(16, description="null: what the prompt leaves of the context")
    echo: StrictBool = False
    logprobs: Optional[Annotated[Integer, Range(0, MAX_LOGPROBS)]] = None
    best_of: Optional[Annotated[Integer, Range(1, MAX_N)]] = Field(None, description="must equal n")
    suffix: Optional[Annotated[StrictStr, Field(max_length=0)]] = Field(None, description="not supported: "
                                                                             "empty or null only")


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: Text


def check_json_text(value: str) -> str:
    try:
        json.loads(value)
    except ValueError as error:
        raise ValueError(f"must be JSON text: {error}") from None
    return value


def check_parameters_schema(value: dict[str, Any]) -> dict[str, Any]:
    """A JSON Schema (of its own ``$schema`` draft, else 2020-12), checked against its meta-schema."""
    try:
        jsonschema.validators.validator_for(value, default=jsonschema.Draft202012Validator).check_schema(value)
    except jsonschema.SchemaError as error:
        where = "".join(f"[{part!r}]" for part in error.path)
        raise ValueError(f"not a valid JSON Schema{' at ' + where if where else ''}: {error.message}") from None
    except Exception as error:  # noqa: BLE001 - a schema so odd the checker itself fails on it
        raise ValueError(f"not a valid JSON Schema: {error}") from None
    return value


# OpenAI's rule for function names, with "." and ":" as namespaced tool names use them.
FunctionName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionCall(OpenAIBaseModel):
    name: Text
    arguments: Annotated[Text, AfterValidator(check_json_text)] = Field(
        description="the arguments as JSON text (as the server returned them)")


class ToolCall(OpenAIBaseModel):
    """A call an earlier assistant turn made (``messages[].tool_calls``)."""
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(OpenAIBaseModel):
    name: FunctionName
    description: Optional[Text] = None
    parameters: Optional[Annotated[dict[str, Any], AfterValidator(check_parameters_schema)]] = Field(
        None, description="a JSON Schema of the arguments object")
    strict: Optional[StrictBool] = Field(None, description="required and named tool choices match the schema "
                                         "exactly either way; auto calls are written by the model")


class ToolDefinition(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: Text


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ChatMessage(OpenAIBaseModel):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        # a tool result names the call it answers; only assistant turns carry calls
        {"if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
         "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}},
        {"if": {"properties": {"tool_calls": {"type": "array"}}, "required": ["tool_calls"]},
         "then": {"properties": {"role": {"const": "assistant"}}}}]})
    role: ChatRole
    content: Optional[Union[Text, list[TextContentPart]]] = None
    name: Optional[Text] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="assistant messages only")
    tool_call_id: Optional[NonEmptyText] = Field(None, description="tool messages: the call answered (required)")
    reasoning_content: Optional[Text] = Field(None, description="assistant messages: the thinking a server "
                                              "returned, for templates that show it again")

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content flattened to one string, tool-call
        arguments as objects (templates write them with ``tojson``)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": call.type,
                                      "function": {"name": call.function.name,
                                                   "arguments": json.loads(call.function.arguments)}}
                                     for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


def check_template_kwargs(kwargs: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    reserved = sorted(set(kwargs or ()) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"key {reserved[0]!r} is reserved (it would change how the template is called)")
    return kwargs


TemplateKwargs = Annotated[dict[Text, Any], AfterValidator(check_template_kwargs), Field(json_schema_extra={
    "propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}}})]


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={
        "description": "Rules JSON Schema cannot state: " + "; ".join(CROSS_FIELD_RULES[:2]) + ".",
        # top_logprobs needs logprobs true (what the route checks; the schema states it too)
        "anyOf": [{"properties": {"top_logprobs": {"type": "null"}}},
                  {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}],
        # a tool_choice other than none needs tools
        "allOf": [{"if": {"properties": {"tool_choice": {"not": {"enum": ["none", None]}}}, "required": ["tool_choice"]},
                   "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}}]})
    messages: Annotated[list[ChatMessage], NonEmpty()]
    max_tokens: Optional[GenerationLength] = Field(None, description="null: what the prompt leaves of the "
                                                                     "context; max_completion_tokens wins")
    max_completion_tokens: Optional[GenerationLength] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[Annotated[Integer, Range(0, MAX_LOGPROBS)]] = Field(
        None, description="needs logprobs true")
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: Optional[TemplateKwargs] = Field(None, description="extra variables for the chat "
                                                           "template; reserved keys are rejected")
    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Optional[ToolChoice] = Field(None, description="none, auto (the default with tools; needs "
                                              "--enable-auto-tool-choice), required, or a named function")
    parallel_tool_calls: StrictBool = Field(True, description="false: at most one call")

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(OpenAIBaseModel):
    """Exactly one of ``prompt`` and ``messages`` (null counts as absent)."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"},
                                                "tools": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]})
    model: ModelName = None
    prompt: Optional[Text] = None
    messages: Optional[Annotated[list[ChatMessage], NonEmpty()]] = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    tools: Optional[list[ToolDefinition]] = Field(None, description="with messages: the tools the template shows")


class DetokenizeRequest(OpenAIBaseModel):
    model: ModelName = None
    tokens: list[TokenId]
