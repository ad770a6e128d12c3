"""PD between tensor-parallel engines on CPU (gloo control groups, NIXL over host memory): a TP=2
prefill engine writes each rank's shard of the pages to the same rank of a TP=2 decode engine.
Greedy outputs equal a colocated TP=1 engine's and transformers'; a write that fails on one rank
fails its request on both legs with every page freed; a TP=1 decode engine is refused at the
handshake with an error naming tensor_parallel_size. The NCCL backend runs the same path.

One NIXL prefill/decode pair (each engine with one worker process) serves the module's tests."""
import os
import time

os.environ["TANDEM_SANITIZE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem import LLM  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402
from tandem.engine.core import EngineCore  # noqa: E402
from tandem.protocol import EngineRequest, TransferParams  # noqa: E402
from tandem.transfer.config import TransferConfig  # noqa: E402
from tandem.transfer.messages import new_room  # noqa: E402
from tests.support.pd import FAST_TIMEOUTS, GREEDY, PDPair  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SMALL = dict(page_size=4, max_total_tokens=512, max_num_seqs=4, max_num_batched_tokens=16)
LONG_PROMPT = [(7 * i + 3) % 500 + 5 for i in range(21)]  # spans two prefill chunks of 16
SHORT_PROMPT = [11, 12, 13]


@pytest.fixture(scope="module")
def tp_pair(model_dirs):
    pair = PDPair(model_dirs["llama"], tensor_parallel_size=2, **SMALL)
    yield pair
    pair.close()


def check_equals_colocated(pair: PDPair, model_dirs, oracles, arch: str = "llama", **colocated_options) -> None:
    """Greedy outputs of the pair equal a colocated TP=1 engine's and transformers'; every rank's
    bytes counted; everything free afterwards."""
    prompts = {"long": LONG_PROMPT, "short": SHORT_PROMPT}
    for request_id, prompt in prompts.items():
        pair.submit(request_id, prompt)
    pair.run_until(lambda: all(pair.finished(request_id) for request_id in prompts), timeout=120)
    single = LLM(model=model_dirs[arch], **(colocated_options or SMALL))
    colocated = single.generate([{"prompt_token_ids": prompt} for prompt in prompts.values()], GREEDY,
                                use_tqdm=False)
    single.engine.shutdown()
    for (request_id, prompt), single in zip(prompts.items(), colocated):
        pair.assert_matches(request_id, oracles[arch].greedy(prompt, GREEDY.max_tokens))
        assert pair.tokens(request_id) == list(single.outputs[0].token_ids), request_id
    # both sides count every rank's bytes: the decode side all of its ranks' destination pages,
    # the prefill side what each rank wrote (rank 1's part reported back to rank 0)
    assert pair.prefill.pd.metrics.bytes_total == pair.decode.pd.metrics.bytes_total > 0
    pair.settle()
    pair.assert_all_free()
    ranks = pair.prefill.pd.ranks  # one outcome per rank per write, each forgotten once resolved
    assert not ranks.outcomes and not ranks.expected and not ranks.operations and not ranks.local.writes


def test_tp2_prefill_to_tp2_decode_equals_colocated_and_transformers(tp_pair, model_dirs, oracles):
    check_equals_colocated(tp_pair, model_dirs, oracles)


def test_a_write_failing_on_one_rank_fails_the_request_cleanly(tp_pair, monkeypatch):
    """Rank 1's part of the page write fails (it is sent to a decode engine rank 1 never loaded):
    the transfer fails through the single-rank path, no metadata row is written, both legs end
    with the error, every page comes back; the next request goes through."""
    import msgspec

    from tandem.transfer.rank_operations import WRITE

    pair = tp_pair
    send = pair.prefill.pd.ranks.send

    def send_to_a_stranger_on_rank_1(operation, ranks):  # rank 0's part goes where it should
        if operation.kind == WRITE and 0 not in ranks:
            operation = msgspec.structs.replace(operation, peer="an-engine-rank-1-never-met")
        send(operation, ranks)

    monkeypatch.setattr(pair.prefill.pd.ranks, "send", send_to_a_stranger_on_rank_1)
    pair.submit("failing", LONG_PROMPT)
    pair.run_until(lambda: pair.finished("failing") and pair.prefill_error("failing") is not None)
    for error in (pair.error("failing"), pair.prefill_error("failing")):
        assert "a page write failed: rank 1 has no agent of decode engine an-engine-rank-1-never-met" in error, error
    pair.settle()
    pair.assert_all_free()
    monkeypatch.undo()
    pair.submit("after", SHORT_PROMPT)
    pair.run_until(lambda: pair.finished("after"))
    assert pair.error("after") is None and len(pair.tokens("after")) == GREEDY.max_tokens
    pair.settle()
    pair.assert_all_free()


def test_a_rank_write_pending_past_drain_timeout_is_cancelled(tp_pair, monkeypatch):
    """The decode side aborts while rank 1's part of the last write's pages looks pending (its
    outcome is held back here until rank 0 cancels it): the prefill side keeps the source pages and
    sends no Drained until drain_timeout passed and it cancelled rank 1's part; then both sides
    free all."""
    pair, ranks = tp_pair, tp_pair.prefill.pd.ranks
    outcome, transfers = ranks.outcome, pair.prefill.pd.transfers

    def in_last_write(key: str) -> bool:  # rank 1's part of the pages the last write carries
        return any(transfer.metadata_write is not None and transfer.metadata_write.owner == key
                   for transfer in transfers.values())

    monkeypatch.setattr(ranks, "outcome",
                        lambda key: None if in_last_write(key) and key not in ranks.cancelled else outcome(key))
    # The decode side does not hear the last write's notification (it would commit the request,
    # and its abort would then not reach the prefill side as one of a transfer in flight).
    monkeypatch.setattr(pair.decode.pd.agent.backend, "notifications", lambda: [])
    room = pair.submit("slow", LONG_PROMPT)
    # Aborted once the last write (the last pages, the row) is posted: it looks pending from then
    # on. (Aborted earlier, while that write still waits for the workers' parts of its pages, the
    # write is never posted and the workers' parts are cancelled at once: nothing to drain.)
    pair.run_until(lambda: any(transfer.metadata_write is not None for transfer in pair.prefill.pd.transfers.values()))
    pair.decode.abort_requests(["slow"])
    aborted = time.monotonic()
    pair.run_until(lambda: room not in pair.decode.pd.draining and room not in pair.prefill.pd.transfers)
    assert time.monotonic() - aborted >= pair.prefill.pd.config.drain_timeout
    pair.settle()
    pair.assert_all_free()


def test_unequal_tensor_parallel_sizes_fail_the_handshake(tp_pair, model_dirs):
    decode = EngineCore(EngineConfig(model=model_dirs["llama"], **SMALL,
                                     transfer=TransferConfig(role="decode", **FAST_TIMEOUTS)))
    try:
        decode.add_request(EngineRequest(request_id="r", prompt_token_ids=SHORT_PROMPT, sampling_params=GREEDY,
                                         transfer=TransferParams(room=new_room(), role="decode",
                                                                 prefill_address=tp_pair.address)))
        deltas, deadline = [], time.monotonic() + 20
        while not any(delta.finish_reason for delta in deltas) and time.monotonic() < deadline:
            tp_pair.step(decode=False)
            deltas += decode.step()
            time.sleep(0.001)
        error = next(delta.error for delta in deltas if delta.finish_reason == "error")
        assert "PD handshake failed: model.tensor_parallel_size: the prefill server has 2, the decode server " \
               "has 1" in error, error
        assert not decode.pd.busy()
        decode.check_all_free()
    finally:
        decode.shutdown()


def test_a_pd_config_reaches_the_workers_whole(model_dirs):
    """The workers build their agents from rank 0's config, sent as JSON (the secret as hex)."""
    from tandem.engine.ranks.launcher import config_from_json, config_to_json

    config = EngineConfig(model=model_dirs["llama"], tensor_parallel_size=2, **SMALL,
                          transfer=TransferConfig(role="prefill", backend="nccl", secret=bytes(range(32)),
                                                  bootstrap_address="tcp://0.0.0.0:5557", **FAST_TIMEOUTS))
    assert config_from_json(config_to_json(config)) == config


def test_tp2_pd_over_the_nccl_backend(model_dirs, oracles):
    """The NCCL backend's pairs form per rank too (gloo between host memories on a CPU). (Last of
    the CPU tests: the module's pair is not stepped meanwhile, and would take its peer for dead.)"""
    pair = PDPair(model_dirs["llama"], tensor_parallel_size=2, transfer=dict(backend="nccl"), **SMALL)
    try:
        check_equals_colocated(pair, model_dirs, oracles)
    finally:
        pair.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4, reason="needs four CUDA devices")
