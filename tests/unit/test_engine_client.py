"""The frontend's engine client without an engine process: what ``add_request`` registers (a
request counts as in flight from then until it ends) when the request cannot be sent."""
import pytest
import zmq

from tandem.frontend.engine_client import EngineClient
from tandem.frontend.output_processor import OutputProcessor
from tandem.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


class FakeSocket:
    def __init__(self, error=None):
        self.error = error
        self.sent = []

    def send(self, data, copy=True):
        if self.error is not None:
            raise self.error
        self.sent.append(bytes(data))


def make_client(socket: FakeSocket) -> EngineClient:
    client = EngineClient(config=None)
    client.output_processor = OutputProcessor(None)
    client.input_socket = socket
    return client


def test_a_request_that_cannot_be_encoded_is_not_left_in_flight():
    client = make_client(FakeSocket())
    with pytest.raises(OverflowError):  # msgpack integers end at 2**64 - 1
        client.add_request("r", None, [1, 2 ** 70], PARAMS)
    assert client.num_in_flight == 0 and client.output_processor.requests == {}
    client.add_request("r", None, [1, 2], PARAMS)  # the id is free again
    assert client.num_in_flight == 1 and len(client.input_socket.sent) == 1


def test_a_request_that_cannot_be_sent_is_not_left_in_flight():
    client = make_client(FakeSocket(zmq.ZMQError(zmq.ENOTSOCK)))
    with pytest.raises(zmq.ZMQError):
        client.add_request("r", None, [1, 2], PARAMS)
    assert client.num_in_flight == 0 and client.output_processor.requests == {}
