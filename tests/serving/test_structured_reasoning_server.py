"""The chat route with ``--reasoning-parser``: a structured output constrains only the answer.

Requests with ``response_format``, ``structured_outputs`` or a forced ``tool_choice`` whose
prompt leaves the model thinking reach the engine with ``after_token_ids`` = the end-of-thinking
marker's ids; the thinking comes back in ``reasoning_content`` and the content parses as JSON
(streamed too). A prompt that does not leave the model thinking, or a server without a reasoning
parser, keeps the constraint from the first token. The engine is a stand-in
(``tests/support/tool_calling.py``): the engine's side is tested in ``test_structured_reasoning.py``.
"""
from __future__ import annotations

import json

from tests.support.tool_calling import MODEL_NAME, TEMPLATES, collect_stream, run_with_client, scripted_server

SCHEMA = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "count", "schema": SCHEMA}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
THINKING = "I count three.\n"
SCRIPTS = {"Count?": THINKING + '</think>\n\n{"count": 3}', "Weather?": THINKING + '</think>\n\n{"city": "Oslo"}'}


def recording(state) -> list:
    seen = []
    generate = state.client.generate

    def record(request_id, prompt, prompt_token_ids, params, *arguments, **options):
        seen.append(params)
        return generate(request_id, prompt, prompt_token_ids, params, *arguments, **options)

    state.client.generate = record
    return seen


def body(question: str, **fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": question}], **fields}


def test_thinking_free_answer_constrained(tokenizer_dir):
    state = scripted_server(tokenizer_dir, TEMPLATES["deepseek_v3"], SCRIPTS, reasoning_parser="deepseek_r1")
    seen = recording(state)
    end_ids = list(state.tokenizer.encode("</think>", add_special_tokens=False))

    async def work(sdk, http):
        whole = await sdk.chat.completions.create(**body("Count?", response_format=RESPONSE_FORMAT))
        streamed = await collect_stream(await sdk.chat.completions.create(
            **body("Count?", response_format=RESPONSE_FORMAT), stream=True))
        vllm_field = await http.post("/v1/chat/completions", json=body(
            "Count?", structured_outputs={"json": SCHEMA}))
        named = await sdk.chat.completions.create(**body(
            "Weather?", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
        plain = await sdk.chat.completions.create(**body("Count?"))
        return whole, streamed, vllm_field.json(), named, plain

    whole, streamed, vllm_field, named, plain = run_with_client(state, work)
    message = whole.choices[0].message
    assert message.reasoning_content == THINKING and json.loads(message.content) == {"count": 3}
    assert streamed[0]["reasoning_content"] == THINKING and json.loads(streamed[0]["content"]) == {"count": 3}
    assert vllm_field["choices"][0]["message"]["reasoning_content"] == THINKING
    assert json.loads(vllm_field["choices"][0]["message"]["content"]) == {"count": 3}
    assert json.loads(named.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    constrained = seen[:4]
    assert [params.structured_outputs.after_token_ids for params in constrained] == [end_ids] * 4
    assert constrained[3].structured_outputs.json == WEATHER["function"]["parameters"]
    assert seen[4].structured_outputs is None  # nothing to constrain: unchanged
    # The answer's tokens do contain the marker's ids, so the engine finds the boundary.
    output_ids = state.tokenizer.encode(SCRIPTS["Count?"], add_special_tokens=False)
    assert any(output_ids[start:start + len(end_ids)] == end_ids for start in range(len(output_ids)))


def test_constraint_from_the_first_token_when_the_prompt_does_not_leave_the_model_thinking(tokenizer_dir):
    answer = {"Count?": '{"count": 3}'}
    cases = [("glm45", TEMPLATES["glm45"], {"enable_thinking": False}),  # the template closed the block
             ("qwen3", TEMPLATES["hermes"], None),  # the prompt opens no block: the model may answer at once
             (None, TEMPLATES["deepseek_v3"], None)]  # no reasoning parser
    for reasoning_parser, template, template_kwargs in cases:
        state = scripted_server(tokenizer_dir, template, answer, reasoning_parser=reasoning_parser)
        seen = recording(state)

        async def work(sdk, http):
            return await http.post("/v1/chat/completions", json=body(
                "Count?", response_format=RESPONSE_FORMAT, chat_template_kwargs=template_kwargs))

        response = run_with_client(state, work)
        assert response.status_code == 200, response.text
        assert json.loads(response.json()["choices"][0]["message"]["content"]) == {"count": 3}
        assert seen[0].structured_outputs.json == SCHEMA
        assert seen[0].structured_outputs.after_token_ids is None, reasoning_parser
