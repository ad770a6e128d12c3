"""Gemma 3 (interleaved sliding-window and global layers) against transformers (fp32, CPU), and
the sliding-window state rules: pages wholly before the window are released while a request
decodes, a prefix hit takes only the last window's pages, and every mover still touches
exactly the registry's buffers (I1).

The test model (``make_model("gemma3")``) has layers local, global, local with a window of 24
tokens; every scenario uses prompts or generations longer than the window, so windowing is live.
"""
from __future__ import annotations

import functools
import pathlib
import random
import re

import pytest
import torch

from tests.support.state_checks import HOST_TIER, check_movers_touch_registry
from tandem import SamplingParams
from tandem.kv.planner import NULL_PAGE
from tests.support.engines import GREEDY, check_outputs, make_llm, random_prompt
from tests.support.oracle import assert_matches

ARCH = "gemma3"
WINDOW = 24
# A small pool keeps the sanitizer's per-step book check (O(pages)) cheap.
make_llm = functools.partial(make_llm, max_total_tokens=1024)


def group_of_kind(engine, manager_kind: str) -> int:
    (group,) = [g.group_id for g in engine.registry.groups if g.spec.manager_kind == manager_kind]
    return group


def pages_held(engine, group: int) -> int:
    pool = engine.coordinator.pools[group]
    return pool.num_usable - pool.num_free


def record_pages_after_each_step(engine) -> list[tuple[int, int]]:
    """Wrap ``engine.step`` to record (sliding, full) pages held after every step."""
    sliding, full = group_of_kind(engine, "sliding_window"), group_of_kind(engine, "full_attention")
    samples: list[tuple[int, int]] = []
    step = engine.step

    def recording_step():
        deltas = step()
        samples.append((pages_held(engine, sliding), pages_held(engine, full)))
        return deltas

    engine.step = recording_step
    return samples


def test_model_has_both_layer_kinds(model_dirs):
    engine = make_llm(model_dirs[ARCH], max_total_tokens=256).engine
    kinds = {group.spec.manager_kind: len(group.layer_names) for group in engine.registry.groups}
    assert kinds == {"sliding_window": 2, "full_attention": 1}
    sliding = engine.registry.groups[group_of_kind(engine, "sliding_window")].spec
    assert sliding.window == WINDOW == engine.hf_config.sliding_window
    rope = engine.hf_config.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]


def test_mixed_batch_with_preemption(model_dirs, oracles):
    rng = random.Random(2)
    lengths = [1, 300, 17, 64, 129, 250, 3, 90, 200, 33, 16, 160, 280, 48, 111, 7]
    prompts = [random_prompt(rng, n) for n in lengths]
    # 560 tokens of pool per group for 16 prompts of 1..300 tokens plus 24 new each.
    llm = make_llm(model_dirs[ARCH], max_total_tokens=560, max_num_batched_tokens=256)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    assert llm.engine.stats().num_preemptions > 0
    check_outputs(outputs, prompts, 24, oracles[ARCH], "mixed batch")
    llm.engine.check_all_free()


@pytest.mark.parametrize("budget", [20, 48])  # chunks shorter and longer than the window
def test_chunked_prefill(budget, model_dirs, oracles):
    rng = random.Random(3)
    prompts = [random_prompt(rng, n) for n in (150, 97, 5)]
    llm = make_llm(model_dirs[ARCH], max_num_batched_tokens=budget)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, **GREEDY))
    check_outputs(outputs, prompts, 16, oracles[ARCH], f"chunk budget {budget}")
    llm.engine.check_all_free()


def test_prefix_cache_hits_are_exact(model_dirs, oracles):
    rng = random.Random(4)
    shared = random_prompt(rng, 120)
    prompts = [shared + random_prompt(rng, n) for n in (5, 40, 1, 77)]
    llm = make_llm(model_dirs[ARCH], max_total_tokens=2048)
    first = llm.generate(prompts[:1], SamplingParams(max_tokens=12, **GREEDY))
    rest = llm.generate(prompts[1:], SamplingParams(max_tokens=12, **GREEDY))
    assert first[0].num_cached_tokens == 0
    assert all(output.num_cached_tokens >= 112 for output in rest), [o.num_cached_tokens for o in rest]
    check_outputs(first + rest, prompts, 12, oracles[ARCH], "prefix hit")
    llm.engine.check_all_free()


