"""The two legs of one routed request: the prefill leg (never streamed) and the decode leg
(relayed to the client, streamed or not). As soon as either leg fails — an error status, an
error event in the decode stream, a dropped connection — both end: the other one is cancelled
(its server aborts the request and releases its pages) and the client gets an OpenAI-style error
(in-stream once streaming has begun: the answer is committed at the decode leg's first event,
``first_event``). A client that goes away cancels both legs. A server that
cannot be reached is reported to the router's ``BackendMonitor`` (no new requests go to it).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, NamedTuple, Optional

from fastapi.responses import JSONResponse, Response

from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.request_id import HEADER
from tandem.entrypoints.openai.serving import SSE_DONE, sse_event
from tandem.entrypoints.router.backends import Backend
from tandem.entrypoints.router.http import HTTP_ERRORS, UNREACHABLE, HttpResponse

if TYPE_CHECKING:
    from tandem.entrypoints.router.routing import Router

ERROR_EVENT_PREFIX = b'data: {"error"'
logger = logging.getLogger("tandem.router")


class FirstEvent(NamedTuple):
    """The decode leg's events and the (done) future of the first of them."""
    events: AsyncIterator[bytes]
    first: asyncio.Future


class LegFailed(Exception):
    """One leg ended in an error; ``status``, ``body`` and ``Retry-After`` are what the client gets."""

    def __init__(self, status: int, body: dict, unreachable: bool = False, retry_after: Optional[str] = None):
        super().__init__(body.get("error", {}).get("message", "leg failed"))
        self.status = status
        self.body = body
        self.unreachable = unreachable  # no connection was made: nothing reached the server
        self.retry_after = retry_after

    @property
    def busy(self) -> bool:
        """The server turned the request away before starting it (its queue is full)."""
        return self.status == 503

    def response(self) -> JSONResponse:
        headers = {"Retry-After": self.retry_after} if self.retry_after else None
        return JSONResponse(self.body, status_code=self.status, headers=headers)


def is_client_error(status: int) -> bool:
    """A 4xx: the request's own fault (a 499 is the client leaving, not an error of its request)."""
    return 400 <= status < 500 and status != 499


def failure_outcome(role: str, status: int) -> str:
    """The ``tandem:router_requests_total`` outcome of a request whose ``role`` leg answered ``status``."""
    return "client_error" if is_client_error(status) else f"{role}_failed"


def unreachable_error(role: str, backend: Backend, error: BaseException) -> LegFailed:
    """The leg's server failed at the connection level; connect errors mean it never got the request."""
    return LegFailed(502, error_body(502, f"the {role} server {backend.url} failed: {type(error).__name__}: {error}"),
                     unreachable=isinstance(error, UNREACHABLE))


def error_body(status: int, message: str) -> dict:
    return OpenAIError(status, message).body()


