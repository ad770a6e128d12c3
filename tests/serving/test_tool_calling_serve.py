"""Tools on a real ``tandem serve`` (a tiny qwen3 model whose chat template writes hermes calls,
``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3``).

The template renders the request's tools, an earlier call and its result exactly as
``transformers`` renders them (the prompt's token ids are compared), the answer's tokens are the
``transformers`` greedy ones, and the ``openai`` SDK parses the message, streamed or not. A tiny
random model writes no calls of its own; ``required`` and named tool choices get their calls from
the grammar engine, whose test here is marked until that engine is part of the server.
"""
from __future__ import annotations

import json
import os
import shutil

os.environ["TANDEM_SANITIZE"] = "1"

import httpx  # noqa: E402
import jsonschema  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402

from tests.support.servers import ServerProcess  # noqa: E402
from tests.support.tool_calling import TEMPLATES  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_paris", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_paris", "content": "sunny, 21 C"},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model_dirs):
    directory = tmp_path_factory.mktemp("tools_model") / "qwen3"
    shutil.copytree(model_dirs["qwen3"], directory)
    (directory / "chat_template.jinja").write_text(TEMPLATES["hermes"])
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    process = ServerProcess(["--model", str(model_dir), "--served-model-name", MODEL, "--enable-auto-tool-choice",
                             "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--max-model-len", "1024",
                             "--max-total-tokens", "4096", "--max-num-seqs", "4", "--log-level", "warning"],
                            tmp_path_factory.mktemp("logs") / "server.log")
    process.start(timeout=300)
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def transformers_prompt(model_dir):
    """The prompt as ``transformers`` renders it: the same template, call arguments as objects."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    messages = json.loads(json.dumps(MESSAGES))
    messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 1}
    rendered = tokenizer.apply_chat_template(messages, tools=[WEATHER, NOW], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)
    return list(rendered["input_ids"]), tokenizer


def test_tools_render_and_answer_like_transformers(server, client, model_dir, oracles):
    """Auto tool choice on a model that answers in text: the prompt (tools, call, result) and the
    greedy answer equal ``transformers``; the SDK's message is the text; streaming agrees."""
    body = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, NOW], max_tokens=8, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    response = client.chat.completions.create(**body)
    prompt_ids, tokenizer = transformers_prompt(model_dir)
    extra = response.model_dump()
    assert extra["prompt_token_ids"] == prompt_ids
    choice = response.choices[0]
    assert extra["choices"][0]["token_ids"] == oracles["qwen3"].greedy(prompt_ids, 8).token_ids
    text = tokenizer.decode(extra["choices"][0]["token_ids"], skip_special_tokens=True)
    assert "<tool_call>" not in text and "<think>" not in text  # the precondition of the next line
    assert choice.message.content == text and choice.message.tool_calls is None
    assert choice.finish_reason == "length"
    streamed, finish = "", None
    for chunk in client.chat.completions.create(**body, stream=True):
        for streamed_choice in chunk.choices:
            streamed += streamed_choice.delta.content or ""
            finish = streamed_choice.finish_reason or finish
    assert (streamed, finish) == (text, "length")
    counted = httpx.post(server.base_url + "/tokenize", json={"messages": MESSAGES, "tools": [WEATHER, NOW]},
                         timeout=30).json()
    assert counted["tokens"] == prompt_ids


def test_bad_tool_request_then_serving(server, client):
    """A 400 naming the field; the server keeps serving, nothing left running."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "now"}})
    assert caught.value.body["param"] == "tool_choice"
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=2)
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert server.wait_for_metric("num_requests_running", 0) == 0


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate_against_parameters(client, tool_choice):
    """``required`` and a named function give calls on any model: each names a tool and its
    arguments validate against that tool's parameters, streamed or not."""
    tools = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, NOW)}
    body = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, NOW], tool_choice=tool_choice, max_tokens=200,
                temperature=0)
    response = client.chat.completions.create(**body)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and all(call.function.name in tools for call in calls)
    if isinstance(tool_choice, dict):
        assert [call.function.name for call in calls] == ["get_weather"]
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])
    streamed: list[list[str]] = []
    for chunk in client.chat.completions.create(**body, stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if delta_call.id is not None:
                streamed.append([delta_call.function.name, ""])
            streamed[delta_call.index][1] += delta_call.function.arguments or ""
    assert streamed == [[call.function.name, call.function.arguments] for call in calls]
