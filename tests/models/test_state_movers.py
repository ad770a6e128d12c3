"""Invariant I1 for the dense family: the buffers every mover touches equal the registry's,
and a swap to the host tier and back restores a request's state exactly."""
from __future__ import annotations

import pytest

from tests.support.state_checks import HOST_TIER, check_movers_touch_registry
from tandem import LLM
from tests.support.models import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_movers_touch_exactly_the_registry_buffers(arch, model_dirs):
    llm = LLM(model=model_dirs[arch], page_size=8, max_total_tokens=512, **HOST_TIER)
    engine = llm.engine
    registry_keys = {d.key for d in engine.registry.buffers()}
    assert len(registry_keys) == 2 * engine.hf_config.num_hidden_layers  # key and value per layer
    check_movers_touch_registry(engine)
