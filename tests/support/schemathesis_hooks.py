"""Schemathesis hooks for ``test_openapi_contract.py`` (loaded through ``SCHEMATHESIS_HOOKS``).

The run uses every check schemathesis has, ``positive_data_acceptance`` included (a schema-valid
request must not be rejected). JSON Schema cannot state the rules between fields that the server
enforces (``protocol.CROSS_FIELD_RULES``, written into the schema's descriptions): the prompt plus
max_tokens must fit the context, min_tokens must not exceed max_tokens (or what the prompt leaves),
best_of must equal n, the tool rules (a named tool_choice among the tools, unique tool names,
valid parameter schemas, JSON call arguments), a structured output's grammar must parse
(``protocol.STRUCTURED_OUTPUTS_RULE``). ``keep_documented_rules`` (a ``map_case`` hook) makes the *positive* cases of
the two generation routes keep them too (a ``required`` or named tool choice is a structured output
as well: the server builds its grammar from the tools, so the same rule holds), as a client that read the descriptions would: best_of
becomes n, max_tokens (or max_completion_tokens) and min_tokens shrink to what the prompt leaves
(counted by the server's own ``/tokenize``), and ``prompt_fits`` (a ``filter_case`` hook) drops a
positive case whose prompt alone fills the context, or that breaks a tool rule or the structured-output
rule (neither can be mended by a client: a schema or grammar that does not parse stays one). Negative cases are left alone, and the 400s
these rules give are tested field by field elsewhere (``tests/serving/test_server_bad_input.py``).

``every_operation_succeeds`` fails the run when an operation never answered 2xx, so a contract
that only ever produces errors cannot pass.

The server is named by ``TANDEM_CONTRACT_BASE_URL`` and ``TANDEM_CONTRACT_API_KEY``.
"""
from __future__ import annotations

import functools
import json
import os
import threading
from typing import Any

import httpx
import jsonschema
import schemathesis

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_MAX_TOKENS = {"/v1/completions": 16, "/v1/chat/completions": None}


def is_positive(case) -> bool:
    return case.meta is not None and case.meta.generation.mode.is_positive and isinstance(case.body, dict)


def is_positive_generation_case(case) -> bool:
    return is_positive(case) and case.path in GENERATION_PATHS


@schemathesis.hook
def filter_case(ctx, case) -> bool:
    """Positive cases that break a documented rule no client could mend (a tool rule, a
    constraint that does not parse, a prompt that alone fills the context): not sent."""
    if is_positive(case) and case.path == "/tokenize" and case.body.get("messages"):
        return not tool_rules(case.body)
    if not is_positive_generation_case(case):
        return True
    if case.path == "/v1/chat/completions" and tool_rules(case.body):
        return False
    if broken_structured_outputs_rule(case):
        return False
    return max(prompt_token_counts(case)) < server().max_model_len()


@schemathesis.hook
def map_case(ctx, case):
    """Positive cases keep the rules between fields that the schema's descriptions state."""
    if is_positive_generation_case(case):
        keep_documented_rules(case)
    return case


def keep_documented_rules(case) -> None:
    body: dict[str, Any] = case.body
    room = server().max_model_len() - max(prompt_token_counts(case))
    if case.path == "/v1/completions" and body.get("best_of") is not None:
        body["best_of"] = body.get("n", 1)
    length_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    requested = body.get(length_field, DEFAULT_MAX_TOKENS[case.path])
    if requested is not None and requested > room:
        body[length_field] = room
        requested = room
    allowed = requested if requested is not None else room
    if body.get("min_tokens", 0) > allowed:
        body["min_tokens"] = allowed


def prompt_token_counts(case) -> list[int]:
    """Tokens of each prompt of the case, after the chat template for chat."""
    body = case.body
    if case.path == "/v1/completions":
        prompt = body["prompt"]
        prompts = [prompt] if isinstance(prompt, str) or is_token_id(prompt[0]) else prompt
        return [server().count({"prompt": item}) if isinstance(item, str) else len(item) for item in prompts]
    return [server().count({"messages": body["messages"], "tools": body.get("tools"),
                            "add_generation_prompt": body.get("add_generation_prompt", True)})]


