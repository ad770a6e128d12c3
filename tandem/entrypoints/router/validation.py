"""What the router checks before it sends a request to any server, so a client error is answered
once, with the servers' own words, and no server starts on it.

The body is read as ``tandem serve`` reads it (a JSON object under a JSON content type, UTF-8)
and validated against the same request models, so every bound the schema states gets the same
400 naming the field. On top, what prefill/decode disaggregation serves: ``n`` of 1 and no prompt
logprobs (the engines' rule, ``engine/admission.py``). Rules that need the model (token ids below
its vocabulary, the prompt's length against its context) are the servers' to check; the router
passes their 4xx through once (``routing.py``).
"""
from __future__ import annotations

from typing import Optional

import msgspec
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from tandem.entrypoints.openai.errors import (BODY_NOT_OBJECT, OpenAIError, content_type_error, is_json_content_type,
                                              undecodable_body_error, validation_error)
from tandem.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


def read_request(path: str, raw: bytes, content_type: Optional[str], disaggregated: bool = True) -> dict:
    """The request body of ``path`` as a dict, checked (and, in front of prefill/decode pairs,
    held to what a pair serves); raises ``OpenAIError`` (400) otherwise."""
    if not is_json_content_type(content_type):
        raise content_type_error(content_type)
    try:
        body = msgspec.json.decode(raw)
    except UnicodeDecodeError:
        raise undecodable_body_error(raw) from None
    except msgspec.DecodeError as error:
        raise OpenAIError(400, f"malformed JSON body: {error}", "body") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, BODY_NOT_OBJECT, "body")
    try:
        request = REQUEST_MODELS[path].model_validate(with_token_lists_shortened(body))
    except ValidationError as error:
        located = [{**item, "loc": ("body", *item["loc"])} for item in error.errors()]
        raise validation_error(RequestValidationError(located)) from None
    if disaggregated:
        check_disaggregated(request)
    return body


def with_token_lists_shortened(body: dict) -> dict:
    """``body`` with each token-id prompt cut to its first id, for validation: checking every id of
    a long prompt in Python costs the router about a millisecond per 2,048 ids, and the servers
    check them all anyway (against the vocabulary, which the router does not know; their 400
    comes back once). Empty lists stay empty, so "must not be empty" is still the router's."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return body
    if all(isinstance(item, list) for item in prompt):
        return {**body, "prompt": [item[:1] for item in prompt]}
    if not any(isinstance(item, (str, list)) for item in prompt[:1]):
        return {**body, "prompt": prompt[:1]}
    return body


def check_disaggregated(request: BaseModel) -> None:
    """What a prefill/decode pair serves: one choice per prompt, no prompt logprobs."""
    if request.n != 1:
        raise OpenAIError(400, f"n: disaggregated prefill/decode serves n=1 only (got {request.n}); "
                               "send one request per choice", "n")
    if getattr(request, "echo", False) and getattr(request, "logprobs", None) is not None:
        raise OpenAIError(400, "echo: prompt logprobs (echo with logprobs) are not available with "
                               "disaggregated prefill/decode", "echo")
