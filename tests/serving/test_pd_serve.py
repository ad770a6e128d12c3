"""PD with real processes on 127.0.0.1: prefill servers, decode servers and routers (NIXL over
UCX, ZMQ control channels), tiny llama. Outputs through the router equal a colocated engine's and
``transformers``'; 1P1D and 2P1D; prompts spanning several prefill chunks; a decode pool small
enough to hold requests back; and the faults: a transfer failure injected at random, a client
that disconnects mid-stream, a prefill server and a decode server killed mid-transfer. Every
affected request ends with an error, unaffected ones stay exact, survivors keep serving, and
every page on every survivor is free once idle. The deployment runs as an operator would run
it: a PD secret file shared by every server, an API key on every server and router. The routers
pass over a server that died and take it back once it answers again (the decode server
restarted). Servers start once for the module."""
import os

os.environ["TANDEM_SANITIZE"] = "1"

import concurrent.futures  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tests.support.oracle import LOGPROB_TOLERANCE  # noqa: E402
from tests.support.pd import RouterProcess, ServerProcess, serve_flags, start_all, wait_for  # noqa: E402

MODEL_NAME = "tiny"
# Prefill chunks of 4 tokens: every prompt here spans several chunks, and a long prompt (~100
# chunks) keeps a transfer going long enough to kill a server in the middle of it.
ENGINE = dict(page_size=4, max_total_tokens=2048, max_num_seqs=8, max_num_batched_tokens=4)
# The decode server's pool: 160 pages of 4 tokens. A request of a ~250-token prompt and 12 new
# tokens needs ~66 pages until it ends, so two fit at once and the others are held back.
DECODE_ENGINE = {**ENGINE, "max_total_tokens": 640}
PD_FLAGS = ["--pd-heartbeat-interval", "0.25", "--pd-peer-timeout", "3", "--pd-drain-timeout", "2",
            "--pd-transfer-timeout", "30", "--pd-bootstrap-timeout", "30"]
FAILURE_PROBABILITY = "0.08"  # each write; about half the requests here make ~9 writes
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived a king who had three "
           "daughters and a very old dog", "1 2 3 4 5 6 7 8"]
CLEANUP_SECONDS = 15.0  # peer_timeout + drain_timeout + slack on a loaded machine
API_KEY = "pd-test-key"
AUTHORIZATION = {"Authorization": f"Bearer {API_KEY}"}
ROUTER_FLAGS = ("--api-key", API_KEY, "--health-interval", "0.5")


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return model_dirs["llama"]


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """Prefill A, B (clean), F (injects transfer failures); decode A (a small pool); routers:
    1P1D, 2P1D, one for the faulty prefill server and one for the prefill server to be killed."""
    logs = tmp_path_factory.mktemp("pd_logs")
    secret_file = logs / "pd_secret"
    secret_file.write_bytes(os.urandom(32).hex().encode())
    secret_file.chmod(0o600)

    def server(name, role, options, model=model_dir, environment=None):
        return ServerProcess(["--model", model, "--served-model-name", MODEL_NAME, "--role", role, *PD_FLAGS,
                              "--pd-secret-file", str(secret_file), "--api-key", API_KEY, *serve_flags(options)],
                             logs / f"{name}.log", environment)

    servers = {
        "prefill_a": server("prefill_a", "prefill", ENGINE),
        "prefill_b": server("prefill_b", "prefill", ENGINE),
        "prefill_f": server("prefill_f", "prefill", ENGINE,
                            environment={"TANDEM_TEST_TRANSFER_FAILURE_PROB": FAILURE_PROBABILITY}),
        "decode_a": server("decode_a", "decode", DECODE_ENGINE),
    }
    url = {name: process.base_url for name, process in servers.items()}
    routers = {
        "one": RouterProcess([url["prefill_a"]], [url["decode_a"]], logs / "router_one.log", extra=ROUTER_FLAGS),
        "two": RouterProcess([url["prefill_a"], url["prefill_b"]], [url["decode_a"]], logs / "router_two.log",
                             extra=("--policy", "round-robin", *ROUTER_FLAGS)),
        "faulty": RouterProcess([url["prefill_f"]], [url["decode_a"]], logs / "router_faulty.log", extra=ROUTER_FLAGS),
        "victim": RouterProcess([url["prefill_b"]], [url["decode_a"]], logs / "router_victim.log", extra=ROUTER_FLAGS),
    }
    try:
        start_all(list(servers.values()))
        for router in routers.values():
            router.start()
        yield servers, routers
    finally:
        for process in [*routers.values(), *servers.values()]:
            process.kill()


