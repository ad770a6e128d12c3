"""What completions and chat share: server state, request checks, output merging, streaming."""
from __future__ import annotations

import asyncio
import functools
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Optional, TypeVar

import anyio
import msgspec
from fastapi import Request
from starlette.responses import StreamingResponse

from tandem.protocol import TransferParams
from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.entrypoints.openai.tool_choice import ToolCallingOptions
from tandem.frontend.engine_client import EngineClient, EngineDeadError, ModelInfo, RequestRejectedError
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.transfer.messages import check_room, derive_room

ResultType = TypeVar("ResultType")
RETRY_AFTER_SECONDS = 1
JSON_ENCODER = msgspec.json.Encoder()


@dataclass
class ServerState:
    """Everything the route handlers share; built once by the server, owned by its app."""
    client: EngineClient
    tokenizer: object
    model_info: ModelInfo
    served_model_names: list[str]
    model_path: str
    metrics: ServerMetrics
    api_key: Optional[str] = None
    max_num_seqs: int = 256
    max_queued_requests: Optional[int] = None
    tool_calling: ToolCallingOptions = field(default_factory=ToolCallingOptions)
    created: int = field(default_factory=lambda: int(time.time()))

    @functools.cached_property
    def reasoning_end_token_ids(self) -> tuple[int, ...]:
        """The token ids that end the thinking of ``--reasoning-parser``'s format (read from the
        vocabulary once)."""
        from tandem.entrypoints.openai.reasoning_constraint import reasoning_end_token_ids

        return reasoning_end_token_ids(self.tool_calling.reasoning_parser, self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    @property
    def default_model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: Optional[str]) -> str:
        """The model name to answer with; 404 for a name this server does not serve."""
        if name is None or name == "" or name in self.served_model_names:
            return self.default_model_name if not name else name
        raise OpenAIError(404, f"model: the model {name!r} does not exist; this server serves "
                               f"{', '.join(repr(served) for served in self.served_model_names)}", "model")

    def check_capacity(self, num_new_requests: int) -> None:
        """503 with Retry-After when admitting would push the waiting queue over its limit.

        Requests beyond ``max_num_seqs`` in flight count as waiting.
        """
        if not self.client.is_alive:
            raise OpenAIError(503, f"the engine is not available: {self.client.dead_reason}",
                              headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        if self.max_queued_requests is None:
            return
        waiting = self.client.num_in_flight + num_new_requests - self.max_num_seqs
        if waiting > self.max_queued_requests:
            raise OpenAIError(503, f"the server is overloaded: more than {self.max_queued_requests} requests "
                                   "would be waiting; retry later", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    def check_prompt_ids(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise OpenAIError(400, f"{param}: the prompt must not be empty", param)
        self.check_token_ids(token_ids, param)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.model_info.vocab_size
        bad = [token for token in token_ids if not 0 <= token < vocab_size]
        if bad:
            raise OpenAIError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param)

    def check_generation_lengths(self, body, names: tuple[str, ...]) -> None:
        """Each length field given is below the context length (the schema's maximum says so too),
        even one that another field overrides (``max_tokens`` beside ``max_completion_tokens``)."""
        for name in names:
            value = getattr(body, name, None)
            if value is not None and value >= self.max_model_len:
                raise OpenAIError(400, f"{name}: must be at most {self.max_model_len - 1} (this model's maximum "
                                       f"context length is {self.max_model_len} tokens), got {value}", name)

    def check_sampling_fields(self, body, length_names: tuple[str, ...]) -> None:
        """The bounds that depend on the served model, for the fields both generation routes share."""
        if body.stop_token_ids:
            self.check_token_ids(body.stop_token_ids, "stop_token_ids")
        self.check_generation_lengths(body, length_names)

    def encode(self, text: str, param: str, **options) -> list[int]:
        """Tokenize; a text the tokenizer cannot take is the client's 400 naming ``param``."""
        try:
            return list(self.tokenizer.encode(text, **options))
        except Exception as error:  # noqa: BLE001 - tokenizers raise several types
            raise OpenAIError(400, f"{param}: cannot be tokenized: {error}", param) from None

    def resolve_max_tokens(self, num_prompt_tokens: int, requested: Optional[int], prompt_param: str,
                           max_tokens_param: str = "max_tokens") -> int:
        """Check the context length; ``None`` means all the room left (as vLLM does)."""
        if requested is not None and requested < 1:
            raise OpenAIError(400, f"{max_tokens_param}: must be a positive integer, got {requested}", max_tokens_param)
        if num_prompt_tokens >= self.max_model_len:
            raise OpenAIError(400, f"{prompt_param}: this model's maximum context length is {self.max_model_len} "
                                   f"tokens, but the prompt has {num_prompt_tokens} tokens", prompt_param)
        if requested is None:
            return self.max_model_len - num_prompt_tokens
        if num_prompt_tokens + requested > self.max_model_len:
            raise OpenAIError(400, f"{max_tokens_param}: this model's maximum context length is "
                                   f"{self.max_model_len} tokens, but {num_prompt_tokens + requested} were requested "
                                   f"({num_prompt_tokens} in the prompt, {requested} to generate)", max_tokens_param)
        return requested

    def token_text(self, token_id: int) -> str:
        return self.client.output_processor.token_texts.text(token_id)


def build_sampling_params(build) -> SamplingParams:
    """Call ``build()``; its ``ValueError("field: message")`` becomes a 400 naming the field."""
    try:
        return build()
    except ValueError as error:
        raise OpenAIError.from_value_error(error) from None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class PromptInput:
    """One tokenized prompt of a request."""
    text: Optional[str]
    token_ids: list[int]


def transfer_params(body, state: Optional[ServerState] = None) -> Optional[TransferParams]:
    """The PD leg a router set in ``kv_transfer_params`` (None for an ordinary request); with
    ``state``, a leg of another role than the server's is a 400."""
    raw = getattr(body, "kv_transfer_params", None)
    if raw is None:
        return None
    if hasattr(raw, "model_dump"):
        raw = raw.model_dump()
    try:
        params = msgspec.convert(raw, TransferParams)
        check_room(params.room)
    except (msgspec.ValidationError, ValueError) as error:
        raise OpenAIError(400, f"kv_transfer_params: {error}", "kv_transfer_params") from None
    if state is not None:
        endpoint = getattr(state.client, "transfer_endpoint", None)
        role = endpoint.role if endpoint is not None else "colocated"
        if params.role != role:
            raise OpenAIError(400, f"kv_transfer_params: a {params.role} leg sent to a {role} server",
                              "kv_transfer_params")
    return params


def prompt_transfer(transfer: Optional[TransferParams], index: int) -> Optional[TransferParams]:
    """Each prompt of a multi-prompt request gets its own room (both legs derive it alike)."""
    if transfer is None or index == 0:
        return transfer
    return msgspec.structs.replace(transfer, room=derive_room(transfer.room, index))


async def merge_generations(client: EngineClient, request_id: str, prompts: list[PromptInput],
                            params: SamplingParams, transfer: Optional[TransferParams] = None,
                            ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run one engine request per prompt; yield ``(prompt_index, newest output)`` as they come.

    Leaving early (or being cancelled) closes every generation, which aborts what still runs.
    """
    arrival_time = time.time()
    generators = [client.generate(f"{request_id}-{index}", prompt.text, prompt.token_ids, params, arrival_time,
                                  transfer=prompt_transfer(transfer, index))
                  for index, prompt in enumerate(prompts)]
    if len(generators) == 1:
        try:
            async for output in generators[0]:
                yield 0, output
        finally:
            await generators[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generator) -> None:
        try:
            async for output in generator:
                queue.put_nowait((index, output, None))
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, None, error))
            return
        queue.put_nowait((index, None, None))

    tasks = [asyncio.create_task(pump(index, generator)) for index, generator in enumerate(generators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                remaining -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for generator in generators:
            await generator.aclose()


def translate_engine_error(error: BaseException) -> OpenAIError:
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, RequestRejectedError):
        return OpenAIError.from_value_error(error)
    if isinstance(error, EngineDeadError):
        return OpenAIError(503, str(error), headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    return OpenAIError(500, f"internal error: {error}")


def check_output_error(output: RequestOutput) -> None:
    if output.error is not None:
        raise OpenAIError(500, f"the engine failed this request: {output.error}")


async def run_until_disconnected(request: Request, work: Awaitable[ResultType]) -> ResultType:
    """Await ``work`` unless the client disconnects first; then cancel it (which aborts it)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        raise OpenAIError(499, "client disconnected")
    return work_task.result()


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse_event(payload: dict) -> bytes:
    return b"data: " + JSON_ENCODER.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class DisconnectAwareStreamingResponse(StreamingResponse):
    """A streaming response that notices a client going away even between chunks.

    On disconnect the body iterator is cancelled and closed at once, so its ``finally`` blocks
    abort the engine requests (freeing their pages) without waiting for the next chunk.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as task_group:
                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    task_group.cancel_scope.cancel()

                async def listen_then_stop() -> None:
                    await self.listen_for_disconnect(receive)
                    task_group.cancel_scope.cancel()

                task_group.start_soon(stream_then_stop)
                task_group.start_soon(listen_then_stop)
        finally:
            await self.body_iterator.aclose()


def streaming_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return DisconnectAwareStreamingResponse(events, media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}