class Legs:
    """The two legs of one request; owns the decode response and counts both in flight."""

    def __init__(self, router: Router, prefill: Backend, decode: Backend, arrival: float = 0.0,
                 request_id: str = "", room: str = ""):
        self.router = router
        self.arrival = arrival  # the request's time.perf_counter() at the router
        self.request_id = request_id  # X-Request-Id (request_id.py), sent on both legs
        self.room = room
        self.headers = {HEADER: request_id} if request_id else {}
        self.prefill = prefill
        self.decode = decode
        self.decode_response: Optional[HttpResponse] = None
        self.failed_leg: Optional[str] = None
        for backend in (prefill, decode):
            backend.in_flight += 1
            backend.dispatched += 1
        self.decode_open = True
        self.prefill_open = True

    def _done(self, role: str) -> None:
        if role == "prefill" and self.prefill_open:
            self.prefill_open = False
            self.prefill.in_flight -= 1
        elif role == "decode" and self.decode_open:
            self.decode_open = False
            self.decode.in_flight -= 1

    async def run_prefill(self, path: str, body: dict) -> None:
        """The prefill leg; raises ``LegFailed`` when it ends in an error."""
        try:
            answer = await self.router.client.post(self.prefill.url + path, body, self.headers)
        except HTTP_ERRORS as error:
            self.router.monitor.mark_unhealthy(self.prefill, f"{type(error).__name__} on a request")
            raise unreachable_error("prefill", self.prefill, error) from None
        finally:
            self._done("prefill")
        if answer.status != 200:
            raise LegFailed(answer.status, response_error(answer.status, answer.content, "prefill"),
                            retry_after=answer.retry_after)

    async def open_decode(self, path: str, body: dict, prefill_task: asyncio.Task) -> HttpResponse:
        """Send the decode leg and wait for its status line; a prefill failure first wins."""
        decode_task = asyncio.create_task(self.router.client.open(self.decode.url + path, body, self.headers))
        try:
            await asyncio.wait({decode_task, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task.done() and prefill_task.exception() is not None and not decode_task.done():
                self.failed_leg = "prefill"
                raise prefill_task.exception()
            try:
                response = await decode_task
            except HTTP_ERRORS as error:
                self.failed_leg = "decode"
                self.router.monitor.mark_unhealthy(self.decode, f"{type(error).__name__} on a request")
                raise unreachable_error("decode", self.decode, error) from None
        except BaseException:
            if not decode_task.done():
                decode_task.cancel()
                await asyncio.gather(decode_task, return_exceptions=True)
            elif not decode_task.cancelled() and decode_task.exception() is None:
                decode_task.result().close()
            self._done("decode")
            raise
        self.decode_response = response
        if response.status != 200:
            failure = await refusal(response, "decode")
            self.failed_leg = "decode"
            self.close_decode()
            raise failure
        return response

    def log_failure(self, role: str, body: dict, status: int = 500) -> None:
        """One line per failed request: its id, its room (the servers' logs name rooms), both
        servers; at info for a client error (the request's fault, answered as the server did)."""
        message = body.get("error", {}).get("message", "") if isinstance(body, dict) else str(body)
        if is_client_error(status):
            logger.info("request %s refused by the %s server %s (room %s): %s", self.request_id, role,
                        self.prefill.url if role == "prefill" else self.decode.url, self.room, message)
            return
        logger.warning("request %s failed on the %s leg (room %s, prefill %s, decode %s): %s", self.request_id, role,
                       self.room, self.prefill.url, self.decode.url, message)

    def close_decode(self) -> None:
        if self.decode_response is not None:
            self.decode_response.close()
        self._done("decode")

    async def cancel(self, prefill_task: asyncio.Task) -> None:
        self.cancel_soon(prefill_task)
        await asyncio.gather(prefill_task, return_exceptions=True)

    def cancel_soon(self, task: asyncio.Task) -> None:
        """Cancel without waiting (safe inside a cancelled scope); the task ends on its own."""
        if not task.done():
            task.cancel()
        self.router.keep(task)
        task.add_done_callback(lambda done: done.cancelled() or done.exception())

    def finish_prefill_in_background(self, prefill_task: asyncio.Task) -> None:
        """The decode leg succeeded; the prefill leg (already done with its transfer) may still be
        answering: let it, without holding the client."""
        if not prefill_task.done():
            self.router.keep(prefill_task)
        prefill_task.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def collect(self, response: HttpResponse, prefill_task: asyncio.Task) -> Response:
        """Non-streaming: the decode body, unless either leg fails first."""
        read_task = asyncio.create_task(response.read())
        try:
            pending = {read_task, prefill_task}
            while read_task in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task in done and prefill_task.exception() is not None and read_task in pending:
                    failure = prefill_task.exception()
                    self.router.requests.labels(outcome=failure_outcome("prefill", failure.status)).inc()
                    self.log_failure("prefill", failure.body, failure.status)
                    return failure.response()
            try:
                content = read_task.result()
            except HTTP_ERRORS as error:
                self.router.monitor.mark_unhealthy(self.decode, f"{type(error).__name__} on a request")
                await self.cancel(prefill_task)
                self.router.requests.labels(outcome="decode_failed").inc()
                body = error_body(502, f"the decode server {self.decode.url} failed: {error}")
                self.log_failure("decode", body)
                return JSONResponse(body, status_code=502)
            self.finish_prefill_in_background(prefill_task)
            self.router.requests.labels(outcome="ok").inc()
            response.release()
            return Response(content, status_code=200, media_type=response.content_type)
        except asyncio.CancelledError:
            self.router.requests.labels(outcome="disconnected").inc()
            self.cancel_soon(prefill_task)
            raise
        finally:
            self.cancel_soon(read_task)
            self.close_decode()

    async def first_event(self, response: HttpResponse, prefill_task: asyncio.Task) -> FirstEvent:
        """Streaming: wait for the decode leg's first event before the answer is committed. It
        comes once the transfer is done, so a prefill leg that fails before it still gets its
        own status (and a busy prefill server's request may go elsewhere): raises LegFailed."""
        events = sse_events(response.chunks())
        first = asyncio.ensure_future(events.__anext__())
        pending = {first, prefill_task}
        try:
            while not first.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task in done and prefill_task.exception() is not None and not first.done():
                    self.failed_leg = "prefill"
                    self.cancel_soon(first)
                    self.close_decode()
                    raise prefill_task.exception()
        except asyncio.CancelledError:  # the client went away
            self.cancel_soon(first)
            raise
        return FirstEvent(events, first)

    async def relay(self, response: HttpResponse, prefill_task: asyncio.Task,
                    first: FirstEvent) -> AsyncIterator[bytes]:
        """Streaming: relay the decode server's SSE events (``first_event`` waited for the
        first), cutting both legs on the first error."""
        events, next_event = first
        outcome = "disconnected"
        try:
            while True:
                waiting = {next_event} if prefill_task.done() else {next_event, prefill_task}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task in done and prefill_task.exception() is not None and not next_event.done():
                    failure = prefill_task.exception()
                    outcome = failure_outcome("prefill", failure.status)
                    self.log_failure("prefill", failure.body, failure.status)
                    yield sse_event(prefill_task.exception().body)
                    yield SSE_DONE
                    return
                if not next_event.done():
                    continue
                try:
                    event = next_event.result()
                except StopAsyncIteration:
                    outcome = "ok"
                    response.release()
                    self.finish_prefill_in_background(prefill_task)
                    return
                except HTTP_ERRORS as error:
                    outcome = "decode_failed"
                    self.router.monitor.mark_unhealthy(self.decode, f"{type(error).__name__} on a request")
                    body = error_body(502, f"the decode server {self.decode.url} failed: {error}")
                    self.log_failure("decode", body)
                    yield sse_event(body)
                    yield SSE_DONE
                    return
                if self.arrival:  # the first event
                    self.router.record_first_event("prefill", time.perf_counter() - self.arrival)
                    self.arrival = 0.0
                yield event
                if event.startswith(ERROR_EVENT_PREFIX):
                    outcome = "decode_failed"
                    self.log_failure("decode", event_error(event))
                    yield SSE_DONE
                    return
                next_event = asyncio.ensure_future(events.__anext__())
        finally:
            # No awaits here: after a client disconnect this runs inside a cancelled scope.
            self.router.requests.labels(outcome=outcome).inc()
            self.cancel_soon(next_event)
            if outcome != "ok":
                self.cancel_soon(prefill_task)
            self.close_decode()


def event_error(event: bytes) -> dict:
    """The error body of an SSE error event (as much as can be read of it)."""
    try:
        return json.loads(event.removeprefix(b"data: "))
    except ValueError:
        return error_body(500, event[:200].decode("utf-8", "replace"))


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole SSE events (each ending in a blank line) from a byte stream."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            yield event + b"\n\n"
    if buffer.strip():
        yield buffer


async def refusal(response: HttpResponse, role: str) -> LegFailed:
    """The failure a server's non-200 answer to a streamed leg means (its body read, if it can be)."""
    try:
        content = await response.read()
    except HTTP_ERRORS:
        content = b""
    return LegFailed(response.status, response_error(response.status, content, role), retry_after=response.retry_after)


def response_error(status: int, content: bytes, role: str) -> dict:
    """The body a server's error answer gives the client: the server's own OpenAI error, if it is one."""
    try:
        body = json.loads(content)
        if isinstance(body, dict) and "error" in body:
            return body
    except ValueError:  # not JSON (nor UTF-8)
        pass
    text = content[:200].decode("utf-8", "replace")
    return error_body(status, f"the {role} server answered {status}: {text}")