@pytest.fixture(scope="module")
def colocated(model_dir):
    return LLM(model=model_dir, **ENGINE)


def client_for(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def expected(colocated, prompt: str, max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return colocated.generate([prompt], params, use_tqdm=False)[0]


def reset_and_count_pages(server) -> int:
    httpx.post(server.base_url + "/reset_prefix_cache", headers=AUTHORIZATION, timeout=10)
    time.sleep(0.1)
    return int(server.metric("kv_pages_used"))


def assert_idle_and_free(*servers) -> None:
    """Every page of every (surviving) server is free once it is idle (prefix caches flushed)."""
    for server in servers:
        wait_for(lambda: reset_and_count_pages(server) == 0, CLEANUP_SECONDS,
                 f"{server.base_url} still holds pages:\n{server.log()[-3000:]}")
        for queue in ("waiting_for_destination", "sending", "draining", "waiting_for_admission", "receiving"):
            try:
                role = "prefill" if "prefill" in server.arguments else "decode"
                value = server.metric("pd_queue_length", f'queue="{queue}",role="{role}"')
            except KeyError:
                continue
            assert value == 0, (server.base_url, queue, value)


def test_1p1d_matches_colocated_and_transformers(cluster, colocated, oracles):
    servers, routers = cluster
    response = client_for(routers["one"]).completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=10,
                                                             logprobs=2, **GREEDY)
    for choice in sorted(response.choices, key=lambda c: c.index):
        reference = expected(colocated, PROMPTS[choice.index], 10)
        token_ids = choice.model_dump()["token_ids"]
        assert token_ids == reference.outputs[0].token_ids, choice.index
        assert choice.text == reference.outputs[0].text
        oracle = oracles["llama"].greedy(reference.prompt_token_ids, 10)
        assert token_ids == oracle.token_ids
        for position, (token_id, logprob) in enumerate(zip(token_ids, choice.logprobs.token_logprobs)):
            assert abs(logprob - oracle.logprobs[position][token_id].item()) <= LOGPROB_TOLERANCE
    assert len(colocated.tokenizer.encode(PROMPTS[1])) > 2 * ENGINE["max_num_batched_tokens"]  # 3+ chunks
    assert response.usage.completion_tokens == 30


def test_streamed_chat_through_the_router(cluster, colocated):
    servers, routers = cluster
    messages = [{"role": "user", "content": "Tell me a story about a dog."}]
    first_events = routers["one"].metric("router_time_to_first_token_seconds_count")
    stream = client_for(routers["one"]).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12,
                                                                stream=True, **GREEDY)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    reference = colocated.chat(messages, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)[0]
    assert text == reference.outputs[0].text
    # the router timed the stream's first event once
    assert routers["one"].metric("router_time_to_first_token_seconds_count") == first_events + 1
    assert routers["one"].metric("router_time_to_first_token_seconds_sum") > 0


