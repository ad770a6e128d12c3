"""OpenAI-style errors: one exception type, turned into ``{"error": {...}}`` bodies by handlers.

Body shape (what the official ``openai`` client parses)::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": 400}}
"""
from __future__ import annotations

import json
import re
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "method_not_allowed_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}
# The words every answer about the body as a whole uses, on the servers and the router alike.
BODY_NOT_OBJECT = "body: must be a JSON object"
# FastAPI answers a body it could not read as JSON (invalid UTF-8, above all) with this detail.
FASTAPI_BODY_PARSE_DETAIL = "There was an error parsing the body"
FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")  # "n", "response_format.type"
# Entries pydantic puts in an error location that name a type (a union member), not a field.
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


class OpenAIError(Exception):
    """An error answered with an OpenAI-style body; ``param`` names the offending field."""

    def __init__(self, status_code: int, message: str, param: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.headers = headers

    @classmethod
    def from_value_error(cls, error: ValueError, status_code: int = 400) -> "OpenAIError":
        """``ValueError("field: message")`` (the convention of SamplingParams and the engine)."""
        text = str(error)
        field, separator, _ = text.partition(":")
        param = field.strip() if separator and FIELD_NAME.match(field.strip()) else None
        return cls(status_code, text, param)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status_code, "error"),
                          "param": self.param, "code": self.status_code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def location_to_param(location: tuple) -> Optional[str]:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``; type tags are dropped."""
    parts: list[str] = []
    for item in location[1:] if location and location[0] == "body" else location:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and FIELD_NAME.match(item) and item not in TYPE_TAGS:
            parts.append(item if not parts else f".{item}")
    return "".join(parts) or None


def most_specific(errors: list[dict]) -> dict:
    """Of the errors about the first offending field, the one deepest inside it; at equal depth,
    one of our own checks (``value_error``) before a type mismatch.

    A value that fits no member of a union (a prompt) fails every member; the deepest location
    (``prompt[0][1]``) says what is wrong better than "should be a valid string", and so does
    the member whose type fitted (``[]`` is a list, which "must not be empty").
    """
    field = tuple(errors[0].get("loc", ()))[:2]
    same_field = [item for item in errors if tuple(item.get("loc", ()))[:2] == field]
    return max(same_field, key=lambda item: (len(item.get("loc", ())), item.get("type") == "value_error"))


def is_json_content_type(content_type: Optional[str]) -> bool:
    """Whether FastAPI parses a body of this content type as JSON (``application/json`` or
    ``application/*+json``, parameters aside)."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    main, _, subtype = media_type.partition("/")
    return main == "application" and (subtype == "json" or subtype.endswith("+json"))


def content_type_error(content_type: Optional[str]) -> OpenAIError:
    got = repr(content_type) if content_type else "none"
    return OpenAIError(400, f"body: send the JSON body with Content-Type: application/json (got {got})", "body")


def undecodable_body_error(raw: bytes) -> OpenAIError:
    """A body that is not UTF-8 text (JSON must be), or otherwise unreadable."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return OpenAIError(400, f"body: not valid UTF-8 (byte 0x{raw[error.start]:02x} at position {error.start}); "
                                "JSON bodies must be UTF-8 text", "body")
    return OpenAIError(400, "malformed JSON body: cannot parse", "body")


def validation_error(error: RequestValidationError) -> OpenAIError:
    """Turn FastAPI's validation failure into a 400 naming the first offending field.

    ``param`` is where the first error points (a union's field, not one of its members); the
    message says what is wrong at the most specific place inside it.
    """
    errors = error.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}", "body")
    param = location_to_param(tuple(first.get("loc", ())))
    detail = most_specific(errors) if errors else {}
    message = detail.get("msg", "invalid request")
    if detail.get("type") == "value_error" and "error" in detail.get("ctx", {}):
        message = str(detail["ctx"]["error"])  # our own checks' words, without pydantic's "Value error, "
    if param is None:
        if detail.get("type") in ("model_attributes_type", "dict_type", "model_type"):
            return OpenAIError(400, BODY_NOT_OBJECT, "body")
        return OpenAIError(400, f"invalid request body: {message}", "body")
    return OpenAIError(400, f"{location_to_param(tuple(detail.get('loc', ()))) or param}: {message}", param)


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app returns, including FastAPI's own, gets the OpenAI body shape."""

    @app.exception_handler(OpenAIError)
    async def handle_openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def handle_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI reads a body as JSON only under a JSON content type; any other is the reason
        # the body "is not an object", and the answer says so.
        content_type = request.headers.get("content-type")
        if request.method == "POST" and not is_json_content_type(content_type):
            return content_type_error(content_type).response()
        return validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def handle_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 400 and error.detail == FASTAPI_BODY_PARSE_DETAIL:
            return undecodable_body_error(await request.body()).response()
        # Keeps the router's headers: a 405 carries ``Allow`` (the methods the route declares).
        message = str(error.detail)
        if error.status_code == 405:
            allowed = (error.headers or {}).get("Allow", "")
            message = f"method {request.method} is not allowed on {request.url.path} (allowed: {allowed})"
        return OpenAIError(error.status_code, message, headers=error.headers).response()

    @app.exception_handler(json.JSONDecodeError)
    async def handle_json_error(request: Request, error: json.JSONDecodeError) -> JSONResponse:
        return OpenAIError(400, f"malformed JSON body: {error}", "body").response()

    @app.exception_handler(Exception)
    async def handle_unexpected_error(request: Request, error: Exception) -> JSONResponse:
        # Still logged (Starlette re-raises after answering); the client gets the error shape.
        return OpenAIError(500, f"internal error: {type(error).__name__}: {error}").response()
