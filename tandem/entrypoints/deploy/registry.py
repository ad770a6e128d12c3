"""A deployment's registry: the named Ray actor ``tandem-deploy-NAME`` that says which replicas
exist, which of them serve, and what the routers in front see.

The supervisor (``supervisor.py``) is its only writer: it records a replica when it is placed
(state ``starting``), marks it ``serving`` once healthy, ``draining`` or gone when it must
receive no more requests, and stores each health check. Routers (``RegistryMembership``) read
the serving replicas every health interval, and acknowledge the version they route by with the
load they see; ``tandem deploy status`` reads every record. Every change of the serving set
raises the version, so the supervisor knows when every router has stopped sending to a replica
it drains.

The registry lives as long as the deployment's driver (not detached): when the driver exits,
Ray ends it, and every replica, with it.
"""
from __future__ import annotations

import asyncio
import time
from typing import Optional

from tandem.entrypoints.router.membership import LoadReport, Member, Membership

SERVING = "serving"
ROUTER_SILENT_SECONDS = 15.0  # a router not heard from this long no longer holds a drain back


class DeploymentRegistry:
    """The actor body (made remote by ``supervisor.py``). ``description``: the deployment's
    name, model, roles, and settings, for ``status``."""

    def __init__(self, description: dict):
        self.description = description
        self.records: dict[str, dict] = {}
        self.version = 0
        self.routers: dict[str, dict] = {}  # router id -> its last acknowledgement

    def describe(self) -> dict:
        return self.description

    def upsert(self, record: dict) -> int:
        """Add or update a replica's record (merged into the existing one); the version."""
        name = record["name"]
        before = self.records.get(name, {}).get("state")
        self.records[name] = {**self.records.get(name, {}), **record}
        if (before == SERVING) != (self.records[name].get("state") == SERVING):
            self.version += 1
        return self.version

    def remove(self, name: str) -> int:
        record = self.records.pop(name, None)
        if record is not None and record.get("state") == SERVING:
            self.version += 1
        return self.version

    def replicas(self) -> list[dict]:
        return sorted(self.records.values(), key=lambda record: (record["role"], record["name"]))

    def members(self) -> dict:
        serving = [record for record in self.records.values() if record.get("state") == SERVING]
        return {"version": self.version,
                "members": [{"name": record["name"], "role": record["role"], "url": record["url"]}
                            for record in serving]}

    def acknowledge(self, router: str, version: int, in_flight: dict, first_event_seconds: dict) -> None:
        self.routers[router] = {"version": version, "in_flight": in_flight,
                                "first_event_seconds": first_event_seconds, "time": time.time()}

    def routers_behind(self, version: int) -> list[str]:
        """Routers heard from lately that route by a version older than ``version``."""
        now = time.time()
        return [router for router, ack in self.routers.items()
                if now - ack["time"] < ROUTER_SILENT_SECONDS and ack["version"] < version]

    def load(self) -> dict:
        """The routers' view, summed: legs in flight per replica, and the largest recent mean time
        to the first event per role."""
        now = time.time()
        in_flight: dict[str, int] = {}
        first_event: dict[str, float] = {}
        for ack in self.routers.values():
            if now - ack["time"] >= ROUTER_SILENT_SECONDS:
                continue
            for name, count in ack["in_flight"].items():
                in_flight[name] = in_flight.get(name, 0) + count
            for role, seconds in ack["first_event_seconds"].items():
                first_event[role] = max(first_event.get(role, 0.0), seconds)
        return {"in_flight": in_flight, "first_event_seconds": first_event}


class RegistryMembership:
    """A router's ``MembershipSource`` reading a deployment's registry (Ray calls run in a
    thread: they block)."""

    def __init__(self, registry, roles: tuple[str, ...], router_id: str, timeout: float = 10.0):
        self.registry = registry
        self.roles = roles
        self.router_id = router_id
        self.timeout = timeout

    async def members(self) -> Membership:
        answer = await self._call(self.registry.members.remote())
        return Membership(answer["version"], tuple(Member(**member) for member in answer["members"]))

    async def acknowledge(self, version: int, report: LoadReport) -> None:
        await self._call(self.registry.acknowledge.remote(self.router_id, version, report.in_flight,
                                                          report.first_event_seconds))

    async def close(self) -> None:
        pass

    async def _call(self, reference, timeout: Optional[float] = None):
        import ray

        return await asyncio.to_thread(ray.get, reference, timeout=timeout or self.timeout)
