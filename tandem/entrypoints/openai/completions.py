"""``POST /v1/completions``: prompts (text, texts, token ids), echo, logprobs, n, streaming."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.protocol import CompletionRequest
from tandem.entrypoints.openai.serving import (
    SSE_DONE,
    PromptInput,
    ServerState,
    build_sampling_params,
    check_output_error,
    merge_generations,
    transfer_params,
    new_request_id,
    run_until_disconnected,
    sse_event,
    streaming_response,
    translate_engine_error,
    usage_dict,
)
from tandem.outputs import CompletionOutput, PositionLogprobDict, RequestOutput
from tandem.sampling_params import SamplingParams


def tokenize_prompts(state: ServerState, prompt) -> list[PromptInput]:
    """Normalise the four accepted prompt shapes to tokenized prompts (checked against the vocab)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt: must not be empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    prompts = [PromptInput(item, state.encode(item, "prompt")) if isinstance(item, str)
               else PromptInput(None, list(item)) for item in prompt]
    for item in prompts:
        state.check_prompt_ids(item.token_ids, "prompt")
    return prompts


def completion_params(state: ServerState, body: CompletionRequest, prompts: list[PromptInput]) -> SamplingParams:
    if body.best_of is not None and body.best_of != body.n:
        raise OpenAIError(400, "best_of: only best_of equal to n is supported", "best_of")
    if body.suffix:
        raise OpenAIError(400, "suffix: not supported", "suffix")
    state.check_sampling_fields(body, ("max_tokens", "min_tokens"))
    max_tokens = min(state.resolve_max_tokens(len(prompt.token_ids), body.max_tokens, "prompt") for prompt in prompts)
    wants_prompt_logprobs = body.echo and body.logprobs is not None
    return build_sampling_params(lambda: body.sampling_params(
        max_tokens=max_tokens, logprobs=body.logprobs, prompt_logprobs=body.logprobs if wants_prompt_logprobs else None))


def top_logprobs_by_text(position: PositionLogprobDict) -> dict[str, float]:
    """The legacy format keys entries by token text; of tokens with equal text the likelier wins."""
    result: dict[str, float] = {}
    for entry in sorted(position.values(), key=lambda entry: -entry.logprob):
        result.setdefault(entry.decoded_token, entry.logprob)
    return result


@dataclass
class ChoiceCursor:
    """How much of one choice has been sent to the client (streaming) so far."""
    sent_tokens: int = 0
    sent_text: int = 0
    text_offset: int = 0
    echoed: bool = False
    finished: bool = False


