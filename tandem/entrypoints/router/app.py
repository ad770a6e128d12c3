"""The router's HTTP face: the OpenAI generation routes (forwarded as two legs, or whole to one
colocated server, ``routing.py``), ``/v1/models``, ``/health`` (from the health monitor's view:
503 while a role has no healthy server) and ``/metrics``. With an API key, the ``/v1`` routes
need ``Authorization: Bearer KEY`` exactly as on ``tandem serve``."""
from __future__ import annotations

import time

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tandem.entrypoints.openai.app import api_key_checker
from tandem.entrypoints.openai.errors import OpenAIError, install_error_handlers
from tandem.entrypoints.openai.request_id import RequestIdMiddleware
from tandem.entrypoints.router.routing import Router
from tandem.entrypoints.router.validation import read_request


def create_router_app(router: Router) -> FastAPI:
    app = FastAPI(title="tandem router", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)
    authorized = [Depends(api_key_checker(router))]

    async def forward(path: str, request: Request) -> Response:
        arrival = time.perf_counter()
        try:
            body = read_request(path, await request.body(), request.headers.get("content-type"),
                                disaggregated=router.roles != ("colocated",))
        except OpenAIError as error:
            router.count_client_error(request, error.message)
            raise
        return await router.dispatch(path, body, request, arrival)

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request):
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request):
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models", dependencies=authorized)
    async def models():
        created = int(time.time())
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "tandem"}
                                           for name in sorted(router.pools)]}

    @app.get("/health")
    async def health():
        servers = [{"url": backend.url, "role": backend.role, "healthy": backend.healthy,
                    **({"replica": backend.replica} if backend.replica else {}),
                    **({"problem": backend.problem} if not backend.healthy else {})} for backend in router.backends]
        missing = [role for role in router.roles
                   if not any(backend.healthy for backend in router.backends if backend.role == role)]
        if missing:
            return JSONResponse({"status": "unhealthy", "reason": f"no healthy {' or '.join(missing)} server",
                                 "servers": servers}, status_code=503)
        return {"status": "ok", "servers": servers}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app
