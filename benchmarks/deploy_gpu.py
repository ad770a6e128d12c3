"""``tandem deploy`` on two GPUs (a local Ray it starts): outputs equal a colocated server's, and
time to first token beside today's PD (``tandem serve --role ...`` by hand and ``tandem router``).

    python -m benchmarks.deploy_gpu                      # both checks
    python -m benchmarks.deploy_gpu --skip-ttft          # outputs only
    python -m benchmarks.deploy_gpu --transfer-backend nccl   # PD over NCCL (no NIXL installed)

1. Outputs: the ``tiny-30m`` shape with random weights (the same on every server), greedy
   token-id prompts; a colocated ``tandem serve`` on GPU 0, then ``tandem deploy
   --prefill-replicas 1 --decode-replicas 1`` (one GPU per replica); token ids must be equal.
2. TTFT: the ``llama3-8b`` shape with dummy weights (bf16); ``benchmarks/serve.py --base-url``
   against today's PD (prefill on GPU 0, decode on GPU 1, ``tandem router``) and against the
   deployment's router, at concurrency 1 and 8. The deployment adds no hop: its TTFT p50 should
   be within 2 ms of today's PD.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent

from benchmarks.common import model_dir_for  # noqa: E402
from benchmarks.serve import checkout_environment  # noqa: E402

PYTHON = sys.executable
ENVIRONMENT = checkout_environment()


def start(arguments: list[str], log: Path, environment: dict | None = None) -> subprocess.Popen:
    handle = open(log, "w")
    return subprocess.Popen([PYTHON, "-m", "tandem.entrypoints.cli", *arguments], stdout=handle,
                            stderr=subprocess.STDOUT, env={**ENVIRONMENT, **(environment or {})}, cwd=REPOSITORY_ROOT)


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {timeout} s:\n{log.read_text()[-4000:]}")


def stop(*processes: subprocess.Popen) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()


def greedy(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        answer = httpx.post(url + "/v1/completions", timeout=300, json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        answer.raise_for_status()
        outputs.append(answer.json()["choices"][0]["token_ids"])
    return outputs


def deploy(model: str, port: int, log: Path, flags: list[str]) -> subprocess.Popen:
    process = start(["deploy", "--model", model, "--prefill-replicas", "1", "--decode-replicas", "1",
                     "--replica-device", "gpu", "--port", str(port), *flags], log)
    wait_healthy(f"http://127.0.0.1:{port}", process, log)
    return process


def check_outputs(logs: Path, backend: list[str]) -> bool:
    model = model_dir_for("tiny-30m", "auto")
    prompts = [[(seed * 131 + index * 7) % 8000 + 5 for index in range(16 + 8 * seed)] for seed in range(8)]
    server = start(["serve", "--model", model, "--port", "18400"], logs / "colocated.log",
                   {"CUDA_VISIBLE_DEVICES": "0"})
    wait_healthy("http://127.0.0.1:18400", server, logs / "colocated.log")
    expected = greedy("http://127.0.0.1:18400", prompts, 32)
    stop(server)
    deployment = deploy(model, 18401, logs / "deploy_outputs.log", backend)
    try:
        got = greedy("http://127.0.0.1:18401", prompts, 32)
        reader = {**ENVIRONMENT, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": ray_address(logs / "deploy_outputs.log")}
        status = subprocess.run([PYTHON, "-m", "tandem.entrypoints.cli", "deploy", "status"], capture_output=True,
                                text=True, env=reader)
        print(status.stdout or status.stderr)
    finally:
        stop(deployment)
    equal = got == expected
    print(f"outputs: deploy 1P1D equals a colocated server on {len(prompts)} prompts: {equal}")
    return equal


def ray_address(log: Path) -> str:
    for line in log.read_text().splitlines():
        if "started a local Ray at " in line:
            return line.split("started a local Ray at ")[1].split()[0].rstrip(";")
    return ""


def serve_benchmark(url: str, name: str, logs: Path) -> None:
    command = [PYTHON, "-m", "benchmarks.serve", "--base-url", url, "--no-offline", "--input-len", "1024",
               "--output-len", "32", "--concurrency", "1", "8", "--requests-per-level", "64"]
    print(f"=== TTFT {name}: {' '.join(command)}", flush=True)
    result = subprocess.run(command, capture_output=True, text=True, env=ENVIRONMENT, cwd=REPOSITORY_ROOT)
    (logs / f"serve_{name}.log").write_text(result.stdout + result.stderr)
    print(result.stdout[-3000:], flush=True)


def check_ttft(logs: Path, backend: list[str]) -> None:
    model = model_dir_for("llama3-8b", "dummy")
    engine = ["--load-format", "dummy", "--dtype", "bfloat16", *backend]
    secret = logs / "pd_secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    prefill = start(["serve", "--model", model, "--role", "prefill", "--port", "18410", "--pd-secret-file", str(secret),
                     *engine], logs / "pd_prefill.log", {"CUDA_VISIBLE_DEVICES": "0"})
    decode = start(["serve", "--model", model, "--role", "decode", "--port", "18411", "--pd-secret-file", str(secret),
                    *engine], logs / "pd_decode.log", {"CUDA_VISIBLE_DEVICES": "1"})
    router = start(["router", "--prefill", "http://127.0.0.1:18410", "--decode", "http://127.0.0.1:18411",
                    "--port", "18412", "--startup-timeout", "900"], logs / "pd_router.log")
    try:
        wait_healthy("http://127.0.0.1:18412", router, logs / "pd_router.log")
        serve_benchmark("http://127.0.0.1:18412", "pd", logs)
    finally:
        stop(router, prefill, decode)
    deployment = deploy(model, 18413, logs / "deploy_ttft.log", engine)
    try:
        serve_benchmark("http://127.0.0.1:18413", "deploy", logs)
    finally:
        stop(deployment)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--transfer-backend", choices=["nixl", "nccl"], default="nixl",
                        help="the PD transfer backend of both the deployment and today's PD servers")
    parser.add_argument("--log-dir", default=os.environ.get("LOG_DIR", tempfile.mkdtemp(prefix="deploy-gpu-")))
    arguments = parser.parse_args()
    logs = Path(arguments.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    backend = ["--transfer-backend", arguments.transfer_backend]
    equal = check_outputs(logs, backend)
    if not arguments.skip_ttft:
        check_ttft(logs, backend)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
