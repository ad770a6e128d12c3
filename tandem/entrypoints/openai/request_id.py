"""``X-Request-Id``: one id for a request across the router and both PD servers.

A client may name its request with an ``X-Request-Id`` header (1 to ``MAX_LENGTH`` visible ASCII
characters; anything else is a 400 naming the header); without one, the first process it reaches
makes one. Every answer carries the id back in the same header, errors included; the router sends
it on both legs and logs it with the PD room of a request that fails, so a request a client saw
fail can be found in the servers' logs (which name rooms). Handlers read it as
``request.state.request_id``.
"""
from __future__ import annotations

import json
import re
import uuid

from tandem.entrypoints.openai.errors import OpenAIError

HEADER = "X-Request-Id"
MAX_LENGTH = 128
_RAW_HEADER = HEADER.lower().encode()
_VALID = re.compile(rb"[!-~]{1,%d}" % MAX_LENGTH)


def request_id_of(scope) -> str:
    """The id ``RequestIdMiddleware`` gave this request."""
    return scope["state"]["request_id"]


class RequestIdMiddleware:
    """Pure ASGI: checks or makes the id, stores it in the request's state, echoes it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == _RAW_HEADER), None)
        if given is not None and not _VALID.fullmatch(given):
            await _reject(send, len(given))
            return
        request_id = given.decode() if given is not None else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        echoed = (_RAW_HEADER, request_id.encode())

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), echoed]}
            await send(message)

        await self.app(scope, receive, send_with_id)


async def _reject(send, length: int) -> None:
    error = OpenAIError(400, f"{HEADER}: must be 1 to {MAX_LENGTH} visible ASCII characters (got {length} bytes)",
                        HEADER)
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
