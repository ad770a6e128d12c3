"""PD with real processes for every landed architecture but llama (test_pd_serve.py): dense
(qwen2, qwen3), sliding window (gemma3), MLA (deepseek_v3), MLA with the sparse-attention
indexer's FP8 page-major cache (deepseek_v32, glm_moe_dsa) and recurrent hybrids whose page table
holds a checkpoint slot besides the working slot (qwen3_next, nemotron_h). Through a router,
greedy outputs equal a colocated engine's (and ``transformers``' where the cache is exact); every
page is free afterwards. Handshake mismatches (page size, model) fail when the servers connect,
naming the difference. Servers start in batches of three pairs to bound memory."""
import os

os.environ["TANDEM_SANITIZE"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tests.support.servers import REPOSITORY_ROOT  # noqa: E402
from tests.support.pd import RouterProcess, ServerProcess, serve_flags, start_all, wait_for  # noqa: E402

BATCHES = (("qwen2", "qwen3", "deepseek_v3"), ("nemotron_h", "glm_moe_dsa"), ("gemma3", "deepseek_v32", "qwen3_next"))
ARCHS = tuple(arch for batch in BATCHES for arch in batch)
ENGINE = dict(page_size=4, max_total_tokens=1024, max_num_seqs=4, max_num_batched_tokens=8)
ARCH_ENGINE = {"gemma3": {"page_size": 8}}  # a page size of its own: the mismatch test pairs it wrongly
FP8_INDEXER = ("deepseek_v32", "glm_moe_dsa")  # not bit-comparable with transformers (see test_pd_engine)
PD_FLAGS = ["--pd-heartbeat-interval", "0.25", "--pd-peer-timeout", "5", "--pd-connect-timeout", "10"]
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived a king"]  # 4 and ~50 tokens
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})


def engine_options(arch: str) -> dict:
    return {**ENGINE, **ARCH_ENGINE.get(arch, {})}


class Batches:
    """Runs one batch of prefill/decode pairs (and a router per pair) at a time."""

    def __init__(self, model_dirs, logs):
        self.model_dirs = model_dirs
        self.logs = logs
        self.current = None
        self.servers, self.routers = {}, {}

    def running(self, arch: str):
        batch = next(batch for batch in BATCHES if arch in batch)
        if batch != self.current:
            self.stop()
            self.start(batch)
        return self.servers, self.routers

    def start(self, batch) -> None:
        for arch in batch:
            for role in ("prefill", "decode"):
                self.servers[arch, role] = ServerProcess(
                    ["--model", self.model_dirs[arch], "--served-model-name", arch, "--role", role, *PD_FLAGS,
                     *serve_flags(engine_options(arch))], self.logs / f"{arch}_{role}.log")
        self.routers = {arch: RouterProcess([self.servers[arch, "prefill"].base_url],
                                            [self.servers[arch, "decode"].base_url], self.logs / f"router_{arch}.log")
                        for arch in batch}
        self.current = batch
        start_all(list(self.servers.values()))
        for router in self.routers.values():
            router.start()

    def stop(self) -> None:
        for process in [*self.routers.values(), *self.servers.values()]:
            process.kill()
        self.servers, self.routers, self.current = {}, {}, None


@pytest.fixture(scope="module")
def batches(model_dirs, tmp_path_factory):
    manager = Batches(model_dirs, tmp_path_factory.mktemp("pd_arch_logs"))
    yield manager
    manager.stop()


def pages_in_use(server) -> int:
    httpx.post(server.base_url + "/reset_prefix_cache", timeout=10)
    time.sleep(0.1)
    return int(server.metric("kv_pages_used"))


@pytest.mark.parametrize("arch", ARCHS)
def test_router_matches_colocated_and_transformers(arch, batches, model_dirs, oracles):
    servers, routers = batches.running(arch)
    client = openai.OpenAI(base_url=routers[arch].base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    response = client.completions.create(model=arch, prompt=PROMPTS, max_tokens=8, logprobs=2, **GREEDY)
    colocated = LLM(model=model_dirs[arch], **engine_options(arch))
    expected = colocated.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                  use_tqdm=False)
    assert len(expected[1].prompt_token_ids) > 4 * ENGINE["max_num_batched_tokens"]  # several prefill chunks
    for choice in response.choices:
        token_ids = choice.model_dump()["token_ids"]
        reference = expected[choice.index]
        assert token_ids == reference.outputs[0].token_ids, (arch, choice.index)
        if arch not in FP8_INDEXER:
            assert token_ids == oracles[arch].greedy(reference.prompt_token_ids, 8).token_ids
    for role in ("prefill", "decode"):
        server = servers[arch, role]
        wait_for(lambda: pages_in_use(server) == 0, 15, f"{arch} {role} server still holds pages")


def test_handshake_mismatch_fails_at_connect_time(batches):
    """The router refuses servers whose state layouts differ (a different page size, a different
    model), naming the first difference; a decode engine sent to a mismatched prefill engine fails
    the request the same way at connect time, and keeps nothing."""
    servers, routers = batches.running("qwen3_next")
    cases = ((("qwen3_next", "prefill"), ("gemma3", "decode"), "page_size: prefill"),
             (("qwen3_next", "prefill"), ("deepseek_v32", "decode"), "architecture: prefill"))
    for prefill, decode, difference in cases:
        result = subprocess.run(
            [sys.executable, "-m", "tandem.entrypoints.cli", "router", "--port", "0",
             "--prefill", servers[prefill].base_url, "--decode", servers[decode].base_url, "--startup-timeout", "30"],
            cwd=REPOSITORY_ROOT, capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPOSITORY_ROOT)})
        assert result.returncode == 2, result.stdout + result.stderr
        assert "PD handshake failed: " + difference in result.stdout, result.stdout
    bootstrap = httpx.get(servers["deepseek_v32", "prefill"].base_url + "/pd/info").json()["bootstrap_address"]
    decode = servers["qwen3_next", "decode"]
    response = httpx.post(decode.base_url + "/v1/completions", timeout=60, json={
        "model": "qwen3_next", "prompt": PROMPTS[0], "max_tokens": 4,
        "kv_transfer_params": {"room": "cd" * 16, "role": "decode", "prefill_address": bootstrap}})
    assert response.status_code == 500, response.text
    message = response.json()["error"]["message"]
    assert "PD handshake failed: architecture: the prefill server has 'DeepseekV32ForCausalLM'" in message, message
    assert pages_in_use(decode) == 0
