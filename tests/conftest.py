"""Shared test setup: the sanitizer is on in every test (DESIGN.md I5, I6), tiny models are
built once per session with ``transformers``' own classes, and ``transformers`` is the oracle."""
from __future__ import annotations

import os

os.environ["TANDEM_SANITIZE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.oracle import Oracle  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")

# Per-architecture variations so each family's options are exercised:
# llama with Llama-3.1 rope scaling, qwen2 with tied embeddings (and qkv bias), qwen3 with q/k norm.
ARCH_OPTIONS = {
    "llama": dict(rope_scaling="llama3", max_position_embeddings=4096),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(),
}


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