def test_structured_outputs_through_the_router(cluster, colocated):
    """The prefill server samples the first token under the grammar, the decode server's matcher
    catches up with it: the answers match their grammar and equal a colocated engine's."""
    import json
    import re

    from tandem.sampling_params import StructuredOutputsParams

    servers, routers = cluster
    client = client_for(routers["one"])
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "w": {"enum": ["alpha", "beta"]}}, "required": ["n", "w"]}
    messages = [{"role": "user", "content": "Answer in JSON."}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=60, temperature=0.0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "a", "schema": schema}})
    reference = colocated.chat(messages, SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=
                                                        StructuredOutputsParams(json=schema)), use_tqdm=False)[0]
    assert chat.choices[0].message.content == reference.outputs[0].text
    assert set(json.loads(chat.choices[0].message.content)) == {"n", "w"} and chat.choices[0].finish_reason == "stop"
    regex = r"[a-e]{2,6}( [0-9]{1,3}){1,3}"
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=60, temperature=0.9,
                                           seed=4, extra_body={"structured_outputs": {"regex": regex}})
    reference = colocated.generate([PROMPTS[0]], SamplingParams(max_tokens=60, temperature=0.9, seed=4,
                                                                structured_outputs=StructuredOutputsParams(
                                                                    regex=regex)), use_tqdm=False)[0]
    assert completion.choices[0].text == reference.outputs[0].text
    assert re.fullmatch(regex, completion.choices[0].text) and completion.choices[0].finish_reason == "stop"


def test_two_prefill_servers_share_the_work(cluster, colocated):
    servers, routers = cluster
    client = client_for(routers["two"])
    prompts = [f"{word} {PROMPTS[1]}" for word in ("Alpha", "Beta", "Gamma", "Delta")]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda p: client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8,
                                                                      **GREEDY), prompts))
    for prompt, response in zip(prompts, responses):
        assert response.choices[0].model_dump()["token_ids"] == expected(colocated, prompt, 8).outputs[0].token_ids
    for name in ("prefill_a", "prefill_b"):
        url = servers[name].base_url
        assert routers["two"].metric("router_backend_dispatched", f'role="prefill",url="{url}"') >= 2


def test_a_full_decode_pool_holds_requests_back(cluster, colocated):
    servers, routers = cluster
    held_before = servers["decode_a"].metric("pd_requests_held_back_total")
    client = client_for(routers["two"])
    prompts = [f"{index} " + " ".join([PROMPTS[1]] * 4) for index in range(4)]
    assert 220 <= len(colocated.tokenizer.encode(prompts[0])) <= 300
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda p: client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=12,
                                                                      **GREEDY), prompts))
    for prompt, response in zip(prompts, responses):
        assert response.choices[0].model_dump()["token_ids"] == expected(colocated, prompt, 12).outputs[0].token_ids
    assert servers["decode_a"].metric("pd_requests_held_back_total") > held_before
    assert_idle_and_free(servers["decode_a"], servers["prefill_a"], servers["prefill_b"])


JSON = {"Content-Type": "application/json"}
# (what the client sends, its headers, the param the 400 names, words of the message): each refused
# by the router itself, before any server sees it
ROUTER_REFUSES = [
    (b'{"prompt": "hi", "max_tokens": ', JSON, "body", ["malformed JSON"]),
    (b'[1, 2]', JSON, "body", ["body: must be a JSON object"]),
    (b'{"prompt": "\xff"}', JSON, "body", ["UTF-8"]),
    (b'{"prompt": "hi"}', {"Content-Type": "text/plain"}, "body", ["Content-Type: application/json", "text/plain"]),
    (b'{"model": "no-such-model", "prompt": "hi"}', JSON, "model", ["no-such-model"]),
    (b'{"prompt": "hi", "temperature": -1}', JSON, "temperature", [">= 0"]),
    (b'{"prompt": [], "max_tokens": 2}', JSON, "prompt", ["must not be empty"]),
    (b'{"prompt": "hi", "n": 2}', JSON, "n", ["n=1"]),
    (b'{"prompt": "hi", "echo": true, "logprobs": 1}', JSON, "echo", ["prompt logprobs"]),
]


def router_outcomes(router) -> dict[str, float]:
    return {outcome: router.metric("router_requests_total", f'outcome="{outcome}"')
            for outcome in ("client_error", "prefill_failed", "decode_failed", "error")}


