"""The PD control channel's authentication: frames (HMAC-SHA256, per-sender sequence, recipient),
the deployment secret (where it comes from; required off loopback), and, against a real
prefill/decode pair of engine cores, forged control messages — a wrong secret, a replayed frame,
a truncated, an oversized and a garbage one, a frame sent under another engine's name — are
dropped and counted by reason, nothing is written for them, and the pair keeps serving exactly."""
import os

os.environ["TANDEM_SANITIZE"] = "1"

import stat  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import msgspec  # noqa: E402
import pytest  # noqa: E402
import zmq  # noqa: E402

from tandem.protocol import EngineRequest, TransferParams  # noqa: E402
from tandem.transfer.config import TransferConfig  # noqa: E402
from tandem.transfer.frames import MAX_FRAME_BYTES, FrameCodec, RejectedFrame, derive_key, seal_frame  # noqa: E402
from tandem.transfer.messages import Destination, Heartbeat, new_room  # noqa: E402
from tandem.transfer.secret import is_loopback_address, local_secret  # noqa: E402
from tandem.transfer.state import TransferState  # noqa: E402
from tests.support.pd import GREEDY, PDPair  # noqa: E402
from tests.support.servers import REPOSITORY_ROOT  # noqa: E402

SECRET = b"a deployment secret of 32 bytes!"
WRONG_SECRET = b"not the deployment secret at all"
PROMPT = [(5 * i + 2) % 400 + 7 for i in range(14)]
SMALL = dict(page_size=4, max_total_tokens=256, max_num_seqs=4, max_num_batched_tokens=16)


# -- frames and secrets -------------------------------------------------------------------------------


def test_frames_are_authenticated_fresh_and_addressed():
    alice, bob = FrameCodec("alice", SECRET), FrameCodec("bob", SECRET)
    frame = alice.seal(b"payload", "bob")
    assert bob.open(frame) == ("alice", "bob", 1, b"payload")
    cases = {
        "replayed": frame,
        "truncated": alice.seal(b"payload", "bob")[:-5],
        "oversized": b"x" * (MAX_FRAME_BYTES + 1),
        "garbage": b"\x93\x01\x02" * 20,
        "bad_authenticator": seal_frame(derive_key(WRONG_SECRET), "alice", "bob", 99, b"payload"),
        "misaddressed": alice.seal(b"payload", "carol"),
    }
    for reason, forged in cases.items():
        with pytest.raises(RejectedFrame) as rejection:
            bob.open(forged)
        assert rejection.value.reason == reason
    altered = bytearray(alice.seal(b"payload", "bob"))
    altered[-40] ^= 1  # one payload bit
    with pytest.raises(RejectedFrame, match="bad_authenticator"):
        bob.open(bytes(altered))
    assert bob.open(alice.seal(b"next", ""))[3] == b"next"  # the sequence moved on; unbound is allowed here


def test_secret_is_required_off_loopback(monkeypatch, tmp_path):
    monkeypatch.delenv("TANDEM_PD_SECRET", raising=False)
    assert is_loopback_address("tcp://127.0.0.1:0") and is_loopback_address("tcp://localhost:5")
    assert not is_loopback_address("tcp://0.0.0.0:5557") and not is_loopback_address("tcp://10.1.2.3:1")
    with pytest.raises(ValueError, match="--pd-secret-file"):
        TransferConfig(role="prefill", bootstrap_address="tcp://0.0.0.0:0")
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    config = TransferConfig(role="prefill", bootstrap_address="tcp://0.0.0.0:0", secret_file=str(secret_file))
    assert config.control_secret() == SECRET and "secret=" not in repr(config.with_secret())
    secret_file.write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        config.control_secret()
    monkeypatch.setenv("TANDEM_PD_SECRET", SECRET.decode())
    assert TransferConfig(role="decode", bootstrap_address="tcp://0.0.0.0:0").control_secret() == SECRET


def test_loopback_secret_is_generated_once_and_private(tmp_path):
    path = tmp_path / "cache" / "pd_secret"
    first = local_secret(path)
    assert local_secret(path) == first and len(first) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_serve_on_a_public_address_without_a_secret_refuses_to_start(tmp_path):
    environment = {key: value for key, value in os.environ.items() if key != "TANDEM_PD_SECRET"}
    result = subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "serve", "--model", str(tmp_path),
                             "--role", "prefill", "--pd-address", "tcp://0.0.0.0:0"], cwd=REPOSITORY_ROOT,
                            env={**environment, "PYTHONPATH": str(REPOSITORY_ROOT)}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "--pd-secret-file" in result.stderr and "not loopback" in result.stderr, result.stderr


# -- forged messages against a real pair --------------------------------------------------------------


@pytest.fixture
def pair(model_dirs):
    pair = PDPair(model_dirs["llama"], transfer=dict(secret=SECRET), **SMALL)
    yield pair
    pair.close()


