"""``tandem deploy`` on the command line: a PD (or colocated) deployment on a Ray cluster, with
its router in this process; ``tandem deploy status``: its replicas, read from its registry.

The driver (this process) joins Ray (``RAY_ADDRESS``, else a local Ray it starts), makes the
deployment's PD secret (``secrets.token_bytes``), creates the registry actor, starts the
supervisor (``supervisor.py``) and waits until every role's replicas serve, then serves the
OpenAI API through a router whose membership is the registry. SIGINT/SIGTERM: the router drains
its requests (``--shutdown-timeout``), the servers drain theirs, and every actor, placement group
and server the deployment started is removed; a local Ray it started is shut down.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sys
import uuid

from tandem.entrypoints.deploy.autoscale import AutoscaleConfig
from tandem.entrypoints.deploy.placement import Placement
from tandem.entrypoints.deploy.ray_cluster import (NAMESPACE, DeployError, connect, import_ray, registry_handle,
                                                   registry_name)
from tandem.entrypoints.deploy.serve_flags import add_serve_flags, serve_arguments
from tandem.entrypoints.deploy.supervisor import RoleSize, Supervisor, SupervisorSettings

logger = logging.getLogger("tandem.deploy")
SECRET_BYTES = 32
DEVICE_CHOICES = ("auto", "gpu", "cpu")


def add_deploy_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "deploy", help="run prefill and decode replicas on a Ray cluster behind one router",
        description="Place prefill and decode replicas (each a tandem serve engine, its ranks one placement "
                    "group on one node) on a Ray cluster ($RAY_ADDRESS, else a local Ray), replace the ones "
                    "that die, optionally scale them with the load, and serve the OpenAI API in front of them "
                    "through a router that learns the replicas from the deployment's registry. Every other "
                    "tandem serve flag is passed to each replica. 'tandem deploy status' lists the replicas.")
    group = parser.add_argument_group("deployment")
    group.add_argument("--model", default=None, help="model directory, the same path on every node (required)")
    group.add_argument("--name", default="default",
                       help="the deployment's name; its registry is the Ray actor tandem-deploy-NAME "
                            "(default: %(default)s)")
    group.add_argument("--prefill-replicas", type=int, default=None, metavar="N",
                       help="prefill replicas (tandem serve --role prefill); with --decode-replicas")
    group.add_argument("--decode-replicas", type=int, default=None, metavar="N",
                       help="decode replicas (tandem serve --role decode); with --prefill-replicas")
    group.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="colocated replicas (each request whole to one), instead of prefill and decode ones")
    group.add_argument("--ray-address", default=None,
                       help="the Ray cluster to join (ray start --head prints it) (default: $RAY_ADDRESS; none: "
                            "start a local Ray, shut down on exit)")
    group.add_argument("--replica-device", choices=DEVICE_CHOICES, default="auto",
                       help="what a rank's placement group bundle reserves: one GPU, or CPUs only; auto: GPUs when "
                            "the cluster has any (default: %(default)s)")
    group.add_argument("--cpus-per-rank", type=float, default=1.0,
                       help="CPUs each rank's bundle reserves (default: %(default)s)")
    group.add_argument("--replica-host", default=None,
                       help="address each replica's server and control channel bind (default: its node's address, "
                            "as Ray knows it)")
    group.add_argument("--health-interval", type=float, default=2.0,
                       help="seconds between health checks of each replica (the router's probes and the "
                            "supervisor's) (default: %(default)s)")
    group.add_argument("--unhealthy-threshold", type=int, default=3,
                       help="failed health checks in a row after which a replica is replaced (an actor or server "
                            "that died: at once) (default: %(default)s)")
    group.add_argument("--startup-timeout", type=float, default=600.0,
                       help="seconds a replica may take to become healthy (default: %(default)s)")
    group.add_argument("--drain-timeout", type=float, default=60.0,
                       help="seconds a replica removed by scale-in may take to finish its requests "
                            "(default: %(default)s)")
    router = parser.add_argument_group("router (in front of the deployment)")
    router.add_argument("--host", default="127.0.0.1", help="address the router listens on (default: %(default)s)")
    router.add_argument("--port", type=int, default=8000, help="port the router listens on (default: %(default)s)")
    router.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on the /v1 routes of the router and of every "
                             "replica (default: $TANDEM_API_KEY; none: open)")
    router.add_argument("--policy", choices=("least-loaded", "round-robin"), default="least-loaded",
                        help="how a replica is chosen for each leg (default: %(default)s)")
    router.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take after SIGINT/SIGTERM, at the router and then at "
                             "each replica (default: %(default)s)")
    router.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                        help="log level of the driver and the replicas (default: %(default)s)")
    add_autoscale_arguments(parser)
    actions = add_serve_flags(parser)
    parser.set_defaults(func=run_deploy, serve_flag_actions=actions, deploy_command=None)
    commands = parser.add_subparsers(dest="deploy_command", metavar="status", required=False)
    status = commands.add_parser("status", help="list a deployment's replicas: role, state, health, node, GPUs, URL",
                                 description="Read a running deployment's registry and list its replicas.")
    status.add_argument("--name", default="default", help="the deployment's name (default: %(default)s)")
    status.add_argument("--ray-address", default=None,
                        help="the deployment's Ray cluster (default: $RAY_ADDRESS)")
    status.add_argument("--json", action="store_true", default=False, help="print the records as JSON")
    status.set_defaults(func=run_status)


def add_autoscale_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("autoscaling (--autoscale)")
    group.add_argument("--autoscale", action="store_true", default=False,
                       help="grow and shrink each role between its --min-*/--max-* bounds with the load the router "
                            "sees (legs in flight per replica; time to first token)")
    for role in ("prefill", "decode", ""):
        flag = f"{role}-replicas" if role else "replicas"
        what = f"{role} replicas" if role else "colocated replicas"
        group.add_argument(f"--min-{flag}", type=int, default=None, metavar="N",
                           help=f"fewest {what} (default: its --{flag})")
        group.add_argument(f"--max-{flag}", type=int, default=None, metavar="N",
                           help=f"most {what} (default: its --{flag})")
    defaults = AutoscaleConfig()
    group.add_argument("--scale-out-in-flight", type=float, default=defaults.scale_out_in_flight,
                       help="a role grows while its replicas have more requests in flight each than this "
                            "(default: %(default)s)")
    group.add_argument("--scale-in-in-flight", type=float, default=defaults.scale_in_in_flight,
                       help="a role shrinks while its replicas have fewer requests in flight each than this "
                            "(default: %(default)s)")
    group.add_argument("--scale-out-ttft-ms", type=float, default=None, metavar="MS",
                       help="prefill (or colocated) replicas also grow while the router's mean time to first token "
                            "over the last 10 s exceeds MS (default: off)")
    group.add_argument("--scale-out-after", type=float, default=defaults.scale_out_after, metavar="SECONDS",
                       help="how long a role must be overloaded before it grows by one (default: %(default)s)")
    group.add_argument("--scale-in-after", type=float, default=defaults.scale_in_after, metavar="SECONDS",
                       help="how long a role must be idle before it shrinks by one (default: %(default)s)")


# -- checking the flags -----------------------------------------------------------------------------
def role_sizes(arguments: argparse.Namespace) -> tuple[RoleSize, ...]:
    """Each role's replicas and bounds; SystemExit naming the flag when they do not make sense."""
    pd = arguments.prefill_replicas is not None or arguments.decode_replicas is not None
    if pd and arguments.replicas is not None:
        fail("--replicas (colocated) cannot be combined with --prefill-replicas/--decode-replicas (PD)")
    if not pd and arguments.replicas is None:
        fail("--prefill-replicas and --decode-replicas (PD), or --replicas (colocated), are required")
    if pd and (arguments.prefill_replicas is None or arguments.decode_replicas is None):
        fail("--prefill-replicas and --decode-replicas go together")
    roles = ("prefill", "decode") if pd else ("colocated",)
    sizes = []
    for role in roles:
        flag = "replicas" if role == "colocated" else f"{role}-replicas"
        replicas = getattr(arguments, flag.replace("-", "_"))
        minimum = getattr(arguments, f"min_{flag.replace('-', '_')}")
        maximum = getattr(arguments, f"max_{flag.replace('-', '_')}")
        if (minimum is not None or maximum is not None) and not arguments.autoscale:
            fail(f"--min-{flag}/--max-{flag} need --autoscale")
        minimum = replicas if minimum is None else minimum
        maximum = replicas if maximum is None else maximum
        if minimum < 1:
            fail(f"--min-{flag} (or --{flag}) must be >= 1, got {minimum}")
        if not minimum <= replicas <= maximum:
            fail(f"--{flag} must lie within --min-{flag} and --max-{flag} ({minimum}..{maximum}), got {replicas}")
        sizes.append(RoleSize(role, replicas, minimum, maximum))
    return tuple(sizes)


