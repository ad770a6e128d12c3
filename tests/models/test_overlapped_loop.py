"""The overlapped engine loop (``async_scheduling``): step N+1 is launched before step N's
tokens are read back, and reads them on the device. On a CPU the forward pass is synchronous, so
these tests check the bookkeeping, not the speed: outputs equal the oracle and the one-step loop,
sequences that end while a launched step still computes for them keep their pages until it
completes (I2), and the books balance after every step (I5)."""
from __future__ import annotations

import functools
import random

import pytest

from tandem import SamplingParams
from tandem.protocol import EngineRequest
from tandem.kv.block_pool import CACHE_OWNER
from tests.support.engines import GREEDY, check_outputs, make_llm, random_prompt

make_llm = functools.partial(make_llm, max_num_batched_tokens=128, max_num_seqs=8, async_scheduling=True)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_next", "deepseek_v32"])
def test_matches_oracle_with_preemption_and_prefix_hits(arch, model_dirs, oracles):
    rng = random.Random(5)
    shared = random_prompt(rng, 48)
    prompts = [random_prompt(rng, n) for n in (1, 150, 17, 90)] + [shared + random_prompt(rng, n) for n in (3, 40)]
    lengths = [5, 16, 9, 12, 16, 7]
    llm = make_llm(model_dirs[arch], max_total_tokens=320)
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths])
    assert llm.engine.stats().num_preemptions > 0
    check_outputs(outputs, prompts, lengths, oracles[arch], arch)
    llm.engine.check_all_free()


def test_sampling_features_equal_the_one_step_loop(model_dirs):
    """Seeded sampling, n > 1 (forks), penalties (fall back to one step at a time), min_tokens,
    stop strings and stop tokens: token for token as without overlap."""
    rng = random.Random(6)
    prompts = [random_prompt(rng, n) for n in (12, 70, 33)]
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=3, max_tokens=14, n=3),
        SamplingParams(temperature=0.7, seed=4, max_tokens=12, presence_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, seed=5, max_tokens=20, min_tokens=4, stop=["e"], stop_token_ids=[7]),
    ]
    results = []
    for async_scheduling in (False, True):
        llm = make_llm(model_dirs["llama"], async_scheduling=async_scheduling)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results.append([[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs])
        llm.engine.check_all_free()
    assert results[0] == results[1]


def test_a_sequence_ending_under_a_launched_step_keeps_its_pages(model_dirs):
    """EOS ends a sequence while the next step, already launched, writes its next token's state:
    its pages stay held (and unused by anyone else) until that step completes."""
    llm = make_llm(model_dirs["llama"])
    engine = llm.engine
    # A prompt whose greedy continuation we learn first, then ask to stop at its third token.
    prompt = random_prompt(random.Random(7), 20)
    (probe,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    stop_at = probe.outputs[0].token_ids[2]
    engine.add_request(EngineRequest(request_id="stopper", prompt_token_ids=prompt,
                                     sampling_params=SamplingParams(temperature=0, max_tokens=50,
                                                                    stop_token_ids=[stop_at])))
    engine.add_request(EngineRequest(request_id="other", prompt_token_ids=random_prompt(random.Random(8), 30),
                                     sampling_params=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
    held_seen = False
    finished = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finish_reason is not None:
                finished[delta.request_id] = delta.finish_reason
        step = engine._in_flight
        if step is not None and step.held:
            held_seen = True
            (sequence,) = step.held
            owner = sequence.state.owner
            for table, pool in zip(sequence.state.page_tables, engine.coordinator.pools):
                for page in table:
                    if page:
                        holders = set(pool.holders(page))
                        assert owner in holders and holders <= {owner, CACHE_OWNER}, \
                            "a held page was handed to someone else"
    assert held_seen and finished == {"stopper": "stop", "other": "length"}
    engine.check_all_free()


def test_abort_while_a_step_is_in_flight(model_dirs):
    llm = make_llm(model_dirs["llama"])
    engine = llm.engine
    for index in range(3):
        engine.add_request(EngineRequest(request_id=f"r{index}", prompt_token_ids=random_prompt(random.Random(index), 25),
                                         sampling_params=SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_requests(["r1"])
    assert engine._in_flight.held, "the aborted sequence's pages wait for the launched step"
    while engine.has_unfinished_requests():
        deltas = engine.step()
        assert all(delta.request_id != "r1" for delta in deltas)
    engine.check_all_free()
