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
    """Of the errors about the first offending field, the one deepest inside it.

    A value that fits no member of a union (a prompt) fails every member; the deepest location
    (``prompt[0][1]``) says what is wrong better than "should be a valid string".
    """
    field = tuple(errors[0].get("loc", ()))[:2]
    same_field = [item for item in errors if tuple(item.get("loc", ()))[:2] == field]
    return max(same_field, key=lambda item: len(item.get("loc", ())))


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
        return OpenAIError(400, f"invalid request body: {message}", "body")
    return OpenAIError(400, f"{location_to_param(tuple(detail.get('loc', ()))) or param}: {message}", param)


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app returns, including FastAPI's own, gets the OpenAI body shape."""

    @app.exception_handler(OpenAIError)
    async def handle_openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def handle_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def handle_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
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
