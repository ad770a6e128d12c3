"""Invariant I1 for the dense family: the buffers every mover touches equal the registry's,
and a host gather/scatter round trip restores a request's state exactly."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.protocol import EngineRequest
from tandem.kv.movers import HostMover
from tests.conftest import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_movers_touch_exactly_the_registry_buffers(arch, model_dirs):
    llm = LLM(model=model_dirs[arch], page_size=8, max_total_tokens=512)
    engine = llm.engine
    registry_keys = {d.key for d in engine.registry.buffers()}
    assert len(registry_keys) == 2 * engine.hf_config.num_hidden_layers  # key and value per layer
    engine.add_request(EngineRequest(request_id="r", prompt_token_ids=list(range(3, 40)),
                                     sampling_params=SamplingParams(temperature=0, max_tokens=4)))
    engine.step()
    state = engine.scheduler.running[0].state
    mover = HostMover(engine.registry)
    copy = mover.gather(state.page_tables)
    assert mover.touched == registry_keys
    # Round trip into fresh pages: equal contents, every buffer.
    fresh = engine.coordinator.new_state("restore#0")
    engine.coordinator.allocate(fresh, 37)
    mover.scatter(copy, fresh.page_tables)
    for descriptor in engine.registry.buffers():
        group = descriptor.group_id
        original = descriptor.tensor[state.page_tables[group]]
        restored = descriptor.tensor[fresh.page_tables[group]]
        assert torch.equal(original, restored), descriptor.key
    engine.coordinator.free(fresh)
    engine.abort_requests(["r"])
    assert engine.coordinator.sanitizer.touched == registry_keys  # the poison mover
    engine.check_all_free()
