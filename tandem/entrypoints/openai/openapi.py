"""The server's ``/openapi.json``: what each route answers, errors included, for this server.

FastAPI writes the schema from the routes and the request models; ``server_openapi`` then makes it
say what this server does:

* no 422 anywhere (the server answers a failed validation with 400, naming the field);
* bounds that the served model sets, filled in (``protocol.LIMIT_KEY``): token ids below the
  vocabulary size, generation lengths below the context length, the served model names;
* ``kv_transfer_params`` as this server's role accepts it (null only on a colocated server);
* the bearer scheme on the routes that need the API key, when the server has one.

Error responses are declared per route with ``error_responses`` (OpenAI's error body).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from tandem.entrypoints.openai.protocol import CROSS_FIELD_RULES, LIMIT_KEY
from tandem.entrypoints.openai.responses import ChatCompletionChunk, CompletionChunk, ErrorResponse

SECURITY_SCHEME = "api_key"
RETRY_AFTER_HEADER = {"Retry-After": {"description": "seconds to wait before retrying", "required": True,
                                      "schema": {"type": "integer", "minimum": 0}}}
ERROR_DESCRIPTIONS = {
    400: "Invalid request: a field of the wrong type or out of range, a rule between fields broken, malformed "
         "JSON or a missing body; `param` names the field (`body` for the body as a whole). Validation "
         "failures are 400, never 422.",
    401: "Missing or wrong API key (send `Authorization: Bearer KEY`).",
    404: "The model named in `model` is not served here; `param` is `model`.",
    500: "The engine failed this request (a streamed response reports it as a last event before `[DONE]`).",
    503: "The engine is not available, or the waiting queue is full; retry after `Retry-After` seconds.",
}
SERVER_DESCRIPTION = (
    "OpenAI-compatible server. Every error has OpenAI's shape, `{\"error\": {\"message\", \"type\", \"param\", "
    "\"code\"}}`. A request that fails validation is answered 400 naming the field (never 422). A method a "
    "route does not declare is answered 405 with an `Allow` header listing the methods it does. Rules between "
    "fields that JSON Schema cannot state (each a 400 naming the field): " + "; ".join(CROSS_FIELD_RULES) + "."
)


COMPONENT_REF = "#/components/schemas/{model}"
STREAMED_MODELS = (CompletionChunk, ChatCompletionChunk, ErrorResponse)  # referenced from event streams only


def sse_content(chunk_model: type) -> dict[str, Any]:
    """A streamed 200: every event's ``data`` is a JSON chunk, an in-stream error, or ``[DONE]``."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [{"$ref": COMPONENT_REF.format(model=chunk_model.__name__)},
                                             {"$ref": COMPONENT_REF.format(model="ErrorResponse")}]}}
    return {"text/event-stream": {"schema": {
        "description": "with stream true, one server-sent event per schema: `data:` a chunk (only what is new), "
                       "then `data: [DONE]`; a failure after the first event arrives as an error body before "
                       "`[DONE]`",
        "type": "object", "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, {"not": {"const": "[DONE]"}, **json_data}]}}}}}


def error_responses(*codes: int, authenticated: bool = False) -> dict[int, dict[str, Any]]:
    """The ``responses=`` of a route: each status with the error body (401 when ``authenticated``)."""
    statuses = sorted(set(codes) | ({401} if authenticated else set()))
    responses: dict[int, dict[str, Any]] = {}
    for status in statuses:
        responses[status] = {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
        if status == 503:
            responses[status]["headers"] = RETRY_AFTER_HEADER
        if status == 401:
            responses[status]["headers"] = {"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}}
    return responses


def server_openapi(app: FastAPI, *, vocab_size: int, max_model_len: int, served_model_names: Iterable[str],
                   role: str, api_key_routes: Optional[set[str]], auto_tool_choice: bool = False) -> dict[str, Any]:
    """Build (once) the schema this server serves; ``api_key_routes``: paths needing the key, or None."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                         description=SERVER_DESCRIPTION, routes=app.routes)
    drop_validation_errors(schema)
    add_models(schema, STREAMED_MODELS)
    limits = {"token_id": {"maximum": vocab_size - 1}, "generation_length": {"maximum": max_model_len - 1}}
    names = list(dict.fromkeys(served_model_names))
    fill_limits(schema.get("components", {}).get("schemas", {}), limits, names)
    set_transfer_role(schema.get("components", {}).get("schemas", {}), role)
    if not auto_tool_choice:
        forbid_auto_tool_choice(schema.get("components", {}).get("schemas", {}))
    if api_key_routes:
        schema.setdefault("components", {})["securitySchemes"] = {
            SECURITY_SCHEME: {"type": "http", "scheme": "bearer", "description": "the server's --api-key"}}
        for path, operations in schema.get("paths", {}).items():
            if path in api_key_routes:
                for operation in operations.values():
                    operation["security"] = [{SECURITY_SCHEME: []}]
    app.openapi_schema = schema
    return schema


def add_models(schema: dict[str, Any], models: Iterable[type]) -> None:
    """Put models that no route names directly (the chunks of event streams) into the components."""
    _, definitions = models_json_schema([(model, "serialization") for model in models], ref_template=COMPONENT_REF)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in definitions.get("$defs", {}).items():
        components.setdefault(name, definition)


def drop_validation_errors(schema: dict[str, Any]) -> None:
    """FastAPI documents 422 on every route with a body; this server answers 400 instead."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def fill_limits(node: Any, limits: dict[str, dict[str, Any]], model_names: list[str]) -> None:
    """Replace every ``LIMIT_KEY`` marker with the bound it stands for (in place, recursively)."""
    if isinstance(node, list):
        for item in node:
            fill_limits(item, limits, model_names)
        return
    if not isinstance(node, dict):
        return
    limit = node.pop(LIMIT_KEY, None)
    if limit == "model":
        node.pop("anyOf", None)
        node.pop("type", None)
        node["anyOf"] = [{"type": "string", "enum": [*model_names, ""]}, {"type": "null"}]
    elif limit is not None:
        node.update(limits[limit])
    for value in node.values():
        fill_limits(value, limits, model_names)


def set_transfer_role(components: dict[str, Any], role: str) -> None:
    """A colocated server accepts only a null ``kv_transfer_params``; a PD server, legs of its role."""
    for name, model in components.items():
        transfer = model.get("properties", {}).get("kv_transfer_params")
        if transfer is None:
            continue
        if role == "colocated":
            model["properties"]["kv_transfer_params"] = {
                "type": "null", "default": None,
                "description": "set by tandem router on prefill/decode servers; a colocated server accepts null only"}
    params = components.get("TransferParamsModel")
    if params is not None:
        if role == "colocated":
            components.pop("TransferParamsModel")
        else:
            params["properties"]["role"] = {"const": role, "type": "string",
                                            "description": "this server's role"}
    if role == "colocated":
        return
    # A PD leg serves n=1 and no prompt logprobs (the engine's rule, answered 400 naming the field).
    leg = {"properties": {"kv_transfer_params": {"type": "object"}}, "required": ["kv_transfer_params"]}
    for name, extra in (("CompletionRequest", [{"not": {"properties": {"echo": {"const": True},
                                                                       "logprobs": {"type": "integer"}},
                                                        "required": ["echo", "logprobs"]}}]),
                        ("ChatCompletionRequest", [])):
        if name in components:
            rule = {"if": leg, "then": {"allOf": [{"properties": {"n": {"const": 1}}}, *extra]}}
            components[name].setdefault("allOf", []).append(rule)


def forbid_auto_tool_choice(components: dict[str, Any]) -> None:
    """Without --enable-auto-tool-choice, tools need a tool_choice other than auto (absent or null
    means auto when tools are given; answered 400 naming tool_choice)."""
    chat = components.get("ChatCompletionRequest")
    if chat is None:
        return
    with_tools = {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}
    rule = {"if": with_tools, "then": {"properties": {"tool_choice": {"not": {"enum": ["auto", None]}}},
                                      "required": ["tool_choice"]}}
    chat.setdefault("allOf", []).append(rule)
