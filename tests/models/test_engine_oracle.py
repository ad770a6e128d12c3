"""Every model path against transformers (fp32, CPU): greedy tokens equal and top-5 logprobs
within 1e-4, for single prompts, mixed batches with forced preemption, chunked prefill,
prefix-cache hits and several page sizes."""
from __future__ import annotations

import random

import pytest

from tandem import SamplingParams
from tests.support.models import ARCHS
from tests.support.engines import GREEDY, check_outputs, make_llm, random_prompt
from tests.support.oracle import assert_matches, assert_position


@pytest.mark.parametrize("arch", ARCHS)
def test_single_prompt_64_tokens(arch, model_dirs, oracles):
    llm = make_llm(model_dirs[arch])
    prompt = random_prompt(random.Random(1), 37)
    outputs = llm.generate([prompt], SamplingParams(max_tokens=64, **GREEDY))
    check_outputs(outputs, [prompt], 64, oracles[arch], arch)
    llm.engine.check_all_free()


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_with_preemption(arch, model_dirs, oracles):
    rng = random.Random(2)
    lengths = [1, 300, 17, 64, 129, 250, 3, 90, 200, 33, 16, 160, 280, 48, 111, 7]
    prompts = [random_prompt(rng, n) for n in lengths]
    # 560 tokens of pool for 16 prompts of 1..300 tokens plus 24 new each: preemption is forced.
    llm = make_llm(model_dirs[arch], max_total_tokens=560, max_num_batched_tokens=256)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    assert llm.engine.stats().num_preemptions > 0
    check_outputs(outputs, prompts, 24, oracles[arch], arch)
    llm.engine.check_all_free()


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill(arch, model_dirs, oracles):
    rng = random.Random(3)
    prompts = [random_prompt(rng, n) for n in (150, 97, 5)]
    llm = make_llm(model_dirs[arch], max_num_batched_tokens=32)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, **GREEDY))
    check_outputs(outputs, prompts, 16, oracles[arch], arch)
    llm.engine.check_all_free()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_are_exact(arch, model_dirs, oracles):
    rng = random.Random(4)
    shared = random_prompt(rng, 120)
    prompts = [shared + random_prompt(rng, n) for n in (5, 40, 1, 77)]
    llm = make_llm(model_dirs[arch])
    first = llm.generate(prompts[:1], SamplingParams(max_tokens=12, **GREEDY))
    rest = llm.generate(prompts[1:], SamplingParams(max_tokens=12, **GREEDY))
    assert first[0].num_cached_tokens == 0
    assert all(output.num_cached_tokens >= 112 for output in rest), [o.num_cached_tokens for o in rest]
    assert llm.engine.stats().prefix_cache_hit_tokens >= 3 * 112
    check_outputs(first + rest, prompts, 12, oracles[arch], arch)
    llm.engine.check_all_free()


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("arch", ARCHS)
def test_page_sizes(arch, page_size, model_dirs, oracles):
    rng = random.Random(5)
    prompts = [random_prompt(rng, n) for n in (70, 1, 130)]
    llm = make_llm(model_dirs[arch], page_size=page_size, max_num_batched_tokens=96)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, **GREEDY))
    check_outputs(outputs, prompts, 20, oracles[arch], f"{arch} page {page_size}")
    llm.engine.check_all_free()


def test_prompt_logprobs_match_oracle(model_dirs, oracles):
    rng = random.Random(6)
    prompt = random_prompt(rng, 45)
    llm = make_llm(model_dirs["llama"], max_num_batched_tokens=16)
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=5, **GREEDY))
    oracle_logprobs = oracles["llama"].prompt_logprobs(prompt)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position]
        assert prompt[position] in entry
        assert_position(entry, oracle_logprobs[position - 1], 5, f"prompt position {position}")
    llm.engine.check_all_free()


def test_n_greedy_sequences_share_prompt_pages(model_dirs, oracles):
    rng = random.Random(7)
    prompt = random_prompt(rng, 40)
    llm = make_llm(model_dirs["qwen3"], enable_prefix_caching=False)
    (output,) = llm.generate([prompt], SamplingParams(n=3, max_tokens=10, **GREEDY))
    reference = oracles["qwen3"].greedy(prompt, 10)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    for choice in output.outputs:
        assert_matches(choice, reference, context=f"choice {choice.index}")
    llm.engine.check_all_free()
