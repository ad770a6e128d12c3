"""Schemathesis hooks for ``test_openapi_contract.py`` (loaded through ``SCHEMATHESIS_HOOKS``).

Two checks join schemathesis's own:

``positive_data_acceptance_or_documented_rule`` is schemathesis's ``positive_data_acceptance`` (a
schema-valid request must not be rejected) except for the rules JSON Schema cannot state, listed
in ``protocol.CROSS_FIELD_RULES`` and in the schema's descriptions: the prompt plus max_tokens must
fit the context, min_tokens must not exceed max_tokens, best_of must equal n, the tool rules
(a named tool_choice among the tools, unique tool names, valid parameter schemas, JSON call
arguments), and a structured output's grammar must parse (``protocol.STRUCTURED_OUTPUTS_RULE``).
A 400 passes only when
the request really breaks such a rule and the error names the field the rule names: the check
counts the prompt's tokens itself (``/tokenize`` on the same server) and redoes the arithmetic. The
test runs schemathesis with the built-in check excluded and this one in its place.

``every_operation_succeeds`` fails the run when an operation never answered 2xx, so a contract
that only ever produces errors cannot pass.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Optional
from urllib.parse import urlsplit

import httpx
import jsonschema
import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_MAX_TOKENS = {"/v1/completions": 16, "/v1/chat/completions": None}
_max_model_len: dict[str, int] = {}


@schemathesis.check
def positive_data_acceptance_or_documented_rule(ctx, response, case) -> Optional[bool]:
    try:
        return positive_data_acceptance(ctx, response, case)
    except AssertionError:
        if response.status_code == 400 and isinstance(case.body, dict):
            param = (response.json().get("error") or {}).get("param")
            if case.path in GENERATION_PATHS and param in broken_rules(case, response):
                return None
            if case.path == "/tokenize" and case.body.get("messages") and param in tool_rules(case.body):
                return None
        raise


def broken_rules(case, response) -> set[str]:
    """The fields that the request's documented cross-field rules name as broken."""
    body: dict[str, Any] = case.body
    server = Server(response)
    limit = server.max_model_len()
    broken: set[str] = set()
    if case.path == "/v1/completions":
        prompt = body["prompt"]
        prompts = [prompt] if isinstance(prompt, str) or is_token_id(prompt[0]) else prompt
        counts = [server.count({"prompt": item}) if isinstance(item, str) else len(item) for item in prompts]
        prompt_param, length_param = "prompt", "max_tokens"
        requested = body.get("max_tokens", DEFAULT_MAX_TOKENS[case.path])
        if body.get("best_of") is not None and body["best_of"] != body.get("n", 1):
            broken.add("best_of")
    else:
        broken |= tool_rules(body)
        if broken:  # the prompt cannot be rendered (nor counted) with them
            return broken
        counts = [server.count({"messages": body["messages"], "tools": body.get("tools"),
                                "add_generation_prompt": body.get("add_generation_prompt", True)})]
        prompt_param = "messages"
        if body.get("max_completion_tokens") is not None:
            length_param, requested = "max_completion_tokens", body["max_completion_tokens"]
        else:
            length_param, requested = "max_tokens", body.get("max_tokens")
    for count in counts:
        if count >= limit:
            broken.add(prompt_param)
        elif requested is not None and count + requested > limit:
            broken.add(length_param)
    room = requested if requested is not None else min(limit - count for count in counts)
    if body.get("min_tokens", 0) > room:
        broken.add("min_tokens")
    return broken | broken_structured_outputs_rule(case)


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
        if constraint is not None:
            SamplingParams(structured_outputs=constraint, ignore_eos=request.ignore_eos,
                           min_tokens=request.min_tokens, max_tokens=None)
    except ValueError as error:
        return {str(error).partition(":")[0]}
    return set()


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


class Server:
    """The server that answered ``response``, asked with the same credentials."""

    def __init__(self, response):
        parts = urlsplit(response.request.url)
        self.base_url = f"{parts.scheme}://{parts.netloc}"
        authorization = response.request.headers.get("Authorization")
        self.headers = {"Authorization": authorization} if authorization else {}

    def max_model_len(self) -> int:
        if self.base_url not in _max_model_len:
            models = httpx.get(self.base_url + "/v1/models", headers=self.headers, timeout=30).json()
            _max_model_len[self.base_url] = models["data"][0]["max_model_len"]
        return _max_model_len[self.base_url]

    def count(self, body: dict) -> int:
        answer = httpx.post(self.base_url + "/tokenize", json=body, headers=self.headers, timeout=30)
        answer.raise_for_status()
        return answer.json()["count"]


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
