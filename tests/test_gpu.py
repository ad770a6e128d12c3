"""GPU checks (``pytest -m gpu`` on a CUDA machine): the same oracle comparison on CUDA."""
from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.oracle import Reference, assert_matches

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_float32_matches_oracle(arch, model_dirs, oracles, monkeypatch):
    import tests.oracle as oracle_module

    monkeypatch.setattr(oracle_module, "LOGPROB_TOLERANCE", 1e-3)  # GPU reduction order differs
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 70, 200, 33, 150, 9)]
    llm = LLM(model=model_dirs[arch], device="cuda", dtype="float32", page_size=16,
              max_total_tokens=400, max_num_batched_tokens=128)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True))
    assert llm.engine.stats().num_preemptions > 0
    for output, prompt in zip(outputs, prompts):
        reference: Reference = oracles[arch].greedy(prompt, 16)
        assert_matches(output.outputs[0], reference, context=arch)
    llm.engine.check_all_free()


def test_cuda_bfloat16_runs(model_dirs):
    llm = LLM(model=model_dirs["llama"], device="cuda", dtype="bfloat16", max_total_tokens=1024)
    (output,) = llm.generate([list(range(3, 50))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 8
    llm.engine.check_all_free()
