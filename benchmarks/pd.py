"""PD benchmark: disaggregated prefill/decode (1 prefill + 1 decode server behind the router)
against one colocated server on the same machine, and the PD transfer path's bandwidth against a
plain NIXL copy of the same bytes.

Part 1, serving: TTFT, TPOT and throughput at each concurrency (``benchmarks/serve.py``'s client:
random token-id prompts, greedy, ``ignore_eos``), first against ``tandem serve``, then against
``tandem serve --role prefill`` + ``tandem serve --role decode`` + ``tandem router``. All
processes share the machine: on a small CPU host the two engines compete for the same cores.

Part 2, bandwidth: two processes, each with the model's real state registry and buffers (dummy
weights) and a NIXL agent (UCX). The prefill process writes a prompt's pages exactly as the PD
path does (``plan_page_writes``: every registry buffer, runs of pages coalesced; then the
metadata row with its completion notification) and, for comparison, the same number of bytes as
one plain NIXL write between two registered contiguous buffers. Both layouts are measured: the
pages of a fresh pool (consecutive: few large writes) and pages scattered as after churn.

    python -m benchmarks.pd                                   # a llama-shaped model it builds
    python -m benchmarks.pd --model DIR --input-len 512 --output-len 64 --concurrency 1 4
    python -m benchmarks.pd --skip-serving --bandwidth-tokens 1024 8192
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent

BENCH_MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, head_dim=64,
                   intermediate_size=1024, vocab_size=512)


# -- part 2: bandwidth ----------------------------------------------------------------------------------


def build_state(model_dir: str, page_size: int, tokens: int, device: str, dtype: str = "auto",
                kv_cache_layout: str = "layer-major"):
    """An engine's registry and pools for ``model_dir`` (dummy weights), with room for ``tokens``;
    ``kv_cache_layout`` as ``--kv-cache-layout`` (peers' buffers: ``buffer_addresses``)."""
    from tandem.config import EngineConfig
    from tandem.engine.core import EngineCore

    # enforce_eager: no forward pass runs, so no graphs to capture
    config = EngineConfig(model=model_dir, load_format="dummy", page_size=page_size, device=device, dtype=dtype,
                          max_total_tokens=2 * tokens + 4 * page_size, max_num_seqs=4, enable_prefix_caching=False,
                          kv_cache_layout=kv_cache_layout, sanitize=False, enforce_eager=True)
    return EngineCore(config)


def allocate_pages(core, owner: str, tokens: int, scattered: bool, seed: int) -> list[list[int]]:
    """Page tables for ``tokens``; scattered: drawn at random from the whole pool."""
    state = core.coordinator.new_state(owner)
    if not scattered:
        core.coordinator.allocate(state, tokens)
        return state.page_tables
    generator = random.Random(seed)
    tables = []
    for pool, manager in zip(core.coordinator.pools, core.coordinator.managers):
        count = manager.pages_for_tokens(tokens)
        tables.append(generator.sample(range(1, pool.num_pages), count))
    return tables


def decode_process(model_dir: str, page_size: int, tokens: int, device: str, scattered: bool, to_prefill, from_prefill):
    import torch

    from tandem.transfer.descriptors import buffer_addresses, buffer_regions, tensor_region
    from tandem.transfer.metadata import MetadataBuffer
    from tandem.transfer.nixl_backend import NixlBackend

    core = build_state(model_dir, page_size, tokens, device)
    metadata = MetadataBuffer(4)
    backend = NixlBackend(f"bench-decode-{os.getpid()}")
    regions = buffer_regions(core.registry)
    total = sum(d.page_bytes * manager.pages_for_tokens(tokens)
                for d, manager in ((d, core.coordinator.managers[d.group_id]) for d in core.registry.buffers()))
    plain = torch.empty(total, dtype=torch.uint8, device=device)
    backend.register(regions + [tensor_region(metadata.tensor), tensor_region(plain)])
    tables = allocate_pages(core, "bench#d", tokens, scattered, seed=2)
    to_prefill.put((backend.local_metadata(), buffer_addresses(core.registry), regions[0].device,
                    metadata.address(0), plain.data_ptr(), tables))
    answer_notifications(backend, from_prefill, to_prefill, "stop")
    backend.close()


def answer_notifications(backend, commands, answers, stop: str, interval: float = 0.0002) -> None:
    """Keep polling the agent every ``interval`` seconds, as a decode engine does while it
    expects writes (it progresses the connection's set-up and receives the notifications);
    answer each "go" with "seen" once a notification arrived, until the ``stop`` command."""
    import queue

    pending, received = 0, 0
    while True:
        received += len(backend.notifications())
        try:
            command = commands.get_nowait()
        except queue.Empty:
            command = None
        if command == stop:
            return
        pending += command == "go"
        if pending and received:
            pending, received = pending - 1, received - 1
            answers.put("seen")
        time.sleep(interval)


def measure_bandwidth(model_dir: str, page_size: int, tokens: int, rounds: int, device: str,
                      scattered: bool) -> dict:
    """Median seconds of the PD write (pages + metadata row) and of one plain NIXL write of the
    same bytes, from post to completion, in two processes."""
    import torch

    from tandem.transfer.connector import WriteStatus
    from tandem.transfer.descriptors import buffer_regions, plan_page_writes, tensor_region
    from tandem.transfer.messages import done_notification, new_room
    from tandem.transfer.metadata import MetadataBuffer, MetadataRow
    from tandem.transfer.nixl_backend import NixlBackend

    context = multiprocessing.get_context("spawn")
    to_prefill, from_prefill = context.Queue(), context.Queue()
    worker = context.Process(target=decode_process, args=(model_dir, page_size, tokens, device, scattered,
                                                          to_prefill, from_prefill))
    worker.start()
    core = build_state(model_dir, page_size, tokens, device)
    metadata = MetadataBuffer(4)
    backend = NixlBackend(f"bench-prefill-{os.getpid()}")
    regions = buffer_regions(core.registry)
    peer_metadata, remote_addresses, remote_device, remote_rows, remote_plain, remote_tables = to_prefill.get(timeout=300)
    sources = allocate_pages(core, "bench#p", tokens, scattered, seed=1)
    pairs = [list(zip(source, target)) for source, target in zip(sources, remote_tables)]
    plan = plan_page_writes(core.registry, remote_addresses, pairs)
    plain = torch.ones(plan.num_bytes, dtype=torch.uint8, device=device)
    backend.register(regions + [tensor_region(metadata.tensor), tensor_region(plain)])
    peer = backend.add_peer(peer_metadata)
    local_device = regions[0].device

    def wait(handle) -> None:
        while backend.poll(handle) is WriteStatus.PENDING:
            pass
        if handle.status is not WriteStatus.DONE:
            raise RuntimeError(f"write failed: {handle.error}")
        backend.release(handle)

    def pd_write() -> float:
        started = time.perf_counter()
        again = plan_page_writes(core.registry, remote_addresses, pairs)  # planning is part of the path
        wait(backend.write(peer, again.descriptors, local_device=local_device, remote_device=remote_device))
        room = new_room()
        metadata.write(0, MetadataRow(room=room, first_token=1))
        wait(backend.write(peer, [(metadata.address(0), remote_rows, metadata.row_bytes)],
                           notification=done_notification(room)))
        seconds = time.perf_counter() - started
        from_prefill.put("go")
        to_prefill.get(timeout=60)  # the decode side saw the notification
        return seconds

    def plain_write() -> float:
        started = time.perf_counter()
        wait(backend.write(peer, [(plain.data_ptr(), remote_plain, plan.num_bytes)], local_device=local_device,
                           remote_device=remote_device, notification=b"plain"))
        seconds = time.perf_counter() - started
        from_prefill.put("go")
        to_prefill.get(timeout=60)
        return seconds

    try:
        pd_write(), plain_write()  # warm up connections and registrations
        pd_times, plain_times = [], []
        for _ in range(rounds):
            pd_times.append(pd_write())
            plain_times.append(plain_write())
    finally:
        from_prefill.put("stop")
        worker.join(60)
        backend.close()
    return {"tokens": tokens, "bytes": plan.num_bytes + metadata.row_bytes, "descriptors": len(plan.descriptors) + 1,
            "pd": statistics.median(pd_times), "plain": statistics.median(plain_times), "scattered": scattered}


def print_bandwidth(results: list[dict]) -> None:
    header = f"{'tokens':>7} {'pages':>10} {'MiB':>8} {'writes':>7} {'PD GB/s':>8} {'plain GB/s':>10} {'PD/plain':>8}"
    print(header)
    print("-" * len(header))
    for result in results:
        pd_rate = result["bytes"] / result["pd"] / 1e9
        plain_rate = result["bytes"] / result["plain"] / 1e9
        layout = "scattered" if result["scattered"] else "fresh"
        print(f"{result['tokens']:>7} {layout:>10} {result['bytes'] / 2**20:>8.1f} {result['descriptors']:>7} "
              f"{pd_rate:>8.2f} {plain_rate:>10.2f} {pd_rate / plain_rate:>8.2f}")


# -- part 1: serving ----------------------------------------------------------------------------------------


class Cluster:
    """Processes of one setup (colocated, or prefill + decode + router); stopped together."""

    def __init__(self, log_directory: Path):
        self.log_directory = log_directory
        self.processes = []

    def launch(self, name: str, arguments: list[str]):
        from benchmarks import serve

        port = serve.free_port()
        log = open(self.log_directory / f"{name}.log", "w")
        process = subprocess.Popen(
            [sys.executable, "-m", "tandem.entrypoints.cli", *arguments, "--port", str(port), "--log-level", "warning"],
            cwd=REPOSITORY_ROOT, env=serve.checkout_environment(), stdout=log,
            stderr=subprocess.STDOUT)
        self.processes.append((process, log))
        return f"http://127.0.0.1:{port}", process

    def wait(self, url: str, process, path: str = "/health", timeout: float = 600) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{url} exited with status {process.returncode}")
            try:
                if httpx.get(url + path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{url} not ready")

    def stop(self) -> None:
        for process, log in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process, log in self.processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
            log.close()
        self.processes = []


def serving_flags(arguments, max_num_seqs: int) -> list[str]:
    flags = ["--model", arguments.model, "--served-model-name", "bench", "--page-size", str(arguments.page_size),
             "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(arguments.max_num_batched_tokens),
             "--no-enable-prefix-caching"]
    if arguments.max_total_tokens:
        flags += ["--max-total-tokens", str(arguments.max_total_tokens)]
    if arguments.load_format != "auto":
        flags += ["--load-format", arguments.load_format]
    return flags


def run_setup(arguments, name: str, prompts_per_level: dict[int, list[list[int]]]) -> list:
    from benchmarks import serve

    max_num_seqs = max(arguments.concurrency)
    cluster = Cluster(Path(arguments.log_directory))
    try:
        flags = serving_flags(arguments, max_num_seqs)
        if name == "colocated":
            url, process = cluster.launch("colocated", ["serve", *flags])
            cluster.wait(url, process)
        else:
            prefill_url, prefill = cluster.launch("prefill", ["serve", *flags, "--role", "prefill"])
            decode_url, decode = cluster.launch("decode", ["serve", *flags, "--role", "decode"])
            cluster.wait(prefill_url, prefill)
            cluster.wait(decode_url, decode)
            url, router = cluster.launch("router", ["router", "--prefill", prefill_url, "--decode", decode_url])
            cluster.wait(url, router, "/v1/models")
        results = []
        for concurrency in arguments.concurrency:
            results.append(asyncio.run(serve.run_level(url, "bench", prompts_per_level[concurrency],
                                                       arguments.output_len, concurrency, None)))
        if name != "colocated":
            results_bandwidth = pd_metrics(prefill_url)
            print(f"   prefill server's own transfer figures: {results_bandwidth}")
        return results
    finally:
        cluster.stop()


def pd_metrics(prefill_url: str) -> str:
    import httpx

    text = httpx.get(prefill_url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        for name in ("pd_transfer_bytes_total", "pd_transfer_duration_seconds_sum", "pd_transfer_duration_seconds_count"):
            if line.startswith("tandem:" + name + " "):
                values[name] = float(line.split()[-1])
    if not values.get("pd_transfer_duration_seconds_count"):
        return "none"
    seconds = values["pd_transfer_duration_seconds_sum"]
    return (f"{values['pd_transfer_duration_seconds_count']:.0f} transfers, "
            f"{values['pd_transfer_bytes_total'] / 2**20:.1f} MiB, first write to metadata row done "
            f"{seconds / values['pd_transfer_duration_seconds_count'] * 1000:.1f} ms each "
            "(overlapped with the chunks' compute)")


def compare(colocated: list, disaggregated: list) -> None:
    from benchmarks import serve

    header = (f"{'setup':>11} {'conc':>4} {'ok':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT p50/p90 ms':>17} "
              f"{'TPOT p50/p90 ms':>17}")
    print(header)
    print("-" * len(header))
    for name, results in (("colocated", colocated), ("1P1D", disaggregated)):
        for result in results:
            done = result.completed
            ttft = [record.ttft * 1000 for record in done]
            tpot = [record.tpot * 1000 for record in done if record.tpot is not None]
            pair = lambda values: "/".join(f"{serve.percentile(values, q):.1f}" for q in (0.5, 0.9))  # noqa: E731
            print(f"{name:>11} {result.concurrency:>4} {len(done):>4} {result.request_throughput:>7.2f} "
                  f"{result.output_throughput:>9.1f} {pair(ttft):>17} {pair(tpot):>17}")


# -- main ---------------------------------------------------------------------------------------------------------


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=f"model directory; none: a llama-shaped random model ({BENCH_MODEL})")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="cpu", help="where the bandwidth part's buffers live (cpu, cuda)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests-per-level", type=int, default=None, help="default: 4 x concurrency")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--bandwidth-tokens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--skip-bandwidth", action="store_true")
    parser.add_argument("--log-directory", default=None)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    os.environ.pop("TANDEM_SANITIZE", None)  # measure the engine as deployed
    arguments.log_directory = arguments.log_directory or tempfile.mkdtemp(prefix="tandem-pd-bench-")
    if arguments.model is None:
        from tandem.tools.make_model import make_model

        arguments.model = str(make_model("llama", Path(arguments.log_directory) / "model", seed=0, **BENCH_MODEL))
    print(f"model {arguments.model}; logs in {arguments.log_directory}")
    if not arguments.skip_bandwidth:
        print("\n== transfer bandwidth: PD write path vs one plain NIXL write of the same bytes "
              f"({arguments.device}, median of {arguments.rounds}) ==")
        results = [measure_bandwidth(arguments.model, arguments.page_size, tokens, arguments.rounds, arguments.device,
                                     scattered) for tokens in arguments.bandwidth_tokens for scattered in (False, True)]
        print_bandwidth(results)
    if not arguments.skip_serving:
        from benchmarks import serve

        vocab = serve.vocab_size_of(arguments.model)
        prompts = {concurrency: serve.make_prompts(arguments.requests_per_level or 4 * concurrency,
                                                   arguments.input_len, vocab, arguments.seed + concurrency)
                   for concurrency in arguments.concurrency}
        print(f"\n== serving: input {arguments.input_len}, output {arguments.output_len} tokens, greedy ==")
        colocated = run_setup(arguments, "colocated", prompts)
        disaggregated = run_setup(arguments, "1P1D", prompts)
        compare(colocated, disaggregated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
