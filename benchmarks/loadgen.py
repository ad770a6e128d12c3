"""An external load generator against ``tandem serve``: NVIDIA AIPerf at fixed input/output lengths
(streamed completions, ``ignore_eos``), its TTFT / ITL / latency table, and a check that its
numbers and the server's own ``/metrics`` agree.

Compared (server figures: the change of each series over the run):
  - requests: AIPerf's completed requests = ``tandem:requests_total`` (every outcome), exactly;
  - tokens: AIPerf's prompt and completion tokens (the server's ``usage``) =
    ``tandem:prompt_tokens_total`` and ``tandem:generation_tokens_total``, exactly;
  - latency: AIPerf's mean TTFT, ITL and request latency against the server's histograms'
    means (``time_to_first_token``, ``inter_token_latency``, ``e2e_request_latency``), within
    max(25%, 15 ms): the client measures from its send to its receipt, the server from arrival
    to the hand-off of each output, so the client's figures are a little larger.
Exit status 1 when they disagree.

AIPerf is not a tandem dependency (it pins pyzmq 26 and brings ~1.2 GB of packages, no torch):
install it in a virtual environment of its own and point ``--aiperf`` (or ``$TANDEM_AIPERF``) at it:

    python -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0
    python -m benchmarks.loadgen --aiperf .venv-aiperf/bin/aiperf                  # demo model
    python -m benchmarks.loadgen --input-len 256 --output-len 64 --concurrency 8 --requests 200
    python -m benchmarks.loadgen --base-url http://127.0.0.1:8000 --tokenizer DIR  # a running server
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import httpx


from benchmarks.serve import LaunchedServer
from tests.support.soak_processes import parse_metrics

MODEL_NAME = "demo"
RELATIVE_TOLERANCE, ABSOLUTE_TOLERANCE_MS = 0.25, 15.0


def aiperf_command(arguments, base_url: str, tokenizer: str, output: Path) -> list[str]:
    command = [arguments.aiperf, "profile", "--model", MODEL_NAME, "--url", base_url, "--endpoint-type", "completions",
               "--streaming", "--tokenizer", tokenizer, "--isl", str(arguments.input_len), "--isl-stddev", "0",
               "--osl", str(arguments.output_len), "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true",
               "--use-server-token-count", "--concurrency", str(arguments.concurrency),
               "--request-count", str(arguments.requests), "--random-seed", str(arguments.seed),
               "--output-artifact-dir", str(output), "--ui", "none"]
    if arguments.api_key:
        command += ["--api-key", arguments.api_key]
    return command


def server_metrics(base_url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(base_url + "/metrics", timeout=10).text)


def change(before: dict, after: dict, prefix: str) -> float:
    """The change of every series whose key starts with ``prefix`` (summed over labels)."""
    return sum(value - before.get(key, 0.0) for key, value in after.items() if key.startswith(prefix))


def histogram_mean_ms(before: dict, after: dict, name: str) -> float:
    count = change(before, after, f"{name}_count")
    return 1000 * change(before, after, f"{name}_sum") / count if count else float("nan")


def histogram_quantile_ms(before: dict, after: dict, name: str, quantile: float) -> float:
    """Prometheus' estimate: linear within the bucket where the quantile falls."""
    buckets = []
    for key, value in after.items():
        if key.startswith(f"{name}_bucket{{le="):
            bound = key.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), value - before.get(key, 0.0)))
    buckets.sort()
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    rank, lower, below = quantile * buckets[-1][1], 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if bound == float("inf"):
                return 1000 * lower
            return 1000 * (lower + (bound - lower) * (rank - below) / max(cumulative - below, 1e-12))
        lower, below = bound, cumulative
    return float("nan")


def compare(report: dict, before: dict, after: dict) -> list[tuple[str, float, float, bool]]:
    """(quantity, AIPerf's figure, the server's, agree?) rows."""
    def client(name: str, field: str = "avg") -> float:
        return float(report.get(name, {}).get(field, float("nan")))

    def close(mine: float, theirs: float) -> bool:
        return abs(mine - theirs) <= max(RELATIVE_TOLERANCE * mine, ABSOLUTE_TOLERANCE_MS)

    rows = []
    for label, name, series in (("requests completed", "completed_request_count", "requests_total"),
                                ("prompt tokens", "total_usage_prompt_tokens", "prompt_tokens_total"),
                                ("completion tokens", "total_usage_completion_tokens", "generation_tokens_total")):
        mine, theirs = client(name), change(before, after, series)
        rows.append((label, mine, theirs, mine == theirs))
    for label, name, series in (("TTFT mean (ms)", "time_to_first_token", "time_to_first_token_seconds"),
                                ("ITL mean (ms)", "inter_token_latency", "inter_token_latency_seconds"),
                                ("request latency mean (ms)", "request_latency", "e2e_request_latency_seconds")):
        mine, theirs = client(name), histogram_mean_ms(before, after, series)
        rows.append((label, mine, theirs, close(mine, theirs)))
    return rows


