"""The engine process of ``tandem serve``: an ``EngineCore`` driven by messages over ZMQ.

The frontend process binds two ZMQ sockets and starts this process, which connects to both::

    frontend --PUSH--> input_address  --PULL--> engine   (FrontendMessage)
    frontend <--PULL-- output_address <--PUSH-- engine   (EngineMessage)

The engine sends ``EngineReadyMessage`` once the core is built (``EngineFailedMessage`` if that
fails), then one ``EngineStepMessage`` per step while it has work, and one after any message that
changed its state while idle (a rejection, an abort) so the frontend's stats stay current. When it
has no work it blocks on its input socket; it never spins.

Lifetime: the frontend owns this process. It sends ``ShutdownMessage`` after draining; SIGINT and
SIGTERM are ignored here (a Ctrl-C reaches the whole process group, and the frontend must be able
to drain first). If the frontend dies, the kernel kills this process (``PR_SET_PDEATHSIG``) and,
as a fallback, the idle loop notices that its parent changed and exits.
"""
from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import time
import traceback
from typing import Mapping, Optional

import msgspec
import zmq

from tandem.config import EngineConfig
from tandem.protocol import (
    AbortRequestsMessage,
    AddRequestMessage,
    EngineFailedMessage,
    EngineReadyMessage,
    EngineStepMessage,
    FinishSequencesMessage,
    FrontendMessage,
    RequestDelta,
    RequestRejectedMessage,
    ResetPrefixCacheMessage,
    ShutdownMessage,
)

DEFAULT_CORE_CLASS = "tandem.engine.core:EngineCore"
IDLE_POLL_MILLISECONDS = 1000  # how often an idle engine checks that its frontend still lives
OUTPUT_LINGER_MILLISECONDS = 2000  # how long unsent messages may delay exit

logger = logging.getLogger("tandem.engine")


def load_core_class(path: str):
    """Resolve ``"package.module:ClassName"`` to the class (tests pass a fake engine core)."""
    module_name, _, class_name = path.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no-op elsewhere)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class EngineLoop:
    """Runs one ``EngineCore`` against the frontend's messages.

    Borrows the core and both sockets from ``run_engine``, which owns (and closes) them. The core
    is touched only from this loop's thread.
    """

    def __init__(self, core, input_socket: zmq.Socket, output_socket: zmq.Socket, parent_pid: Optional[int]):
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        self.decoder = msgspec.msgpack.Decoder(FrontendMessage)
        self.encoder = msgspec.msgpack.Encoder()
        self.stopping = False
        self.rejected: list[RequestRejectedMessage] = []
        self.state_changed = False
        self.last_stats = None  # PD engines: the stats last sent (quiet steps are not reported)
        self.handlers = {
            AddRequestMessage: self.add_request,
            AbortRequestsMessage: lambda message: self.change(self.core.abort_requests, message.request_ids),
            FinishSequencesMessage: lambda message: self.change(
                self.core.finish_sequences, [tuple(key) for key in message.keys]),
            ResetPrefixCacheMessage: lambda message: self.change(self.core.reset_prefix_cache),
            ShutdownMessage: self.stop,
        }

    def send(self, message) -> None:
        self.output_socket.send(self.encoder.encode(message), copy=False)

    def send_ready(self) -> None:
        info = self.core.model_info
        self.send(EngineReadyMessage(vocab_size=int(info.vocab_size), max_model_len=int(info.max_model_len),
                                     eos_token_ids=[int(token) for token in info.eos_token_ids],
                                     stats=self.core.stats(), transfer=self.transfer_endpoint()))

    def transfer_endpoint(self):
        """A PD engine's role, control address and state layout (None when colocated)."""
        pd = getattr(self.core, "pd", None)
        return pd.endpoint() if pd is not None else None

    def run(self) -> None:
        """Serve until ``ShutdownMessage`` or until the parent process is gone."""
        while not self.stopping:
            busy = self.core.has_unfinished_requests()
            self.receive(block=not busy)
            if self.stopping:
                break
            deltas: list[RequestDelta] = []
            if self.core.has_unfinished_requests():
                deltas = self.step()
            elif not (self.state_changed or busy):
                continue
            self.send_step(deltas)

    def step(self) -> list[RequestDelta]:
        """The core's step; a PD engine's transfer deltas (a decode engine's first tokens) are
        sent before it, so a first token never waits for the step that follows it."""
        if not self.waits_between_steps():
            deltas = self.core.step()
        else:
            early = self.core.poll_transfers()
            if early:
                self.send_step(early)
            deltas = self.core.step(poll_transfers=False)
        take_rejections = getattr(self.core, "take_rejections", None)
        for request_id, error in take_rejections() if take_rejections is not None else ():
            self.rejected.append(RequestRejectedMessage(request_id=request_id, error=error))
        return deltas

    def send_step(self, deltas: list[RequestDelta]) -> None:
        stats = self.core.stats()
        if self.waits_between_steps() and not (deltas or self.rejected or self.state_changed) \
                and stats == self.last_stats:
            return  # a PD engine steps while it waits on transfers: nothing new to report
        self.last_stats = stats
        self.send(EngineStepMessage(deltas=deltas, rejected=self.rejected, stats=stats))
        self.rejected = []
        self.state_changed = False

    def waits_between_steps(self) -> bool:
        """PD engines always have work (heartbeats, transfers) and wait on their control sockets
        between steps (``idle_wait_milliseconds``) instead of spinning."""
        return getattr(self.core, "pd", None) is not None

    def wait_for_messages(self) -> None:
        timeout = self.core.idle_wait_milliseconds()
        if timeout <= 0:
            return
        poller = zmq.Poller()
        for socket in [self.input_socket, *self.core.wakeup_sockets()]:
            poller.register(socket, zmq.POLLIN)
        if timeout >= 1:
            poller.poll(timeout)
        elif not poller.poll(0):  # (zmq waits in whole milliseconds)
            time.sleep(timeout / 1000)
        if self.parent_gone():
            self.stopping = True

    def receive(self, block: bool) -> None:
        """Handle every queued message; when ``block``, first wait until one arrives."""
        if block:
            while not self.input_socket.poll(IDLE_POLL_MILLISECONDS):
                if self.parent_gone():
                    self.stopping = True
                    return
                check_health = getattr(self.core, "check_health", None)
                if check_health is not None:
                    check_health()  # a dead tensor-parallel rank ends an idle engine too
        elif self.waits_between_steps():
            self.wait_for_messages()
        while True:
            try:
                frame = self.input_socket.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.handle(self.decoder.decode(frame.buffer))

    def parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def handle(self, message) -> None:
        self.handlers[type(message)](message)

    def change(self, operation, *arguments) -> None:
        """Run a core operation that changes its state; the frontend hears the new stats."""
        operation(*arguments)
        self.state_changed = True

    def stop(self, message: ShutdownMessage) -> None:
        self.stopping = True

    def add_request(self, message: AddRequestMessage) -> None:
        try:
            self.core.add_request(message.request)
        except ValueError as error:
            self.rejected.append(RequestRejectedMessage(request_id=message.request.request_id, error=str(error)))
            self.state_changed = True


