"""Page-major device state pools (``kv_cache_layout="page-major"``): a page of every buffer of a
state group is one block of one allocation, each buffer a strided view of it.

Units: the views alias the group's pool at aligned offsets; a PD write plan moves one block run
per group (checked by carrying it out byte for byte). Families against ``transformers``: dense
(llama), sliding window (gemma3), MLA + DSA indexer (deepseek_v32), recurrent hybrid
(qwen3_next), with chunked prefill, prefix hits and preemption. PD with page-major on both
sides (NIXL on CPU memory, NCCL over gloo) decodes as ``transformers`` does, with one write
descriptor per run of pages and group; a pair whose layouts differ fails its handshake naming
``kv_cache_layout``. (Tiers, swap, FP8 pages and the sanitizer's poison with page-major are
parametrized in their own test files.)
"""
from __future__ import annotations

import ctypes
import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.kv.planner import PAGE_MAJOR_ALIGNMENT, allocate_buffers, plan_pools
from tandem.kv.registry import StateRegistry
from tandem.kv.spec import FullAttentionSpec, RecurrentSpec
from tandem.transfer.descriptors import WritePlanner, buffer_addresses, buffer_regions, coalesce, plan_page_writes
from tests.support.oracle import assert_matches
from tests.support.pd import GREEDY, PDPair

PAGE_MAJOR = dict(kv_cache_layout="page-major")
EXACT_OPTIONS = {"deepseek_v32": dict(indexer_cache_dtype="float32")}


def two_group_registry(layout: str, page_size: int = 4) -> StateRegistry:
    """Two attention layers (one token-paged group) and a recurrent layer (a per-sequence group)."""
    registry = StateRegistry()
    attention = FullAttentionSpec(num_kv_heads=2, head_dim=6, dtype=torch.float32)  # 48-byte rows: unaligned pages
    for layer in ("a", "b"):
        registry.register(layer, attention)
    registry.register("r", RecurrentSpec(conv_shape=(3, 5), ssm_shape=(2, 3), conv_dtype=torch.float32,
                                         ssm_dtype=torch.bfloat16))
    registry.finalize()
    plan = plan_pools(registry, page_size, max_total_tokens=8 * page_size, memory_budget_bytes=None, max_num_seqs=2,
                      layout=layout)
    allocate_buffers(registry, plan, torch.device("cpu"), layout)
    return registry


def test_buffers_are_aligned_views_of_one_pool_per_group():
    layer_major, page_major = two_group_registry("layer-major"), two_group_registry("page-major")
    assert len(page_major.allocations()) == len(page_major.groups) == 2
    assert [r.length for r in buffer_regions(page_major)] == [t.numel() for t in page_major.allocations()]
    for mine, theirs in zip(page_major.buffers(), layer_major.buffers(), strict=True):
        assert (mine.key, mine.tensor.shape, mine.tensor.dtype) == (theirs.key, theirs.tensor.shape, theirs.tensor.dtype)
        assert theirs.page_stride == theirs.page_bytes and theirs.pool is None
        pool = page_major.group_pool(mine.group_id).tensor
        assert mine.pool is pool and mine.offset % PAGE_MAJOR_ALIGNMENT == 0
        assert mine.page_stride == pool.shape[1] and pool.shape[1] % PAGE_MAJOR_ALIGNMENT == 0
        for page in (0, 1, mine.tensor.shape[0] - 1):  # page p at data_ptr + p * page_stride
            assert mine.tensor[page].data_ptr() == mine.tensor.data_ptr() + page * mine.page_stride \
                == pool.data_ptr() + page * pool.shape[1] + mine.offset
    # writing one buffer's page changes exactly its column range of that row of the pool
    descriptor = next(page_major.buffers(0))
    pool = descriptor.pool
    before = pool.clone()
    descriptor.tensor[2].fill_(1.5)
    changed = (pool != before).nonzero()
    assert set(changed[:, 0].tolist()) == {2}
    assert descriptor.offset <= changed[:, 1].min() and changed[:, 1].max() < descriptor.offset + descriptor.page_bytes


