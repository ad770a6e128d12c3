"""One routed request on one colocated server (``tandem router --server``): the server computes
the whole request, and its answer — streamed or not — is relayed as it is. A server that cannot
be connected to is reported to the router's ``BackendMonitor`` (no new requests go to it); one
whose connection drops mid-answer ends the client's answer with an OpenAI-style error (in-stream
once streaming has begun). A client that goes away closes the connection, which the server takes
as an abort.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, Optional

from fastapi.responses import JSONResponse, Response

from tandem.entrypoints.openai.request_id import HEADER
from tandem.entrypoints.openai.serving import SSE_DONE, sse_event
from tandem.entrypoints.router.backends import Backend
from tandem.entrypoints.router.http import HTTP_ERRORS, HttpResponse
from tandem.entrypoints.router.legs import (ERROR_EVENT_PREFIX, error_body, event_error, refusal, sse_events,
                                            unreachable_error)

if TYPE_CHECKING:
    from tandem.entrypoints.router.routing import Router

OUTCOME_FAILED = "server_failed"
logger = logging.getLogger("tandem.router")


class SingleLeg:
    """The one leg of a request sent to a colocated server; owns its response and counts it in
    flight on its backend from construction until ``close``."""

    def __init__(self, router: Router, server: Backend, arrival: float = 0.0, request_id: str = ""):
        self.router = router
        self.server = server
        self.arrival = arrival  # the request's time.perf_counter() at the router
        self.request_id = request_id
        self.headers = {HEADER: request_id} if request_id else {}
        self.response: Optional[HttpResponse] = None
        self.open_ = True
        server.in_flight += 1
        server.dispatched += 1

    def close(self) -> None:
        if self.response is not None:
            self.response.close()
        if self.open_:
            self.open_ = False
            self.server.in_flight -= 1

    async def open(self, path: str, body: dict) -> HttpResponse:
        """Send the request and wait for the status line; raises ``LegFailed`` (and closes) when
        the server cannot be reached or answers with an error status."""
        try:
            response = await self.router.client.open(self.server.url + path, body, self.headers)
        except HTTP_ERRORS as error:
            self.router.monitor.mark_unhealthy(self.server, f"{type(error).__name__} on a request")
            self.close()
            raise unreachable_error("colocated", self.server, error) from None
        self.response = response
        if response.status != 200:
            failure = await refusal(response, "colocated")
            self.close()
            raise failure
        return response

    def log_failure(self, body: dict) -> None:
        message = body.get("error", {}).get("message", "") if isinstance(body, dict) else str(body)
        logger.warning("request %s failed on server %s: %s", self.request_id, self.server.url, message)

    async def collect(self) -> Response:
        """Non-streaming: the server's body as it is."""
        response = self.response
        try:
            content = await response.read()
        except HTTP_ERRORS as error:
            self.router.monitor.mark_unhealthy(self.server, f"{type(error).__name__} on a request")
            self.close()
            self.router.requests.labels(outcome=OUTCOME_FAILED).inc()
            body = error_body(502, f"the server {self.server.url} failed: {error}")
            self.log_failure(body)
            return JSONResponse(body, status_code=502)
        except BaseException:
            self.close()
            self.router.requests.labels(outcome="disconnected").inc()
            raise
        response.release()
        self.response = None
        self.close()
        self.router.requests.labels(outcome="ok").inc()
        return Response(content, status_code=200, media_type=response.content_type)

    async def relay(self) -> AsyncIterator[bytes]:
        """Streaming: the server's SSE events, ended by an error event if the server fails."""
        response, outcome = self.response, "disconnected"
        try:
            async for event in sse_events(response.chunks()):
                if self.arrival:  # the first event
                    self.router.record_first_event("colocated", time.perf_counter() - self.arrival)
                    self.arrival = 0.0
                yield event
                if event.startswith(ERROR_EVENT_PREFIX):
                    outcome = OUTCOME_FAILED
                    self.log_failure(event_error(event))
                    yield SSE_DONE
                    return
            outcome = "ok"
            response.release()
            self.response = None
        except HTTP_ERRORS as error:
            outcome = OUTCOME_FAILED
            self.router.monitor.mark_unhealthy(self.server, f"{type(error).__name__} on a request")
            body = error_body(502, f"the server {self.server.url} failed: {error}")
            self.log_failure(body)
            yield sse_event(body)
            yield SSE_DONE
        finally:
            # No awaits here: after a client disconnect this runs inside a cancelled scope.
            self.router.requests.labels(outcome=outcome).inc()
            self.close()
