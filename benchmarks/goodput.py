"""Goodput benchmark: requests per second that meet their latency SLOs, over a sweep of Poisson
request rates (open loop) and, optionally, of fixed concurrency (closed loop).

A request meets its SLOs when it completes with every token, its time to first token is within
``--ttft-slo-ms``, and — as given — its worst inter-token gap (the longest wait between two
streamed chunks carrying tokens) is within ``--itl-slo-ms`` and its mean time per output token
within ``--tpot-slo-ms``. Per level it prints throughput, TTFT p50/p99, worst-gap p99, TPOT p50,
attainment (the fraction of sent requests meeting the SLOs) and goodput (those requests per
second of the level's wall time), then the highest rate with attainment >= ``--attainment``
(90 %) and its goodput per GPU (``--num-gpus``: the GPUs behind ``--base-url``).

    python -m benchmarks.goodput --base-url http://127.0.0.1:8000 --input-len 2048 --output-len 256 \
        --request-rates 1 2 4 6 8 --num-requests 96 --ttft-slo-ms 1000 --itl-slo-ms 50 --num-gpus 2
    python -m benchmarks.goodput --base-url URL --concurrency 16 32 --num-requests 96 ...  # closed loop too
    python -m benchmarks.goodput --smoke      # a stand-in server in this process: seconds, no model

``--base-url`` may be a ``tandem serve``, or a ``tandem router`` in front of colocated servers
(``--server``) or of PD pairs (``--prefill``/``--decode``): compare them on the same GPUs with
the same flags (docs/goodput.md). Prompts are random token ids (seeded), sent with
``ignore_eos`` so every request produces exactly ``--output-len`` tokens; sampling is greedy.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


import httpx

from benchmarks.serve import (RequestRecord, SseConnection, make_prompts, percentile, served_model, stream_one,
                   vocab_size_of)

SMOKE_DEFAULTS = dict(input_len=16, output_len=8, request_rates=[40.0, 80.0], concurrency=[4], num_requests=16,
                      ttft_slo_ms=2000.0, itl_slo_ms=1000.0)


@dataclass(frozen=True)
class Slo:
    """Latency objectives in seconds; None: not judged."""
    ttft: float
    worst_gap: Optional[float] = None
    tpot: Optional[float] = None

    def met(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if record.ttft > self.ttft:
            return False
        if self.worst_gap is not None and max(record.chunk_gaps, default=0.0) > self.worst_gap:
            return False
        return self.tpot is None or record.tpot is None or record.tpot <= self.tpot


@dataclass
class Level:
    """One point of the sweep: its load (a Poisson rate, or a concurrency) and what happened."""
    rate: Optional[float]  # requests per second (open loop), or None
    concurrency: Optional[int]  # requests in flight (closed loop), or None
    records: list[RequestRecord]
    duration: float  # first request sent to last one done, seconds

    @property
    def name(self) -> str:
        return f"rate {self.rate:g}/s" if self.rate is not None else f"conc {self.concurrency}"


@dataclass
class Summary:
    name: str
    rate: Optional[float]
    concurrency: Optional[int]
    sent: int
    completed: int
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    ttft_p50_ms: float
    ttft_p99_ms: float
    worst_gap_p99_ms: float
    tpot_p50_ms: float
    attainment: float  # fraction of sent requests meeting every SLO
    goodput: float  # requests meeting every SLO per second
    goodput_per_gpu: float


def summarize(level: Level, slo: Slo, num_gpus: int) -> Summary:
    done = [record for record in level.records if record.ok]
    met = sum(1 for record in level.records if slo.met(record))
    sent = len(level.records)
    goodput = met / level.duration if level.duration > 0 else 0.0
    return Summary(
        name=level.name, rate=level.rate, concurrency=level.concurrency, sent=sent, completed=len(done),
        request_throughput=len(done) / level.duration if level.duration > 0 else 0.0,
        output_throughput=sum(record.output_tokens for record in done) / level.duration if level.duration > 0 else 0.0,
        ttft_p50_ms=percentile([record.ttft * 1e3 for record in done], 0.5),
        ttft_p99_ms=percentile([record.ttft * 1e3 for record in done], 0.99),
        worst_gap_p99_ms=percentile([max(record.chunk_gaps, default=0.0) * 1e3 for record in done], 0.99),
        tpot_p50_ms=percentile([record.tpot * 1e3 for record in done if record.tpot is not None], 0.5),
        attainment=met / sent if sent else 0.0, goodput=goodput, goodput_per_gpu=goodput / num_gpus)


def best_rate(summaries: list[Summary], attainment: float) -> Optional[Summary]:
    """The open-loop level of the highest rate whose attainment reaches ``attainment``."""
    passing = [summary for summary in summaries if summary.rate is not None and summary.attainment >= attainment]
    return max(passing, key=lambda summary: summary.rate, default=None)


# -- load ----------------------------------------------------------------------------------------
def poisson_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``count`` requests arriving as a Poisson process."""
    generator = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += generator.expovariate(rate) if math.isfinite(rate) else 0.0
    return offsets


