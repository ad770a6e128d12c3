"""Soak with faults: minutes of mixed traffic against (a) one ``tandem serve`` or (b) 2P1D (two
prefill servers, one decode server, a router), checking that every request ends exactly or with
a clean error and that nothing leaks.

Traffic (``soak_traffic.py``): greedy completions and chats, streamed or not, n=2, stop strings,
logprobs, short and long prompts; aborts (client timeouts), client disconnects mid-stream, bad
requests. In (b) both prefill servers fail each transfer write with probability
``--failure-probability`` (the test-only ``TANDEM_TEST_TRANSFER_FAILURE_PROB``), and one prefill
server is killed (SIGKILL) a third of the way in and started again at the same port; requests
whose error names an injected fault count as clean ``fault_error`` endings (n=2 is refused with
a 400 naming ``n``: a PD leg serves n=1). Everything listens on 127.0.0.1.

It prints requests by outcome, latency percentiles, pages used and RSS over time, and checks:
  - every request ends exact (equal to the reference run: an offline ``LLM`` on the same model)
    or with a clean error; no 5xx for valid input other than those an injected fault explains;
  - once the traffic stops and prefix caches are flushed, every surviving server holds no page
    (and, in PD, no transfer is queued, sent or draining);
  - RSS is flat: each process's RSS at the end is within max(10%, 64 MiB) of its second quarter's;
  - (b) the router takes the restarted prefill server back and sends it requests (the traffic
    goes on at least a few seconds after that, past ``--duration`` if the restart was slow).
Exit status 1 when a check fails.

    python -m tests.support.soak --mode single --duration 600
    python -m tests.support.soak --mode pd --duration 600 --concurrency 8
    python -m tests.support.soak --mode both --duration 30 --max-requests 400 --model DIR   # short (CI)
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx


from tests.support.soak_processes import ManagedProcess
from tests.support.soak_traffic import (
    CLEAN_OUTCOMES,
    VIOLATIONS,
    Record,
    Traffic,
    bad_templates,
    compute_references,
    run_request,
    stop_templates,
    valid_templates,
)

MODEL_NAME = "soak"
API_KEY = "soak-key"
ENGINE_FLAGS = ["--page-size", "4", "--max-num-batched-tokens", "32", "--max-total-tokens", "8192",
                "--max-num-seqs", "16", "--max-model-len", "1024"]
PD_FLAGS = ["--pd-heartbeat-interval", "0.25", "--pd-peer-timeout", "3", "--pd-drain-timeout", "2",
            "--pd-transfer-timeout", "30", "--pd-bootstrap-timeout", "30"]
FAULT_WORDS = ("injected transfer failure",)
CLEANUP_SECONDS = 30.0
AFTER_RESTART_SECONDS = 4.0
RSS_TOLERANCE, RSS_SLACK_BYTES = 0.10, 64 << 20


@dataclass
class SoakResult:
    mode: str
    records: list[Record]
    seconds: float
    samples: list[tuple[float, dict[str, float]]]  # (t, server -> pages used)
    problems: list[str] = field(default_factory=list)
    started: float = 0.0
    restart: Optional[tuple[float, float]] = None  # (when the router took the server back, its legs then)

    @property
    def violations(self) -> list[Record]:
        return [record for record in self.records if record.outcome in VIOLATIONS]


class Deployment:
    """The processes of one mode; ``servers`` are the engines' servers, ``entry`` what clients call."""

    def __init__(self, mode: str, model: str, log_directory: Path, failure_probability: float):
        self.mode = mode
        self.processes: dict[str, ManagedProcess] = {}
        serve = ["serve", "--model", model, "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
                 "--log-level", "warning", *ENGINE_FLAGS]
        environment = {"TANDEM_SANITIZE": os.environ.get("TANDEM_SANITIZE", "1")}
        if mode == "single":
            self.add("server", serve, log_directory, environment)
            self.entry = self.processes["server"]
            return
        secret = log_directory / "pd_secret"
        secret.write_text(os.urandom(32).hex())
        secret.chmod(0o600)
        faulty = {**environment, "TANDEM_TEST_TRANSFER_FAILURE_PROB": str(failure_probability)}
        for name, role, extra in (("prefill_a", "prefill", faulty), ("prefill_b", "prefill", faulty),
                                  ("decode", "decode", environment)):
            self.add(name, [*serve, "--role", role, *PD_FLAGS, "--pd-secret-file", str(secret)], log_directory, extra)
        urls = {name: process.base_url for name, process in self.processes.items()}
        self.add("router", ["router", "--prefill", urls["prefill_a"], urls["prefill_b"], "--decode", urls["decode"],
                            "--api-key", API_KEY, "--health-interval", "0.5", "--log-level", "warning"],
                 log_directory, environment)
        self.entry = self.processes["router"]

    def add(self, name: str, arguments: list[str], log_directory: Path, environment: dict) -> None:
        self.processes[name] = ManagedProcess(name, arguments, free_port(), log_directory, environment)

    @property
    def servers(self) -> list[ManagedProcess]:
        return [process for name, process in self.processes.items() if name != "router"]

    def start(self) -> None:
        for process in self.servers:
            process.start()
        for process in self.servers:
            process.wait_ready()
        if "router" in self.processes:
            self.processes["router"].start().wait_ready()

    def stop(self) -> None:
        for process in self.processes.values():
            process.stop()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class FaultLog:
    """When the prefill server was down (killed .. taken back by the router, plus peer_timeout)."""

    def __init__(self):
        self.windows: list[tuple[float, float]] = []

    def explains(self, message: str, start: float, end: float) -> bool:
        if any(word in message for word in FAULT_WORDS):
            return True
        return "prefill" in message and any(start <= window_end and end >= window_start
                                            for window_start, window_end in self.windows)


