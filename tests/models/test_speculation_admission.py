"""Admission reserves every page a speculative step may need: a seeded fuzz over speculation
(a draft model, an MTP layer) × a recurrent hybrid and an MLA + sparse-indexer family × TP=2
(gloo) × pools small enough to force preemption, with the host tier holding cached pages in
flight. No ``OutOfPagesError`` escapes a step (a set-aside slot is reserved with a sequence's
pages, so a sequence that cannot get one waits or is preempted), the outputs equal
transformers' (greedy tokens and top-5 logprobs), the books balance after every step (the
sanitizer) and every page is free at the end.

The recurrent case is the shape that failed on two GPUs (``need [0, 0, 1, 0] pages, free
[6, 22, 0, 22]`` from ``StateCoordinator.set_aside`` in the middle of a step): a draft whose
recurrent state sets aside a slot to run its chain on, cached checkpoints the host tier was
still copying, and every seat of the recurrent pool taken.
"""
from __future__ import annotations

import random

import pytest

from tandem import LLM, SamplingParams
from tests.support.oracle import assert_matches

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# Recurrent: every seat of the recurrent pool taken (8 sequences) while the host tier copies
# cached checkpoints (prompts over several pages, then the same prompts again as host hits),
# then prompts long enough that the token pool (50 pages of 16) runs short: preemption.
RECURRENT = dict(page_size=16, max_total_tokens=800, max_num_batched_tokens=128, max_num_seqs=8)
# MLA + indexer (DeepSeek-V3.2, its MTP layer): a pool of 10 pages of 8 tokens, 4 seats.
MLA = dict(page_size=8, max_total_tokens=80, max_num_batched_tokens=24, max_num_seqs=4,
           speculative_method="mtp", indexer_cache_dtype="float32")
COMMON = dict(num_speculative_tokens=3, host_cache_size=0.01, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def recurrent_draft(tmp_path_factory, tokenizer_dir):
    """A qwen3_next of other weights: its drafts are mostly rejected (rollbacks restore the
    target's recurrent slots) and its chain runs on set-aside copies of its own slots."""
    from tandem.tools.make_model import make_model
    from tests.support.models import ARCH_OPTIONS

    return str(make_model("qwen3_next", tmp_path_factory.mktemp("recurrent_draft"), seed=7,
                          tokenizer_dir=tokenizer_dir, **ARCH_OPTIONS["qwen3_next"]))


def workload(seed: int, num_prompts: int, longest: int, most_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs, about half the prompts sharing a prefix (prefix hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(rng.randrange(9, 30))]
    prompts = []
    for _ in range(num_prompts):
        own = [rng.randrange(3, 500) for _ in range(rng.randrange(1, longest))]
        prompts.append(shared + own if rng.random() < 0.5 else own)
    return [(prompt, rng.randrange(3, most_tokens)) for prompt in prompts]


def recurrent_workloads():
    """(workload, flush the prefix cache after it): full seats, their host hits, preemption."""
    full_seats = workload(2, 8, 200, 10)
    return [(full_seats, True), (full_seats, False), (workload(1, 8, 200, 60), False)]


def mla_workloads():
    return [(workload(seed, 5, 30, 10), False) for seed in (0, 1, 2)]


@pytest.mark.parametrize("arch,method", [("qwen3_next", "draft"), ("deepseek_v32", "mtp")])
def test_speculation_under_page_pressure_never_runs_out_midstep(arch, method, model_dirs, oracles, recurrent_draft):
    if method == "mtp":
        options, workloads = MLA, mla_workloads()
    else:
        options, workloads = dict(RECURRENT, speculative_model=recurrent_draft), recurrent_workloads()
    llm = LLM(model=model_dirs[arch], **options, **COMMON)
    runs = []
    try:
        engine = llm.engine
        assert engine.coordinator.sanitizer.enabled
        for pairs, flush in workloads:
            params = [SamplingParams(temperature=0.0, logprobs=5, ignore_eos=True, max_tokens=length)
                      for _, length in pairs]
            runs.append((pairs, llm.generate([prompt for prompt, _ in pairs], params, use_tqdm=False)))
            if flush:  # the next run hits the host tier
                engine.tiers.drain()
                engine.reset_prefix_cache()
        stats = engine.speculator.stats()
        preemptions = engine.scheduler.num_preemptions
        host_hits = engine.stats().tiers.host_hit_tokens
        engine.check_all_free()
    finally:
        llm.engine.shutdown()
    assert stats.num_draft_tokens > 0, stats
    assert preemptions > 0, "the pool was never short: the fuzz exercised no preemption"
    assert method == "mtp" or host_hits > 0, "no host-tier hit"
    for run, (pairs, outputs) in enumerate(runs):
        for number, ((prompt, length), output) in enumerate(zip(pairs, outputs)):
            context = f"{arch} {method} run {run} prompt {number}"
            assert output.outputs[0].finish_reason == "length", (context, output.outputs[0].finish_reason)
            assert_matches(output.outputs[0], oracles[arch].greedy(prompt, length), context=context)