@pytest.mark.parametrize("backend", ["nixl", "nccl"])
def test_cuda_tp2_pd_equals_colocated_float32(backend, model_dirs, oracles, monkeypatch):
    """Prefill on cuda:0-1, decode on cuda:2-3: each rank's GPU pages cross to the same rank."""
    import tests.support.oracle as oracle_module

    if backend == "nixl":
        pytest.importorskip("nixl", reason="NIXL is not installed")
    monkeypatch.setattr(oracle_module, "LOGPROB_TOLERANCE", 1e-3)  # GPU reduction order differs
    options = dict(dtype="float32", page_size=16, max_total_tokens=1024, max_num_batched_tokens=16, max_num_seqs=4)
    pair = PDPair(model_dirs["llama"], tensor_parallel_size=2, prefill_options=dict(device="cuda:0"),
                  decode_options=dict(device="cuda:2"), transfer=dict(backend=backend), **options)
    try:
        check_equals_colocated(pair, model_dirs, oracles, device="cuda:0", **options)
    finally:
        pair.close()


def test_tp2_pd_of_a_hybrid_model(model_dirs, oracles):
    """NemotronH (Mamba-2 and attention): each rank writes its heads' recurrent slots and K/V.
    (Last in the module: the module's idle pair must not wait through it.)"""
    pair = PDPair(model_dirs["nemotron_h"], tensor_parallel_size=2, **SMALL)
    try:
        check_equals_colocated(pair, model_dirs, oracles, arch="nemotron_h")
    finally:
        pair.close()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_tp2_pd_with_speculative_decoding(arch, model_dirs, oracles):
    """Speculative decoding on both TP=2 sides. A draft model runs on each rank 0: its pages cross
    with rank 0's shard (the worker's copies of its groups are never read). DeepSeek's MTP module
    is sharded: its state crosses rank by rank, and the decode side's first draft pass (from the
    hidden state in the metadata row) runs on both ranks. (Last in the module, as above.)"""
    speculation = (dict(speculative_method="mtp") if arch == "deepseek_v3" else
                   dict(speculative_model=model_dirs["llama"]))
    pair = PDPair(model_dirs[arch], tensor_parallel_size=2, num_speculative_tokens=2, **speculation, **SMALL)
    try:
        check_equals_colocated(pair, model_dirs, oracles, arch=arch)
        stats = pair.decode.speculator.stats()
        assert stats.num_draft_tokens > 0, stats
        if arch == "llama":  # an identical draft
            assert stats.num_accepted_tokens == stats.num_draft_tokens, stats
    finally:
        pair.close()
