"""``POST /v1/chat/completions``: chat template, n, logprobs/top_logprobs, SSE streaming."""
from __future__ import annotations

import dataclasses
import time
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from tandem.entrypoints.openai.assistant_output import AssistantOutputParser, MessageStream, message_dict
from tandem.entrypoints.openai.completions import ChoiceCursor, collect_final_outputs, has_news, usage_of
from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from tandem.entrypoints.openai.reasoning import REASONING_PARSERS
from tandem.entrypoints.openai.reasoning_constraint import with_reasoning_boundary
from tandem.entrypoints.openai.tool_choice import ToolPlan, plan_tools
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
)
from tandem.frontend.tokenizer import apply_chat_template
from tandem.outputs import CompletionOutput, PositionLogprobDict, RequestOutput
from tandem.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.structured.source import check as check_grammar


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """Tool results name the call they answer; only assistant turns carry calls."""
    for index, message in enumerate(messages):
        if message.role == "tool" and not message.tool_call_id:
            raise OpenAIError(400, f"messages[{index}].tool_call_id: a tool message must name the call it "
                                   "answers", f"messages[{index}].tool_call_id")
        if message.tool_calls and message.role != "assistant":
            raise OpenAIError(400, f"messages[{index}].tool_calls: only assistant messages carry tool calls",
                              f"messages[{index}].tool_calls")


def render_chat_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                       template_kwargs: Optional[dict], tools: Optional[list[dict]] = None) -> PromptInput:
    """Apply the tokenizer's chat template (with the request's tools, when it has some); template
    failures are the client's 400."""
    check_tool_messages(messages)
    template_kwargs = dict(template_kwargs or {})
    if tools:
        template_kwargs["tools"] = tools
    try:
        text = apply_chat_template(state.tokenizer, [message.template_dict() for message in messages],
                                   add_generation_prompt=add_generation_prompt, **template_kwargs)
    except ValueError as error:
        rejection = OpenAIError.from_value_error(error)
        if rejection.param is None:  # transformers' own words name no field: they are about the messages
            rejection = OpenAIError(400, f"messages: {error}", "messages")
        raise rejection from None
    except Exception as error:  # noqa: BLE001 - jinja raises its own types (raise_exception in templates)
        raise OpenAIError(400, f"messages: the chat template rejected the messages: {error}", "messages") from None
    return PromptInput(text, state.encode(text, "messages", add_special_tokens=False))