def count_writes(backend) -> list:
    calls = []
    original = backend.write

    def write(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    backend.write = write
    return calls


def record_frames(channel) -> list[bytes]:
    """Every frame ``channel`` seals, in order (to replay them)."""
    frames = []
    seal = channel.codec.seal

    def recording(payload, recipient=""):
        frames.append(seal(payload, recipient))
        return frames[-1]

    channel.codec.seal = recording
    return frames


def prefill_request(pair: PDPair, request_id: str, room: str) -> None:
    pair.prefill.add_request(EngineRequest(request_id=request_id, prompt_token_ids=PROMPT, sampling_params=GREEDY,
                                           transfer=TransferParams(room=room, role="prefill")))


def test_forged_control_messages_are_dropped_counted_and_write_nothing(pair, oracles):
    """A legitimate request first (its frames recorded); then a prefill request whose room an
    attacker targets, and every kind of forged frame at the prefill engine's control port: none
    binds the room, nothing is written, each is counted by reason; the pair still serves exactly."""
    sent_by_decode = record_frames(pair.decode.pd.channel)
    pair.submit("legit", PROMPT)
    pair.run_until(lambda: pair.finished("legit"))
    assert pair.tokens("legit") == oracles["llama"].greedy(PROMPT, GREEDY.max_tokens).token_ids
    destination_frame = next(frame for frame in sent_by_decode if b"destination" in frame)

    room = new_room()
    prefill_request(pair, "target", room)
    pair.step(decode=False)
    writes = count_writes(pair.prefill.pd.agent.backend)
    decode_id, prefill_id = pair.decode.pd.engine_id, pair.prefill.pd.engine_id
    forged_destination = msgspec.msgpack.encode(Destination(room=room, page_tables=[[1, 2, 3, 4]], metadata_row=0,
                                                            num_prompt_tokens=len(PROMPT)))
    context = zmq.Context()
    attacker = context.socket(zmq.DEALER)
    attacker.setsockopt(zmq.IDENTITY, b"tandem-decode-attacker")
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(pair.address)
    wrong_key = derive_key(WRONG_SECRET)
    try:
        attacker.send(seal_frame(wrong_key, "tandem-decode-attacker", prefill_id, 1, forged_destination))
        attacker.send(seal_frame(wrong_key, "tandem-decode-attacker", "", 2,
                                 msgspec.msgpack.encode(Heartbeat(sender="tandem-decode-attacker"))))
        attacker.send(destination_frame[:-7])  # truncated
        attacker.send(b"TPC1" + bytes(MAX_FRAME_BYTES))  # oversized
        attacker.send(os.urandom(300))  # garbage
        attacker.send(destination_frame)  # a real frame, under another engine's name
        pair.decode.pd.channel.dealers[pair.address].send(destination_frame)  # replayed by the real peer
        expected = {"bad_authenticator": 2, "truncated": 1, "oversized": 1, "garbage": 1, "impersonation": 1,
                    "replayed": 1}
        rejected = pair.prefill.pd.channel.rejected
        pair.run_until(lambda: all(rejected[reason] >= count for reason, count in expected.items()), timeout=10)
        pair.step()
        pair.step()
        assert attacker.poll(100) == 0  # nothing is ever sent back to an unauthenticated peer
    finally:
        attacker.close()
        context.term()
    assert {reason: rejected[reason] for reason in expected} == expected
    assert rejected["misaddressed"] == rejected["undecodable"] == 0
    assert pair.prefill.stats().transfer.control_rejected == dict(rejected)
    assert pair.prefill.pd.transfers[room].status.state is TransferState.WAITING  # nothing bound the room
    assert not writes and set(pair.prefill.pd.peers) == {decode_id}

    pair.prefill.abort_requests(["target"])
    pair.submit("after", PROMPT[::-1])
    pair.run_until(lambda: pair.finished("after"))
    assert pair.tokens("after") == oracles["llama"].greedy(PROMPT[::-1], GREEDY.max_tokens).token_ids
    pair.settle()
    pair.assert_all_free()


def test_engines_with_different_secrets_never_connect(model_dirs):
    """A decode engine with another secret: its hello is rejected (counted), it never learns the
    prefill engine's answer, and its request fails after the connect timeout naming the secret."""
    pair = PDPair(model_dirs["llama"], transfer=dict(secret=SECRET, connect_timeout=1.0),
                  decode_transfer=dict(secret=WRONG_SECRET), **SMALL)
    try:
        writes = count_writes(pair.prefill.pd.agent.backend)
        pair.submit("r", PROMPT)
        pair.run_until(lambda: pair.finished("r"), timeout=20)
        assert "PD secret" in pair.error("r")
        assert pair.prefill.pd.channel.rejected["bad_authenticator"] >= 1
        assert not pair.prefill.pd.peers and not writes
        pair.prefill.abort_requests(["r"])
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


def test_a_forged_prefill_engine_gets_no_destination(pair):
    """The decode side, pointed at an impostor's address, sends it nothing but its hello and
    heartbeats: the impostor's forged answers are rejected and no destination ever leaves."""
    context = zmq.Context()
    impostor = context.socket(zmq.ROUTER)
    impostor.setsockopt(zmq.LINGER, 0)
    port = impostor.bind_to_random_port("tcp://127.0.0.1")
    try:
        room = new_room()
        pair.decode.add_request(EngineRequest(request_id="victim", prompt_token_ids=PROMPT, sampling_params=GREEDY,
                                              transfer=TransferParams(room=room, role="decode",
                                                                      prefill_address=f"tcp://127.0.0.1:{port}")))
        identity, hello = impostor.recv_multipart()
        payload = FrameCodec("x", SECRET).open(hello).payload  # the test knows the secret; the impostor does not
        assert b"hello" in payload
        reply = b'\x84\xa4type\xabhello_reply\xa6sender\xa8impostor\xa8accepted\xc3\xa6layout\xc0'
        impostor.send_multipart([identity, seal_frame(derive_key(WRONG_SECRET), "impostor", identity.decode(), 1,
                                                      reply)])
        rejected = pair.decode.pd.channel.rejected
        pair.run_until(lambda: rejected["bad_authenticator"] >= 1, decode=True, prefill=False, timeout=10)
        assert not any(link.ready for link in pair.decode.pd.links.values())
        pair.decode.abort_requests(["victim"])
        pair.step(prefill=False)
        while impostor.poll(50):
            frame = impostor.recv_multipart()[1]
            assert b"destination" not in frame and b"abort" not in frame
    finally:
        impostor.close()
        context.term()
    pair.settle()
    pair.assert_all_free()