def test_router_answers_client_errors_once(cluster):
    """Bad requests get the servers' 400 naming the field, once: the router's own checks refuse
    what it can check before any server sees it; what needs the model (a prompt past the context,
    a token id outside the vocabulary) reaches the servers, and their 400 comes back as it was.
    Each counts as outcome="client_error" (never a leg failure) and is logged at info, not as a
    warning; the router keeps routing, with X-Request-Id on every answer."""
    servers, routers = cluster
    router, decode = routers["one"], servers["decode_a"]

    def dispatched() -> float:
        return router.metric("router_backend_dispatched", f'role="decode",url="{decode.base_url}"')

    before, sent = router_outcomes(router), dispatched()
    for number, (content, headers, param, words) in enumerate(ROUTER_REFUSES):
        response = httpx.post(router.base_url + "/v1/completions", content=content, timeout=30,
                              headers={**AUTHORIZATION, **headers, "X-Request-Id": f"bad-{number}"})
        assert response.status_code in (400, 404), response.text
        error = response.json()["error"]
        assert error["param"] == param and all(word in error["message"] for word in words), (content, error)
        assert response.headers["x-request-id"] == f"bad-{number}"
    assert dispatched() == sent, "a request the router can check reached a server"
    # The servers' words for the same bodies (a body that is not an object, a schema bound).
    for content in (b'[1, 2]', b'{"prompt": "hi", "temperature": -1}'):
        server_answer = httpx.post(servers["prefill_a"].base_url + "/v1/completions", content=content, timeout=30,
                                   headers={**AUTHORIZATION, **JSON}).json()["error"]
        router_answer = httpx.post(router.base_url + "/v1/completions", content=content, timeout=30,
                                   headers={**AUTHORIZATION, **JSON}).json()["error"]
        assert router_answer == server_answer
    passed_through = [({"prompt": "hi " * 5000, "max_tokens": 4}, "prompt"),  # past max_model_len (4096)
                      ({"prompt": [1, 2, 10 ** 6], "max_tokens": 2}, "prompt")]  # outside the vocabulary
    for number, (fields, param) in enumerate(passed_through):
        response = httpx.post(router.base_url + "/v1/completions", json={"model": MODEL_NAME, **fields}, timeout=30,
                              headers={**AUTHORIZATION, "X-Request-Id": f"server-bad-{number}"})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    after = router_outcomes(router)
    refused = len(ROUTER_REFUSES) + 2 + len(passed_through)
    assert after == {**before, "client_error": before["client_error"] + refused}, (before, after)
    log = router.log()
    assert "request bad-7 refused" in log and "request server-bad-0 refused by the" in log
    assert not [line for line in log.splitlines() if "WARNING" in line and "bad-" in line]
    answer = client_for(router).completions.with_raw_response.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=2, **GREEDY, extra_headers={"X-Request-Id": "client-7"})
    assert answer.headers["x-request-id"] == "client-7"
    assert len(answer.parse().choices[0].model_dump()["token_ids"]) == 2
    assert_idle_and_free(decode, servers["prefill_a"])
    assert_series_documented(router, decode, servers["prefill_a"])


def assert_series_documented(*processes) -> None:
    """Every series a router or a PD server exposes is in the metrics reference; no ``_created``."""
    from tests.support.docs_blocks import ROOT

    reference = (ROOT / "docs" / "metrics.md").read_text()
    for process in processes:
        text = httpx.get(process.base_url + "/metrics", headers=AUTHORIZATION, timeout=10).text
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("tandem:")}
        assert names and not [name for name in names if name.endswith("_created")], process.base_url
        assert not [name for name in names if f"`{name}`" not in reference], (process.base_url, names)


def test_client_disconnect_mid_stream(cluster):
    servers, routers = cluster
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", routers["one"].base_url + "/v1/completions", json=body, headers=AUTHORIZATION,
                      timeout=60) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(3)]
    assert any(line.startswith("data: {") for line in received)
    assert_idle_and_free(servers["decode_a"], servers["prefill_a"])
    assert routers["one"].metric("router_requests_total", 'outcome="disconnected"') >= 1


