"""Speculative decoding for every family against ``transformers`` (fp32, CPU): greedy tokens and
top-5 logprobs equal with a draft identical to the target (every draft accepted: its state —
KV, MLA latents, indexer keys, recurrent slots — is right through chunked prefill, prefix hits
and preemption) and with a random draft (almost every draft rejected: rollback, recurrent
restores included, is exact). MTP drafts propose the same tokens under all of that as in a
plain run. Sampled outputs follow the target's distribution (chi-square)."""
from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.conftest import ARCH_OPTIONS
from tests.oracle import assert_matches
from tests.spec_helpers import differing_proposals, record_proposals

ALL_ARCHS = tuple(ARCH_OPTIONS)
MTP_ARCHS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
EXACT_INDEXER = dict(indexer_cache_dtype="float32")  # DSA: comparable with transformers bit for bit
GREEDY = SamplingParams(temperature=0.0, logprobs=5, ignore_eos=True, max_tokens=12)

_rng = random.Random(12)
_SHARED = [_rng.randrange(3, 500) for _ in range(40)]
# The first call computes the first three prompts (the shared prefix among them); the second
# call's prompt hits the prefix cache.
PROMPTS = ([[_rng.randrange(3, 500) for _ in range(n)] for n in (5, 70)] + [_SHARED + [7, 8, 9]],
           [_SHARED + [_rng.randrange(3, 500) for _ in range(11)]])
# Pages of 8, a token budget of 24 (chunked prefill) and a pool of 120 tokens (preemption).
STRESS = dict(page_size=8, max_num_batched_tokens=24, max_total_tokens=120, max_num_seqs=8)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, tokenizer_dir):
    """A tiny random llama sharing the test models' tokenizer: its guesses are almost never right."""
    from tandem.tools.make_model import make_model

    return str(make_model("llama", tmp_path_factory.mktemp("random_draft"), seed=5, hidden_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=1, intermediate_size=64, tokenizer_dir=tokenizer_dir))


def options_for(arch: str, **speculation) -> dict:
    return {**STRESS, **(EXACT_INDEXER if arch in ("deepseek_v32", "glm_moe_dsa") else {}), **speculation}


def run_workload(model_dir: str, record: bool = False, **options):
    """The workload's outputs, and what the draft proposed where (``record``)."""
    llm = LLM(model=model_dir, **options)
    proposals = record_proposals(llm.engine) if record else None
    outputs = []
    for prompts in PROMPTS:
        outputs += llm.generate(prompts, GREEDY, use_tqdm=False)
    return llm, outputs, proposals


def check_against_oracle(llm, outputs, oracle, context: str) -> None:
    prompts = [prompt for batch in PROMPTS for prompt in batch]
    for number, (output, prompt) in enumerate(zip(outputs, prompts)):
        assert_matches(output.outputs[0], oracle.greedy(prompt, GREEDY.max_tokens), context=f"{context} {number}")
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and outputs[-1].num_cached_tokens > 0, context
    llm.engine.check_all_free()


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_identical_draft_is_exact_and_accepted(arch, model_dirs, oracles):
    llm, outputs, _ = run_workload(model_dirs[arch], **options_for(arch, speculative_model=model_dirs[arch],
                                                                num_speculative_tokens=3))
    check_against_oracle(llm, outputs, oracles[arch], f"{arch} identical draft")
    speculation = llm.engine.stats().speculation
    assert speculation.num_drafts > 10
    # A draft whose state were wrong anywhere (after a prefix hit, a preemption, a rollback)
    # would guess differently from the target it copies.
    assert speculation.num_accepted_tokens >= speculation.num_draft_tokens - 1, speculation


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_random_draft_is_exact(arch, model_dirs, oracles, random_draft):
    mtp = arch in MTP_ARCHS
    speculation = dict(speculative_method="mtp", num_speculative_tokens=2) if mtp else \
        dict(speculative_model=random_draft, num_speculative_tokens=3)
    llm, outputs, proposals = run_workload(model_dirs[arch], record=mtp, **options_for(arch, **speculation))
    check_against_oracle(llm, outputs, oracles[arch], f"{arch} random draft")
    stats = llm.engine.stats().speculation
    assert stats.num_drafts > 10 and stats.num_accepted_tokens <= 0.2 * stats.num_draft_tokens, stats
    if mtp:
        # The MTP layer's proposals equal those of a plain run (one chunk per prompt, no prefix
        # cache, no preemption): its state came through all of that intact.
        plain = {**options_for(arch, **speculation), "max_total_tokens": 2048, "max_num_batched_tokens": 512,
                 "enable_prefix_caching": False}
        reference, _, expected = run_workload(model_dirs[arch], record=True, **plain)
        assert reference.engine.stats().num_preemptions == 0
        common = set(proposals) & set(expected)
        assert len(common) >= 0.8 * len(expected), (len(common), len(expected))
        differing = differing_proposals(proposals, expected)
        assert not differing, differing[:5]
