"""Bad input and faults against a live server (fake engine: fast, deterministic).

Every case must give an OpenAI-style error body with the right status and field, and the server
must keep serving afterwards with every page free once idle.
"""
import os

os.environ["TANDEM_SANITIZE"] = "1"

import asyncio  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402

from tests.support.servers import FAKE_CORE_CLASS, ServerProcess, make_fake_model_dir  # noqa: E402

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 128
MAX_TOTAL_TOKENS = 112  # the fake engine's pool: smaller than MAX_MODEL_LEN, so the engine rejects some
MAX_NUM_SEQS = 2
STEP_DELAY = 0.03  # seconds per fake engine step: an 80-token request takes about 2.4 s
LONG = 80  # max_tokens of the requests that are still running when the tests disconnect


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer_dir):
    model_dir = make_fake_model_dir(tmp_path_factory.mktemp("fake_model"), tokenizer_dir, step_delay=STEP_DELAY)
    process = ServerProcess(["--model", str(model_dir), "--served-model-name", "fake", "--api-key", API_KEY,
                             "--max-model-len", str(MAX_MODEL_LEN), "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--max-num-seqs", str(MAX_NUM_SEQS),
                             "--max-queued-requests", "0", "--engine-core-class", FAKE_CORE_CLASS,
                             "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                            tmp_path_factory.mktemp("logs") / "server.log")
    process.start()
    yield process
    assert process.stop() == 0


def chat(content="hi", **fields):
    return {"model": "fake", "messages": [{"role": "user", "content": content}], **fields}


def completion(prompt="hello", **fields):
    return {"model": "fake", "prompt": prompt, **fields}


# (name, path, JSON body or raw bytes, headers, status, param, words the message must contain)
CASES = [
    ("negative max_tokens", "/v1/completions", completion(max_tokens=-1), AUTH, 400, "max_tokens", ["max_tokens"]),
    ("zero max_tokens", "/v1/completions", completion(max_tokens=0), AUTH, 400, "max_tokens", []),
    ("fractional max_tokens", "/v1/completions", completion(max_tokens=1.5), AUTH, 400, "max_tokens", []),
    ("string max_tokens", "/v1/chat/completions", chat(max_tokens="ten"), AUTH, 400, "max_tokens", []),
    ("negative temperature", "/v1/completions", completion(temperature=-0.5), AUTH, 400, "temperature", [">= 0"]),
    ("top_p zero", "/v1/completions", completion(top_p=0), AUTH, 400, "top_p", ["(0, 1]"]),
    ("top_p above one", "/v1/chat/completions", chat(top_p=1.5), AUTH, 400, "top_p", []),
    ("n zero", "/v1/completions", completion(n=0), AUTH, 400, "n", []),
    ("n negative", "/v1/chat/completions", chat(n=-2), AUTH, 400, "n", []),
    ("too many logprobs", "/v1/completions", completion(logprobs=50), AUTH, 400, "logprobs", []),
    ("presence penalty out of range", "/v1/completions", completion(presence_penalty=3), AUTH, 400,
     "presence_penalty", []),
    ("empty stop string", "/v1/completions", completion(stop=[""]), AUTH, 400, "stop", []),
    ("unknown role", "/v1/chat/completions",
     {"model": "fake", "messages": [{"role": "wizard", "content": "hi"}]}, AUTH, 400, "messages[0].role", []),
    ("no messages", "/v1/chat/completions", {"model": "fake", "messages": []}, AUTH, 400, "messages", []),
    ("overlong X-Request-Id", "/v1/completions", completion(max_tokens=2), {**AUTH, "X-Request-Id": "r" * 129}, 400,
     "X-Request-Id", ["X-Request-Id", "128"]),
    ("X-Request-Id with a space", "/v1/chat/completions", chat(max_tokens=2), {**AUTH, "X-Request-Id": "a b"}, 400,
     "X-Request-Id", ["visible ASCII"]),
    ("top_logprobs without logprobs", "/v1/chat/completions", chat(top_logprobs=2), AUTH, 400, "top_logprobs", []),
    ("malformed JSON", "/v1/completions", b'{"prompt": "hi", "max_tokens": ', AUTH, 400, "body", ["JSON"]),
    ("missing prompt", "/v1/completions", {"model": "fake"}, AUTH, 400, "prompt", []),
    ("empty prompt", "/v1/completions", completion(prompt=""), AUTH, 400, "prompt", ["empty"]),
    ("prompt id outside vocabulary", "/v1/completions", completion(prompt=[1, 2, 99999]), AUTH, 400, "prompt",
     ["99999", "512"]),
    ("negative prompt id", "/v1/completions", completion(prompt=[[3, -1]]), AUTH, 400, "prompt", []),
    ("prompt plus max_tokens too long", "/v1/completions", completion(prompt=[5] * 40, max_tokens=100), AUTH, 400,
     "max_tokens", [str(MAX_MODEL_LEN), "140"]),
    ("prompt alone too long", "/v1/completions", completion(prompt=[5] * 200), AUTH, 400, "prompt",
     [str(MAX_MODEL_LEN), "200"]),
    ("chat too long", "/v1/chat/completions", chat("hello " * 20, max_tokens=120), AUTH, 400, "max_tokens",
     [str(MAX_MODEL_LEN)]),
    ("request larger than the KV pool (engine rejects)", "/v1/completions", completion(prompt=[5] * 20, max_tokens=100),
     AUTH, 400, "max_tokens", ["never fit"]),
    ("best_of above n", "/v1/completions", completion(best_of=3), AUTH, 400, "best_of", []),
    ("unknown model", "/v1/completions", completion(model="gpt-4"), AUTH, 404, "model", ["gpt-4"]),
    ("unknown model in chat", "/v1/chat/completions", chat(model="nope"), AUTH, 404, "model", []),
    ("missing API key", "/v1/completions", completion(), {}, 401, None, ["API key"]),
    ("wrong API key", "/v1/chat/completions", chat(), {"Authorization": "Bearer wrong"}, 401, None, []),
    ("models without API key", "/v1/models", None, {}, 401, None, []),
    ("empty prompt list", "/v1/completions", completion(prompt=[]), AUTH, 400, "prompt", ["prompt: must not be empty"]),
    ("empty token list in a batch", "/v1/completions", completion(prompt=[[]]), AUTH, 400, "prompt",
     ["prompt[0]: must not be empty"]),
    ("body not an object", "/v1/completions", b"[1, 2]", AUTH, 400, "body", ["body: must be a JSON object"]),
    ("body not UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', AUTH, 400, "body", ["UTF-8", "0xff"]),
    ("detokenize outside vocabulary", "/detokenize", {"tokens": [1, 100000]}, AUTH, 400, "tokens", []),
    ("tokenize nothing", "/tokenize", {}, AUTH, 400, "prompt", []),
]


@pytest.mark.parametrize("name, path, body, headers, status, param, words", CASES, ids=[case[0] for case in CASES])
def test_bad_input(server, name, path, body, headers, status, param, words):
    if body is None:
        response = httpx.get(server.base_url + path, headers=headers, timeout=30)
    elif isinstance(body, bytes):
        response = httpx.post(server.base_url + path, content=body,
                              headers={**headers, "Content-Type": "application/json"}, timeout=30)
    else:
        response = httpx.post(server.base_url + path, json=body, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] and error["message"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_json_without_its_content_type_is_named(server, content_type):
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    response = httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}',
                          headers=headers, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "body" and "Content-Type: application/json" in error["message"], error
    assert (repr(content_type) if content_type else "got none") in error["message"], error


def test_prompt_longer_than_the_tokenizer_limit_is_our_error_not_a_warning(server):
    """The checkpoint's tokenizer says 4096 tokens; a longer prompt gets the server's own 400
    naming the context length, and transformers' "Token indices sequence length" warning stays
    out of the log."""
    response = httpx.post(server.base_url + "/v1/completions", json=completion("hello " * 5000, max_tokens=1),
                          headers=AUTH, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert str(MAX_MODEL_LEN) in response.json()["error"]["message"]
    assert "Token indices" not in server.log()


def test_request_id_is_echoed(server):
    """X-Request-Id comes back as given (errors too); without one the server makes one per request."""
    given = {**AUTH, "X-Request-Id": "trace-42:a/b"}
    ok = httpx.post(server.base_url + "/v1/completions", json=completion(max_tokens=2), headers=given, timeout=30)
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "trace-42:a/b"
    with httpx.stream("POST", server.base_url + "/v1/completions", json=completion(max_tokens=2, stream=True),
                      headers=given, timeout=30) as streamed:
        assert streamed.headers["x-request-id"] == "trace-42:a/b"
        assert any(line.startswith("data: {") for line in streamed.iter_lines())
    failed = httpx.post(server.base_url + "/v1/completions", json=completion(max_tokens=-1), headers=given, timeout=30)
    assert failed.status_code == 400 and failed.headers["x-request-id"] == "trace-42:a/b"
    made = [httpx.post(server.base_url + "/v1/completions", json=completion(max_tokens=1), headers=AUTH,
                       timeout=30).headers["x-request-id"] for _ in range(2)]
    assert made[0] != made[1] and all(made)


def test_openai_client_sees_field_errors(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="fake", prompt="hi", temperature=-1)
    assert raised.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="bad", max_retries=0).models.list()


def test_engine_failure_is_a_500_and_the_server_keeps_serving(server):
    failing_prompt = [511, 5, 6]  # the fake engine fails requests whose prompt starts with vocab - 1
    response = httpx.post(server.base_url + "/v1/completions", json=completion(failing_prompt), headers=AUTH,
                          timeout=30)
    assert response.status_code == 500 and "fake engine failure" in response.json()["error"]["message"]
    streamed = httpx.post(server.base_url + "/v1/completions", json=completion(failing_prompt, stream=True),
                          headers=AUTH, timeout=30)
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert "fake engine failure" in events[-2] and events[-1] == "data: [DONE]"
    assert httpx.get(server.base_url + "/health").status_code == 200
    ok = httpx.post(server.base_url + "/v1/completions", json=completion(max_tokens=3), headers=AUTH, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


async def read_some_chunks(client: httpx.AsyncClient, body: dict, count: int, started: asyncio.Event):
    """Stream a request, read ``count`` events, then drop the connection."""
    async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= count:
                started.set()
                await asyncio.sleep(1.0)  # hold the connection while the test checks the queue limit
                return


def test_queue_limit_gives_503_then_disconnects_free_pages(server):
    aborts_before = server.metric("requests_total", 'outcome="abort"')

    async def scenario():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            events = [asyncio.Event() for _ in range(MAX_NUM_SEQS)]
            holders = [asyncio.create_task(read_some_chunks(client, completion(max_tokens=LONG, stream=True), 2, event))
                       for event in events]
            await asyncio.gather(*(event.wait() for event in events))
            overflow = await client.post("/v1/completions", json=completion(max_tokens=5), headers=AUTH)
            await asyncio.gather(*holders)
            return overflow

    overflow = asyncio.run(scenario())
    assert overflow.status_code == 503, overflow.text
    assert overflow.headers["retry-after"] == "1"
    assert overflow.json()["error"]["type"] == "service_unavailable_error"
    assert server.wait_for_metric("kv_pages_used", 0, timeout=1.0) == 0
    assert server.metric("requests_total", 'outcome="abort"') == aborts_before + MAX_NUM_SEQS
    assert server.metric("requests_total", 'outcome="rejected"') >= 1


def test_streaming_disconnect_aborts_at_once(server):
    aborts_before = server.metric("requests_total", 'outcome="abort"')
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json=chat(max_tokens=LONG, stream=True),
                           headers=AUTH) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert sum(next(lines).startswith("data: ") for _ in range(6)) >= 2
            assert server.metric("kv_pages_used") > 0
        disconnected = time.monotonic()
    assert server.wait_for_metric("kv_pages_used", 0, timeout=1.0) == 0
    assert time.monotonic() - disconnected < 1.0, "pages must be freed well before the request would end"
    assert server.metric("requests_total", 'outcome="abort"') == aborts_before + 1


def test_non_streaming_disconnect_aborts_at_once(server):
    aborts_before = server.metric("requests_total", 'outcome="abort"')
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=completion(max_tokens=LONG, n=2), headers=AUTH,
                   timeout=httpx.Timeout(30, read=0.5))
    assert server.wait_for_metric("requests_total", aborts_before + 1, timeout=1.0,
                                  labels='outcome="abort"') == aborts_before + 1
    assert server.wait_for_metric("kv_pages_used", 0, timeout=1.0) == 0


def test_server_healthy_and_idle_after_everything(server):
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=chat(max_tokens=4), headers=AUTH, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert server.wait_for_metric("kv_pages_used", 0) == 0
    assert server.metric("num_requests_running") == 0
    assert server.metric("kv_pages_total") > 0


def test_documented_requests_run_against_a_live_server(server):
    """Every curl body of the README and the docs, and the README's OpenAI-client example, run
    against a live server (its model name and API key swapped in): the documented requests are
    requests this server answers with 200."""
    from tests.support.docs_blocks import ROOT, blocks, curl_calls

    for call in curl_calls():
        if call.body is None:
            continue
        body = {**call.body, "model": "fake"}
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 8  # "the rest of the context" does not fit this server's tiny pool
        response = httpx.post(server.base_url + call.path, json=body, headers=AUTH, timeout=60)
        assert response.status_code == 200, (call.source.name, call.body, response.text)
    (readme_client,) = [text for path, text in blocks("python")
                        if path == ROOT / "README.md" and "OpenAI(base_url=" in text]
    code = (readme_client.replace('"http://localhost:8000/v1"', repr(server.base_url + "/v1"))
            .replace('api_key="unused"', f'api_key="{API_KEY}"').replace('model="demo"', 'model="fake"'))
    assert code != readme_client
    exec(compile(code, "README.md", "exec"), {})


def test_every_series_the_server_exposes_is_documented(server):
    """Each series on a live server's /metrics is in the metrics reference; no ``_created`` series."""
    from tests.support.docs_blocks import ROOT

    reference = (ROOT / "docs" / "metrics.md").read_text()
    names = {line.split("{")[0].split(" ")[0] for line in httpx.get(server.base_url + "/metrics").text.splitlines()
             if line.startswith("tandem:")}
    assert len(names) >= 15
    assert not [name for name in names if name.endswith("_created")]
    assert not [name for name in names if f"`{name}`" not in reference]
