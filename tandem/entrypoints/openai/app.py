"""The FastAPI app of an OpenAI-compatible server, built by ``create_app`` around a ``ServerState``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``,
``POST /reset_prefix_cache``, ``GET /pd/info``. With an API key set, every route but ``/health``,
``/metrics`` and ``/pd/info`` needs ``Authorization: Bearer KEY``. ``/openapi.json`` documents each
route's answers, errors included (see ``openapi.py``); a method a route does not declare gets 405
with ``Allow``.
"""
from __future__ import annotations

import hmac

import msgspec

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tandem.entrypoints.openai.chat import create_chat_completion, render_chat_prompt
from tandem.entrypoints.openai.completions import create_completion
from tandem.entrypoints.openai.errors import OpenAIError, install_error_handlers
from tandem.entrypoints.openai.openapi import error_responses, server_openapi, sse_content
from tandem.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tandem.entrypoints.openai.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    DetokenizeResponse,
    ModelList,
    StatusResponse,
    TokenizeResponse,
    TransferInfo,
    UnhealthyResponse,
)
from tandem.entrypoints.openai.request_id import RequestIdMiddleware
from tandem.entrypoints.openai.serving import ServerState


def create_app(state: ServerState) -> FastAPI:
    """Build the app; it reads ``state`` and never outlives the engine client inside it."""
    app = FastAPI(title="tandem", summary="OpenAI-compatible LLM server", docs_url="/docs", redoc_url=None)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)
    authenticated = state.api_key is not None
    authorized = Depends(api_key_checker(state))
    add_generation_routes(app, state, authorized, authenticated)
    add_model_routes(app, state, authorized, authenticated)
    add_tokenizer_routes(app, state, authorized, authenticated)
    add_operations_routes(app, state, authorized, authenticated)
    add_transfer_routes(app, state)
    protected = {route.path for route in app.routes if any(dependency.dependency is authorized.dependency
                                                            for dependency in getattr(route, "dependencies", ()))}
    endpoint = getattr(state.client, "transfer_endpoint", None)
    app.openapi = lambda: server_openapi(
        app, vocab_size=state.model_info.vocab_size, max_model_len=state.max_model_len,
        served_model_names=state.served_model_names, role=endpoint.role if endpoint is not None else "colocated",
        api_key_routes=protected if authenticated else None,
        auto_tool_choice=state.tool_calling.enable_auto_tool_choice)
    return app


def add_transfer_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/pd/info", response_model=None, responses={200: {"model": TransferInfo}})
    async def transfer_info():
        """A PD server's role, control (bootstrap) address and state layout, for the router."""
        endpoint = getattr(state.client, "transfer_endpoint", None)
        if endpoint is None:
            return {"role": "colocated", "served_model_names": state.served_model_names}
        return {"role": endpoint.role, "backend": endpoint.backend, "bootstrap_address": endpoint.bootstrap_address,
                "layout": msgspec.to_builtins(endpoint.layout), "served_model_names": state.served_model_names}


def api_key_checker(state: ServerState):
    """A dependency answering 401 unless the request carries the server's API key."""
    async def check_api_key(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise OpenAIError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                              headers={"WWW-Authenticate": "Bearer"})
    return check_api_key


def add_generation_routes(app: FastAPI, state: ServerState, authorized, authenticated: bool) -> None:
    errors = error_responses(400, 404, 500, 503, authenticated=authenticated)

    @app.post("/v1/completions", dependencies=[authorized], response_model=None,
              responses={200: {"model": CompletionResponse, "content": sse_content(CompletionChunk)}, **errors})
    async def completions(body: CompletionRequest, request: Request):
        return await counting_rejections(state, create_completion(state, body, request))

    @app.post("/v1/chat/completions", dependencies=[authorized], response_model=None,
              responses={200: {"model": ChatCompletionResponse, "content": sse_content(ChatCompletionChunk)},
                         **errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await counting_rejections(state, create_chat_completion(state, body, request))


async def counting_rejections(state: ServerState, handler):
    """Await the handler; a request refused before reaching the engine is counted as rejected."""
    try:
        return await handler
    except OpenAIError as error:
        if error.status_code in (400, 404, 503):
            state.metrics.count_rejected()
        raise


def add_model_routes(app: FastAPI, state: ServerState, authorized, authenticated: bool) -> None:
    @app.get("/v1/models", dependencies=[authorized], response_model=None,
             responses={200: {"model": ModelList}, **error_responses(authenticated=authenticated)})
    async def list_models():
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "tandem",
                 "root": state.model_path, "parent": None, "max_model_len": state.max_model_len}
                for name in state.served_model_names]
        return {"object": "list", "data": data}


def add_tokenizer_routes(app: FastAPI, state: ServerState, authorized, authenticated: bool) -> None:
    errors = error_responses(400, 404, authenticated=authenticated)

    @app.post("/tokenize", dependencies=[authorized], response_model=None,
              responses={200: {"model": TokenizeResponse}, **errors})
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if body.tools is not None and body.messages is None:
            raise OpenAIError(400, "tools: only with messages (the chat template shows them)", "tools")
        if body.messages is not None:
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
            token_ids = render_chat_prompt(state, body.messages, body.add_generation_prompt, None, tools).token_ids
        else:
            token_ids = state.encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        return {"count": len(token_ids), "max_model_len": state.max_model_len, "tokens": token_ids}

    @app.post("/detokenize", dependencies=[authorized], response_model=None,
              responses={200: {"model": DetokenizeResponse}, **errors})
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        state.check_token_ids(body.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}


def add_operations_routes(app: FastAPI, state: ServerState, authorized, authenticated: bool) -> None:
    @app.get("/health", response_model=None, responses={
        200: {"model": StatusResponse},
        503: {"model": UnhealthyResponse, "description": "The engine is not running (`reason` says why)."}})
    async def health():
        if not state.client.is_alive:
            return JSONResponse({"status": "unhealthy", "reason": state.client.dead_reason}, status_code=503)
        return {"status": "ok"}

    @app.post("/reset_prefix_cache", dependencies=[authorized], response_model=None,
              responses={200: {"model": StatusResponse}, **error_responses(authenticated=authenticated)})
    async def reset_prefix_cache():
        """Drop unreferenced prefix-cache pages (as vLLM's route of the same name)."""
        state.client.reset_prefix_cache()
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format"}})
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
