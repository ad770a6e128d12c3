"""What the PD router adds to time to first token, measured without engines.

Two stand-in servers answer exactly as a prefill and a decode server do (``/pd/info``, ``/health``,
``POST /v1/completions``: the prefill leg a JSON completion, the decode leg an SSE stream of one
token per event), each after ``--answer-ms`` (the prefill's compute, the same on both legs). The
client (``benchmarks/serve.py``'s: a fresh connection per request, streamed, token-id prompts)
sends the same requests straight to the stand-in decode server and then through ``tandem router``
in front of both; the difference of the TTFTs is the router's hop (reading the request, picking
the pair, sending both legs, relaying the first event). The router's own view (its
``tandem:router_time_to_first_token_seconds``) is printed beside it.

    python -m benchmarks.router_hop                       # 2,048-token prompts, 50 requests
    python -m benchmarks.router_hop --input-len 128 --requests 200 --answer-ms 0
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent

import httpx

from benchmarks.serve import (SseConnection, checkout_environment, cpu_seconds, free_port, make_prompts, percentile,
                              stream_one)
from tests.support.stand_ins import MODEL

def start(command: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPOSITORY_ROOT,
                            env=checkout_environment())


def wait_healthy(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy")


async def measure(url: str, prompts: list[list[int]], output_len: int) -> list[float]:
    """Sequential streamed requests; each one's TTFT in ms."""
    address = httpx.URL(url)
    connection = SseConnection(address.host, address.port, {})
    for prompt in prompts[:3]:  # warm connections and code paths
        await stream_one(connection, MODEL, prompt, output_len)
    ttfts = []
    for prompt in prompts:
        record = await stream_one(connection, MODEL, prompt, output_len)
        if not record.ok:
            raise RuntimeError(f"request failed through {url}: {record.error}")
        ttfts.append(record.ttft * 1e3)
    return ttfts


def router_first_event_ms(url: str) -> tuple[float, int]:
    """The router's own mean arrival-to-first-event time (ms) and its count."""
    text = httpx.get(url + "/metrics", timeout=5).text
    values = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(f"tandem:router_time_to_first_token_seconds{suffix} "):
                values[suffix] = float(line.split()[-1])
    count = int(values.get("_count", 0))
    return (values.get("_sum", 0.0) / count * 1e3 if count else float("nan")), count


def row(name: str, values: list[float]) -> str:
    return (f"{name:<26} {statistics.mean(values):>8.2f} {statistics.median(values):>8.2f} "
            f"{percentile(values, 0.99):>8.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--answer-ms", type=float, default=20.0,
                        help="how long each stand-in server takes before answering (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="alternate straight/router this many times")
    arguments = parser.parse_args(argv)

    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"router-hop-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    ports = {name: free_port() for name in ("prefill", "decode", "router")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    stand_ins = str(REPOSITORY_ROOT / "tests" / "support" / "stand_ins.py")
    processes = [start([sys.executable, stand_ins, role, str(ports[role]), "--answer-ms", str(arguments.answer_ms)],
                       logs / f"{role}.log") for role in ("prefill", "decode")]
    try:
        wait_healthy(urls["prefill"])
        wait_healthy(urls["decode"])
        processes.append(start([sys.executable, "-m", "tandem.entrypoints.cli", "router", "--prefill", urls["prefill"],
                                "--decode", urls["decode"], "--port", str(ports["router"]), "--log-level", "warning"],
                               logs / "router.log"))
        wait_healthy(urls["router"])
        prompts = make_prompts(arguments.requests, arguments.input_len, 32000, seed=0)
        straight, routed, router_cpu = [], [], 0.0
        for _ in range(arguments.rounds):
            straight += asyncio.run(measure(urls["decode"], prompts, arguments.output_len))
            before = cpu_seconds(f"/proc/{processes[-1].pid}/stat")
            routed += asyncio.run(measure(urls["router"], prompts, arguments.output_len))
            router_cpu += cpu_seconds(f"/proc/{processes[-1].pid}/stat") - before
        router_view, count = router_first_event_ms(urls["router"])
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=10)
    print(f"router hop: {arguments.input_len}-token prompts, {len(straight)} requests each way, stand-ins answer "
          f"after {arguments.answer_ms:g} ms")
    print(f"{'TTFT (ms)':<26} {'mean':>8} {'median':>8} {'p99':>8}")
    print(row("straight to decode", straight))
    print(row("through the router", routed))
    print(f"{'added by the router':<26} {statistics.mean(routed) - statistics.mean(straight):>8.2f} "
          f"{statistics.median(routed) - statistics.median(straight):>8.2f}")
    per_request = router_cpu / (arguments.rounds * (len(prompts) + 3)) * 1e3
    print(f"router process CPU time per request: {per_request:.2f} ms (user + system)")
    print(f"router's own arrival-to-first-event mean: {router_view:.2f} ms over {count} requests "
          f"(of which {arguments.answer_ms:g} ms the stand-ins' answer time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
