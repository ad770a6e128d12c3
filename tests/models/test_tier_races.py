"""Races between tier copies and the forward pass, held open with the copy-delay test hook.

- I3: a layer whose host→device load is delayed is read only after the load lands; with the
  wait removed, the read sees poisoned pages and the sanitizer fails the step.
- I2: a page under a delayed device→host copy is not reused until the copy completes, and the
  copy reads the page's contents from before anyone else could write it.
- I1: the tier mover touches exactly the registry's buffers, per family.
"""
from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams
from tandem.kv.accessor import PendingLoads
from tandem.kv.block_pool import SanitizerError
from tandem.kv.planner import NULL_PAGE
from tests.models.test_tiers import FAMILIES, make_llm
from tests.support.engines import GREEDY, check_outputs, prompts_for

DELAY = 0.05


def cached_then_flushed(llm, prompt, max_tokens=4):
    """Run ``prompt`` once, wait for its host copies, drop the device copies."""
    first = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY))
    llm.engine.tiers.drain()
    llm.engine.reset_prefix_cache()
    return first


def test_delayed_load_is_waited_for_layer_by_layer(model_dirs, oracles):
    prompts = prompts_for(21, (5, 9), shared=80)
    llm = make_llm(model_dirs["llama"])
    tiers = llm.engine.tiers
    first = cached_then_flushed(llm, prompts[0])
    waited: list[str] = []
    original_wait = PendingLoads.wait

    def recording_wait(self, layer_name):
        if self._waits.get(layer_name):
            waited.append(layer_name)
        original_wait(self, layer_name)

    tiers.local.stream.delay_s = DELAY
    PendingLoads.wait = recording_wait
    try:
        second = llm.generate(prompts[1:], SamplingParams(max_tokens=4, **GREEDY))
    finally:
        PendingLoads.wait = original_wait
        tiers.local.stream.delay_s = 0.0
    assert tiers.stats.host_hit_tokens >= 80 - 16
    assert waited == llm.engine.registry.layer_names()  # each layer waited once, in order
    check_outputs(first + second, prompts, 4, oracles["llama"], "delayed load")
    llm.engine.check_all_free()


def test_read_without_the_wait_is_caught(model_dirs):
    prompts = prompts_for(22, (5, 9), shared=80)
    llm = make_llm(model_dirs["llama"])
    tiers = llm.engine.tiers
    cached_then_flushed(llm, prompts[0])
    tiers.local.stream.delay_s = 0.5
    original_wait = PendingLoads.wait
    PendingLoads.wait = lambda self, layer_name: self._waits.pop(layer_name, None)  # the wait removed
    try:
        with pytest.raises(SanitizerError, match="poison"):
            llm.generate(prompts[1:], SamplingParams(max_tokens=2, **GREEDY))
    finally:
        PendingLoads.wait = original_wait
        tiers.local.stream.delay_s = 0.0
        tiers.drain()


def test_page_under_a_delayed_save_is_not_reused(model_dirs, oracles):
    prompts = prompts_for(23, (64, 250))
    # 288 tokens of pool: the second prompt needs every page the first one's cache holds.
    llm = make_llm(model_dirs["llama"], max_total_tokens=288)
    engine = llm.engine
    tiers = engine.tiers
    tiers.local.stream.delay_s = 0.3
    first = llm.generate(prompts[:1], SamplingParams(max_tokens=1, **GREEDY))
    # The write-through save of the first prompt's pages is still in flight: its pages are held.
    saved = [node for node in engine.coordinator.prefix_cache.all_nodes() if node.host_pages is not None]
    assert saved and tiers.copies_in_flight == 1
    pool = engine.coordinator.pools[0]
    device_pages = [node.pages[0] for node in saved]
    before = {page: engine.registry.layer_buffers("model.layers.0.self_attn")["key"][page].clone()
              for page in device_pages}
    assert all(any(owner.startswith("inflight:") for owner in pool.holders(page)) for page in device_pages)
    engine.reset_prefix_cache()  # the cache lets go; the copy still holds the pages
    assert all(pool.holders(page) and page not in pool._free for page in device_pages)
    # A request that needs the whole pool cannot have them while the copy runs: it waits for it.
    second = llm.generate(prompts[1:], SamplingParams(max_tokens=1, **GREEDY))
    assert engine.stats().prefix_cache_hit_tokens == 0
    host = tiers.local.host
    layout = host.layouts[0]
    segment = layout.layer_segments("model.layers.0.self_attn")[0]
    for node, page in zip(saved, device_pages):
        copied = host.arrays[0][node.host_pages[0], segment.offset:segment.offset + segment.width]
        assert torch.equal(copied, before[page].view(torch.uint8).flatten())
    check_outputs(first + second, prompts, 1, oracles["llama"], "delayed save")
    engine.check_all_free()


@pytest.mark.parametrize("arch", FAMILIES)
def test_tier_mover_touches_exactly_the_registry(arch, model_dirs):
    llm = make_llm(model_dirs[arch])
    engine = llm.engine
    prompt = prompts_for(24, (70,))[0]
    cached_then_flushed(llm, prompt, max_tokens=2)
    llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))  # a host hit: loads
    registry_keys = {descriptor.key for descriptor in engine.registry.buffers()}
    assert engine.tiers.local.mover.touched == registry_keys
    engine.check_all_free()


def test_swapped_state_round_trip_restores_every_buffer(model_dirs):
    """A swap out and in moves every page of every group into fresh pages, byte for byte."""
    llm = make_llm(model_dirs["qwen3_next"])
    engine = llm.engine
    from tandem.protocol import EngineRequest

    engine.add_request(EngineRequest(request_id="r", prompt_token_ids=prompts_for(25, (40,))[0],
                                     sampling_params=SamplingParams(max_tokens=4, **GREEDY)))
    engine.step()
    sequence = engine.scheduler.running[0]
    state = sequence.state
    before = {d.key: d.tensor[[p for p in state.page_tables[d.group_id] if p != NULL_PAGE]].clone()
              for d in engine.registry.buffers()}
    tiers = engine.tiers
    assert tiers.swap_out(state, sequence.num_computed_tokens)
    engine.coordinator.free(state, keep_swapped=True)
    assert tiers.swap_in(state)
    tiers.commit_swap_in(state)
    tiers.drain()
    for descriptor in engine.registry.buffers():
        pages = [p for p in state.page_tables[descriptor.group_id] if p != NULL_PAGE]
        assert torch.equal(descriptor.tensor[pages].view(torch.uint8), before[descriptor.key].view(torch.uint8))
    engine.abort_requests(["r"])
    engine.check_all_free()