class CompletionRenderer:
    """Turns ``RequestOutput``s of one completions request into response dicts."""

    def __init__(self, state: ServerState, body: CompletionRequest, request_id: str, model_name: str,
                 prompts: list[PromptInput]):
        self.state = state
        self.body = body
        self.request_id = request_id
        self.model_name = model_name
        self.prompts = prompts
        self.created = int(time.time())

    def prompt_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        return prompt.text if prompt.text is not None else self.state.tokenizer.decode(prompt.token_ids)

    def logprobs_dict(self, token_ids: list[int], positions: list[Optional[PositionLogprobDict]],
                      cursor: ChoiceCursor) -> dict:
        """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, position in zip(token_ids, positions):
            text = position[token_id].decoded_token if position else self.state.token_text(token_id)
            result["tokens"].append(text)
            result["token_logprobs"].append(position[token_id].logprob if position else None)
            result["top_logprobs"].append(top_logprobs_by_text(position) if position else None)
            result["text_offset"].append(cursor.text_offset)
            cursor.text_offset += len(text)
        return result

    def choice_dict(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput,
                    cursor: ChoiceCursor) -> dict:
        """The part of ``choice`` not yet covered by ``cursor`` (all of it when not streaming)."""
        text = choice.text[cursor.sent_text:]
        token_ids = choice.token_ids[cursor.sent_tokens:]
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = self._choice_logprobs(prompt_index, output, choice, cursor)
        if self.body.echo and not cursor.echoed:
            text = self.prompt_text(prompt_index) + text
        result = {"index": prompt_index * self.body.n + choice.index, "text": text, "logprobs": logprobs,
                  "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
        if self.body.return_token_ids:
            result["token_ids"] = token_ids
            if not cursor.echoed:
                result["prompt_token_ids"] = output.prompt_token_ids
        cursor.echoed = True
        cursor.sent_text = len(choice.text)
        cursor.sent_tokens = len(choice.token_ids)
        cursor.finished = choice.finish_reason is not None
        return result

    def _choice_logprobs(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput,
                         cursor: ChoiceCursor) -> dict:
        token_ids = choice.token_ids[cursor.sent_tokens:]
        positions = (choice.logprobs or [])[cursor.sent_tokens:]
        if self.body.echo and not cursor.echoed:
            prompt_positions = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
            token_ids = output.prompt_token_ids + token_ids
            positions = list(prompt_positions) + list(positions)
        return self.logprobs_dict(token_ids, positions, cursor)

    def response(self, finals: dict[int, RequestOutput]) -> dict:
        choices, num_prompt_tokens, num_completion_tokens, num_cached_tokens = [], 0, 0, 0
        for prompt_index in sorted(finals):
            output = finals[prompt_index]
            check_output_error(output)
            num_prompt_tokens += len(output.prompt_token_ids)
            num_cached_tokens += output.num_cached_tokens
            for choice in output.outputs:
                num_completion_tokens += len(choice.token_ids)
                choices.append(self.choice_dict(prompt_index, output, choice, ChoiceCursor()))
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.model_name, "choices": choices,
                "usage": usage_dict(num_prompt_tokens, num_completion_tokens, num_cached_tokens)}

    def chunk(self, choices: list[dict], usage: Optional[dict] = None) -> dict:
        chunk = {"id": self.request_id, "object": "text_completion", "created": self.created,
                 "model": self.model_name, "choices": choices}
        if self.body.include_usage_in_stream:
            chunk["usage"] = usage
        return chunk


async def create_completion(state: ServerState, body: CompletionRequest, request: Request):
    """Validate, submit, and answer (JSON or SSE). Every check happens before anything is submitted."""
    model_name = state.check_model(body.model)
    prompts = tokenize_prompts(state, body.prompt)
    params = completion_params(state, body, prompts)
    transfer = transfer_params(body, state)
    state.check_capacity(len(prompts))
    request_id = new_request_id("cmpl")
    renderer = CompletionRenderer(state, body, request_id, model_name, prompts)
    if body.stream:
        return streaming_response(stream_completion(state, renderer, params))
    finals = await run_until_disconnected(request, collect_final_outputs(state, request_id, prompts, params, transfer))
    return JSONResponse(renderer.response(finals))


async def collect_final_outputs(state: ServerState, request_id: str, prompts: list[PromptInput],
                                params: SamplingParams, transfer=None) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    try:
        async for prompt_index, output in merge_generations(state.client, request_id, prompts, params, transfer):
            finals[prompt_index] = output
    except OpenAIError:
        raise
    except Exception as error:  # noqa: BLE001 - engine failures become OpenAI errors
        raise translate_engine_error(error) from None
    return finals


async def stream_completion(state: ServerState, renderer: CompletionRenderer,
                            params: SamplingParams) -> AsyncIterator[bytes]:
    """SSE: one chunk per choice that has news, an optional usage chunk, then ``[DONE]``."""
    cursors: dict[tuple[int, int], ChoiceCursor] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        async for prompt_index, output in merge_generations(state.client, renderer.request_id,
                                                            renderer.prompts, params,
                                                            transfer_params(renderer.body)):
            check_output_error(output)
            finals[prompt_index] = output
            for choice in output.outputs:
                cursor = cursors.setdefault((prompt_index, choice.index), ChoiceCursor())
                if has_news(renderer.body, choice, cursor):
                    yield sse_event(renderer.chunk([renderer.choice_dict(prompt_index, output, choice, cursor)]))
        if renderer.body.include_usage_in_stream:
            yield sse_event(renderer.chunk([], usage_of(finals)))
    except Exception as error:  # noqa: BLE001 - reported in-stream: the status line is already sent
        yield sse_event(translate_engine_error(error).body())
    yield SSE_DONE


def has_news(body, choice: CompletionOutput, cursor: ChoiceCursor) -> bool:
    if cursor.finished:
        return False
    if choice.finish_reason is not None or len(choice.text) > cursor.sent_text:
        return True
    if not cursor.echoed and getattr(body, "echo", False):
        return True
    wants_tokens = body.return_token_ids or body.logprobs not in (None, False)
    return wants_tokens and len(choice.token_ids) > cursor.sent_tokens


def usage_of(finals: dict[int, RequestOutput]) -> dict:
    return usage_dict(sum(len(output.prompt_token_ids) for output in finals.values()),
                      sum(len(choice.token_ids) for output in finals.values() for choice in output.outputs),
                      sum(output.num_cached_tokens for output in finals.values()))
