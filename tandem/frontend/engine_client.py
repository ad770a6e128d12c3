"""The frontend's handle on the engine process: start, submit, stream outputs, abort, shut down.

``EngineClient`` owns the engine process (started in ``start``, ended in ``shutdown``), both ZMQ
sockets, the ``OutputProcessor`` and one ``RequestStream`` per live request. It runs inside the
frontend's asyncio loop: a receive task folds each ``EngineStepMessage`` into outputs at once
(detokenizing, checking stop strings, telling the engine which sequences a stop string ended)
and hands every changed request its newest cumulative output. A slow consumer therefore sees
several steps merged into one output, never a backlog.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

import msgspec
import zmq
import zmq.asyncio

from tandem.config import EngineConfig
from tandem.protocol import (
    AbortRequestsMessage,
    AddRequestMessage,
    EngineFailedMessage,
    EngineMessage,
    EngineReadyMessage,
    EngineRequest,
    EngineStats,
    EngineStepMessage,
    FinishSequencesMessage,
    ResetPrefixCacheMessage,
    ShutdownMessage,
    TransferParams,
)
from tandem.frontend.output_processor import OutputProcessor
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger("tandem.frontend")

DEFAULT_CORE_CLASS = "tandem.engine.core:EngineCore"
LIVENESS_CHECK_SECONDS = 0.5


class EngineDeadError(RuntimeError):
    """The engine process failed or exited; no request can be served any more."""


class RequestRejectedError(ValueError):
    """The engine refused a request at admission; the message starts with the field's name."""


@dataclass(frozen=True)
class ModelInfo:
    """What the engine reported when it became ready."""
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]


class NullRequestTimer:
    """Observer of one request's progress that records nothing (when no metrics are kept)."""

    def record_output(self, output: RequestOutput, now: float) -> None:
        pass

    def record_end(self, outcome: str, now: float) -> None:
        pass


class NullObserver:
    def start_request(self, num_prompt_tokens: int, arrival_time: float) -> NullRequestTimer:
        return NullRequestTimer()


class RequestStream:
    """Hand-off of one request's newest output from the receive task to the request's handler.

    Owned by the ``EngineClient`` from ``add_request`` until the request finishes, fails or is
    aborted; the handler only reads it.
    """

    def __init__(self, request_id: str, timer):
        self.request_id = request_id
        self.timer = timer
        self.latest: Optional[RequestOutput] = None
        self.error: Optional[BaseException] = None
        self.event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self.latest = output
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    async def next(self) -> RequestOutput:
        """Wait for a newer output than the last one returned; raise the failure if any."""
        await self.event.wait()
        self.event.clear()
        if self.error is not None:
            raise self.error
        output, self.latest = self.latest, None
        return output


