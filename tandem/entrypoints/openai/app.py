"""The FastAPI app of an OpenAI-compatible server, built by ``create_app`` around a ``ServerState``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``,
``POST /reset_prefix_cache``. With an API key
set, every route but ``/health`` and ``/metrics`` needs ``Authorization: Bearer KEY``.
"""
from __future__ import annotations

import hmac

import msgspec

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tandem.entrypoints.openai.chat import create_chat_completion, render_chat_prompt
from tandem.entrypoints.openai.completions import create_completion
from tandem.entrypoints.openai.errors import OpenAIError, install_error_handlers
from tandem.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tandem.entrypoints.openai.serving import ServerState


def create_app(state: ServerState) -> FastAPI:
    """Build the app; it reads ``state`` and never outlives the engine client inside it."""
    app = FastAPI(title="tandem", summary="OpenAI-compatible LLM server", docs_url="/docs", redoc_url=None)
    app.state.server = state
    install_error_handlers(app)
    authorized = Depends(api_key_checker(state))
    add_generation_routes(app, state, authorized)
    add_model_routes(app, state, authorized)
    add_tokenizer_routes(app, state, authorized)
    add_operations_routes(app, state, authorized)
    add_transfer_routes(app, state)
    return app


def add_transfer_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/pd/info")
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
            raise OpenAIError(401, "invalid or missing API key (send Authorization: Bearer KEY)")
    return check_api_key


def add_generation_routes(app: FastAPI, state: ServerState, authorized) -> None:
    @app.post("/v1/completions", dependencies=[authorized])
    async def completions(body: CompletionRequest, request: Request):
        return await counting_rejections(state, create_completion(state, body, request))

    @app.post("/v1/chat/completions", dependencies=[authorized])
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


def add_model_routes(app: FastAPI, state: ServerState, authorized) -> None:
    @app.get("/v1/models", dependencies=[authorized])
    async def list_models():
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "tandem",
                 "root": state.model_path, "parent": None, "max_model_len": state.max_model_len}
                for name in state.served_model_names]
        return {"object": "list", "data": data}


def add_tokenizer_routes(app: FastAPI, state: ServerState, authorized) -> None:
    @app.post("/tokenize", dependencies=[authorized])
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            token_ids = render_chat_prompt(state, body.messages, body.add_generation_prompt, None).token_ids
        else:
            token_ids = list(state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        return {"count": len(token_ids), "max_model_len": state.max_model_len, "tokens": token_ids}

    @app.post("/detokenize", dependencies=[authorized])
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        if body.tokens:
            state.check_prompt_ids(body.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}


def add_operations_routes(app: FastAPI, state: ServerState, authorized) -> None:
    @app.get("/health")
    async def health():
        if not state.client.is_alive:
            return JSONResponse({"status": "unhealthy", "reason": state.client.dead_reason}, status_code=503)
        return {"status": "ok"}

    @app.post("/reset_prefix_cache", dependencies=[authorized])
    async def reset_prefix_cache():
        """Drop unreferenced prefix-cache pages (as vLLM's route of the same name)."""
        state.client.reset_prefix_cache()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
