"""Invariant I1, shared by every family's test: run one request, then check that the host
gather/scatter mover and the sanitizer's poison touch exactly the registry's buffers, and that
a gather/scatter round trip into fresh pages restores every buffer exactly."""
from __future__ import annotations

import torch

from tandem import SamplingParams
from tandem.protocol import EngineRequest
from tandem.kv.movers import HostMover


def check_movers_touch_registry(engine, prompt_length: int = 37, after_step=None,
                                require_nonzero: bool = False) -> None:
    registry_keys = {d.key for d in engine.registry.buffers()}
    engine.add_request(EngineRequest(request_id="r", prompt_token_ids=list(range(3, 3 + prompt_length)),
                                     sampling_params=SamplingParams(temperature=0, max_tokens=4)))
    engine.step()
    state = engine.scheduler.running[0].state
    if after_step is not None:
        after_step(state)
    mover = HostMover(engine.registry)
    copy = mover.gather(state.page_tables)
    assert mover.touched == registry_keys
    fresh = engine.coordinator.new_state("restore#0")
    engine.coordinator.allocate(fresh, prompt_length)
    assert [len(t) for t in fresh.page_tables] == [len(t) for t in state.page_tables]
    mover.scatter(copy, fresh.page_tables)
    for descriptor in engine.registry.buffers():
        group = descriptor.group_id
        original = descriptor.tensor[state.page_tables[group]]
        restored = descriptor.tensor[fresh.page_tables[group]]
        # Bytes, not values: unwritten slots of a page hold the poison (NaN) on both sides.
        assert torch.equal(original.view(torch.uint8), restored.view(torch.uint8)), descriptor.key
        assert not require_nonzero or original.any(), descriptor.key
    engine.coordinator.free(fresh)
    engine.abort_requests(["r"])
    assert engine.coordinator.sanitizer.touched == registry_keys  # the poison mover
    engine.check_all_free()
