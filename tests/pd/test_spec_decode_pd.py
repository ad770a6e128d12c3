"""Speculative decoding across PD: a prefill and a decode engine core in this process (real NIXL
agents, real control channel), both with the checkpoint's MTP layer. The MTP layer's state
(MLA latent, DSA indexer keys) crosses with the target's, and the hidden state it needs for the
last prompt position crosses in the metadata row: the decode side's tokens and logprobs equal
``transformers``, its proposals equal a colocated engine's from its very first step, and the
transfer wrote every buffer of the registry, the draft's included (I1). A prefill server
without the draft cannot pair with a decode server that has one."""
import os

os.environ["TANDEM_SANITIZE"] = "1"

import pytest  # noqa: E402

from tandem import LLM  # noqa: E402
from tests.support.pd import GREEDY, PDPair  # noqa: E402
from tests.support.speculation import differing_proposals, record_proposals  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")

OPTIONS = dict(page_size=4, max_total_tokens=512, max_num_seqs=4, max_num_batched_tokens=16,
               indexer_cache_dtype="float32")
MTP = dict(speculative_method="mtp", num_speculative_tokens=2)
PROMPTS = {"long": [(7 * i + 3) % 500 + 5 for i in range(21)], "short": [11, 12, 13]}  # two chunks; one


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_mtp_state_crosses_with_the_target(arch, model_dirs, oracles):
    pair = PDPair(model_dirs[arch], **OPTIONS, **MTP)
    try:
        proposals = record_proposals(pair.decode)
        for request_id, prompt in PROMPTS.items():
            pair.submit(request_id, prompt)
        pair.run_until(lambda: all(pair.finished(r) for r in PROMPTS))
        for request_id, prompt in PROMPTS.items():
            pair.assert_matches(request_id, oracles[arch].greedy(prompt, GREEDY.max_tokens))
        registry = pair.prefill.registry
        draft_buffers = {d.key for d in registry.buffers() if d.layer_name in pair.prefill.speculator.network.layer_names}
        assert len(draft_buffers) == 2  # the MTP layer's latent and indexer keys
        assert pair.prefill.pd.touched == {d.key for d in registry.buffers()}  # I1, the draft's included
        # both sides count the same bytes (page-major blocks whole, padding included)
        assert pair.prefill.pd.metrics.bytes_total == pair.decode.pd.metrics.bytes_total > 0
        colocated = LLM(model=model_dirs[arch], **OPTIONS, **MTP)
        expected = record_proposals(colocated.engine)
        colocated.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS.values()], GREEDY, use_tqdm=False)
        first = {(tuple(prompt), len(prompt) + 1) for prompt in PROMPTS.values()}
        assert first <= set(proposals) and set(proposals) <= set(expected)  # from the first decode step on
        assert not differing_proposals(proposals, expected)
        assert pair.decode.stats().speculation.num_drafts > 0
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


def test_prefill_without_the_draft_cannot_pair(model_dirs):
    pair = PDPair(model_dirs["deepseek_v3"], prefill_options={}, decode_options=MTP,
                  **{**OPTIONS, "indexer_cache_dtype": "fp8"})
    try:
        pair.submit("r", PROMPTS["short"], prefill=False)
        pair.run_until(lambda: pair.finished("r"))
        error = pair.error("r")
        assert "PD handshake failed: model.draft_state_layers: " in error, error
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()
