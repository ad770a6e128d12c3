"""Tool calls and reasoning through the chat route, end to end, for each parser: the request's
tools and history go into a chat template that writes that parser's format, the scripted answer
(in that format) comes back as ``tool_calls`` / ``reasoning_content`` that the ``openai`` SDK
parses, streamed deltas add up to the non-streamed message, and bad tool fields are 400s naming
the field. The engine is a stand-in (``tests/support/tool_calling.py``): a tiny random model
never writes a tool call by itself.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.entrypoints.openai.tool_choice import required_calls_schema
from tests.support.tool_calling import (
    MODEL_NAME,
    TEMPLATES,
    collect_stream,
    message_summary,
    run_with_client,
    scripted_server,
    without_ids,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {"type": "object"}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Paris it is.", "tool_calls": [
        {"id": "call_paris", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_paris", "content": "sunny, 21 C"},
]
OSLO = {"city": "Oslo", "days": 2}

# parser -> (reasoning parser, how the template writes the earlier call, the scripted answer,
#            expected reasoning, expected content)
FORMATS = {
    "hermes": ("qwen3", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               '<think>They want Oslo.</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Oslo", "days": 2}}\n</tool_call>', "They want Oslo.", "Checking."),
    "llama3_json": (None, '{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}', "", ""),
    "deepseek_v3": ("deepseek_r1", '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```',
                    'They want Oslo.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    'get_weather\n```json\n{"city": "Oslo", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                    "They want Oslo.\n", ""),
    "glm45": ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
              "<think>They want Oslo.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo"
              "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>", "They want Oslo.", ""),
}


def request(question: str, **fields) -> dict:
    return {"model": MODEL_NAME, "messages": [*HISTORY, {"role": "user", "content": question}],
            "tools": [WEATHER, NOW], **fields}


async def whole_and_streamed(sdk, body: dict):
    whole = await sdk.chat.completions.create(**body)
    streamed = await collect_stream(await sdk.chat.completions.create(**body, stream=True))
    return whole, streamed


@pytest.mark.parametrize("parser_name", sorted(FORMATS))
def test_auto_tool_calls_and_reasoning(tokenizer_dir, parser_name):
    reasoning_parser, earlier_call, answer, reasoning, content = FORMATS[parser_name]
    thinking = "Fine.</think>" if reasoning_parser == "deepseek_r1" else ""  # R1 always thinks first
    separator = "; " if parser_name == "llama3_json" else "\n"  # llama3_json separates calls with ";"
    scripts = {"Oslo?": answer, "Say hi": thinking + "Hi there! ", "Two calls": answer + separator + answer}
    state = scripted_server(tokenizer_dir, TEMPLATES[parser_name], scripts, enable_auto_tool_choice=True,
                            tool_call_parser=parser_name, reasoning_parser=reasoning_parser)

    async def work(sdk, http):
        results = {"call": await whole_and_streamed(sdk, request("Oslo?")),
                   "text": await whole_and_streamed(sdk, request("Say hi")),
                   "single": await whole_and_streamed(sdk, request("Two calls", parallel_tool_calls=False)),
                   "two": await whole_and_streamed(sdk, request("Two calls", n=2)),
                   "cut": await whole_and_streamed(sdk, request("Oslo?", max_tokens=len(answer) // 3))}
        return results

    results = run_with_client(state, work)
    whole, streamed = results["call"]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [call.function.name for call in choice.message.tool_calls] == ["get_weather"]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == OSLO
    assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"
    assert (choice.message.content or "") == content
    assert (getattr(choice.message, "reasoning_content", None) or "") == reasoning
    assert without_ids(streamed[0]) == message_summary(choice)
    # the template saw the tools, the earlier call in this format and the tool's result
    prompt = state.client.prompts[0]
    assert json.dumps(WEATHER["function"]["description"]) in prompt and earlier_call in prompt
    assert "sunny, 21 C" in prompt and "<think>Paris it is.</think>" in prompt

    whole, streamed = results["text"]
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content.startswith("Hi there!")
    assert without_ids(streamed[0]) == message_summary(whole.choices[0])

    whole, streamed = results["single"]  # parallel_tool_calls false: the first call only
    assert len(whole.choices[0].message.tool_calls) == 1 and len(streamed[0]["tool_calls"]) == 1

    whole, streamed = results["two"]  # n=2: each choice parsed on its own
    assert len(whole.choices) == 2 and all(len(choice.message.tool_calls) == 2 for choice in whole.choices)
    assert [without_ids(streamed[index]) for index in (0, 1)] == [message_summary(c) for c in whole.choices]

    whole, streamed = results["cut"]  # max_tokens cut the answer: what was written, finish "length"
    assert whole.choices[0].finish_reason == "length"
    assert without_ids(streamed[0]) == message_summary(whole.choices[0])


FORCED_CALLS = [{"name": "get_weather", "parameters": OSLO}, {"name": "now", "parameters": {}}]


def test_required_and_named_tool_choice(tokenizer_dir):
    """``required`` and a named function ask the engine for a JSON Schema constraint
    (``structured_outputs``) and read its output as calls, on a server without auto tool choice."""
    scripts = {"Forced?": json.dumps(FORCED_CALLS), "Named?": json.dumps(OSLO)}
    state = scripted_server(tokenizer_dir, TEMPLATES["hermes"], scripts)
    seen_params = []
    generate = state.client.generate

    def recording_generate(request_id, prompt, prompt_token_ids, params, *arguments, **options):
        seen_params.append(params)
        return generate(request_id, prompt, prompt_token_ids, params, *arguments, **options)

    state.client.generate = recording_generate
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def work(sdk, http):
        return (await whole_and_streamed(sdk, request("Forced?", tool_choice="required")),
                await whole_and_streamed(sdk, request("Named?", tool_choice=named)),
                await whole_and_streamed(sdk, request("Forced?", tool_choice="required", parallel_tool_calls=False)))

    (required, required_streamed), (named_whole, named_streamed), (single, _) = run_with_client(state, work)
    calls = required.choices[0].message.tool_calls
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [
        (item["name"], item["parameters"]) for item in FORCED_CALLS]
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.content is None
    assert without_ids(required_streamed[0]) == message_summary(required.choices[0])
    assert [(call.function.name, json.loads(call.function.arguments))
            for call in named_whole.choices[0].message.tool_calls] == [("get_weather", OSLO)]
    assert without_ids(named_streamed[0]) == message_summary(named_whole.choices[0])
    assert len(single.choices[0].message.tool_calls) == 1
    assert seen_params[0].structured_outputs.json == required_calls_schema([WEATHER, NOW], parallel=True)
    assert seen_params[2].structured_outputs.json == WEATHER["function"]["parameters"]
    assert seen_params[4].structured_outputs.json["maxItems"] == 1


def test_forced_choice_refuses_a_second_constraint():
    """A required or named tool choice is itself the output's constraint: another one (from
    response_format or structured_outputs) is a 400 naming tool_choice."""
    from tandem.entrypoints.openai.chat import with_tool_constraint
    from tandem.entrypoints.openai.errors import OpenAIError
    from tandem.entrypoints.openai.tool_choice import ToolPlan
    from tandem.sampling_params import SamplingParams, StructuredOutputsParams

    for plan in (ToolPlan([WEATHER], "required"), ToolPlan([WEATHER], "named", "get_weather")):
        params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
        with pytest.raises(OpenAIError) as refused:
            with_tool_constraint(params, plan)
        assert refused.value.status_code == 400 and refused.value.param == "tool_choice"
    unconstrained = with_tool_constraint(SamplingParams(), ToolPlan([WEATHER], "auto", parser_name="hermes"))
    assert unconstrained.structured_outputs is None


def test_tool_choice_none_reads_text(tokenizer_dir):
    """With ``tool_choice: none`` a call-shaped answer stays text."""
    answer = FORMATS["hermes"][2]
    state = scripted_server(tokenizer_dir, TEMPLATES["hermes"], {"Oslo?": answer}, enable_auto_tool_choice=True,
                            tool_call_parser="hermes")

    async def work(sdk, http):
        return await sdk.chat.completions.create(**request("Oslo?", tool_choice="none"))

    whole = run_with_client(state, work)
    assert whole.choices[0].message.content == answer and whole.choices[0].message.tool_calls is None
    assert whole.choices[0].finish_reason == "stop"


def bad(path: tuple, value) -> dict:
    """``request("Oslo?")`` with the field at ``path`` set to ``value``."""
    body = json.loads(json.dumps(request("Oslo?")))
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


BAD_REQUESTS = [
    ("auto without --enable-auto-tool-choice", request("Oslo?", tool_choice="auto"), "tool_choice", False),
    ("tools default to auto", request("Oslo?"), "tool_choice", False),
    ("unknown named function", request("Oslo?", tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice", True),
    ("tool_choice without tools", {**request("Oslo?", tool_choice="required"), "tools": None}, "tool_choice", True),
    ("invalid parameters schema", bad(("tools", 0, "function", "parameters"), {"type": "objekt"}),
     "tools[0].function.parameters", True),
    ("parameters not an object", bad(("tools", 0, "function", "parameters"), [1]), "tools[0].function.parameters",
     True),
    ("function name with a space", bad(("tools", 0, "function", "name"), "get weather"), "tools[0].function.name",
     True),
    ("duplicate function names", bad(("tools", 1, "function", "name"), "get_weather"), "tools[1].function.name",
     True),
    ("tool type", bad(("tools", 0, "type"), "retrieval"), "tools[0].type", True),
    ("unknown tool_choice", request("Oslo?", tool_choice="sometimes"), "tool_choice", True),
    ("tool message without tool_call_id", bad(("messages", 2, "tool_call_id"), None), "messages[2].tool_call_id",
     True),
    ("arguments that are not JSON", bad(("messages", 1, "tool_calls", 0, "function", "arguments"), "{city: Paris"),
     "messages[1].tool_calls[0].function.arguments", True),
    ("tool calls on a user message", bad(("messages", 0, "tool_calls"), HISTORY[1]["tool_calls"]),
     "messages[0].tool_calls", True),
    ("parallel_tool_calls not a boolean", request("Oslo?", tool_choice="none", parallel_tool_calls="yes"),
     "parallel_tool_calls", True),
]


def test_bad_tool_fields(tokenizer_dir):
    """Every bad tool field is a 400 naming it; a good request then still works."""
    state = scripted_server(tokenizer_dir, TEMPLATES["hermes"], {"Oslo?": FORMATS["hermes"][2]})
    auto_state = scripted_server(tokenizer_dir, TEMPLATES["hermes"], {"Oslo?": FORMATS["hermes"][2]},
                                 enable_auto_tool_choice=True, tool_call_parser="hermes")

    async def work(http, cases):
        answers = [await http.post("/v1/chat/completions", json=body) for _, body, _, _ in cases]
        answers.append(await http.post("/tokenize", json={"prompt": "hi", "tools": [WEATHER]}))
        answers.append(await http.post("/v1/chat/completions", json=request("Oslo?", tool_choice="none")))
        return answers

    for server, cases in ((state, [case for case in BAD_REQUESTS if not case[3]]),
                          (auto_state, [case for case in BAD_REQUESTS if case[3]])):
        answers = run_with_client(server, lambda sdk, http: work(http, cases))
        for (name, _, param, _), answer in zip(cases, answers):
            assert answer.status_code == 400, (name, answer.text)
            error = answer.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (name, error)
        assert answers[-2].status_code == 400 and answers[-2].json()["error"]["param"] == "tools"
        assert answers[-1].status_code == 200
        assert server.client.num_in_flight == 0 and not server.client.output_processor.has_unfinished()


def test_serve_flags(capsys):
    """The flags are listed with their parsers' names; auto tool choice without a parser is refused
    before anything starts."""
    from tandem.entrypoints.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    for word in ("--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser", "hermes", "llama3_json",
                 "deepseek_v3", "glm45", "deepseek_r1", "qwen3"):
        assert word in help_text, word
    with pytest.raises(SystemExit) as refused:
        main(["serve", "--model", "/nonexistent", "--enable-auto-tool-choice"])
    assert "--tool-call-parser" in str(refused.value)


def forced_choice_cases():
    """Tools with definitions and references (2020-12 and draft-07), and call arrays the
    ``required`` schema must accept (``good``) and refuse (``wrong``)."""
    tree = {"type": "function", "function": {"name": "plant", "parameters": {
        "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"],
        "$defs": {"node": {"type": "object", "properties": {"children": {"type": "array",
                                                                         "items": {"$ref": "#/$defs/node"}}}}}}}}
    legacy = {"type": "function", "function": {"name": "legacy", "parameters": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"unit": {"$ref": "#/definitions/unit"}, "next": {"$ref": "#"}},
        "definitions": {"unit": {"enum": ["C", "F"]}}}}}
    good = [[{"name": "get_weather", "parameters": {"city": "Oslo"}}],
            [{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": OSLO}],
            [{"name": "plant", "parameters": {"root": {"children": [{"children": []}]}}}],
            [{"name": "legacy", "parameters": {"unit": "C", "next": {"unit": "F", "next": {}}}}]]
    wrong = [[], {"name": "now", "parameters": {}}, [{"name": "later", "parameters": {}}],
             [{"name": "get_weather", "parameters": {"days": 2}}],
             [{"name": "get_weather", "parameters": {"city": 5}}],
             [{"name": "now", "parameters": {}, "extra": 1}],
             [{"name": "plant", "parameters": {"root": {"children": [5]}}}],
             [{"name": "legacy", "parameters": {"unit": "K"}}],
             [{"name": "legacy", "parameters": {"next": {"next": {"unit": "K"}}}}]]
    return [WEATHER, NOW, tree, legacy], good, wrong


def test_required_schema_accepts_exactly_valid_calls():
    """The ``required`` grammar's schema: a non-empty array of calls, each naming one tool with
    arguments valid for that tool; definitions and references of each tool still resolve."""
    tools, good, wrong = forced_choice_cases()
    schema = required_calls_schema(tools, parallel=True)
    validator = jsonschema.Draft202012Validator(schema)
    validator.check_schema(schema)
    assert all(validator.is_valid(instance) for instance in good)
    assert not any(validator.is_valid(instance) for instance in wrong)
    single = jsonschema.Draft202012Validator(required_calls_schema([WEATHER, NOW], parallel=False))
    assert single.is_valid(good[0]) and not single.is_valid(good[1])


def test_forced_choice_schemas_compile_in_xgrammar(tokenizer_dir):
    """The grammar engine (xgrammar) compiles the ``required`` and named schemas and its matcher
    accepts exactly the valid calls, as the server writes them (``json.dumps``)."""
    xgrammar = pytest.importorskip("xgrammar")
    from tandem.entrypoints.openai.tool_choice import named_function_schema
    from tandem.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=512))
    tools, good, wrong = forced_choice_cases()

    def accepts(schema, value) -> bool:
        matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
        return matcher.accept_string(json.dumps(value)) and matcher.accept_token(tokenizer.eos_token_id)

    required = required_calls_schema(tools, parallel=True)
    assert all(accepts(required, value) for value in good)
    assert not any(accepts(required, value) for value in wrong)
    assert accepts(named_function_schema(WEATHER), OSLO) and not accepts(named_function_schema(WEATHER), {"days": 1})
