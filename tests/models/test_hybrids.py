"""Recurrent-state hybrids (Qwen3-Next: gated DeltaNet; NemotronH: Mamba-2) against
transformers (fp32, CPU), and their recurrent slots as a state group: isolation under heavy
slot reuse, prefix-cache checkpoints, forks, preemption, movers (I1), books and planning (I5)."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tests.support.state_checks import HOST_TIER, check_movers_touch_registry
from tandem import LLM, SamplingParams
from tandem.protocol import EngineRequest
from tandem.kv.planner import bytes_per_page, plan_pools
from tandem.layers import recurrent
from tests.support.engines import GREEDY, check_outputs, make_llm, random_prompt
from tests.support.oracle import assert_matches

pytestmark = pytest.mark.usefixtures("single_torch_thread")

HYBRIDS = ("qwen3_next", "nemotron_h")
MAX_TOKENS = 16


# One prompt set for the oracle scenarios, so the (slow) transformers references are shared.
_rng = random.Random(11)
PROMPTS = {length: random_prompt(_rng, length) for length in (1, 5, 17, 70, 97, 130, 150, 200)}
SHARED = random_prompt(_rng, 120)
PREFIX_PROMPTS = [SHARED + random_prompt(_rng, n) for n in (5, 40, 1, 77)]


def recurrent_pools(engine):
    return [(group, pool) for group, pool in zip(engine.registry.groups, engine.coordinator.pools)
            if group.spec.manager_kind == "recurrent"]


# -- transformers oracle scenarios ----------------------------------------------------------------
@pytest.mark.parametrize("arch", HYBRIDS)
def test_mixed_batch_with_forced_preemption(arch, model_dirs, oracles):
    prompts = [PROMPTS[n] for n in (1, 200, 17, 70, 130, 150, 5, 97)]
    # 256 tokens of KV pool for 8 prompts of 1..200 tokens plus 16 new each: preemption (by
    # recompute, so the recurrent state is rebuilt from the prompt) is forced.
    llm = make_llm(model_dirs[arch], max_total_tokens=256, max_num_batched_tokens=256)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY), use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    check_outputs(outputs, prompts, MAX_TOKENS, oracles[arch], arch)
    llm.engine.check_all_free()


@pytest.mark.parametrize("arch", HYBRIDS)
def test_chunked_prefill_carries_state_across_chunks(arch, model_dirs, oracles):
    prompts = [PROMPTS[n] for n in (150, 97, 5)]
    llm = make_llm(model_dirs[arch], max_num_batched_tokens=32)  # budget far below the prompts
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY), use_tqdm=False)
    check_outputs(outputs, prompts, MAX_TOKENS, oracles[arch], arch)
    llm.engine.check_all_free()


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_page_sizes(arch, page_size, model_dirs, oracles):
    prompts = [PROMPTS[n] for n in (70, 1, 130)]
    llm = make_llm(model_dirs[arch], page_size=page_size, max_num_batched_tokens=96)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY), use_tqdm=False)
    check_outputs(outputs, prompts, MAX_TOKENS, oracles[arch], f"{arch} page {page_size}")
    llm.engine.check_all_free()


# (page size, token budget, expected hit): the first prompt (125 tokens) in one chunk or in
# chunks of 32 leaves a checkpoint at 112; in chunks of 48 with pages of 64, at 64 ([48, 96)).
@pytest.mark.parametrize("page_size,budget,expected_hit", [(16, 512, 112), (16, 32, 112), (64, 48, 64)])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_prefix_hits_restore_checkpoints_exactly(arch, page_size, budget, expected_hit, model_dirs, oracles):
    """The first request leaves a state checkpoint at the last page boundary each of its chunks
    crosses; the others hit at the deepest one inside the shared 120 tokens."""
    llm = make_llm(model_dirs[arch], page_size=page_size, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    first = llm.generate(PREFIX_PROMPTS[:1], params, use_tqdm=False)
    rest = llm.generate(PREFIX_PROMPTS[1:], params, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [expected_hit] * 3
    check_outputs(first + rest, PREFIX_PROMPTS, MAX_TOKENS, oracles[arch], f"{arch} page {page_size} budget {budget}")
    llm.engine.check_all_free()


@pytest.mark.parametrize("arch", HYBRIDS)
def test_checkpoints_yield_to_sequences(arch, model_dirs, oracles):
    """More checkpoints than the pool holds: the least recently used are dropped from their
    nodes (which keep their KV pages), sequences never wait for them, and hits stay exact."""
    rng = random.Random(31)
    prompts = [random_prompt(rng, 10) for _ in range(10)]
    llm = make_llm(model_dirs[arch], page_size=4, max_num_seqs=2)
    engine = llm.engine
    ((group, pool),) = recurrent_pools(engine)
    assert pool.num_usable == 6
    params = SamplingParams(max_tokens=3, **GREEDY)
    first = llm.generate(prompts, params, use_tqdm=False)
    nodes = engine.coordinator.prefix_cache.all_nodes()
    with_checkpoint = [node for node in nodes if node.pages[group.group_id] != 0]
    assert len(nodes) >= 2 * len(prompts) and 0 < len(with_checkpoint) <= pool.num_usable
    again = llm.generate(prompts[-2:], params, use_tqdm=False)  # the most recent kept theirs
    assert [output.num_cached_tokens for output in again] == [8, 8]
    for output, prompt in zip(first + again, prompts + prompts[-2:]):
        assert_matches(output.outputs[0], oracles[arch].greedy(prompt, 3), context=arch)
    engine.check_all_free()


@pytest.mark.parametrize("arch", HYBRIDS)
def test_forks_copy_the_slot(arch, model_dirs, oracles):
    prompt = PROMPTS[70]
    llm = make_llm(model_dirs[arch], enable_prefix_caching=False)
    (output,) = llm.generate([prompt], SamplingParams(n=3, max_tokens=MAX_TOKENS, **GREEDY), use_tqdm=False)
    reference = oracles[arch].greedy(prompt, MAX_TOKENS)
    assert [choice.index for choice in output.outputs] == [0, 1, 2]
    for choice in output.outputs:
        assert_matches(choice, reference, context=f"{arch} choice {choice.index}")
    llm.engine.check_all_free()


# -- isolation under slot reuse ---------------------------------------------------------------------
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_requests_never_see_each_others_state(arch, prefix_caching, model_dirs, oracles):
    """200 short requests (20 distinct prompts, 10 copies each, shuffled) through 4 sequence
    seats, so each slot serves ~50 requests: every request must reproduce transformers on its
    own prompt, whoever used its slot before. With prefix caching (page size 4) the copies also
    restore each other's checkpoints."""
    rng = random.Random(21)
    distinct = [random_prompt(rng, rng.randrange(2, 13)) for _ in range(20)]
    requests = distinct * 10
    rng.shuffle(requests)
    llm = make_llm(model_dirs[arch], page_size=4, max_num_seqs=4, max_num_batched_tokens=48,
                   enable_prefix_caching=prefix_caching)
    engine = llm.engine
    ((_, pool),) = recurrent_pools(engine)
    assert pool.num_usable == 4 * (3 if prefix_caching else 1)
    allocated = Counter()
    allocate = pool.allocate

    def counting_allocate(count, owner):
        pages = allocate(count, owner)
        allocated.update(pages)
        return pages

    pool.allocate = counting_allocate
    outputs = llm.generate(requests, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert sum(allocated.values()) >= len(requests) and len(allocated) <= pool.num_usable
    for prompt, output in zip(requests, outputs):
        assert_matches(output.outputs[0], oracles[arch].greedy(prompt, 2), context=f"{arch} {prompt}")
    if prefix_caching:
        assert engine.stats().prefix_cache_hit_tokens > 0
    engine.check_all_free()
    # Every slot was used and freed: in sanitizer mode each one now holds poison (I6).
    for descriptor in engine.registry.buffers():
        if descriptor.group_id == pool.group_id:
            assert torch.isnan(descriptor.tensor[1:]).all(), descriptor.key


# -- movers (I1), books and planning (I5) -------------------------------------------------------------
@pytest.mark.parametrize("arch", HYBRIDS)
def test_movers_touch_exactly_the_registry_buffers(arch, model_dirs):
    llm = LLM(model=model_dirs[arch], page_size=8, max_total_tokens=512, enable_prefix_caching=False, **HOST_TIER)
    engine = llm.engine
    kinds = Counter(d.kind for d in engine.registry.buffers())
    assert kinds["conv"] == kinds["ssm"] == 2 and kinds["key"] == kinds["value"] >= 1
    check_movers_touch_registry(engine)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_recurrent_slots_in_books_and_budget(arch, model_dirs):
    llm = LLM(model=model_dirs[arch], page_size=16, max_total_tokens=1024, max_num_seqs=3,
              enable_prefix_caching=False)
    engine = llm.engine
    ((group, pool),) = recurrent_pools(engine)
    assert pool.num_usable == 3  # one slot per sequence seat, not per token page
    for index in range(5):
        engine.add_request(EngineRequest(request_id=f"r{index}", prompt_token_ids=list(range(3, 30 + index)),
                                         sampling_params=SamplingParams(temperature=0, max_tokens=3)))
    engine.step()  # books are checked after every step (I5)
    running = len(engine.scheduler.running)
    assert running == 3 and pool.census() == {"free": 0, "used": 3, "cached": 0, "inflight": 0}
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_all_free()

    # The planner takes the slots off the memory budget before sizing the token pages.
    registry = engine.registry
    slot_bytes = len(group.layer_names) * group.spec.page_bytes(16)
    token_page_bytes = bytes_per_page(registry, 16)
    budget = 100 * token_page_bytes + 13 * slot_bytes
    plan = plan_pools(registry, 16, max_total_tokens=None, memory_budget_bytes=budget, max_num_seqs=4,
                      prefix_caching=True)
    assert plan.sequence_pool_bytes == 13 * slot_bytes and plan.pages_of(group.group_id) == 13
    assert plan.num_pages == 100 and plan.total_bytes == budget
    with pytest.raises(ValueError, match="max_num_seqs"):
        plan_pools(registry, 16, max_total_tokens=None, memory_budget_bytes=12 * slot_bytes, max_num_seqs=4,
                   prefix_caching=True)
    # An engine on a budget: the same split.
    budget_llm = LLM(model=model_dirs[arch], page_size=16, kv_cache_memory_bytes=budget, max_num_seqs=4)
    budget_pools = dict((g.group_id, p.num_pages) for g, p in zip(budget_llm.engine.registry.groups,
                                                                   budget_llm.engine.coordinator.pools))
    assert budget_pools[group.group_id] == 13
    assert all(pages == 100 for group_id, pages in budget_pools.items() if group_id != group.group_id)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_dummy_weights(arch, model_dirs):
    llm = LLM(model=model_dirs[arch], load_format="dummy", page_size=16, max_total_tokens=512)
    (output,) = llm.generate([PROMPTS[17]], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4
    assert all(torch.isfinite(torch.tensor(lp.logprob)) for entry in output.outputs[0].logprobs
               for lp in entry.values())
    llm.engine.check_all_free()


# -- reference kernels: chunked scans agree with single steps ---------------------------------------
def test_gated_delta_rule_scan_matches_steps():
    torch.manual_seed(0)
    length, heads_k, heads_v, dim_k, dim_v = 37, 2, 4, 8, 6
    query, key = torch.randn(length, heads_k, dim_k), torch.randn(length, heads_k, dim_k)
    value = torch.randn(length, heads_v, dim_v)
    decay, beta = -torch.rand(length, heads_v), torch.rand(length, heads_v)
    initial = torch.randn(heads_v, dim_k, dim_v)
    output, final = recurrent.chunk_gated_delta_rule(query, key, value, decay, beta, initial, chunk_size=8)
    state, rows = initial[None], []
    for t in range(length):
        row, state = recurrent.gated_delta_rule_step(query[t:t + 1], key[t:t + 1], value[t:t + 1],
                                                     decay[t:t + 1], beta[t:t + 1], state)
        rows.append(row[0])
    torch.testing.assert_close(output, torch.stack(rows), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, state[0], atol=1e-5, rtol=1e-5)
    # Split at any point (a checkpoint boundary): the same outputs and state.
    first, middle = recurrent.chunk_gated_delta_rule(query[:13], key[:13], value[:13], decay[:13], beta[:13], initial)
    second, end = recurrent.chunk_gated_delta_rule(query[13:], key[13:], value[13:], decay[13:], beta[13:], middle)
    torch.testing.assert_close(torch.cat([first, second]), output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=1e-5)


def test_mamba2_scan_matches_steps():
    torch.manual_seed(0)
    length, heads, head_dim, groups, state_size = 29, 4, 5, 2, 3
    hidden = torch.randn(length, heads, head_dim)
    dt = torch.randn(length, heads)
    A, D, dt_bias = -torch.rand(heads) - 0.5, torch.randn(heads), torch.randn(heads)
    B, C = torch.randn(length, groups, state_size), torch.randn(length, groups, state_size)
    initial = torch.randn(heads, head_dim, state_size)
    no_limit = (0.0, float("inf"))
    output, final = recurrent.mamba2_chunk_scan(hidden, dt, A, B, C, D, dt_bias, initial, 8, no_limit)
    state, rows = initial[None], []
    for t in range(length):
        row, state = recurrent.mamba2_step(hidden[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, dt_bias, state)
        rows.append(row[0])
    torch.testing.assert_close(output, torch.stack(rows), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, state[0], atol=1e-5, rtol=1e-5)


def test_causal_conv_scan_matches_steps():
    torch.manual_seed(0)
    channels, kernel, length = 6, 4, 9
    weight, bias = torch.randn(channels, kernel), torch.randn(channels)
    inputs, state = torch.randn(length, channels), torch.randn(channels, kernel - 1)
    output, history = recurrent.causal_conv1d_scan(inputs, state, weight, bias)
    states, rows = state[None], []
    for t in range(length):
        row, states = recurrent.causal_conv1d_step(inputs[t:t + 1], states, weight, bias)
        rows.append(row[0])
        torch.testing.assert_close(states[0], history[:, t + 1:t + kernel])
    torch.testing.assert_close(output, torch.stack(rows), atol=1e-5, rtol=1e-5)