def test_prefix_hit_takes_only_the_last_window_of_sliding_pages(model_dirs):
    llm = make_llm(model_dirs[ARCH], page_size=8)
    engine, coordinator = llm.engine, llm.engine.coordinator
    prompt = random_prompt(random.Random(8), 100)
    llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))
    sliding, full = group_of_kind(engine, "sliding_window"), group_of_kind(engine, "full_attention")
    state = coordinator.new_state("probe#0")
    hit = coordinator.prefix_hits.match(state, prompt + [7])
    assert hit == 96  # 12 whole pages of 8 (the cache holds the prompt's pages)
    # The next query (position 96) reads keys 73..96: pages 9.. (tokens 72..); pages 0..8 stay null.
    assert state.page_tables[sliding][:9] == [NULL_PAGE] * 9
    assert NULL_PAGE not in state.page_tables[sliding][9:] and len(state.page_tables[sliding]) == 12
    assert NULL_PAGE not in state.page_tables[full] and len(state.page_tables[full]) == 12
    assert coordinator.pools[sliding].holders(state.page_tables[sliding][9])[state.owner] == 1
    coordinator.free(state)
    llm.engine.check_all_free()


def test_sliding_window_hit_rule_on_hand_built_paths():
    """A cache path may lack this group's pages (null entries); a hit of ``k`` pages is usable
    when the pages of the last window before token ``k * page_size`` are all there, and the
    hit's table keeps those pages only (the entries before them null)."""
    from types import SimpleNamespace

    from tandem.kv.managers.sliding_window import SlidingWindowManager

    manager = SlidingWindowManager(SimpleNamespace(spec=SimpleNamespace(window=6)), pool=None, page_size=4)
    N = NULL_PAGE
    # the sketch in sliding_window.py: page 4, window 6; a hit of k pages reads entries k-2, k-1
    assert manager.usable_prefix_pages_on_path([N, N, 7, 9, 4]) == 5
    assert manager.usable_prefix_pages_on_path([N, N, 7, 9, N]) == 4  # 5 needs entry 4
    assert manager.usable_prefix_pages_on_path([N, N, 7, N, 4]) == 0  # every hit needs a null entry
    assert manager.usable_prefix_pages_on_path([5, N, N, N]) == 1
    assert manager.usable_prefix_pages_on_path([N, N, N]) == 0
    assert manager.usable_prefix_pages_on_path([]) == 0
    assert manager.hit_page_table([3, 5, 7, 9, 4]) == [N, N, N, 9, 4]
    assert manager.hit_page_table([3]) == [3]


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_sizes(page_size, model_dirs, oracles):
    rng = random.Random(5)
    prompts = [random_prompt(rng, n) for n in (70, 1, 130)]
    llm = make_llm(model_dirs[ARCH], page_size=page_size, max_num_batched_tokens=96)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, **GREEDY))
    check_outputs(outputs, prompts, 20, oracles[ARCH], f"page {page_size}")
    llm.engine.check_all_free()