@pytest.mark.parametrize("page_size, layout, copies", [(4, "layer-major", [4, 2]), (4, "page-major", [4, 2]),
                                                        (16, "page-major", [1, 2])])
def test_tier_copies_join_buffers_that_continue_on_both_sides(page_size, layout, copies):
    """A host block is the buffers' pages back to back; a page-major device block matches it
    where no page needs alignment padding (16 tokens x 48 bytes), so the group moves in one copy."""
    from tandem.kv.tiers.host_pool import layouts_of

    registry = two_group_registry(layout, page_size)
    assert [len(group.spans()) for group in layouts_of(registry)] == copies
    for group in layouts_of(registry):
        for span in group.spans():
            assert span.device_rows().shape[1] == span.width
            assert span.device_rows().data_ptr() == span.segments[0].descriptor.tensor.data_ptr()


@pytest.mark.parametrize("layout", ["layer-major", "page-major"])
def test_write_plan_carried_out_byte_for_byte_moves_every_buffer(layout):
    """One descriptor per run of pages and buffer (layer-major) or group (page-major); doing
    the plan's copies into a second registry of the same layout moves exactly the paired pages."""
    source, destination = two_group_registry(layout), two_group_registry(layout)
    generator = torch.Generator().manual_seed(0)
    for allocation in source.allocations():
        allocation.view(torch.uint8).copy_(torch.randint(0, 256, allocation.view(torch.uint8).shape,
                                                         generator=generator, dtype=torch.uint8))
    pairs = [[(1, 3), (2, 4), (3, 5), (6, 1)], [(2, 1)]]
    plan = plan_page_writes(source, buffer_addresses(destination), pairs)
    runs = [len(coalesce(group_pairs)) for group_pairs in pairs]
    buffers = [len(list(source.buffers(group))) for group in range(2)]
    expected = sum(runs) if layout == "page-major" else sum(r * b for r, b in zip(runs, buffers))
    assert len(plan.descriptors) == expected
    assert plan.touched == {d.key for d in source.buffers()}
    for source_address, destination_address, length in plan.descriptors:
        ctypes.memmove(destination_address, source_address, length)
    for mine, theirs in zip(source.buffers(), destination.buffers()):
        for from_page, to_page in pairs[mine.group_id]:
            assert torch.equal(mine.tensor[from_page].view(torch.uint8), theirs.tensor[to_page].view(torch.uint8))
        untouched = [p for p in range(theirs.tensor.shape[0]) if p not in {d for _, d in pairs[mine.group_id]}]
        assert not theirs.tensor[untouched].view(torch.uint8).any(), mine.key


def test_layout_option_resolves_and_bad_values_name_the_field(model_dirs):
    from tandem.entrypoints.cli import build_parser, engine_config
    from tandem.transfer.config import TransferConfig

    assert EngineConfig(model="m").resolved_kv_cache_layout == "layer-major"
    assert EngineConfig(model="m", transfer=TransferConfig(role="decode")).resolved_kv_cache_layout == "page-major"
    assert EngineConfig(model="m", kv_cache_layout="layer-major",
                        transfer=TransferConfig(role="prefill")).resolved_kv_cache_layout == "layer-major"
    arguments = build_parser().parse_args(["serve", "--kv-cache-layout", "page-major"])
    assert engine_config(arguments, "/m").kv_cache_layout == "page-major"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-layout", "row-major"])
    with pytest.raises(ValueError, match="kv_cache_layout: must be one of"):
        LLM(model=model_dirs["llama"], kv_cache_layout="row-major")


