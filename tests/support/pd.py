"""Shared pieces of the PD tests (no tests here): an in-process prefill/decode pair of engine
cores joined by real NIXL agents and a real control channel, and launchers for ``tandem serve
--role ...`` and ``tandem router`` as child processes."""
from __future__ import annotations

import os

os.environ["TANDEM_SANITIZE"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import httpx  # noqa: E402

from tandem.config import EngineConfig  # noqa: E402
from tandem.engine.core import EngineCore  # noqa: E402
from tandem.protocol import EngineRequest, RequestDelta, TransferParams  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402
from tandem.transfer.config import TransferConfig  # noqa: E402
from tandem.transfer.messages import new_room  # noqa: E402
from tests.support.servers import REPOSITORY_ROOT, ServerProcess, free_port  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
# Short enough for fault tests to be quick, long enough that a loaded CI machine's slow step is not
# taken for a dead peer (the dead-peer tests shorten peer_timeout further).
FAST_TIMEOUTS = dict(heartbeat_interval=0.2, peer_timeout=8.0, connect_timeout=10.0, bootstrap_timeout=30.0,
                     transfer_timeout=30.0, drain_timeout=2.0)


class PDPair:
    """A prefill and a decode ``EngineCore`` in this process, stepped alternately.

    Each has its own NIXL agent and control channel (ZMQ over 127.0.0.1), exactly as in two
    processes; only the scheduling of their loops is shared, which makes fault tests
    deterministic (a side that is not stepped is a side that is stalled).
    """

    def __init__(self, model_dir: str, prefill_options: Optional[dict] = None, decode_options: Optional[dict] = None,
                 transfer: Optional[dict] = None, decode_transfer: Optional[dict] = None, **options) -> None:
        transfer = {**FAST_TIMEOUTS, **(transfer or {})}
        options.setdefault("async_scheduling", True)  # the overlapped loop, as on a GPU (servers here run without)
        self.prefill = EngineCore(EngineConfig(model=model_dir, **{**options, **(prefill_options or {})},
                                               transfer=TransferConfig(role="prefill", **transfer)))
        self.decode = EngineCore(EngineConfig(model=model_dir, **{**options, **(decode_options or {})},
                                              transfer=TransferConfig(role="decode", **{**transfer,
                                                                                       **(decode_transfer or {})})))
        self.outputs: dict[str, list[RequestDelta]] = {}
        self.prefill_outputs: dict[str, list[RequestDelta]] = {}

    @property
    def address(self) -> str:
        return self.prefill.pd.channel.address

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams = GREEDY,
               room: Optional[str] = None, prefill: bool = True, decode: bool = True) -> str:
        room = room or new_room()
        if prefill:
            self.prefill.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                                                   transfer=TransferParams(room=room, role="prefill")))
        if decode:
            self.decode.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                                                  transfer=TransferParams(room=room, role="decode",
                                                                          prefill_address=self.address)))
        return room

    def submit_destination_first(self, request_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> str:
        """Both legs, the decode leg first: the prefill engine gets the request only once the
        decode side's destination reached it, so pages stream chunk by chunk as they are
        computed (else the prefill engine may compute the whole prompt, and its tiers store it,
        before the destination comes)."""
        room = self.submit(request_id, prompt, params, prefill=False)
        self.run_until(lambda: room in self.prefill.pd.early_destinations)
        self.submit(request_id, prompt, params, room=room, decode=False)
        return room

    def step(self, prefill: bool = True, decode: bool = True) -> None:
        if prefill:
            for delta in self.prefill.step():
                self.prefill_outputs.setdefault(delta.request_id, []).append(delta)
        if decode:
            for delta in self.decode.step():
                self.outputs.setdefault(delta.request_id, []).append(delta)

    def run_until(self, done: Callable[[], bool], timeout: float = 30.0, **which) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError("PD pair did not reach the expected state in time")
            self.step(**which)
            time.sleep(0.0005)

    def finished(self, request_id: str) -> bool:
        return any(delta.finish_reason for delta in self.outputs.get(request_id, []))

    def tokens(self, request_id: str) -> list[int]:
        return [token for delta in self.outputs.get(request_id, []) for token in delta.new_token_ids]

    def assert_matches(self, request_id: str, reference) -> None:
        """The decode side's tokens equal an oracle ``Reference``'s, and their logprobs too."""
        from tests.support.oracle import LOGPROB_TOLERANCE

        assert self.error(request_id) is None, self.error(request_id)
        assert self.tokens(request_id) == reference.token_ids, request_id
        entries = [entry for delta in self.outputs[request_id] for entry in delta.new_logprobs or []]
        for position, entry in enumerate(entries):
            expected = reference.logprobs[position][entry.token_ids[0]].item()
            assert abs(entry.logprobs[0] - expected) <= LOGPROB_TOLERANCE, (request_id, position)

    def error(self, request_id: str) -> Optional[str]:
        return next((delta.error for delta in self.outputs.get(request_id, []) if delta.finish_reason == "error"), None)

    def prefill_error(self, request_id: str) -> Optional[str]:
        return next((delta.error for delta in self.prefill_outputs.get(request_id, [])
                     if delta.finish_reason == "error"), None)

    def settle(self, timeout: float = 10.0) -> None:
        """Step both sides until no transfer is live on either (drains, rows, in-flight holds)."""
        self.run_until(lambda: not (self.prefill.pd.busy() or self.decode.pd.busy()
                                    or self.prefill.scheduler.has_unfinished()
                                    or self.decode.scheduler.has_unfinished()), timeout)

    def assert_all_free(self) -> None:
        self.prefill.check_all_free()
        self.decode.check_all_free()
        for engine in (self.prefill, self.decode):
            assert engine.pd.metadata.num_free == engine.pd.metadata.num_rows

    def close(self) -> None:
        self.prefill.shutdown()
        self.decode.shutdown()


def serve_flags(options: dict) -> list[str]:
    return [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]


class RouterProcess(ServerProcess):
    """``tandem router`` as a child process (same lifetime rules as ``ServerProcess``); its
    /health answers once it has read every server's /pd/info."""
    ready_path = "/health"
    kind = "router"

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], log_path: Path, extra: tuple = (),
                 environment: Optional[dict] = None):
        super().__init__([], log_path, environment)
        self.arguments = ["router", "--port", str(self.port), "--prefill", *prefill_urls, "--decode", *decode_urls,
                          *extra]