def test_n_sequences_fork_past_the_window(model_dirs, oracles):
    """Siblings fork after the prompt, when the parent already dropped its first pages."""
    prompt = random_prompt(random.Random(7), 60)
    llm = make_llm(model_dirs[ARCH], enable_prefix_caching=False)
    (output,) = llm.generate([prompt], SamplingParams(n=3, max_tokens=10, **GREEDY))
    reference = oracles[ARCH].greedy(prompt, 10)
    for choice in output.outputs:
        assert_matches(choice, reference, context=f"choice {choice.index}")
    llm.engine.check_all_free()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_long_generation_holds_a_window_of_sliding_pages(prefix_caching, model_dirs, oracles):
    """Pool counters after every step: the sliding group stays at O(window / page_size) pages
    while the full group grows with the sequence (with prefix caching, the cache keeps its own
    references on completed pages, so there the sequence-held count is what stays bounded)."""
    page_size, prompt_length, max_tokens = 8, 40, 200
    prompt = random_prompt(random.Random(9), prompt_length)
    llm = make_llm(model_dirs[ARCH], page_size=page_size, max_num_batched_tokens=64, max_total_tokens=256,
                   enable_prefix_caching=prefix_caching)
    engine = llm.engine
    samples = record_pages_after_each_step(engine)
    sliding = group_of_kind(engine, "sliding_window")
    bound = engine.coordinator.managers[sliding].max_pages_held()
    assert bound == 4  # ceil(23 / 8) + 1
    used_by_sequences = []
    if prefix_caching:
        step = engine.step

        def census_step():
            deltas = step()
            used_by_sequences.append(engine.coordinator.pools[sliding].census()["used"])
            return deltas

        engine.step = census_step
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY))
    assert_matches(output.outputs[0], oracles[ARCH].greedy(prompt, max_tokens), context="long generation")
    total = prompt_length + max_tokens
    full_pages = [full for _, full in samples]
    if prefix_caching:
        assert max(used_by_sequences[:-1]) <= bound, used_by_sequences
        assert engine.coordinator.pools[sliding].census()["cached"] == (total - 1) // page_size
    else:
        sliding_pages = [held for held, _ in samples[:-1]]  # the last step finished the request
        assert max(sliding_pages) <= bound, sliding_pages
        assert full_pages[-2] == -(-(total - 2) // page_size)  # the full group grew with the sequence
        assert samples[-1] == (0, 0)
    print(f"\n{'cached' if prefix_caching else 'no cache'}: after {total - 1} tokens computed, "
          f"sliding group holds {samples[-2][0]} pages (max {max(s for s, _ in samples)}), "
          f"full group {samples[-2][1]} pages; sequence-held sliding pages max "
          f"{max(used_by_sequences) if used_by_sequences else max(s for s, _ in samples[:-1])}")
    engine.check_all_free()


def test_movers_touch_exactly_the_registry_buffers(model_dirs):
    """I1 with two groups: sanitizer poison and the host tier's swap out and in touch every
    buffer the registry holds, and no other; the round trip is exact (null entries included)."""
    llm = make_llm(model_dirs[ARCH], page_size=8, max_total_tokens=512, **HOST_TIER)
    engine = llm.engine
    registry_keys = {d.key for d in engine.registry.buffers()}
    assert len(registry_keys) == 2 * engine.hf_config.num_hidden_layers
    assert {key[0] for key in registry_keys} == {0, 1}
    sliding = group_of_kind(engine, "sliding_window")

    def windowed(state):  # 57 computed: the next query reads positions 34.., so 4 pages dropped
        assert state.page_tables[sliding][:4] == [NULL_PAGE] * 4
    check_movers_touch_registry(engine, prompt_length=57, after_step=windowed)


def test_dummy_weights_load(model_dirs):
    llm = make_llm(model_dirs[ARCH], max_total_tokens=256, load_format="dummy")
    (output,) = llm.generate([random_prompt(random.Random(10), 40)],
                             SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 4
    norms = [p for name, p in llm.engine.model.named_parameters() if "norm" in name]
    assert norms and all(torch.all(p == 0) for p in norms)  # (1 + w) norms start at identity
    llm.engine.check_all_free()


STATE_KIND_SWITCH = re.compile(
    r"isinstance\([^)]*\b\w*Spec\b|type\([^)]*\)\s*(?:is|==)\s*\w*Spec\b|manager_kind\s*(?:==|!=|in\b)")


def test_no_state_kind_switch_outside_managers_and_registry():
    """Only ``kv/managers/`` and the registry may tell state kinds apart."""
    root = pathlib.Path(__file__).resolve().parents[2] / "tandem"
    allowed = {root / "kv" / "registry.py"}
    offenders = []
    for path in root.rglob("*.py"):
        if path in allowed or (root / "kv" / "managers") in path.parents:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if STATE_KIND_SWITCH.search(line):
                offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_tied_model_with_linear_rope_scaling_on_global_layers(tokenizer_dir, tmp_path):
    """Released Gemma 3 models tie the output head and scale the global layers' rope linearly
    (the local ones not)."""
    import json

    from tandem.tools.make_model import make_model
    from tests.support.oracle import Oracle

    model_dir = make_model(ARCH, tmp_path / "gemma3_tied", seed=2, num_layers=3, tie_word_embeddings=True,
                           tokenizer_dir=tokenizer_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"]["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    (model_dir / "config.json").write_text(json.dumps(config))
    prompt = random_prompt(random.Random(11), 60)
    llm = make_llm(str(model_dir), max_total_tokens=256)
    assert llm.engine.model.lm_head.weight is llm.engine.model.model.embed_tokens.weight
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))
    assert_matches(output.outputs[0], Oracle(str(model_dir)).greedy(prompt, 10), context="tied, linear rope")
    llm.engine.check_all_free()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_oracle_and_bfloat16_runs(model_dirs, oracles, monkeypatch):
    import tests.support.oracle as oracle_module

    monkeypatch.setattr(oracle_module, "LOGPROB_TOLERANCE", 1e-3)  # GPU reduction order differs
    rng = random.Random(8)
    prompts = [random_prompt(rng, n) for n in (1, 70, 200, 33, 150, 9)]
    llm = make_llm(model_dirs[ARCH], device="cuda", dtype="float32", max_total_tokens=288,
                   max_num_batched_tokens=128)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, **GREEDY))
    assert llm.engine.stats().num_preemptions > 0
    check_outputs(outputs, prompts, 16, oracles[ARCH], "cuda float32")
    llm.engine.check_all_free()
    llm = make_llm(model_dirs[ARCH], device="cuda", dtype="bfloat16", max_total_tokens=1024)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert all(len(output.outputs[0].token_ids) == 40 for output in outputs)
    llm.engine.check_all_free()
