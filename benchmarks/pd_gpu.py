"""PD over GPU memory between two GPUs of one host: prefill on cuda:0, decode on cuda:1, for
each transfer backend (NIXL with VRAM registered; NCCL through torch.distributed).

Part 1, bandwidth (``pd_gpu_bandwidth.py``): two processes, each with the model's real state
registry and pools (dummy weights) on its GPU. The prefill process writes one prompt's pages exactly as the PD path does
(the peer's ``WritePlanner``: every registry buffer, page runs coalesced; the metadata row beside
them and the completion notification in the same write), from planning to completion, and compares it with a plain torch
device-to-device copy of the same bytes between the two GPUs, timed in the same process; the
``sends`` column is what the backend posts per write (NIXL descriptors, NCCL sends).

Part 2, serving: a colocated server on cuda:0 and, per backend, ``tandem serve --role prefill``
on cuda:0 + ``--role decode`` on cuda:1 + ``tandem router``, one setup at a time (each alone on
the GPUs: processes sharing a GPU are time-sliced, so another setup's servers would slow the one
measured). Greedy outputs
of the prompt through each PD pair must equal the colocated server's; TTFT (streamed, median)
of PD minus colocated is what disaggregation adds.

Goals (issue 26): bandwidth >= 0.85 of the device-to-device copy; TTFT added <= 1 ms, for a
2,048-token Llama-3.1-8B-shape prompt (256 MiB of KV in bf16). Everything runs under one
deadline (``--deadline``, default 420 s); a backend that fails is reported as such and the
others still run; the table prints whatever was measured.

    python -m benchmarks.pd_gpu                                       # 2 GPUs: llama3-8b, bf16
    python -m benchmarks.pd_gpu --device one-gpu                      # 1 GPU: PD's own TTFT steps, NIXL
    python -m benchmarks.pd_gpu --device cpu --shape micro --input-len 64 --rounds 3   # check on a CPU

On a CPU both "devices" are host memory (NCCL runs over gloo, NIXL over shared memory): the
figures mean nothing there; the steps are the same. Part 1 prints, besides the PD write, rows
that tell where its time goes (the page write alone, the same bytes as one descriptor, and the
split into planning, posting and waiting): see ``MODES_HELP``. Keep both GPUs visible to every process
(no CUDA_VISIBLE_DEVICES split): NCCL and UCX use NVLink between processes only when each sees
both devices.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import traceback
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent

BACKENDS = ("nixl", "nccl")

from benchmarks.pd_gpu_bandwidth import MODES_HELP, TIMED_STEPS, Deadline, free_device_memory, run_bandwidth
from benchmarks.serve import checkout_environment


# -- part 2: serving ----------------------------------------------------------------------------------------


def server_flags(arguments, device: str) -> list[str]:
    flags = ["serve", "--model", arguments.model, "--served-model-name", "bench", "--device", device,
             "--page-size", str(arguments.page_size), "--max-num-seqs", "4",
             "--max-num-batched-tokens", str(arguments.max_num_batched_tokens), "--no-enable-prefix-caching",
             "--max-total-tokens", str(4 * arguments.input_len + 1024), "--dtype", arguments.dtype]
    if arguments.load_format != "auto":
        flags += ["--load-format", arguments.load_format]
    if device.startswith("cuda"):
        flags += ["--cuda-graph-sizes", "1", "2", "4"]
    return flags


def complete(url: str, prompt: list[int], output_len: int) -> list[int]:
    import httpx

    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice.get("token_ids") or choice["text"]


# server-side histograms whose means say where TTFT goes: the API server's own TTFT (arrival to
# first token out) and PD's phases (tandem/disagg/metrics.py)
TIMING_HISTOGRAMS = ("time_to_first_token_seconds", "pd_phase_seconds", "router_time_to_first_token_seconds")


def timing_sums(urls: dict[str, str]) -> dict[str, float]:
    """``server name{labels}_sum|_count`` -> value, for ``TIMING_HISTOGRAMS`` of each server."""
    import httpx

    values = {}
    for server, url in urls.items():
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            name = line.split("{")[0].split(" ")[0].removeprefix("tandem:")
            if any(name in (f"{histogram}_sum", f"{histogram}_count") for histogram in TIMING_HISTOGRAMS):
                values[f"{server} {line.rsplit(' ', 1)[0].removeprefix('tandem:')}"] = float(line.split()[-1])
    return values


def timing_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean seconds of each histogram over the requests between the two snapshots."""
    means = {}
    for key, total in after.items():
        if "_sum" not in key:
            continue
        count = after.get(key.replace("_sum", "_count"), 0) - before.get(key.replace("_sum", "_count"), 0)
        if count > 0:
            label = key.replace("_seconds_sum", "").replace("router_time_to_first_token", "first event") \
                .replace("time_to_first_token", "server TTFT")
            means[label] = (total - before.get(key, 0.0)) / count
    return means


