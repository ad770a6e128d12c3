"""Tool-call and reasoning parsers on fixed model outputs, whole and streamed.

Each case is a model output in one format and the message it must give. Streaming is checked by
driving the server's own delta logic (``MessageStream``) over every prefix of the output, one
character at a time (every split point), and over every two-piece split: the deltas must add up
to the non-streamed message, with each call's name sent once and its arguments only appended.
A property test does the same on random mixes of marker fragments, where holding back a partial
marker or a half-written call is what keeps the stream exact.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.entrypoints.openai.assistant_output import AssistantOutputParser, MessageStream
from tandem.entrypoints.openai.reasoning import REASONING_PARSERS
from tandem.entrypoints.openai.tool_parsers import TOOL_PARSERS
from tandem.entrypoints.openai.tool_parsers.forced import NamedFunctionParser, RequiredCallsParser

WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "units": {"type": "string"}, "detail": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds_call(name: str, arguments: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"


def glm_call(name: str, *pairs: tuple[str, str]) -> str:
    body = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n" for key, value in pairs)
    return f"<tool_call>{name}\n{body}</tool_call>"


# (parser, output, content, [(name, arguments as a Python value or, for raw checks, text)])
CASES = [
    ("hermes", "Just text, no calls.  ", "Just text, no calls.  ", []),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>', "Let me look.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>',
     "", [("get_weather", {"city": "Oslo"}), ("now", {})]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "a </tool_call> b \\"q\\" é"}}</tool_call>',
     "", [("get_weather", {"city": 'a </tool_call> b "q" é'})]),
    ("hermes", "<tool_call>not json</tool_call> and then <tool_call>", "<tool_call>not json</tool_call> and then "
                                                                       "<tool_call>", []),
    ("hermes", '<tool_call>{"name": 7}</tool_call>ok', '<tool_call>{"name": 7}</tool_call>ok', []),
    ("hermes", '<tool_call>{"name": "now"}</tool_call>', "", [("now", {})]),
    ("hermes", 'a < b <tool_ <tool_call>{"name": "now", "arguments": {}}', "a < b <tool_", [("now", {})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome", "detail": {"wind": true}}}', "",
     [("get_weather", {"city": "Rome", "detail": {"wind": True}})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                    '{"name": "now", "parameters": {}}', "", [("get_weather", {"city": "Rome"}), ("now", {})]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"name": "now", "arguments": {}} and that is all', "and that is all", [("now", {})]),
    ("deepseek_v3", "Checking." + DS_CALLS + ds_call("get_weather", '{"city": "Lima"}') + "\n"
     + ds_call("now", "{}") + DS_CALLS_END, "Checking.", [("get_weather", {"city": "Lima"}), ("now", {})]),
    ("deepseek_v3", DS_CALLS + ds_call("get_weather", '{\n  "city": "Kyiv",\n  "days": 2\n}') + DS_CALLS_END + " done",
     "done", [("get_weather", {"city": "Kyiv", "days": 2})]),
    ("deepseek_v3", "No calls here, only ``` fences\n```json\n{}\n```", "No calls here, only ``` fences\n```json\n{}\n```",
     []),
    ("glm45", "Sure.\n" + glm_call("get_weather", ("city", " New York "), ("days", "4"), ("units", "42"),
                                   ("detail", '{"wind": true}')),
     "Sure.", [("get_weather", {"city": "New York", "days": 4, "units": "42", "detail": {"wind": True}})]),
    ("glm45", glm_call("now") + "\n" + glm_call("get_weather", ("city", 'a "quoted" <b> name\n'), ("days", "True")),
     "", [("now", {}), ("get_weather", {"city": 'a "quoted" <b> name', "days": True})]),
    ("glm45", "<tool_call></tool_call> plain", "<tool_call></tool_call> plain", []),
]


def streamed_message(new_parser, text: str, cuts) -> dict:
    """Feed ``text`` cut at ``cuts`` through ``MessageStream``; the deltas, added up."""
    stream = MessageStream(new_parser())
    total = {"reasoning": "", "content": "", "calls": []}
    points = sorted(set(cuts)) + [len(text)]
    for index, cut in enumerate(points):
        delta = stream.delta(text[:cut], final=index == len(points) - 1)
        total["reasoning"] += delta.get("reasoning_content", "")
        total["content"] += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(total["calls"]) and call["function"]["name"], call
                total["calls"].append([call["function"]["name"], ""])
            else:
                assert "name" not in call["function"], "a call's name is sent once"
            total["calls"][call["index"]][1] += call["function"]["arguments"]
    return total


def whole_message(new_parser, text: str) -> dict:
    message = new_parser().parse(text, final=True)
    return {"reasoning": message.reasoning or "", "content": message.content,
            "calls": [[call.name, call.arguments] for call in message.calls]}


def check_streaming(new_parser, text: str) -> dict:
    whole = whole_message(new_parser, text)
    assert streamed_message(new_parser, text, range(1, len(text))) == whole  # every split point at once
    for cut in range(len(text) + 1):
        assert streamed_message(new_parser, text, [cut]) == whole, cut
    return whole


@pytest.mark.parametrize("parser_name, output, content, calls", CASES,
                         ids=[f"{case[0]}-{index}" for index, case in enumerate(CASES)])
def test_parser_on_fixed_outputs(parser_name, output, content, calls):
    new_parser = lambda: AssistantOutputParser(None, TOOL_PARSERS[parser_name](WEATHER_TOOLS))  # noqa: E731
    whole = check_streaming(new_parser, output)
    assert whole["content"] == content
    assert [name for name, _ in whole["calls"]] == [name for name, _ in calls]
    assert [json.loads(arguments) for _, arguments in whole["calls"]] == [arguments for _, arguments in calls]


REASONING_CASES = [
    # (parser, prompt, output, reasoning or None, content)
    ("qwen3", "<|im_start|>assistant\n", "<think>\nPlan: look it up.\n</think>\n\nIt is sunny.",
     "\nPlan: look it up.\n", "It is sunny."),
    ("qwen3", "<|im_start|>assistant\n", "It is sunny.", None, "It is sunny."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "It is <b>sunny</b>.", None, "It is <b>sunny</b>."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Plan.</think>Answer", "Plan.", "Answer"),
    ("qwen3", "<|im_start|>assistant\n", "<think>cut off by max_tokens </thi", "cut off by max_tokens </thi", ""),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Hmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.\n", "4"),
    ("deepseek_r1", "<｜Assistant｜>", "<think>Hmm.</think>4", "Hmm.", "4"),
    ("deepseek_r1", "<｜Assistant｜>", "never closes", "never closes", ""),
    ("glm45", "<|assistant|>", "<think>First.</think>\nSecond.", "First.", "Second."),
    ("glm45", "<|assistant|><think></think>", "Only the answer.", None, "Only the answer."),
]


@pytest.mark.parametrize("parser_name, prompt, output, reasoning, content", REASONING_CASES,
                         ids=[f"{case[0]}-{index}" for index, case in enumerate(REASONING_CASES)])
def test_reasoning_on_fixed_outputs(parser_name, prompt, output, reasoning, content):
    parser_class = REASONING_PARSERS[parser_name]
    new_parser = lambda: AssistantOutputParser(parser_class(prompt), None)  # noqa: E731
    whole = check_streaming(new_parser, output)
    message = new_parser().parse(output, final=True)
    assert (message.reasoning, message.content) == (reasoning, content)
    assert whole["content"] == content


def test_reasoning_then_tool_calls():
    """The thinking is split off first; calls are read out of the answer only (a call written
    inside the thinking is thinking)."""
    output = ('<think>Maybe <tool_call>{"name": "now"}</tool_call>? No.</think>\n\nOK.\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>')
    new_parser = lambda: AssistantOutputParser(REASONING_PARSERS["qwen3"]("<|im_start|>assistant\n"),  # noqa: E731
                                               TOOL_PARSERS["hermes"](WEATHER_TOOLS))
    whole = check_streaming(new_parser, output)
    assert whole["reasoning"] == 'Maybe <tool_call>{"name": "now"}</tool_call>? No.'
    assert whole["content"] == "OK."
    assert [(name, json.loads(arguments)) for name, arguments in whole["calls"]] == [("get_weather", {"city": "Bern"})]


def test_forced_choices():
    """What a required or named tool choice's grammar produces; one call at most without
    parallel calls."""
    required = '[{"name": "get_weather", "parameters": {"city": "Quito"}}, {"name": "now", "parameters": {}}]'
    whole = check_streaming(lambda: AssistantOutputParser(None, RequiredCallsParser(WEATHER_TOOLS)), required)
    assert [(name, json.loads(arguments)) for name, arguments in whole["calls"]] == [
        ("get_weather", {"city": "Quito"}), ("now", {})]
    assert whole["content"] == ""
    single = check_streaming(lambda: AssistantOutputParser(None, RequiredCallsParser(WEATHER_TOOLS), 1), required)
    assert [name for name, _ in single["calls"]] == ["get_weather"]
    named = check_streaming(lambda: AssistantOutputParser(None, NamedFunctionParser("get_weather")),
                            ' {"city": "Accra", "days": 1}')
    assert named["calls"] == [["get_weather", '{"city": "Accra", "days": 1}']] and named["content"] == ""
    unparsable = whole_message(lambda: AssistantOutputParser(None, RequiredCallsParser(WEATHER_TOOLS)), "free text")
    assert unparsable == {"reasoning": "", "content": "free text", "calls": []}


def test_reasoning_boundary_token_ids(tokenizer_dir):
    """The grammar hook: the end marker's id when it is one token, and whether the output starts
    inside the thinking."""
    from tandem.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    assert REASONING_PARSERS["qwen3"]("x").boundary(tokenizer).end_token_ids == ()  # several tokens here
    tokenizer.add_tokens(["</think>"])
    boundary = REASONING_PARSERS["qwen3"]("<|im_start|>assistant\n<think>\n").boundary(tokenizer)
    assert boundary.end_token_ids == (tokenizer.convert_tokens_to_ids("</think>"),)
    assert boundary.in_reasoning_at_start
    assert not REASONING_PARSERS["qwen3"]("<think>\n\n</think>\n\n").boundary(tokenizer).in_reasoning_at_start
    assert REASONING_PARSERS["deepseek_r1"]("").boundary(tokenizer).in_reasoning_at_start


FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool", "_call>", '{"name": "now"', '{"name": "get_weather", ',
               '"arguments": {"city": "x"}', "}", "{", '"', "\\", ", ", "\n", " ", "text", "<", "]"],
    "llama3_json": ["<|python_tag|>", '{"name": "now", "parameters": {}}', '{"name": ', '"get_weather"', ", ",
                    '"parameters": ', '{"city": "x"}', "}", ";", " ", "text", "{", '"'],
    "deepseek_v3": [DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP, "function", "now", "\n", "```json",
                    "\n```", "{}", '{"city": "x"}', "text", "<｜", " "],
    "glm45": ["<tool_call>", "</tool_call>", "now", "get_weather", "\n", "<arg_key>", "</arg_key>", "city",
              "days", "<arg_value>", "</arg_value>", " x ", "3", "<", "text", '"'],
}


@pytest.mark.parametrize("parser_name", sorted(FRAGMENTS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streaming_matches_whole_on_random_outputs(parser_name, data):
    """Whatever the model writes, streamed deltas never take anything back and add up to the
    whole message (with thinking in front, for the reasoning parser too)."""
    pieces = data.draw(st.lists(st.sampled_from(FRAGMENTS[parser_name] + ["<think>", "</think>"]), max_size=14))
    text = "".join(pieces)
    new_parser = lambda: AssistantOutputParser(REASONING_PARSERS["qwen3"]("<think>"),  # noqa: E731
                                               TOOL_PARSERS[parser_name](WEATHER_TOOLS))
    whole = whole_message(new_parser, text)
    assert streamed_message(new_parser, text, range(1, len(text))) == whole
    cut = data.draw(st.integers(0, len(text)))
    assert streamed_message(new_parser, text, [cut]) == whole