class BalancingRouterProcess(ServerProcess):
    """``tandem router --server URL...`` (load balancing over colocated servers) as a child
    process; ready once it has read every server's /pd/info."""
    ready_path = "/health"
    kind = "router"

    def __init__(self, server_urls: list[str], log_path: Path, extra: tuple = (), environment: Optional[dict] = None):
        super().__init__([], log_path, environment)
        self.arguments = ["router", "--port", str(self.port), "--server", *server_urls, *extra]


def start_all(processes: list[ServerProcess], timeout: float = 180.0) -> None:
    """Start servers concurrently (their start-up overlaps), then wait for each to be healthy."""
    for process in processes:
        process.log_file = open(process.log_path, "w")
        process.process = subprocess.Popen([sys.executable, "-m", "tandem.entrypoints.cli", *process.arguments],
                                           cwd=REPOSITORY_ROOT, env=process.environment, stdout=process.log_file,
                                           stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    for process in processes:
        while True:
            if process.process.poll() is not None:
                raise RuntimeError(f"server exited with {process.process.returncode}:\n{process.log()}")
            try:
                if httpx.get(process.base_url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout} s:\n{process.log()}")
            time.sleep(0.2)


def wait_for(condition: Callable[[], bool], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.1)


__all__ = ["GREEDY", "BalancingRouterProcess", "PDPair", "RouterProcess", "ServerProcess", "free_port", "serve_flags",
           "start_all", "wait_for"]
