"""Shared test setup: the sanitizer is on in every test (docs/design.md I5, I6), tiny models are
built once per session with ``transformers``' own classes, and ``transformers`` is the oracle."""
from __future__ import annotations

import os

os.environ["TANDEM_SANITIZE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def threads_per_worker() -> int | None:
    """Under pytest-xdist (``-n N``), each worker's share of the cores this process may use;
    None when the tests run in one process."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // workers) if workers > 1 else None


# Workers that each ran as many threads as there are cores would oversubscribe them: every
# parallel region of a tiny model's many small ops would wait for a core another worker holds.
# OMP_NUM_THREADS is read when torch loads, here and in every server a test starts.
if threads_per_worker() is not None:
    os.environ["OMP_NUM_THREADS"] = str(threads_per_worker())

import torch  # noqa: E402

if threads_per_worker() is not None:
    torch.set_num_threads(threads_per_worker())

# Without a CUDA device, Triton kernels run through Triton's interpreter (tiny shapes only). It
# is read when a kernel is defined, so it is set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402

import pytest  # noqa: E402

from tests.support.models import ARCH_OPTIONS, ARCHS  # noqa: E402,F401  (ARCHS: importable from here too)
from tests.support.oracle import Oracle  # noqa: E402

# The GPU machine runs `-m gpu` without the server stack installed: skip collecting those files.
SERVER_STACK = ("fastapi", "uvicorn", "zmq", "openai")
SERVER_TESTS = ["serving/*"]
collect_ignore_glob = [] if all(importlib.util.find_spec(name) for name in SERVER_STACK) else SERVER_TESTS


@pytest.fixture(scope="module")
def single_torch_thread():
    """Tiny models run fastest on one thread, especially on a busy CI machine (each parallel
    region of their many small ops waits for a second core). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("single_torch_thread")``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from tandem.tools.make_model import make_model

    return make_model("llama", tmp_path_factory.mktemp("tokenizer_source"), seed=99)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer_dir):
    """arch -> a tiny random-weight checkpoint directory (built lazily, once)."""
    from tandem.tools.make_model import make_model

    built: dict[str, str] = {}

    class Dirs(dict):
        def __missing__(self, arch):
            path = make_model(arch, tmp_path_factory.mktemp(f"model_{arch}"), seed=1,
                              tokenizer_dir=tokenizer_dir, **ARCH_OPTIONS.get(arch, {}))
            self[arch] = str(path)
            return self[arch]

    return Dirs(built)


@pytest.fixture(scope="session")
def oracles(model_dirs):
    """arch -> Oracle (the transformers model, with cached greedy references)."""
    class Oracles(dict):
        def __missing__(self, arch):
            self[arch] = Oracle(model_dirs[arch])
            return self[arch]

    torch.set_num_threads(max(1, torch.get_num_threads()))
    return Oracles()


@pytest.fixture(scope="module")
def structured(tokenizer_dir):
    """The engine side of structured outputs (compiler pool, matchers, masks) on the test
    tokenizer, without a model."""
    import json
    from pathlib import Path

    from tandem.engine.structured_outputs import StructuredOutputs

    config = json.loads((Path(tokenizer_dir) / "config.json").read_text())
    engine_side = StructuredOutputs(str(tokenizer_dir), config["vocab_size"], (config["eos_token_id"],),
                                    compile_timeout=30.0, device=torch.device("cpu"))
    yield engine_side
    engine_side.close()
