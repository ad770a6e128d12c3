"""Serving benchmark: an async client at fixed input/output lengths over a sweep of concurrency.

For each concurrency level it prints TTFT, TPOT and ITL (p50/p90/p99, milliseconds), request
throughput and token throughput, and the ratio of the server's output-token throughput to the
offline ``LLM``'s on the same model, the same prompts, the same batch size (``max_num_seqs``
set to the concurrency) and the same CPU threading as the server's engine, which isolates what
serving costs: HTTP, SSE, ZMQ, the second process.

    python -m benchmarks.serve                          # demo model, starts its own server
    python -m benchmarks.serve --model DIR --input-len 256 --output-len 128 --concurrency 1 8 32 64
    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --no-offline   # a running server

Prompts are random token ids (seeded), sent as token-id prompts with ``ignore_eos`` so every
request produces exactly ``--output-len`` tokens; sampling is greedy.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import msgspec

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RequestRecord:
    """Client-side timing of one streamed request."""
    sent: float
    token_times: list[float] = field(default_factory=list)  # one entry per token received
    chunk_gaps: list[float] = field(default_factory=list)  # time between chunks that carried tokens
    output_tokens: int = 0
    ok: bool = False
    error: Optional[str] = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def latency(self) -> float:
        return self.token_times[-1] - self.sent

    @property
    def tpot(self) -> Optional[float]:
        if self.output_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)


@dataclass
class LevelResult:
    concurrency: int
    records: list[RequestRecord]
    duration: float
    input_len: int
    offline_throughput: Optional[float] = None

    @property
    def completed(self) -> list[RequestRecord]:
        return [record for record in self.records if record.ok]

    @property
    def output_throughput(self) -> float:
        return sum(record.output_tokens for record in self.completed) / self.duration

    @property
    def total_throughput(self) -> float:
        return sum(record.output_tokens + self.input_len for record in self.completed) / self.duration

    @property
    def request_throughput(self) -> float:
        return len(self.completed) / self.duration


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def make_prompts(count: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = random.Random(seed)
    return [[generator.randrange(10, vocab_size) for _ in range(input_len)] for _ in range(count)]


class SseConnection:
    """A minimal HTTP/1.1 client for one streamed POST over a fresh connection.

    The benchmark shares the machine with the server, so its client must be cheap per chunk:
    it reads the chunked body straight off an asyncio stream instead of going through a general
    HTTP library. It yields the payload of each server-sent event.
    """

    def __init__(self, host: str, port: int, headers: dict[str, str]):
        self.host = host
        self.port = port
        self.headers = headers

    async def post_events(self, path: str, body: dict):
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            payload = JSON_ENCODER.encode(body)
            head = "".join(f"{name}: {value}\r\n" for name, value in {
                "Host": f"{self.host}:{self.port}", "Content-Type": "application/json",
                "Content-Length": str(len(payload)), "Connection": "close", **self.headers}.items())
            writer.write(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + payload)
            status, headers = await read_head(reader)
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {(await reader.read(300))!r}")
            buffer = b""
            async for data in read_body(reader, headers):
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    yield event
        finally:
            writer.close()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]):
    if headers.get("transfer-encoding", "").lower() != "chunked":
        yield await reader.read()
        return
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        yield (await reader.readexactly(size + 2))[:-2]


async def stream_one(connection: SseConnection, model: str, prompt: list[int], output_len: int) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    record = RequestRecord(sent=time.perf_counter())
    try:
        async for event in connection.post_events("/v1/completions", body):
            consume_event(record, event)
    except (OSError, RuntimeError, ValueError, asyncio.IncompleteReadError) as error:
        record.error = repr(error)
    record.ok = record.error is None and record.output_tokens == output_len
    if record.error is None and not record.ok:
        record.error = f"got {record.output_tokens} tokens, expected {output_len}"
    return record


class ChoiceTokens(msgspec.Struct):
    token_ids: list[int] = []


class ChunkTokens(msgspec.Struct):
    """The only parts of an SSE chunk the client reads (decoding just these keeps it cheap)."""
    choices: list[ChoiceTokens] = []
    error: Optional[dict] = None


CHUNK_DECODER = msgspec.json.Decoder(ChunkTokens)
JSON_ENCODER = msgspec.json.Encoder()


def consume_event(record: RequestRecord, event: bytes) -> None:
    if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
        return
    chunk = CHUNK_DECODER.decode(event[6:])
    if chunk.error is not None:
        record.error = chunk.error.get("message", str(chunk.error))
        return
    count = sum(len(choice.token_ids) for choice in chunk.choices)
    if not count:
        return
    now = time.perf_counter()
    if record.token_times:
        record.chunk_gaps.append(now - record.token_times[-1])
    record.token_times.extend([now] * count)
    record.output_tokens += count


async def run_level(base_url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int,
                    api_key: Optional[str]) -> LevelResult:
    """Send every prompt, at most ``concurrency`` in flight at once."""
    address = httpx.URL(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connection = SseConnection(address.host, address.port or 80, headers)
    semaphore = asyncio.Semaphore(concurrency)

    async def bounded(prompt):
        async with semaphore:
            return await stream_one(connection, model, prompt, output_len)

    await stream_one(connection, model, prompts[0][:8], 2)  # warm the server
    started = time.perf_counter()
    records = await asyncio.gather(*(bounded(prompt) for prompt in prompts))
    duration = time.perf_counter() - started
    return LevelResult(concurrency, list(records), duration, len(prompts[0]))


def offline_throughput(model_dir: str, engine_options: dict, prompts: list[list[int]], output_len: int,
                       concurrency: int, threads: int) -> float:
    """Output tokens per second of the offline ``LLM`` with the same prompts, batch size and
    number of torch threads as the server's engine."""
    import torch

    from tandem import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model=model_dir, **{**engine_options, "max_num_seqs": concurrency})
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - started
    llm.engine.shutdown()
    return sum(len(output.outputs[0].token_ids) for output in outputs) / duration


