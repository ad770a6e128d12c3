"""The deployment's supervisor, in the ``tandem deploy`` driver: it places the replicas, admits
them to the registry once healthy, replaces the ones that die, resizes roles (``--autoscale``)
and drains the ones it removes. It runs in its own thread, one tick every ``TICK_SECONDS``:

    starting  --ready-->  serving  --dead or unhealthy-->  removed from the registry, destroyed;
                                                           a replacement is placed
              --scale-in-->  draining: out of the registry; once every router routes without it
                             and has no leg left on it, its server gets SIGTERM (it drains), then
                             the replica is destroyed

Health, each ``health_interval`` s per serving replica: the actor answers ``alive`` (its server
process runs) within ``CHECK_TIMEOUT`` s, and the server answers ``GET /health``. An actor that is
gone, or whose server exited, is replaced at once; a server that fails ``unhealthy_threshold``
checks in a row is replaced too. Requests in flight on a replica that died fail at the router
with a clean error (as for any server that dies).

The supervisor owns every ``PlacedReplica`` and the registry's records; ``shutdown`` removes
everything it started.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from tandem.entrypoints.deploy.autoscale import AutoscaleConfig, AutoscalePolicy
from tandem.entrypoints.deploy.placement import (DRAINING, SERVING, STARTING, Placement, PlacedReplica, destroy,
                                                 place_replica)
from tandem.entrypoints.deploy.ray_cluster import DeployError
from tandem.entrypoints.deploy.replica import get_status

logger = logging.getLogger("tandem.deploy")
TICK_SECONDS = 0.25
CHECK_TIMEOUT = 5.0
RETRY_SECONDS = 2.0  # after a replica failed to start, before its role places another


@dataclass(frozen=True)
class RoleSize:
    """How many replicas a role has: ``replicas`` at start; with autoscaling, within
    [minimum, maximum]."""
    role: str
    replicas: int
    minimum: int
    maximum: int


@dataclass(frozen=True)
class SupervisorSettings:
    deployment: str
    model: str
    serve_arguments: tuple[str, ...]
    placement: Placement
    sizes: tuple[RoleSize, ...]
    health_interval: float = 2.0
    unhealthy_threshold: int = 3
    startup_timeout: float = 600.0
    drain_timeout: float = 60.0  # how long a drained replica's requests may take
    autoscale: Optional[AutoscaleConfig] = None
    host: Optional[str] = None  # the address replicas bind (default: their node's)
    api_key: Optional[str] = field(default=None, repr=False)  # the servers' --api-key (in their environment)


class Supervisor:
    def __init__(self, settings: SupervisorSettings, registry, secret: bytes):
        self.settings = settings
        self.registry = registry
        self.secret = secret
        self.replicas: dict[str, PlacedReplica] = {}
        self.targets = {size.role: size.replicas for size in settings.sizes}
        self.bounds = {size.role: (size.minimum, size.maximum) for size in settings.sizes}
        self.counters = {size.role: itertools.count() for size in settings.sizes}
        self.policy = AutoscalePolicy(settings.autoscale) if settings.autoscale else None
        self.last_health = 0.0
        self.retry_after = {size.role: 0.0 for size in settings.sizes}
        self.ever_served: set[str] = set()
        self.fatal: Optional[str] = None
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # held by a tick, and by resize and shutdown
        self.thread = threading.Thread(target=self.run, name="tandem-deploy-supervisor", daemon=True)

    # -- life ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def run(self) -> None:
        while not self.stopping.wait(TICK_SECONDS):
            try:
                with self.lock:
                    if not self.stopping.is_set():
                        self.tick()
            except Exception:  # keep supervising: one failed call must not end the deployment
                logger.exception("deploy: supervisor tick failed")

    def wait_until_serving(self, timeout: float) -> None:
        """Block until every role has its replicas serving; DeployError when a first replica of a
        role cannot start (a wrong flag, a model that does not load) or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            if self.fatal:
                raise DeployError(self.fatal)
            counts = self.counts(SERVING)
            if all(counts.get(role, 0) >= target for role, target in self.targets.items()):
                return
            if time.monotonic() > deadline:
                raise DeployError(f"the deployment's replicas are not all serving after {timeout:g} s ({counts})")
            time.sleep(0.2)

    def resize(self, role: str, replicas: int) -> None:
        """Set a role's number of replicas (the autoscaler's decision, or an operator's)."""
        minimum, maximum = self.bounds[role]
        with self.lock:
            self.targets[role] = min(max(replicas, minimum), maximum)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop supervising, drain every server (SIGTERM) and remove every actor and placement group."""
        import ray

        self.stopping.set()
        self.thread.join(timeout=10)
        with self.lock:
            for replica in self.replicas.values():
                self.registry.remove.remote(replica.name)
            stops = [replica.actor.stop.remote(timeout) for replica in self.replicas.values()]
            if stops:
                ray.wait(stops, num_returns=len(stops), timeout=timeout + 5)
            for replica in self.replicas.values():
                destroy(replica)
            self.replicas.clear()

    # -- one tick -----------------------------------------------------------------------------------
    def tick(self) -> None:
        self.admit_ready()
        now = time.monotonic()
        if now - self.last_health >= self.settings.health_interval:
            self.last_health = now
            self.check_health()
            if self.policy is not None:
                self.autoscale(now)
        self.reconcile(now)
        self.advance_drains(now)

    def counts(self, *states: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for replica in list(self.replicas.values()):  # read from the driver's thread too
            if replica.state in states:
                counts[replica.role] = counts.get(replica.role, 0) + 1
        return counts

    def admit_ready(self) -> None:
        """Starting replicas whose server is healthy become serving (registered); those that
        failed are destroyed (and placed again by ``reconcile``)."""
        import ray

        starting = [replica for replica in self.replicas.values() if replica.state == STARTING]
        if not starting:
            return
        done, _ = ray.wait([replica.ready for replica in starting], num_returns=len(starting), timeout=0)
        done = set(done)
        for replica in starting:
            if replica.ready not in done:
                continue
            try:
                record = ray.get(replica.ready)
            except Exception as error:
                self.failed_to_start(replica, error)
                continue
            replica.record, replica.state = record, SERVING
            self.ever_served.add(replica.role)
            ray.get(self.registry.upsert.remote({**record, "state": SERVING, "healthy": True, "problem": ""}))
            logger.info("deploy: %s serves at %s on node %s (GPUs %s)", replica.name, record["url"],
                        record["node_ip"], record["gpus"] or "none")

    def failed_to_start(self, replica: PlacedReplica, error: BaseException) -> None:
        message = getattr(error, "cause", None) or error
        logger.error("deploy: replica %s failed to start: %s", replica.name, message)
        self.forget(replica)
        self.retry_after[replica.role] = time.monotonic() + RETRY_SECONDS
        if replica.role not in self.ever_served:  # the first of its role: a setup error, not bad luck
            self.fatal = f"replica {replica.name} failed to start: {message}"

    def check_health(self) -> None:
        import ray

        serving = [replica for replica in self.replicas.values() if replica.state == SERVING]
        answers = {replica.name: replica.actor.alive.remote() for replica in serving}
        if answers:
            ray.wait(list(answers.values()), num_returns=len(answers), timeout=CHECK_TIMEOUT)
        for replica in serving:
            try:
                alive = ray.get(answers[replica.name], timeout=0)
            except ray.exceptions.GetTimeoutError:
                alive, problem = None, f"its actor did not answer within {CHECK_TIMEOUT:g} s"
            except ray.exceptions.RayActorError as error:
                self.replace(replica, f"its actor died ({type(error).__name__})")
                continue
            if alive is False:
                self.replace(replica, "its server process exited")
                continue
            status = get_status(replica.record["url"] + "/health")
            if alive and status == 200:
                if replica.failed_checks:
                    self.registry.upsert.remote({"name": replica.name, "healthy": True, "problem": ""})
                replica.failed_checks = 0
                continue
            problem = problem if alive is None else f"GET /health answered {status or 'nothing'}"
            replica.failed_checks += 1
            self.registry.upsert.remote({"name": replica.name, "healthy": False, "problem": problem})
            if replica.failed_checks >= self.settings.unhealthy_threshold:
                self.replace(replica, f"{problem} ({replica.failed_checks} checks in a row)")

    def replace(self, replica: PlacedReplica, reason: str) -> None:
        """Out of the registry at once (no new requests), destroyed; ``reconcile`` places its successor."""
        logger.warning("deploy: replacing %s %s (%s): %s", replica.role, replica.name,
                       (replica.record or {}).get("url"), reason)
        self.forget(replica)

    def forget(self, replica: PlacedReplica) -> None:
        import ray

        ray.get(self.registry.remove.remote(replica.name))
        destroy(replica)
        self.replicas.pop(replica.name, None)

    def autoscale(self, now: float) -> None:
        import ray

        load = ray.get(self.registry.load.remote(), timeout=CHECK_TIMEOUT)
        for role, (minimum, maximum) in self.bounds.items():
            serving = [replica for replica in self.replicas.values()
                       if replica.role == role and replica.state == SERVING]
            if len(serving) != self.targets[role]:
                continue  # a change is under way: decide again once it is done
            in_flight = sum(load["in_flight"].get(replica.name, 0) for replica in serving)
            first_event = load["first_event_seconds"].get(role)
            desired = self.policy.desired(role, len(serving), minimum, maximum, in_flight, first_event, now)
            if desired != self.targets[role]:
                logger.warning("deploy: scaling %s from %d to %d replicas (%d legs in flight%s)", role,
                               self.targets[role], desired, in_flight,
                               f", recent time to first token {first_event * 1000:.0f} ms" if first_event else "")
                self.targets[role] = desired

    def reconcile(self, now: float) -> None:
        """Place or drain replicas until each role has its target (starting or serving)."""
        for role, target in self.targets.items():
            active = [replica for replica in self.replicas.values()
                      if replica.role == role and replica.state in (STARTING, SERVING)]
            if len(active) < target and now >= self.retry_after[role]:
                for _ in range(target - len(active)):
                    self.place(role)
            elif len(active) > target:
                for replica in self.surplus(active, len(active) - target):
                    self.drain(replica)

    def place(self, role: str) -> None:
        name = f"{role}-{next(self.counters[role])}"
        spec = {"name": name, "role": role, "model": self.settings.model, "deployment": self.settings.deployment,
                "serve_arguments": list(self.settings.serve_arguments), "host": self.settings.host,
                "api_key": self.settings.api_key}
        replica = place_replica(spec, self.secret, self.settings.placement, self.settings.startup_timeout)
        self.replicas[name] = replica
        self.registry.upsert.remote({"name": name, "role": role, "state": STARTING, "url": "", "healthy": False,
                                     "problem": "starting"})
        logger.info("deploy: placing %s", name)

    @staticmethod
    def surplus(active: list[PlacedReplica], count: int) -> list[PlacedReplica]:
        """The replicas to remove: those still starting first, then the newest."""
        ordered = sorted(active, key=lambda replica: (replica.state == SERVING, -replica.started))
        return ordered[:count]

    def drain(self, replica: PlacedReplica) -> None:
        import ray

        if replica.state == STARTING:
            self.forget(replica)
            return
        replica.state, replica.drain_started = DRAINING, time.monotonic()
        replica.drain_version = ray.get(self.registry.upsert.remote({"name": replica.name, "state": DRAINING}))
        logger.info("deploy: draining %s (%s)", replica.name, replica.record["url"])

    def advance_drains(self, now: float) -> None:
        """A draining replica is stopped once no router sends to it, and destroyed once stopped."""
        import ray

        for replica in [replica for replica in self.replicas.values() if replica.state == DRAINING]:
            if replica.stopping is None:
                overdue = now - replica.drain_started > self.settings.drain_timeout
                if not overdue and not self.routers_done_with(replica):
                    continue
                replica.stopping = replica.actor.stop.remote(self.settings.drain_timeout)
            done, _ = ray.wait([replica.stopping], timeout=0)
            if done or now - replica.drain_started > 2 * self.settings.drain_timeout + CHECK_TIMEOUT:
                logger.info("deploy: %s drained and stopped", replica.name)
                self.forget(replica)

    def routers_done_with(self, replica: PlacedReplica) -> bool:
        import ray

        behind = ray.get(self.registry.routers_behind.remote(replica.drain_version), timeout=CHECK_TIMEOUT)
        if behind:
            return False
        load = ray.get(self.registry.load.remote(), timeout=CHECK_TIMEOUT)
        return load["in_flight"].get(replica.name, 0) == 0