class Deadline:
    """When the traffic stops: ``--duration`` after the start; while ``held`` (a restart is to come)
    not before ``release``, which may set a later moment."""

    def __init__(self, moment: float, held: bool = False):
        self.moment = moment
        self.held = held

    def release(self, moment: float = 0.0) -> None:
        self.moment = max(self.moment, moment)
        self.held = False

    def passed(self) -> bool:
        return not self.held and time.monotonic() >= self.moment


async def run_traffic(traffic: Traffic, arguments, deadline: Deadline, records: list[Record]) -> None:
    limits = httpx.Limits(max_connections=arguments.concurrency * 2, max_keepalive_connections=arguments.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as client:
        async def worker(index: int) -> None:
            generator = random.Random(arguments.seed * 1000 + index)
            while not deadline.passed() and len(records) < arguments.max_requests:
                template, action = traffic.choose(generator)
                records.append(await run_request(client, traffic, template, action, generator))
        await asyncio.gather(*(worker(index) for index in range(arguments.concurrency)))


async def sample_periodically(deployment: Deployment, samples: list, stop: asyncio.Event, interval: float) -> None:
    started = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        pages = {}
        for process in deployment.processes.values():
            await asyncio.to_thread(process.sample_rss, now)
            if process in deployment.servers and process.alive:
                try:
                    pages[process.name] = (await asyncio.to_thread(process.metrics)).get("kv_pages_used", float("nan"))
                except httpx.HTTPError:
                    pages[process.name] = float("nan")
        samples.append((now - started, pages))
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def kill_and_restart(deployment: Deployment, faults: FaultLog, kill_at: float, deadline: Deadline,
                           result: SoakResult) -> None:
    """Kill prefill B at ``kill_at``, start it again, check the router takes it back, and keep the
    traffic going a while after that (at least ``AFTER_RESTART_SECONDS``)."""
    try:
        await restart_prefill(deployment, faults, kill_at, deadline, result)
    finally:
        deadline.release()


async def restart_prefill(deployment: Deployment, faults: FaultLog, kill_at: float, deadline: Deadline,
                          result: SoakResult) -> None:
    await asyncio.sleep(max(0.0, kill_at - time.monotonic()))
    victim, router = deployment.processes["prefill_b"], deployment.processes["router"]
    killed = time.monotonic()
    faults.windows.append((killed - 1.0, float("inf")))
    await asyncio.to_thread(victim.kill)
    print(f"   t={killed - result.started:.0f}s: killed {victim.name}; restarting it", flush=True)
    await asyncio.to_thread(victim.start)
    await asyncio.to_thread(victim.wait_ready)
    label = f'router_backend_healthy{{role="prefill",url="{victim.base_url}"}}'
    give_up_at = time.monotonic() + 30
    while (await asyncio.to_thread(router.metrics)).get(label) != 1.0:
        if time.monotonic() > give_up_at:
            result.problems.append(f"the router did not take {victim.name} back within 30 s of its restart")
            break
        await asyncio.sleep(0.2)
    back = time.monotonic()
    faults.windows[-1] = (killed - 1.0, back + 5.0)  # + peer_timeout and slack: late failures of the outage
    deadline.release(back + AFTER_RESTART_SECONDS)
    dispatched = f'router_backend_dispatched{{role="prefill",url="{victim.base_url}"}}'
    result.restart = (back, (await asyncio.to_thread(router.metrics)).get(dispatched, 0.0))
    print(f"   t={back - result.started:.0f}s: {victim.name} is back ({back - killed:.1f} s after the kill)", flush=True)


def check_idle_and_free(deployment: Deployment, result: SoakResult) -> None:
    """After the traffic: every server's pages free once prefix caches are flushed; no PD queue."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for process in deployment.servers:
        if not process.alive:
            result.problems.append(f"{process.name} is not running at the end")
            continue
        deadline = time.monotonic() + CLEANUP_SECONDS
        while True:
            httpx.post(process.base_url + "/reset_prefix_cache", headers=headers, timeout=10)
            metrics = process.metrics()
            busy = {key: value for key, value in metrics.items()
                    if value and (key == "kv_pages_used" or key.startswith("pd_queue_length")
                                  or key in ("num_requests_running", "num_requests_waiting"))}
            if not busy:
                break
            if time.monotonic() > deadline:
                result.problems.append(f"{process.name} still holds state {CLEANUP_SECONDS:g} s after the traffic: "
                                       f"{busy}")
                break
            time.sleep(0.25)


def check_rss(deployment: Deployment, result: SoakResult) -> list[str]:
    """RSS at the end of each run of each process against its second quarter; returns table rows."""
    rows = []
    for process in deployment.processes.values():
        for number, incarnation in enumerate(process.incarnations):
            samples = incarnation.rss
            if len(samples) < 8:
                continue
            quarter = samples[len(samples) // 4:len(samples) // 2]
            reference = statistics.median(value for _, value in quarter)
            end = statistics.median(value for _, value in samples[-max(2, len(samples) // 10):])
            bound = max(reference * RSS_TOLERANCE, RSS_SLACK_BYTES)
            verdict = "flat" if end - reference <= bound else "GROWING"
            name = process.name + (f" (run {number + 1})" if len(process.incarnations) > 1 else "")
            rows.append(f"{name:>20} {reference / 2**20:>9.0f} {end / 2**20:>9.0f} {(end - reference) / 2**20:>+8.0f}"
                        f" {verdict:>8}")
            if verdict != "flat":
                result.problems.append(f"{name}: RSS grew {(end - reference) / 2**20:.0f} MiB "
                                       f"(from {reference / 2**20:.0f} MiB; bound {bound / 2**20:.0f} MiB)")
    return rows


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def report(result: SoakResult, rss_rows: list[str]) -> None:
    records = result.records
    print(f"\n== soak {result.mode}: {len(records)} requests in {result.seconds:.0f} s "
          f"({len(records) / result.seconds:.1f} req/s)")
    print(f"{'outcome':>18} {'requests':>9} {'share':>7}")
    counts = {outcome: sum(r.outcome == outcome for r in records) for outcome in (*CLEAN_OUTCOMES, *VIOLATIONS)}
    for outcome, count in counts.items():
        if count or outcome in CLEAN_OUTCOMES:
            print(f"{outcome:>18} {count:>9} {count / max(1, len(records)):>7.1%}")
    print(f"\n{'latency (ms)':>24} {'n':>6} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8}")
    groups = {"exact, not streamed": [r.seconds for r in records if r.outcome == "exact" and r.action == "send"],
              "exact, streamed": [r.seconds for r in records if r.outcome == "exact" and r.action == "stream"],
              "time to first token": [r.first_token_seconds for r in records
                                      if r.outcome == "exact" and r.first_token_seconds is not None],
              "fault errors": [r.seconds for r in records if r.outcome == "fault_error"],
              "rejected": [r.seconds for r in records if r.outcome == "rejected"]}
    for name, values in groups.items():
        cells = " ".join(f"{percentile(values, q) * 1000:>8.1f}" for q in (0.5, 0.9, 0.99, 1.0))
        print(f"{name:>24} {len(values):>6} {cells}")
    names = sorted({name for _, pages in result.samples for name in pages})
    print(f"\n{'t (s)':>8} " + " ".join(f"{name + ' pages':>16}" for name in names))
    step = max(1, len(result.samples) // 12)
    for moment, pages in result.samples[::step] + result.samples[-1:]:
        print(f"{moment:>8.0f} " + " ".join(f"{pages.get(name, float('nan')):>16.0f}" for name in names))
    print(f"\n{'process':>20} {'RSS MiB':>9} {'end MiB':>9} {'growth':>8} {'verdict':>8}   "
          "(RSS: median of the second quarter of the run, and of its last tenth)")
    for row in rss_rows:
        print(row)
    for record in result.violations[:20]:
        print(f"VIOLATION {record.outcome}: {record.template} ({record.action}): {record.detail}")
    for problem in result.problems:
        print(f"PROBLEM: {problem}")
    print("PASS" if not result.violations and not result.problems else "FAIL", flush=True)


def soak(mode: str, arguments, model: str, references: dict, templates) -> SoakResult:
    valid, bad = templates
    log_directory = Path(tempfile.mkdtemp(prefix=f"tandem-soak-{mode}-"))
    deployment = Deployment(mode, model, log_directory, arguments.failure_probability)
    print(f"== soak {mode}: starting {', '.join(deployment.processes)} (logs in {log_directory})", flush=True)
    deployment.start()
    faults = FaultLog()
    traffic = Traffic(deployment.entry.base_url, MODEL_NAME, {"Authorization": f"Bearer {API_KEY}"}, valid, bad,
                      references, unsupported={"completion-n2": "n"} if mode == "pd" else {},
                      is_fault=faults.explains if mode == "pd" else (lambda *_: False))
    result = SoakResult(mode, [], 0.0, [])
    try:
        asyncio.run(drive(deployment, traffic, arguments, faults, result))
        check_idle_and_free(deployment, result)
        if mode == "pd":
            check_restarted_server_used(deployment, result)
        rss_rows = check_rss(deployment, result)
    finally:
        deployment.stop()
    report(result, rss_rows)
    return result


async def drive(deployment: Deployment, traffic: Traffic, arguments, faults: FaultLog, result: SoakResult) -> None:
    started = result.started = time.monotonic()
    deadline = Deadline(started + arguments.duration, held=deployment.mode == "pd")
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_periodically(deployment, result.samples, stop, arguments.sample_interval))
    tasks = [run_traffic(traffic, arguments, deadline, result.records)]
    if deployment.mode == "pd":
        tasks.append(kill_and_restart(deployment, faults, started + arguments.duration / 3, deadline, result))
    try:
        await asyncio.gather(*tasks)
    finally:
        result.seconds = time.monotonic() - started
        stop.set()
        await sampler


def check_restarted_server_used(deployment: Deployment, result: SoakResult) -> None:
    if result.restart is None:
        result.problems.append("prefill_b was not restarted")
        return
    back, dispatched_then = result.restart
    router, victim = deployment.processes["router"], deployment.processes["prefill_b"]
    dispatched = router.metrics().get(f'router_backend_dispatched{{role="prefill",url="{victim.base_url}"}}', 0.0)
    if dispatched <= dispatched_then:
        result.problems.append("the router sent the restarted prefill server no request after taking it back")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mode", choices=("single", "pd", "both"), default="both")
    parser.add_argument("--model", default=None, help="model directory; none: the built-in demo model")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic per mode")
    parser.add_argument("--max-requests", type=int, default=100_000, help="most requests per mode")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    parser.add_argument("--failure-probability", type=float, default=0.05,
                        help="pd: each transfer write fails with this probability (test-only switch)")
    parser.add_argument("--sample-interval", type=float, default=2.0, help="seconds between page and RSS samples")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def prepare(arguments) -> tuple[str, dict, tuple]:
    """The model, the templates and their references (one offline engine, then released)."""
    from tandem import LLM
    from tandem.tools.demo_model import ensure_demo_model

    model = arguments.model or str(ensure_demo_model())
    llm = LLM(model=model, page_size=4, max_total_tokens=8192, max_model_len=1024, sanitize=False)
    valid = valid_templates(arguments.seed)
    references = compute_references(llm, valid)
    stopped = stop_templates(valid, references)
    references.update(compute_references(llm, stopped))
    bad = bad_templates(llm.engine.model_info.vocab_size, 1024)
    llm.engine.shutdown()
    return model, references, (valid + stopped, bad)


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    model, references, templates = prepare(arguments)
    modes = ("single", "pd") if arguments.mode == "both" else (arguments.mode,)
    results = [soak(mode, arguments, model, references, templates) for mode in modes]
    return 0 if all(not r.violations and not r.problems for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