# -- every kind of state, against transformers ---------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma3", "deepseek_v32", "qwen3_next"])
def test_families_match_transformers(arch, model_dirs, oracles):
    """Chunked prefill (16-token budget), a prefix hit, and preemption (a pool too small for the
    batch), every buffer a strided view of its group's pool."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (45, 9, 30, 26)]
    prompts.insert(1, prompts[0][:40] + [5, 6])  # a prefix hit on the first prompt's pages
    llm = LLM(model=model_dirs[arch], page_size=4, max_total_tokens=96, max_num_batched_tokens=16, max_num_seqs=4,
              **PAGE_MAJOR, **EXACT_OPTIONS.get(arch, {}))
    registry = llm.engine.registry
    assert registry.kv_cache_layout == "page-major" and len(registry.allocations()) == len(registry.groups)
    assert any(not descriptor.tensor.is_contiguous() for descriptor in registry.buffers())
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True)
    outputs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
    assert llm.engine.stats().num_preemptions > 0
    assert outputs[1].num_cached_tokens >= 32
    for number, (output, prompt) in enumerate(zip(outputs, prompts)):
        assert_matches(output.outputs[0], oracles[arch].greedy(prompt, 6), context=f"{arch} prompt {number}")
    llm.engine.check_all_free()


# -- PD --------------------------------------------------------------------------------------------------

SMALL = dict(page_size=4, max_total_tokens=512, max_num_seqs=4, max_num_batched_tokens=16)
LONG_PROMPT = [(7 * i + 3) % 500 + 5 for i in range(21)]


@pytest.mark.parametrize("backend, arch, layout", [("nixl", "gemma3", "auto"), ("nccl", "llama", "auto"),
                                                   ("nixl", "llama", "layer-major")])
def test_pd_writes_one_descriptor_per_run_and_group(backend, arch, layout, model_dirs, oracles, monkeypatch):
    """``auto`` is page-major on PD servers: one write descriptor per run of pages and group;
    layer-major (both servers) still pairs, one descriptor per run and buffer."""
    plans = []  # (plan, its page pairs per group), as the prefill side's per-peer planner made them
    plan_pages = WritePlanner.plan

    def recording_plan(planner, pairs_per_group):
        plan = plan_pages(planner, pairs_per_group)
        plans.append((plan, pairs_per_group))
        return plan

    monkeypatch.setattr(WritePlanner, "plan", recording_plan)
    pair = PDPair(model_dirs[arch], transfer=dict(backend=backend), kv_cache_layout=layout, **SMALL)
    try:
        expected_layout = "page-major" if layout == "auto" else layout
        for engine in (pair.prefill, pair.decode):
            assert engine.registry.kv_cache_layout == engine.pd.layout.kv_cache_layout == expected_layout
        prompts = {"long": LONG_PROMPT, "short": [11, 12, 13]}
        for request_id, prompt in prompts.items():
            pair.submit(request_id, prompt)
        pair.run_until(lambda: all(pair.finished(r) for r in prompts))
        for request_id, prompt in prompts.items():
            pair.assert_matches(request_id, oracles[arch].greedy(prompt, GREEDY.max_tokens))
        # page-major: (runs) where layer-major takes (runs x buffers of the group), 4+ buffers here
        registry = pair.prefill.registry
        spans = {group: 1 if expected_layout == "page-major" else len(list(registry.buffers(group)))
                 for group in range(len(registry.groups))}
        expected = [sum(len(coalesce(pairs)) * spans[group] for group, pairs in enumerate(pairs_per_group))
                    for _, pairs_per_group in plans]
        assert sum(expected) >= 2
        assert [len(plan.descriptors) for plan, _ in plans] == expected
        assert pair.prefill.pd.touched == {d.key for d in pair.prefill.registry.buffers()}  # I1
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


def test_pd_servers_of_different_layouts_never_pair(model_dirs):
    pair = PDPair(model_dirs["llama"], prefill_options=dict(kv_cache_layout="layer-major"), **SMALL)
    try:
        pair.submit("r", [11, 12, 13])
        pair.run_until(lambda: pair.finished("r"))
        assert "kv_cache_layout: the prefill server has 'layer-major', the decode server has 'page-major'" \
            in pair.error("r"), pair.error("r")
        pair.prefill.abort_requests(["r"])
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()