def autoscale_config(arguments: argparse.Namespace):
    if not arguments.autoscale:
        return None
    try:
        return AutoscaleConfig(scale_out_in_flight=arguments.scale_out_in_flight,
                               scale_in_in_flight=arguments.scale_in_in_flight,
                               ttft_target=(arguments.scale_out_ttft_ms / 1000 if arguments.scale_out_ttft_ms
                                            is not None else None),
                               scale_out_after=arguments.scale_out_after, scale_in_after=arguments.scale_in_after)
    except ValueError as error:
        fail(str(error))


def check_numbers(arguments: argparse.Namespace) -> None:
    for flag in ("health_interval", "startup_timeout", "drain_timeout", "cpus_per_rank"):
        if getattr(arguments, flag) <= 0:
            fail(f"--{flag.replace('_', '-')} must be > 0, got {getattr(arguments, flag)}")
    if arguments.unhealthy_threshold < 1:
        fail(f"--unhealthy-threshold must be >= 1, got {arguments.unhealthy_threshold}")
    if arguments.shutdown_timeout < 0:
        fail(f"--shutdown-timeout must be >= 0, got {arguments.shutdown_timeout}")
    if arguments.model is None:
        fail("--model is required (a model directory at the same path on every node)")


def fail(message: str):
    raise SystemExit(f"tandem deploy: {message}")


