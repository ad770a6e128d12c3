"""The router's HTTP client towards its servers: kept-alive connections (aiohttp, whose parser is
in C: the client is most of the router's own time per request; ``benchmarks/router_hop.py``),
JSON bodies encoded by msgspec, and one error type for everything that can go wrong on the wire.

``UNREACHABLE`` errors mean no connection was made, so the server never got the request (the
router may send it elsewhere); any other ``HTTP_ERRORS`` member means the server may have
started on it.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, NamedTuple, Optional

import aiohttp
import msgspec

HTTP_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
UNREACHABLE = (aiohttp.ClientConnectorError,)
CONNECT_TIMEOUT = 10.0
KEEPALIVE_SECONDS = 15.0  # below the servers' own keep-alive (30 s): the router closes first
_ENCODER = msgspec.json.Encoder()


class HttpAnswer(NamedTuple):
    """A whole answer: status, body, and its ``Retry-After`` header (a busy server's advice)."""
    status: int
    content: bytes
    retry_after: Optional[str] = None


class HttpResponse:
    """One answer: its status, and its body read whole (``read``) or as it arrives (``chunks``)."""

    def __init__(self, response: aiohttp.ClientResponse):
        self._response = response
        self.status = response.status
        self.content_type = response.headers.get("Content-Type")
        self.retry_after = response.headers.get("Retry-After")

    async def read(self) -> bytes:
        return await self._response.read()

    def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they come (chunked transfer decoded)."""
        return self._response.content.iter_any()

    def close(self) -> None:
        """Stop reading: the connection is closed, which the server takes as the client leaving."""
        self._response.close()

    def release(self) -> None:
        """Done with a body read to its end: the connection goes back to the pool."""
        self._response.release()


class HttpClient:
    """Pooled connections to every server; created on its event loop at first use."""

    def __init__(self, headers: Optional[dict[str, str]] = None):
        self.headers = dict(headers or {})
        self._session: Optional[aiohttp.ClientSession] = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS)
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self.headers, auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT))
        return self._session

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        """Status and body of ``GET url``, everything within ``timeout`` seconds."""
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            return response.status, await response.read()

    async def post(self, url: str, body: dict, headers: Optional[dict[str, str]] = None) -> HttpAnswer:
        """The whole answer to ``POST url`` with a JSON body."""
        async with self.session.post(url, data=_ENCODER.encode(body), headers={**_JSON, **(headers or {})}) \
                as response:
            return HttpAnswer(response.status, await response.read(), response.headers.get("Retry-After"))

    async def open(self, url: str, body: dict, headers: Optional[dict[str, str]] = None) -> HttpResponse:
        """``POST url`` with a JSON body, returned once the status line and headers are in; the
        body is left to read (``HttpResponse.chunks``); close or release it when done."""
        response = await self.session.post(url, data=_ENCODER.encode(body), headers={**_JSON, **(headers or {})})
        return HttpResponse(response)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


_JSON = {"Content-Type": "application/json"}
