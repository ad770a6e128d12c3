"""Pydantic models of the OpenAI-compatible responses: documentation only (``/openapi.json``); the
route handlers build the responses as plain dicts. The requests are in ``protocol.py``."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from tandem.entrypoints.openai.protocol import ToolCall


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error (400), authentication_error (401), not_found_error (404), "
                                  "method_not_allowed_error (405), internal_server_error (500), "
                                  "service_unavailable_error (503)")
    param: Optional[str] = Field(description="the offending field (``messages[0].role``, ``body`` for the body "
                                             "as a whole), or null")
    code: int = Field(description="the HTTP status")


class ErrorResponse(BaseModel):
    """OpenAI's error shape (what the official ``openai`` client parses)."""
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[str]
    stop_reason: Optional[Union[int, str]]
    token_ids: Optional[list[int]] = Field(None, description="with return_token_ids")
    prompt_token_ids: Optional[list[int]] = Field(None, description="with return_token_ids")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One streamed event of ``/v1/completions`` (choices carry only what is new)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = Field(None, description="with stream_options.include_usage: null but in the last "
                                                     "chunk, whose choices are empty")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str] = Field(description="null when only tool calls came out")
    reasoning_content: Optional[str] = Field(None, description="with --reasoning-parser: the thinking")
    tool_calls: Optional[list[ToolCall]] = Field(None, description="the calls the model made")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[str]
    stop_reason: Optional[Union[int, str]]
    token_ids: Optional[list[int]] = Field(None, description="with return_token_ids")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: Optional[list[int]] = Field(None, description="with return_token_ids")


class ToolCallDelta(BaseModel):
    index: int
    id: Optional[str] = Field(None, description="in the call's first delta, with type and name")
    type: Optional[Literal["function"]] = None
    function: dict[str, str] = Field(description="name (first delta only) and the next piece of arguments")


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = Field(None, description="in each choice's first chunk")
    content: Optional[str] = Field(None, description="absent in a delta that carries only thinking or calls")
    reasoning_content: Optional[str] = Field(None, description="with --reasoning-parser: the next piece "
                                                                "of thinking")
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[str]
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = Field(None, description="with return_token_ids")


class ChatCompletionChunk(BaseModel):
    """One streamed event of ``/v1/chat/completions``."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = Field(None, description="with stream_options.include_usage: null but in the last "
                                                     "chunk, whose choices are empty")
    prompt_token_ids: Optional[list[int]] = Field(None, description="with return_token_ids, in the first chunks")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class StatusResponse(BaseModel):
    status: Literal["ok"]


class UnhealthyResponse(BaseModel):
    status: Literal["unhealthy"]
    reason: Optional[str]


class TransferInfo(BaseModel):
    role: Literal["colocated", "prefill", "decode"]
    served_model_names: list[str]
    backend: Optional[str] = Field(None, description="PD servers only")
    bootstrap_address: Optional[str] = Field(None, description="PD servers only")
    layout: Optional[dict[str, Any]] = Field(None, description="PD servers only: the state layout")
