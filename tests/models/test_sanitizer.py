"""Sanitizer tests that fail on purpose: a leaked page, a read of a freed page and a double
free are each caught (docs/design.md I2, I5, I6)."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.protocol import EngineRequest
from tandem.kv.block_pool import BlockPool, SanitizerError
from tandem.kv.sanitizer import Sanitizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture()
def llm(model_dirs):
    return LLM(model=model_dirs["llama"], page_size=4, max_total_tokens=256, max_num_batched_tokens=64)


def test_sanitizer_is_on_in_tests(llm):
    assert llm.engine.coordinator.sanitizer.enabled


def test_leaked_page_is_caught_by_books_and_idle_check(llm):
    llm.generate([[5, 6, 7, 8, 9]], GREEDY)
    pool = llm.engine.coordinator.pools[0]
    pool.allocate(1, "nobody#0")  # a reference no sequence, cache or operation accounts for
    with pytest.raises(SanitizerError, match="books unbalanced"):
        llm.engine.step()
    with pytest.raises(SanitizerError, match="leak"):
        llm.engine.check_all_free()


def running_sequence_and_a_freed_page(engine):
    """Start one request and free a page someone else held: the makings of a stale read."""
    engine.add_request(EngineRequest(request_id="victim", prompt_token_ids=list(range(3, 12)),
                                     sampling_params=GREEDY.clone(max_tokens=8)))
    engine.step()
    pool = engine.coordinator.pools[0]
    freed_page = pool.allocate(1, "other#0")[0]
    pool.release([freed_page], "other#0")
    return engine.scheduler.running[0], freed_page


def test_read_of_a_freed_page_is_caught_by_owner_tags(llm):
    engine = llm.engine
    sequence, freed_page = running_sequence_and_a_freed_page(engine)
    sequence.state.page_tables[0][0] = freed_page  # a stale page-table entry
    with pytest.raises(SanitizerError, match="does not hold"):
        engine.step()


@pytest.mark.parametrize("kv_cache_dtype, layout", [("auto", "layer-major"), ("fp8", "layer-major"),
                                                    ("auto", "page-major"), ("fp8", "page-major")])
def test_read_of_poisoned_state_fails_loudly_without_owner_tags(model_dirs, monkeypatch, kv_cache_dtype, layout):
    """Even past the owner-tag check, a freed page holds NaN poison that reaches the logits (FP8
    pages too: their poison byte is e4m3's NaN; page-major: every buffer's slice of the page's
    block, and nothing of a live page)."""
    engine = LLM(model=model_dirs["llama"], page_size=4, max_total_tokens=256, max_num_batched_tokens=64,
                 kv_cache_dtype=kv_cache_dtype, kv_cache_layout=layout).engine
    sequence, freed_page = running_sequence_and_a_freed_page(engine)
    for descriptor in engine.registry.buffers(0):
        assert torch.isnan(descriptor.tensor[freed_page].float()).all(), "freed page not poisoned"
        assert not torch.isnan(descriptor.tensor[sequence.state.page_tables[0][0]].float()).all()
    monkeypatch.setattr(Sanitizer, "check_owner", lambda *args: None)
    sequence.state.page_tables[0][0] = freed_page
    with pytest.raises(SanitizerError, match="non-finite logits"):
        engine.step()


def test_double_free_is_caught():
    pool = BlockPool(group_id=0, num_pages=8)
    pages = pool.allocate(2, "req#0")
    pool.release(pages, "req#0")
    with pytest.raises(SanitizerError, match="double free"):
        pool.release(pages[:1], "req#0")


def test_release_by_a_non_owner_is_caught():
    pool = BlockPool(group_id=0, num_pages=8)
    pages = pool.allocate(1, "req#0")
    with pytest.raises(SanitizerError, match="double free"):
        pool.release(pages, "req#1")


def test_books_balance_after_every_step_of_a_busy_run(llm):
    """Run many overlapping requests with preemption; check_books runs after every step."""
    engine = llm.engine
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(12)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert engine.stats().num_preemptions > 0
    engine.check_all_free()
