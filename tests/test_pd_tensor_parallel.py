"""PD between tensor-parallel engines on CPU (gloo control groups, NIXL over host memory): a TP=2
prefill engine writes each rank's shard of the pages to the same rank of a TP=2 decode engine.
Greedy outputs equal a colocated TP=1 engine's and transformers'; a write that fails on one rank
fails its request on both legs with every page freed; a TP=1 decode engine is refused at the
handshake with an error naming tensor_parallel_size.

One prefill/decode pair (each engine with one worker process) serves the module's tests."""
import os
import time

os.environ["TANDEM_SANITIZE"] = "1"

import pytest  # noqa: E402

from tandem import LLM  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402
from tandem.engine.core import EngineCore  # noqa: E402
from tandem.engine.protocol import EngineRequest, TransferParams  # noqa: E402
from tandem.transfer.config import TransferConfig  # noqa: E402
from tandem.transfer.messages import new_room  # noqa: E402
from tests.pd_helpers import FAST_TIMEOUTS, GREEDY, PDPair  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SMALL = dict(page_size=4, max_total_tokens=512, max_num_seqs=4, max_num_batched_tokens=16)
LONG_PROMPT = [(7 * i + 3) % 500 + 5 for i in range(21)]  # spans two prefill chunks of 16
SHORT_PROMPT = [11, 12, 13]


@pytest.fixture(scope="module")
def tp_pair(model_dirs):
    pair = PDPair(model_dirs["llama"], tensor_parallel_size=2, **SMALL)
    yield pair
    pair.close()


def test_tp2_prefill_to_tp2_decode_equals_colocated_and_transformers(tp_pair, model_dirs, oracles):
    pair = tp_pair
    prompts = {"long": LONG_PROMPT, "short": SHORT_PROMPT}
    for request_id, prompt in prompts.items():
        pair.submit(request_id, prompt)
    pair.run_until(lambda: all(pair.finished(request_id) for request_id in prompts))
    colocated = LLM(model=model_dirs["llama"], **SMALL).generate(
        [{"prompt_token_ids": prompt} for prompt in prompts.values()], GREEDY, use_tqdm=False)
    for (request_id, prompt), single in zip(prompts.items(), colocated):
        pair.assert_matches(request_id, oracles["llama"].greedy(prompt, GREEDY.max_tokens))
        assert pair.tokens(request_id) == list(single.outputs[0].token_ids), request_id
    # both sides count every rank's bytes: the decode side all of its ranks' destination pages,
    # the prefill side what each rank wrote (rank 1's part reported back to rank 0)
    assert pair.prefill.pd.metrics.bytes_total == pair.decode.pd.metrics.bytes_total > 0
    pair.settle()
    pair.assert_all_free()
    assert not pair.prefill.pd.ranks.outcomes and not pair.prefill.pd.ranks.operations


def test_a_write_failing_on_one_rank_fails_the_request_cleanly(tp_pair, monkeypatch):
    """Rank 1's part of the page write fails (it is sent to a decode engine rank 1 never loaded):
    the transfer fails through the single-rank path, no metadata row is written, both legs end
    with the error, every page comes back; the next request goes through."""
    pair = tp_pair
    post = pair.prefill.pd.ranks.post
    monkeypatch.setattr(pair.prefill.pd.ranks, "post",
                        lambda key, identity, pairs: post(key, "an-engine-rank-1-never-met", pairs))
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
    from tandem.parallel.launcher import config_from_json, config_to_json

    config = EngineConfig(model=model_dirs["llama"], tensor_parallel_size=2, **SMALL,
                          transfer=TransferConfig(role="prefill", backend="nccl", secret=bytes(range(32)),
                                                  bootstrap_address="tcp://0.0.0.0:5557", **FAST_TIMEOUTS))
    assert config_from_json(config_to_json(config)) == config