def test_random_transfer_failures_end_both_legs(cluster, colocated):
    """Prefill server F fails each write with probability 0.08 (seeded): every request either
    matches the colocated output or ends with a clear error; both kinds occur; nothing leaks."""
    servers, routers = cluster
    client = client_for(routers["faulty"])
    outcomes = {"exact": 0, "failed": 0}
    for index in range(10):
        prompt = f"{index} {PROMPTS[1]}"
        try:
            response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, **GREEDY,
                                                 extra_headers={"X-Request-Id": f"faulty-{index}"})
        except openai.APIStatusError as error:
            assert "injected transfer failure" in str(error), error
            assert error.response.headers["x-request-id"] == f"faulty-{index}"
            # the router logs the request's id with its room, which the prefill server's log names
            line = next(line for line in routers["faulty"].log().splitlines()
                        if f"request faulty-{index} failed on the " in line)
            room = line.split("(room ", 1)[1].split(",", 1)[0]
            assert f"room {room}" in servers["prefill_f"].log(), line
            outcomes["failed"] += 1
            continue
        assert response.choices[0].model_dump()["token_ids"] == expected(colocated, prompt, 6).outputs[0].token_ids
        outcomes["exact"] += 1
    assert outcomes["exact"] and outcomes["failed"], outcomes
    assert servers["prefill_f"].metric("pd_transfers_total", 'outcome="failed",role="prefill"') >= 1
    assert_idle_and_free(servers["decode_a"], servers["prefill_f"])


def test_transfer_metrics(cluster):
    servers, routers = cluster
    prefill, decode = servers["prefill_a"], servers["decode_a"]
    # transfers of its own through the 1P1D pair (the test also runs alone)
    response = client_for(routers["one"]).completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=2, **GREEDY)
    assert len(response.choices) == len(PROMPTS) >= 3
    assert prefill.metric("pd_transfers_total", 'outcome="done",role="prefill"') >= 3
    assert decode.metric("pd_transfers_total", 'outcome="done",role="decode"') >= 3
    assert prefill.metric("pd_transfer_bytes_total") > 0
    assert prefill.metric("pd_transfer_bandwidth_bytes_per_second_count") >= 3
    assert decode.metric("pd_transfer_duration_seconds_count") >= 3
    # every done transfer's phases are counted on each side
    for role, phases in (("prefill", ("compute", "destination_wait", "last_write")),
                         ("decode", ("admission_wait", "receive"))):
        server = prefill if role == "prefill" else decode
        done = server.metric("pd_transfers_total", f'outcome="done",role="{role}"')
        for phase in phases:
            assert server.metric("pd_phase_seconds_count", f'phase="{phase}",role="{role}"') == done, (role, phase)
    assert prefill.metric("pd_phase_seconds_sum", 'phase="compute",role="prefill"') > 0
    assert decode.metric("pd_phase_seconds_sum", 'phase="receive",role="decode"') > 0
    assert routers["one"].metric("router_requests_total", 'outcome="ok"') >= 1
    assert httpx.get(routers["one"].base_url + "/v1/models").status_code == 401  # the router wants its key too


def stream_in_background(router, prompt: str, max_tokens: int) -> concurrent.futures.Future:
    def run():
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", router.base_url + "/v1/completions", json=body, headers=AUTHORIZATION,
                          timeout=120) as response:
            lines = [line for line in response.iter_lines() if line]
        return response.status_code, lines, time.monotonic()  # (when it ended)
    return concurrent.futures.ThreadPoolExecutor(1).submit(run)


def long_prompt(tag: str) -> str:
    return f"{tag} " + " ".join(f"word{index}" for index in range(80))  # ~420 tokens: ~50 chunks


def wait_until_sending(prefill, request: concurrent.futures.Future) -> None:
    """Until ``prefill`` is sending pages (the decode side's destination arrived). The deadline is
    generous: on a loaded 2-core machine the servers' processes share the cores with the other
    test worker. Fails at once, with the request's outcome, if the request ended first."""
    deadline = time.monotonic() + 90
    while prefill.metric("pd_queue_length", 'queue="sending",role="prefill"') < 1:
        assert not request.done(), f"the request ended before the prefill server sent anything: {request.result()}"
        assert time.monotonic() < deadline, "the prefill server never started sending"
        time.sleep(0.01)


