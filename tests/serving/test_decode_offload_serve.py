"""Decode offload with real processes: two prefill servers and a decode server with
``--decode-offload`` name one ``--disk-cache-dir``; routers for 1P1D and 2P1D. Concurrent
multi-turn conversations through the routers: every turn equals ``transformers`` on the whole
conversation, and from turn 2 on the prefill servers report store hits written by the decode
server covering the pages the previous turn completed while decoding — gemma3 included: its
decode server receives only the window's pages of a long prompt, and caches and offloads the pages
it completes all the same (kv/managers/sliding_window.py: sparse entries before the window). Then a
decode server is killed while its store writes are in flight: every page file in the store is
complete and verifies, and the next turn (on a restarted decode server) is exact and hits what it
wrote. Servers start once per family.

By default (CI) llama only, a few conversations of 3 turns. ``TANDEM_TEST_MULTITURN_FULL=1`` runs
the issue's scale: 32 concurrent conversations of 4 turns, for llama, gemma3, deepseek_v32 (float32
indexer) and qwen3_next (minutes; run with ``-s`` to see the store hits per turn)."""
import os

os.environ["TANDEM_SANITIZE"] = "1"

import concurrent.futures  # noqa: E402
import random  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

from tandem.kv.tiers import page_io  # noqa: E402
from tests.support.oracle import LOGPROB_TOLERANCE  # noqa: E402
from tests.support.pd import RouterProcess, ServerProcess, serve_flags, start_all, wait_for  # noqa: E402
from tests.pd.test_decode_offload import EXACT  # noqa: E402

MODEL_NAME = "tiny"
ENGINE = dict(page_size=4, max_total_tokens=1024, max_num_seqs=8, max_num_batched_tokens=16)
PD_FLAGS = ["--pd-heartbeat-interval", "0.25", "--pd-peer-timeout", "3", "--pd-drain-timeout", "2"]
TOKENS = 6
PAGE = ENGINE["page_size"]
WRITE_DELAY = 0.3
FULL = os.environ.get("TANDEM_TEST_MULTITURN_FULL") == "1"
FAMILIES = ("llama", "gemma3", "deepseek_v32", "qwen3_next")  # llama first: the kill test shares its servers
# (conversations, turns) per topology
SCALE = {"one": (32, 4), "two": (32, 4)} if FULL else {"one": (3, 3), "two": (4, 3)}


@pytest.fixture(scope="module")
def deployment(request, model_dirs, tmp_path_factory):
    arch = request.param
    if arch != "llama" and not FULL:
        pytest.skip("set TANDEM_TEST_MULTITURN_FULL=1 for the families beside llama")
    logs = tmp_path_factory.mktemp(f"offload_logs_{arch}")
    store = logs / "store"
    options = {**ENGINE, **EXACT.get(arch, {})}

    def server(name, role, *extra, environment=None):
        return ServerProcess(["--model", model_dirs[arch], "--served-model-name", MODEL_NAME, "--role", role,
                              *PD_FLAGS, "--disk-cache-dir", str(store), *extra, *serve_flags(options)],
                             logs / f"{name}.log", environment)

    # llama's store writes wait WRITE_DELAY each on the decode server, so the last test can kill it
    # with writes in flight.
    delay = {"TANDEM_TEST_STORE_WRITE_DELAY": str(WRITE_DELAY)} if arch == "llama" else None
    servers = {"prefill_a": server("prefill_a", "prefill"), "prefill_b": server("prefill_b", "prefill"),
               "decode": server("decode", "decode", "--decode-offload", environment=delay)}
    url = {name: process.base_url for name, process in servers.items()}
    routers = {"one": RouterProcess([url["prefill_a"]], [url["decode"]], logs / "router_one.log",
                                    extra=("--health-interval", "0.5")),
               "two": RouterProcess([url["prefill_a"], url["prefill_b"]], [url["decode"]], logs / "router_two.log",
                                    extra=("--policy", "round-robin", "--prefill-affinity"))}
    try:
        start_all(list(servers.values()))
        for router in routers.values():
            router.start()
        yield arch, servers, routers, store
    finally:
        for process in [*routers.values(), *servers.values()]:
            process.kill()


