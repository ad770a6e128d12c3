"""``tandem router`` on the command line: flags, start-up checks, serving until a signal."""
from __future__ import annotations

import argparse
import logging
import os

from tandem.entrypoints import event_loop
from tandem.entrypoints.event_loop import DrainingServer
from tandem.entrypoints.router.backends import DEFAULT_HEALTH_INTERVAL, RouterSetupError
from tandem.entrypoints.router.routing import POLICIES, Router

logger = logging.getLogger("tandem.router")


def add_router_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "router", help="serve the OpenAI API in front of prefill and decode servers, or of colocated servers",
        description="Route each request to a prefill server and a decode server at once (disaggregated "
                    "prefill/decode) and stream the decode server's answer back; or (--server) balance "
                    "requests over colocated servers, each request sent whole to one of them.")
    parser.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                        help="base URLs of prefill servers (tandem serve --role prefill); with --decode")
    parser.add_argument("--decode", nargs="+", default=[], metavar="URL",
                        help="base URLs of decode servers (tandem serve --role decode); with --prefill")
    parser.add_argument("--server", nargs="+", default=[], metavar="URL",
                        help="base URLs of colocated servers (tandem serve) to balance requests over; instead of "
                             "--prefill/--decode")
    parser.add_argument("--policy", choices=POLICIES, default="least-loaded",
                        help="how a server is chosen for each leg (least-loaded: fewest requests in flight) "
                             "(default: %(default)s)")
    parser.add_argument("--prefill-affinity", action="store_true", default=False,
                        help="send a conversation's next turn to the prefill server that served its start (its "
                             "prefix cache still holds it), when that server is healthy (default: off)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' from clients on the /v1 routes "
                             "(default: $TANDEM_API_KEY; none: open)")
    parser.add_argument("--server-api-key", default=None,
                        help="the key the router sends to the servers (their --api-key) (default: the --api-key "
                             "value)")
    parser.add_argument("--health-interval", type=float, default=DEFAULT_HEALTH_INTERVAL,
                        help="seconds between GET /health probes of each server; an unhealthy server gets no "
                             "requests until it answers again (default: %(default)s)")
    parser.add_argument("--startup-timeout", type=float, default=120.0,
                        help="seconds to wait for every server to answer GET /pd/info (default: %(default)s)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish after SIGINT/SIGTERM; then they are "
                             "cut (both legs cancelled: the servers abort them) (default: %(default)s)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                        help="log level (default: %(default)s)")
    parser.set_defaults(func=run_router)


def check_servers(arguments: argparse.Namespace) -> None:
    """Either colocated servers (--server) or PD pairs (--prefill and --decode), never both."""
    if arguments.server and (arguments.prefill or arguments.decode):
        raise SystemExit("tandem router: --server (load balancing over colocated servers) cannot be combined with "
                         "--prefill/--decode (PD); give one or the other")
    if not arguments.server and not (arguments.prefill and arguments.decode):
        missing = ("--decode" if arguments.prefill else "--prefill" if arguments.decode
                   else "--server, or --prefill and --decode")
        raise SystemExit(f"tandem router: {missing} is required (colocated servers: --server URL...; PD: "
                         "--prefill URL... --decode URL...)")
    if arguments.server and arguments.prefill_affinity:
        raise SystemExit("tandem router: --prefill-affinity applies to PD (--prefill servers), not to --server")


def run_router(arguments: argparse.Namespace) -> int:
    import uvicorn

    from tandem.entrypoints.router.app import create_router_app

    logging.basicConfig(level=arguments.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if arguments.health_interval <= 0:
        raise SystemExit(f"tandem router: --health-interval must be > 0, got {arguments.health_interval}")
    if arguments.shutdown_timeout < 0:
        raise SystemExit(f"tandem router: --shutdown-timeout must be >= 0, got {arguments.shutdown_timeout}")
    check_servers(arguments)
    api_key = arguments.api_key or os.environ.get("TANDEM_API_KEY") or None

    async def serve() -> int:
        router = Router(arguments.prefill, arguments.decode, arguments.policy, api_key=api_key,
                        server_api_key=arguments.server_api_key or api_key, health_interval=arguments.health_interval,
                        prefill_affinity=arguments.prefill_affinity, server_urls=tuple(arguments.server))
        try:
            try:
                await router.discover(arguments.startup_timeout)
            except RouterSetupError as error:
                logger.error("%s", error)
                print(f"tandem router: {error}", flush=True)
                return 2
            if arguments.server:
                logger.info("balancing %s over %d colocated servers (%s)", ", ".join(sorted(router.pools)),
                            len(arguments.server), arguments.policy)
            else:
                logger.info("routing %s over %d prefill and %d decode servers (%s)", ", ".join(sorted(router.pools)),
                            len(arguments.prefill), len(arguments.decode), arguments.policy)
            config = uvicorn.Config(create_router_app(router), host=arguments.host, port=arguments.port,
                                    log_level=arguments.log_level, access_log=arguments.log_level == "debug",
                                    timeout_graceful_shutdown=arguments.shutdown_timeout)
            await DrainingServer(config).serve()
            return 0
        finally:
            await router.close()

    try:
        return event_loop.run(serve())
    except KeyboardInterrupt:
        return 0
