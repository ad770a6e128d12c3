"""End to end: the official ``openai`` client against a live ``tandem serve`` (real engine, tiny
llama). Outputs must equal the offline ``LLM`` and ``transformers`` greedy on the same model."""
import os

os.environ["TANDEM_SANITIZE"] = "1"

import asyncio  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tests.support.oracle import LOGPROB_TOLERANCE  # noqa: E402
from tests.support.servers import ServerProcess  # noqa: E402

MODEL_NAME = "tiny"
ENGINE_OPTIONS = dict(page_size=16, max_total_tokens=16384, max_num_seqs=64, max_num_batched_tokens=1024)
PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time, in a land far away,", "1 2 3 4"]
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})


def engine_flags() -> list[str]:
    return [f"--{name.replace('_', '-')}={value}" for name, value in ENGINE_OPTIONS.items()]


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return model_dirs["llama"]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    process = ServerProcess(["--model", model_dir, "--served-model-name", MODEL_NAME, *engine_flags()],
                            tmp_path_factory.mktemp("logs") / "server.log")
    process.start()
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model=model_dir, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def offline_generate(offline, prompts, **params):
    return offline.generate(prompts, SamplingParams(**params), use_tqdm=False)


def test_completions_match_offline_and_transformers(client, offline, oracles):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, logprobs=3, **GREEDY)
    expected = offline_generate(offline, PROMPTS, max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    assert response.id.startswith("cmpl-") and len(response.choices) == len(PROMPTS)
    for choice, reference in zip(sorted(response.choices, key=lambda c: c.index), expected):
        extra = choice.model_dump()
        assert extra["token_ids"] == reference.outputs[0].token_ids
        assert extra["prompt_token_ids"] == reference.prompt_token_ids
        assert choice.text == reference.outputs[0].text
        assert choice.finish_reason == "length"
        oracle = oracles["llama"].greedy(reference.prompt_token_ids, 12)
        assert extra["token_ids"] == oracle.token_ids
        for position, (token_id, logprob) in enumerate(zip(extra["token_ids"], choice.logprobs.token_logprobs)):
            assert abs(logprob - oracle.logprobs[position][token_id].item()) <= LOGPROB_TOLERANCE
        for position, top in enumerate(choice.logprobs.top_logprobs):
            # Keyed by token text, as OpenAI's legacy format is: tokens of equal text share a key.
            assert max(top.values()) == pytest.approx(oracle.logprobs[position].max().item(), abs=1e-4)
    usage = response.usage
    assert usage.completion_tokens == 12 * len(PROMPTS)
    assert usage.prompt_tokens == sum(len(reference.prompt_token_ids) for reference in expected)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_stream_equals_non_stream(client):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=20, **GREEDY)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    token_ids = sum((chunk.choices[0].model_dump()["token_ids"] for chunk in chunks if chunk.choices), [])
    assert text == whole.choices[0].text
    assert token_ids == whole.choices[0].model_dump()["token_ids"]
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert len({chunk.id for chunk in chunks}) == 1


def test_token_prompt_with_echo(client, offline):
    prompt_ids = offline.tokenizer.encode(PROMPTS[1])
    response = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=5, echo=True, logprobs=1,
                                         **GREEDY)
    choice = response.choices[0]
    prompt_text = offline.tokenizer.decode(prompt_ids)
    assert choice.text.startswith(prompt_text) and len(choice.text) > len(prompt_text)
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == len(prompt_ids) + 5


def test_chat_stream_and_non_stream_match_offline(client, offline):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, **GREEDY)
    expected = offline.chat(messages, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)[0]
    assert whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.outputs[0].text
    assert whole.choices[0].model_dump()["token_ids"] == expected.outputs[0].token_ids
    assert whole.model_dump()["prompt_token_ids"] == expected.prompt_token_ids
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids) and whole.usage.completion_tokens == 16
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == \
        expected.outputs[0].text
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_logprobs_match_transformers(client, offline, oracles):
    messages = [{"role": "user", "content": "Count to five."}]
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, logprobs=True,
                                              top_logprobs=3, **GREEDY)
    choice = response.choices[0]
    oracle = oracles["llama"].greedy(response.model_dump()["prompt_token_ids"], 8)
    token_ids = choice.model_dump()["token_ids"]
    assert token_ids == oracle.token_ids
    assert len(choice.logprobs.content) == 8
    for position, (token_id, entry) in enumerate(zip(token_ids, choice.logprobs.content)):
        assert abs(entry.logprob - oracle.logprobs[position][token_id].item()) <= LOGPROB_TOLERANCE
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(oracle.logprobs[position].max().item(), abs=1e-4)
        assert entry.token == offline.tokenizer.decode([token_id])


