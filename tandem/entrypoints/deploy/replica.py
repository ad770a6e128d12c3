"""One replica of a deployment: a Ray actor that owns a ``tandem serve`` process on its node.

The actor picks a free port on its node's address, starts ``tandem serve`` with the replica's
role, the deployment's serve flags, the PD secret and the API key (in the child's environment,
``$TANDEM_PD_SECRET`` and ``$TANDEM_API_KEY``: never on a command line), and answers the supervisor: ``wait_ready``
(the server answers ``/health``; its ``/pd/info`` then says its control address), ``alive``, and
``stop`` (SIGTERM: the server drains its requests, then exits). The server dies with the actor:
the kernel kills it when the actor's process exits (``PR_SET_PDEATHSIG``; Ray runs an actor's
constructor and methods on its process's main thread, the one that started the child), and its
engine processes follow it the same way.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

LOG_TAIL_CHARS = 4000
SECRET_VARIABLE = "TANDEM_PD_SECRET"
API_KEY_VARIABLE = "TANDEM_API_KEY"


def free_port(host: str) -> int:
    """A port free now on ``host`` (the kernel's pick; the server binds it moments later)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the actor's process exits (Linux)."""
    from tandem.engine.process import die_with_parent as ask_kernel

    ask_kernel()


class ReplicaServer:
    """The actor body (made remote by ``placement.py``). ``spec``: name, role, model, deployment,
    serve_arguments (the deployment's ``tandem serve`` flags), host (the address to bind: the
    node's, or ``0.0.0.0``), gpus (whether it runs on GPUs); ``secret``: the deployment's PD
    secret; ``gpu_ids``: per bundle of its placement group, the devices it reserved."""

    def __init__(self, spec: dict, secret: bytes, *gpu_ids: list[str]):
        import ray

        self.spec = spec
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.gpu_ids = [gpu for bundle in gpu_ids for gpu in bundle]
        bind = spec.get("host") or self.node_ip
        self.port = free_port(bind)
        self.url = f"http://{self.node_ip}:{self.port}"
        log_dir = Path(tempfile.gettempdir()) / f"tandem-deploy-{spec['deployment']}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{spec['name']}-{self.port}.log"
        environment = {**os.environ, SECRET_VARIABLE: secret.hex()}
        if spec.get("api_key"):
            environment[API_KEY_VARIABLE] = spec["api_key"]
        if spec.get("gpus"):
            environment["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpu_ids)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command(bind), env=environment, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)

    def command(self, bind: str) -> list[str]:
        role = self.spec["role"]
        pd = [] if role == "colocated" else ["--pd-address", f"tcp://{bind}:0"]
        return [sys.executable, "-m", "tandem.entrypoints.cli", "serve", "--model", self.spec["model"],
                "--role", role, "--host", bind, "--port", str(self.port), *pd, *self.spec["serve_arguments"]]

    def wait_ready(self, timeout: float) -> dict:
        """Wait until the server answers ``/health`` (``timeout`` s at most); its registry record.
        RuntimeError with the end of its log when it exits or does not become healthy."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"replica {self.spec['name']}: tandem serve exited with {self.process.returncode}:"
                                   f"\n{self.log_tail()}")
            if get_status(self.url + "/health") == 200:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {self.spec['name']}: tandem serve not healthy after {timeout:g} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.25)
        with urllib.request.urlopen(self.url + "/pd/info", timeout=10) as answer:
            info = json.loads(answer.read())
        return {"name": self.spec["name"], "role": self.spec["role"], "url": self.url,
                "bootstrap_address": info.get("bootstrap_address"), "node_id": self.node_id,
                "node_ip": self.node_ip, "gpus": self.gpu_ids, "pid": self.process.pid, "log": str(self.log_path)}

    def alive(self) -> bool:
        return self.process.poll() is None

    def server_pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float) -> Optional[int]:
        """SIGTERM the server (it drains its requests within its --shutdown-timeout), SIGKILL after
        ``timeout`` s; its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text()[-LOG_TAIL_CHARS:]
        except OSError:
            return ""


def get_status(url: str) -> Optional[int]:
    """The status of ``GET url`` (2 s at most), or None when it cannot be reached."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except (OSError, ValueError):
        return None
