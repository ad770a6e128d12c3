"""A seeded fuzz over speculation × state family × TP=2 × pools small enough to force preemption.

Each draw picks an engine (page size, a pool a few pages over the longest request, the number of
seats, draft tokens per step, preemption by swap or by recompute, an identical or an unrelated
draft) and a workload (prompts with and without a shared prefix, their lengths, max_tokens).
For each draw the TP=2 engine (gloo, one worker process) and the TP=1 engine run the workload:

- no error escapes a step (``OutOfPagesError`` included: admission reserves every page a step
  may need, so a sequence that cannot get them waits or is preempted);
- the outputs are exact: TP=2's greedy tokens and top-5 logprobs equal transformers' and TP=1's;
- the books balance after every step (the sanitizer is on) and every page is free at the end.

Over a family's draws the pool must have run short (preemption), or the fuzz exercised nothing.
The families: a recurrent hybrid (qwen3_next) with a draft model, and MLA (deepseek_v3) with a
draft model and with its MTP layer (deepseek_v32's MTP: ``test_speculation_admission.py``).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from tandem import LLM, SamplingParams
from tests.support.oracle import assert_matches

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SEEDS = (0, 1)
TOP_LOGPROBS = 5
LOGPROB_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Draw:
    """One engine and one workload."""
    options: dict
    requests: list  # (prompt, max_tokens)


def draw(seed: int, arch: str, method: str, drafts: dict) -> Draw:
    rng = random.Random(f"{arch}/{method}/{seed}")
    page_size = rng.choice((8, 16))
    shared = [rng.randrange(3, 500) for _ in range(rng.randrange(page_size, 3 * page_size))]
    requests = []
    for _ in range(rng.randrange(4, 7)):
        own = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 3 * page_size))]
        requests.append((shared + own if rng.random() < 0.5 else own, rng.randrange(3, 14)))
    speculative_tokens = rng.randrange(1, 4)
    longest = max(len(prompt) + length for prompt, length in requests) + speculative_tokens + 1
    pages = -(-longest // page_size) + rng.randrange(1, 4)  # a few pages over the longest request
    options = dict(page_size=page_size, max_total_tokens=pages * page_size,
                   max_num_batched_tokens=rng.choice((2, 3)) * page_size, max_num_seqs=rng.randrange(2, 7),
                   num_speculative_tokens=speculative_tokens, host_cache_size=0.01,
                   preemption_mode=rng.choice(("swap", "recompute")))
    if arch == "deepseek_v32":
        options["indexer_cache_dtype"] = "float32"
    if method == "mtp":
        options["speculative_method"] = "mtp"
    else:  # identical (drafts accepted: pages run ahead) or unrelated (rejected: rollbacks)
        options["speculative_model"] = drafts[rng.choice(("identical", "unrelated"))]
    return Draw(options, requests)


def run(model_dir: str, options: dict, requests: list, tensor_parallel_size: int):
    """(outputs, preemptions, swaps out) of one engine over the workload; every page free after."""
    llm = LLM(model=model_dir, tensor_parallel_size=tensor_parallel_size, **options)
    try:
        engine = llm.engine
        assert engine.coordinator.sanitizer.enabled
        params = [SamplingParams(temperature=0.0, logprobs=TOP_LOGPROBS, ignore_eos=True, max_tokens=length)
                  for _, length in requests]
        outputs = llm.generate([prompt for prompt, _ in requests], params, use_tqdm=False)
        stats = engine.stats()
        engine.check_all_free()
    finally:
        llm.engine.shutdown()
    return outputs, stats.num_preemptions, stats.tiers.swaps["out"]


def assert_equal_runs(outputs, single_outputs, context: str) -> None:
    for number, (output, single) in enumerate(zip(outputs, single_outputs)):
        sequence, single_sequence = output.outputs[0], single.outputs[0]
        where = f"{context} prompt {number}"
        assert list(sequence.token_ids) == list(single_sequence.token_ids), f"{where}: TP=1 differs"
        for entry, single_entry in zip(sequence.logprobs, single_sequence.logprobs):
            assert entry.keys() == single_entry.keys(), where
            for token, logprob in entry.items():
                assert abs(logprob.logprob - single_entry[token].logprob) <= LOGPROB_TOLERANCE, where


@pytest.fixture(scope="module")
def unrelated_drafts(tmp_path_factory, tokenizer_dir):
    """arch -> a model of the same family and other weights: its drafts are mostly rejected."""
    from tandem.tools.make_model import make_model
    from tests.support.models import ARCH_OPTIONS

    built = {}

    def unrelated(arch: str) -> str:
        if arch not in built:
            built[arch] = str(make_model(arch, tmp_path_factory.mktemp(f"unrelated_{arch}"), seed=7,
                                         tokenizer_dir=tokenizer_dir, **ARCH_OPTIONS[arch]))
        return built[arch]
    return unrelated


@pytest.mark.parametrize("arch,method", [("qwen3_next", "draft"), ("deepseek_v3", "draft"), ("deepseek_v3", "mtp")])
def test_speculation_tp2_under_page_pressure(arch, method, model_dirs, oracles, unrelated_drafts):
    drafts = {} if method == "mtp" else {"identical": model_dirs[arch], "unrelated": unrelated_drafts(arch)}
    preempted = False
    for seed in SEEDS:
        case = draw(seed, arch, method, drafts)
        context = f"{arch} {method} seed {seed} {case.options}"
        outputs, preemptions, swaps = run(model_dirs[arch], case.options, case.requests, 2)
        single_outputs, _, _ = run(model_dirs[arch], case.options, case.requests, 1)
        preempted |= preemptions > 0
        # every preemption of a swapping engine swaps (its draft's state with the target's)
        assert swaps == (preemptions if case.options["preemption_mode"] == "swap" else 0), (context, swaps)
        for number, ((prompt, length), output) in enumerate(zip(case.requests, outputs)):
            assert output.outputs[0].finish_reason == "length", (context, number)
            assert_matches(output.outputs[0], oracles[arch].greedy(prompt, length), top_k=TOP_LOGPROBS,
                           context=f"{context} prompt {number}")
        assert_equal_runs(outputs, single_outputs, context)
    assert preempted, f"{arch} {method}: the pool was never short: the fuzz exercised no preemption"
