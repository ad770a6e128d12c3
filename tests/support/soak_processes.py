"""The soak's processes: ``tandem serve`` and ``tandem router`` children on fixed loopback ports,
which can be killed and started again at the same port, with their memory (RSS of the whole
process tree: frontend, engine) and their Prometheus metrics read while they run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Incarnation:
    """One run of a process between a start and its end: when, and its RSS samples (t, bytes),
    taken once it is ready (start-up's growth is not a leak)."""
    started: float
    ready: bool = False
    ended: Optional[float] = None
    rss: list[tuple[float, int]] = field(default_factory=list)


class ManagedProcess:
    """One tandem command on a fixed loopback port; ``kill`` then ``start`` restarts it there."""

    def __init__(self, name: str, arguments: list[str], port: int, log_directory: Path,
                 environment: Optional[dict] = None, ready_path: str = "/health"):
        self.name = name
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.arguments = [*arguments, "--port", str(port)]
        self.log_path = log_directory / f"{name}.log"
        self.environment = {**os.environ, "PYTHONPATH": str(REPOSITORY_ROOT), **(environment or {})}
        self.ready_path = ready_path
        self.process: Optional[subprocess.Popen] = None
        self.incarnations: list[Incarnation] = []

    def start(self) -> "ManagedProcess":
        log = open(self.log_path, "a")
        self.process = subprocess.Popen([sys.executable, "-m", "tandem.entrypoints.cli", *self.arguments],
                                        cwd=REPOSITORY_ROOT, env=self.environment, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.incarnations.append(Incarnation(started=time.monotonic()))
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.process.returncode}; see {self.log_path}:\n"
                                   f"{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.base_url + self.ready_path, timeout=2).status_code == 200:
                    self.incarnations[-1].ready = True
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout:g} s; see {self.log_path}")

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the frontend (its engine follows: parent-death signal) and wait for the tree."""
        if not self.alive:
            return
        tree = process_tree(self.process.pid)
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + 10
        while any(process_alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.incarnations[-1].ended = time.monotonic()

    def stop(self, timeout: float = 60.0) -> None:
        """SIGINT (drain, then exit), SIGKILL if it lingers."""
        if not self.alive:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.incarnations[-1].ended is None:
            self.incarnations[-1].ended = time.monotonic()

    def sample_rss(self, now: float) -> None:
        if self.alive and self.incarnations[-1].ready:
            self.incarnations[-1].rss.append((now, sum(rss_bytes(pid) for pid in process_tree(self.process.pid))))

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.base_url + "/metrics", timeout=10).text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (names without the ``tandem:`` prefix)."""
    values = {}
    for line in text.splitlines():
        if line.startswith("tandem:"):
            key, _, value = line[len("tandem:"):].rpartition(" ")
            values[key] = float(value)
    return values


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant."""
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as children:
                    pending.extend(int(child) for child in children.read().split())
        except OSError:
            continue
    return tree


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False
