"""Servers that come and go: the router's membership taken from a source (a deployment's
registry, ``tandem deploy``) instead of the static ``--prefill/--decode/--server`` lists.

A ``MembershipSource`` answers, each time it is asked, the servers that should receive requests
now (a version number and one ``Member`` per server). The ``MembershipWatcher`` asks it every
``interval`` seconds and makes the router's backends equal to that list: a new member is read
(``GET /pd/info``) and admitted once its state layout pairs with the other role's servers; a member
that left gets no new requests at once, while requests already on it run to their end (their legs
hold the ``Backend``; it stays in the load reports, ``retiring``, until its last leg ends). After
each reconciliation the watcher acknowledges the version it read (every removal up to it is in
force; a member still being admitted may lag), with the load it sees (legs in flight per server,
recent time to the first event per role), so the deployment knows when no new request can reach
a server it drains, and when the last one has left it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol

import msgspec

from tandem.entrypoints.router.backends import (Backend, ModelPool, RouterSetupError, form_pools,
                                                layout_difference)
from tandem.entrypoints.router.http import HTTP_ERRORS

if TYPE_CHECKING:
    from tandem.entrypoints.router.routing import Router

logger = logging.getLogger("tandem.router")
DESCRIBE_TIMEOUT = 5.0


@dataclass(frozen=True)
class Member:
    """One server that should receive requests: its replica name, role and base URL."""
    name: str
    role: str
    url: str


@dataclass(frozen=True)
class Membership:
    version: int
    members: tuple[Member, ...] = ()


@dataclass
class LoadReport:
    """What the router sees, for a deployment's autoscaler: legs in flight per replica name,
    and the mean time to the first event of streamed requests over the last window, per role
    whose work the first token waits on (prefill for PD, colocated)."""
    in_flight: dict[str, int] = field(default_factory=dict)
    first_event_seconds: dict[str, float] = field(default_factory=dict)


class MembershipSource(Protocol):
    """Where a router learns its servers. ``roles``: ("prefill", "decode") or ("colocated",)."""
    roles: tuple[str, ...]

    async def members(self) -> Membership: ...

    async def acknowledge(self, version: int, report: LoadReport) -> None: ...

    async def close(self) -> None: ...


class MembershipWatcher:
    """Keeps ``router.backends`` and ``router.pools`` equal to the source's members (one per
    membership router; runs on its event loop)."""

    def __init__(self, router: Router, source: MembershipSource, interval: float):
        self.router = router
        self.source = source
        self.interval = interval
        self.retiring: list[Backend] = []  # left the membership, legs still in flight
        self.task: Optional[asyncio.Task] = None

    async def first_sync(self, timeout: float) -> None:
        """Wait until every role has at least one admitted server (``timeout`` s at most)."""
        deadline = time.monotonic() + timeout
        while True:
            await self.sync()
            if all(self.router.candidates_of_role(role) for role in self.router.roles):
                return
            if time.monotonic() > deadline:
                raise RouterSetupError(f"the deployment has no serving {' and '.join(self.router.roles)} servers "
                                       f"after {timeout:g} s")
            await asyncio.sleep(min(self.interval, 0.5))

    def start(self) -> None:
        self.task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.source.close()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sync()
            except Exception as error:  # a registry that cannot be reached now: keep the current servers
                logger.warning("membership: cannot read the deployment's registry (%s); keeping the current "
                               "servers", error)

    async def sync(self) -> None:
        membership = await self.source.members()
        wanted = {member.url.rstrip("/"): member for member in membership.members}
        backends = self.router.backends
        for backend in [backend for backend in backends if backend.url not in wanted]:
            backends.remove(backend)
            self.retiring.append(backend)
            logger.warning("%s server %s (%s) left the deployment; no new requests go to it", backend.role,
                           backend.url, backend.replica)
        known = {backend.url for backend in backends}
        admitted = await asyncio.gather(*(self.describe(url, member) for url, member in wanted.items()
                                          if url not in known))
        for backend in admitted:
            if backend is not None and self.pairs(backend):
                backends.append(backend)
                logger.info("%s server %s (%s) joined the deployment", backend.role, backend.url, backend.replica)
        self.router.pools = membership_pools(backends, self.router.pools)
        self.retiring = [backend for backend in self.retiring if backend.in_flight > 0]
        await self.source.acknowledge(membership.version, self.router.load_report())

    async def describe(self, url: str, member: Member) -> Optional[Backend]:
        """The member as a backend, read from its /pd/info; None while it does not answer."""
        backend = Backend(url, member.role, replica=member.name)
        try:
            status, content = await self.router.client.get(url + "/pd/info", timeout=DESCRIBE_TIMEOUT)
            if status != 200:
                raise ValueError(f"GET /pd/info answered {status}")
            self.router.monitor.apply_info(backend, json.loads(content))
            await self.router.monitor.check_api_key(backend)
        except (*HTTP_ERRORS, RouterSetupError, KeyError, ValueError, msgspec.ValidationError) as error:
            logger.warning("%s server %s (%s) is not admitted yet: %s", member.role, url, member.name, error)
            return None
        return backend

    def pairs(self, backend: Backend) -> bool:
        others = [other for other in self.router.backends if other.role != backend.role and other.layout is not None]
        difference = layout_difference(backend, others) if backend.role != "colocated" else None
        if difference is not None:
            logger.error("%s server %s (%s) is not admitted: PD handshake failed: %s", backend.role, backend.url,
                         backend.replica, difference)
        return difference is None


def membership_pools(backends: list[Backend], previous: dict[str, ModelPool]) -> dict[str, ModelPool]:
    """The pools of the current servers; with none (or no common name), the previous pools'
    names with no servers (requests get 503 until servers come back)."""
    if backends:
        try:
            return form_pools(backends)
        except RouterSetupError as error:
            logger.error("membership: %s", error)
    return {name: ModelPool(name) for name in previous}
