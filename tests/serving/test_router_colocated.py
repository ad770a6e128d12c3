"""``tandem router --server``: load balancing over colocated servers, against stand-in servers
(``tests/support/stand_ins.py``: no engines, so these cases are fast and exact about who answered).

Each request goes whole to one server (fewest requests in flight, then fewest sent; or round
robin), its answer streamed through as it comes. A server that turns a request away (503) or
cannot be connected to is skipped: the request goes to another; with none left the client gets
the 503 and the server's ``Retry-After``. Per-server gauges say what went where.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from tandem.entrypoints.router.backends import Backend, BackendMonitor, RouterSetupError
from tandem.entrypoints.router.cli import add_router_parser, check_servers
from tests.support.stand_ins import stand_in_app
from tests.support.pd import BalancingRouterProcess, start_all
from tests.support.servers import free_port


def body(stream: bool, max_tokens: int = 3) -> dict:
    return {"model": "stand-in", "prompt": [5, 6, 7], "max_tokens": max_tokens, "stream": stream}


def served_by(response: httpx.Response, stream: bool) -> str:
    """The stand-in that answered (its name is in every answer), checking the answer whole."""
    if not stream:
        answer = response.json()
        assert answer["choices"][0]["token_ids"] == [1, 2, 3]
        return answer["system_fingerprint"]
    events = [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert [event["choices"][0]["token_ids"] for event in events] == [[1], [2], [3]], response.text
    assert response.text.rstrip().endswith("data: [DONE]")
    assert len({event["system_fingerprint"] for event in events}) == 1  # one server streamed all of it
    return events[0]["system_fingerprint"]


class StandInThread:
    """A colocated stand-in server served by uvicorn on a thread of the test process (no process to
    start: the routers are the processes under test)."""

    def __init__(self, *, token_ms: float = 0.0, busy: bool = False):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        app = stand_in_app("colocated", busy=busy, name=f"colocated:{self.port}", token_seconds=token_ms / 1e3)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "stand-in did not start"
            time.sleep(0.02)

    def served(self) -> int:
        return httpx.get(self.base_url + "/served", timeout=5).json()["requests"]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    logs = tmp_path_factory.mktemp("router_colocated")
    servers = [StandInThread(token_ms=20) for _ in range(3)]
    busy, doomed = StandInThread(busy=True), StandInThread()
    routers = {
        "least_loaded": BalancingRouterProcess([server.base_url for server in servers], logs / "least_loaded.log"),
        "mixed": BalancingRouterProcess([busy.base_url, servers[0].base_url], logs / "mixed.log",
                                        ("--policy", "round-robin")),
        "all_busy": BalancingRouterProcess([busy.base_url], logs / "all_busy.log"),
        # its first server goes away in a test; no health probe brings it back meanwhile
        "fallback": BalancingRouterProcess([doomed.base_url, servers[2].base_url], logs / "fallback.log",
                                           ("--policy", "round-robin", "--health-interval", "60")),
    }
    try:
        start_all(list(routers.values()))
        yield servers, busy, doomed, routers
    finally:
        with ThreadPoolExecutor(len(routers)) as pool:  # their drains overlap
            statuses = list(pool.map(lambda router: router.stop(), routers.values()))
        for server in [*servers, busy, doomed]:
            server.stop()
    assert statuses == [0] * len(routers)


def test_requests_go_to_the_least_loaded_server(deployment):
    servers, _, _, routers = deployment
    router = routers["least_loaded"]
    health = httpx.get(router.base_url + "/health", timeout=10).json()
    assert health["status"] == "ok" and {server["role"] for server in health["servers"]} == {"colocated"}
    before = [server.served() for server in servers]
    # one at a time: none in flight, so the fewest sent: two each
    for number in range(6):
        response = httpx.post(router.base_url + "/v1/completions", json=body(stream=number % 2 == 0), timeout=30)
        assert response.status_code == 200, response.text
        served_by(response, stream=number % 2 == 0)
    assert [server.served() - count for server, count in zip(servers, before)] == [2, 2, 2]
    # a long stream holds one server: the next requests go to the other two, fewest sent first
    with httpx.stream("POST", router.base_url + "/v1/completions", json=body(True, max_tokens=100),
                      timeout=30) as long_stream:
        lines = long_stream.iter_lines()
        holder = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])["system_fingerprint"]
        names = []
        for number in range(4):
            response = httpx.post(router.base_url + "/v1/completions", json=body(stream=number % 2 == 0), timeout=30)
            assert response.status_code == 200, response.text
            names.append(served_by(response, stream=number % 2 == 0))
        holder_url = next(server.base_url for server in servers if f"colocated:{server.port}" == holder)
        assert router.metric("router_backend_in_flight", f'role="colocated",url="{holder_url}"') == 1
        assert [line for line in lines if line.startswith("data: {")].__len__() == 99  # streamed through whole
    assert holder not in names and len(set(names)) == 2 and all(names.count(name) == 2 for name in names)
    for server in servers:
        labels = f'role="colocated",url="{server.base_url}"'
        assert router.metric("router_backend_dispatched", labels) >= 3
        assert router.metric("router_backend_in_flight", labels) == 0
        assert router.metric("router_backend_healthy", labels) == 1
    assert router.metric("router_requests_total", 'outcome="ok"') >= 11


@pytest.mark.parametrize("stream", [False, True])
def test_a_busy_server_sends_the_request_elsewhere(deployment, stream):
    servers, busy, _, routers = deployment
    router = routers["mixed"]
    retries = router.metric("router_retries_total", 'role="colocated"')
    served = servers[0].served()
    for _ in range(4):  # round robin: every other request tries the busy server first
        response = httpx.post(router.base_url + "/v1/completions", json=body(stream), timeout=30)
        assert response.status_code == 200, response.text
        assert served_by(response, stream) == f"colocated:{servers[0].port}"
    assert servers[0].served() - served == 4 and busy.served() == 0
    assert router.metric("router_retries_total", 'role="colocated"') >= retries + 2


@pytest.mark.parametrize("stream", [False, True])
def test_with_every_server_busy_the_client_gets_the_503(deployment, stream):
    _, _, _, routers = deployment
    response = httpx.post(routers["all_busy"].base_url + "/v1/completions", json=body(stream), timeout=30)
    assert response.status_code == 503, response.text  # a status, not an error inside a stream
    assert response.headers["retry-after"] == "7"  # the server's advice, passed on
    assert "busy" in response.json()["error"]["message"]
    assert routers["all_busy"].metric("router_requests_total", 'outcome="server_failed"') >= 1


def test_a_server_that_went_away_is_skipped(deployment):
    """Connection refused: the request goes to the other server, and the dead one gets no more."""
    servers, _, doomed, routers = deployment
    router, alive = routers["fallback"], servers[2]
    doomed.stop()  # nothing listens on its port any more
    served = alive.served()
    for stream in (True, False, True, False):
        response = httpx.post(router.base_url + "/v1/completions", json=body(stream), timeout=30)
        assert response.status_code == 200, response.text
        assert served_by(response, stream) == f"colocated:{alive.port}"
    assert alive.served() - served == 4
    assert router.metric("router_backend_healthy", f'role="colocated",url="{doomed.base_url}"') == 0
    assert router.metric("router_retries_total", 'role="colocated"') == 1  # then it was not picked again


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    return parser.parse_args(["router", *flags])


@pytest.mark.parametrize("flags, message", [
    (("--server", "http://a", "--prefill", "http://b"), "cannot be combined with --prefill/--decode"),
    (("--server", "http://a", "--decode", "http://b"), "cannot be combined with --prefill/--decode"),
    ((), "--server, or --prefill and --decode is required"),
    (("--prefill", "http://b"), "--decode is required"),
    (("--server", "http://a", "--prefill-affinity"), "--prefill-affinity applies to PD"),
])
def test_server_flags_exclude_pd_flags(flags, message):
    with pytest.raises(SystemExit, match=message):
        check_servers(parse(*flags))
    check_servers(parse("--server", "http://a", "http://b"))
    check_servers(parse("--prefill", "http://a", "--decode", "http://b"))


def test_a_server_of_the_other_kind_is_named_at_start_up():
    """A colocated server given as a PD leg, or a PD server given as --server, stops the router at
    start with the flag it belongs under."""
    monitor = BackendMonitor([], client=None)
    with pytest.raises(RouterSetupError, match="runs with role 'colocated'.*as --server"):
        monitor.apply_info(Backend("http://a", "prefill"), {"role": "colocated", "served_model_names": ["m"]})
    with pytest.raises(RouterSetupError, match="runs with role 'decode'.*as --decode"):
        monitor.apply_info(Backend("http://a", "colocated"), {"role": "decode", "served_model_names": ["m"]})
    server = Backend("http://a", "colocated")
    monitor.apply_info(server, {"role": "colocated", "served_model_names": ["m"]})  # no layout: nothing to agree on
    assert server.model_names == ["m"] and server.layout is None