def chat_params(state: ServerState, body: ChatCompletionRequest, prompt: PromptInput,
                tool_plan: Optional[ToolPlan] = None) -> SamplingParams:
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
    state.check_sampling_fields(body, ("max_tokens", "max_completion_tokens", "min_tokens"))
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = state.resolve_max_tokens(len(prompt.token_ids), body.requested_max_tokens, "messages",
                                          max_tokens_param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = build_sampling_params(lambda: body.sampling_params(max_tokens=max_tokens, logprobs=logprobs,
                                                                prompt_logprobs=None))
    params = with_tool_constraint(params, tool_plan)
    reasoning_parser = state.tool_calling.reasoning_parser
    if reasoning_parser is None or params.structured_outputs is None:
        return params
    return with_reasoning_boundary(reasoning_parser, state.reasoning_end_token_ids, params, prompt.text or "")


def with_tool_constraint(params: SamplingParams, tool_plan: Optional[ToolPlan]) -> SamplingParams:
    """``required`` and named tool choices: the output must match the calls' JSON Schema."""
    schema = tool_plan.schema if tool_plan is not None else None
    if schema is None:
        return params
    if params.structured_outputs is not None:
        raise OpenAIError(400, f"tool_choice: {tool_plan.choice!r} tool choice constrains the output; it cannot be "
                               "combined with another output constraint (response_format, structured_outputs)",
                          "tool_choice")
    constraint = StructuredOutputsParams(json=schema)

    def constrained() -> SamplingParams:
        check_grammar(constraint, "tools")  # a parameter schema the grammar engine cannot take: a 400 now
        return dataclasses.replace(params, structured_outputs=constraint)

    # rebuilt, so the rules between a constraint and the other fields are checked (a 400 naming the field)
    return build_sampling_params(constrained)


def output_parser_factory(state: ServerState, tool_plan: ToolPlan, prompt: PromptInput):
    """Per choice, what reads its text into a message; None when the text is the content as is."""
    reasoning_class = REASONING_PARSERS.get(state.tool_calling.reasoning_parser or "")
    if reasoning_class is None and tool_plan.choice == "none":
        return None
    return lambda: AssistantOutputParser(reasoning_class(prompt.text or "") if reasoning_class else None,
                                         tool_plan.tool_parser(), tool_plan.max_calls)


class ChatRenderer:
    """Turns ``RequestOutput``s of one chat request into response dicts."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, request_id: str, model_name: str,
                 new_output_parser=None):
        self.state = state
        self.body = body
        self.request_id = request_id
        self.model_name = model_name
        self.created = int(time.time())
        # None: the text is the content; else a new ``AssistantOutputParser`` per choice
        self.new_output_parser = new_output_parser
        self.with_reasoning = state.tool_calling.reasoning_parser is not None

    def logprobs_dict(self, token_ids: list[int], positions: list[PositionLogprobDict]) -> Optional[dict]:
        if not self.body.logprobs:
            return None
        top = self.body.top_logprobs or 0
        content = []
        for token_id, position in zip(token_ids, positions):
            chosen = position[token_id]
            ranked = sorted((entry for entry in position.values() if entry.rank is not None and entry.rank <= top),
                            key=lambda entry: entry.rank)
            content.append({"token": chosen.decoded_token, "logprob": chosen.logprob,
                            "bytes": list(chosen.decoded_token.encode("utf-8")),
                            "top_logprobs": [{"token": entry.decoded_token, "logprob": entry.logprob,
                                              "bytes": list(entry.decoded_token.encode("utf-8"))} for entry in ranked]})
        return {"content": content}

    def choice_logprobs(self, choice: CompletionOutput, start: int) -> Optional[dict]:
        return self.logprobs_dict(choice.token_ids[start:], (choice.logprobs or [])[start:])

    def response(self, output: RequestOutput) -> dict:
        check_output_error(output)
        choices = []
        for choice in output.outputs:
            message, finish_reason = {"role": "assistant", "content": choice.text}, choice.finish_reason
            if self.new_output_parser is not None:
                parsed = self.new_output_parser().parse(choice.text, final=True)
                message, finish_reason = message_dict(parsed, self.with_reasoning), calls_finish(choice, parsed.calls)
            entry = {"index": choice.index, "message": message, "logprobs": self.choice_logprobs(choice, 0),
                     "finish_reason": finish_reason, "stop_reason": choice.stop_reason}
            if self.body.return_token_ids:
                entry["token_ids"] = choice.token_ids
            choices.append(entry)
        result = {"id": self.request_id, "object": "chat.completion", "created": self.created,
                  "model": self.model_name, "choices": choices, "usage": usage_of({0: output})}
        if self.body.return_token_ids:
            result["prompt_token_ids"] = output.prompt_token_ids
        return result

    def chunk(self, choices: list[dict], usage: Optional[dict] = None, prompt_token_ids=None) -> dict:
        chunk = {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model_name, "choices": choices}
        if self.body.include_usage_in_stream:
            chunk["usage"] = usage
        if prompt_token_ids is not None:
            chunk["prompt_token_ids"] = prompt_token_ids
        return chunk

    def role_chunk(self, index: int, prompt_token_ids: list[int]) -> dict:
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self.chunk([choice], prompt_token_ids=prompt_token_ids if self.body.return_token_ids else None)

    def delta_choice(self, choice: CompletionOutput, cursor: ChoiceCursor,
                     stream: Optional[MessageStream] = None) -> Optional[dict]:
        """The choice's news since ``cursor``; None when parsing holds all of it back for now."""
        delta, finish_reason = {"content": choice.text[cursor.sent_text:]}, choice.finish_reason
        if stream is not None:
            delta = stream.delta(choice.text, final=choice.finish_reason is not None)
            finish_reason = calls_finish(choice, stream.calls)
            if not delta and finish_reason is None and not self.wants_tokens:
                return None
        entry = {"index": choice.index, "delta": delta,
                 "logprobs": self.choice_logprobs(choice, cursor.sent_tokens),
                 "finish_reason": finish_reason, "stop_reason": choice.stop_reason}
        if self.body.return_token_ids:
            entry["token_ids"] = choice.token_ids[cursor.sent_tokens:]
        cursor.sent_text = len(choice.text)
        cursor.sent_tokens = len(choice.token_ids)
        cursor.finished = choice.finish_reason is not None
        return entry

    @property
    def wants_tokens(self) -> bool:
        return self.body.return_token_ids or self.body.logprobs


def calls_finish(choice: CompletionOutput, calls) -> Optional[str]:
    """A generation that ended on its own after making calls finished with ``tool_calls``."""
    return "tool_calls" if calls and choice.finish_reason == "stop" else choice.finish_reason


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request):
    """Validate, submit, and answer (JSON or SSE). Every check happens before anything is submitted."""
    model_name = state.check_model(body.model)
    tool_plan = plan_tools(state.tool_calling, body.tools, body.tool_choice, body.parallel_tool_calls)
    prompt = render_chat_prompt(state, body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                                tool_plan.tools)
    state.check_prompt_ids(prompt.token_ids, "messages")
    params = chat_params(state, body, prompt, tool_plan)
    transfer = transfer_params(body, state)
    state.check_capacity(1)
    request_id = new_request_id("chatcmpl")
    renderer = ChatRenderer(state, body, request_id, model_name, output_parser_factory(state, tool_plan, prompt))
    if body.stream:
        return streaming_response(stream_chat(state, renderer, prompt, params))
    finals = await run_until_disconnected(request, collect_final_outputs(state, request_id, [prompt], params,
                                                                         transfer))
    return JSONResponse(renderer.response(finals[0]))


async def stream_chat(state: ServerState, renderer: ChatRenderer, prompt: PromptInput,
                      params: SamplingParams) -> AsyncIterator[bytes]:
    """SSE: a role chunk per choice, content chunks, an optional usage chunk, then ``[DONE]``."""
    for index in range(params.n):
        yield sse_event(renderer.role_chunk(index, prompt.token_ids))
    cursors = [ChoiceCursor(echoed=True) for _ in range(params.n)]
    streams = [MessageStream(renderer.new_output_parser()) if renderer.new_output_parser else None
               for _ in range(params.n)]
    final: Optional[RequestOutput] = None
    try:
        async for _, output in merge_generations(state.client, renderer.request_id, [prompt], params,
                                                 transfer_params(renderer.body)):
            check_output_error(output)
            final = output
            for choice, cursor, stream in zip(output.outputs, cursors, streams):
                if has_news(renderer.body, choice, cursor):
                    entry = renderer.delta_choice(choice, cursor, stream)
                    if entry is not None:
                        yield sse_event(renderer.chunk([entry]))
        if renderer.body.include_usage_in_stream and final is not None:
            yield sse_event(renderer.chunk([], usage_of({0: final})))
    except Exception as error:  # noqa: BLE001 - reported in-stream: the status line is already sent
        yield sse_event(translate_engine_error(error).body())
    yield SSE_DONE