def measure_setup(url: str, prompts: list[list[int]], output_len: int, servers: dict[str, str]) -> dict:
    """One warm-up request (its greedy output kept), then the streamed requests one at a time;
    the server-side timings are the histograms' means over the measured requests."""
    from benchmarks import serve

    outputs = complete(url, prompts[0], output_len)
    before = timing_sums(servers)
    level = asyncio.run(serve.run_level(url, "bench", prompts[1:], output_len, 1, None))
    done = level.completed
    if not done:
        raise RuntimeError(f"no streamed request finished: {[record.error for record in level.records][:1]}")
    return {"outputs": outputs, "ttft": statistics.median(record.ttft for record in done),
            "client ttft mean": statistics.mean(record.ttft for record in done),
            "timings": timing_means(before, timing_sums(servers))}


def start_setup(cluster, arguments, name: str, deadline: Deadline) -> tuple[str, dict[str, str]]:
    """Start setup ``name`` (colocated, or a backend's prefill + decode + router) and wait until
    it serves: (the URL to send to, the servers whose timings are read)."""
    if name == "colocated":
        url, process = cluster.launch("colocated", server_flags(arguments, arguments.prefill_device))
        cluster.wait(url, process, timeout=deadline.left(600))
        return url, {"colocated": url}
    layout = ["--kv-cache-layout", arguments.kv_cache_layout]
    prefill_url, prefill = cluster.launch(f"prefill-{name}", [*server_flags(arguments, arguments.prefill_device),
                                                             "--role", "prefill", "--transfer-backend", name, *layout])
    decode_url, decode = cluster.launch(f"decode-{name}", [*server_flags(arguments, arguments.decode_device),
                                                           "--role", "decode", "--transfer-backend", name, *layout])
    cluster.wait(prefill_url, prefill, timeout=deadline.left(600))
    cluster.wait(decode_url, decode, timeout=deadline.left(600))
    url, router = cluster.launch(f"router-{name}", ["router", "--prefill", prefill_url, "--decode", decode_url])
    cluster.wait(url, router, "/v1/models", timeout=deadline.left(120))
    return url, {"prefill": prefill_url, "decode": decode_url, "router": url}


def run_serving(arguments, deadline: Deadline) -> dict[str, dict]:
    """setup (colocated, nixl, nccl) -> {outputs, ttft, transfers} or {error}. One setup at a
    time, alone on the GPUs (its servers stopped before the next starts): processes sharing a
    GPU are time-sliced, so another setup's servers there (starting up, or a transfer backend's
    kernel waiting) would slow the one measured."""
    from benchmarks import serve
    from benchmarks.pd import Cluster, pd_metrics

    vocab = serve.vocab_size_of(arguments.model)
    prompts = serve.make_prompts(arguments.requests + 1, arguments.input_len, vocab, arguments.seed)
    results: dict[str, dict] = {}
    for name in ("colocated", *arguments.backends):
        cluster = Cluster(Path(arguments.log_directory))
        try:
            url, servers = start_setup(cluster, arguments, name, deadline)
            results[name] = measure_setup(url, prompts, arguments.output_len, servers)
            if name != "colocated":
                results[name]["transfers"] = pd_metrics(servers["prefill"])
        except Exception as error:  # noqa: BLE001 - a setup that fails is reported; the others still run
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        finally:
            cluster.stop()
        served = results[name]
        print(f"   serving {name}: {served.get('error') or 'TTFT %.2f ms' % (served['ttft'] * 1e3)}", flush=True)
    return results