def test_prefill_killed_mid_transfer(cluster, colocated):
    servers, routers = cluster
    victim = servers["prefill_b"]
    future = stream_in_background(routers["victim"], long_prompt("killed prefill"), 20)
    wait_until_sending(victim, future)
    victim.process.send_signal(signal.SIGKILL)  # the frontend; its engine follows (parent-death signal)
    killed = time.monotonic()
    status, lines, ended = future.result(timeout=120)
    errors = [line for line in lines if '"error"' in line]
    assert errors and ended - killed < 30, lines
    assert_idle_and_free(servers["decode_a"])
    # The decode server keeps serving, exactly.
    response = client_for(routers["one"]).completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5,
                                                             **GREEDY)
    assert response.choices[0].model_dump()["token_ids"] == expected(colocated, PROMPTS[0], 5).outputs[0].token_ids
    victim.kill()


def router_sees(router, server, healthy: bool) -> None:
    wait_for(lambda: router.metric("router_backend_healthy", f'role="{role_of(server)}",url="{server.base_url}"')
             == float(healthy), 10, f"the router never saw {server.base_url} as {'healthy' if healthy else 'dead'}")


def role_of(server) -> str:
    return server.arguments[server.arguments.index("--role") + 1]


def test_router_passes_over_a_dead_prefill_server(cluster, colocated):
    """Prefill B is dead (killed above): router "two" routes everything to prefill A, exactly (a
    request that still tries B is sent again, to A) and stays healthy. (Taking a restarted prefill
    server back, at its new control address, is part of tests/support/soak.py, which CI runs.)"""
    servers, routers = cluster
    router, victim = routers["two"], servers["prefill_b"]
    client = client_for(router)
    for index in range(3):
        prompt = f"{index} {PROMPTS[0]}"
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, **GREEDY)
        assert response.choices[0].model_dump()["token_ids"] == expected(colocated, prompt, 4).outputs[0].token_ids
    router_sees(router, victim, healthy=False)
    assert httpx.get(router.base_url + "/health").json()["status"] == "ok"  # prefill A still serves


def test_decode_killed_mid_transfer(cluster, colocated):
    servers, routers = cluster
    victim, prefill = servers["decode_a"], servers["prefill_a"]
    future = stream_in_background(routers["one"], long_prompt("killed decode"), 20)
    wait_until_sending(prefill, future)
    victim.process.send_signal(signal.SIGKILL)
    status, lines, _ = future.result(timeout=120)
    assert status != 200 or any('"error"' in line for line in lines), lines
    assert_idle_and_free(prefill, servers["prefill_f"])
    # The prefill server keeps serving (a colocated request, as no decode server is left).
    response = httpx.post(prefill.base_url + "/v1/completions", headers=AUTHORIZATION, timeout=60, json={
        "model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert response.json()["choices"][0]["token_ids"] == expected(colocated, PROMPTS[0], 5).outputs[0].token_ids
    victim.kill()


def test_router_survives_a_decode_server_restart(cluster, colocated):
    """The decode server is dead (killed above): the router answers 503 with Retry-After naming
    the dead server; once it is restarted, the router routes to it again, exactly."""
    servers, routers = cluster
    router, victim = routers["one"], servers["decode_a"]
    router_sees(router, victim, healthy=False)
    response = httpx.post(router.base_url + "/v1/completions", headers=AUTHORIZATION, timeout=30,
                          json={"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 4})
    assert response.status_code == 503 and response.headers["retry-after"], response.text
    assert "no healthy decode server" in response.json()["error"]["message"]
    assert httpx.get(router.base_url + "/health").status_code == 503

    victim.start()
    router_sees(router, victim, healthy=True)
    response = client_for(router).completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=6, **GREEDY)
    assert response.choices[0].model_dump()["token_ids"] == expected(colocated, PROMPTS[2], 6).outputs[0].token_ids
    assert_idle_and_free(victim, servers["prefill_a"])
    victim.kill()