async def run_open_loop(connection: SseConnection, model: str, prompts: list[list[int]], output_len: int,
                        rate: float, seed: int) -> Level:
    """Every prompt sent at its Poisson arrival time, whatever is still in flight."""
    await stream_one(connection, model, prompts[0][:8], 2)  # warm the connection path
    started = time.perf_counter()

    async def send_at(offset: float, prompt: list[int]) -> RequestRecord:
        await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
        return await stream_one(connection, model, prompt, output_len)

    records = await asyncio.gather(*(send_at(offset, prompt)
                                     for offset, prompt in zip(poisson_offsets(len(prompts), rate, seed), prompts)))
    return Level(rate, None, list(records), time.perf_counter() - started)


async def run_closed_loop(connection: SseConnection, model: str, prompts: list[list[int]], output_len: int,
                          concurrency: int) -> Level:
    """Every prompt sent, ``concurrency`` in flight at once (the next one as soon as one ends)."""
    await stream_one(connection, model, prompts[0][:8], 2)
    semaphore = asyncio.Semaphore(concurrency)
    started = time.perf_counter()

    async def bounded(prompt: list[int]) -> RequestRecord:
        async with semaphore:
            return await stream_one(connection, model, prompt, output_len)

    records = await asyncio.gather(*(bounded(prompt) for prompt in prompts))
    return Level(None, concurrency, list(records), time.perf_counter() - started)


# -- report ----------------------------------------------------------------------------------------
def print_report(summaries: list[Summary], slo: Slo, attainment: float, num_gpus: int) -> None:
    objectives = [f"TTFT <= {slo.ttft * 1e3:g} ms"]
    if slo.worst_gap is not None:
        objectives.append(f"worst inter-token gap <= {slo.worst_gap * 1e3:g} ms")
    if slo.tpot is not None:
        objectives.append(f"TPOT <= {slo.tpot * 1e3:g} ms")
    print(f"SLOs: {', '.join(objectives)}; {num_gpus} GPU(s)")
    header = (f"{'level':>14} {'sent':>5} {'ok':>5} {'req/s':>7} {'out tok/s':>9} {'TTFT p50/p99 ms':>17} "
              f"{'gap p99 ms':>10} {'TPOT p50':>8} {'attain':>7} {'goodput':>8} {'/GPU':>7}")
    print(header)
    print("-" * len(header))
    for summary in summaries:
        print(f"{summary.name:>14} {summary.sent:>5} {summary.completed:>5} {summary.request_throughput:>7.2f} "
              f"{summary.output_throughput:>9.1f} {summary.ttft_p50_ms:>8.1f}/{summary.ttft_p99_ms:<8.1f} "
              f"{summary.worst_gap_p99_ms:>10.1f} {summary.tpot_p50_ms:>8.2f} {summary.attainment:>7.1%} "
              f"{summary.goodput:>8.2f} {summary.goodput_per_gpu:>7.2f}")
    best = best_rate(summaries, attainment)
    if best is None:
        if any(summary.rate is not None for summary in summaries):
            print(f"no request rate reached {attainment:.0%} attainment")
    else:
        print(f"max rate at >= {attainment:.0%} attainment: {best.rate:g} req/s; goodput {best.goodput:.2f} req/s "
              f"= {best.goodput_per_gpu:.2f} req/s per GPU")


# -- smoke -----------------------------------------------------------------------------------------
class StandInServer:
    """A colocated stand-in server (``stand_ins.py``) on a thread of this process: answers after
    ``answer_ms``, then one token every ``token_ms``."""

    def __init__(self, answer_ms: float = 5.0, token_ms: float = 2.0):
        import socket

        import uvicorn

        from tests.support.stand_ins import stand_in_app

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        app = stand_in_app("colocated", answer_seconds=answer_ms / 1e3, name="smoke", token_seconds=token_ms / 1e3)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the stand-in server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


# -- command line ---------------------------------------------------------------------------------
def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--base-url", default=None, help="a tandem serve or tandem router (required unless --smoke)")
    parser.add_argument("--smoke", action="store_true",
                        help="a few seconds against a stand-in server started in this process (CI)")
    parser.add_argument("--served-model-name", default=None, help="model name to send; none: the server's first")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="model directory, read for its vocabulary size only")
    parser.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 2048; smoke 16)")
    parser.add_argument("--output-len", type=int, default=None, help="output tokens (default 256; smoke 8)")
    parser.add_argument("--request-rates", type=float, nargs="*", default=None,
                        help="Poisson request rates per second, one level each; inf: all at once "
                             "(default 1 2 4 8)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=None,
                        help="closed-loop levels: requests in flight (default: none)")
    parser.add_argument("--num-requests", type=int, default=None, help="requests per level (default 96; smoke 16)")
    parser.add_argument("--ttft-slo-ms", type=float, default=None, help="time to first token SLO (default 1000)")
    parser.add_argument("--itl-slo-ms", type=float, default=None,
                        help="per-request worst inter-token gap SLO (default 50 unless --tpot-slo-ms is given)")
    parser.add_argument("--tpot-slo-ms", type=float, default=None, help="per-request mean time per output token SLO")
    parser.add_argument("--attainment", type=float, default=0.9,
                        help="fraction of requests that must meet the SLOs for a rate to count")
    parser.add_argument("--num-gpus", type=int, default=1, help="GPUs behind --base-url: goodput is divided by it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the summaries to PATH")
    arguments = parser.parse_args(argv)
    fill_defaults(parser, arguments)
    return arguments