def shutdown_core(core) -> None:
    """Release the core's resources; an error here must not hide the one that ended the loop."""
    if core is None:
        return
    try:
        core.shutdown()
    except Exception:  # noqa: BLE001
        logger.exception("engine core shutdown failed")


SLEEPING_OPENMP_THREADS = {"OMP_WAIT_POLICY": "PASSIVE"}


def with_sleeping_openmp_threads(environment: Mapping[str, str]) -> dict[str, str]:
    """``environment`` for a process about to start, its idle OpenMP threads made to sleep
    instead of spinning (``OMP_WAIT_POLICY=PASSIVE``) unless it names a policy itself.

    The engine shares the host's cores with the frontend process, with the other ranks'
    processes (and often with clients or other work). Spinning threads then fight whoever holds
    their core, and a 2-core host was seen to drop from ~2000 to ~100 output tokens/s; sleeping
    threads cost little when the host is quiet and nothing when it is not. OpenMP reads the
    policy once, when torch loads it: a process that imported torch can only hand the setting
    to the processes it starts."""
    return {**SLEEPING_OPENMP_THREADS, **environment}


def wait_passively_between_parallel_regions() -> None:
    """``with_sleeping_openmp_threads`` for this process, where torch has not loaded yet (the
    engine process: ``run_engine`` runs before anything imports it); too late once it has."""
    if "torch" in sys.modules:
        logger.debug("torch already loaded: this process's OpenMP wait policy stays as it was")
        return
    for name, value in SLEEPING_OPENMP_THREADS.items():
        os.environ.setdefault(name, value)


def run_engine(config: EngineConfig, input_address: str, output_address: str,
               core_class_path: str = DEFAULT_CORE_CLASS, parent_pid: Optional[int] = None,
               log_level: str = "info") -> None:
    """Entry point of the engine process (the target the frontend spawns)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    wait_passively_between_parallel_regions()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket.setsockopt(zmq.LINGER, OUTPUT_LINGER_MILLISECONDS)
    output_socket.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    core = None
    try:
        core = load_core_class(core_class_path)(config)
        loop = EngineLoop(core, input_socket, output_socket, parent_pid)
        loop.send_ready()
        loop.run()
    except BaseException:  # noqa: BLE001 - anything that ends the loop is reported to the frontend
        text = traceback.format_exc()
        logger.error("engine failed:\n%s", text)
        output_socket.send(encoder.encode(EngineFailedMessage(error=text.strip().splitlines()[-1])))
        raise SystemExit(1)
    finally:
        shutdown_core(core)
        input_socket.close(linger=0)
        output_socket.close()
        context.term()
