"""The router's servers: who they are (``GET /pd/info``), which model pools they form, and
whether each is healthy now.

``BackendMonitor`` owns every ``Backend``'s health. At start it reads each server's /pd/info
(waiting for servers still starting) and checks the servers can form PD pairs; then it probes
``GET /health`` of every server each ``interval`` seconds. A server is unhealthy from its first
failed probe or failed connection (reported by the request that saw it) until a probe succeeds
again; before it returns, its /pd/info is read anew (a restarted server has a new control
address) and its state layout checked against the other role's servers. Unhealthy servers get
no new requests.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec

from tandem.entrypoints.router.http import HTTP_ERRORS, HttpClient
from tandem.transfer.messages import StateLayout, first_difference

logger = logging.getLogger("tandem.router")
DEFAULT_HEALTH_INTERVAL = 2.0


class RouterSetupError(RuntimeError):
    """The servers cannot be routed to: they cannot form PD pairs (wrong role, no pair, different
    state layout), share no model, or want a key the router does not send."""


@dataclass(eq=False)
class Backend:
    url: str
    role: str
    replica: str = ""  # its name in a deployment (tandem deploy); "" for a server given by URL
    model_names: list[str] = field(default_factory=list)
    bootstrap_address: Optional[str] = None
    layout: Optional[StateLayout] = None
    in_flight: int = 0
    dispatched: int = 0
    healthy: bool = True
    problem: str = ""  # why it is unhealthy
    unhealthy_since: float = 0.0


@dataclass
class ModelPool:
    name: str
    prefills: list[Backend] = field(default_factory=list)
    decodes: list[Backend] = field(default_factory=list)
    turns: dict[str, Any] = field(default_factory=dict)
    servers: list[Backend] = field(default_factory=list)  # colocated servers (load balancing, no PD)

    def members(self, role: str) -> list[Backend]:
        """The pool's servers of one role ("prefill", "decode" or "colocated")."""
        return {"prefill": self.prefills, "decode": self.decodes, "colocated": self.servers}[role]


def form_pools(backends: list[Backend]) -> dict[str, ModelPool]:
    """One pool per served name common to every server (all names of one model); every
    prefill/decode pair must have equal state layouts."""
    prefills = [backend for backend in backends if backend.role == "prefill"]
    decodes = [backend for backend in backends if backend.role == "decode"]
    servers = [backend for backend in backends if backend.role == "colocated"]
    for prefill in prefills:
        difference = layout_difference(prefill, decodes)
        if difference is not None:
            raise RouterSetupError(f"PD handshake failed: {difference}")
    names = set(backends[0].model_names)
    for backend in backends[1:]:
        names &= set(backend.model_names)
    if not names:
        raise RouterSetupError("the servers share no served model name (give them a common --served-model-name)")
    return {name: ModelPool(name, list(prefills), list(decodes), servers=list(servers)) for name in sorted(names)}


def layout_difference(backend: Backend, others: list[Backend]) -> Optional[str]:
    """The first difference between ``backend``'s state layout and any of ``others``' (the other role)."""
    for other in others:
        prefill, decode = (backend, other) if backend.role == "prefill" else (other, backend)
        difference = first_difference(prefill.layout, decode.layout, f"prefill {prefill.url}", f"decode {decode.url}")
        if difference is not None:
            return difference
    return None


class BackendMonitor:
    """Discovery and health of the router's servers (one per router; runs on its event loop)."""

    def __init__(self, backends: list[Backend], client: HttpClient,
                 interval: float = DEFAULT_HEALTH_INTERVAL) -> None:
        self.backends = backends
        self.client = client
        self.interval = interval
        self.task: Optional[asyncio.Task] = None

    # -- start-up ---------------------------------------------------------------------------------
    async def discover(self, timeout: float) -> None:
        """Read every server's /pd/info, waiting up to ``timeout`` s for servers still starting."""
        await asyncio.gather(*(self._wait_and_describe(backend, timeout) for backend in self.backends))

    async def _wait_and_describe(self, backend: Backend, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, content = await self.client.get(backend.url + "/pd/info", timeout=5.0)
                if status == 200:
                    break
            except HTTP_ERRORS:
                pass
            if time.monotonic() > deadline:
                raise RouterSetupError(f"{backend.role} server {backend.url} did not answer GET /pd/info "
                                       f"within {timeout:g} s")
            await asyncio.sleep(0.25)
        self.apply_info(backend, json.loads(content))
        await self.check_api_key(backend)

    def apply_info(self, backend: Backend, info: dict) -> None:
        if info.get("role") != backend.role:
            flag = "--server" if info.get("role") == "colocated" else f"--{info.get('role')}"
            raise RouterSetupError(f"{backend.url} was given as a {backend.role} server but runs with role "
                                   f"{info.get('role')!r} (start it with --role {backend.role}, or give it to the "
                                   f"router as {flag})")
        backend.model_names = list(info.get("served_model_names") or [])
        backend.bootstrap_address = info.get("bootstrap_address")
        if backend.role != "colocated":  # a colocated server moves no state: it has no layout to agree on
            backend.layout = msgspec.convert(info["layout"], StateLayout)

    async def check_api_key(self, backend: Backend) -> None:
        """The server takes the router's key (``/v1/models`` needs it when the server has one)."""
        status, _ = await self.client.get(backend.url + "/v1/models", timeout=5.0)
        if status == 401:
            raise RouterSetupError(f"{backend.role} server {backend.url} requires an API key the router does not "
                                   "send: give the router --server-api-key KEY (the servers' --api-key)")

    # -- health --------------------------------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await asyncio.gather(*(self.probe(backend) for backend in self.backends))

    async def probe(self, backend: Backend) -> None:
        try:
            status, _ = await self.client.get(backend.url + "/health", timeout=max(self.interval, 2.0))
            problem = None if status == 200 else f"/health answered {status}"
        except HTTP_ERRORS as error:
            problem = f"{type(error).__name__}"
        if problem is not None:
            self.mark_unhealthy(backend, problem)
        elif not backend.healthy:
            await self.readmit(backend)

    async def readmit(self, backend: Backend) -> None:
        """A server answers again: read its /pd/info anew and check it still pairs with the others."""
        try:
            status, content = await self.client.get(backend.url + "/pd/info", timeout=5.0)
            if status != 200:
                raise ValueError(f"it answered {status}")
            self.apply_info(backend, json.loads(content))
        except (*HTTP_ERRORS, RouterSetupError, KeyError, ValueError, msgspec.ValidationError) as error:
            self.mark_unhealthy(backend, f"its /pd/info is unusable: {error}")
            return
        others = [other for other in self.backends if other.role != backend.role and other.layout is not None]
        difference = layout_difference(backend, others)
        if difference is not None:
            self.mark_unhealthy(backend, f"PD handshake failed: {difference}")
            return
        backend.healthy, backend.problem = True, ""
        logger.warning("%s server %s is healthy again after %.1f s (control address %s)", backend.role, backend.url,
                       time.monotonic() - backend.unhealthy_since, backend.bootstrap_address)

    def mark_unhealthy(self, backend: Backend, problem: str) -> None:
        """Stop routing to ``backend`` until a health probe succeeds (logged once per outage)."""
        if backend.healthy or backend.problem != problem:
            logger.warning("%s server %s is unhealthy (%s); no requests go to it until it answers /health",
                           backend.role, backend.url, problem)
        if backend.healthy:
            backend.unhealthy_since = time.monotonic()
        backend.healthy, backend.problem = False, problem
