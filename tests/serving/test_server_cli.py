"""The ``tandem`` command line: complete ``--help``, ``generate``, the embedded demo model, and
shutdown on SIGINT/SIGTERM (in-flight requests drain, bounded; no orphans; exit status 0)."""
import os

os.environ["TANDEM_SANITIZE"] = "1"

import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

from tandem.entrypoints.cli import main  # noqa: E402
from tests.support.servers import FAKE_CORE_CLASS, ServerProcess, make_fake_model_dir  # noqa: E402

SERVE_FLAGS = ["--model", "--host", "--port", "--api-key", "--page-size", "--max-total-tokens", "--max-num-seqs",
               "--max-num-batched-tokens", "--max-model-len", "--dtype", "--load-format", "--enable-prefix-caching",
               "--no-enable-prefix-caching", "--served-model-name", "--log-level", "--max-queued-requests",
               "--shutdown-timeout", "--tokenizer", "--seed", "--device", "--kv-cache-dtype"]


def help_text(capsys, *command) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_help_is_complete(capsys):
    top = help_text(capsys)
    for command in ("serve", "generate", "make-model"):
        assert command in top
    serve = help_text(capsys, "serve")
    for flag in SERVE_FLAGS:
        assert flag in serve, flag
    assert "--engine-core-class" not in serve
    generate = help_text(capsys, "generate")
    for flag in ("--model", "--max-tokens", "--temperature", "--chat", "--stop", "--max-model-len"):
        assert flag in generate, flag
    assert "--out" in help_text(capsys, "make-model")


def test_generate_prints_outputs(capsys, model_dirs):
    status = main(["generate", "--model", model_dirs["llama"], "--max-tokens", "5", "--ignore-eos",
                   "--max-total-tokens", "4096", "hello there", "second prompt"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert status == 0 and len(lines) == 2
    assert lines[0].startswith("'hello there' -> ") and lines[0].endswith("(5 tokens, length)")


def stream_in_background(url: str, body: dict, result: dict, first_chunk: threading.Event) -> threading.Thread:
    """Stream ``body`` in a thread; record every data line, or the error that ended the stream."""
    def run():
        result["lines"] = []
        try:
            with httpx.stream("POST", url, json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        result["lines"].append(line)
                        first_chunk.set()
        except httpx.HTTPError as error:
            result["error"] = error
        first_chunk.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_demo_model_served_without_model_and_sigint_drains(tmp_path):
    server = ServerProcess(["--max-total-tokens", "8192"], tmp_path / "server.log",
                           environment={"TANDEM_CACHE_DIR": str(tmp_path / "cache")})
    server.start(timeout=180)
    try:
        first_line = server.log().splitlines()[0]
        assert "demo model" in first_line, first_line
        assert [model["id"] for model in httpx.get(server.base_url + "/v1/models").json()["data"]] == ["demo"]
        result, first_chunk = {}, threading.Event()
        body = {"model": "demo", "prompt": "hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
        thread = stream_in_background(server.base_url + "/v1/completions", body, result, first_chunk)
        assert first_chunk.wait(30)
        status = server.stop(signal.SIGINT)
    finally:
        server.kill()
    thread.join(30)
    assert status == 0
    assert "error" not in result, result.get("error")
    assert result["lines"][-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in result["lines"][-2], "the in-flight request must finish, not be cut"
    assert "stopped" in server.log()
    assert any(path.name.startswith("demo-") for path in (tmp_path / "cache").iterdir())


def test_sigterm_drain_is_bounded(tmp_path, tokenizer_dir):
    model_dir = make_fake_model_dir(tmp_path / "fake_model", tokenizer_dir, step_delay=0.05)
    server = ServerProcess(["--model", str(model_dir), "--shutdown-timeout", "1",
                            "--engine-core-class", FAKE_CORE_CLASS], tmp_path / "server.log")
    server.start()
    try:
        result, first_chunk = {}, threading.Event()
        body = {"prompt": "hello", "max_tokens": 200, "stream": True}  # about 10 s of fake steps
        thread = stream_in_background(server.base_url + "/v1/completions", body, result, first_chunk)
        assert first_chunk.wait(30)
        signalled = time.monotonic()
        status = server.stop(signal.SIGTERM)
        elapsed = time.monotonic() - signalled
    finally:
        server.kill()
    thread.join(30)
    assert status == 0
    assert elapsed < 6, f"shutdown took {elapsed:.1f} s with a 1 s drain limit"
    assert '"finish_reason":"length"' not in "".join(result["lines"]), "the long request cannot have finished"


def test_server_exits_when_its_engine_dies(tmp_path, tokenizer_dir):
    model_dir = make_fake_model_dir(tmp_path / "fake_model", tokenizer_dir, step_delay=0.05)
    server = ServerProcess(["--model", str(model_dir), "--engine-core-class", FAKE_CORE_CLASS],
                           tmp_path / "server.log")
    server.start()
    try:
        result, first_chunk = {}, threading.Event()
        body = {"prompt": "hello", "max_tokens": 200, "stream": True}
        thread = stream_in_background(server.base_url + "/v1/completions", body, result, first_chunk)
        assert first_chunk.wait(30)
        (engine_pid,) = [pid for pid in server.child_pids() if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]
        os.kill(engine_pid, signal.SIGKILL)
        status = server.process.wait(30)
    finally:
        server.kill()
    thread.join(30)
    assert status == 1
    assert "engine" in result["lines"][-2] and "error" in result["lines"][-2], result["lines"][-2:]
    assert "exiting because the engine died" in server.log()
