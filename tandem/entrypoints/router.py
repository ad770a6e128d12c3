"""``tandem router``: one OpenAI-compatible endpoint in front of prefill and decode servers.

For each request the router picks a prefill and a decode server that serve the requested model
(least loaded, or round robin), makes a 128-bit room id, and sends the request to both at once:

    client --> router --(kv_transfer_params: room, role=prefill)--> prefill server  (not streamed)
                      --(kv_transfer_params: room, role=decode,  --> decode server   (streamed back)
                          prefill_address)

The client gets the decode server's response (SSE when it asked for a stream). As soon as either
leg fails — an error status, an error event in the decode stream, a dropped connection — both
legs end: the other one is cancelled (its server aborts the request and releases its pages) and
the client gets an OpenAI-style error (in-stream once streaming has begun). A client that goes
away cancels both legs.

A router fronts the servers of one model. At start it reads ``GET /pd/info`` of every server:
roles must match the flags, the servers must share a served model name, and every prefill/decode
pair must agree on page size, model, dtypes and the ordered state buffers (the handshake the
engines repeat when they connect); a mismatch stops the router with the first difference named.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from tandem.entrypoints.openai.errors import OpenAIError, install_error_handlers
from tandem.entrypoints.openai.serving import SSE_DONE, run_until_disconnected, sse_event, streaming_response
from tandem.transfer.messages import StateLayout, first_difference, new_room

logger = logging.getLogger("tandem.router")
POLICIES = ("least-loaded", "round-robin")
ERROR_EVENT_PREFIX = b'data: {"error"'
DOWN_SECONDS = 5.0  # how long a server that failed a connection is passed over


class RouterSetupError(RuntimeError):
    """The servers cannot form PD pairs (wrong role, no pair, different state layout)."""


@dataclass(eq=False)
class Backend:
    url: str
    role: str
    model_names: list[str] = field(default_factory=list)
    bootstrap_address: Optional[str] = None
    layout: Optional[StateLayout] = None
    in_flight: int = 0
    dispatched: int = 0
    down_until: float = 0.0  # after a connection failure the server is skipped until then

    def available(self, now: float) -> bool:
        return now >= self.down_until


@dataclass
class ModelPool:
    name: str
    prefills: list[Backend] = field(default_factory=list)
    decodes: list[Backend] = field(default_factory=list)
    turns: dict[str, Any] = field(default_factory=dict)


class LegFailed(Exception):
    """One leg ended in an error; ``status`` and ``body`` are what the client gets."""

    def __init__(self, status: int, body: dict):
        super().__init__(body.get("error", {}).get("message", "leg failed"))
        self.status = status
        self.body = body


def error_body(status: int, message: str) -> dict:
    return OpenAIError(status, message).body()


class Router:
    """Owns the backends table and the HTTP client; one per router process."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], policy: str = "least-loaded",
                 client: Optional[httpx.AsyncClient] = None):
        self.backends = [Backend(url.rstrip("/"), "prefill") for url in prefill_urls] + \
                        [Backend(url.rstrip("/"), "decode") for url in decode_urls]
        self.policy = policy
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                                  limits=httpx.Limits(max_connections=None,
                                                                      max_keepalive_connections=64))
        self.pools: dict[str, ModelPool] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("tandem:router_requests", "Requests by outcome.", ["outcome"], registry=self.registry)
        for outcome in ("ok", "error", "prefill_failed", "decode_failed", "disconnected"):
            self.requests.labels(outcome=outcome)
        self.registry.register(_BackendCollector(self))
        self.background: set[asyncio.Task] = set()

    # -- start-up ---------------------------------------------------------------------------------
    async def discover(self, timeout: float = 120.0) -> None:
        """Read every server's /pd/info (waiting for servers still starting) and form the pools."""
        await asyncio.gather(*(self._describe(backend, timeout) for backend in self.backends))
        self.pools = form_pools(self.backends)

    async def _describe(self, backend: Backend, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                response = await self.client.get(backend.url + "/pd/info", timeout=5.0)
                if response.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RouterSetupError(f"{backend.role} server {backend.url} did not answer GET /pd/info "
                                       f"within {timeout:g} s")
            await asyncio.sleep(0.25)
        info = response.json()
        if info.get("role") != backend.role:
            raise RouterSetupError(f"{backend.url} was given as a {backend.role} server but runs with role "
                                   f"{info.get('role')!r} (start it with --role {backend.role})")
        backend.model_names = list(info.get("served_model_names") or [])
        backend.bootstrap_address = info.get("bootstrap_address")
        backend.layout = msgspec.convert(info["layout"], StateLayout)

    # -- choosing ------------------------------------------------------------------------------------
    def pool_for(self, model: Optional[str]) -> ModelPool:
        if model is None or model == "":
            if len(self.pools) == 1:
                return next(iter(self.pools.values()))
            raise OpenAIError(400, f"model: this router serves several models ({', '.join(sorted(self.pools))}); "
                                   "name one", "model")
        pool = self.pools.get(model)
        if pool is None:
            raise OpenAIError(404, f"model: the model {model!r} does not exist; this router serves "
                                   f"{', '.join(repr(name) for name in sorted(self.pools))}", "model")
        return pool

    def pick(self, pool: ModelPool, role: str) -> Backend:
        """A server for one leg; servers that recently failed a connection are passed over while
        any other is available."""
        backends = pool.prefills if role == "prefill" else pool.decodes
        now = time.monotonic()
        candidates = [backend for backend in backends if backend.available(now)] or backends
        if self.policy == "round-robin":
            turn = pool.turns.setdefault(role, itertools.count())
            return candidates[next(turn) % len(candidates)]
        return min(candidates, key=lambda backend: (backend.in_flight, backend.dispatched))

    def mark_down(self, backend: Backend, error: BaseException) -> None:
        logger.warning("%s server %s failed (%s); passing it over for %g s", backend.role, backend.url,
                       type(error).__name__, DOWN_SECONDS)
        backend.down_until = time.monotonic() + DOWN_SECONDS

    # -- dispatching -----------------------------------------------------------------------------------
    async def dispatch(self, path: str, body: dict, request: Request) -> Response:
        pool = self.pool_for(body.get("model"))
        prefill, decode = self.pick(pool, "prefill"), self.pick(pool, "decode")
        room = new_room()
        prefill_body = {**body, "stream": False,
                        "kv_transfer_params": {"room": room, "role": "prefill"}}
        prefill_body.pop("stream_options", None)
        decode_body = {**body, "kv_transfer_params": {"room": room, "role": "decode",
                                                      "prefill_address": prefill.bootstrap_address}}
        legs = Legs(self, prefill, decode)
        prefill_task = asyncio.create_task(legs.run_prefill(path, prefill_body))
        try:
            decode_response = await legs.open_decode(path, decode_body, prefill_task)
        except LegFailed as failure:
            await legs.cancel(prefill_task)
            self.requests.labels(outcome="decode_failed" if legs.failed_leg == "decode" else "prefill_failed").inc()
            return JSONResponse(failure.body, status_code=failure.status)
        except BaseException:
            await legs.cancel(prefill_task)
            legs.close_decode()
            raise
        if body.get("stream"):
            return streaming_response(legs.relay(decode_response, prefill_task))
        return await run_until_disconnected(request, legs.collect(decode_response, prefill_task))

    def keep(self, task: asyncio.Task) -> None:
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def close(self) -> None:
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        await self.client.aclose()


class Legs:
    """The two legs of one request; owns the decode response and counts both in flight."""

    def __init__(self, router: Router, prefill: Backend, decode: Backend):
        self.router = router
        self.prefill = prefill
        self.decode = decode
        self.decode_response: Optional[httpx.Response] = None
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
            response = await self.router.client.post(self.prefill.url + path, json=body)
        except httpx.HTTPError as error:
            self.router.mark_down(self.prefill, error)
            raise LegFailed(502, error_body(502, f"the prefill server {self.prefill.url} failed: "
                                                 f"{type(error).__name__}: {error}")) from None
        finally:
            self._done("prefill")
        if response.status_code != 200:
            raise LegFailed(response.status_code, response_error(response, "prefill"))

    async def open_decode(self, path: str, body: dict, prefill_task: asyncio.Task) -> httpx.Response:
        """Send the decode leg and wait for its status line; a prefill failure first wins."""
        request = self.router.client.build_request("POST", self.decode.url + path, json=body)
        decode_task = asyncio.create_task(self.router.client.send(request, stream=True))
        try:
            await asyncio.wait({decode_task, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task.done() and prefill_task.exception() is not None and not decode_task.done():
                self.failed_leg = "prefill"
                raise prefill_task.exception()
            try:
                response = await decode_task
            except httpx.HTTPError as error:
                self.failed_leg = "decode"
                self.router.mark_down(self.decode, error)
                raise LegFailed(502, error_body(502, f"the decode server {self.decode.url} failed: "
                                                     f"{type(error).__name__}: {error}")) from None
        except BaseException:
            if not decode_task.done():
                decode_task.cancel()
                await asyncio.gather(decode_task, return_exceptions=True)
            elif not decode_task.cancelled() and decode_task.exception() is None:
                await decode_task.result().aclose()
            self._done("decode")
            raise
        self.decode_response = response
        if response.status_code != 200:
            await response.aread()
            self.failed_leg = "decode"
            self.close_decode()
            raise LegFailed(response.status_code, response_error(response, "decode"))
        return response

    def close_decode(self) -> None:
        if self.decode_response is not None:
            self.router.keep(asyncio.create_task(self.decode_response.aclose()))
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

    async def collect(self, response: httpx.Response, prefill_task: asyncio.Task) -> Response:
        """Non-streaming: the decode body, unless either leg fails first."""
        read_task = asyncio.create_task(response.aread())
        try:
            pending = {read_task, prefill_task}
            while read_task in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task in done and prefill_task.exception() is not None and read_task in pending:
                    failure = prefill_task.exception()
                    self.router.requests.labels(outcome="prefill_failed").inc()
                    return JSONResponse(failure.body, status_code=failure.status)
            try:
                content = read_task.result()
            except httpx.HTTPError as error:
                self.router.mark_down(self.decode, error)
                await self.cancel(prefill_task)
                self.router.requests.labels(outcome="decode_failed").inc()
                return JSONResponse(error_body(502, f"the decode server {self.decode.url} failed: {error}"),
                                    status_code=502)
            self.finish_prefill_in_background(prefill_task)
            self.router.requests.labels(outcome="ok").inc()
            return Response(content, status_code=200, media_type=response.headers.get("content-type"))
        except asyncio.CancelledError:
            self.router.requests.labels(outcome="disconnected").inc()
            self.cancel_soon(prefill_task)
            raise
        finally:
            self.cancel_soon(read_task)
            self.close_decode()

    async def relay(self, response: httpx.Response, prefill_task: asyncio.Task) -> AsyncIterator[bytes]:
        """Streaming: relay the decode server's SSE events, cutting both legs on the first error."""
        events = sse_events(response.aiter_raw())
        next_event = asyncio.ensure_future(events.__anext__())
        outcome = "disconnected"
        try:
            while True:
                waiting = {next_event} if prefill_task.done() else {next_event, prefill_task}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task in done and prefill_task.exception() is not None and not next_event.done():
                    outcome = "prefill_failed"
                    yield sse_event(prefill_task.exception().body)
                    yield SSE_DONE
                    return
                if not next_event.done():
                    continue
                try:
                    event = next_event.result()
                except StopAsyncIteration:
                    outcome = "ok"
                    self.finish_prefill_in_background(prefill_task)
                    return
                except httpx.HTTPError as error:
                    outcome = "decode_failed"
                    self.router.mark_down(self.decode, error)
                    yield sse_event(error_body(502, f"the decode server {self.decode.url} failed: {error}"))
                    yield SSE_DONE
                    return
                yield event
                if event.startswith(ERROR_EVENT_PREFIX):
                    outcome = "decode_failed"
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


def response_error(response: httpx.Response, role: str) -> dict:
    try:
        body = response.json()
        if isinstance(body, dict) and "error" in body:
            return body
    except (json.JSONDecodeError, ValueError):
        pass
    return error_body(response.status_code, f"the {role} server answered {response.status_code}: {response.text[:200]}")


def form_pools(backends: list[Backend]) -> dict[str, ModelPool]:
    """One pool per served name common to every server (all names of one model); every
    prefill/decode pair must have equal state layouts."""
    prefills = [backend for backend in backends if backend.role == "prefill"]
    decodes = [backend for backend in backends if backend.role == "decode"]
    for prefill in prefills:
        for decode in decodes:
            difference = first_difference(prefill.layout, decode.layout, f"prefill {prefill.url}",
                                          f"decode {decode.url}")
            if difference is not None:
                raise RouterSetupError(f"PD handshake failed: {difference}")
    names = set(backends[0].model_names)
    for backend in backends[1:]:
        names &= set(backend.model_names)
    if not names:
        raise RouterSetupError("the servers share no served model name (give them a common --served-model-name)")
    return {name: ModelPool(name, list(prefills), list(decodes)) for name in sorted(names)}


class _BackendCollector:
    def __init__(self, router: Router):
        self.router = router

    def collect(self):
        in_flight = GaugeMetricFamily("tandem:router_backend_in_flight", "Legs in flight per server.",
                                      labels=["role", "url"])
        dispatched = GaugeMetricFamily("tandem:router_backend_dispatched", "Legs sent per server.",
                                       labels=["role", "url"])
        for backend in self.router.backends:
            in_flight.add_metric([backend.role, backend.url], backend.in_flight)
            dispatched.add_metric([backend.role, backend.url], backend.dispatched)
        yield in_flight
        yield dispatched


def create_router_app(router: Router) -> FastAPI:
    app = FastAPI(title="tandem router", docs_url=None, redoc_url=None)
    install_error_handlers(app)

    async def forward(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, ValueError) as error:
            raise OpenAIError(400, f"malformed JSON body: {error}", "body") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "body: must be a JSON object", "body")
        return await router.dispatch(path, body, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "tandem"}
                                           for name in sorted(router.pools)]}

    @app.get("/health")
    async def health():
        async def probe(backend: Backend) -> Optional[str]:
            try:
                response = await router.client.get(backend.url + "/health", timeout=2.0)
                return None if response.status_code == 200 else f"{backend.url}: {response.status_code}"
            except httpx.HTTPError as error:
                return f"{backend.url}: {type(error).__name__}"
        problems = [problem for problem in await asyncio.gather(*(probe(b) for b in router.backends)) if problem]
        if problems:
            return JSONResponse({"status": "unhealthy", "reason": "; ".join(problems)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# -- command line -----------------------------------------------------------------------------------------


def add_router_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "router", help="serve the OpenAI API in front of prefill and decode servers",
        description="Route each request to a prefill server and a decode server at once (disaggregated "
                    "prefill/decode) and stream the decode server's answer back.")
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="base URLs of prefill servers (tandem serve --role prefill)")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="base URLs of decode servers (tandem serve --role decode)")
    parser.add_argument("--policy", choices=POLICIES, default="least-loaded",
                        help="how a server is chosen for each leg (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--startup-timeout", type=float, default=120.0,
                        help="seconds to wait for every server to answer GET /pd/info (default: %(default)s)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                        help="log level (default: %(default)s)")
    parser.set_defaults(func=run_router)


def run_router(arguments: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=arguments.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def serve() -> int:
        router = Router(arguments.prefill, arguments.decode, arguments.policy)
        try:
            try:
                await router.discover(arguments.startup_timeout)
            except RouterSetupError as error:
                logger.error("%s", error)
                print(f"tandem router: {error}", flush=True)
                return 2
            logger.info("routing %s over %d prefill and %d decode servers (%s)", ", ".join(sorted(router.pools)),
                        len(arguments.prefill), len(arguments.decode), arguments.policy)
            config = uvicorn.Config(create_router_app(router), host=arguments.host, port=arguments.port,
                                    log_level=arguments.log_level, access_log=arguments.log_level == "debug")
            await uvicorn.Server(config).serve()
            return 0
        finally:
            await router.close()

    try:
        return asyncio.run(serve())
    except KeyboardInterrupt:
        return 0