def broken_structured_outputs_rule(case) -> set[str]:
    """The field the structured-outputs rule (``protocol.STRUCTURED_OUTPUTS_RULE``) names as
    broken: whether a schema, regex or grammar parses only xgrammar can tell, so the request's
    constraint is built as the server builds it and checked with the engine's parameters."""
    from tandem.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from tandem.sampling_params import SamplingParams

    model = CompletionRequest if case.path == "/v1/completions" else ChatCompletionRequest
    try:
        request = model.model_validate(case.body)
    except ValueError:
        return set()
    try:
        constraint = request.structured_constraint()
        if constraint is None and case.path == "/v1/chat/completions":
            constraint = tool_constraint(request)
        if constraint is not None:
            SamplingParams(structured_outputs=constraint, ignore_eos=request.ignore_eos,
                           min_tokens=request.min_tokens, max_tokens=None)
    except ValueError as error:
        return {str(error).partition(":")[0]}
    return set()


def tool_constraint(request):
    """The constraint a ``required`` or named ``tool_choice`` puts on the output, built and its
    grammar checked as the server does (``chat.with_tool_constraint``); None for the other choices.
    Raises ``ValueError("tools: ...")`` for a parameter schema the grammar engine cannot take."""
    from tandem.entrypoints.openai.errors import OpenAIError
    from tandem.entrypoints.openai.tool_choice import ToolCallingOptions, plan_tools
    from tandem.sampling_params import StructuredOutputsParams
    from tandem.structured.source import check

    if not request.tools or request.tool_choice in (None, "none", "auto"):
        return None
    try:
        plan = plan_tools(ToolCallingOptions(), request.tools, request.tool_choice, request.parallel_tool_calls)
    except OpenAIError as error:  # (a tool rule: ``tool_rules`` names it)
        raise ValueError(f"{error.param}: {error}") from None
    schema = plan.schema
    constraint = StructuredOutputsParams(json=schema)
    check(constraint, "tools")
    return constraint


def tool_rules(body: dict[str, Any]) -> set[str]:
    """The tool fields that break a rule JSON Schema cannot state (``protocol.CROSS_FIELD_RULES``)."""
    broken: set[str] = set()
    tools = body.get("tools") or []
    names = [tool["function"]["name"] for tool in tools]
    for index, tool in enumerate(tools):
        if tool["function"]["name"] in names[:index]:
            broken.add(f"tools[{index}].function.name")
        parameters = tool["function"].get("parameters")
        if parameters is not None and not is_json_schema(parameters):
            broken.add(f"tools[{index}].function.parameters")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        broken.add("tool_choice")
    for index, message in enumerate(body["messages"]):
        for call_index, call in enumerate(message.get("tool_calls") or []):
            try:
                json.loads(call["function"]["arguments"])
            except ValueError:
                broken.add(f"messages[{index}].tool_calls[{call_index}].function.arguments")
    return broken


def is_json_schema(value) -> bool:
    try:
        jsonschema.validators.validator_for(value, default=jsonschema.Draft202012Validator).check_schema(value)
    except Exception:  # noqa: BLE001 - whatever the checker raises, it is not a schema
        return False
    return True


def is_token_id(value) -> bool:
    """JSON Schema's integer: ``7`` or ``7.0``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@functools.lru_cache(maxsize=1)
def server() -> "Server":
    return Server(os.environ["TANDEM_CONTRACT_BASE_URL"], os.environ.get("TANDEM_CONTRACT_API_KEY"))


class Server:
    """The server under test, asked with the run's credentials; answers are remembered."""

    def __init__(self, base_url: str, api_key: str | None):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.counts: dict[str, int] = {}
        self._max_model_len: int | None = None

    def max_model_len(self) -> int:
        if self._max_model_len is None:
            models = httpx.get(self.base_url + "/v1/models", headers=self.headers, timeout=30).json()
            self._max_model_len = models["data"][0]["max_model_len"]
        return self._max_model_len

    def count(self, body: dict) -> int:
        key = json.dumps(body, sort_keys=True)
        if key not in self.counts:
            answer = httpx.post(self.base_url + "/tokenize", json=body, headers=self.headers, timeout=30)
            answer.raise_for_status()
            self.counts[key] = answer.json()["count"]
        return self.counts[key]


@schemathesis.check
class every_operation_succeeds:  # noqa: N801 - check names are snake case
    """Fail the run if an operation that was tested never answered 2xx."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tested: set[str] = set()
        self.succeeded: set[str] = set()

    def after_response(self, ctx, response, case) -> None:
        with self.lock:
            self.tested.add(case.operation.label)
            if 200 <= response.status_code < 300:
                self.succeeded.add(case.operation.label)

    def after_run(self, ctx) -> None:
        never = sorted(self.tested - self.succeeded)
        if never:
            raise AssertionError(f"operations that never answered 2xx: {', '.join(never)}")