class EngineClient:
    """Frontend side of one engine process (see the module docstring for ownership)."""

    def __init__(self, config: EngineConfig, tokenizer=None, *, core_class_path: str = DEFAULT_CORE_CLASS,
                 log_level: str = "info", observer=None,
                 on_engine_death: Optional[Callable[[str], None]] = None):
        self.config = config
        self.tokenizer = tokenizer  # may be set after ``launch`` (loaded while the engine starts)
        self.core_class_path = core_class_path
        self.log_level = log_level
        self.observer = observer or NullObserver()
        self.on_engine_death = on_engine_death  # called once if the engine dies while serving
        self.output_processor: Optional[OutputProcessor] = None
        self.streams: dict[str, RequestStream] = {}
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineMessage)
        self.stats = EngineStats()
        self.model_info: Optional[ModelInfo] = None
        self.transfer_endpoint = None
        self.dead_reason: Optional[str] = None
        self.process: Optional[multiprocessing.Process] = None
        self.socket_directory: Optional[str] = None
        self.sync_context: Optional[zmq.Context] = None
        self.async_context: Optional[zmq.asyncio.Context] = None
        self.input_socket: Optional[zmq.Socket] = None
        self.output_socket: Optional[zmq.asyncio.Socket] = None
        self.tasks: list[asyncio.Task] = []
        self.shutting_down = False

    # ---- lifetime -------------------------------------------------------------------------

    def launch(self) -> None:
        """Bind the sockets and start the engine process; returns at once (idempotent)."""
        if self.process is not None:
            return
        self._bind_sockets()
        self.process = multiprocessing.get_context("spawn").Process(
            target=_engine_process_main, name="tandem-engine", daemon=False,
            args=(self.config, self.input_address, self.output_address, self.core_class_path,
                  os.getpid(), self.log_level))
        self.process.start()

    async def start(self, ready_timeout: float = 600.0) -> ModelInfo:
        """``launch`` if needed, then wait until the engine reports ready; needs ``tokenizer`` set.

        Raises ``EngineDeadError`` if the engine fails, exits, or is not ready in time.
        """
        self.launch()
        self.output_processor = OutputProcessor(self.tokenizer)
        try:
            ready = await self._wait_ready(ready_timeout)
        except BaseException:
            await self.shutdown(timeout=5.0)
            raise
        self.model_info = ModelInfo(ready.vocab_size, ready.max_model_len, tuple(ready.eos_token_ids))
        self.stats = ready.stats
        self.transfer_endpoint = ready.transfer  # PD engines: role, control address, state layout
        self.tasks = [asyncio.create_task(self._receive_loop(), name="tandem-engine-receive"),
                      asyncio.create_task(self._watch_process(), name="tandem-engine-watch")]
        return self.model_info

    def _bind_sockets(self) -> None:
        self.socket_directory = tempfile.mkdtemp(prefix="tandem-ipc-")
        self.input_address = f"ipc://{self.socket_directory}/input"
        self.output_address = f"ipc://{self.socket_directory}/output"
        self.sync_context = zmq.Context()
        self.input_socket = self.sync_context.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(self.input_address)
        self.async_context = zmq.asyncio.Context()
        self.output_socket = self.async_context.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(self.output_address)

    async def _wait_ready(self, timeout: float) -> EngineReadyMessage:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.output_socket.poll(timeout=int(LIVENESS_CHECK_SECONDS * 1000)):
                message = self.decoder.decode(await self.output_socket.recv())
                if isinstance(message, EngineReadyMessage):
                    return message
                if isinstance(message, EngineFailedMessage):
                    raise EngineDeadError(f"engine failed to start: {message.error}")
            elif not self.process.is_alive():
                raise EngineDeadError(f"engine process exited during start-up (exit code {self.process.exitcode})")
        raise EngineDeadError(f"engine not ready after {timeout:.0f} s")

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (asking first, killing after ``timeout``) and free the sockets.

        In-flight requests fail with ``EngineDeadError``; callers drain them before this.
        """
        self.shutting_down = True
        for task in self.tasks:
            task.cancel()
        if self.process is None:
            return
        self._fail_all(EngineDeadError("server is shutting down"))
        if self.process is not None and self.process.is_alive():
            try:  # an engine that already failed may have closed its end: never block on it
                self.input_socket.send(self.encoder.encode(ShutdownMessage()), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            await asyncio.to_thread(self.process.join, timeout)
            if self.process.is_alive():
                logger.warning("engine process did not exit in %.0f s; killing it", timeout)
                self.process.kill()
                await asyncio.to_thread(self.process.join, 5.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self.input_socket, self.output_socket):
            if socket is not None:
                socket.close(linger=0)
        for context in (self.sync_context, self.async_context):
            if context is not None:
                context.term()
        self.input_socket = self.output_socket = None
        self.sync_context = self.async_context = None
        if self.socket_directory:
            shutil.rmtree(self.socket_directory, ignore_errors=True)
            self.socket_directory = None

    # ---- requests -------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self.model_info is not None

    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: Optional[float] = None,
                    transfer: Optional[TransferParams] = None) -> RequestStream:
        """Register the request and send it to the engine; its outputs arrive on the stream.

        A request that cannot be encoded or sent raises and leaves nothing registered (it would
        otherwise count as in flight forever).
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        arrival_time = time.time() if arrival_time is None else arrival_time
        request = EngineRequest(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                                sampling_params=params, arrival_time=arrival_time, transfer=transfer)
        payload = self.encoder.encode(AddRequestMessage(request=request))
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
        stream = RequestStream(request_id, self.observer.start_request(len(prompt_token_ids), arrival_time))
        self.streams[request_id] = stream
        try:
            self.input_socket.send(payload, copy=False)
        except BaseException:
            del self.streams[request_id]
            self.output_processor.abort(request_id)
            stream.timer.record_end("error", time.time())
            raise
        return stream

    async def generate(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                       params: SamplingParams, arrival_time: Optional[float] = None,
                       transfer: Optional[TransferParams] = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's newest cumulative output until it finishes.

        Leaving early (the consumer stops iterating, or its task is cancelled because the client
        disconnected) aborts the request in the engine, which frees its pages at once.
        """
        stream = self.add_request(request_id, prompt, prompt_token_ids, params, arrival_time, transfer)
        finished = False
        try:
            while not finished:
                output = await stream.next()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request now (no-op when it already finished or failed)."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        self.output_processor.abort(request_id)
        stream.timer.record_end("abort", time.time())
        if self.dead_reason is None and self.input_socket is not None:
            self._send(AbortRequestsMessage(request_ids=[request_id]))

    def reset_prefix_cache(self) -> None:
        """Ask the engine to drop unreferenced prefix-cache pages (stats follow in its reply)."""
        if self.dead_reason is None and self.input_socket is not None:
            self._send(ResetPrefixCacheMessage())

    def _send(self, message) -> None:
        self.input_socket.send(self.encoder.encode(message), copy=False)

    # ---- engine messages ------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        try:
            while True:
                message = self.decoder.decode(await self.output_socket.recv())
                if isinstance(message, EngineStepMessage):
                    self._on_step(message)
                elif isinstance(message, EngineFailedMessage):
                    self._mark_dead(f"engine failed: {message.error}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - a broken receive loop makes the engine unusable
            logger.exception("engine receive loop failed")
            self._mark_dead(f"engine receive loop failed: {error}")

    def _on_step(self, message: EngineStepMessage) -> None:
        now = time.time()
        self.stats = message.stats
        outputs, stopped = self.output_processor.process(message.deltas)
        if stopped:
            self._send(FinishSequencesMessage(keys=stopped))
        for output in outputs:
            self._deliver(output, now)
        for rejected in message.rejected:
            self._reject(rejected.request_id, rejected.error, now)

    def _deliver(self, output: RequestOutput, now: float) -> None:
        stream = self.streams.get(output.request_id)
        if stream is None:
            return
        stream.timer.record_output(output, now)
        if output.finished:
            del self.streams[output.request_id]
            stream.timer.record_end(_outcome(output), now)
        stream.put(output)

    def _reject(self, request_id: str, error: str, now: float) -> None:
        self.output_processor.abort(request_id)
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.timer.record_end("rejected", now)
            stream.fail(RequestRejectedError(error))

    async def _watch_process(self) -> None:
        while self.process.is_alive():
            await asyncio.sleep(LIVENESS_CHECK_SECONDS)
        if not self.shutting_down:
            self._mark_dead(f"engine process exited unexpectedly (exit code {self.process.exitcode})")

    def _mark_dead(self, reason: str) -> None:
        first = self.dead_reason is None
        if first:
            logger.error("%s", reason)
            self.dead_reason = reason
        self._fail_all(EngineDeadError(reason))
        if first and not self.shutting_down and self.on_engine_death is not None:
            self.on_engine_death(reason)

    def _fail_all(self, error: BaseException) -> None:
        now = time.time()
        for request_id, stream in list(self.streams.items()):
            if self.output_processor is not None:
                self.output_processor.abort(request_id)
            stream.timer.record_end("error", now)
            stream.fail(error)
        self.streams.clear()


def _outcome(output: RequestOutput) -> str:
    """The outcome a finished request is counted under: its first choice's finish reason."""
    if output.error is not None:
        return "error"
    return output.outputs[0].finish_reason or "stop"


def _engine_process_main(*args) -> None:
    """Spawn target; imports the engine side only in the child."""
    from tandem.engine.process import run_engine

    run_engine(*args)
