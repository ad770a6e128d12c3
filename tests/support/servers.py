"""Shared pieces of the server tests (no tests here): a fake engine core with the real
``EngineCore`` interface, and a launcher that runs ``tandem serve`` as a child process.

The fake engine makes the bad-input and disconnect tests fast: it needs no torch and generates
a deterministic token stream; it accounts pages the way the real one reports them.
"""
from __future__ import annotations

import os

os.environ["TANDEM_SANITIZE"] = "1"

import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Optional  # noqa: E402

import httpx  # noqa: E402

from tandem.protocol import EngineRequest, EngineStats, PositionLogprobs, RequestDelta  # noqa: E402

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
FAKE_ENGINE_FILE = "fake_engine.json"
FAKE_CORE_CLASS = "tests.support.servers:FakeEngineCore"
FAIL_TOKEN_OFFSET = 1  # a prompt starting with vocab_size - 1 makes the fake engine fail it


class FakeSequence:
    def __init__(self, request: EngineRequest, index: int):
        self.request_id = request.request_id
        self.index = index
        self.params = request.sampling_params
        self.prompt = list(request.prompt_token_ids)
        self.output: list[int] = []
        self.sent_first = False


class FakeEngineCore:
    """``EngineCore``'s interface over a token generator: next = (31 * last + 7 + index) % vocab.

    Settings come from ``fake_engine.json`` in the model directory: ``vocab_size``,
    ``max_model_len``, ``step_delay`` (seconds slept per step), ``eos_token_id``.
    """

    def __init__(self, config):
        settings = json.loads((Path(config.model) / FAKE_ENGINE_FILE).read_text())
        self.config = config
        self.step_delay = settings.get("step_delay", 0.0)
        self.model_info = SimpleNamespace(vocab_size=settings["vocab_size"],
                                          max_model_len=config.max_model_len or settings["max_model_len"],
                                          eos_token_ids=[settings.get("eos_token_id", 0)])
        self.page_size = config.page_size
        self.pages_total = (config.max_total_tokens or 65536) // config.page_size
        self.sequences: dict[tuple[str, int], FakeSequence] = {}

    def add_request(self, request: EngineRequest) -> None:
        vocab_size = self.model_info.vocab_size
        if any(not 0 <= token < vocab_size for token in request.prompt_token_ids):
            raise ValueError(f"prompt: token id outside the vocabulary [0, {vocab_size})")
        total = len(request.prompt_token_ids) + (request.sampling_params.max_tokens or 0)
        if total > self.model_info.max_model_len:
            raise ValueError("max_tokens: prompt plus max_tokens exceeds max_model_len")
        if total > self.pages_total * self.page_size:
            raise ValueError(f"max_tokens: {total} tokens can never fit the state pool "
                             f"({self.pages_total * self.page_size} tokens)")
        for index in range(request.sampling_params.n):
            self.sequences[(request.request_id, index)] = FakeSequence(request, index)

    def abort_requests(self, request_ids: list[str]) -> None:
        for key in [key for key in self.sequences if key[0] in request_ids]:
            del self.sequences[key]

    def finish_sequences(self, keys: list[tuple[str, int]]) -> None:
        for key in keys:
            self.sequences.pop(tuple(key), None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.sequences)

    def step(self) -> list[RequestDelta]:
        if self.step_delay:
            time.sleep(self.step_delay)
        running = list(self.sequences.values())[:self.config.max_num_seqs]
        return [self.advance(sequence) for sequence in running]

    def advance(self, sequence: FakeSequence) -> RequestDelta:
        vocab_size = self.model_info.vocab_size
        delta = RequestDelta(request_id=sequence.request_id, index=sequence.index)
        if not sequence.sent_first:
            sequence.sent_first = True
            delta.num_prompt_tokens = len(sequence.prompt)
            if sequence.prompt[0] == vocab_size - FAIL_TOKEN_OFFSET:
                del self.sequences[(sequence.request_id, sequence.index)]
                delta.finish_reason, delta.error = "error", "fake engine failure"
                return delta
        last = (sequence.output or sequence.prompt)[-1]
        token = fake_next_token(last, sequence.index, vocab_size)
        sequence.output.append(token)
        delta.new_token_ids = [token]
        if sequence.params.logprobs is not None:
            top = [(token + offset) % vocab_size for offset in range(sequence.params.logprobs)]
            delta.new_logprobs = [PositionLogprobs([token] + top, [-0.25] + [-0.25 - 0.5 * rank for rank in
                                                                            range(len(top))], 1)]
        if token in sequence.params.stop_token_ids:
            delta.finish_reason, delta.stop_reason = "stop", token
        elif len(sequence.output) >= sequence.params.max_tokens:
            delta.finish_reason = "length"
        if delta.finish_reason is not None:
            del self.sequences[(sequence.request_id, sequence.index)]
        return delta

    def stats(self) -> EngineStats:
        used = sum(-(-(len(sequence.prompt) + len(sequence.output)) // self.page_size)
                   for sequence in self.sequences.values())
        return EngineStats(num_running=len(self.sequences), kv_pages_used=used, kv_pages_total=self.pages_total,
                           page_size=self.page_size)

    def reset_prefix_cache(self) -> int:
        return 0

    def shutdown(self) -> None:
        self.sequences.clear()


def fake_next_token(last: int, index: int, vocab_size: int) -> int:
    """The fake engine's generator; never the eos (id 0) or the failure trigger."""
    token = (31 * last + 7 + index) % vocab_size
    return token if 0 < token < vocab_size - FAIL_TOKEN_OFFSET else 1


def make_fake_model_dir(directory: Path, tokenizer_source: Path, **settings) -> Path:
    """A model directory the fake engine serves: the tokenizer files of a real tiny model plus
    the fake's settings."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in Path(tokenizer_source).iterdir():
        if "token" in path.name or path.name.endswith(".jinja"):
            shutil.copy(path, directory / path.name)
    settings.setdefault("vocab_size", 512)
    settings.setdefault("max_model_len", 256)
    (directory / FAKE_ENGINE_FILE).write_text(json.dumps(settings))
    return directory


def free_port() -> int:
    """A port free now, drawn from below the kernel's ephemeral range: a port the kernel hands
    out for port 0 may be taken by any outgoing connection before the server binds it."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(10000, max(10001, first_ephemeral))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


class ServerProcess:
    """``python -m tandem.entrypoints.cli serve ARGS`` on a free port, for one test module.

    Owns the child process: ``start`` waits for ``/health``; ``stop`` sends a signal and checks
    that the server exits with status 0 and leaves no child process behind.
    """

    ready_path = "/health"
    kind = "server"

    def __init__(self, arguments: list[str], log_path: Path, environment: Optional[dict] = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.arguments = ["serve", "--port", str(self.port), *arguments]
        self.log_path = log_path
        self.environment = {**os.environ, "TANDEM_SANITIZE": "1", "PYTHONPATH": str(REPOSITORY_ROOT),
                            **(environment or {})}
        self.process: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 120.0) -> "ServerProcess":
        self.log_file = open(self.log_path, "w")
        self.process = subprocess.Popen([sys.executable, "-m", "tandem.entrypoints.cli", *self.arguments],
                                        cwd=REPOSITORY_ROOT, env=self.environment, stdout=self.log_file,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + self.ready_path, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"{self.kind} not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self.log_file.closed:
            self.log_file.flush()
        return self.log_path.read_text()

    def child_pids(self) -> list[int]:
        result = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True)
        return [int(pid) for pid in result.stdout.split()]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server; return its exit status after checking its children are gone."""
        children = self.child_pids()
        self.process.send_signal(sig)
        try:
            status = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server did not exit within {timeout} s:\n{self.log()}")
        finally:
            self.log_file.close()
        deadline = time.monotonic() + 10
        while any(process_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        orphans = [pid for pid in children if process_alive(pid)]
        assert not orphans, f"server left child processes behind: {orphans}"
        return status

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            for pid in self.child_pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.process.kill()
            self.process.wait()
        if self.process is not None and not self.log_file.closed:
            self.log_file.close()

    def metric(self, name: str, labels: str = "", headers: Optional[dict] = None) -> float:
        """One sample of ``/metrics`` (``labels`` like ``outcome="abort"``)."""
        text = httpx.get(self.base_url + "/metrics", headers=headers, timeout=10).text
        wanted = f"tandem:{name}{{{labels}}}" if labels else f"tandem:{name}"
        for line in text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        raise KeyError(f"{wanted} not in /metrics")

    def wait_for_metric(self, name: str, value: float, timeout: float = 10.0, labels: str = "") -> float:
        deadline = time.monotonic() + timeout
        current = self.metric(name, labels)
        while current != value and time.monotonic() < deadline:
            time.sleep(0.05)
            current = self.metric(name, labels)
        return current


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False
