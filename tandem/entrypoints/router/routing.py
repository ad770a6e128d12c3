"""Routing one request: pick a healthy prefill and decode server of the requested model (least
loaded, or round robin), make a 128-bit room id, send both legs at once (``legs.py``). A router
over colocated servers (``--server``) instead sends each request whole to one of them, picked the
same way (``single_leg.py``), with the same retries.

    client --> router --(kv_transfer_params: room, role=prefill)--> prefill server  (not streamed)
                      --(kv_transfer_params: room, role=decode,  --> decode server   (streamed back)
                          prefill_address)

A leg whose server cannot be connected to, or turns it away with 503 (its queue is full), never
started it: the request is sent again with a fresh room, to another healthy server (not one that
turned it away), at most ``MAX_ATTEMPTS`` times in all. No such server left for a role is a 503
with ``Retry-After`` (a busy server's own advice when it answered last). A streamed answer is
committed at the decode leg's first event, so failures before it (the prefill leg's too) keep
their own status and may be retried. Calls to the servers carry the server API key when one is
set.

Client errors are answered once: the router checks the body before sending it
(``validation.py``), and a leg a server answers with a 4xx (a rule that needs the model) ends both
legs and goes back to the client as it came, counted as ``client_error`` and logged at info.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from typing import Optional

from fastapi import Request
from fastapi.responses import Response
from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.metrics import new_registry
from tandem.entrypoints.openai.request_id import request_id_of
from tandem.entrypoints.openai.serving import run_until_disconnected, streaming_response
from tandem.entrypoints.router.affinity import PrefillAffinity, conversation_key, conversation_keys
from tandem.entrypoints.router.backends import DEFAULT_HEALTH_INTERVAL, Backend, BackendMonitor, ModelPool, form_pools
from tandem.entrypoints.router.http import HttpClient
from tandem.entrypoints.router.legs import LegFailed, Legs, failure_outcome
from tandem.entrypoints.router.membership import LoadReport, MembershipSource, MembershipWatcher
from tandem.entrypoints.router.single_leg import OUTCOME_FAILED, SingleLeg
from tandem.transfer.messages import new_room

logger = logging.getLogger("tandem.router")
POLICIES = ("least-loaded", "round-robin")
MAX_ATTEMPTS = 3
RETRY_AFTER_SECONDS = 2
# client_error: the request itself was at fault (a 4xx, from the router's own checks or passed
# through from a server); the others are the router's and the servers' own failures.
OUTCOMES = ("ok", "client_error", "error", "prefill_failed", "decode_failed", OUTCOME_FAILED, "disconnected")


LOAD_WINDOW_SECONDS = 10.0  # the recent first-event times a load report averages
FIRST_EVENT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class Router:
    """Owns the backends table, their monitor and the HTTP client; one per router process.

    ``api_key``: what clients must send to the router; ``server_api_key``: what the router sends to
    the servers (their ``--api-key``). With a ``membership`` source (a deployment), the servers
    come from it, and change while the router runs (``membership.py``), instead of from URLs."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], policy: str = "least-loaded",
                 client: Optional[HttpClient] = None, *, api_key: Optional[str] = None,
                 server_api_key: Optional[str] = None, health_interval: float = DEFAULT_HEALTH_INTERVAL,
                 prefill_affinity: bool = False, server_urls: tuple[str, ...] = (),
                 membership: Optional[MembershipSource] = None):
        if server_urls and (prefill_urls or decode_urls):
            raise ValueError("a router balances colocated servers or routes PD pairs, not both")
        if membership is not None and (server_urls or prefill_urls or decode_urls):
            raise ValueError("a router takes its servers from a membership source or from URLs, not both")
        self.backends = [Backend(url.rstrip("/"), "prefill") for url in prefill_urls] + \
                        [Backend(url.rstrip("/"), "decode") for url in decode_urls] + \
                        [Backend(url.rstrip("/"), "colocated") for url in server_urls]
        if membership is not None:
            self.roles = membership.roles
        else:
            self.roles = ("colocated",) if server_urls else ("prefill", "decode")
        self.policy = policy
        self.affinity = PrefillAffinity() if prefill_affinity else None
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {server_api_key}"} if server_api_key else {}
        self.client = client or HttpClient(headers)
        self.monitor = BackendMonitor(self.backends, self.client, health_interval)
        self.watcher = MembershipWatcher(self, membership, health_interval) if membership is not None else None
        self.recent_first_events: dict[str, deque] = {role: deque() for role in self.roles}
        self.pools: dict[str, ModelPool] = {}
        self.registry = new_registry()
        self.requests = Counter("tandem:router_requests", "Requests by outcome.", ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        self.retries = Counter("tandem:router_retries", "Requests sent again because a server could not be reached "
                               "or was busy (503).", ["role"], registry=self.registry)
        for role in self.roles:
            self.retries.labels(role=role)
        self.affinity_hits = Counter("tandem:router_prefill_affinity_hits",
                                     "Requests sent to the prefill server that served their conversation's start "
                                     "(--prefill-affinity).", registry=self.registry)
        self.first_event = Histogram("tandem:router_time_to_first_token_seconds",
                                     "Streamed requests: their arrival at the router to the decode server's first "
                                     "event relayed (what the router and both legs add to TTFT).",
                                     registry=self.registry, buckets=FIRST_EVENT_BUCKETS)
        self.registry.register(BackendCollector(self))
        self.background: set[asyncio.Task] = set()

    # -- start-up ---------------------------------------------------------------------------------
    async def discover(self, timeout: float = 120.0) -> None:
        """Read every server's /pd/info (waiting for servers still starting), form the pools, and
        start the health probes (and, with a membership source, its watcher)."""
        if self.watcher is not None:
            await self.watcher.first_sync(timeout)
            self.watcher.start()
        else:
            await self.monitor.discover(timeout)
            self.pools = form_pools(self.backends)
        self.monitor.start()

    # -- load, for a deployment's autoscaler ---------------------------------------------------------
    def record_first_event(self, role: str, seconds: float) -> None:
        """A streamed request's first event was relayed ``seconds`` after its arrival; ``role``:
        the role whose work the first token waits on (prefill for PD, colocated)."""
        self.first_event.observe(seconds)
        recent = self.recent_first_events.setdefault(role, deque())
        now = time.monotonic()
        recent.append((now, seconds))
        while recent and recent[0][0] < now - LOAD_WINDOW_SECONDS:
            recent.popleft()

    def load_report(self) -> LoadReport:
        now = time.monotonic()
        first_event = {}
        for role, recent in self.recent_first_events.items():
            values = [seconds for moment, seconds in recent if moment >= now - LOAD_WINDOW_SECONDS]
            if values:
                first_event[role] = sum(values) / len(values)
        retiring = self.watcher.retiring if self.watcher is not None else []
        in_flight = {backend.replica or backend.url: backend.in_flight for backend in [*retiring, *self.backends]}
        return LoadReport(in_flight, first_event)

    def candidates_of_role(self, role: str) -> list[Backend]:
        return [backend for backend in self.backends if backend.role == role and backend.healthy]

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

    def pick(self, pool: ModelPool, role: str, busy: frozenset = frozenset()) -> Backend:
        """A healthy server for one leg, not one of ``busy`` (they turned this request away);
        503 when there is none."""
        candidates = self.candidates(pool, role, busy)
        backends = pool.members(role)
        if not candidates:
            problems = "; ".join(f"{backend.url}: {backend.problem}" for backend in backends)
            raise OpenAIError(503, f"no healthy {role} server for model {pool.name!r} ({problems})",
                              headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        if self.policy == "round-robin":
            turn = pool.turns.setdefault(role, itertools.count())
            return candidates[next(turn) % len(candidates)]
        return min(candidates, key=lambda backend: (backend.in_flight, backend.dispatched))

    @staticmethod
    def candidates(pool: ModelPool, role: str, busy: frozenset = frozenset()) -> list[Backend]:
        return [backend for backend in pool.members(role) if backend.healthy and backend.url not in busy]

    def pick_prefill(self, pool: ModelPool, body: dict, busy: frozenset = frozenset()) -> Backend:
        """With prefill affinity, the healthy prefill server that served this conversation last;
        else (or when it is not healthy) the policy's pick, remembered for the next turn."""
        if self.affinity is None:
            return self.pick(pool, "prefill", busy)
        url = self.affinity.remembered(conversation_keys(body))
        backend = next((b for b in self.candidates(pool, "prefill", busy) if b.url == url), None) if url else None
        if backend is not None:
            self.affinity_hits.inc()
        else:
            backend = self.pick(pool, "prefill", busy)
        self.affinity.remember(conversation_key(body), backend.url)
        return backend

    # -- dispatching -----------------------------------------------------------------------------------
    def count_client_error(self, request: Request, message: str) -> None:
        """A request refused for its own fault: counted apart from failures, logged at info."""
        self.requests.labels(outcome="client_error").inc()
        logger.info("request %s refused: %s", request_id_of(request.scope), message)

    async def dispatch(self, path: str, body: dict, request: Request, arrival: Optional[float] = None) -> Response:
        """Both legs of one request (``arrival``: its ``time.perf_counter()`` at the router)."""
        arrival = arrival if arrival is not None else time.perf_counter()
        request_id = request_id_of(request.scope)
        try:
            pool = self.pool_for(body.get("model"))
        except OpenAIError as error:
            if error.status_code < 500:
                self.count_client_error(request, error.message)
            raise
        if pool.servers:
            return await self.dispatch_colocated(path, body, request, pool, arrival, request_id)
        busy: frozenset = frozenset()  # servers that turned this request away (503)
        prefill = decode = None  # a retry picks again only the leg that failed
        for attempt in range(MAX_ATTEMPTS):
            if prefill is None:
                prefill = self.pick_prefill(pool, body, busy)
            if decode is None:
                decode = self.pick(pool, "decode", busy)
            room = new_room()
            prefill_body = {**body, "stream": False, "kv_transfer_params": {"room": room, "role": "prefill"}}
            prefill_body.pop("stream_options", None)
            decode_body = {**body, "kv_transfer_params": {"room": room, "role": "decode",
                                                          "prefill_address": prefill.bootstrap_address}}
            legs = Legs(self, prefill, decode, arrival, request_id, room)
            prefill_task = asyncio.create_task(legs.run_prefill(path, prefill_body))
            try:
                decode_response = await legs.open_decode(path, decode_body, prefill_task)
                if body.get("stream"):
                    first = await run_until_disconnected(request, legs.first_event(decode_response, prefill_task))
            except LegFailed as failure:
                await legs.cancel(prefill_task)
                role = legs.failed_leg or "prefill"
                if failure.busy:
                    busy |= {(prefill if role == "prefill" else decode).url}
                retry = failure.unreachable or (failure.busy and self.candidates(pool, role, busy))
                if retry and attempt + 1 < MAX_ATTEMPTS:
                    self.retries.labels(role=role).inc()
                    logger.info("request %s: %s; sending it again", request_id, failure)
                    if role == "prefill":
                        prefill = None
                    else:
                        decode = None
                    continue  # that server is unhealthy now, or busy: pick again
                self.requests.labels(outcome=failure_outcome(role, failure.status)).inc()
                legs.log_failure(role, failure.body, failure.status)
                return failure.response()
            except BaseException as error:
                await legs.cancel(prefill_task)
                legs.close_decode()
                if isinstance(error, OpenAIError) and error.status_code == 499:
                    self.requests.labels(outcome="disconnected").inc()
                raise
            if body.get("stream"):
                return streaming_response(legs.relay(decode_response, prefill_task, first))
            return await run_until_disconnected(request, legs.collect(decode_response, prefill_task))
        raise AssertionError("unreachable")

    async def dispatch_colocated(self, path: str, body: dict, request: Request, pool: ModelPool, arrival: float,
                                 request_id: str) -> Response:
        """The whole request to one colocated server; sent again to another (at most
        ``MAX_ATTEMPTS`` in all) when the server cannot be reached or is busy (503)."""
        busy: frozenset = frozenset()
        for attempt in range(MAX_ATTEMPTS):
            leg = SingleLeg(self, self.pick(pool, "colocated", busy), arrival, request_id)
            try:
                await run_until_disconnected(request, leg.open(path, body))
            except LegFailed as failure:
                if failure.busy:
                    busy |= {leg.server.url}
                retry = failure.unreachable or (failure.busy and self.candidates(pool, "colocated", busy))
                if retry and attempt + 1 < MAX_ATTEMPTS:
                    self.retries.labels(role="colocated").inc()
                    logger.info("request %s: %s; sending it again", request_id, failure)
                    continue
                self.requests.labels(outcome=OUTCOME_FAILED).inc()
                leg.log_failure(failure.body)
                return failure.response()
            except BaseException as error:
                leg.close()
                if isinstance(error, OpenAIError) and error.status_code == 499:
                    self.requests.labels(outcome="disconnected").inc()
                raise
            if body.get("stream"):
                return streaming_response(leg.relay())
            return await run_until_disconnected(request, leg.collect())
        raise AssertionError("unreachable")

    def keep(self, task: asyncio.Task) -> None:
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def close(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        await self.monitor.stop()
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        await self.client.close()


class BackendCollector:
    """Per-server gauges: legs in flight, legs sent, healthy (1) or not (0); labelled by role and
    URL, and, in front of a deployment, by replica name too (``replica="prefill-0"``)."""

    def __init__(self, router: Router):
        self.router = router

    def collect(self):
        deployment = self.router.watcher is not None
        labels = ["role", "url", "replica"] if deployment else ["role", "url"]
        families = {
            "in_flight": GaugeMetricFamily("tandem:router_backend_in_flight",
                                           "Legs in flight per server (in front of a deployment, also labelled "
                                           "by replica name).", labels=labels),
            "dispatched": GaugeMetricFamily("tandem:router_backend_dispatched",
                                            "Legs sent per server (in front of a deployment, also labelled by "
                                            "replica name).", labels=labels),
            "healthy": GaugeMetricFamily("tandem:router_backend_healthy",
                                         "1 while the server answers its health checks, else 0 (in front of a "
                                         "deployment, also labelled by replica name).", labels=labels),
        }
        for backend in self.router.backends:
            values = [backend.role, backend.url, backend.replica] if deployment else [backend.role, backend.url]
            for name, family in families.items():
                family.add_metric(values, int(getattr(backend, name)))
        yield from families.values()
