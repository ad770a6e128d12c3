"""Invariant I1, shared by every family's test: run one request, then check that the movers
production runs touch exactly the registry's buffers on every rank — each rank's tier page mover
(a preemption by swap: the request's state to host pages, its device pages freed and poisoned,
then loaded back into fresh pages) and its sanitizer's poison, as the rank's page executor
applied them (asked of every rank by ``collective_rpc("moved_buffers")``) — and that the round
trip restores every buffer exactly. The engine needs a host tier (``host_cache_size``)."""
from __future__ import annotations

import torch

from tandem import SamplingParams
from tandem.kv.planner import NULL_PAGE
from tandem.protocol import EngineRequest

HOST_TIER = dict(host_cache_size=0.01)  # what an engine under this check is built with


def _live_pages(table: list[int]) -> list[int]:
    return [page for page in table if page != NULL_PAGE]


def check_movers_touch_registry(engine, prompt_length: int = 37, after_step=None,
                                require_nonzero: bool = False) -> None:
    tiers = engine.tiers
    assert tiers is not None, "I1 runs the host tier's mover: build the engine with host_cache_size"
    registry_keys = {d.key for d in engine.registry.buffers()}
    engine.add_request(EngineRequest(request_id="r", prompt_token_ids=list(range(3, 3 + prompt_length)),
                                     sampling_params=SamplingParams(temperature=0, max_tokens=4)))
    engine.step()
    tiers.drain()
    sequence = engine.scheduler.running[0]
    state = sequence.state
    if after_step is not None:
        after_step(state)
    null_entries = [[page == NULL_PAGE for page in table] for table in state.page_tables]
    # Bytes, not values: unwritten slots of a page hold the poison (NaN) on both sides.
    before = {d.key: d.tensor[_live_pages(state.page_tables[d.group_id])].view(torch.uint8).clone()
              for d in engine.registry.buffers()}
    engine.executor.collective_rpc("moved_buffers")  # every rank's records start here
    assert tiers.swap_out(state, sequence.num_computed_tokens)
    engine.coordinator.free(state, keep_swapped=True)  # the device pages go (poisoned)
    assert tiers.swap_in(state)
    tiers.drain()
    tiers.commit_swap_in(state)
    assert [[page == NULL_PAGE for page in table] for table in state.page_tables] == null_entries
    for descriptor in engine.registry.buffers():
        restored = descriptor.tensor[_live_pages(state.page_tables[descriptor.group_id])].view(torch.uint8)
        assert torch.equal(before[descriptor.key], restored), descriptor.key
        assert not require_nonzero or before[descriptor.key].any(), descriptor.key
    engine.abort_requests(["r"])
    answers = engine.executor.collective_rpc("moved_buffers")  # (each rank applies what it was sent first)
    assert len(answers) == engine.config.tensor_parallel_size
    for rank, moved in enumerate(answers):
        assert {tuple(key) for key in moved["registry"]} == registry_keys, rank
        assert {tuple(key) for key in moved["tiers"]} == registry_keys, rank  # the tier page mover
        assert {tuple(key) for key in moved["poison"]} == registry_keys, rank  # the poison mover
    engine.check_all_free()