# -- running --------------------------------------------------------------------------------------
def run_deploy(arguments: argparse.Namespace) -> int:
    from tandem.entrypoints.engine_arguments import configure_logging

    configure_logging(arguments.log_level)
    sizes = role_sizes(arguments)
    check_numbers(arguments)
    autoscale = autoscale_config(arguments)
    api_key = arguments.api_key or os.environ.get("TANDEM_API_KEY") or None
    flags = serve_arguments(arguments, arguments.serve_flag_actions) + ["--log-level", arguments.log_level,
                                                                         "--shutdown-timeout",
                                                                         str(arguments.shutdown_timeout)]
    signal.signal(signal.SIGTERM, stop_starting)  # until the router serves, a signal undoes the start
    try:
        started_ray = connect(arguments.ray_address, start_local=True)
    except DeployError as error:
        print(f"tandem deploy: {error}", file=sys.stderr)
        return 2
    ray = import_ray()
    supervisor = registry = None
    try:
        registry = create_registry(arguments, sizes)
        settings = SupervisorSettings(
            deployment=arguments.name, model=os.path.abspath(arguments.model), serve_arguments=tuple(flags),
            placement=Placement(arguments.tensor_parallel_size, uses_gpus(ray, arguments.replica_device),
                                arguments.cpus_per_rank),
            sizes=sizes, health_interval=arguments.health_interval, unhealthy_threshold=arguments.unhealthy_threshold,
            startup_timeout=arguments.startup_timeout, drain_timeout=arguments.drain_timeout, autoscale=autoscale,
            host=arguments.replica_host, api_key=api_key)
        supervisor = Supervisor(settings, registry, secrets.token_bytes(SECRET_BYTES))
        supervisor.start()
        supervisor.wait_until_serving(arguments.startup_timeout)
        logger.info("deployment %r serving: %s", arguments.name,
                    ", ".join(f"{size.replicas} {size.role}" for size in sizes))
        return serve_router(arguments, registry, tuple(size.role for size in sizes), api_key)
    except DeployError as error:
        logger.error("%s", error)
        print(f"tandem deploy: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up below is not to be cut short
        if supervisor is not None:
            supervisor.shutdown(arguments.shutdown_timeout)
        if registry is not None:
            ray.kill(registry, no_restart=True)
        ray.shutdown()
        logger.info("deployment %r removed%s", arguments.name, " (and its local Ray)" if started_ray else "")


def stop_starting(signum, frame) -> None:
    raise KeyboardInterrupt


def create_registry(arguments: argparse.Namespace, sizes: tuple[RoleSize, ...]):
    ray = import_ray()
    from tandem.entrypoints.deploy.registry import DeploymentRegistry

    try:
        ray.get_actor(registry_name(arguments.name), namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise DeployError(f"a deployment named {arguments.name!r} already runs on this Ray cluster (give --name)")
    description = {"name": arguments.name, "model": os.path.abspath(arguments.model),
                   "roles": {size.role: {"replicas": size.replicas, "minimum": size.minimum, "maximum": size.maximum}
                             for size in sizes},
                   "tensor_parallel_size": arguments.tensor_parallel_size, "autoscale": arguments.autoscale,
                   "router": f"http://{arguments.host}:{arguments.port}"}
    return ray.remote(DeploymentRegistry).options(name=registry_name(arguments.name), namespace=NAMESPACE,
                                                  num_cpus=0, max_restarts=0).remote(description)


def uses_gpus(ray, device: str) -> bool:
    if device != "auto":
        return device == "gpu"
    return ray.cluster_resources().get("GPU", 0) > 0


def serve_router(arguments: argparse.Namespace, registry, roles: tuple[str, ...], api_key) -> int:
    import uvicorn

    from tandem.entrypoints import event_loop
    from tandem.entrypoints.deploy.registry import RegistryMembership
    from tandem.entrypoints.event_loop import DrainingServer
    from tandem.entrypoints.router import Router, RouterSetupError
    from tandem.entrypoints.router.app import create_router_app

    async def serve() -> int:
        membership = RegistryMembership(registry, roles, router_id=f"deploy-{uuid.uuid4().hex[:8]}")
        router = Router([], [], arguments.policy, api_key=api_key, server_api_key=api_key,
                        health_interval=arguments.health_interval, membership=membership)
        try:
            try:
                await router.discover(arguments.startup_timeout)
            except RouterSetupError as error:
                raise DeployError(str(error)) from None
            config = uvicorn.Config(create_router_app(router), host=arguments.host, port=arguments.port,
                                    log_level=arguments.log_level, access_log=arguments.log_level == "debug",
                                    timeout_graceful_shutdown=arguments.shutdown_timeout)
            logger.info("router of deployment %r on http://%s:%d", arguments.name, arguments.host, arguments.port)
            await DrainingServer(config).serve()
            return 0
        finally:
            await router.close()

    return event_loop.run(serve())


def run_status(arguments: argparse.Namespace) -> int:
    try:
        connect(arguments.ray_address, start_local=False)
        ray = import_ray()
        registry = registry_handle(arguments.name)
        description = ray.get(registry.describe.remote(), timeout=30)
        replicas = ray.get(registry.replicas.remote(), timeout=30)
    except DeployError as error:
        print(f"tandem deploy status: {error}", file=sys.stderr)
        return 2
    if arguments.json:
        print(json.dumps({"deployment": description, "replicas": replicas}, indent=2))
        return 0
    print(f"deployment {description['name']}: model {description['model']}, router {description['router']}")
    print(status_table(replicas))
    return 0


STATUS_COLUMNS = ("name", "role", "state", "health", "node", "gpus", "url")


def status_table(replicas: list[dict]) -> str:
    rows = [STATUS_COLUMNS]
    for record in replicas:
        health = "healthy" if record.get("healthy") else f"unhealthy: {record.get('problem') or '?'}"
        rows.append((record["name"], record["role"], record.get("state", "?"), health, record.get("node_ip") or "-",
                     ",".join(record.get("gpus") or []) or "-", record.get("url") or "-"))
    widths = [max(len(str(row[column])) for row in rows) for column in range(len(STATUS_COLUMNS))]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
