"""The router against stand-in servers (``tests/support/stand_ins.py``: no engines, so these cases are
fast and exact about who answered what): servers that turn requests away, and the router's own
bounded drain on SIGTERM.

A server that answers 503 (its queue is full) never started the request: the router sends it to
another healthy server of that role, streamed or not, and only when none is left does the client
get the 503, with the server's ``Retry-After``. A streamed answer is committed at the decode
leg's first event, so a prefill failure before it keeps its own status.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.pd import RouterProcess
from tests.support.servers import free_port

STAND_INS = Path(__file__).resolve().parents[1] / "support" / "stand_ins.py"


class StandIn:
    def __init__(self, role: str, log_dir: Path, *flags: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / f"{role}-{self.port}.log", "w")
        self.process = subprocess.Popen([sys.executable, str(STAND_INS), role, str(self.port), *flags],
                                        stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.process.poll() is None and time.monotonic() < deadline, f"stand-in {role} did not start"
            time.sleep(0.1)

    def served(self) -> int:
        return httpx.get(self.base_url + "/served", timeout=5).json()["requests"]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    logs = tmp_path_factory.mktemp("router_busy")
    # the decode stand-in answers a little later than a busy server turns a request away
    stand_ins = {"busy_prefill": StandIn("prefill", logs, "--busy"), "prefill": StandIn("prefill", logs),
                 "busy_decode": StandIn("decode", logs, "--busy"), "decode": StandIn("decode", logs, "--answer-ms", "50")}
    url = {name: stand_in.base_url for name, stand_in in stand_ins.items()}
    routers = {
        # round robin: every other request goes to the busy server first
        "mixed": RouterProcess([url["busy_prefill"], url["prefill"]], [url["busy_decode"], url["decode"]],
                               logs / "router_mixed.log", ("--policy", "round-robin")),
        "all_busy": RouterProcess([url["busy_prefill"]], [url["decode"]], logs / "router_all_busy.log"),
    }
    try:
        for router in routers.values():
            router.start()
        yield stand_ins, routers
    finally:
        for process in [*routers.values(), *stand_ins.values()]:
            process.stop()


def body(stream: bool) -> dict:
    return {"model": "stand-in", "prompt": [5, 6, 7], "max_tokens": 3, "stream": stream}


@pytest.mark.parametrize("stream", [False, True])
def test_a_busy_server_sends_the_request_elsewhere(deployment, stream):
    stand_ins, routers = deployment
    router = routers["mixed"]
    served = {name: stand_in.served() for name, stand_in in stand_ins.items()}
    retries = {role: router.metric("router_retries_total", f'role="{role}"') for role in ("prefill", "decode")}
    for _ in range(4):
        response = httpx.post(router.base_url + "/v1/completions", json=body(stream), timeout=30)
        assert response.status_code == 200, response.text
        if stream:
            events = [line for line in response.text.splitlines() if line.startswith("data: {")]
            assert len(events) == 3 and all('"error"' not in event for event in events), response.text
        else:
            assert response.json()["choices"][0]["token_ids"] == [1, 2, 3]
    # a leg whose other leg was turned away is cancelled and sent again (new room) to the same server
    assert stand_ins["prefill"].served() - served["prefill"] >= 4
    assert stand_ins["decode"].served() - served["decode"] >= 4
    # round robin picks a busy server of each role at least every other request; only the refused
    # leg is picked again, so each role is sent again at least twice in four requests
    for role in ("prefill", "decode"):
        assert router.metric("router_retries_total", f'role="{role}"') >= retries[role] + 2
    assert router.metric("router_requests_total", 'outcome="ok"') >= 4


@pytest.mark.parametrize("stream", [False, True])
def test_with_every_server_busy_the_client_gets_the_503(deployment, stream):
    stand_ins, routers = deployment
    decode_served = stand_ins["decode"].served()
    response = httpx.post(routers["all_busy"].base_url + "/v1/completions", json=body(stream), timeout=30)
    assert response.status_code == 503, response.text  # a status, not an error inside a stream
    assert response.headers["retry-after"] == "7"  # the server's advice, passed on
    assert "busy" in response.json()["error"]["message"]
    assert response.headers["x-request-id"]
    assert stand_ins["decode"].served() - decode_served <= 1  # its leg was cut (it may have begun)
    assert routers["all_busy"].metric("router_requests_total", 'outcome="prefill_failed"') >= 1


def test_sigterm_drain_is_bounded(tmp_path):
    """A stream still running when the router is told to stop is cut after --shutdown-timeout;
    the router exits 0."""
    prefill, decode = StandIn("prefill", tmp_path), StandIn("decode", tmp_path, "--token-ms", "50")
    router = RouterProcess([prefill.base_url], [decode.base_url], tmp_path / "router.log",
                           ("--shutdown-timeout", "1"))
    lines, first_event = [], threading.Event()

    def stream():  # 200 tokens, 50 ms apart: about 10 s
        try:
            with httpx.stream("POST", router.base_url + "/v1/completions", json={**body(True), "max_tokens": 200},
                              timeout=60) as response:
                for line in response.iter_lines():
                    lines.append(line)
                    first_event.set()
        except httpx.HTTPError:
            pass
    try:
        router.start()
        thread = threading.Thread(target=stream)
        thread.start()
        assert first_event.wait(30)
        signalled = time.monotonic()
        status = router.stop(signal.SIGTERM)
        elapsed = time.monotonic() - signalled
        thread.join(30)
    finally:
        router.kill()
        prefill.stop()
        decode.stop()
    assert status == 0
    # The 1 s drain, the router's exit and a busy CPU (another test worker) take well under the
    # ~10 s the stream would have run on: 8 s tells a cut stream from an awaited one.
    assert elapsed < 8, f"the router took {elapsed:.1f} s to stop with a 1 s drain limit"
    assert "data: [DONE]" not in lines and len(lines) < 200, "the long stream cannot have finished"