def print_report(arguments, report: dict, before: dict, after: dict, rows) -> None:
    print(f"\nAIPerf {report.get('aiperf_version', '?')} against tandem serve: {arguments.requests} requests, "
          f"{arguments.input_len} tokens in, {arguments.output_len} out, concurrency {arguments.concurrency}, streamed")
    print(f"{'AIPerf (ms)':>22} {'avg':>8} {'p50':>8} {'p90':>8} {'p99':>8}")
    for label, name in (("TTFT", "time_to_first_token"), ("ITL", "inter_token_latency"),
                        ("request latency", "request_latency")):
        figures = report.get(name, {})
        print(f"{label:>22} " + " ".join(f"{figures.get(field, float('nan')):>8.1f}"
                                         for field in ("avg", "p50", "p90", "p99")))
    for label, name in (("requests/s", "request_throughput"), ("output tokens/s", "output_token_throughput")):
        print(f"{label:>22} {report.get(name, {}).get('avg', float('nan')):>8.1f}")
    print(f"\n{'server histograms (ms)':>22} {'mean':>8} {'p50~':>8} {'p90~':>8}   (~: bucket estimates)")
    for label, series in (("TTFT", "time_to_first_token_seconds"), ("ITL", "inter_token_latency_seconds"),
                          ("request latency", "e2e_request_latency_seconds")):
        print(f"{label:>22} {histogram_mean_ms(before, after, series):>8.1f} "
              f"{histogram_quantile_ms(before, after, series, 0.5):>8.1f} "
              f"{histogram_quantile_ms(before, after, series, 0.9):>8.1f}")
    print(f"\n{'quantity':>26} {'AIPerf':>10} {'/metrics':>10}  agree")
    for label, mine, theirs, agree in rows:
        print(f"{label:>26} {mine:>10.1f} {theirs:>10.1f}  {'yes' if agree else 'NO'}")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--aiperf", default=os.environ.get("TANDEM_AIPERF") or shutil.which("aiperf"),
                        help="the aiperf command ($TANDEM_AIPERF, else aiperf on PATH)")
    parser.add_argument("--model", default=None, help="model directory; none: the built-in demo model")
    parser.add_argument("--base-url", default=None, help="a running server (served as 'demo') instead of starting one")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory for AIPerf (default: the model's)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    if not arguments.aiperf:
        print("loadgen: aiperf not found; install it (see this file's docstring) and pass --aiperf", file=sys.stderr)
        return 2
    model: Optional[str] = arguments.model
    if model is None and arguments.base_url is None:
        from tandem.tools.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
    tokenizer = arguments.tokenizer or model
    output = Path(tempfile.mkdtemp(prefix="tandem-aiperf-"))
    server = None
    if arguments.base_url is None:
        flags = ["--served-model-name", MODEL_NAME, "--max-num-seqs", str(max(arguments.concurrency, 1))]
        server = LaunchedServer(model, flags + (["--api-key", arguments.api_key] if arguments.api_key else []),
                                output / "server.log")
    try:
        base_url = arguments.base_url or server.base_url
        if server is not None:
            server.wait_healthy()
        before = server_metrics(base_url)
        result = subprocess.run(aiperf_command(arguments, base_url, tokenizer, output), capture_output=True, text=True)
        after = server_metrics(base_url)
    finally:
        if server is not None:
            server.stop()
    report_path = output / "profile_export_aiperf.json"
    if result.returncode != 0 or not report_path.exists():
        print(result.stdout[-4000:], result.stderr[-4000:], sep="\n", file=sys.stderr)
        print(f"loadgen: aiperf failed (status {result.returncode}); artifacts in {output}", file=sys.stderr)
        return 1
    report = json.loads(report_path.read_text())
    rows = compare(report, before, after)
    print_report(arguments, report, before, after, rows)
    print(f"(AIPerf's artifacts: {output})")
    return 0 if all(agree for *_, agree in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
