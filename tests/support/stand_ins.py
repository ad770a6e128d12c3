"""Stand-in servers: HTTP apps that answer as a prefill, decode or colocated server would (``/pd/info``,
``/health``, ``/v1/models``, ``POST /v1/completions``) with no engine behind them, for measuring
and testing the router alone. Each waits ``answer_seconds`` before answering; one made ``busy``
turns every generation request away with 503 and ``Retry-After`` as a server whose queue is full
does. Each answer names the server (``system_fingerprint``), so a test can see who served it;
``/served`` counts the generation requests it served.

    python -m tests.support.stand_ins ROLE PORT [--answer-ms MS] [--token-ms MS] [--busy]
        (ROLE: prefill, decode or colocated)
"""
from __future__ import annotations

import argparse
import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "stand-in"
LAYOUT = {"architecture": "LlamaForCausalLM", "model": {"vocab_size": 32000}, "page_size": 16, "num_groups": 1,
          "buffers": [[0, "layers.0", "kv", 2, "bfloat16", 65536, 65536, 0]], "metadata_row_bytes": 64}


def stand_in_app(role: str, answer_seconds: float = 0.0, busy: bool = False, name: str = "",
                 token_seconds: float = 0.0) -> FastAPI:
    app = FastAPI()
    served = {"requests": 0}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/pd/info")
    async def info():
        if role == "colocated":
            return {"role": role, "served_model_names": [MODEL]}
        return {"role": role, "backend": "nixl", "bootstrap_address": "tcp://127.0.0.1:1", "layout": LAYOUT,
                "served_model_names": [MODEL]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/served")
    async def count():
        return served

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if busy:
            return JSONResponse({"error": {"message": "the server is busy (--max-queued-requests)",
                                           "type": "service_unavailable_error", "param": None, "code": 503}},
                                status_code=503, headers={"Retry-After": "7"})
        served["requests"] += 1
        tokens = body.get("max_tokens", 1)
        await asyncio.sleep(answer_seconds)
        if not body.get("stream"):
            return JSONResponse({"id": "cmpl", "object": "text_completion", "model": MODEL, "system_fingerprint": name,
                                 "choices": [{"index": 0, "text": "x" * tokens, "token_ids": list(range(1, tokens + 1)),
                                              "finish_reason": "length"}]})

        async def events():
            for index in range(tokens):
                chunk = {"id": "cmpl", "object": "text_completion", "model": MODEL, "system_fingerprint": name,
                         "choices": [{"index": 0, "text": "x", "token_ids": [index + 1], "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                await asyncio.sleep(token_seconds)
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main(argv=None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("prefill", "decode", "colocated"))
    parser.add_argument("port", type=int)
    parser.add_argument("--answer-ms", type=float, default=0.0)
    parser.add_argument("--token-ms", type=float, default=0.0, help="between streamed tokens")
    parser.add_argument("--busy", action="store_true")
    arguments = parser.parse_args(argv)
    app = stand_in_app(arguments.role, arguments.answer_ms / 1e3, arguments.busy, f"{arguments.role}:{arguments.port}",
                       arguments.token_ms / 1e3)
    uvicorn.run(app, host="127.0.0.1", port=arguments.port, log_level="warning")


if __name__ == "__main__":
    main()
