"""Running the OpenAI-compatible server: engine process up, HTTP on, drain on SIGINT/SIGTERM.

Order of events (the frontend process owns all of it)::

    load tokenizer -> start engine process, wait for ready -> serve HTTP (uvicorn)
    SIGINT/SIGTERM -> stop accepting, let in-flight requests finish (at most shutdown_timeout s,
                      then cancel them, which aborts them) -> stop the engine process -> exit 0
"""
from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import Optional

import uvicorn

from tandem.config import EngineConfig
from tandem.protocol import EngineStats
from tandem.entrypoints import event_loop
from tandem.entrypoints.event_loop import DrainingServer
from tandem.entrypoints.openai.app import create_app
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.entrypoints.openai.serving import ServerState
from tandem.entrypoints.openai.tool_choice import ToolCallingOptions
from tandem.frontend.engine_client import DEFAULT_CORE_CLASS, EngineClient, EngineDeadError
from tandem.frontend.tokenizer import load_tokenizer

logger = logging.getLogger("tandem.server")


@dataclass(frozen=True)
class ServerOptions:
    """Frontend settings (the engine's are in ``EngineConfig``)."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    served_model_names: tuple[str, ...] = ()
    log_level: str = "info"
    max_queued_requests: Optional[int] = None
    shutdown_timeout: float = 30.0
    engine_ready_timeout: float = 600.0
    core_class_path: str = DEFAULT_CORE_CLASS
    tool_calling: ToolCallingOptions = ToolCallingOptions()


class StatsReader:
    """Late-bound view of the engine client's newest stats (the metrics exist before the client)."""

    def __init__(self):
        self.client: Optional[EngineClient] = None

    def __call__(self) -> EngineStats:
        return self.client.stats if self.client is not None else EngineStats()


def interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


async def serve(config: EngineConfig, options: ServerOptions) -> int:
    """Serve until a signal arrives (status 0) or the engine dies (status 1); always stops the
    engine process before returning."""
    stats_reader = StatsReader()
    metrics = ServerMetrics(stats_reader)
    client = EngineClient(config, core_class_path=options.core_class_path, log_level=options.log_level,
                          observer=metrics)
    stats_reader.client = client
    logger.info("starting the engine process (model %s)", config.model)
    try:
        client.launch()  # the engine loads its model while this process loads the tokenizer
        tokenizer = client.tokenizer = await asyncio.to_thread(load_tokenizer, config.tokenizer or config.model)
        model_info = await client.start(options.engine_ready_timeout)
        logger.info("engine ready: vocab %d, max model length %d", model_info.vocab_size, model_info.max_model_len)
        state = ServerState(client=client, tokenizer=tokenizer, model_info=model_info,
                            served_model_names=list(options.served_model_names or (config.model,)),
                            model_path=config.model, metrics=metrics, api_key=options.api_key,
                            max_num_seqs=config.max_num_seqs, max_queued_requests=options.max_queued_requests,
                            tool_calling=options.tool_calling)
        warn_special_markers(tokenizer, options.tool_calling)
        return await run_http(create_app(state), client, options)
    finally:
        logger.info("stopping the engine process")
        await client.shutdown()
        logger.info("stopped")


def warn_special_markers(tokenizer, tool_calling: ToolCallingOptions) -> None:
    """The parsers read the detokenized text: a marker that is a special token of this tokenizer
    is dropped from it unless the request sets ``skip_special_tokens: false``."""
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    for marker in tool_calling_markers(tool_calling):
        if marker in special:
            logger.warning("%r is a special token of this tokenizer: requests must set skip_special_tokens to "
                           "false for the parsers to see it", marker)


def tool_calling_markers(tool_calling: ToolCallingOptions) -> list[str]:
    from tandem.entrypoints.openai.reasoning import REASONING_PARSERS
    from tandem.entrypoints.openai.tool_parsers import TOOL_PARSERS

    markers: list[str] = []
    if tool_calling.tool_call_parser:
        markers.extend(TOOL_PARSERS[tool_calling.tool_call_parser].markers)
    if tool_calling.reasoning_parser:
        parser = REASONING_PARSERS[tool_calling.reasoning_parser]
        markers.extend((parser.start_marker, parser.end_marker))
    return markers


async def run_http(app, client: EngineClient, options: ServerOptions) -> int:
    """Serve HTTP until a signal (0) or until the engine dies (1: the server must not linger)."""
    uvicorn_config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                                    access_log=options.log_level == "debug",
                                    timeout_graceful_shutdown=options.shutdown_timeout, timeout_keep_alive=30)
    server = DrainingServer(uvicorn_config)
    engine_died: list[str] = []

    def stop_serving(reason: str) -> None:
        engine_died.append(reason)
        server.should_exit = True

    client.on_engine_death = stop_serving
    logger.info("serving %s on http://%s:%d", app.state.server.default_model_name, options.host, options.port)
    await server.serve()
    if not server.started:
        raise SystemExit(f"could not serve on {options.host}:{options.port}")
    if engine_died:
        logger.error("exiting because the engine died: %s", engine_died[0])
        return 1
    return 0


def run_server(config: EngineConfig, options: ServerOptions) -> int:
    """Blocking entry point for ``tandem serve``; returns the process exit status."""
    signal.signal(signal.SIGTERM, interrupt)
    try:
        return event_loop.run(serve(config, options))
    except KeyboardInterrupt:
        logger.info("interrupted")
        return 0
    except (EngineDeadError, OSError) as error:
        logger.error("cannot serve: %s", error)
        return 1