# -- report -------------------------------------------------------------------------------------------------------


def print_table(arguments, bandwidth: dict, serving: dict) -> None:
    colocated = serving.get("colocated", {})
    print(f"\n== PD over GPU memory: {arguments.shape or arguments.model}, {arguments.input_len}-token prompt, "
          f"prefill {arguments.prefill_device} -> decode {arguments.decode_device}, {arguments.kv_cache_layout} ==")
    if "error" in colocated:
        print(f"colocated server failed: {colocated['error']}")
    columns = {"backend": 17, "MiB": 7, "descs": 5, "sends": 5, "PD ms": 7, "prepare ms": 10, "stage ms": 8,
               "post ms": 7, "wait ms": 7, "row ms": 6, "PD GB/s": 8, "copy GB/s": 9, "fraction": 8, "TTFT ms": 8, "added ms": 8, "outputs": 8}
    header = " ".join(f"{title:>{width}}" for title, width in columns.items())
    print(header)
    print("-" * len(header))
    for name in [*arguments.backends, *(label for label in bandwidth if label not in arguments.backends)]:
        cells = dict.fromkeys(list(columns)[1:], "-")
        measured = bandwidth.get(name, {"error": "not run"})
        if "error" not in measured:
            rate = measured["bytes"] / measured["seconds"] / 1e9
            copy_rate = measured["bytes"] / measured["copy_seconds"] / 1e9
            cells.update({"MiB": f"{measured['bytes'] / 2**20:.1f}", "descs": str(measured["descriptors"]),
                          "sends": str(measured.get("sends", "-")),
                          "PD ms": f"{measured['seconds'] * 1e3:.3f}", "PD GB/s": f"{rate:.1f}",
                          "copy GB/s": f"{copy_rate:.1f}", "fraction": f"{rate / copy_rate:.2f}"})
            for key in TIMED_STEPS:
                if measured.get(key):
                    cells[f"{key} ms"] = f"{measured[key] * 1e3:.3f}"
        served = serving.get(name, {"error": "not run"})
        if "error" not in served:
            cells["TTFT ms"] = f"{served['ttft'] * 1e3:.2f}"
            if "ttft" in colocated:
                cells["added ms"] = f"{(served['ttft'] - colocated['ttft']) * 1e3:.2f}"
                cells["outputs"] = "equal" if served["outputs"] == colocated["outputs"] else "DIFFER"
        print(" ".join(f"{value:>{width}}" for value, width in zip([name, *cells.values()], columns.values())))
    if bandwidth:
        print(MODES_HELP)
    if "ttft" in colocated:
        print(f"colocated TTFT {colocated['ttft'] * 1e3:.2f} ms (median of {arguments.requests} streamed requests)")
    for label, result in bandwidth.items():
        if "error" in result:
            print(f"{label} bandwidth failed: {result['error']}")
    for name in arguments.backends:
        if "error" in serving.get(name, {}):
            print(f"{name} serving failed: {serving[name]['error']}")
        if "transfers" in serving.get(name, {}):
            print(f"{name} prefill server's transfers: {serving[name]['transfers']}")
    for name in ("colocated", *arguments.backends):
        served = serving.get(name, {})
        if "timings" in served:  # where TTFT goes (means over the streamed requests, ms)
            timings = ", ".join(f"{label} {seconds * 1e3:.2f}" for label, seconds in served["timings"].items())
            print(f"{name} timings (mean ms): client TTFT {served['client ttft mean'] * 1e3:.2f}, {timings}")
    print("goals: fraction >= 0.85, added TTFT <= 1 ms (Llama-3.1-8B shape, 2,048 tokens, 2 GPUs), outputs equal")


def variant(text: str) -> tuple[float, float]:
    direct, _, staging = text.partition(":")
    return float(direct), float(staging)


