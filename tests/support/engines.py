"""An engine on a tiny model, its prompts and its comparison with the oracle: what every
model-path test does the same way."""
from __future__ import annotations

import random
from typing import Sequence

from tandem import LLM
from tests.support.oracle import assert_matches

# Greedy with the top five logprobs, never stopping early: what the oracle comparison reads.
GREEDY = dict(temperature=0.0, logprobs=5, ignore_eos=True)

# A pool and budgets roomy for the tests' few prompts of up to ~300 tokens; the DSA indexer
# unquantised, so DeepSeek-V3.2 and GLM-5 compare exactly (other families ignore it).
ENGINE_DEFAULTS = dict(page_size=16, max_total_tokens=4096, max_num_batched_tokens=512, max_num_seqs=64,
                       indexer_cache_dtype="float32")


def make_llm(model_dir: str, **options) -> LLM:
    """An offline engine on ``model_dir``: ``ENGINE_DEFAULTS`` with ``options`` over them. A file
    whose scenarios share other defaults binds them once: ``functools.partial(make_llm, ...)``."""
    return LLM(model=model_dir, **{**ENGINE_DEFAULTS, **options})


def random_prompt(rng: random.Random, length: int, vocab: int = 500) -> list[int]:
    """``length`` token ids drawn from ``[3, vocab)`` (clear of the special tokens)."""
    return [rng.randrange(3, vocab) for _ in range(length)]


def prompts_for(seed: int, lengths: Sequence[int], shared: int = 0, vocab: int = 500) -> list[list[int]]:
    """One prompt per length, each after the same ``shared``-token prefix (prefix hits)."""
    rng = random.Random(seed)
    prefix = random_prompt(rng, shared, vocab)
    return [prefix + random_prompt(rng, length, vocab) for length in lengths]


def check_outputs(outputs, prompts, max_tokens: int | Sequence[int], oracle, context: str = "") -> None:
    """Each output's first completion against ``oracle``'s greedy continuation of its prompt:
    tokens equal, top logprobs within tolerance. ``max_tokens``: one for all, or one per prompt."""
    assert len(outputs) == len(prompts), f"{context}: {len(outputs)} outputs for {len(prompts)} prompts"
    lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    for number, (output, prompt, length) in enumerate(zip(outputs, prompts, lengths)):
        assert_matches(output.outputs[0], oracle.greedy(prompt, length), context=f"{context} prompt {number}")
