"""Goodput of deployments on the same GPUs: N colocated replicas behind ``tandem router --server``
against xPyD (x prefill + y decode servers behind ``tandem router --prefill/--decode``), each
measured by ``benchmarks/goodput.py`` through its router, one deployment after the other.

    # two GPUs, Llama-3.1-8B shape (dummy weights), 2,048 in / 256 out, TTFT <= 1 s, worst gap <= 50 ms
    python -m benchmarks.goodput_deployments --deployment colocated:2 1p1d \
        --request-rates 1 2 3 4 6 --num-requests 96 --ttft-slo-ms 1000 --itl-slo-ms 50
    # the same with the SLO-aware colocated scheduler (--max-itl-ms on the colocated servers)
    python -m benchmarks.goodput_deployments --deployment colocated:2 --max-itl-ms 30 ...
    # a check of the steps on a CPU (the figures mean nothing there)
    python -m benchmarks.goodput_deployments --device cpu --shape micro --input-len 64 --output-len 8 \
        --deployment colocated:2 1p1d --request-rates 2 --num-requests 8

Server i of a deployment runs on ``cuda:i`` (prefill servers first); keep every GPU visible to
every process (NCCL and UCX use NVLink between processes only then). Goodput per GPU divides by
the deployment's server count. Logs go to ``--log-directory``.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent

DEPLOYMENT = re.compile(r"^(?:colocated:(?P<replicas>\d+)|(?P<prefills>\d+)p(?P<decodes>\d+)d)$")


def parse_deployment(text: str) -> tuple[int, int, int]:
    """``colocated:N`` -> (N, 0, 0); ``XpYd`` -> (0, X, Y)."""
    match = DEPLOYMENT.match(text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"--deployment: {text!r} is neither colocated:N nor XpYd (e.g. 1p1d)")
    if match["replicas"] is not None:
        counts = (int(match["replicas"]), 0, 0)
    else:
        counts = (0, int(match["prefills"]), int(match["decodes"]))
    if sum(counts) == 0 or (counts[0] == 0 and 0 in counts[1:]):
        raise argparse.ArgumentTypeError(f"--deployment: {text!r} needs at least one server of each kind")
    return counts


def server_flags(arguments: argparse.Namespace, device: str) -> list[str]:
    flags = ["serve", "--model", arguments.model, "--served-model-name", "bench", "--device", device,
             "--page-size", str(arguments.page_size), "--max-num-seqs", str(arguments.max_num_seqs),
             "--max-num-batched-tokens", str(arguments.max_num_batched_tokens), "--no-enable-prefix-caching",
             "--dtype", arguments.dtype]
    if arguments.load_format != "auto":
        flags += ["--load-format", arguments.load_format]
    if arguments.max_total_tokens:
        flags += ["--max-total-tokens", str(arguments.max_total_tokens)]
    return flags


def device_of(arguments: argparse.Namespace, index: int) -> str:
    return "cpu" if arguments.device == "cpu" else f"cuda:{index}"


def launch(cluster, arguments: argparse.Namespace, name: str, counts: tuple[int, int, int]) -> str:
    """Start the deployment's servers (at once: their start-ups overlap), then its router; its URL."""
    replicas, prefills, decodes = counts
    servers = []
    for index in range(replicas):
        flags = server_flags(arguments, device_of(arguments, index))
        if arguments.max_itl_ms is not None:
            flags += ["--max-itl-ms", str(arguments.max_itl_ms)]
        servers.append(("server", cluster.launch(f"{name}-server{index}", flags)))
    for index in range(prefills + decodes):
        role = "prefill" if index < prefills else "decode"
        flags = [*server_flags(arguments, device_of(arguments, index)), "--role", role,
                 "--transfer-backend", arguments.transfer_backend]
        servers.append((role, cluster.launch(f"{name}-{role}{index}", flags)))
    for _, (url, process) in servers:
        cluster.wait(url, process, timeout=arguments.startup_timeout)
    router_flags = ["router", "--policy", arguments.policy]
    for role in ("server", "prefill", "decode"):
        urls = [url for kind, (url, _) in servers if kind == role]
        if urls:
            router_flags += [f"--{role}", *urls]
    url, router = cluster.launch(f"{name}-router", router_flags)
    cluster.wait(url, router, "/v1/models", timeout=120)
    return url


