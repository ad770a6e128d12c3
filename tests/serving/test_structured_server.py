"""Structured outputs through ``tandem serve`` with the official ``openai`` client: OpenAI's
``response_format`` (json_schema, json_object, text) and vLLM's ``structured_outputs`` on chat and
completions, ``client.chat.completions.parse`` with a Pydantic model, streamed results equal to
non-streamed ones, bad constraints answered 400 naming the field (the server keeps serving), and
the metrics."""
import os

os.environ["TANDEM_SANITIZE"] = "1"

import json  # noqa: E402
import re  # noqa: E402
from typing import Literal  # noqa: E402

import httpx  # noqa: E402
import jsonschema  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from tests.support.servers import ServerProcess  # noqa: E402

ENGINE_FLAGS = ["--page-size=16", "--max-total-tokens=8192", "--max-num-seqs=16", "--max-num-batched-tokens=512"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "days", "sunny"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Plan a trip as JSON."}]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "emu"]
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=30)
    vaccinated: bool


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    process = ServerProcess(["--model", model_dirs["llama"], "--served-model-name", "tiny", *ENGINE_FLAGS],
                            tmp_path_factory.mktemp("logs") / "server.log")
    process.start()
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def json_schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


def streamed_chat(client, **options) -> tuple[str, str]:
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **options):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_chat_response_format_json_schema_and_json_object_stream_equals_non_stream(client):
    for response_format in (json_schema_format(SCHEMA), json_schema_format(SCHEMA, strict=False),
                            {"type": "json_object"}):
        options = dict(model="tiny", messages=MESSAGES, temperature=0.0, max_tokens=200,
                       response_format=response_format)
        answer = client.chat.completions.create(**options).choices[0]
        if response_format["type"] == "json_schema":
            assert answer.finish_reason == "stop", answer.message.content
            jsonschema.validate(json.loads(answer.message.content), SCHEMA)
        elif answer.finish_reason == "stop":  # any object: its keys are unbounded, a random model may not end
            assert isinstance(json.loads(answer.message.content), dict)
        else:
            assert answer.message.content.startswith('{"')
        assert streamed_chat(client, **options) == (answer.message.content, answer.finish_reason), response_format
    # type "text" is free text, as without the field
    plain = dict(model="tiny", messages=MESSAGES, temperature=0.0, max_tokens=8, extra_body={"ignore_eos": True})
    assert (client.chat.completions.create(response_format={"type": "text"}, **plain).choices[0].message.content
            == client.chat.completions.create(**plain).choices[0].message.content)


def test_sdk_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "A pet?"}],
                                               response_format=Pet, temperature=0.0, max_tokens=200)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pet) and message.parsed == Pet.model_validate_json(message.content)


def test_structured_outputs_field_on_completions_and_chat(client):
    cases = [({"regex": r"[a-d]{2,4}-[0-9]{1,3}"}, lambda text: re.fullmatch(r"[a-d]{2,4}-[0-9]{1,3}", text)),
             ({"choice": ["left", "right"]}, lambda text: text in ("left", "right")),
             ({"grammar": 'root ::= "x=" [0-9] ";"'}, lambda text: re.fullmatch(r"x=[0-9];", text)),
             ({"json": SCHEMA, "disable_any_whitespace": False},
              lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
             ]
    for constraint, valid in cases:
        options = dict(model="tiny", prompt="Answer:", temperature=0.0, max_tokens=200,
                       extra_body={"structured_outputs": constraint})
        answer = client.completions.create(**options).choices[0]
        assert answer.finish_reason == "stop" and valid(answer.text), (constraint, answer.text)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **options)
                           if chunk.choices)
        assert streamed == answer.text
        chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.8, seed=5,
                                              max_tokens=200, extra_body={"structured_outputs": constraint})
        assert chat.choices[0].finish_reason == "stop" and valid(chat.choices[0].message.content), constraint


BAD_REQUESTS = [
    ({"response_format": json_schema_format({"type": "nope"})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"structured_outputs": {"choice": ["a"]}, "min_tokens": 3}, "min_tokens"),
]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_bad_constraints_are_400_naming_the_field(server, route):
    base = {"model": "tiny", "max_tokens": 20, "stream": route == "chat"}
    base.update({"messages": MESSAGES} if route == "chat" else {"prompt": "hi"})
    url = f"{server.base_url}/v1/{'chat/completions' if route == 'chat' else 'completions'}"
    with httpx.Client(timeout=60) as http:
        for fields, param in BAD_REQUESTS:
            response = http.post(url, json={**base, **fields})
            assert response.status_code == 400, (fields, response.text)
            error = response.json()["error"]
            assert error["param"] == param and error["message"].startswith(param), (fields, error)
        good = http.post(url, json={**base, "stream": False, "structured_outputs": {"choice": ["fine"]}})
        assert good.status_code == 200, good.text
    assert server.wait_for_metric("num_requests_running", 0) == 0


def test_metrics(server, client):
    client.completions.create(model="tiny", prompt="m", max_tokens=20, extra_body={"structured_outputs":
                                                                                  {"choice": ["metric"]}})
    client.completions.create(model="tiny", prompt="m", max_tokens=20, extra_body={"structured_outputs":
                                                                                  {"choice": ["metric"]}})
    assert server.metric("structured_outputs_compiled_total") >= 1
    assert server.metric("structured_outputs_cache_hits_total") >= 1
    assert server.metric("structured_outputs_constrained_steps_total") >= 2
    assert server.metric("structured_outputs_compile_seconds_total") > 0