def parse_arguments(argv=None) -> argparse.Namespace:
    from benchmarks.common import add_model_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--device", default="auto", choices=("auto", "one-gpu", "cpu"),
                        help="auto: cuda:0 and cuda:1; one-gpu: both legs on cuda:0 (PD's steps without the link: "
                             "where TTFT goes; NIXL only); cpu: both legs in host memory")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--nccl-variants", nargs="*", default=[(4.0, 32.0), (1024.0, 16.0), (1024.0, 64.0)],
                        type=variant,
                        help="more NCCL segmentings measured in part 1, DIRECT_MIB:STAGING_MIB (runs of at least "
                             "DIRECT_MIB sent in place, shorter ones gathered into pipelined staged sends of "
                             "STAGING_MIB); the default row uses the backend's own (64:32); 4:32 was the default "
                             "before (4 MiB runs sent in place, one NCCL group)")
    parser.add_argument("--kv-cache-layout", choices=("page-major", "layer-major"), default="page-major",
                        help="the pools of both parts' PD sides (PD servers' default is page-major: a prompt's "
                             "pages are one run per state group; layer-major: one run per layer buffer)")
    parser.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="environment for every process of the run (e.g. NCCL_MIN_P2P_NCHANNELS=32 to try "
                             "NCCL's point-to-point tuning, UCX_... for NIXL's transport)")
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--requests", type=int, default=16, help="streamed requests per setup (TTFT median)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="prefill chunk of the servers: pages stream to the decode server as chunks complete, "
                             "so only the last chunk's transfer adds to TTFT")
    parser.add_argument("--rounds", type=int, default=10, help="timed PD writes per backend (median)")
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds for everything")
    parser.add_argument("--skip-bandwidth", action="store_true")
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--log-directory", default=None)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def resolve_devices(arguments) -> None:
    import torch

    if arguments.device == "cpu":
        arguments.prefill_device = arguments.decode_device = "cpu"
        arguments.shape = arguments.shape or "micro"
        arguments.dtype = arguments.dtype or "float32"
        arguments.load_format = "auto"
        return
    if arguments.device == "one-gpu":  # both servers on cuda:0: PD's own steps without the link
        if "nccl" in arguments.backends:
            print("one-gpu: NCCL allows one rank per device; measuring NIXL only", flush=True)
            arguments.backends = [name for name in arguments.backends if name != "nccl"]
        arguments.prefill_device = arguments.decode_device = "cuda:0"
    elif torch.cuda.device_count() < 2:
        raise SystemExit("pd_gpu.py: needs two visible GPUs (or --device one-gpu: both sides on one GPU, "
                         "or --device cpu to check the steps on a CPU)")
    else:
        arguments.prefill_device, arguments.decode_device = "cuda:0", "cuda:1"
    arguments.shape = arguments.shape or "llama3-8b"
    arguments.dtype = arguments.dtype or "bfloat16"
    arguments.load_format = "dummy" if not arguments.model else "auto"


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    deadline = Deadline(arguments.deadline)
    os.environ.pop("TANDEM_SANITIZE", None)  # measure the engine as deployed
    for setting in arguments.env:  # before any process, backend or communicator starts
        key, separator, value = setting.partition("=")
        if not separator or not key:
            raise SystemExit(f"pd_gpu.py: --env takes KEY=VALUE, got {setting!r}")
        os.environ[key] = value
    os.environ["PYTHONPATH"] = checkout_environment()["PYTHONPATH"]  # the servers import this checkout
    resolve_devices(arguments)
    from benchmarks.common import model_dir_for

    arguments.model = arguments.model or model_dir_for(arguments.shape, arguments.load_format)
    arguments.log_directory = arguments.log_directory or tempfile.mkdtemp(prefix="tandem-pd-gpu-")
    Path(arguments.log_directory).mkdir(parents=True, exist_ok=True)
    print(f"model {arguments.model} ({arguments.shape}, {arguments.dtype}, {arguments.load_format}); "
          f"logs in {arguments.log_directory}", flush=True)
    bandwidth, serving = {}, {}
    try:
        if not arguments.skip_bandwidth:
            print("== part 1: transfer bandwidth ==", flush=True)
            bandwidth = run_bandwidth(arguments, deadline)
            free_device_memory()
        if not arguments.skip_serving and deadline.left():
            print("== part 2: serving (TTFT, outputs) ==", flush=True)
            serving = run_serving(arguments, deadline)
    finally:
        print_table(arguments, bandwidth, serving)
    return 0


if __name__ == "__main__":
    sys.exit(main())