def goodput_flags(arguments: argparse.Namespace, url: str, num_gpus: int, json_path: Path) -> list[str]:
    flags = ["--base-url", url, "--served-model-name", "bench", "--model", arguments.model,
             "--input-len", str(arguments.input_len), "--output-len", str(arguments.output_len),
             "--num-requests", str(arguments.num_requests), "--num-gpus", str(num_gpus),
             "--ttft-slo-ms", str(arguments.ttft_slo_ms), "--attainment", str(arguments.attainment),
             "--seed", str(arguments.seed), "--json", str(json_path),
             "--request-rates", *map(str, arguments.request_rates), "--concurrency", *map(str, arguments.concurrency)]
    if arguments.itl_slo_ms is not None:
        flags += ["--itl-slo-ms", str(arguments.itl_slo_ms)]
    if arguments.tpot_slo_ms is not None:
        flags += ["--tpot-slo-ms", str(arguments.tpot_slo_ms)]
    return flags


def parse_arguments(argv=None) -> argparse.Namespace:
    from benchmarks.common import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--deployment", type=parse_deployment, nargs="+", required=True, metavar="KIND",
                        help="colocated:N (N replicas behind the router) or XpYd (X prefill + Y decode servers)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--model", default=None, help="model directory (default: the shape, dummy weights on CUDA)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--max-itl-ms", type=float, default=None, help="--max-itl-ms of the colocated servers")
    parser.add_argument("--transfer-backend", default="nixl", help="PD servers' --transfer-backend")
    parser.add_argument("--policy", default="least-loaded", help="the router's --policy")
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--request-rates", type=float, nargs="*", default=[1.0, 2.0, 4.0, 6.0])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[])
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--itl-slo-ms", type=float, default=50.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=None)
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--log-directory", default=str(Path(tempfile.gettempdir()) / "tandem-goodput"))
    arguments = parser.parse_args(argv)
    arguments.dtype = arguments.dtype or ("bfloat16" if arguments.device == "cuda" else "float32")
    arguments.load_format = "dummy" if arguments.device == "cuda" and arguments.model is None else "auto"
    return arguments


def main(argv=None) -> int:
    from benchmarks import goodput
    from benchmarks.common import model_dir_for
    from benchmarks.pd import Cluster

    arguments = parse_arguments(argv)
    arguments.model = arguments.model or model_dir_for(arguments.shape, arguments.load_format)
    log_directory = Path(arguments.log_directory)
    log_directory.mkdir(parents=True, exist_ok=True)
    status = 0
    for counts in arguments.deployment:
        replicas, prefills, decodes = counts
        name = f"colocated{replicas}" if replicas else f"{prefills}p{decodes}d"
        label = name + (f" --max-itl-ms {arguments.max_itl_ms:g}" if replicas and arguments.max_itl_ms else "")
        print(f"\n== {label}: {arguments.shape}, {arguments.input_len} in / {arguments.output_len} out ==", flush=True)
        cluster = Cluster(log_directory)
        started = time.monotonic()
        try:
            url = launch(cluster, arguments, name, counts)
            print(f"   up in {time.monotonic() - started:.0f} s; router {url}", flush=True)
            status |= goodput.main(goodput_flags(arguments, url, sum(counts), log_directory / f"{name}.json"))
        except Exception as error:  # noqa: BLE001 - report it and go on with the next deployment
            print(f"   {name} failed: {type(error).__name__}: {error} (logs in {log_directory})", flush=True)
            status = 1
        finally:
            cluster.stop()
    return status


if __name__ == "__main__":
    sys.exit(main())