def test_n2_with_seed_is_reproducible_and_matches_offline(client, offline):
    request = dict(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=10, n=2, temperature=1.0, seed=7,
                   extra_body={"return_token_ids": True, "ignore_eos": True})
    first = client.completions.create(**request)
    second = client.completions.create(**request)
    tokens = [choice.model_dump()["token_ids"] for choice in sorted(first.choices, key=lambda c: c.index)]
    assert [choice.index for choice in first.choices] == [0, 1]
    assert tokens == [choice.model_dump()["token_ids"] for choice in sorted(second.choices, key=lambda c: c.index)]
    expected = offline_generate(offline, [PROMPTS[2]], max_tokens=10, n=2, temperature=1.0, seed=7,
                                ignore_eos=True)[0]
    assert tokens == [choice.token_ids for choice in expected.outputs]
    assert first.usage.completion_tokens == 20


def test_chat_stream_with_n2_equals_non_stream(client):
    request = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12, n=2,
                   temperature=0.8, seed=11, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**request)
    texts = {choice.index: "" for choice in whole.choices}
    finishes = {}
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert texts == {choice.index: choice.message.content for choice in whole.choices}
    assert finishes == {0: "length", 1: "length"}


def test_stop_strings(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=24, **GREEDY).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    cut = full[:full.index(stop)]
    stopped = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=24, stop=[stop], **GREEDY)
    assert stopped.choices[0].text == cut
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_dump()["stop_reason"] == stop
    kept = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=24, stop=stop,
                                     temperature=0.0, extra_body={"ignore_eos": True,
                                                                  "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=24, stop=[stop],
                                            stream=True, **GREEDY))
    assert "".join(chunk.choices[0].text for chunk in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_64_concurrent_streams_complete_and_free_pages(server, offline):
    prompts = [f"Request number {number}: " + "tokens " * (number % 7) for number in range(64)]
    expected = offline_generate(offline, prompts, max_tokens=16, temperature=0.0, ignore_eos=True)
    async_client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                                      http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=100)))

    async def one(prompt: str):
        stream = await async_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, stream=True,
                                                       **GREEDY)
        token_ids, text, finish = [], "", None
        async for chunk in stream:
            token_ids += chunk.choices[0].model_dump()["token_ids"]
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return token_ids, text, finish

    async def run_all():
        try:
            return await asyncio.gather(*(one(prompt) for prompt in prompts))
        finally:
            await async_client.close()

    results = asyncio.run(run_all())
    for (token_ids, text, finish), reference in zip(results, expected):
        assert token_ids == reference.outputs[0].token_ids
        assert text == reference.outputs[0].text and finish == "length"
    assert server.wait_for_metric("num_requests_running", 0) == 0
    httpx.post(server.base_url + "/reset_prefix_cache")
    assert server.wait_for_metric("kv_pages_used", 0) == 0


def test_models_tokenize_detokenize_health_metrics(server, client, offline):
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL_NAME]
    tokenized = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tokenized["tokens"] == offline.tokenizer.encode(PROMPTS[0]) and tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] > 0
    chat_tokens = httpx.post(server.base_url + "/tokenize",
                             json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert offline.tokenizer.decode(chat_tokens).endswith("assistant\n")
    detokenized = httpx.post(server.base_url + "/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert detokenized["prompt"] == PROMPTS[0]
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert server.metric("requests_total", 'outcome="length"') >= 64
    assert server.metric("generation_tokens_total") >= 64 * 16
    assert server.metric("time_to_first_token_seconds_count") >= 64
    assert server.metric("inter_token_latency_seconds_count") > 0
    assert server.metric("e2e_request_latency_seconds_count") >= 64
    assert server.metric("prompt_tokens_total") > 0
    assert server.metric("kv_pages_total") > 0
    assert server.metric("prefix_cache_query_tokens_total") > 0
    assert server.metric("num_requests_waiting") == 0