def fill_defaults(parser: argparse.ArgumentParser, arguments: argparse.Namespace) -> None:
    defaults = SMOKE_DEFAULTS if arguments.smoke else dict(
        input_len=2048, output_len=256, request_rates=[1.0, 2.0, 4.0, 8.0], concurrency=[], num_requests=96,
        ttft_slo_ms=1000.0, itl_slo_ms=50.0)
    if arguments.tpot_slo_ms is not None and arguments.itl_slo_ms is None:
        defaults = {**defaults, "itl_slo_ms": None}
    for name, value in defaults.items():
        if getattr(arguments, name) is None:
            setattr(arguments, name, value)
    if arguments.base_url is None and not arguments.smoke:
        parser.error("--base-url is required (or --smoke)")
    if arguments.base_url is not None and arguments.smoke:
        parser.error("--smoke starts its own stand-in server: leave out --base-url")
    for name in ("input_len", "output_len", "num_requests", "num_gpus"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(arguments, name)}")
    for name in ("ttft_slo_ms", "itl_slo_ms", "tpot_slo_ms"):
        value = getattr(arguments, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if any(rate <= 0 for rate in arguments.request_rates):
        parser.error(f"--request-rates must be > 0, got {arguments.request_rates}")
    if any(level < 1 for level in arguments.concurrency):
        parser.error(f"--concurrency must be >= 1, got {arguments.concurrency}")
    if not arguments.request_rates and not arguments.concurrency:
        parser.error("nothing to run: give --request-rates and/or --concurrency")
    if not 0 < arguments.attainment <= 1:
        parser.error(f"--attainment must be in (0, 1], got {arguments.attainment}")


def slo_of(arguments: argparse.Namespace) -> Slo:
    return Slo(ttft=arguments.ttft_slo_ms / 1e3,
               worst_gap=arguments.itl_slo_ms / 1e3 if arguments.itl_slo_ms is not None else None,
               tpot=arguments.tpot_slo_ms / 1e3 if arguments.tpot_slo_ms is not None else None)


def run_sweep(arguments: argparse.Namespace, base_url: str) -> list[Summary]:
    model = arguments.served_model_name or served_model(base_url, arguments.api_key)
    vocab_size = vocab_size_of(arguments.model)
    address = httpx.URL(base_url)
    headers = {"Authorization": f"Bearer {arguments.api_key}"} if arguments.api_key else {}
    connection = SseConnection(address.host, address.port or 80, headers)
    slo = slo_of(arguments)
    summaries = []
    loads = [("rate", rate) for rate in arguments.request_rates] + [("concurrency", c) for c in arguments.concurrency]
    for number, (kind, load) in enumerate(loads):
        prompts = make_prompts(arguments.num_requests, arguments.input_len, vocab_size, arguments.seed + number)
        if kind == "rate":
            level = asyncio.run(run_open_loop(connection, model, prompts, arguments.output_len, load,
                                              arguments.seed + number))
        else:
            level = asyncio.run(run_closed_loop(connection, model, prompts, arguments.output_len, load))
        summaries.append(summarize(level, slo, arguments.num_gpus))
        failures = [record.error for record in level.records if not record.ok]
        print(f"{level.name}: {summaries[-1].attainment:.1%} attainment"
              + (f"; {len(failures)} failed, first: {failures[0]}" if failures else ""), flush=True)
    return summaries


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    server = StandInServer() if arguments.smoke else None
    try:
        base_url = server.base_url if server is not None else arguments.base_url.rstrip("/")
        print(f"{base_url}: input {arguments.input_len} tokens, output {arguments.output_len} tokens, "
              f"{arguments.num_requests} requests per level", flush=True)
        summaries = run_sweep(arguments, base_url)
    finally:
        if server is not None:
            server.stop()
    print()
    print_report(summaries, slo_of(arguments), arguments.attainment, arguments.num_gpus)
    if arguments.json:
        Path(arguments.json).write_text(json.dumps([summary.__dict__ for summary in summaries], indent=2))
    return 0 if all(summary.completed == summary.sent for summary in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