def print_table(results: list[LevelResult]) -> None:
    header = (f"{'conc':>4} {'reqs':>5} {'ok':>5} {'req/s':>7} {'out tok/s':>9} {'tot tok/s':>9} "
              f"{'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>22} "
              f"{'offline tok/s':>13} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    for result in results:
        done = result.completed
        ttft = [record.ttft * 1000 for record in done]
        tpot = [record.tpot * 1000 for record in done if record.tpot is not None]
        itl = [gap * 1000 for record in done for gap in record.chunk_gaps]
        offline = result.offline_throughput
        ratio = f"{result.output_throughput / offline:6.2f}" if offline else f"{'-':>6}"
        print(f"{result.concurrency:>4} {len(result.records):>5} {len(done):>5} {result.request_throughput:>7.2f} "
              f"{result.output_throughput:>9.1f} {result.total_throughput:>9.1f} {triple(ttft):>22} "
              f"{triple(tpot):>22} {triple(itl):>22} {(f'{offline:.1f}' if offline else '-'):>13} {ratio}")
    failures = [record.error for result in results for record in result.records if not record.ok]
    if failures:
        print(f"{len(failures)} request(s) failed; first: {failures[0]}")


def triple(values: list[float]) -> str:
    return "/".join(f"{percentile(values, fraction):.1f}" for fraction in (0.5, 0.9, 0.99))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cpu_seconds(stat_file: str) -> float:
    """User + system CPU time so far of the process or thread whose ``/proc/.../stat`` file this
    is (Linux; nan where it cannot be read: elsewhere, or the process or thread has ended)."""
    try:
        fields = Path(stat_file).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def checkout_environment() -> dict[str, str]:
    """This process's environment for a child (a server a benchmark starts) that must import
    this checkout: the checkout first on ``PYTHONPATH``, then whatever the caller had there
    (packages installed outside the environment stay importable)."""
    paths = [str(REPOSITORY_ROOT)] + [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


class LaunchedServer:
    """``tandem serve`` as a child process for the benchmark's lifetime (stopped with SIGINT)."""

    def __init__(self, model_dir: str, engine_flags: list[str], log_path: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "tandem.entrypoints.cli", "serve", "--model", model_dir,
                   "--port", str(self.port), "--log-level", "warning", *engine_flags]
        environment = checkout_environment()
        self.log_file = open(log_path, "w")
        self.process = subprocess.Popen(command, cwd=REPOSITORY_ROOT, env=environment, stdout=self.log_file,
                                        stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with status {self.process.returncode}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become healthy")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log_file.close()


def engine_options(arguments: argparse.Namespace) -> dict:
    options = {"page_size": arguments.page_size, "max_num_batched_tokens": arguments.max_num_batched_tokens,
               "enable_prefix_caching": arguments.enable_prefix_caching, "dtype": arguments.dtype,
               "load_format": arguments.load_format}
    if arguments.max_total_tokens is not None:
        options["max_total_tokens"] = arguments.max_total_tokens
    if arguments.max_itl_ms is not None:
        options["max_itl_ms"] = arguments.max_itl_ms
    return options


def engine_flags(options: dict, max_num_seqs: int) -> list[str]:
    flags = [f"--max-num-seqs={max_num_seqs}"]
    for name, value in options.items():
        if isinstance(value, bool):
            flags.append(f"--{'' if value else 'no-'}{name.replace('_', '-')}")
        else:
            flags.append(f"--{name.replace('_', '-')}={value}")
    return flags


def engine_thread_count() -> int:
    """The torch thread count ``tandem serve``'s engine process runs with on this host."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    return len(os.sched_getaffinity(0))


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory; none: the built-in demo model")
    parser.add_argument("--base-url", default=None, help="benchmark this running server instead of starting one")
    parser.add_argument("--served-model-name", default=None, help="model name to send; none: the server's first")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-level", type=int, default=None,
                        help="requests at each level; none: 4 x concurrency, at least 8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per level, server and offline interleaved; the best of each is reported")
    parser.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the offline LLM on the same prompts (needs --model or the demo model)")
    parser.add_argument("--offline-threads", type=int, default=engine_thread_count(),
                        help="torch threads of the offline run; the default is what the server's engine "
                             "uses (OMP_NUM_THREADS, else every usable core)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-itl-ms", type=float, default=None,
                        help="the server's (and the offline run's) inter-token gap target (tandem serve --max-itl-ms)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                        help="off by default so that repeated prompts do not turn into cache hits")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto")
    return parser.parse_args(argv)


def resolve_model(arguments: argparse.Namespace) -> Optional[str]:
    if arguments.model is not None or arguments.base_url is not None:
        return arguments.model
    from tandem.tools.demo_model import ensure_demo_model

    return str(ensure_demo_model())


def vocab_size_of(model_dir: Optional[str]) -> int:
    if model_dir is None:
        return 500
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def served_model(base_url: str, api_key: Optional[str]) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(base_url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]


def measure_level(arguments: argparse.Namespace, base_url: str, model: str, model_dir: Optional[str],
                  options: dict, vocab_size: int, concurrency: int) -> LevelResult:
    """The best of ``--repeats`` server runs and of as many offline runs, interleaved (a shared
    machine's noise only ever slows a run down, so the best run is the least disturbed)."""
    count = arguments.requests_per_level or max(8, 4 * concurrency)
    prompts = make_prompts(count, arguments.input_len, vocab_size, arguments.seed + concurrency)
    best: Optional[LevelResult] = None
    offline_runs: list[float] = []
    for _ in range(arguments.repeats):
        result = asyncio.run(run_level(base_url, model, prompts, arguments.output_len, concurrency,
                                       arguments.api_key))
        if best is None or result.output_throughput > best.output_throughput:
            best = result
        if arguments.offline and model_dir is not None:
            offline_runs.append(offline_throughput(model_dir, options, prompts, arguments.output_len, concurrency,
                                                   arguments.offline_threads))
    best.offline_throughput = max(offline_runs, default=None)
    return best


def main(argv=None) -> int:
    # The offline runs wait for OpenMP work the way the server's engine process does (see
    # tandem/engine/process.py); this must be set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    arguments = parse_arguments(argv)
    model_dir = resolve_model(arguments)
    options = engine_options(arguments)
    vocab_size = vocab_size_of(model_dir)
    results = []
    server = None
    if arguments.base_url is None:
        server = LaunchedServer(model_dir, engine_flags(options, max(arguments.concurrency)),
                                Path(os.environ.get("TMPDIR", "/tmp")) / "tandem-benchmark-server.log")
    try:
        base_url = arguments.base_url or server.base_url
        if server is not None:
            server.wait_healthy()
        model = arguments.served_model_name or served_model(base_url, arguments.api_key)
        print(f"model {model_dir or model}: input {arguments.input_len} tokens, output {arguments.output_len} "
              f"tokens; offline runs use {arguments.offline_threads} torch thread(s), OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}", flush=True)
        for concurrency in arguments.concurrency:
            result = measure_level(arguments, base_url, model, model_dir, options, vocab_size, concurrency)
            results.append(result)
            print(f"concurrency {concurrency}: {result.output_throughput:.1f} output tok/s", flush=True)
    finally:
        if server is not None:
            server.stop()
    print()
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