def complete(router, prompt: list[int], max_tokens: int = TOKENS) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 1}
    response = httpx.post(router.base_url + "/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def assert_exact(choice: dict, reference) -> None:
    assert choice["token_ids"] == reference.token_ids
    for position, (token, logprob) in enumerate(zip(choice["token_ids"], choice["logprobs"]["token_logprobs"])):
        assert abs(logprob - reference.logprobs[position][token].item()) <= LOGPROB_TOLERANCE, position


def decode_hits(*prefills) -> float:
    total = 0.0
    for server in prefills:
        try:
            total += server.metric("store_hit_tokens_total", 'origin="decode"')
        except KeyError:
            pass
    return total


def conversations(router, decode, prefills, oracle, *, count: int, turns: int, seed: int) -> None:
    rng = random.Random(seed)
    history = [[rng.randrange(3, 500) for _ in range(9)] for _ in range(count)]
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        for turn in range(turns):
            before, started = decode_hits(*prefills), time.monotonic()
            choices = list(pool.map(lambda prompt: complete(router, prompt), history))
            wait_for(lambda: decode.metric("offloads_in_flight") == 0, 120, "the offload did not land")
            hits = decode_hits(*prefills) - before
            # the pages the previous turn completed while decoding
            previous = [len(prompt) - TOKENS - 5 for prompt in history] if turn else []
            expected = sum(((length + TOKENS - 1) // PAGE - length // PAGE) * PAGE for length in previous)
            print(f"turn {turn + 1}: {count} conversations, prompts {min(map(len, history))}-"
                  f"{max(map(len, history))} tokens, {time.monotonic() - started:.1f} s, prefill store hits "
                  f"written by the decode server {hits:.0f} tokens (previous turn's decoded pages: {expected} "
                  f"tokens), offloaded pages so far {decode.metric('offloaded_pages_total'):.0f}")
            assert hits >= expected, (turn, hits, expected)
            for number, choice in enumerate(choices):
                assert_exact(choice, oracle.greedy(history[number], TOKENS))
                history[number] = history[number] + choice["token_ids"] + [rng.randrange(3, 500) for _ in range(5)]


@pytest.mark.parametrize("deployment", FAMILIES, indirect=True)
def test_1p1d_turns_hit_what_the_decode_server_offloaded(deployment, oracles):
    arch, servers, routers, _ = deployment
    count, turns = SCALE["one"]
    print(f"\n{arch} 1P1D")
    conversations(routers["one"], servers["decode"], [servers["prefill_a"]], oracles[arch],
                  count=count, turns=turns, seed=1)
    assert servers["decode"].metric("offloaded_pages_total") > 0


@pytest.mark.parametrize("deployment", FAMILIES, indirect=True)
def test_2p1d_turns_hit_on_either_prefill_server(deployment, oracles):
    """Round robin spreads the conversations over both prefill servers; prefill affinity sends
    each later turn to the server that served the conversation's start."""
    arch, servers, routers, _ = deployment
    count, turns = SCALE["two"]
    print(f"\n{arch} 2P1D")
    conversations(routers["two"], servers["decode"], [servers["prefill_a"], servers["prefill_b"]],
                  oracles[arch], count=count, turns=turns, seed=2)
    assert routers["two"].metric("router_prefill_affinity_hits_total") == count * (turns - 1)
    for name in ("prefill_a", "prefill_b"):
        url = servers[name].base_url
        assert routers["two"].metric("router_backend_dispatched", f'role="prefill",url="{url}"') == count // 2 * turns


def verify_page_file(path) -> None:
    """A page file as a reader checks it: header, key, lengths, both checksums."""
    data = path.read_bytes()
    fixed = page_io._FIXED
    magic, version, key_length, _, payload_length, _, payload_crc = fixed.unpack_from(data)
    assert magic == page_io.MAGIC and version == page_io.FORMAT_VERSION, path
    key = data[page_io.HEADER_SIZE:page_io.HEADER_SIZE + key_length]
    (header_crc,) = struct.unpack_from("<I", data, fixed.size)
    assert zlib.crc32(key, zlib.crc32(data[:fixed.size])) == header_crc, path
    assert len(data) == page_io.HEADER_SIZE + key_length + payload_length, path
    assert zlib.crc32(data[page_io.HEADER_SIZE + key_length:]) == payload_crc, path
    assert path.name == key.hex() + ".page"


@pytest.mark.parametrize("deployment", ["llama"], indirect=True)
def test_a_decode_server_killed_mid_offload_leaves_only_whole_pages(deployment, oracles):
    _, servers, routers, store = deployment
    victim, oracle = servers["decode"], oracles["llama"]
    prompt = [random.Random(3).randrange(3, 500) for _ in range(10)]
    # earlier requests' writes land first, so the count below grows by this request's pages only
    wait_for(lambda: victim.metric("offloads_in_flight") == 0, 60, "earlier store writes did not finish")
    written = victim.metric("offloaded_pages_total")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: httpx.post(routers["one"].base_url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 100, "temperature": 0, "ignore_eos": True}))
        # kill once some of this request's pages landed and more are in flight (writes take
        # WRITE_DELAY each: they fall behind the decoding, and land in order). Four pages: the
        # first two may be the prompt's (the prefill server holds those itself, so they are no
        # hits of the decode server's), which leaves two past them
        wait_for(lambda: victim.metric("offloaded_pages_total") >= written + 4
                 and victim.metric("offloads_in_flight") > 0, 60, "no store write landed")
        victim.kill()
        pending.result()  # an error or a cut-off answer: the request died with its server
    pages = list(store.rglob("*.page"))
    assert pages
    for path in pages:
        verify_page_file(path)
    victim.start()
    wait_for(lambda: routers["one"].metric("router_backend_healthy", f'role="decode",url="{victim.base_url}"')
             == 1, 20, "the router did not take the restarted decode server back")
    before = decode_hits(servers["prefill_a"])
    second = prompt + oracle.greedy(prompt, 100).token_ids + [7, 8, 9, 10, 11]
    assert_exact(complete(routers["one"], second), oracle.greedy(second, TOKENS))
    assert decode_hits(servers["prefill_a"]) - before >= 2 * PAGE
