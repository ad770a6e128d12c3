"""The engine process's loop sends a PD engine's transfer deltas (a decode engine's first tokens)
before the step that follows them, so a first token never waits for a step's launch or for the
read-back of the step in flight."""
from __future__ import annotations

import msgspec

from tandem.engine.process import EngineLoop
from tandem.protocol import EngineMessage, EngineStats, EngineStepMessage, RequestDelta


class RecordingSocket:
    def __init__(self):
        self.sent: list[EngineStepMessage] = []
        self.decoder = msgspec.msgpack.Decoder(EngineMessage)

    def send(self, data, copy=True):
        self.sent.append(self.decoder.decode(bytes(data)))


class SlowStepPDCore:
    """A PD core whose transfers produced a first token and whose step then takes a while."""

    pd = object()  # a PD engine

    def __init__(self, socket: RecordingSocket):
        self.socket = socket
        self.calls: list[tuple[str, int]] = []  # (call, messages sent before it)
        self.steps = 0

    def has_unfinished_requests(self) -> bool:
        return self.steps < 1

    def poll_transfers(self) -> list[RequestDelta]:
        self.calls.append(("poll_transfers", len(self.socket.sent)))
        return [RequestDelta(request_id="first", new_token_ids=[7])]

    def step(self, poll_transfers: bool = True) -> list[RequestDelta]:
        self.calls.append((f"step(poll_transfers={poll_transfers})", len(self.socket.sent)))
        self.steps += 1
        return [RequestDelta(request_id="first", new_token_ids=[8])]

    def stats(self) -> EngineStats:
        return EngineStats(num_running=1)

    def idle_wait_milliseconds(self) -> float:
        return 0

    def wakeup_sockets(self) -> list:
        return []


class Stop(Exception):
    pass


def test_transfer_deltas_go_out_before_the_step():
    socket = RecordingSocket()
    core = SlowStepPDCore(socket)
    loop = EngineLoop(core, input_socket=None, output_socket=socket, parent_pid=None)

    def receive(block):  # no frontend messages; stop once the step ran
        if core.steps:
            loop.stopping = True
    loop.receive = receive
    loop.run()
    # the first token was sent before the step began, which did not poll the transfers again
    assert core.calls == [("poll_transfers", 0), ("step(poll_transfers=False)", 1)]
    tokens = [[delta.new_token_ids for delta in message.deltas] for message in socket.sent]
    assert tokens == [[[7]], [[8]]]
